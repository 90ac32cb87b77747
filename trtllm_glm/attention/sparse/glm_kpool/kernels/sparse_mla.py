"""Sparse MLA decode/verify attention over selected latent rows (`ops.sparse_mla_attention`): Triton + Gluon.

Split-K (flash-decoding) over the selection, ``_gluon_split_kernel`` on sm_90 (bf16/fp16, R = 512), ``_split_kernel``
elsewhere (an FP8 latent cache with its block scales included), then ``_combine_kernel``; split count from shapes only
(graph-capturable). Bad pages and ``row_seq < 0`` rows are skipped where the reference raises. Schedule and numerics:
docs/kernels.md, "Sparse MLA decode / verify"; floors: kernels/NOTES.md.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from trtllm_glm import envs
from trtllm_glm.attention.sparse.glm_kpool.cache_layout import (
    LATENT_SCALE_BLOCK,
    check_latent_planes,
    latent_scale_blocks,
)
from trtllm_glm.numerics import batch_invariant

from ._common import INTERPRETED, e4m3_to_f16_scaled

try:  # Gluon (Triton's explicit-layout dialect) ships with triton >= 3.5; the Hopper kernel below needs it.
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
    from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma, warpgroup_mma_wait

    _HAVE_GLUON = True
except ImportError:  # pragma: no cover - older triton: the Triton kernel serves every case
    _HAVE_GLUON = False

__all__ = [
    "PARTIAL_SLAB_ROWS",
    "choose_combine_block_h",
    "choose_splits",
    "gluon_eligible",
    "partial_bytes",
    "sparse_mla_attention",
    "split_layout",
]

_LOG2E = 1.4426950408889634

# Triton kernel's default launch shape for the GLM geometry (64 heads x 512 latent): all heads in one
# program, so every gathered latent row is read from memory exactly once per query row. 64 entries per tile:
# its fastest shape measured on the H200 (kernels/NOTES.md; 197 KB of shared memory; deeper pipelines with
# 32-entry tiles were slower).
_BLOCK_H = 64
_BLOCK_W = 64
_NUM_WARPS = 8
_NUM_STAGES = 2
# The Hopper (Gluon) kernel's launch shape: all 64 heads, two warpgroups, BLOCK_W-entry tiles in a ring of
# the most buffers that fit beside Q in shared memory (copies run NBUF - 1 tiles ahead of the products).
# 64-entry tiles with two buffers measured fastest on the H200 (32 / 16 entries with 4 / 8 buffers: slower).
_GLUON_BLOCK_H = 64
_GLUON_BLOCK_W = 64
_GLUON_NUM_WARPS = 8
_GLUON_NBUF = {64: 2, 32: 4, 16: 8}
# Operational switch, read once at import: "auto" (the Gluon kernel where `gluon_eligible`, the default) or
# "triton" (never the Gluon kernel).
_DEFAULT_IMPL = envs.SPARSE_MLA_IMPL.get()
# Rows per launch when the split count was not chosen for the rows (more rows than this and more than one split):
# bounds the fp32 partials to ~1.5 GB at the real model's 64 heads, 512 latent columns and 11 splits.
PARTIAL_SLAB_ROWS = 1024


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
    scale_ptr,
    stride_sp,
    stride_sr,
    R: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_W: tl.constexpr,
    RP: tl.constexpr,
    FINAL: tl.constexpr,
    FP32: tl.constexpr,
    LAT_FP8: tl.constexpr,
    SCALE_BLOCK: tl.constexpr,
    NB: tl.constexpr,
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
        if LAT_FP8:
            # FP8 latent (uint8 view): decode the codes from their bits (no fp8 cast, which the interpreter gets
            # wrong) and apply each 128-column block's power-of-two scale right after loading; the product is
            # exact in fp32 and in bf16 (a power-of-two multiple of a 4-bit-mantissa value).
            codes = tl.load(
                kv_ptr + (page * stride_kp + row * stride_kr)[:, None] + r[None, :],
                mask=ok[:, None] & r_ok[None, :],
                other=0,
            )
            # fp16 value * 2**-8 (exact), the 2**8 folded into the scale below.
            dec = e4m3_to_f16_scaled(codes.to(tl.int32)).to(tl.float32)
            scale_row = scale_ptr + page * stride_sp + row * stride_sr
            if RP % SCALE_BLOCK == 0:
                # Whole blocks: load each row's NB scales once ([BLOCK_W, RP // 128]) and broadcast them over their
                # 128 columns, instead of one scalar load per element.
                sb = tl.arange(0, RP // SCALE_BLOCK)
                sc = tl.load(scale_row[:, None] + sb[None, :], mask=ok[:, None] & (sb < NB)[None, :], other=0.0)
                kv = dec.reshape(BLOCK_W, RP // SCALE_BLOCK, SCALE_BLOCK) * (sc * 256.0)[:, :, None]
                kv = kv.reshape(BLOCK_W, RP)
            else:
                # A latent narrower than one block (small test models): every column reads its block's scale.
                sc = tl.load(
                    scale_row[:, None] + (r // SCALE_BLOCK)[None, :], mask=ok[:, None] & r_ok[None, :], other=0.0
                )
                kv = dec * (sc * 256.0)
            if not FP32:
                kv = kv.to(q.dtype)
        else:
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


if _HAVE_GLUON:

    @gluon.jit
    def _gl_load_tok(sel_row, w, w_hi):
        # Entries past the split read as -1 (skipped).
        return gl.load(sel_row + w, mask=w < w_hi, other=-1)

    @gluon.jit
    def _gl_load_page(table_row, tok, tok_hi, PAGE: gl.constexpr):
        # Skipped entries, pages past the table and a padding row's (empty) table give page = -1.
        return gl.load(table_row + tok // PAGE, mask=(tok >= 0) & (tok < tok_hi), other=-1)

    @gluon.jit
    def _gl_gather(dst, kv_ptr, ok_dst, tok, page, rr, num_pages, stride_kp, stride_kr, PAGE: gl.constexpr):
        # Asynchronous 16-byte copies of one tile's latent rows, one commit group per tile; masked rows are
        # zero-filled in shared memory without a global read. Each row's validity goes beside it (softmax mask).
        ok = (page >= 0) & (page < num_pages)
        off = page.to(gl.int64) * stride_kp + (tok % PAGE) * stride_kr
        cp.async_copy_global_to_shared(dst, kv_ptr + off[:, None] + rr[None, :], mask=ok[:, None])
        cp.commit_group()
        ok_dst.store(ok.to(gl.int8))

    @gluon.jit
    def _gluon_split_kernel(
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
        R: gl.constexpr,
        PAGE: gl.constexpr,
        BLOCK_H: gl.constexpr,
        BLOCK_W: gl.constexpr,
        NBUF: gl.constexpr,
        FINAL: gl.constexpr,
        P_IN_SMEM: gl.constexpr,
        DIAG: gl.constexpr,
        num_warps: gl.constexpr,
    ):
        dt: gl.constexpr = kv_ptr.dtype.element_ty
        WG: gl.constexpr = num_warps // 4
        # Gathers: 16 bytes per thread, 8 threads per 128-byte row segment, 4 rows per warp.
        GATHER: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [num_warps, 1], [1, 0])
        ROWS: gl.constexpr = gl.SliceLayout(1, GATHER)
        COLS: gl.constexpr = gl.SliceLayout(0, GATHER)
        # Both products split N across the warpgroups: S = Q C^T by entries, O = P C by latent columns
        # (each warpgroup owns O[:, half], 128 fp32 registers per thread).
        S_L: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, WG], instr_shape=[16, BLOCK_W // WG, 16]
        )
        O_L: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, WG], instr_shape=[16, R // WG, 16]
        )
        KV_SH: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_W, R], dt)
        Q_SH: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_H, R], dt)
        P_SH: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_H, BLOCK_W], dt)
        OK_SH: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0])

        hb = gl.program_id(0)
        split = gl.program_id(1)
        n = gl.program_id(2)
        n64 = n.to(gl.int64)
        # Shared memory: Q (64 KB), a ring of NBUF latent tiles (NBUF x BLOCK_W KB) with their row validity,
        # and P (BLOCK_W / 8 KB) if P_IN_SMEM.
        q_smem = gl.allocate_shared_memory(dt, [BLOCK_H, R], Q_SH)
        kv_smem = gl.allocate_shared_memory(dt, [NBUF, BLOCK_W, R], KV_SH)
        ok_smem = gl.allocate_shared_memory(gl.int8, [NBUF, BLOCK_W], OK_SH)
        if P_IN_SMEM:
            p_smem = gl.allocate_shared_memory(dt, [BLOCK_H, BLOCK_W], P_SH)
        hq = hb * BLOCK_H + gl.arange(0, BLOCK_H, layout=ROWS)
        rr = gl.arange(0, R, layout=COLS)
        cp.async_copy_global_to_shared(
            q_smem, q_ptr + n64 * stride_qn + hq[:, None] * stride_qh + rr[None, :], mask=(hq < H)[:, None]
        )

        w_lo = split * rows_per_split
        w_hi = gl.minimum(w_lo + rows_per_split, W)
        n_tiles = gl.cdiv(w_hi - w_lo, BLOCK_W)
        wr = w_lo + gl.arange(0, BLOCK_W, layout=ROWS)
        sel_row = sel_ptr + n64 * stride_sn
        # The first selection entries go out before the sequence id (independent loads, in flight together).
        tok = _gl_load_tok(sel_row, wr, w_hi)
        tok_next = _gl_load_tok(sel_row, wr + BLOCK_W, w_hi)
        seq = gl.load(seq_ptr + n).to(gl.int64)
        table_row = table_ptr + seq * stride_tb
        tok_hi = gl.where(seq >= 0, table_width * PAGE, 0)
        page = _gl_load_page(table_row, tok, tok_hi, PAGE)

        # Prologue: tiles 0 .. NBUF - 2 in flight (tile 0 with Q), one commit group per tile. Throughout, the
        # page lookups run one tile ahead of the copies and the selection loads two tiles ahead, so that the
        # copies never wait for a dependent load in the loop.
        for i in gl.static_range(NBUF - 1):
            if DIAG == 2:
                cp.commit_group()
            else:
                _gl_gather(
                    kv_smem.index(i), kv_ptr, ok_smem.index(i), tok, page, rr, num_pages, stride_kp, stride_kr, PAGE
                )
            tok = tok_next
            page = _gl_load_page(table_row, tok, tok_hi, PAGE)
            tok_next = _gl_load_tok(sel_row, wr + (i + 2) * BLOCK_W, w_hi)

        m_i = gl.full([BLOCK_H], float("-inf"), gl.float32, layout=gl.SliceLayout(1, S_L))
        l_i = gl.zeros([BLOCK_H], gl.float32, layout=gl.SliceLayout(1, S_L))
        o = gl.zeros([BLOCK_H, R], gl.float32, layout=O_L)
        s_zero = gl.zeros([BLOCK_H, BLOCK_W], gl.float32, layout=S_L)
        for t in range(n_tiles):
            cur = t % NBUF
            # Tile t has landed (this thread's copies; NBUF - 2 later tiles may still fly). The fence hands
            # the copies to the tensor cores' async proxy; the barrier makes every thread's copies visible and
            # proves that both warpgroups are done with tile t - 1, whose slot the next copy reuses.
            cp.wait_group(NBUF - 2)
            fence_async_shared()
            gl.thread_barrier()
            # Tile t + NBUF - 1 goes in flight; then the page lookup of the tile after it and the selection of
            # the one after that (plain loads: their latency hides behind this step's products).
            nxt = (t + NBUF - 1) % NBUF
            if DIAG == 2:
                cp.commit_group()
            else:
                _gl_gather(
                    kv_smem.index(nxt),
                    kv_ptr,
                    ok_smem.index(nxt),
                    tok,
                    page,
                    rr,
                    num_pages,
                    stride_kp,
                    stride_kr,
                    PAGE,
                )
            kv = kv_smem.index(cur)
            if DIAG == 1:
                s = s_zero
            else:
                s = warpgroup_mma(q_smem, kv.permute((1, 0)), s_zero, use_acc=False, is_async=True)
            tok = tok_next
            page = _gl_load_page(table_row, tok, tok_hi, PAGE)
            tok_next = _gl_load_tok(sel_row, wr + (t + NBUF + 1) * BLOCK_W, w_hi)
            ok = ok_smem.index(cur).load(gl.SliceLayout(0, S_L)) != 0
            if DIAG != 1:
                s = warpgroup_mma_wait(0, deps=(s,))
            s = gl.where(ok[None, :], s * qk_scale, float("-inf"))
            m_new = gl.maximum(m_i, gl.max(s, axis=1))
            # Until a head has seen a selected entry its max is -inf; shift by 0 then (no inf - inf NaN).
            m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = gl.exp2(m_i - m_use)
            p = gl.exp2(s - m_use[:, None])
            l_i = l_i * alpha + gl.sum(p, axis=1)
            m_i = m_new
            o = o * gl.convert_layout(alpha, gl.SliceLayout(1, O_L))[:, None]
            if DIAG == 1:
                o = o + gl.convert_layout(gl.sum(p, axis=1), gl.SliceLayout(1, O_L))[:, None]
            elif P_IN_SMEM:
                p_smem.store(p.to(dt))
                fence_async_shared()
                gl.thread_barrier()
                o = warpgroup_mma(p_smem, kv, o, is_async=True)
                o = warpgroup_mma_wait(0, deps=(o,))
            else:
                # Each warpgroup needs all of P as its register operand: the layout conversion exchanges the
                # two halves through shared memory (generic proxy, so no proxy fence while copies fly).
                p_op = gl.convert_layout(p.to(dt), gl.DotOperandLayout(operand_index=0, parent=O_L, k_width=2))
                o = warpgroup_mma(p_op, kv, o, is_async=True)
                o = warpgroup_mma_wait(0, deps=(o,))
        cp.wait_group(0)  # the last copies (fully masked)
        has = l_i > 0.0
        inv_l = gl.convert_layout(1.0 / gl.where(has, l_i, 1.0), gl.SliceLayout(1, O_L))
        has_o = gl.convert_layout(has, gl.SliceLayout(1, O_L))
        o = gl.where(has_o[:, None], o * inv_l[:, None], 0.0)
        ho = hb * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, O_L))
        ro = gl.arange(0, R, layout=gl.SliceLayout(0, O_L))
        o_ptrs = o_ptr + n64 * stride_on + split * stride_os + ho[:, None] * stride_oh + ro[None, :]
        if FINAL:
            gl.store(o_ptrs, o.to(o_ptr.dtype.element_ty), mask=(ho < H)[:, None])
        else:
            gl.store(o_ptrs, o, mask=(ho < H)[:, None])
            lse = gl.where(has, m_i + gl.log2(gl.where(has, l_i, 1.0)), float("-inf"))
            hl = hb * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, S_L))
            gl.store(lse_ptr + n64 * stride_ln + split * stride_ls + hl, lse, mask=hl < H)


@functools.cache
def _num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def choose_splits(
    n_rows: int, n_heads: int, width: int, device: torch.device, block_h: int, block_w: int,
    invariant: bool | None = None,
) -> int:  # fmt: skip
    """Split count over the ``width`` selected entries, from shapes only (graph-capture safe).

    Enough ``(head block, split, row)`` programs to fill the multiprocessors once (the default program
    holds one per SM), at least one tile of ``block_w`` entries per split, and no more splits than make the
    fp32 partials (``H * R * 4`` bytes per split and row) outweigh the latent rows they summarise
    (``width * R * 2`` bytes per row), i.e. at most ``width / (2 H)`` splits -- except when one-tile splits
    of every row fit in half the machine: then each program's chain of tiles, not the partials' bytes, sets
    the time, and every split gets one tile. H200, W = 2051 (33 tiles), graph replay: one row 15.1 us split
    33 ways against 19.2 us split 11 ways (the bytes cap), two rows 15.8 against 19.7; at four rows 33 splits
    (a full wave, partials twice the latent rows) take 19.6 us and the capped 11 splits 17.9 us
    (`benchmarks/results/kernels/sparse_mla_small_rows_h200_2026-12-03.log`).

    Args:
        n_rows: query rows ``N``. n_heads: heads ``H``. width: selection width ``W``.
        device: where the kernel runs (its multiprocessor count sets the target).
        block_h: heads per program. block_w: entries per tile.
        invariant: the numerics mode to choose for (default: the process's).

    In the batch-invariant mode (`trtllm_glm.numerics.batch_invariant`) the count depends on the width and the
    heads only, never on ``n_rows`` or the device: the bytes cap above (``min(width / (2 H), tiles)``, 16
    requested, 11 after `split_layout`, for W = 2051 and 64 heads), the balanced choice between one row (which
    alone would take one-tile splits) and a full batch. The split layout sets where the online softmax restarts
    and how the combine weighs the parts, so a row then rounds the same alone, in any batch, as a decode or a
    verify row.

    Returns:
        The split count (``>= 1``).
    """
    tiles = max(1, triton.cdiv(width, block_w))
    if batch_invariant() if invariant is None else invariant:
        return max(1, min(width // (2 * n_heads), tiles))
    target = _num_programs_target(device)
    programs_per_split = max(1, n_rows * triton.cdiv(n_heads, block_h))
    if programs_per_split * tiles <= target // 2:
        return tiles
    return max(1, min(target // programs_per_split, max(1, width // (2 * n_heads)), tiles))


def choose_combine_block_h(n_rows: int, n_heads: int, device: torch.device) -> int:
    """Heads per program of the split combine: the widest of 8 / 4 / 2 whose grid still fills the machine.

    Each combine program reads ``splits x block_h`` fp32 partial rows one after another, so with few query
    rows wide head blocks leave most multiprocessors idle and each busy one reads longer (H200, one row, 11
    splits: 17.3 us with one head per program against 19.2 us with eight). The choice follows the number of
    rows even in the batch-invariant mode: a head's result does not depend on it (per head the combine is
    elementwise over the splits, in split order, and its max is exact; tests check the bits).

    Args:
        n_rows: query rows ``N``. n_heads: heads ``H``.
        device: where the kernel runs.

    Returns:
        ``block_h`` in 8 / 4 / 2 / 1.
    """
    target = _num_programs_target(device)
    for cb in (8, 4, 2):
        if triton.cdiv(n_heads, cb) * n_rows >= target:
            return cb
    return 1


def _num_programs_target(device: torch.device) -> int:
    # One program per multiprocessor; the CPU interpreter has no such limit, a small constant keeps its grids
    # (and the tests' split counts) small.
    if device.type != "cuda":
        return 8
    return _num_sms(device.index if device.index is not None else torch.cuda.current_device())


def partial_bytes(n_rows: int, n_heads: int, width: int, rank: int, splits: int, block_w: int = _BLOCK_W) -> int:
    """Bytes of the fp32 partials (``o`` and log-sum-exp) that `sparse_mla_attention` allocates for ``n_rows``
    rows at ``splits`` requested splits: none with one split, at most `PARTIAL_SLAB_ROWS` rows' worth."""
    _, splits = split_layout(width, block_w, splits)
    if splits == 1:
        return 0
    return min(n_rows, PARTIAL_SLAB_ROWS) * splits * n_heads * (rank + 1) * 4


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


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def gluon_eligible(q_abs: torch.Tensor, latent_cache: torch.Tensor) -> bool:
    """Whether the Hopper kernel (`_gluon_split_kernel`) can serve these tensors.

    It needs Gluon, an sm_90 device, bf16 or fp16 queries and cache of one dtype, a 512-wide latent (its
    layouts and its 205 KB of shared memory are sized for it) and 16-byte aligned rows (the gathers are
    16-byte ``cp.async`` copies). Everything else goes to the Triton kernel.

    Args:
        q_abs: ``[N, H, R]`` absorbed queries.
        latent_cache: ``[num_pages, P, R]`` latent plane.

    Returns:
        True when the Gluon kernel applies.
    """
    if not _HAVE_GLUON or INTERPRETED or q_abs.device.type != "cuda":
        return False
    index = q_abs.device.index if q_abs.device.index is not None else torch.cuda.current_device()
    if _capability(index) != (9, 0):
        return False
    if q_abs.dtype not in (torch.bfloat16, torch.float16) or latent_cache.dtype != q_abs.dtype:
        return False
    if q_abs.shape[-1] != 512:
        return False
    strides = (q_abs.stride(0), q_abs.stride(1), latent_cache.stride(0), latent_cache.stride(1))
    return all(st % 16 == 0 for st in strides) and q_abs.data_ptr() % 16 == 0 and latent_cache.data_ptr() % 16 == 0


