"""Triton kernel: sparse MLA decode/verify attention over selected latent rows (`ops.sparse_mla_attention`).

Absorbed (MQA) form: every head of a query row attends over the same selected latent rows, so each latent
row is read once per query row and shared by all heads of a program. Split-K (flash-decoding) layout:

* ``_split_kernel``, grid ``(head blocks, splits, N)``: a program owns ``BLOCK_H`` heads of one row and a
  contiguous range of ``rows_per_split`` entries of ``sel``. Per tile of ``BLOCK_W`` entries it gathers the
  latent rows through the slot table (entries ``< 0``, bad pages and padding rows are masked: no load),
  takes ``S = Q C^T`` and ``O += P C`` on the tensor cores with an online (running max) softmax in fp32,
  and writes the normalised partial output and its log2-sum-exp. With one split it writes the final
  output directly and no combine runs. The loop is left to Triton's software pipeliner (two stages: the
  selection, page and row loads of the next tile become asynchronous copies).
* ``_combine_kernel``, grid ``(head blocks, N)``: weights the partials by ``2 ** (lse_s - max lse)`` and
  writes the output in ``q_abs``'s dtype. A row with nothing selected has every ``lse = -inf`` and gets
  zeros, as in the reference.

The split count depends only on shapes (rows, heads, selection width, multiprocessor count), and the
partial buffers are allocated from shapes only, so the op has no host synchronisation and can be captured
in a CUDA graph.

Numerics: on CUDA with bf16/fp16 queries and cache (the model's case) both products run on the tensor
cores with fp32 accumulation; ``Q C^T`` is exact per product (bf16 x bf16 fits fp32), the probabilities
are rounded to the cache dtype for ``P C`` (as FlashAttention does), so outputs agree with the fp32
reference to about one unit of the output dtype's last place. With fp32 inputs, mixed dtypes or under the
interpreter (CPU), everything is fp32 with IEEE dot products (bf16 values are upcast right after loading:
the interpreter's bf16 arithmetic is not IEEE).

Defensive differences from the reference (which raises): a selected token whose page is missing from the
slot table or out of range, and rows with ``row_seq < 0``, are skipped instead.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ._common import INTERPRETED

__all__ = ["sparse_mla_attention", "choose_splits", "split_layout"]

_LOG2E = 1.4426950408889634

# Default launch shape for the GLM geometry (64 heads x 512 latent): all heads in one program, so every
# gathered latent row is read from memory exactly once per query row. 64 entries per tile: the fastest
# shape measured on the H200 (kernels/NOTES.md; per-tile costs dominate, so wider tiles win while they fit:
# 197 KB of shared memory, a few spilled registers).
_BLOCK_H = 64
_BLOCK_W = 64
_NUM_WARPS = 8
_NUM_STAGES = 2
_COMBINE_BLOCK_H = 8


@triton.jit
def _split_kernel(
    q_ptr,
    kv_ptr,
    sel_ptr,
    seq_ptr,
    table_ptr,
    o_ptr,
    lse_ptr,
    H,
    W,
    num_pages,
    table_width,
    rows_per_split,
    stride_qn,
    stride_qh,
    stride_kp,
    stride_kr,
    stride_sn,
    stride_tb,
    stride_on,
    stride_os,
    stride_oh,
    stride_ln,
    stride_ls,
    qk_scale,
    R: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_W: tl.constexpr,
    RP: tl.constexpr,
    FINAL: tl.constexpr,
    FP32: tl.constexpr,
):
    hb = tl.program_id(0)
    split = tl.program_id(1)
    n = tl.program_id(2)
    n64 = n.to(tl.int64)
    h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    r = tl.arange(0, RP)
    h_ok = h < H
    # R is a compile-time constant so that the row mask is provably uniform over 16-byte vectors (a
    # run-time bound would force 2-byte loads of the latent rows).
    r_ok = r < R
    q = tl.load(
        q_ptr + n64 * stride_qn + h[:, None] * stride_qh + r[None, :], mask=h_ok[:, None] & r_ok[None, :], other=0.0
    )
    if FP32:
        q = q.to(tl.float32)
    seq = tl.load(seq_ptr + n).to(tl.int64)
    table_row = table_ptr + seq * stride_tb
    w_lo = split * rows_per_split
    w_hi = tl.minimum(w_lo + rows_per_split, W)
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, RP], tl.float32)
    for w0 in range(w_lo, w_hi, BLOCK_W):
        w = w0 + tl.arange(0, BLOCK_W)
        tok = tl.load(sel_ptr + n64 * stride_sn + w, mask=w < w_hi, other=-1)
        # Masked lanes never touch memory: skipped entries, padding rows and pages outside the table.
        ok = (tok >= 0) & (seq >= 0)
        logical = tok // PAGE
        ok = ok & (logical < table_width)
        page = tl.load(table_row + logical, mask=ok, other=-1).to(tl.int64)
        ok = ok & (page >= 0) & (page < num_pages)
        row = tok % PAGE
        kv = tl.load(
            kv_ptr + (page * stride_kp + row * stride_kr)[:, None] + r[None, :],
            mask=ok[:, None] & r_ok[None, :],
            other=0.0,
        )
        if FP32:
            kv = kv.to(tl.float32)
            s = tl.dot(q, tl.trans(kv), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(kv))
        s = tl.where(ok[None, :], s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        # Until a head has seen a selected entry its max is -inf; shift by 0 then so that no inf - inf NaN
        # appears (the exp2 of -inf logits is 0 either way).
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_use)
        p = tl.exp2(s - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if FP32:
            pv = tl.dot(p, kv, input_precision="ieee")
        else:
            pv = tl.dot(p.to(kv.dtype), kv)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    has = l_i > 0.0
    inv_l = 1.0 / tl.where(has, l_i, 1.0)
    o = tl.where(has[:, None], acc * inv_l[:, None], 0.0)
    o_ptrs = o_ptr + n64 * stride_on + split * stride_os + h[:, None] * stride_oh + r[None, :]
    o_mask = h_ok[:, None] & r_ok[None, :]
    if FINAL:
        tl.store(o_ptrs, o.to(o_ptr.dtype.element_ty), mask=o_mask)
    else:
        tl.store(o_ptrs, o, mask=o_mask)
        lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
        tl.store(lse_ptr + n64 * stride_ln + split * stride_ls + h, lse, mask=h_ok)


@triton.jit
def _combine_kernel(
    o_ptr,
    lse_ptr,
    out_ptr,
    H,
    S,
    stride_on,
    stride_os,
    stride_oh,
    stride_ln,
    stride_ls,
    stride_outn,
    stride_outh,
    R: tl.constexpr,
    BLOCK_H: tl.constexpr,
    RP: tl.constexpr,
    SP: tl.constexpr,
):
    hb = tl.program_id(0)
    n64 = tl.program_id(1).to(tl.int64)
    h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    r = tl.arange(0, RP)
    s = tl.arange(0, SP)
    h_ok = h < H
    r_ok = r < R
    lse_row = lse_ptr + n64 * stride_ln
    lse = tl.load(lse_row + s[:, None] * stride_ls + h[None, :], mask=(s < S)[:, None] & h_ok[None, :], other=-1.0e30)
    lse = tl.where(lse == float("-inf"), -1.0e30, lse)
    m = tl.max(lse, axis=0)
    acc = tl.zeros([BLOCK_H, RP], tl.float32)
    den = tl.zeros([BLOCK_H], tl.float32)
    o_row = o_ptr + n64 * stride_on + h[:, None] * stride_oh + r[None, :]
    for i in range(S):
        li = tl.load(lse_row + i * stride_ls + h, mask=h_ok, other=float("-inf"))
        # Splits that saw nothing have lse = -inf and weight exactly 0; a row with nothing at all keeps
        # den = 0 and outputs zeros.
        wi = tl.where(li == float("-inf"), 0.0, tl.exp2(li - m))
        oi = tl.load(o_row + i * stride_os, mask=h_ok[:, None] & r_ok[None, :], other=0.0)
        acc += wi[:, None] * oi
        den += wi
    has = den > 0.0
    out = tl.where(has[:, None], acc * (1.0 / tl.where(has, den, 1.0))[:, None], 0.0)
    tl.store(
        out_ptr + n64 * stride_outn + h[:, None] * stride_outh + r[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=h_ok[:, None] & r_ok[None, :],
    )


@functools.cache
def _num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def choose_splits(n_rows: int, n_heads: int, width: int, device: torch.device, block_h: int, block_w: int) -> int:
    """Split count over the ``width`` selected entries, from shapes only (graph-capture safe).

    Enough ``(head block, split, row)`` programs to fill the multiprocessors once (the default program
    holds one per SM), but no more splits than make the fp32 partials (``H * R * 4`` bytes per split and
    row) outweigh the latent rows they summarise (``width * R * 2`` bytes per row), and at least one tile
    of ``block_w`` entries per split.

    Args:
        n_rows: query rows ``N``. n_heads: heads ``H``. width: selection width ``W``.
        device: where the kernel runs (its multiprocessor count sets the target).
        block_h: heads per program. block_w: entries per tile.

    Returns:
        The split count (``>= 1``).
    """
    sms = (
        _num_sms(device.index if device.index is not None else torch.cuda.current_device())
        if device.type == "cuda"
        else 8
    )
    head_blocks = triton.cdiv(n_heads, block_h)
    tiles = max(1, triton.cdiv(width, block_w))
    splits = max(1, sms // max(1, n_rows * head_blocks))
    splits = min(splits, max(1, width // (2 * n_heads)), tiles)
    return splits


def split_layout(width: int, block_w: int, splits: int) -> tuple[int, int]:
    """Entries per split (a whole number of tiles) and the resulting split count for ``splits`` requested.

    Args:
        width: selection width ``W``. block_w: entries per tile. splits: requested split count.

    Returns:
        ``(rows_per_split, splits)``; every split but the last holds ``rows_per_split`` entries.
    """
    tiles = triton.cdiv(width, block_w)
    rows_per_split = triton.cdiv(tiles, max(1, min(splits, tiles))) * block_w
    return rows_per_split, triton.cdiv(width, rows_per_split)


def sparse_mla_attention(
    q_abs: torch.Tensor,
    latent_cache: torch.Tensor,
    sel: torch.Tensor,
    row_seq: torch.Tensor,
    slot_table: torch.Tensor,
    page_size: int,
    softmax_scale: float,
    *,
    out: torch.Tensor | None = None,
    splits: int | None = None,
    block_h: int | None = None,
    block_w: int | None = None,
    num_warps: int | None = None,
    num_stages: int = _NUM_STAGES,
    combine_block_h: int = _COMBINE_BLOCK_H,
) -> torch.Tensor:
    """Sparse MLA over selected latent rows; see the package's `sparse_mla_attention`.

    Args:
        q_abs: ``[N, H, R]`` absorbed queries (last dim contiguous).
        latent_cache: ``[num_pages, P, R]`` latent plane (last dim contiguous).
        sel: ``[N, W]`` int token positions, ``-1`` = skip, any order.
        row_seq: ``[N]`` int sequence index of each row (``< 0``: padding row, outputs zeros).
        slot_table: ``[B, max_pages]`` int raw page ids.
        page_size: tokens per page ``P``.
        softmax_scale: logit scale.
        out: optional ``[N, H, R]`` buffer of ``q_abs``'s dtype to write into.
        splits: split count over ``W`` (default: `choose_splits`); tuning only.
        block_h, block_w, num_warps, num_stages, combine_block_h: launch shape; tuning only.

    Returns:
        ``[N, H, R]`` latent outputs in ``q_abs``'s dtype.

    Raises:
        ValueError: shapes, dtypes or layouts disagree.
    """
    if q_abs.dim() != 3:
        raise ValueError(f"q_abs must be [N, H, R], got {tuple(q_abs.shape)}")
    n_rows, n_heads, rank = q_abs.shape
    if latent_cache.dim() != 3 or latent_cache.shape[1:] != (page_size, rank):
        raise ValueError(f"latent cache {tuple(latent_cache.shape)} is not [num_pages, {page_size}, {rank}]")
    if sel.dim() != 2 or sel.shape[0] != n_rows or row_seq.shape != (n_rows,):
        raise ValueError(
            f"expected sel [N={n_rows}, W] and row_seq [N], got {tuple(sel.shape)}, {tuple(row_seq.shape)}"
        )
    if latent_cache.stride(-1) != 1:
        raise ValueError("latent cache rows must be contiguous")
    if q_abs.stride(-1) != 1:
        q_abs = q_abs.contiguous()
    if sel.stride(-1) != 1:
        sel = sel.contiguous()
    if slot_table.stride(-1) != 1:
        slot_table = slot_table.contiguous()
    if out is None:
        out = torch.empty(n_rows, n_heads, rank, dtype=q_abs.dtype, device=q_abs.device)
    elif out.shape != q_abs.shape or out.dtype != q_abs.dtype or out.stride(-1) != 1:
        raise ValueError(f"out must be [N, H, R] {q_abs.dtype}, got {tuple(out.shape)} {out.dtype}")
    width = sel.shape[1]
    if n_rows == 0 or n_heads == 0 or rank == 0:
        return out
    if width == 0:
        return out.zero_()

    fp32 = INTERPRETED or q_abs.dtype != latent_cache.dtype or latent_cache.dtype == torch.float32
    if fp32 and not INTERPRETED:
        # IEEE fp32 products run on the FMA units with the operands in registers: small tiles, or the
        # compiler spills (this is the exactness path, not the fast one).
        block_h = block_h or 16
        block_w = block_w or 16
        num_warps = num_warps or 4
    if block_h is None:
        # tl.dot needs at least 16 rows; padded heads load zero queries and are never stored.
        block_h = min(_BLOCK_H, max(16, triton.next_power_of_2(n_heads)))
    if block_w is None:
        block_w = _BLOCK_W
    if num_warps is None:
        num_warps = _NUM_WARPS if block_h >= 64 else 4
    rp = triton.next_power_of_2(rank)
    if splits is None:
        splits = choose_splits(n_rows, n_heads, width, q_abs.device, block_h, block_w)
    rows_per_split, splits = split_layout(width, block_w, splits)
    head_blocks = triton.cdiv(n_heads, block_h)
    # The interpreter rounds fp32 -> bf16 stores incorrectly: write fp32 there and cast with torch.
    dst = out
    if INTERPRETED and out.dtype == torch.bfloat16:
        dst = torch.empty(out.shape, dtype=torch.float32, device=out.device)
    common = dict(
        R=rank,
        PAGE=page_size,
        BLOCK_H=block_h,
        BLOCK_W=block_w,
        RP=rp,
        FP32=fp32,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    grid = (head_blocks, splits, n_rows)
    qk_scale = float(softmax_scale) * _LOG2E
    if splits == 1:
        _split_kernel[grid](
            q_abs,
            latent_cache,
            sel,
            row_seq,
            slot_table,
            dst,
            dst,
            n_heads,
            width,
            latent_cache.shape[0],
            slot_table.shape[1],
            rows_per_split,
            q_abs.stride(0),
            q_abs.stride(1),
            latent_cache.stride(0),
            latent_cache.stride(1),
            sel.stride(0),
            slot_table.stride(0),
            dst.stride(0),
            0,
            dst.stride(1),
            0,
            0,
            qk_scale,
            FINAL=True,
            **common,
        )
    else:
        o_part = torch.empty(n_rows, splits, n_heads, rank, dtype=torch.float32, device=q_abs.device)
        lse_part = torch.empty(n_rows, splits, n_heads, dtype=torch.float32, device=q_abs.device)
        _split_kernel[grid](
            q_abs,
            latent_cache,
            sel,
            row_seq,
            slot_table,
            o_part,
            lse_part,
            n_heads,
            width,
            latent_cache.shape[0],
            slot_table.shape[1],
            rows_per_split,
            q_abs.stride(0),
            q_abs.stride(1),
            latent_cache.stride(0),
            latent_cache.stride(1),
            sel.stride(0),
            slot_table.stride(0),
            o_part.stride(0),
            o_part.stride(1),
            o_part.stride(2),
            lse_part.stride(0),
            lse_part.stride(1),
            qk_scale,
            FINAL=False,
            **common,
        )
        cb = min(combine_block_h, triton.next_power_of_2(n_heads))
        _combine_kernel[(triton.cdiv(n_heads, cb), n_rows)](
            o_part,
            lse_part,
            dst,
            n_heads,
            splits,
            o_part.stride(0),
            o_part.stride(1),
            o_part.stride(2),
            lse_part.stride(0),
            lse_part.stride(1),
            dst.stride(0),
            dst.stride(1),
            R=rank,
            BLOCK_H=cb,
            RP=rp,
            SP=triton.next_power_of_2(splits),
            num_warps=4,
        )
    if dst is not out:
        out.copy_(dst)
    return out
