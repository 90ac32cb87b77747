"""The verify-ahead staging kernel (`runtime.verify_staging.kernels`) against its torch reference, on the CPU
interpreter, and the staged description against what `AttentionMetadata.prepare` describes for the same rows.

Adversarial geometry: packed float64 results with a row stride wider than three columns, drafts read through a
transposed (strided) view, padding sequences (``P > B``) whose lengths must stay, every accepted count from 1 to
``W``, buffers wider than the batch (columns past it must stay untouched), more rows than one kernel block. Every
output is poisoned first.
"""

from __future__ import annotations

import pytest
import torch

from trtllm_glm.attention.metadata import AttentionMetadata
from trtllm_glm.runtime.verify_staging import VerifyBuffers, stage_verify_ahead, stage_verify_ahead_reference

pytest.importorskip("triton")

pytestmark = pytest.mark.cpu_only


def _case(seed: int, B: int, P: int, W: int, wide: int = 3):
    g = torch.Generator().manual_seed(seed)
    packed = torch.randn(B * W, 5, generator=g, dtype=torch.float64)[:, :3]  # a row stride of 5
    packed[:, 0] = torch.randint(0, 150_000, (B * W,), generator=g).double()
    acc = torch.randint(1, W + 1, (B,), generator=g)
    acc[0] = W
    acc[-1] = 1
    packed.view(B, W, 3)[:, 0, 2] = acc.double()
    drafts = torch.randint(0, 150_000, (W - 1, B), generator=g).t()  # strided
    S, N = P + wide, P * W + 5 * wide
    seq = torch.randint(-9, -2, (5, S + 1), generator=g)
    seq[1, :P] = torch.randint(10, 5_000, (P,), generator=g)  # the lengths the host described
    bufs = {
        "seq": seq,
        "tok": torch.full((3, N), -7, dtype=torch.int64),
        "ids": torch.full((N,), -7, dtype=torch.int64),
        "acc": torch.full((S,), -7, dtype=torch.int64),
    }
    return packed, drafts, acc, bufs


def _run(fn, packed, drafts, bufs, W: int, P: int, **kw) -> dict[str, torch.Tensor]:
    o = {k: v.clone() for k, v in bufs.items()}
    fn(packed, drafts, W, P, VerifyBuffers(o["seq"], o["tok"], o["ids"], o["acc"]), **kw)
    return o


