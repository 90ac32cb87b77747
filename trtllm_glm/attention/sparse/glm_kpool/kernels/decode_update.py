"""Triton kernel: decode/verify update of the indexer tail rings and pools (`ops.update_decode_pools`).

One program per row; the program of a sequence's first row (its "leader") walks the sequence's rows in batch order
with the 4-entry ring in registers, so verify rows see the entries of earlier rows exactly as the reference applies
them one by one. No per-sequence metadata, no host sync; rows of a sequence are contiguous and ``row_seq < 0`` marks
padding rows. docs/kernels.md, "Decode / verify ring and pool update".
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from trtllm_glm.attention.sparse.glm_kpool.cache_layout import KpoolLayerCache

from ._common import INDEX_DIM, INTERPRETED, KPOOL, bf16_bits, pool4, rotate_quant_rows

__all__ = ["update_decode_pools"]


@triton.jit
def _decode_update_kernel(
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
    USE_LIBDEVICE: tl.constexpr,
    KEY_BF16: tl.constexpr,
):
    n = tl.program_id(0)
    seq = tl.load(seq_ptr + n)
    prev = tl.load(seq_ptr + n - 1, mask=n > 0, other=-1)
    if (seq >= 0) & ((n == 0) | (prev != seq)):
        d = tl.arange(0, 128)
        slot = tl.load(slots_ptr + seq).to(tl.int64)
        ring = ring_ptr + slot * stride_ring_slot + d
        k0 = tl.load(ring + 0 * stride_ring_member)
        k1 = tl.load(ring + 1 * stride_ring_member)
        k2 = tl.load(ring + 2 * stride_ring_member)
        k3 = tl.load(ring + 3 * stride_ring_member)
        g0 = tl.load(ring + stride_ring_kind + 0 * stride_ring_member)
        g1 = tl.load(ring + stride_ring_kind + 1 * stride_ring_member)
        g2 = tl.load(ring + stride_ring_kind + 2 * stride_ring_member)
        g3 = tl.load(ring + stride_ring_kind + 3 * stride_ring_member)
        a0 = tl.load(ape_ptr + 0 * stride_ape + d).to(tl.float32)
        a1 = tl.load(ape_ptr + 1 * stride_ape + d).to(tl.float32)
        a2 = tl.load(ape_ptr + 2 * stride_ape + d).to(tl.float32)
        a3 = tl.load(ape_ptr + 3 * stride_ape + d).to(tl.float32)
        seq64 = seq.to(tl.int64)
        r = n
        more = r < N
        while more:
            r64 = r.to(tl.int64)
            pos = tl.load(pos_ptr + r).to(tl.int64)
            m = pos % 4
            kr = tl.load(key_ptr + r64 * stride_key + d).to(tl.float32)
            gr = tl.load(gate_ptr + r64 * stride_gate + d).to(tl.float32)
            k0 = tl.where(m == 0, kr, k0)
            k1 = tl.where(m == 1, kr, k1)
            k2 = tl.where(m == 2, kr, k2)
            k3 = tl.where(m == 3, kr, k3)
            g0 = tl.where(m == 0, gr, g0)
            g1 = tl.where(m == 1, gr, g1)
            g2 = tl.where(m == 2, gr, g2)
            g3 = tl.where(m == 3, gr, g3)
            if m == 3:
                pooled = pool4(k0, k1, k2, k3, g0, g1, g2, g3, a0, a1, a2, a3, USE_LIBDEVICE)
                logical = pos // page_size
                page = tl.load(table_ptr + seq64 * stride_table + logical, mask=logical < table_width, other=-1).to(
                    tl.int64
                )
                # A bad table entry skips the write instead of corrupting another page (the reference raises).
                ok = (page >= 0) & (page < num_pages)
                within = (pos // 4) % (page_size // 4)
                dst = ik_ptr + page * stride_ik_page + within * stride_ik_pool
                if KEY_BF16:
                    # BF16 keys: the pooled key rounded to bf16, stored as bits (no rotation, no scale).
                    tl.store(dst + d, bf16_bits(pooled).to(tl.int16), mask=ok)
                else:
                    codes, scale = rotate_quant_rows(tl.reshape(pooled, (1, 128)), 1)
                    tl.store(dst + d[None, :], codes.to(tl.uint8), mask=ok)
                    tl.store(isc_ptr + page * stride_isc_page + within + tl.arange(0, 1), scale, mask=ok)
            r += 1
            nxt = tl.load(seq_ptr + r, mask=r < N, other=-1)
            more = (r < N) & (nxt == seq)
        tl.store(ring + 0 * stride_ring_member, k0)
        tl.store(ring + 1 * stride_ring_member, k1)
        tl.store(ring + 2 * stride_ring_member, k2)
        tl.store(ring + 3 * stride_ring_member, k3)
        tl.store(ring + stride_ring_kind + 0 * stride_ring_member, g0)
        tl.store(ring + stride_ring_kind + 1 * stride_ring_member, g1)
        tl.store(ring + stride_ring_kind + 2 * stride_ring_member, g2)
        tl.store(ring + stride_ring_kind + 3 * stride_ring_member, g3)


def _check_planes(cache: KpoolLayerCache) -> bool:
    """Validate the planes; returns whether the keys are BF16 (no scale plane) rather than FP8."""
    ik, isc, ring = cache.index_k, cache.index_scale, cache.tail_ring
    key_bf16 = ik.dtype == torch.bfloat16
    if ik.dtype not in (torch.float8_e4m3fn, torch.bfloat16) or ik.shape[1:] != (
        cache.tokens_per_block // KPOOL,
        INDEX_DIM,
    ):
        raise ValueError(f"index_k must be [num_pages, P // 4, 128] e4m3 or bf16, got {tuple(ik.shape)} {ik.dtype}")
    if ik.stride(-1) != 1:
        raise ValueError("index_k must have a unit last stride")
    if key_bf16 and isc is not None:
        raise ValueError("BF16 index keys have no index_scale plane (got one)")
    if not key_bf16 and (isc is None or isc.dtype != torch.float32 or isc.shape != ik.shape[:2] or isc.stride(-1) != 1):
        got = "None" if isc is None else f"{tuple(isc.shape)} {isc.dtype}"
        raise ValueError(f"index_scale must be [num_pages, P // 4] fp32 for FP8 keys, got {got}")
    if ring.dtype != torch.float32 or ring.shape[1:] != (2, KPOOL, INDEX_DIM) or ring.stride(-1) != 1:
        raise ValueError(f"tail_ring must be [slots, 2, 4, 128] fp32, got {tuple(ring.shape)} {ring.dtype}")
    return key_bf16


def key_planes(cache: KpoolLayerCache, key_bf16: bool) -> tuple[torch.Tensor, torch.Tensor, int]:
    """``(index_k bits view, scale plane, scale page stride)`` for a launch: an int16 view of BF16 keys
    (with ``index_k`` itself standing in for the absent scale plane, never accessed) or a uint8 view of
    FP8 keys and their scales."""
    if key_bf16:
        return cache.index_k.view(torch.int16), cache.index_k, 0
    assert cache.index_scale is not None
    return cache.index_k.view(torch.uint8), cache.index_scale, cache.index_scale.stride(0)


def _rows(x: torch.Tensor, name: str, n: int) -> torch.Tensor:
    if x.dim() != 2 or x.shape != (n, INDEX_DIM):
        raise ValueError(f"{name} must be [N={n}, {INDEX_DIM}], got {tuple(x.shape)}")
    return x if x.stride(-1) == 1 else x.contiguous()


def update_decode_pools(
    cache: KpoolLayerCache,
    key: torch.Tensor,
    gate: torch.Tensor,
    ape: torch.Tensor,
    positions: torch.Tensor,
    row_seq: torch.Tensor,
    slot_table: torch.Tensor,
    state_slots: torch.Tensor,
) -> None:
    """Decode/verify update of rings and pools; see the package's `update_decode_pools`.

    Args:
        cache: layer planes; ``index_k [num_pages, P // 4, 128]`` e4m3, ``index_scale [num_pages, P // 4]``
            fp32 (or bf16 ``index_k`` and no scales) and ``tail_ring [S, 2, 4, 128]`` fp32 are updated in place.
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
    _decode_update_kernel[(n,)](
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
        USE_LIBDEVICE=not INTERPRETED,
        KEY_BF16=key_bf16,
        # Pooling must round every multiply and add separately, like the reference (no FMA contraction).
        enable_fp_fusion=False,
    )
