"""Triton kernel: store latent rows at their token slots (`ops.write_latent_rows`).

``latent[slot_table[b, pos // P], pos % P] = rows[n]``, one program per row. Same-dtype rows are copied as
raw bits; a bf16 cache gets round-to-nearest-even from the fp32 bits (the interpreter's float->bf16 cast
is wrong, so no cast is used); an FP8 cache (``latent_dtype="fp8"``) gets `ops.quant_latent`'s codes and block
scales, bit-identical, computed in fp32 and integer bit arithmetic (no fp8 cast: the interpreter's is wrong);
other combinations use a plain cast.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from trtllm_glm.attention.sparse.glm_kpool.cache_layout import (
    LATENT_SCALE_BLOCK,
    check_latent_planes,
)

from ._common import e4m3_codes, pow2_scale

__all__ = ["write_latent_rows"]

_RAW_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_MODE_COPY, _MODE_TO_BF16, _MODE_CAST, _MODE_FP8 = 0, 1, 2, 3


@triton.jit
def _latent_kernel(
    rows_ptr,
    pos_ptr,
    seq_ptr,
    table_ptr,
    lat_ptr,
    scale_ptr,
    page_size,
    num_pages,
    table_width,
    stride_rows,
    stride_table,
    stride_lat_page,
    stride_lat_tok,
    stride_scale_page,
    stride_scale_tok,
    R: tl.constexpr,
    MODE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    n = tl.program_id(0)
    pos = tl.load(pos_ptr + n).to(tl.int64)
    seq = tl.load(seq_ptr + n).to(tl.int64)
    logical = pos // page_size
    page = tl.load(table_ptr + seq * stride_table + logical, mask=(seq >= 0) & (logical < table_width), other=-1)
    page = page.to(tl.int64)
    if (page >= 0) & (page < num_pages):
        dst = lat_ptr + page * stride_lat_page + (pos % page_size) * stride_lat_tok
        src = rows_ptr + n.to(tl.int64) * stride_rows
        if MODE == 3:
            # FP8: one power-of-two scale per BLOCK (= 128) columns; multiplying by its exact reciprocal equals
            # the reference's division, and the codes are rounded from fp32 bits (no fp8 cast).
            sdst = scale_ptr + page * stride_scale_page + (pos % page_size) * stride_scale_tok
            for c0 in tl.static_range(0, R, BLOCK):
                c = c0 + tl.arange(0, BLOCK)
                ok = c < R
                x = tl.load(src + c, mask=ok, other=0.0).to(tl.float32)
                scale, inv = pow2_scale(tl.max(tl.abs(x), axis=0))
                tl.store(dst + c, e4m3_codes(x * inv).to(tl.uint8), mask=ok)
                tl.store(sdst + c0 // BLOCK, scale)
        else:
            for c0 in tl.static_range(0, R, BLOCK):
                c = c0 + tl.arange(0, BLOCK)
                ok = c < R
                x = tl.load(src + c, mask=ok)
                if MODE == 1:
                    bits = x.to(tl.float32).to(tl.int32, bitcast=True)
                    # Round half to even on the dropped 16 bits; the arithmetic shift keeps the sign in int16 range.
                    y = ((bits + (0x7FFF + ((bits >> 16) & 1))) >> 16).to(tl.int16)
                elif MODE == 2:
                    y = x.to(lat_ptr.dtype.element_ty)
                else:
                    y = x
                tl.store(dst + c, y, mask=ok)


def write_latent_rows(
    latent_cache: torch.Tensor,
    rows: torch.Tensor,
    positions: torch.Tensor,
    row_seq: torch.Tensor,
    slot_table: torch.Tensor,
    page_size: int,
    *,
    latent_scale: torch.Tensor | None = None,
) -> None:
    """Store latent rows; see the package's `write_latent_rows`.

    Args:
        latent_cache: ``[num_pages, P, R]`` latent plane. rows: ``[N, R]``. positions: ``[N]`` int.
        row_seq: ``[N]`` int (``< 0`` skipped). slot_table: ``[B, max_pages]`` int. page_size: ``P``.
        latent_scale: ``[num_pages, P, ceil(R / 128)]`` fp32 block scales of an FP8 plane (required with one,
            refused without).
    """
    fp8 = check_latent_planes(latent_cache, latent_scale, page_size)
    if latent_cache.stride(-1) != 1:
        raise ValueError(f"latent cache {tuple(latent_cache.shape)} rows must be contiguous")
    r = latent_cache.shape[2]
    n = positions.shape[0]
    if rows.dim() != 2 or rows.shape != (n, r):
        raise ValueError(f"rows {tuple(rows.shape)} do not match [N={n}, {r}]")
    if n == 0:
        return
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    scale = latent_scale
    if fp8:
        mode, src, dst = _MODE_FP8, rows, latent_cache.view(torch.uint8)
    elif rows.dtype == latent_cache.dtype:
        mode = _MODE_COPY
        raw = _RAW_BITS[rows.element_size()]
        src, dst = rows.view(raw), latent_cache.view(raw)
    elif latent_cache.dtype == torch.bfloat16:
        mode, src, dst = _MODE_TO_BF16, rows, latent_cache.view(torch.int16)
    else:
        mode, src, dst = _MODE_CAST, rows, latent_cache
    if scale is None:
        scale = dst  # never read (MODE != FP8): a valid pointer for the launch
        scale_strides = (0, 0)
    else:
        scale_strides = (scale.stride(0), scale.stride(1))
    # FP8: one tile per scale block; else whole rows (up to 1024 columns) per tile.
    block = LATENT_SCALE_BLOCK if fp8 else min(triton.next_power_of_2(r), 1024)
    _latent_kernel[(n,)](
        src,
        positions,
        row_seq,
        slot_table,
        dst,
        scale,
        page_size,
        latent_cache.shape[0],
        slot_table.shape[1],
        rows.stride(0),
        slot_table.stride(0),
        latent_cache.stride(0),
        latent_cache.stride(1),
        *scale_strides,
        R=r,
        MODE=mode,
        BLOCK=block,
    )
