"""The verify-ahead staging kernel (`runtime.verify_staging.kernels`) against its torch reference, on the CPU
interpreter, and the reference against what `AttentionMetadata.set_verify_rows` and `set_num_accepted_t` write.

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


def test_reference_is_set_verify_rows_and_set_num_accepted_t() -> None:
    """The reference writes the metadata's buffers as the metadata's own device-row methods do (the path it replaced
    in `CudaGraphRunner.replay_verify_ahead`)."""
    B, P, W = 3, 4, 4
    packed, drafts, acc, _ = _case(5, B, P, W)
    metas = []
    for _ in range(2):
        m = AttentionMetadata(max_num_seqs=6, max_num_tokens=32)
        m.prepare([10, 11, 12, 13], [40, 7, 300, 12], [1] * P, [5, 0, 2, 1], num_decode_seqs=P)
        metas.append(m)
    a, b = metas
    past = a.past_lens_t.clone()
    past[:B] += acc
    a.set_verify_rows(past, torch.arange(P) < B, W, [44, 11, 304, 12])
    a.set_num_accepted_t(acc)
    ids = torch.full((32,), -7, dtype=torch.int64)
    b.describe_verify_rows(W, [44, 11, 304, 12])
    seq, tok = b.row_buffers
    stage_verify_ahead_reference(packed, drafts, W, P, VerifyBuffers(seq, tok, ids, b.accepted_buffer))
    b.accepted_written_on_device()
    sa, ta = a.row_buffers
    assert torch.equal(sa[1:, : P + 1], seq[1:, : P + 1]) and torch.equal(sa[0], seq[0])  # slots stay
    assert torch.equal(ta[:, : P * W], tok[:, : P * W])
    assert torch.equal(a.accepted_buffer, b.accepted_buffer)
    assert torch.equal(a.spec.num_accepted_t, b.spec.num_accepted_t)
    for f in ("q_lens", "past_lens", "cu_seqlens", "num_tokens", "num_decode_tokens", "max_kv_len"):
        assert getattr(a, f) == getattr(b, f), f


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
