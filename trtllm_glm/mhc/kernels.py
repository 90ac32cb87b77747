"""Triton kernels of one mHC-wrapped block: `mhc_pre` (weights, Sinkhorn, collapse) and `mhc_post` (expand).

Drop-in for the torch reference of `trtllm_glm.modules.mhc`: three launches per block, sizes from shapes only, no
host sync (graph-capturable). The fused residual sites (``TRTLLM_GLM_MHC_FUSE``) are docs/gpu.md, "Decode-step
fusions". CPU: an interpreted copy (`trtllm_glm.triton_interp`). Launches, numerics, measurements and what was tried:
docs/kernels.md, "mHC".
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from trtllm_glm.numerics import batch_invariant
from trtllm_glm.pdl import late_trigger, launch_kwargs, pdl_enter, pdl_leave, use_pdl

__all__ = [
    "mhc_pre",
    "mhc_post",
    "mhc_pre_norm",
    "mhc_post_mean_norm",
    "post_mix_partials",
    "pre_launch_config",
    "pre_path",
    "pre_tc_launch_config",
    "mix_partials",
    "TC_MIN_ROWS",
]

# From this many tokens (bf16 streams, outside the batch-invariant mode) the projection runs on tensor cores
# (`_mix_partial_tc_kernel`); below it, the decode-tuned FMA path, unchanged (CUDA graphs capture those sizes).
TC_MIN_ROWS = 256
PRE_PATHS = ("auto", "fma", "tc")
# ``mma=`` of `mhc_pre` -> the ``MMA`` constexpr of `_mix_partial_tc_kernel` on CUDA (the interpreter uses 0).
MMA_MODES = {"split3": 1, "tf32x3": 2, "bf16x6": 3, "split3_chain": 4}


@triton.jit
def _mix_partial_kernel(
    x_ptr,
    fn_ptr,
    ws_ptr,
    N,
    D,
    stride_xn,
    stride_xs,
    stride_fm,
    stride_wsp,
    stride_wn,
    units_per_prog,
    n_units,
    M: tl.constexpr,
    M_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,
    PDL_LATE: tl.constexpr,
):
    pdl_enter(PDL, PDL_LATE)  # `trtllm_glm.pdl`: launched early, it waits here for the block before it
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    mm = tl.arange(0, M_PAD)
    m_ok = mm < M
    kk = tl.arange(0, BLOCK_K)
    d_blocks = tl.cdiv(D, BLOCK_K)
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_xn
    # fn is read as the dot's B operand [BLOCK_K, M_PAD] (k runs along memory).
    fn_cols = fn_ptr + mm[None, :].to(tl.int64) * stride_fm
    acc = tl.zeros((BLOCK_N, M_PAD), dtype=tl.float32)
    sq = tl.zeros((BLOCK_N,), dtype=tl.float32)
    u0 = pid_k * units_per_prog
    u1 = tl.minimum(u0 + units_per_prog, n_units)
    for u in range(u0, u1):
        # A unit is one stream's BLOCK_K-wide d range: column s * D + d of the flattened streams.
        s = u // d_blocks
        d = (u - s * d_blocks) * BLOCK_K + kk
        d_ok = d < D
        x = tl.load(x_rows + s * stride_xs + d[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0)
        x = x.to(tl.float32)
        w = tl.load(fn_cols + (s * D + d)[:, None], mask=d_ok[:, None] & m_ok[None, :], other=0.0)
        w = w.to(tl.float32)
        acc = tl.dot(x, w, acc, input_precision="ieee")
        sq += tl.sum(x * x, axis=1)
    # Column M (always padding: fn is masked there, so the dot left it 0) carries the sum of squares.
    acc = tl.where(mm[None, :] == M, sq[:, None], acc)
    tl.store(ws_ptr + pid_k * stride_wsp + rows[:, None] * stride_wn + mm[None, :], acc, mask=row_ok[:, None])
    pdl_leave(PDL, PDL_LATE)


@triton.jit
def _split3(w):
    """``w`` (fp32) as ``hi + mid + lo`` exactly, each part a bf16 value held in fp32.

    Each part keeps the top 16 bits of what is left (truncation by mask, exact: a value whose low 16 bits are 0 is
    a bf16). ``hi`` takes 8 significant bits, ``w - hi`` has at most 16 left, ``mid`` 8 of them, ``lo`` the last
    8, so the sum is ``w`` exactly (fn's values are far from the bf16 subnormals). Masks, not casts: the
    interpreter's fp32 -> bf16 cast is wrong, and this way the CPU tests check the decomposition itself.
    """
    hi = (w.to(tl.uint32, bitcast=True) & 0xFFFF0000).to(tl.float32, bitcast=True)
    r = w - hi
    mid = (r.to(tl.uint32, bitcast=True) & 0xFFFF0000).to(tl.float32, bitcast=True)
    return hi, mid, r - mid


@triton.jit
def _mix_partial_tc_kernel(
    x_ptr,
    fn_ptr,
    ws_ptr,
    N,
    D,
    stride_xn,
    stride_xs,
    stride_fm,
    stride_wsp,
    stride_wn,
    units_per_prog,
    n_units,
    M: tl.constexpr,
    M_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    MMA: tl.constexpr,
):
    """`_mix_partial_kernel` on tensor cores, for bf16 streams at prefill sizes (same workspace layout).

    ``MMA`` 1 (``"split3"``): ``fn``'s tile is split into three bf16 parts (`_split3`) and multiplied by the
    bf16 streams (exact in bf16) in three bf16 MMAs with fp32 accumulation: every product is exact (8 x 8
    significant bits), so only the fp32 sums round, as in the IEEE fp32 dot. Each unit's MMAs start from zero
    and the units are added in registers (round-to-nearest); ``hi`` accumulates apart from ``mid + lo`` (~2^-8
    of it), added at the end. ``MMA`` 4 (``"split3_chain"``): the same, the tensor cores accumulating across
    units (their fp32 accumulation's rounding is the hardware's). ``MMA`` 2 / 3: Triton's ``tf32x3`` (fn kept
    to ~22 bits, tf32 MMAs at half the bf16 rate) / ``bf16x6`` (both operands split in three: six MMAs, three of
    them on the streams' zero low parts) on the fp32 upcast, for comparison. ``MMA`` 0: the split, the dots in
    IEEE fp32 (the interpreter, whose bf16 arithmetic is wrong). The sum of squares is accumulated from the fp32
    upcast of ``x`` as in `_mix_partial_kernel`.
    """
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    mm = tl.arange(0, M_PAD)
    m_ok = mm < M
    kk = tl.arange(0, BLOCK_K)
    d_blocks = tl.cdiv(D, BLOCK_K)
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_xn
    fn_cols = fn_ptr + mm[None, :].to(tl.int64) * stride_fm
    acc = tl.zeros((BLOCK_N, M_PAD), dtype=tl.float32)
    acc_lo = tl.zeros((BLOCK_N, M_PAD), dtype=tl.float32)
    sq = tl.zeros((BLOCK_N,), dtype=tl.float32)
    u0 = pid_k * units_per_prog
    u1 = tl.minimum(u0 + units_per_prog, n_units)
    for u in range(u0, u1):
        s = u // d_blocks
        d = (u - s * d_blocks) * BLOCK_K + kk
        d_ok = d < D
        x = tl.load(x_rows + s * stride_xs + d[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0)
        xf = x.to(tl.float32)
        sq += tl.sum(xf * xf, axis=1)
        w = tl.load(fn_cols + (s * D + d)[:, None], mask=d_ok[:, None] & m_ok[None, :], other=0.0)
        w = w.to(tl.float32)
        if MMA == 2:
            acc = tl.dot(xf, w, acc, input_precision="tf32x3")
        elif MMA == 3:
            acc = tl.dot(xf, w, acc, input_precision="bf16x6")
        else:
            hi, mid, lo = _split3(w)
            if MMA == 1:
                # The tensor cores sum one unit (BLOCK_K products per entry) from zero; the units are summed in
                # registers in IEEE fp32. Their own fp32 accumulation may truncate (it is not specified as
                # round-to-nearest), so it only ever sums short runs.
                xb = x.to(tl.bfloat16)
                acc += tl.dot(xb, hi.to(tl.bfloat16))
                acc_lo += tl.dot(xb, lo.to(tl.bfloat16), tl.dot(xb, mid.to(tl.bfloat16)))
            elif MMA == 4:
                # The same products accumulated by the tensor cores over all of the program's units.
                xb = x.to(tl.bfloat16)
                acc = tl.dot(xb, hi.to(tl.bfloat16), acc)
                acc_lo = tl.dot(xb, mid.to(tl.bfloat16), acc_lo)
                acc_lo = tl.dot(xb, lo.to(tl.bfloat16), acc_lo)
            else:
                acc = tl.dot(xf, hi, acc, input_precision="ieee")
                acc_lo = tl.dot(xf, mid, acc_lo, input_precision="ieee")
                acc_lo = tl.dot(xf, lo, acc_lo, input_precision="ieee")
    acc += acc_lo
    acc = tl.where(mm[None, :] == M, sq[:, None], acc)
    tl.store(ws_ptr + pid_k * stride_wsp + rows[:, None] * stride_wn + mm[None, :], acc, mask=row_ok[:, None])


@triton.jit
def _pre_finish_kernel(
    x_ptr,
    ws_ptr,
    base_ptr,
    scale_ptr,
    xin_ptr,
    pre_ptr,
    post_ptr,
    comb_ptr,
    D,
    n_split,
    inv_k,
    stride_xn,
    stride_xs,
    stride_in,
    stride_wsp,
    stride_wn,
    norm_eps,
    hc_eps,
    sinkhorn_iters,
    nw_ptr,
    y_ptr,
    stride_yn,
    rms_eps,
    S: tl.constexpr,
    S_PAD: tl.constexpr,
    M: tl.constexpr,
    M_PAD: tl.constexpr,
    SPLIT_PAD: tl.constexpr,
    BLOCK_D: tl.constexpr,
    WRITE_PRE: tl.constexpr,
    NORM: tl.constexpr,
    STORE_XIN: tl.constexpr,
    PDL: tl.constexpr,
    PDL_LATE: tl.constexpr,
):
    pdl_enter(PDL, PDL_LATE)
    n = tl.program_id(0)
    pid_d = tl.program_id(1)
    # The token's mixing logits and sum of squares: its partials summed in split order.
    sp = tl.arange(0, SPLIT_PAD)
    mm = tl.arange(0, M_PAD)
    part = tl.load(
        ws_ptr + sp[:, None] * stride_wsp + n * stride_wn + mm[None, :], mask=(sp < n_split)[:, None], other=0.0
    )
    mix = tl.sum(part, axis=0)
    sumsq = tl.sum(tl.where(mm == M, mix, 0.0), axis=0)
    # rsqrt(mean(x^2) + eps); the reference multiplies x by it before the (linear) projection.
    r = 1.0 / tl.sqrt(sumsq * inv_k + norm_eps)
    sc_pre = tl.load(scale_ptr).to(tl.float32)
    sc_post = tl.load(scale_ptr + 1).to(tl.float32)
    sc_comb = tl.load(scale_ptr + 2).to(tl.float32)

    ss = tl.arange(0, S_PAD)
    s_ok = ss < S
    # Entries of the [M_PAD] register vector picked by masked sums (registers cannot be indexed).
    pre_w = tl.sum(tl.where((mm[None, :] == ss[:, None]) & s_ok[:, None], mix[None, :], 0.0), axis=1) * r
    post_w = tl.sum(tl.where((mm[None, :] == (ss + S)[:, None]) & s_ok[:, None], mix[None, :], 0.0), axis=1) * r
    pre_b = tl.load(base_ptr + ss, mask=s_ok, other=0.0).to(tl.float32)
    post_b = tl.load(base_ptr + S + ss, mask=s_ok, other=0.0).to(tl.float32)
    pre = 1.0 / (1.0 + tl.exp(-(pre_w * sc_pre + pre_b))) + hc_eps
    post = 2.0 * (1.0 / (1.0 + tl.exp(-(post_w * sc_post + post_b))))

    # comb[j, s]: weight of input stream j in output stream s; padding (j or s >= S) is kept at exactly 0.
    jj = ss[:, None]
    kk = ss[None, :]
    c_ok = (jj < S) & (kk < S)
    c_idx = 2 * S + jj * S + kk
    comb_w = tl.sum(tl.where((mm[None, None, :] == c_idx[:, :, None]) & c_ok[:, :, None], mix[None, None, :], 0.0), 2)
    comb_b = tl.load(base_ptr + c_idx, mask=c_ok, other=0.0).to(tl.float32)
    logits = comb_w * r * sc_comb + comb_b
    # Softmax over s (the reference's dim -1); padded columns are -inf, padded rows stay finite and are zeroed.
    logits = tl.where(kk < S, logits, float("-inf"))
    e = tl.exp(logits - tl.max(logits, axis=1)[:, None])
    comb = tl.where(c_ok, e / tl.sum(e, axis=1)[:, None] + hc_eps, 0.0)
    comb = comb / (tl.sum(comb, axis=0)[None, :] + hc_eps)
    for _ in range(sinkhorn_iters - 1):
        comb = comb / (tl.sum(comb, axis=1)[:, None] + hc_eps)
        comb = comb / (tl.sum(comb, axis=0)[None, :] + hc_eps)

    if pid_d == 0:
        tl.store(post_ptr + n * S + ss, post, mask=s_ok)
        tl.store(comb_ptr + n * (S * S) + jj * S + kk, comb, mask=c_ok)
        if WRITE_PRE:
            tl.store(pre_ptr + n * S + ss, pre, mask=s_ok)

    # Collapse of this program's d slice: fp32 products summed over s in order, cast once.
    d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    d_ok = d < D
    x_row = x_ptr + n.to(tl.int64) * stride_xn
    acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
    for s in tl.static_range(S):
        p_s = tl.sum(tl.where(ss == s, pre, 0.0), axis=0)
        xs = tl.load(x_row + s * stride_xs + d, mask=d_ok, other=0.0).to(tl.float32)
        acc += p_s * xs
    x_in = acc.to(xin_ptr.dtype.element_ty)
    if STORE_XIN:
        tl.store(xin_ptr + n.to(tl.int64) * stride_in + d, x_in, mask=d_ok)
    if NORM:
        # The block's RMSNorm (`_row_norm_kernel`'s arithmetic, in its order) on the collapse rounded to the streams'
        # dtype, as the unfused path reads it back: one program holds the whole row (BLOCK_D >= D, grid (N, 1)).
        xr = tl.where(d_ok, x_in.to(tl.float32), 0.0)
        stat = tl.sum(xr * xr, axis=0) / D
        yv = xr * (1.0 / tl.sqrt(stat + rms_eps))
        yv = yv * tl.load(nw_ptr + d, mask=d_ok, other=0.0).to(tl.float32)
        tl.store(y_ptr + n.to(tl.int64) * stride_yn + d, yv.to(y_ptr.dtype.element_ty), mask=d_ok)
    pdl_leave(PDL, PDL_LATE)  # every program, after the branches


@triton.jit
def _post_mix_kernel(
    x_ptr,
    bo_ptr,
    post_ptr,
    comb_ptr,
    out_ptr,
    fn_ptr,
    ws_ptr,
    N,
    D,
    stride_xn,
    stride_xs,
    stride_bn,
    stride_on,
    stride_os,
    stride_fm,
    stride_wsp,
    stride_wn,
    units_per_prog,
    n_units,
    S: tl.constexpr,
    M: tl.constexpr,
    M_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,
    PDL_LATE: tl.constexpr,
):
    """`_post_kernel` of one block fused with `_mix_partial_kernel` of the next: each program expands the units
    (one output stream's ``BLOCK_K``-wide d range, for ``BLOCK_N`` tokens) that the next block's projection reads,
    stores them, and feeds the same values to the projection. The units partition ``[S, D]`` and the token blocks
    the rows, so every element of ``out`` is written once. The expand is `_post_kernel`'s arithmetic and the
    projection `_mix_partial_kernel`'s (same launch shape, same unit order), so both outputs are those of the two
    launches bit for bit. ``out`` must not alias ``x`` (a unit reads all ``S`` input streams of its d range)."""
    pdl_enter(PDL, PDL_LATE)
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    dt = out_ptr.dtype.element_ty
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    rows64 = rows.to(tl.int64)
    mm = tl.arange(0, M_PAD)
    m_ok = mm < M
    kk = tl.arange(0, BLOCK_K)
    d_blocks = tl.cdiv(D, BLOCK_K)
    x_rows = x_ptr + rows64[:, None] * stride_xn
    fn_cols = fn_ptr + mm[None, :].to(tl.int64) * stride_fm
    acc = tl.zeros((BLOCK_N, M_PAD), dtype=tl.float32)
    sq = tl.zeros((BLOCK_N,), dtype=tl.float32)
    u0 = pid_k * units_per_prog
    u1 = tl.minimum(u0 + units_per_prog, n_units)
    for u in range(u0, u1):
        s = u // d_blocks
        d = (u - s * d_blocks) * BLOCK_K + kk
        d_ok = d < D
        ok = row_ok[:, None] & d_ok[None, :]
        # Output stream s of the previous block's expand, as `_post_kernel` computes it.
        p_s = tl.load(post_ptr + rows * S + s, mask=row_ok, other=0.0).to(dt).to(tl.float32)
        bo = tl.load(bo_ptr + rows64[:, None] * stride_bn + d[None, :], mask=ok, other=0.0).to(dt).to(tl.float32)
        mix = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        for j in tl.static_range(S):
            c_j = tl.load(comb_ptr + rows * (S * S) + j * S + s, mask=row_ok, other=0.0).to(dt).to(tl.float32)
            x_j = tl.load(x_rows + j * stride_xs + d[None, :], mask=ok, other=0.0).to(tl.float32)
            mix += c_j[:, None] * x_j
        y = ((p_s[:, None] * bo).to(dt).to(tl.float32) + mix.to(dt).to(tl.float32)).to(dt)
        tl.store(out_ptr + rows64[:, None] * stride_on + s * stride_os + d[None, :], y, mask=ok)
        # The next block's projection of the same unit (`_mix_partial_kernel`).
        x = tl.where(ok, y.to(tl.float32), 0.0)
        w = tl.load(fn_cols + (s * D + d)[:, None], mask=d_ok[:, None] & m_ok[None, :], other=0.0)
        w = w.to(tl.float32)
        acc = tl.dot(x, w, acc, input_precision="ieee")
        sq += tl.sum(x * x, axis=1)
    acc = tl.where(mm[None, :] == M, sq[:, None], acc)
    tl.store(ws_ptr + pid_k * stride_wsp + rows[:, None] * stride_wn + mm[None, :], acc, mask=row_ok[:, None])
    pdl_leave(PDL, PDL_LATE)


@triton.jit
def _post_mean_norm_kernel(
    x_ptr,
    bo_ptr,
    post_ptr,
    comb_ptr,
    nw_ptr,
    y_ptr,
    D,
    stride_xn,
    stride_xs,
    stride_bn,
    stride_yn,
    inv_s,
    rms_eps,
    S: tl.constexpr,
    S_PAD: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PDL: tl.constexpr,
    PDL_LATE: tl.constexpr,
):
    """The last block's expand (`_post_kernel`'s arithmetic, every stream rounded to the streams' dtype), the mean
    over the streams (fp32 sum in stream order times ``1 / S``, rounded once, as torch's ``mean``) and the final
    RMSNorm (`_row_norm_kernel`'s arithmetic), one program per token holding the whole row (BLOCK_D >= D); the new
    streams themselves are never stored."""
    pdl_enter(PDL, PDL_LATE)
    n = tl.program_id(0)
    dt = y_ptr.dtype.element_ty
    ss = tl.arange(0, S_PAD)
    s_ok = ss < S
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    n64 = n.to(tl.int64)
    post = tl.load(post_ptr + n * S + ss, mask=s_ok, other=0.0).to(dt).to(tl.float32)
    bo = tl.load(bo_ptr + n64 * stride_bn + d, mask=d_ok, other=0.0).to(dt).to(tl.float32)
    acc = tl.zeros((S_PAD, BLOCK_D), dtype=tl.float32)
    for j in tl.static_range(S):
        c_j = tl.load(comb_ptr + n * (S * S) + j * S + ss, mask=s_ok, other=0.0).to(dt).to(tl.float32)
        x_j = tl.load(x_ptr + n64 * stride_xn + j * stride_xs + d, mask=d_ok, other=0.0).to(tl.float32)
        acc += c_j[:, None] * x_j[None, :]
    y = ((post[:, None] * bo[None, :]).to(dt).to(tl.float32) + acc.to(dt).to(tl.float32)).to(dt).to(tl.float32)
    m = tl.zeros((BLOCK_D,), dtype=tl.float32)
    for s in tl.static_range(S):
        m += tl.sum(tl.where(ss[:, None] == s, y, 0.0), axis=0)
    xr = tl.where(d_ok, (m * inv_s).to(dt).to(tl.float32), 0.0)
    stat = tl.sum(xr * xr, axis=0) / D
    yv = xr * (1.0 / tl.sqrt(stat + rms_eps))
    yv = yv * tl.load(nw_ptr + d, mask=d_ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + n64 * stride_yn + d, yv.to(dt), mask=d_ok)
    pdl_leave(PDL, PDL_LATE)


@triton.jit
def _post_kernel(
    x_ptr,
    bo_ptr,
    post_ptr,
    comb_ptr,
    out_ptr,
    D,
    stride_xn,
    stride_xs,
    stride_bn,
    stride_on,
    stride_os,
    S: tl.constexpr,
    S_PAD: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PDL: tl.constexpr,
    PDL_LATE: tl.constexpr,
):
    pdl_enter(PDL, PDL_LATE)
    n = tl.program_id(0)
    pid_d = tl.program_id(1)
    dt = out_ptr.dtype.element_ty
    ss = tl.arange(0, S_PAD)
    s_ok = ss < S
    d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    d_ok = d < D
    n64 = n.to(tl.int64)
    # The reference casts the fp32 weights and the block output to the streams' dtype first.
    post = tl.load(post_ptr + n * S + ss, mask=s_ok, other=0.0).to(dt).to(tl.float32)
    bo = tl.load(bo_ptr + n64 * stride_bn + d, mask=d_ok, other=0.0).to(dt).to(tl.float32)
    acc = tl.zeros((S_PAD, BLOCK_D), dtype=tl.float32)
    for j in tl.static_range(S):
        c_j = tl.load(comb_ptr + n * (S * S) + j * S + ss, mask=s_ok, other=0.0).to(dt).to(tl.float32)
        x_j = tl.load(x_ptr + n64 * stride_xn + j * stride_xs + d, mask=d_ok, other=0.0).to(tl.float32)
        acc += c_j[:, None] * x_j[None, :]
    # Two tensors of the streams' dtype (elementwise product, matmul), then their sum in that dtype.
    y = (post[:, None] * bo[None, :]).to(dt).to(tl.float32) + acc.to(dt).to(tl.float32)
    tl.store(
        out_ptr + n64 * stride_on + ss[:, None] * stride_os + d[None, :],
        y.to(dt),
        mask=s_ok[:, None] & d_ok[None, :],
    )
    pdl_leave(PDL, PDL_LATE)


@functools.lru_cache(maxsize=8)
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # the interpreter: a few programs, enough to exercise the split-K path
    return torch.cuda.get_device_properties(device).multi_processor_count


def pre_launch_config(
    n: int, s: int, d: int, device: torch.device, *, split: int | None = None, block_n: int | None = None,
    block_k: int = 32
) -> tuple[int, int, int, int]:  # fmt: skip
    """Launch shape of ``_mix_partial_kernel`` from the shapes alone (graph safe).

    Args:
        n: tokens.
        s: streams.
        d: hidden size.
        device: where it runs (the SM count sets the split).
        split: requested K split (capped to the number of units), default ~2 programs per SM, at most 128.
        block_n: tokens per program (power of two >= 16; the dot needs 16 rows), default by ``n``.
        block_k: width of a unit (power of two >= 16). The fp32 dot runs on the FMA units, each thread
            holding whole ``block_k`` strips of both operands: 32 keeps it at ~100 registers for 16 rows
            (64 needs ~170 and, at 64 rows, spills).

    Returns:
        ``(block_n, block_k, split, units_per_program)``; ``split * units_per_program >= units`` and every
        program has at least one unit.
    """
    invariant = batch_invariant()
    if block_n is None:
        # Batch-invariant mode: one token tile and one split whatever ``n`` is (a token's partial sums, and so its
        # bits, then never depend on the other tokens of the step).
        block_n = 16 if n <= 16 or invariant else (32 if n <= 32 else 64)
    units = s * triton.cdiv(d, block_k)
    tblocks = 1 if invariant else triton.cdiv(max(n, 1), block_n)
    if split is None:
        split = min(128, max(1, (2 * _num_sms(device)) // tblocks))
    split = max(1, min(split, units))
    upp = triton.cdiv(units, split)
    return block_n, block_k, triton.cdiv(units, upp), upp


def pre_path(n: int, dtype: torch.dtype, path: str = "auto") -> str:
    """Which projection `mhc_pre` runs for ``n`` tokens of ``dtype`` streams: ``"fma"`` or ``"tc"``.

    ``"auto"``: ``"tc"`` from `TC_MIN_ROWS` tokens of bf16 streams outside the batch-invariant mode (the mode
    keeps the FMA path's one token tile and one split for every ``n``, so a row's bits never depend on ``n``);
    ``"fma"`` otherwise. ``"tc"`` needs bf16 streams (their values must be exact MMA operands) and is refused
    in the batch-invariant mode.
    """
    if path not in PRE_PATHS:
        raise ValueError(f"mhc_pre: path must be one of {PRE_PATHS}, got {path!r}")
    invariant = batch_invariant()
    if path == "auto":
        return "tc" if n >= TC_MIN_ROWS and dtype == torch.bfloat16 and not invariant else "fma"
    if path == "tc" and (dtype != torch.bfloat16 or invariant):
        raise ValueError("mhc_pre: path='tc' needs bf16 streams and is not batch invariant")
    return path


def pre_tc_launch_config(
    n: int, s: int, d: int, device: torch.device, *, split: int | None = None, block_n: int | None = None,
    block_k: int = 64
) -> tuple[int, int, int, int]:  # fmt: skip
    """Launch shape of `_mix_partial_tc_kernel` from the shapes alone (graph safe).

    Args:
        n: tokens.
        s: streams.
        d: hidden size.
        device: where it runs (the SM count sets the split).
        split: requested K split (capped to the number of units); default: enough to give ~2 programs per
            SM over the token tiles, at most 64 (the workspace is ``[split, n, M_PAD]`` fp32: at n = 8192 and
            132 SMs the split is 5, 5 MB).
        block_n: tokens per program (power of two >= 16), default 128 from 1024 tokens, else 64.
        block_k: width of a unit (power of two >= 16).

    Returns:
        ``(block_n, block_k, split, units_per_program)`` as `pre_launch_config`.
    """
    if block_n is None:
        block_n = 128 if n >= 1024 else 64
    units = s * triton.cdiv(d, block_k)
    tblocks = triton.cdiv(max(n, 1), block_n)
    if split is None:
        split = min(64, triton.cdiv(2 * _num_sms(device), tblocks))
    split = max(1, min(split, units))
    upp = triton.cdiv(units, split)
    return block_n, block_k, triton.cdiv(units, upp), upp


def _check_streams(streams: torch.Tensor) -> torch.Tensor:
    if streams.dim() != 3:
        raise ValueError(f"streams must be [N, S, D], got {tuple(streams.shape)}")
    if streams.stride(-1) != 1:
        streams = streams.contiguous()
    return streams


def _mma_code(mma: str, device: torch.device) -> int:
    """The ``MMA`` constexpr of `_mix_partial_tc_kernel`: ``mma``'s on CUDA, 0 (IEEE fp32 dots) in the interpreter."""
    if mma not in MMA_MODES:
        raise ValueError(f"mhc_pre: mma must be one of {tuple(MMA_MODES)}, got {mma!r}")
    return MMA_MODES[mma] if device.type == "cuda" else 0


def mix_partials(
    streams: torch.Tensor,
    fn: torch.Tensor,
    *,
    path: str = "auto",
    mma: str = "split3",
    split: int | None = None,
    block_n: int | None = None,
    block_k: int | None = None,
    num_warps: int | None = None,
) -> torch.Tensor:
    """The projection of `mhc_pre` alone: split-K partial mixing logits and sums of squares.

    Args:
        streams: ``[N, S, D]`` (N > 0, last dim contiguous).
        fn: ``[M, S * D]`` with ``M = (2 + S) * S``, last dim contiguous.
        path / mma / split / block_n / block_k / num_warps: as `mhc_pre`.

    Returns:
        ``ws [SPLIT, N, M_PAD]`` fp32: summed over its first dim, columns ``< M`` are ``x @ fnᵀ`` (``x`` the
        flattened streams, not yet RMS-scaled), column ``M`` is ``sum(x^2)``, the rest 0.
    """
    n, s, d = streams.shape
    m = (2 + s) * s
    dev = streams.device
    tc = pre_path(n, streams.dtype, path) == "tc"
    m_pad = max(16, triton.next_power_of_2(m + 1))  # + 1: the spare column of the sum of squares
    if tc:
        bn, bk, n_split, upp = pre_tc_launch_config(n, s, d, dev, split=split, block_n=block_n, block_k=block_k or 64)
    else:
        bn, bk, n_split, upp = pre_launch_config(n, s, d, dev, split=split, block_n=block_n, block_k=block_k or 32)
    ws = torch.empty(n_split, n, m_pad, dtype=torch.float32, device=dev)
    args = (
        streams, fn, ws, n, d, streams.stride(0), streams.stride(1), fn.stride(0), ws.stride(0), ws.stride(1),
        upp, s * triton.cdiv(d, bk),
    )  # fmt: skip
    if tc:
        _mix_partial_tc_kernel[(triton.cdiv(n, bn), n_split)](
            *args, M=m, M_PAD=m_pad, BLOCK_N=bn, BLOCK_K=bk, MMA=_mma_code(mma, dev),
            num_warps=num_warps or (8 if bn >= 128 else 4),
        )  # fmt: skip
    else:
        pdl = use_pdl(dev)
        _mix_partial_kernel[(triton.cdiv(n, bn), n_split)](
            *args, M=m, M_PAD=m_pad, BLOCK_N=bn, BLOCK_K=bk, PDL=pdl, PDL_LATE=late_trigger(pdl),
            num_warps=num_warps or (8 if bn >= 32 else 4),
            **launch_kwargs(pdl),
        )  # fmt: skip
    return ws


def mhc_pre(
    streams: torch.Tensor,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    *,
    norm_eps: float,
    hc_eps: float,
    sinkhorn_iters: int,
    return_pre: bool = False,
    out: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    split: int | None = None,
    block_n: int | None = None,
    block_k: int | None = None,
    block_d: int = 1024,
    num_warps: int | None = None,
    path: str = "auto",
    mma: str = "split3",
) -> tuple[torch.Tensor, ...]:
    """Fused ``mhc_weights`` + ``mhc_collapse`` of `trtllm_glm.modules.mhc`.

    Args:
        streams: ``[N, S, D]`` residual streams (any float dtype; last dim contiguous, else copied).
        fn: ``[(2 + S) * S, S * D]`` projection (read as fp32).
        base: ``[(2 + S) * S]`` bias.
        scale: ``[3]`` scales of the pre, post and comb logits.
        norm_eps: epsilon of the weightless RMS norm over the flattened streams.
        hc_eps: floor added to pre and comb and to every Sinkhorn denominator.
        sinkhorn_iters: Sinkhorn iterations (the reference's count: one column normalisation, then
            ``sinkhorn_iters - 1`` (row, column) pairs).
        return_pre: also return ``pre [N, S]`` fp32 (tests).
        out: optional ``(x_in, post, comb)`` buffers to write (e.g. a graph's static outputs).
        split / block_n / block_k: launch shape of the split-K projection (`pre_launch_config` on the FMA
            path, block_k 32 by default; `pre_tc_launch_config` on the tensor-core path, block_k 64).
        block_d: hidden slice per program of the collapse (power of two).
        num_warps: warps per program of the projection (FMA path: default 4, 8 from 32 tokens per program,
            keeps the FMA dot under ~130 registers; tensor-core path: 8 for 128-token tiles, else 4: ptxas for
            sm_90 at D = 4096 gives 102 / 96 registers, 4 warps at 128 tokens 180); the finishing kernel uses 4.
        path: ``"auto"`` / ``"fma"`` / ``"tc"``, the projection's path (`pre_path`).
        mma: tensor-core path only: ``"split3"`` (three bf16 MMAs on fn's exact three-part split, units summed
            in registers), ``"split3_chain"`` (summed by the tensor cores), or Triton's ``"tf32x3"`` /
            ``"bf16x6"`` (for comparison); on the CPU the interpreter runs the split in IEEE fp32
            whatever ``mma`` is.

    Returns:
        ``(x_in [N, D] streams' dtype, post [N, S] fp32, comb [N, S, S] fp32)``, with ``pre`` inserted
        after ``x_in`` when ``return_pre``.
    """
    streams = _check_streams(streams)
    n, s, d = streams.shape
    m = (2 + s) * s
    if fn.shape != (m, s * d) or base.shape != (m,) or scale.numel() < 3:
        raise ValueError(
            f"mhc_pre: fn {tuple(fn.shape)} / base {tuple(base.shape)} / scale {tuple(scale.shape)} do not match "
            f"{s} streams of {d}"
        )
    dev = streams.device
    if fn.stride(-1) != 1:
        fn = fn.contiguous()
    base = base.contiguous()
    scale = scale.contiguous()
    if out is None:
        x_in = torch.empty(n, d, dtype=streams.dtype, device=dev)
        post = torch.empty(n, s, dtype=torch.float32, device=dev)
        comb = torch.empty(n, s, s, dtype=torch.float32, device=dev)
    else:
        x_in, post, comb = out
        if x_in.shape != (n, d) or x_in.stride(-1) != 1 or x_in.dtype != streams.dtype:
            raise ValueError("mhc_pre: out x_in must be [N, D] of the streams' dtype, last dim contiguous")
        if post.shape != (n, s) or comb.shape != (n, s, s) or not (post.is_contiguous() and comb.is_contiguous()):
            raise ValueError("mhc_pre: out post / comb must be contiguous [N, S] / [N, S, S]")
        if post.dtype != torch.float32 or comb.dtype != torch.float32:
            raise ValueError("mhc_pre: out post / comb must be fp32")
    pre = torch.empty(n, s, dtype=torch.float32, device=dev) if return_pre else post
    pre_path(n, streams.dtype, path)  # a bad path / dtype / mma is refused at every n
    _mma_code(mma, dev)
    if n > 0:
        ws = mix_partials(
            streams, fn, path=path, mma=mma, split=split, block_n=block_n, block_k=block_k, num_warps=num_warps
        )
        n_split, m_pad = ws.shape[0], ws.shape[2]
        pdl = use_pdl(dev)
        s_pad = max(2, triton.next_power_of_2(s))
        _pre_finish_kernel[(n, triton.cdiv(d, block_d))](
            streams, ws, base, scale, x_in, pre, post, comb, d, n_split, 1.0 / (s * d),
            streams.stride(0), streams.stride(1), x_in.stride(0), ws.stride(0), ws.stride(1),
            float(norm_eps), float(hc_eps), int(sinkhorn_iters), x_in, x_in, x_in.stride(0), 0.0,
            S=s, S_PAD=s_pad, M=m, M_PAD=m_pad, SPLIT_PAD=max(2, triton.next_power_of_2(n_split)), BLOCK_D=block_d,
            WRITE_PRE=return_pre, NORM=False, STORE_XIN=True, PDL=pdl, PDL_LATE=late_trigger(pdl), num_warps=4,
            **launch_kwargs(pdl),
        )  # fmt: skip
    if return_pre:
        return x_in, pre, post, comb
    return x_in, post, comb


def mhc_post(
    streams: torch.Tensor,
    block_out: torch.Tensor,
    post: torch.Tensor,
    comb: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
    block_d: int = 1024,
    num_warps: int = 4,
) -> torch.Tensor:
    """Fused ``mhc_expand``: new streams ``post ⊗ block_out + combᵀ @ streams`` in the streams' dtype.

    Args:
        streams: ``[N, S, D]`` the block's input streams.
        block_out: ``[N, D]`` the block's output (any float dtype; rounded to the streams' dtype first).
        post: ``[N, S]`` fp32 from `mhc_pre`.
        comb: ``[N, S, S]`` fp32 from `mhc_pre` (``comb[n, j, s]``: input ``j`` to output ``s``).
        out: optional ``[N, S, D]`` buffer (streams' dtype, last dim contiguous); may be ``streams`` itself
            (in place: each program reads its token's ``[S, BLOCK_D]`` slice before writing that same slice).
        block_d: hidden slice per program (power of two).
        num_warps: warps per program.

    Returns:
        ``[N, S, D]`` in the streams' dtype.
    """
    streams = _check_streams(streams)
    n, s, d = streams.shape
    if block_out.shape != (n, d) or post.shape != (n, s) or comb.shape != (n, s, s):
        raise ValueError(
            f"mhc_post: block_out {tuple(block_out.shape)} / post {tuple(post.shape)} / comb {tuple(comb.shape)} "
            f"do not match streams {tuple(streams.shape)}"
        )
    if block_out.stride(-1) != 1:
        block_out = block_out.contiguous()
    post = post.contiguous()
    comb = comb.contiguous()
    if out is None:
        out = torch.empty(n, s, d, dtype=streams.dtype, device=streams.device)
    elif out.shape != (n, s, d) or out.dtype != streams.dtype or out.stride(-1) != 1:
        raise ValueError("mhc_post: out must be [N, S, D] of the streams' dtype, last dim contiguous")
    if n > 0:
        pdl = use_pdl(streams.device)
        _post_kernel[(n, triton.cdiv(d, block_d))](
            streams, block_out, post, comb, out, d,
            streams.stride(0), streams.stride(1), block_out.stride(0), out.stride(0), out.stride(1),
            S=s, S_PAD=max(2, triton.next_power_of_2(s)), BLOCK_D=block_d, PDL=pdl, PDL_LATE=late_trigger(pdl),
            num_warps=num_warps,
            **launch_kwargs(pdl),
        )  # fmt: skip
    return out


def post_mix_partials(
    streams: torch.Tensor,
    block_out: torch.Tensor,
    post: torch.Tensor,
    comb: torch.Tensor,
    fn: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
    split: int | None = None,
    block_n: int | None = None,
    block_k: int | None = None,
    num_warps: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`mhc_post` of one block and the FMA projection (`mix_partials`) of the next, in one launch.

    Args:
        streams: ``[N, S, D]`` the finished block's input streams (last dim contiguous).
        block_out / post / comb: that block's output and `mhc_pre` weights, as `mhc_post` takes them.
        fn: ``[M, S * D]`` the next block's projection.
        out: optional ``[N, S, D]`` buffer for the new streams (not ``streams``: a unit reads every input stream of
            its d range while other programs write theirs).
        split / block_n / block_k / num_warps: `mix_partials`'s FMA launch shape (`pre_launch_config`).

    Returns:
        ``(new_streams [N, S, D], ws [SPLIT, N, M_PAD])``: the bits of `mhc_post` and of `mix_partials` on the new
        streams with the same launch shape.
    """
    streams = _check_streams(streams)
    n, s, d = streams.shape
    m = (2 + s) * s
    if block_out.shape != (n, d) or post.shape != (n, s) or comb.shape != (n, s, s) or fn.shape != (m, s * d):
        raise ValueError(
            f"post_mix_partials: block_out {tuple(block_out.shape)} / post {tuple(post.shape)} / comb "
            f"{tuple(comb.shape)} / fn {tuple(fn.shape)} do not match streams {tuple(streams.shape)}"
        )
    if block_out.stride(-1) != 1:
        block_out = block_out.contiguous()
    if fn.stride(-1) != 1:
        fn = fn.contiguous()
    post = post.contiguous()
    comb = comb.contiguous()
    dev = streams.device
    if out is None:
        out = torch.empty(n, s, d, dtype=streams.dtype, device=dev)
    elif out.shape != (n, s, d) or out.dtype != streams.dtype or out.stride(-1) != 1:
        raise ValueError("post_mix_partials: out must be [N, S, D] of the streams' dtype, last dim contiguous")
    elif out.data_ptr() == streams.data_ptr():
        raise ValueError("post_mix_partials: out must not be the input streams")
    m_pad = max(16, triton.next_power_of_2(m + 1))
    bn, bk, n_split, upp = pre_launch_config(n, s, d, dev, split=split, block_n=block_n, block_k=block_k or 32)
    ws = torch.empty(n_split, n, m_pad, dtype=torch.float32, device=dev)
    if n > 0:
        pdl = use_pdl(dev)
        _post_mix_kernel[(triton.cdiv(n, bn), n_split)](
            streams, block_out, post, comb, out, fn, ws, n, d,
            streams.stride(0), streams.stride(1), block_out.stride(0), out.stride(0), out.stride(1),
            fn.stride(0), ws.stride(0), ws.stride(1), upp, s * triton.cdiv(d, bk),
            S=s, M=m, M_PAD=m_pad, BLOCK_N=bn, BLOCK_K=bk, PDL=pdl, PDL_LATE=late_trigger(pdl),
            num_warps=num_warps or (8 if bn >= 32 else 4),
            **launch_kwargs(pdl),
        )  # fmt: skip
    return out, ws


def mhc_pre_norm(
    streams: torch.Tensor,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    norm_weight: torch.Tensor,
    *,
    norm_eps: float,
    hc_eps: float,
    sinkhorn_iters: int,
    rms_eps: float,
    prev: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    return_x_in: bool = False,
    out: tuple[torch.Tensor | None, torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    split: int | None = None,
    block_n: int | None = None,
    block_k: int | None = None,
    num_warps: int | None = None,
) -> tuple[torch.Tensor, ...]:
    """One residual site's `mhc_pre` and the block's input RMSNorm, with the previous block's `mhc_post` in front.

    Two launches instead of four: with ``prev`` the previous block's expand and this block's projection partials
    run as one (`post_mix_partials`; the FMA path, decode sizes), else the projection alone (`mix_partials`, any
    path); then the finishing kernel applies the weights, collapses, and RMS-normalises the collapse (rounded to the
    streams' dtype, as the block's norm reads it) with ``norm_weight`` in the same program (one program per token
    holds the whole row). The finishing kernel keeps `mhc_pre`'s 4 warps, so ``post``, ``comb`` and the collapse
    have `mhc_pre`'s bits (the same tiles in the same layouts); the norm's sum over ``D`` runs in this layout, not
    `trtllm_glm.norm.row_norm`'s (8 warps at D = 4096), so the normed input may differ from the unfused path's by
    an ulp where a sum rounds differently. Row-wise, launch shape from the shapes only: batch invariant.

    Args:
        streams: ``[N, S, D]``: this block's input streams, or with ``prev`` the previous block's input streams.
        fn / base / scale / norm_eps / hc_eps / sinkhorn_iters: this block's mHC, as `mhc_pre`.
        norm_weight: ``[D]`` the block's RMSNorm weight; ``rms_eps`` its epsilon.
        prev: ``(block_out, post, comb)`` of the previous block (its expand is done here).
        return_x_in: also return the un-normed collapse (tests).
        out: optional ``(streams, x, post, comb)`` buffers (``streams`` used with ``prev`` only; ``None`` allowed).
        split / block_n / block_k / num_warps: the projection's launch shape.

    Returns:
        ``(streams [N, S, D], x [N, D], post [N, S], comb [N, S, S])``: this block's input streams (``streams``
        itself without ``prev``), the normed block input in the streams' dtype and the weights (fp32); ``x_in`` after
        ``x`` with ``return_x_in``.
    """
    streams = _check_streams(streams)
    n, s, d = streams.shape
    m = (2 + s) * s
    if fn.shape != (m, s * d) or base.shape != (m,) or scale.numel() < 3 or norm_weight.shape != (d,):
        raise ValueError(
            f"mhc_pre_norm: fn {tuple(fn.shape)} / base {tuple(base.shape)} / scale {tuple(scale.shape)} / norm "
            f"weight {tuple(norm_weight.shape)} do not match {s} streams of {d}"
        )
    dev = streams.device
    if fn.stride(-1) != 1:
        fn = fn.contiguous()
    base = base.contiguous()
    scale = scale.contiguous()
    norm_weight = norm_weight.contiguous()
    launch = dict(split=split, block_n=block_n, block_k=block_k, num_warps=num_warps)
    s_out, x, post, comb = out if out is not None else (None, None, None, None)
    if prev is not None:
        if pre_path(n, streams.dtype) == "fma":
            streams, ws = post_mix_partials(streams, *prev, fn, out=s_out, **launch)
        else:  # the tensor-core projection (prefill sizes): the expand on its own
            streams = mhc_post(streams, *prev, out=s_out)
            ws = mix_partials(streams, fn, **launch) if n > 0 else None
    else:
        ws = mix_partials(streams, fn, **launch) if n > 0 else None
    if out is None:
        x = torch.empty(n, d, dtype=streams.dtype, device=dev)
        post = torch.empty(n, s, dtype=torch.float32, device=dev)
        comb = torch.empty(n, s, s, dtype=torch.float32, device=dev)
    elif (
        x.shape != (n, d) or x.dtype != streams.dtype or x.stride(-1) != 1 or post.shape != (n, s)
        or comb.shape != (n, s, s) or post.dtype != torch.float32 or comb.dtype != torch.float32
        or not (post.is_contiguous() and comb.is_contiguous())
    ):  # fmt: skip
        raise ValueError("mhc_pre_norm: out x / post / comb must be [N, D] (streams' dtype) / fp32 [N, S] / [N, S, S]")
    x_in = torch.empty(n, d, dtype=streams.dtype, device=dev) if return_x_in else x  # not written unless asked
    if n > 0:
        n_split, m_pad = ws.shape[0], ws.shape[2]
        pdl = use_pdl(dev)
        block_d = triton.next_power_of_2(d)
        _pre_finish_kernel[(n, 1)](
            streams, ws, base, scale, x_in, post, post, comb, d, n_split, 1.0 / (s * d),
            streams.stride(0), streams.stride(1), x_in.stride(0), ws.stride(0), ws.stride(1),
            float(norm_eps), float(hc_eps), int(sinkhorn_iters), norm_weight, x, x.stride(0), float(rms_eps),
            S=s, S_PAD=max(2, triton.next_power_of_2(s)), M=m, M_PAD=m_pad,
            SPLIT_PAD=max(2, triton.next_power_of_2(n_split)), BLOCK_D=block_d, WRITE_PRE=False, NORM=True,
            STORE_XIN=return_x_in, PDL=pdl, PDL_LATE=late_trigger(pdl), num_warps=4, **launch_kwargs(pdl),
        )  # fmt: skip
    if return_x_in:
        return streams, x, post, comb, x_in
    return streams, x, post, comb


def mhc_post_mean_norm(
    streams: torch.Tensor,
    block_out: torch.Tensor,
    post: torch.Tensor,
    comb: torch.Tensor,
    norm_weight: torch.Tensor,
    *,
    rms_eps: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The model's end in one launch: the last block's `mhc_post`, the mean over the streams and the final RMSNorm.

    Args:
        streams / block_out / post / comb: as `mhc_post`.
        norm_weight: ``[D]`` the final norm's weight; ``rms_eps`` its epsilon.
        out: optional ``[N, D]`` result buffer (streams' dtype, last dim contiguous).

    Returns:
        ``[N, D]`` ``rms_norm(mhc_post(...).mean(dim=1))`` in the streams' dtype.
    """
    streams = _check_streams(streams)
    n, s, d = streams.shape
    if block_out.shape != (n, d) or post.shape != (n, s) or comb.shape != (n, s, s) or norm_weight.shape != (d,):
        raise ValueError(
            f"mhc_post_mean_norm: block_out {tuple(block_out.shape)} / post {tuple(post.shape)} / comb "
            f"{tuple(comb.shape)} / norm weight {tuple(norm_weight.shape)} do not match streams {tuple(streams.shape)}"
        )
    if block_out.stride(-1) != 1:
        block_out = block_out.contiguous()
    post = post.contiguous()
    comb = comb.contiguous()
    norm_weight = norm_weight.contiguous()
    if out is None:
        out = torch.empty(n, d, dtype=streams.dtype, device=streams.device)
    elif out.shape != (n, d) or out.dtype != streams.dtype or out.stride(-1) != 1:
        raise ValueError("mhc_post_mean_norm: out must be [N, D] of the streams' dtype, last dim contiguous")
    if n > 0:
        pdl = use_pdl(streams.device)
        block_d = triton.next_power_of_2(d)
        _post_mean_norm_kernel[(n,)](
            streams, block_out, post, comb, norm_weight, out, d,
            streams.stride(0), streams.stride(1), block_out.stride(0), out.stride(0), 1.0 / s, float(rms_eps),
            S=s, S_PAD=max(2, triton.next_power_of_2(s)), BLOCK_D=block_d, PDL=pdl, PDL_LATE=late_trigger(pdl),
            num_warps=max(1, min(8, block_d // 256)), **launch_kwargs(pdl),
        )  # fmt: skip
    return out
