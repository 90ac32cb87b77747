"""Triton kernel: indexer scores over each row's complete pools (`ops.score_pools`).

Exact fp8 (or bf16) products accumulated in fp32 on the tensor cores: agreement with the reference to fp32
rounding, each row's result from its own inputs only. Grid and numerics: docs/kernels.md, "Indexer scores".
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import INDEX_DIM, INTERPRETED, KPOOL, bf16_bits_to_f32, e4m3_to_f16_scaled

__all__ = ["score_pools"]

_BLOCK_P = 64
_ITERS = 4


@triton.jit
def _score_kernel(
    q_ptr,
    w_ptr,
    ik_ptr,
    isc_ptr,
    pos_ptr,
    seq_ptr,
    table_ptr,
    out_ptr,
    H,
    num_pages,
    table_width,
    max_pools,
    page_size,
    stride_q_row,
    stride_q_head,
    stride_w,
    stride_ik_page,
    stride_ik_pool,
    stride_isc_page,
    stride_table,
    stride_out,
    HP: tl.constexpr,
    BLOCK_P: tl.constexpr,
    ITERS: tl.constexpr,
    HW_FP8: tl.constexpr,
    KEY_BF16: tl.constexpr,
):
    n = tl.program_id(0)
    chunk0 = tl.program_id(1) * (BLOCK_P * ITERS)
    n64 = n.to(tl.int64)
    pos = tl.load(pos_ptr + n).to(tl.int64)
    seq = tl.load(seq_ptr + n).to(tl.int64)
    # A padding row (row_seq < 0) sees no pool: it must not index the slot table.
    n_c = tl.where(seq >= 0, tl.minimum((pos + 1) // 4, max_pools), 0)
    out_row = out_ptr + n64 * stride_out
    p_off = tl.arange(0, BLOCK_P)
    if chunk0 < n_c:
        d = tl.arange(0, 128)
        h = tl.arange(0, HP)
        h_ok = h < H
        qb = tl.load(q_ptr + n64 * stride_q_row + h[:, None] * stride_q_head + d[None, :], mask=h_ok[:, None], other=0)
        if KEY_BF16:
            if HW_FP8:
                qf = qb.to(tl.bfloat16, bitcast=True)
            else:
                qf = bf16_bits_to_f32(qb)
            unscale = 1.0
        elif HW_FP8:
            # GPU-only variant: the hardware e4m3 -> fp16 conversion (exact; no 2**-8 factor to undo).
            qf = qb.to(tl.float8e4nv, bitcast=True).to(tl.float16)
            unscale = 1.0
        else:
            qf = e4m3_to_f16_scaled(qb.to(tl.int32))
            unscale = 65536.0
        qt = tl.trans(qf)
        wh = tl.load(w_ptr + n64 * stride_w + h, mask=h_ok, other=0.0).to(tl.float32)
        pools_per_page = page_size // 4
        for it in tl.static_range(ITERS):
            p = chunk0 + it * BLOCK_P + p_off
            valid = p < n_c
            logical = p // pools_per_page
            page = tl.load(table_ptr + seq * stride_table + logical, mask=valid & (logical < table_width), other=-1).to(
                tl.int64
            )
            ok = valid & (page >= 0) & (page < num_pages)
            within = p % pools_per_page
            kb = tl.load(
                ik_ptr + (page * stride_ik_page + within * stride_ik_pool)[:, None] + d[None, :],
                mask=ok[:, None],
                other=0,
            )
            if KEY_BF16:
                if HW_FP8:
                    dots = tl.dot(kb.to(tl.bfloat16, bitcast=True), qt)  # exact bf16 products, fp32 sums
                else:
                    dots = tl.dot(bf16_bits_to_f32(kb), qt, input_precision="ieee")
            else:
                if HW_FP8:
                    kf = kb.to(tl.float8e4nv, bitcast=True).to(tl.float16)
                else:
                    kf = e4m3_to_f16_scaled(kb.to(tl.int32))
                dots = tl.dot(kf, qt)  # [BLOCK_P, HP] fp32: q . k, times 2**-16 on the arithmetic decode
            s = tl.sum(wh[None, :] * tl.maximum(dots, 0.0), axis=1)
            if not KEY_BF16:
                kscale = tl.load(isc_ptr + page * stride_isc_page + within, mask=ok, other=0.0)
                s = s * (kscale * unscale)
            tl.store(out_row + p, tl.where(valid, s, float("-inf")), mask=p < max_pools)
    else:
        for it in tl.static_range(ITERS):
            p = chunk0 + it * BLOCK_P + p_off
            tl.store(out_row + p, tl.full((BLOCK_P,), float("-inf"), tl.float32), mask=p < max_pools)


def score_pools(
    q8: torch.Tensor,
    w: torch.Tensor,
    index_k: torch.Tensor,
    index_scale: torch.Tensor | None,
    positions: torch.Tensor,
    row_seq: torch.Tensor,
    slot_table: torch.Tensor,
    page_size: int,
    max_pools: int,
    *,
    out: torch.Tensor | None = None,
    block_p: int | None = None,
    iters: int | None = None,
    num_warps: int = 4,
    fp8_decode: str | None = None,
) -> torch.Tensor:
    """Score complete pools; see the package's `score_pools`.

    Args:
        q8: ``[N, H, 128]`` e4m3 queries (bf16 with BF16 keys). w: ``[N, H]`` fp32 weights.
            index_k: ``[num_pages, P // 4, 128]`` e4m3 (or bf16). index_scale: ``[num_pages, P // 4]`` fp32
            (``None`` with BF16 keys). positions, row_seq: ``[N]`` int.
        slot_table: ``[B, max_pages]`` int. page_size: ``P``. max_pools: output columns.
        out: optional ``[N, max_pools]`` fp32 output buffer.
        block_p, iters, num_warps: launch shape (pools per block, blocks per program, warps); tuning only.
            Default ``64, 4``; under the interpreter, which runs every masked-off lane's work too, one block
            just covering ``max_pools`` (at most 64) per program.
        fp8_decode: ``"arith"`` (integer bit decode, the one path that also runs in the interpreter) or
            ``"hw"`` (CUDA only: the hardware e4m3 conversion, fewer instructions per key byte; measured
            faster on the H200). Both are exact, so they give the same products. ``None``: ``"hw"`` on
            CUDA, ``"arith"`` under the interpreter. With BF16 keys: ``"hw"`` feeds the bf16 operands to the
            tensor cores, ``"arith"`` widens them to fp32 (IEEE dot).

    Returns:
        ``[N, max_pools]`` fp32 scores.
    """
    n, n_heads, dim = q8.shape
    key_bf16 = index_k.dtype == torch.bfloat16
    want_q = torch.bfloat16 if key_bf16 else torch.float8_e4m3fn
    if dim != INDEX_DIM or q8.dtype != want_q or q8.stride(-1) != 1:
        raise ValueError(
            f"queries must be [N, H, {INDEX_DIM}] {want_q} for {index_k.dtype} keys, got {tuple(q8.shape)} {q8.dtype}"
        )
    if w.shape != (n, n_heads):
        raise ValueError(f"w must be [N={n}, H={n_heads}], got {tuple(w.shape)}")
    if w.stride(-1) != 1:
        w = w.contiguous()
    if index_k.dim() != 3 or index_k.shape[1:] != (page_size // KPOOL, dim) or index_k.stride(-1) != 1:
        raise ValueError(f"index_k must be [num_pages, {page_size // KPOOL}, {dim}], got {tuple(index_k.shape)}")
    if key_bf16:
        if index_scale is not None:
            raise ValueError("BF16 index keys have no index_scale plane (got one)")
        index_scale, isc_stride = index_k, 0  # never read (KEY_BF16): a valid pointer for the launch
    else:
        if index_k.dtype != torch.float8_e4m3fn:
            raise ValueError(f"index_k must be float8_e4m3fn or bfloat16, got {index_k.dtype}")
        if index_scale is None or index_scale.shape != index_k.shape[:2] or index_scale.stride(-1) != 1:
            got = None if index_scale is None else tuple(index_scale.shape)
            raise ValueError(f"index_scale must be [num_pages, P // 4] fp32 for FP8 keys, got {got}")
        isc_stride = index_scale.stride(0)
    if fp8_decode is None:
        fp8_decode = "arith" if INTERPRETED else "hw"
    if fp8_decode not in ("arith", "hw") or (fp8_decode == "hw" and INTERPRETED):
        raise ValueError(f"fp8_decode must be 'arith' (or 'hw' on CUDA), got {fp8_decode!r}")
    if out is None:
        out = torch.empty(n, max_pools, dtype=torch.float32, device=q8.device)
    elif out.shape != (n, max_pools) or out.dtype != torch.float32 or out.stride(-1) != 1:
        raise ValueError(f"out must be [N={n}, max_pools={max_pools}] fp32, got {tuple(out.shape)} {out.dtype}")
    if n == 0 or max_pools == 0:
        return out
    if block_p is None:
        block_p = min(_BLOCK_P, max(16, triton.next_power_of_2(max_pools))) if INTERPRETED else _BLOCK_P
    if iters is None:
        iters = 1 if INTERPRETED else _ITERS
    # tl.dot needs at least 16 columns; padded heads load zero queries and weights and add exact zeros.
    hp = max(16, triton.next_power_of_2(n_heads))
    grid = (n, triton.cdiv(max_pools, block_p * iters))
    bits = torch.int16 if key_bf16 else torch.uint8
    _score_kernel[grid](
        q8.view(bits),
        w,
        index_k.view(bits),
        index_scale,
        positions,
        row_seq,
        slot_table,
        out,
        n_heads,
        index_k.shape[0],
        slot_table.shape[1],
        max_pools,
        page_size,
        q8.stride(0),
        q8.stride(1),
        w.stride(0),
        index_k.stride(0),
        index_k.stride(1),
        isc_stride,
        slot_table.stride(0),
        out.stride(0),
        HP=hp,
        BLOCK_P=block_p,
        ITERS=iters,
        HW_FP8=fp8_decode == "hw",
        KEY_BF16=key_bf16,
        num_warps=num_warps,
    )
    return out
