"""Triton kernel: store each sequence's last (up to 4) batch rows in its tail ring (`ops.write_prefill_tail`).

Row ``n`` survives "last write wins" exactly when row ``n + 4`` is not of the same sequence (rows of a
sequence are contiguous with consecutive positions, so ``n + 4`` would be the next row with the same
``pos % 4``). Surviving rows write distinct entries, so the result does not depend on store order.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import INDEX_DIM, KPOOL
from .decode_update import _rows

__all__ = ["write_prefill_tail"]

_BLOCK_R = 16


@triton.jit
def _prefill_tail_kernel(
    key_ptr,
    gate_ptr,
    pos_ptr,
    seq_ptr,
    slots_ptr,
    ring_ptr,
    N,
    stride_key,
    stride_gate,
    stride_ring_slot,
    stride_ring_kind,
    stride_ring_member,
    BLOCK_R: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    d = tl.arange(0, 128)
    in_range = rows < N
    pos = tl.load(pos_ptr + rows, mask=in_range, other=0).to(tl.int64)
    seq = tl.load(seq_ptr + rows, mask=in_range, other=-1)
    later = tl.load(seq_ptr + rows + 4, mask=rows + 4 < N, other=-1)
    keep = in_range & (seq >= 0) & ((rows + 4 >= N) | (later != seq))
    slot = tl.load(slots_ptr + seq, mask=keep, other=0).to(tl.int64)
    r64 = rows.to(tl.int64)
    k = tl.load(key_ptr + r64[:, None] * stride_key + d[None, :], mask=keep[:, None], other=0.0).to(tl.float32)
    g = tl.load(gate_ptr + r64[:, None] * stride_gate + d[None, :], mask=keep[:, None], other=0.0).to(tl.float32)
    dst = ring_ptr + slot * stride_ring_slot + (pos % 4) * stride_ring_member
    tl.store(dst[:, None] + d[None, :], k, mask=keep[:, None])
    tl.store(dst[:, None] + stride_ring_kind + d[None, :], g, mask=keep[:, None])


def write_prefill_tail(
    tail_ring: torch.Tensor,
    key: torch.Tensor,
    gate: torch.Tensor,
    positions: torch.Tensor,
    row_seq: torch.Tensor,
    state_slots: torch.Tensor,
) -> None:
    """Store the last (up to 4) rows of each sequence into its ring; see the package's `write_prefill_tail`.

    Args:
        tail_ring: ``[S, 2, 4, 128]`` fp32 rings. key: ``[N, 128]``. gate: ``[N, 128]``.
        positions: ``[N]`` int positions. row_seq: ``[N]`` int sequence per row. state_slots: ``[B]`` int.
    """
    n = positions.shape[0]
    key, gate = _rows(key, "key", n), _rows(gate, "gate", n)
    if tail_ring.dtype != torch.float32 or tail_ring.shape[1:] != (2, KPOOL, INDEX_DIM) or tail_ring.stride(-1) != 1:
        raise ValueError(f"tail_ring must be [slots, 2, 4, 128] fp32, got {tuple(tail_ring.shape)} {tail_ring.dtype}")
    if n == 0:
        return
    _prefill_tail_kernel[(triton.cdiv(n, _BLOCK_R),)](
        key,
        gate,
        positions,
        row_seq,
        state_slots,
        tail_ring,
        n,
        key.stride(0),
        gate.stride(0),
        tail_ring.stride(0),
        tail_ring.stride(1),
        tail_ring.stride(2),
        BLOCK_R=_BLOCK_R,
    )
