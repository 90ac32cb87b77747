"""The draft-ahead staging kernel (`speculative.mtp.staging.kernels`) against its torch reference, on the CPU
interpreter.

Adversarial geometry: packed float64 results read through strided column views (as the executor passes them),
padding sequences (``P > n``), every accepted count from 1 to ``W``, state slots neither the row index nor in
order in a pool larger than the batch (the other slots' draft hidden must stay untouched), hidden widths that are
not a power of two and wider than one block, bf16 and fp32 rows. Every output is poisoned first; the metadata's
row buffers start from a description with real rows, so a row the kernel should leave alone shows if written.
"""

from __future__ import annotations

import pytest
import torch

from trtllm_glm.speculative.mtp.staging import StageBuffers, stage_draft_ahead, stage_draft_ahead_reference

pytest.importorskip("triton")

pytestmark = [
    pytest.mark.cpu_only,
    pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0 to a scalar:DeprecationWarning"),
]


def _case(seed: int, n: int, P: int, W: int, D: int, S: int, dtype: torch.dtype):
    g = torch.Generator().manual_seed(seed)
    packed = torch.randn(n * W, 3, generator=g, dtype=torch.float64)
    packed[:, 0] = torch.randint(0, 50_000, (n * W,), generator=g).double()  # ids
    acc = torch.randint(1, W + 1, (n,), generator=g).double()
    acc[0] = W
    acc[-1] = 1
    packed.view(n, W, 3)[:, 0, 2] = acc  # the accepted count sits in each sequence's first row
    hidden = (torch.randn(n * W, D + 3, generator=g) * 3).to(dtype)[:, 1 : 1 + D]  # a row stride of D + 3
    slots = torch.randperm(S, generator=g)[:n]
    N = P * W
    tok = torch.stack([torch.arange(N), torch.arange(N) // W, torch.ones(N, dtype=torch.int64)])  # a description
    outs = {
        "valid": torch.full((P,), -7, dtype=torch.int64),
        "c_tokens": torch.full((N,), -7, dtype=torch.int64),
        "c_hidden": torch.full((N, D), float("nan"), dtype=dtype),
        "last_rows": torch.full((n,), -7, dtype=torch.int64),
        "draft_hidden": torch.full((S, D), float("nan"), dtype=dtype),
    }
    return packed, hidden, slots, tok, outs


def _run(fn, packed, hidden, slots, tok, outs, W: int, P: int, **kw) -> dict[str, torch.Tensor]:
    o = {k: v.clone() for k, v in outs.items()}
    t = tok.clone()
    n = slots.numel()
    fn(packed[:, 0], hidden, packed.view(n, W, 3)[:, 0, 2], W, P, _buffers(o, t, slots), **kw)
    o["tok"] = t
    return o


def _buffers(o: dict[str, torch.Tensor], tok: torch.Tensor, slots: torch.Tensor | None) -> StageBuffers:
    return StageBuffers(o["valid"], o["c_tokens"], o["c_hidden"], tok[1], tok[2], o["last_rows"],
                        o.get("draft_hidden"), slots)  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("n", "P", "W", "D"), [(1, 1, 4, 128), (3, 4, 4, 200), (5, 8, 2, 1100), (2, 2, 6, 17)])
def test_kernel_matches_reference(n: int, P: int, W: int, D: int, dtype: torch.dtype) -> None:
    case = _case(n * 100 + P * 10 + W, n, P, W, D, S=n + 5, dtype=dtype)
    ref = _run(stage_draft_ahead_reference, *case, W=W, P=P)
    got = _run(stage_draft_ahead, *case, W=W, P=P, backend="triton")
    for k in ref:
        assert torch.equal(ref[k], got[k]) or (
            ref[k].is_floating_point() and torch.equal(ref[k].isnan(), got[k].isnan())
            and torch.equal(ref[k].nan_to_num(), got[k].nan_to_num())
        ), k  # fmt: skip
    packed, hidden, slots, tok, _ = case
    acc = packed.view(n, W, 3)[:, 0, 2].long()
    # What the reference says, spelled out: the padding rows and the untouched slots.
    assert got["valid"].tolist() == acc.tolist() + [0] * (P - n)
    assert got["c_tokens"][: n * W].tolist() == packed[:, 0].long().tolist()
    last = torch.arange(n) * W + acc - 1
    assert torch.equal(got["draft_hidden"][slots], hidden[last])
    others = torch.ones(n + 5, dtype=torch.bool)
    others[slots] = False
    assert got["draft_hidden"][others].isnan().all()
    live = got["tok"][2].view(P, W)
    assert live.sum(dim=1).tolist() == acc.tolist() + [0] * (P - n)
    assert torch.equal(got["tok"][0], tok[0])  # positions are not the kernel's


def test_without_draft_hidden_and_bad_shapes() -> None:
    packed, hidden, slots, tok, outs = _case(7, 2, 2, 3, 40, S=6, dtype=torch.float32)
    acc = packed.view(2, 3, 3)[:, 0, 2]
    outs = {k: v for k, v in outs.items() if k != "draft_hidden"}
    for fn, kw in ((stage_draft_ahead_reference, {}), (stage_draft_ahead, {"backend": "triton"})):
        o = {k: v.clone() for k, v in outs.items()}
        fn(packed[:, 0], hidden, acc, 3, 2, _buffers(o, tok.clone(), None), **kw)
        assert o["valid"].tolist() == acc.long().tolist()
    with pytest.raises(ValueError, match="tokens"):
        stage_draft_ahead(packed[:-1, 0], hidden[:-1], acc, 3, 2, _buffers(outs, tok, None))
    with pytest.raises(ValueError, match="go together"):
        stage_draft_ahead(packed[:, 0], hidden, acc, 3, 2, _buffers(outs, tok, slots))
    with pytest.raises(ValueError, match="n <= P"):
        stage_draft_ahead(packed[:, 0], hidden, acc, 3, 1, _buffers(outs, tok, None))
    with pytest.raises(ValueError, match="last_rows"):
        short = {**outs, "last_rows": outs["valid"][:1]}
        stage_draft_ahead(packed[:, 0], hidden, acc, 3, 2, _buffers(short, tok, None))
