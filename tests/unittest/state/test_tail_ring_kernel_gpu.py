"""The one-launch `DecodeTailRing.prepare_step` kernel on CUDA at production sizes (docs/design.md §6.2).

Needs CUDA (tests/conftest.py skips ``gpu`` tests without it). 128 state slots, 64 sequences, verify widths 4
and 8 (``max_rows`` 8), bf16 keys and gate logits, slots out of order in a pool larger than the batch, stale
duplicate slot ids, out-of-range ids and padding rows; against the torch reference on the same inputs, every
plane and the disagreement counter bit for bit (pure data movement). Then a CUDA-graph capture of the step,
replayed on fresh inputs written into the captured buffers, against the reference run eagerly.
"""

from __future__ import annotations

import pytest
import torch

from trtllm_glm.state.tail_ring import DecodeTailRing

pytestmark = pytest.mark.gpu

S, B, MAX_ROWS, D = 128, 64, 8, 128
_PLANES = ("snapshot", "saved_rows", "saved_pos", "_saved_count", "num_disagreements_t")


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({4: torch.int32, 8: torch.int64}[t.element_size()])


def _assert_same(got: DecodeTailRing, want: DecodeTailRing, ring: torch.Tensor, ring_ref: torch.Tensor, what: str):
    assert torch.equal(_bits(ring), _bits(ring_ref)), f"{what}: ring"
    for name in _PLANES:
        assert torch.equal(_bits(getattr(got, name)), _bits(getattr(want, name))), f"{what}: {name}"


def _state(g: torch.Generator) -> tuple[torch.Tensor, DecodeTailRing]:
    """A random ring and live random backups (no zeros)."""
    ring = torch.randn(S, 2, 4, D, generator=g, device="cuda") * 3 + 0.5
    tr = DecodeTailRing(S, MAX_ROWS, "cuda")
    tr.snapshot.copy_(torch.randn(tr.snapshot.shape, generator=g, device="cuda") - 2)
    tr.saved_rows.copy_(torch.randn(tr.saved_rows.shape, generator=g, device="cuda") + 2)
    tr.saved_pos.copy_(torch.randint(0, 1000, (S,), generator=g, device="cuda"))
    tr.saved_count.copy_(torch.randint(0, MAX_ROWS + 1, (S,), generator=g, device="cuda"))
    return ring, tr


def _clone(tr: DecodeTailRing) -> DecodeTailRing:
    out = DecodeTailRing(S, MAX_ROWS, "cuda")
    for name in _PLANES:
        getattr(out, name).copy_(getattr(tr, name))
    return out


def _step(g: torch.Generator, tr: DecodeTailRing, width: int, index_dtype: torch.dtype):
    """``B`` sequences of ``width`` rows, the last four of them replaced by padding rows; the last four entries of
    ``state_slots`` are a stale duplicate, a free slot and two out-of-range ids (all without rows). First positions
    fall inside and around each slot's backup, so accepted lengths run from clamped-low to clamped-high."""
    slots = torch.randperm(S, generator=g, device="cuda")[:B]
    slots[B - 4] = slots[0]
    slots[B - 2], slots[B - 1] = -1, S + 5
    p0 = tr.saved_pos[slots.clamp(0, S - 1)] + torch.randint(-2, MAX_ROWS + 3, (B,), generator=g, device="cuda")
    p0 = p0.clamp(min=0)
    pos = (p0[:, None] + torch.arange(width, device="cuda")).reshape(-1)
    rs = torch.arange(B, device="cuda").repeat_interleave(width)
    rs[(B - 4) * width :] = -1
    N = B * width
    key = (torch.randn(N, D, generator=g, device="cuda") * 2).to(torch.bfloat16)
    gate = (torch.randn(N, D, generator=g, device="cuda") + 1).to(torch.bfloat16)
    nat = torch.randint(0, MAX_ROWS + 1, (B,), generator=g, device="cuda")
    return key, gate, pos.to(index_dtype), rs.to(index_dtype), slots.to(index_dtype), nat.to(index_dtype)


@pytest.mark.parametrize("width", [4, 8])
@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32])
def test_prepare_step_kernel_matches_reference_at_production_sizes(width: int, index_dtype: torch.dtype) -> None:
    g = torch.Generator(device="cuda").manual_seed(width)
    ring_ref, ref = _state(g)
    ring, tr = ring_ref.clone(), _clone(ref)
    for step in range(6):
        w = width if step % 3 else 1  # width-one rounds between wide ones
        key, gate, pos, rs, slots, nat = _step(g, ref, w, index_dtype)
        ref.prepare_step(ring_ref, key, gate, pos, rs, slots, nat, backend="torch")
        tr.prepare_step(ring, key, gate, pos, rs, slots, nat, backend="triton")
        torch.cuda.synchronize()
        _assert_same(tr, ref, ring, ring_ref, f"width {w}, step {step}")
        # The layer's own ring writes: fresh contents for the slots with rows.
        touched = slots[: B - 4].to(torch.int64)
        fresh = torch.randn(touched.numel(), 2, 4, D, generator=g, device="cuda")
        ring[touched], ring_ref[touched] = fresh, fresh
    assert int(ref.num_disagreements_t) > 0


def test_prepare_step_kernel_replays_in_a_cuda_graph() -> None:
    width = 4
    g = torch.Generator(device="cuda").manual_seed(99)
    ring, tr = _state(g)
    inputs = _step(g, tr, width, torch.int64)
    # Compile outside the capture, on throw-away copies.
    _clone(tr).prepare_step(ring.clone(), *inputs, backend="triton")
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        tr.prepare_step(ring, *inputs, backend="triton")
    for seed in (1, 2, 3):
        g2 = torch.Generator(device="cuda").manual_seed(seed)
        ring_ref, ref = _state(g2)
        fresh = _step(g2, ref, width, torch.int64)
        ring.copy_(ring_ref)
        for name in _PLANES:
            getattr(tr, name).copy_(getattr(ref, name))
        for dst, src in zip(inputs, fresh):
            dst.copy_(src)
        ref.prepare_step(ring_ref, *fresh, backend="torch")
        graph.replay()
        torch.cuda.synchronize()
        _assert_same(tr, ref, ring, ring_ref, f"replay {seed}")