@pytest.mark.parametrize(
    ("B", "P", "W"), [(1, 1, 2), (1, 1, 4), (3, 4, 4), (5, 8, 6), (7, 7, 3), (200, 256, 5), (2, 300, 4)]
)
def test_kernel_matches_reference(B: int, P: int, W: int) -> None:
    packed, drafts, acc, bufs = _case(B * 100 + P * 10 + W, B, P, W)
    want = _run(stage_verify_ahead_reference, packed, drafts, bufs, W, P)
    got = _run(stage_verify_ahead, packed, drafts, bufs, W, P, backend="triton")
    for k in want:
        assert torch.equal(got[k], want[k]), k
    # The reference's meaning, spelled out on a few entries.
    past = bufs["seq"][1, :P].clone()
    assert torch.equal(want["seq"][1, :B], past[:B] + acc)
    assert torch.equal(want["seq"][1, B:P], past[B:])  # padding lengths stay
    assert torch.equal(want["acc"][:P], torch.cat([acc, torch.zeros(P - B, dtype=torch.int64)]))
    assert torch.equal(want["acc"][P:], bufs["acc"][P:])  # past the batch: untouched
    assert torch.equal(want["ids"][P * W :], bufs["ids"][P * W :])
    assert torch.equal(want["ids"][B * W : P * W], bufs["ids"][B * W : P * W])  # padding rows' inputs stay
    rows = packed.view(B, W, 3)
    j = B - 1
    assert want["ids"][j * W] == int(rows[j, acc[j] - 1, 0])
    assert torch.equal(want["ids"][j * W + 1 : (j + 1) * W], drafts[j])
    assert torch.equal(want["tok"][:, P * W :], bufs["tok"][:, P * W :])


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_staged_description_matches_prepare(backend: str) -> None:
    """A batch described at round n's starts (3 sequences of other widths, one padding sequence), then staged from
    round n's packed results: the metadata holds what `prepare` writes for ``W`` verify rows per sequence at
    ``start + accepted``, in the same persistent buffers; ``spec.num_accepted_t`` is what `set_num_accepted` sets."""
    W, P = 4, 4
    packed, drafts, _, _ = _case(9, 3, P, W)
    packed.view(3, W, 3)[:, 0, 2] = torch.tensor([3.0, 3.0, 2.0])  # starts 5, 0, 9 -> 8, 3, 11
    a = AttentionMetadata(max_num_seqs=6, max_num_tokens=32)
    b = AttentionMetadata(max_num_seqs=6, max_num_tokens=32)
    a.prepare([1, 2, 3, 4], past_lens=[5, 0, 9, 4], q_lens=[3, 2, 4, 1], state_slots=[7, 1, 2, 0], num_decode_seqs=0,
              num_padding_seqs=1, valid_q_lens=[2, 2, 3, 0])  # fmt: skip
    ptr = a.row_seq_t.data_ptr()
    past = [8, 3, 11, 4]
    a.set_num_accepted([1, 1, 1, 1])
    a.describe_verify_rows(W, past)
    seq, tok = a.row_buffers
    ids = torch.full((32,), -7, dtype=torch.int64)
    stage_verify_ahead(packed, drafts, W, P, VerifyBuffers(seq, tok, ids, a.accepted_buffer), backend=backend)
    a.accepted_written_on_device()
    b.prepare([1, 2, 3, 4], past_lens=past, q_lens=[W] * 4, state_slots=[7, 1, 2, 0], num_decode_seqs=4,
              num_padding_seqs=1)  # fmt: skip
    b.set_num_accepted([3, 3, 2])
    for name in ("positions_t", "row_seq_t", "row_live_t", "state_slots_t", "past_lens_t", "q_lens_t", "kv_lens_t",
                 "cu_seqlens_t"):  # fmt: skip
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    assert a.row_seq_t.data_ptr() == ptr
    assert a.row_seq_t.tolist()[-W:] == [-1] * W and a.positions_t.tolist()[:W] == [8, 9, 10, 11]
    for name in ("q_lens", "past_lens", "cu_seqlens", "num_decode_seqs", "num_decode_tokens", "num_tokens",
                 "max_kv_len", "valid_q_lens", "num_padding_seqs"):  # fmt: skip
        assert getattr(a, name) == getattr(b, name), name
    assert torch.equal(a.spec.num_accepted_t, b.spec.num_accepted_t) and a.spec.num_accepted_t.tolist() == [3, 3, 2, 0]
    with pytest.raises(ValueError, match="4 host lengths"):
        a.describe_verify_rows(W, past[:3])
    with pytest.raises(ValueError, match="do not fit"):
        a.describe_verify_rows(9, past)


def test_bad_shapes_are_refused() -> None:
    packed, drafts, _, bufs = _case(1, 2, 3, 4)
    with pytest.raises(ValueError, match="drafts must be"):
        _run(stage_verify_ahead_reference, packed, drafts[:, :2], bufs, 4, 3)
    with pytest.raises(ValueError, match="1 <= B <= P"):
        _run(stage_verify_ahead_reference, packed, drafts, bufs, 4, 1)
    with pytest.raises(ValueError, match="packed must be"):
        _run(stage_verify_ahead_reference, packed[:-1], drafts, bufs, 4, 3)
    small = dict(bufs, tok=bufs["tok"][:, :5].contiguous())
    with pytest.raises(ValueError, match="tok must be"):
        _run(stage_verify_ahead, packed, drafts, small, 4, 3, backend="triton")
