"""Triton kernel: store latent rows at their token slots (`ops.write_latent_rows`).

``latent[slot_table[b, pos // P], pos % P] = rows[n]``, one program per row. Same-dtype rows are copied as
raw bits; a bf16 cache gets round-to-nearest-even from the fp32 bits (the interpreter's float->bf16 cast
is wrong, so no cast is used); other combinations use a plain cast.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["write_latent_rows"]

_RAW_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_MODE_COPY, _MODE_TO_BF16, _MODE_CAST = 0, 1, 2


@triton.jit
def _latent_kernel(
    rows_ptr,
    pos_ptr,
    seq_ptr,
    table_ptr,
    lat_ptr,
    page_size,
    num_pages,
    table_width,
    stride_rows,
    stride_table,
    stride_lat_page,
    stride_lat_tok,
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
) -> None:
    """Store latent rows; see the package's `write_latent_rows`.

    Args:
        latent_cache: ``[num_pages, P, R]`` latent plane. rows: ``[N, R]``. positions: ``[N]`` int.
        row_seq: ``[N]`` int (``< 0`` skipped). slot_table: ``[B, max_pages]`` int. page_size: ``P``.
    """
    if latent_cache.dim() != 3 or latent_cache.shape[1] != page_size or latent_cache.stride(-1) != 1:
        raise ValueError(f"latent cache {tuple(latent_cache.shape)} is not [num_pages, {page_size}, R]")
    n = positions.shape[0]
    if rows.dim() != 2 or rows.shape != (n, latent_cache.shape[2]):
        raise ValueError(f"rows {tuple(rows.shape)} do not match [N={n}, {latent_cache.shape[2]}]")
    if n == 0:
        return
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    if rows.dtype == latent_cache.dtype:
        mode = _MODE_COPY
        raw = _RAW_BITS[rows.element_size()]
        src, dst = rows.view(raw), latent_cache.view(raw)
    elif latent_cache.dtype == torch.bfloat16:
        mode, src, dst = _MODE_TO_BF16, rows, latent_cache.view(torch.int16)
    else:
        mode, src, dst = _MODE_CAST, rows, latent_cache
    r = latent_cache.shape[2]
    block = min(triton.next_power_of_2(r), 1024)
    _latent_kernel[(n,)](
        src,
        positions,
        row_seq,
        slot_table,
        dst,
        page_size,
        latent_cache.shape[0],
        slot_table.shape[1],
        rows.stride(0),
        slot_table.stride(0),
        latent_cache.stride(0),
        latent_cache.stride(1),
        R=r,
        MODE=mode,
        BLOCK=block,
    )