def sparse_mla_attention(
    q_abs: torch.Tensor,
    latent_cache: torch.Tensor,
    sel: torch.Tensor,
    row_seq: torch.Tensor,
    slot_table: torch.Tensor,
    page_size: int,
    softmax_scale: float,
    *,
    latent_scale: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    splits: int | None = None,
    impl: str | None = None,
    block_h: int | None = None,
    block_w: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    combine_block_h: int | None = None,
    gluon_nbuf: int | None = None,
    gluon_p_smem: bool = True,
    gluon_diag: int = 0,
) -> torch.Tensor:
    """Sparse MLA over selected latent rows; see the package's `sparse_mla_attention`.

    Args:
        q_abs: ``[N, H, R]`` absorbed queries (last dim contiguous).
        latent_cache: ``[num_pages, P, R]`` latent plane (last dim contiguous; model dtype or float8_e4m3fn).
        sel: ``[N, W]`` int token positions, ``-1`` = skip, any order.
        row_seq: ``[N]`` int sequence index of each row (``< 0``: padding row, outputs zeros).
        slot_table: ``[B, max_pages]`` int raw page ids.
        page_size: tokens per page ``P``.
        softmax_scale: logit scale.
        latent_scale: ``[num_pages, P, ceil(R / 128)]`` fp32 block scales of an FP8 plane (required with one,
            refused without; last dim contiguous). FP8 rows go to the Triton kernel, never the Gluon one.
        out: optional ``[N, H, R]`` buffer of ``q_abs``'s dtype to write into.
        splits: split count over ``W`` (default: `choose_splits`); tuning only.
        impl: ``"gluon"`` (the Hopper kernel; the default where `gluon_eligible`) or ``"triton"``; tuning
            and tests only.
        block_h, block_w, num_warps, num_stages: launch shape (the Gluon kernel takes ``block_w`` in 16 / 32
            / 64 and always runs 64 heads on 8 warps); tuning only.
        combine_block_h: heads per combine program (default: `choose_combine_block_h`); tuning only.
        gluon_nbuf: Gluon kernel: tiles in its shared-memory ring (default: the most that fit); tuning only.
        gluon_p_smem: Gluon kernel: pass P to the second product through shared memory (else through
            registers, exchanged by a layout conversion); tuning only.
        gluon_diag: Gluon kernel, benchmark diagnostics only (wrong results): 1 skips both products, 2 skips
            the latent-row copies.

    Returns:
        ``[N, H, R]`` latent outputs in ``q_abs``'s dtype.

    Raises:
        ValueError: shapes, dtypes or layouts disagree, or ``impl="gluon"`` where it does not apply.
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
    lat_fp8 = check_latent_planes(latent_cache, latent_scale)
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

    if impl is None:
        impl = "gluon" if _DEFAULT_IMPL != "triton" and gluon_eligible(q_abs, latent_cache) else "triton"
    elif impl == "gluon" and not gluon_eligible(q_abs, latent_cache):
        raise ValueError("the Gluon sparse MLA kernel needs sm_90, bf16/fp16, R = 512 and 16-byte aligned rows")
    elif impl not in ("gluon", "triton"):
        raise ValueError(f"impl must be 'gluon' or 'triton', got {impl!r}")
    use_gluon = impl == "gluon"
    if lat_fp8:
        # Dequantised rows are multiplied in the queries' dtype: on the tensor cores for bf16/fp16 queries.
        fp32 = INTERPRETED or q_abs.dtype == torch.float32
    else:
        fp32 = INTERPRETED or q_abs.dtype != latent_cache.dtype or latent_cache.dtype == torch.float32
    if use_gluon:
        block_h, num_warps = _GLUON_BLOCK_H, _GLUON_NUM_WARPS
        block_w = block_w or _GLUON_BLOCK_W
        if block_w not in _GLUON_NBUF:
            raise ValueError(f"the Gluon kernel takes block_w in {sorted(_GLUON_NBUF)}, got {block_w}")
        nbuf = gluon_nbuf or _GLUON_NBUF[block_w]
    elif fp32 and not INTERPRETED:
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
    if num_stages is None:
        num_stages = _NUM_STAGES
    rp = triton.next_power_of_2(rank)
    if splits is None:
        splits = choose_splits(n_rows, n_heads, width, q_abs.device, block_h, block_w)
    rows_per_split, splits = split_layout(width, block_w, splits)
    if splits > 1 and n_rows > PARTIAL_SLAB_ROWS:
        # Many rows at a split count they did not choose (the batch-invariant mode's prefill chunks): the fp32
        # partials are [rows, splits, H, R] (11.8 GB for 8,192 rows of the real model), so run slabs of rows with
        # the same launch; a row's result does not depend on the other rows of its launch.
        if combine_block_h is None:
            combine_block_h = choose_combine_block_h(n_rows, n_heads, q_abs.device)
        for r0 in range(0, n_rows, PARTIAL_SLAB_ROWS):
            r1 = min(n_rows, r0 + PARTIAL_SLAB_ROWS)
            sparse_mla_attention(
                q_abs[r0:r1], latent_cache, sel[r0:r1], row_seq[r0:r1], slot_table, page_size, softmax_scale,
                latent_scale=latent_scale, out=out[r0:r1], splits=splits, impl="gluon" if use_gluon else "triton",
                block_h=block_h, block_w=block_w, num_warps=num_warps, num_stages=num_stages,
                combine_block_h=combine_block_h, gluon_nbuf=gluon_nbuf, gluon_p_smem=gluon_p_smem,
                gluon_diag=gluon_diag,
            )  # fmt: skip
        return out
    head_blocks = triton.cdiv(n_heads, block_h)
    # The interpreter rounds fp32 -> bf16 stores incorrectly: write fp32 there and cast with torch.
    dst = out
    if INTERPRETED and out.dtype == torch.bfloat16:
        dst = torch.empty(out.shape, dtype=torch.float32, device=out.device)
    if splits == 1:
        o_buf, lse_buf = dst, dst
        o_strides = (dst.stride(0), 0, dst.stride(1))
        lse_strides = (0, 0)
    else:
        o_buf = torch.empty(n_rows, splits, n_heads, rank, dtype=torch.float32, device=q_abs.device)
        lse_buf = torch.empty(n_rows, splits, n_heads, dtype=torch.float32, device=q_abs.device)
        o_strides = (o_buf.stride(0), o_buf.stride(1), o_buf.stride(2))
        lse_strides = (lse_buf.stride(0), lse_buf.stride(1))
    args = (
        q_abs,
        latent_cache.view(torch.uint8) if lat_fp8 else latent_cache,
        sel,
        row_seq,
        slot_table,
        o_buf,
        lse_buf,
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
        *o_strides,
        *lse_strides,
        float(softmax_scale) * _LOG2E,
    )
    grid = (head_blocks, splits, n_rows)
    if use_gluon:
        _gluon_split_kernel[grid](
            *args,
            R=rank,
            PAGE=page_size,
            BLOCK_H=block_h,
            BLOCK_W=block_w,
            NBUF=nbuf,
            FINAL=splits == 1,
            P_IN_SMEM=gluon_p_smem,
            DIAG=gluon_diag,
            num_warps=num_warps,
        )
    else:
        # The scale plane (FP8 latent) or, never read, the latent plane as a valid pointer.
        scale_args = (
            (latent_scale, latent_scale.stride(0), latent_scale.stride(1))
            if latent_scale is not None
            else (latent_cache, 0, 0)
        )
        _split_kernel[grid](
            *args,
            *scale_args,
            R=rank,
            PAGE=page_size,
            BLOCK_H=block_h,
            BLOCK_W=block_w,
            RP=rp,
            FINAL=splits == 1,
            FP32=fp32,
            LAT_FP8=lat_fp8,
            SCALE_BLOCK=LATENT_SCALE_BLOCK,
            NB=latent_scale_blocks(rank),
            num_warps=num_warps,
            num_stages=num_stages,
        )
    if splits > 1:
        if combine_block_h is None:
            combine_block_h = choose_combine_block_h(n_rows, n_heads, q_abs.device)
        cb = min(combine_block_h, triton.next_power_of_2(n_heads))
        _combine_kernel[(triton.cdiv(n_heads, cb), n_rows)](
            o_buf,
            lse_buf,
            dst,
            n_heads,
            splits,
            o_buf.stride(0),
            o_buf.stride(1),
            o_buf.stride(2),
            lse_buf.stride(0),
            lse_buf.stride(1),
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
