"""Triton kernel: prefill pool writes (`ops.update_prefill_pools`), parallel over the pools of the chunks.

Each program takes ``BLOCK_R`` consecutive rows; the rows with ``pos % 4 == 3`` complete pool ``pos // 4``
(other lanes are masked: their loads and stores never happen). Member ``m`` of that pool sits at position
``pos - 3 + m`` and, when it belongs to this batch, at row ``n - 3 + m`` (rows of a sequence are contiguous
with consecutive positions); members before the sequence's first row come from ``tail_ring[slot, :, m]``.
The ring is only read here: `write_prefill_tail` stores the chunk's last rows afterwards.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from trtllm_glm.attention.sparse.glm_kpool.cache_layout import KpoolLayerCache

from ._common import INDEX_DIM, INTERPRETED, KPOOL, bf16_bits, pool4, rotate_quant_rows
from .decode_update import _check_planes, _rows, key_planes

__all__ = ["update_prefill_pools"]

_BLOCK_R = 16


@triton.jit
def _member(
    ptr,
    stride,
    ring_ptr,
    rows,
    seq,
    done,
    slot,
    stride_ring_slot,
    ring_off,
    seq_ptr,
    M: tl.constexpr,
):
    """Member ``M`` (key or gate, by the pointers) of the pools completed by ``rows``: ``[BLOCK_R, 128]``."""
    d = tl.arange(0, 128)
    src = rows - 3 + M
    src_ok = done & (src >= 0)
    src_seq = tl.load(seq_ptr + src, mask=src_ok, other=-2)
    in_batch = src_ok & (src_seq == seq)
    from_rows = tl.load(ptr + src.to(tl.int64)[:, None] * stride + d[None, :], mask=in_batch[:, None], other=0.0).to(
        tl.float32
    )
    from_ring = tl.load(
        ring_ptr + slot[:, None] * stride_ring_slot + ring_off + d[None, :],
        mask=(done & ~in_batch)[:, None],
        other=0.0,
    )
    return tl.where(in_batch[:, None], from_rows, from_ring)


@triton.jit
def _prefill_pools_kernel(
    key_ptr,
    gate_ptr,
    ape_ptr,
    pos_ptr,
    seq_ptr,
    table_ptr,
    slots_ptr,
    ik_ptr,
    isc_ptr,
    ring_ptr,
    N,
    num_pages,
    table_width,
    page_size,
    stride_key,
    stride_gate,
    stride_ape,
    stride_table,
    stride_ik_page,
    stride_ik_pool,
    stride_isc_page,
    stride_ring_slot,
    stride_ring_kind,
    stride_ring_member,
    BLOCK_R: tl.constexpr,
    USE_LIBDEVICE: tl.constexpr,
    KEY_BF16: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    in_range = rows < N
    pos = tl.load(pos_ptr + rows, mask=in_range, other=0).to(tl.int64)
    seq = tl.load(seq_ptr + rows, mask=in_range, other=-1)
    done = in_range & (seq >= 0) & (pos % 4 == 3)
    if tl.max(done.to(tl.int32), axis=0) > 0:
        d = tl.arange(0, 128)
        slot = tl.load(slots_ptr + seq, mask=done, other=0).to(tl.int64)
        kd = stride_ring_kind
        sm = stride_ring_member
        rs = stride_ring_slot
        k0 = _member(key_ptr, stride_key, ring_ptr, rows, seq, done, slot, rs, 0 * sm, seq_ptr, 0)
        k1 = _member(key_ptr, stride_key, ring_ptr, rows, seq, done, slot, rs, 1 * sm, seq_ptr, 1)
        k2 = _member(key_ptr, stride_key, ring_ptr, rows, seq, done, slot, rs, 2 * sm, seq_ptr, 2)
        k3 = _member(key_ptr, stride_key, ring_ptr, rows, seq, done, slot, rs, 3 * sm, seq_ptr, 3)
        g0 = _member(gate_ptr, stride_gate, ring_ptr, rows, seq, done, slot, rs, kd + 0 * sm, seq_ptr, 0)
        g1 = _member(gate_ptr, stride_gate, ring_ptr, rows, seq, done, slot, rs, kd + 1 * sm, seq_ptr, 1)
        g2 = _member(gate_ptr, stride_gate, ring_ptr, rows, seq, done, slot, rs, kd + 2 * sm, seq_ptr, 2)
        g3 = _member(gate_ptr, stride_gate, ring_ptr, rows, seq, done, slot, rs, kd + 3 * sm, seq_ptr, 3)
        a0 = tl.load(ape_ptr + 0 * stride_ape + d).to(tl.float32)[None, :]
        a1 = tl.load(ape_ptr + 1 * stride_ape + d).to(tl.float32)[None, :]
        a2 = tl.load(ape_ptr + 2 * stride_ape + d).to(tl.float32)[None, :]
        a3 = tl.load(ape_ptr + 3 * stride_ape + d).to(tl.float32)[None, :]
        pooled = pool4(k0, k1, k2, k3, g0, g1, g2, g3, a0, a1, a2, a3, USE_LIBDEVICE)
        logical = pos // page_size
        page = tl.load(
            table_ptr + seq.to(tl.int64) * stride_table + logical, mask=done & (logical < table_width), other=-1
        ).to(tl.int64)
        ok = done & (page >= 0) & (page < num_pages)
        within = (pos // 4) % (page_size // 4)
        dst = ik_ptr + page * stride_ik_page + within * stride_ik_pool
        if KEY_BF16:
            # BF16 keys: the pooled key rounded to bf16, stored as bits (no rotation, no scale).
            tl.store(dst[:, None] + d[None, :], bf16_bits(pooled).to(tl.int16), mask=ok[:, None])
        else:
            codes, scale = rotate_quant_rows(pooled, BLOCK_R)
            tl.store(dst[:, None] + d[None, :], codes.to(tl.uint8), mask=ok[:, None])
            tl.store(isc_ptr + page * stride_isc_page + within, scale, mask=ok)


def update_prefill_pools(
    cache: KpoolLayerCache,
    key: torch.Tensor,
    gate: torch.Tensor,
    ape: torch.Tensor,
    positions: torch.Tensor,
    row_seq: torch.Tensor,
    slot_table: torch.Tensor,
    state_slots: torch.Tensor,
) -> None:
    """Write every pool completed inside the batch; see the package's `update_prefill_pools`.

    Args:
        cache: layer planes (``index_k`` and ``index_scale`` written, ``tail_ring`` read).
        key: ``[N, 128]`` keys. gate: ``[N, 128]`` gate logits. ape: ``[4, 128]`` position bias.
        positions: ``[N]`` int positions. row_seq: ``[N]`` int sequence per row.
        slot_table: ``[B, max_pages]`` int pages. state_slots: ``[B]`` int state slots.
    """
    n = positions.shape[0]
    key_bf16 = _check_planes(cache)
    key, gate = _rows(key, "key", n), _rows(gate, "gate", n)
    if ape.shape != (KPOOL, INDEX_DIM) or ape.stride(-1) != 1:
        raise ValueError(f"ape must be contiguous [4, {INDEX_DIM}], got {tuple(ape.shape)}")
    if n == 0:
        return
    ik, ring = cache.index_k, cache.tail_ring
    ik_bits, isc, isc_stride = key_planes(cache, key_bf16)
    _prefill_pools_kernel[(triton.cdiv(n, _BLOCK_R),)](
        key,
        gate,
        ape,
        positions,
        row_seq,
        slot_table,
        state_slots,
        ik_bits,
        isc,
        ring,
        n,
        ik.shape[0],
        slot_table.shape[1],
        cache.tokens_per_block,
        key.stride(0),
        gate.stride(0),
        ape.stride(0),
        slot_table.stride(0),
        ik.stride(0),
        ik.stride(1),
        isc_stride,
        ring.stride(0),
        ring.stride(1),
        ring.stride(2),
        BLOCK_R=_BLOCK_R,
        USE_LIBDEVICE=not INTERPRETED,
        KEY_BF16=key_bf16,
        enable_fp_fusion=False,
    )
