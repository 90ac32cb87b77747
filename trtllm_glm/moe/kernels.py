"""Triton fused MoE: routed experts as two grouped GEMMs over expert-sorted pairs (decode, verify and prefill).

`fused_moe` is a drop-in for `ops.fused_moe_ref` (same arguments, ``[N, H]`` fp32 result), bit-deterministic (no
atomics: one fp32 row per pair, summed in slot order). The four steps, dead rows, numerics and block-FP8 experts:
docs/kernels.md, "Fused MoE".
"""

from __future__ import annotations

import importlib.util
import sys
import threading
import types

import torch
import triton
import triton.language as tl

from .. import envs
from ..numerics import batch_invariant
from .ops import FP8_BLOCK, check_fused_moe_args, padded_pairs_bound
from .ops import moe_align as torch_moe_align

__all__ = ["fused_moe", "moe_align", "default_block_m", "large_m_launch", "default_align", "INTERPRETED"]

# Fixed when this module is imported: the CPU path imports an interpreted copy of this file.
INTERPRETED: bool = bool(triton.knobs.runtime.interpret)

_INTERP_NAME = "trtllm_glm.moe._kernels_interpreted"
ALIGN_ENV = envs.MOE_ALIGN.name
_interp_lock = threading.Lock()
# Pairs (rounded up to a power of two) up to which `moe_align` sorts them all at once in registers
# (`_align_sort_kernel`); larger batches (prefill-sized) take the torch ops of `ops.moe_align`. Past 4096 the
# register sort spills on sm_90 (64 registers per thread at 2048 pairs, 106 at 4096).
SORT_ALIGN_MAX_PAIRS = 4096


@triton.jit
def _pow2_fp16(a):
    """``[M, K]`` activations -> ``(a / p`` in fp16, ``p [M]`` fp32``)``: ``p`` a power of two per row that puts the
    row's largest ``|a|`` in ``[2^14, 2^15)``. Exact for bf16 inputs (8 significant bits in fp16's 11, scaled by a
    power of two) except for entries more than ~30 binades below their row's largest, which round in fp16's
    subnormals (an error below ``2^-40`` of the row's largest)."""
    af = a.to(tl.float32)
    amax = tl.max(tl.abs(af), axis=1)
    e = (amax.to(tl.int32, bitcast=True) >> 23) & 0xFF
    pe = tl.maximum(e - 14, 1)  # a zero (padding) row: p = 2^-126, its zeros stay zeros
    p = (pe << 23).to(tl.float32, bitcast=True)
    inv = ((254 - pe) << 23).to(tl.float32, bitcast=True)
    return (af * inv[:, None]).to(tl.float16), p


@triton.jit
def _gate_up_kernel(
    x_ptr,
    w_ptr,
    sorted_ptr,
    block_expert_ptr,
    inter_ptr,
    n_pairs,
    top_k,
    H,
    I,
    stride_x,
    stride_we,
    stride_wn,
    stride_inter,
    limit,
    s_ptr,
    stride_se,
    stride_sn,
    stride_sk,
    s_up_row,
    HAS_LIMIT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    IEEE: tl.constexpr,
    UPCAST: tl.constexpr,
    FP8: tl.constexpr,
    A_POW2: tl.constexpr,
    SCALE_BLOCK: tl.constexpr,
):
    b = tl.program_id(0)
    expert = tl.load(block_expert_ptr + b)
    if expert >= 0:
        slots = b * BLOCK_M + tl.arange(0, BLOCK_M)
        pair = tl.load(sorted_ptr + slots)
        valid = pair < n_pairs
        tok = tl.where(valid, pair // top_k, 0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < I
        kk = tl.arange(0, BLOCK_K)
        x_rows = x_ptr + tok[:, None] * stride_x
        # Weight tiles are loaded as [BLOCK_K, BLOCK_N] (k runs along memory), the dot's B operand.
        wg_base = w_ptr + expert.to(tl.int64) * stride_we + cols[None, :].to(tl.int64) * stride_wn
        wu_base = wg_base + I * stride_wn
        acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        if FP8:
            # BLOCK_N and BLOCK_K divide the scale tile: a program's columns share one tile row (the gate's, and
            # the up's `s_up_row` rows further), and each K step lies inside one tile column.
            s_g = s_ptr + expert.to(tl.int64) * stride_se + (tl.program_id(1) * BLOCK_N // SCALE_BLOCK) * stride_sn
            s_u = s_g + s_up_row * stride_sn
        for k0 in range(0, H, BLOCK_K):
            k = k0 + kk
            if EVEN_K:
                a = tl.load(x_rows + k[None, :], mask=valid[:, None], other=0.0)
                wg = tl.load(wg_base + k[:, None], mask=col_ok[None, :], other=0.0)
                wu = tl.load(wu_base + k[:, None], mask=col_ok[None, :], other=0.0)
            else:
                k_ok = k < H
                a = tl.load(x_rows + k[None, :], mask=valid[:, None] & k_ok[None, :], other=0.0)
                wg = tl.load(wg_base + k[:, None], mask=k_ok[:, None] & col_ok[None, :], other=0.0)
                wu = tl.load(wu_base + k[:, None], mask=k_ok[:, None] & col_ok[None, :], other=0.0)
            if UPCAST:
                a = a.to(tl.float32)
                wg = wg.to(tl.float32)
                wu = wu.to(tl.float32)
            if FP8:
                # e4m3 values are exact in fp16 / fp32: the dot multiplies the stored codes' values, the tile
                # scale comes after it, in fp32 (no rounding of w * scale to the activation dtype). fp16, not
                # bf16, operands: e4m3 -> fp16 is one packed conversion per two weights, e4m3 -> bf16 two more
                # (the conversions, not the bytes, would bound the kernel); bf16 activations go to fp16 exactly
                # after a power-of-two scaling per row (`_pow2_fp16`), undone on the fp32 partial product.
                sg = tl.load(s_g + (k0 // SCALE_BLOCK) * stride_sk)
                su = tl.load(s_u + (k0 // SCALE_BLOCK) * stride_sk)
                if IEEE:
                    acc_g += tl.dot(a, wg.to(tl.float32), input_precision="ieee") * sg
                    acc_u += tl.dot(a, wu.to(tl.float32), input_precision="ieee") * su
                elif A_POW2:
                    a16, p = _pow2_fp16(a)
                    acc_g += tl.dot(a16, wg.to(tl.float16)) * (p[:, None] * sg)
                    acc_u += tl.dot(a16, wu.to(tl.float16)) * (p[:, None] * su)
                else:
                    a16 = a.to(tl.float16)
                    acc_g += tl.dot(a16, wg.to(tl.float16)) * sg
                    acc_u += tl.dot(a16, wu.to(tl.float16)) * su
            elif IEEE:
                acc_g = tl.dot(a, wg, acc_g, input_precision="ieee")
                acc_u = tl.dot(a, wu, acc_u, input_precision="ieee")
            else:
                acc_g = tl.dot(a, wg, acc_g)
                acc_u = tl.dot(a, wu, acc_u)
        if HAS_LIMIT:
            acc_g = tl.minimum(acc_g, limit)
            acc_u = tl.minimum(tl.maximum(acc_u, -limit), limit)
        # silu(g) * u in fp32; padding rows loaded zeros, so they store exact zeros.
        h = acc_g * tl.sigmoid(acc_g) * acc_u
        dst = inter_ptr + slots[:, None].to(tl.int64) * stride_inter + cols[None, :]
        tl.store(dst, h.to(inter_ptr.dtype.element_ty), mask=col_ok[None, :])


@triton.jit
def _down_kernel(
    inter_ptr,
    w_ptr,
    sorted_ptr,
    block_expert_ptr,
    topk_w_ptr,
    out_ptr,
    n_pairs,
    H,
    I,
    stride_inter,
    stride_we,
    stride_wn,
    stride_out,
    s_ptr,
    stride_se,
    stride_sn,
    stride_sk,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    IEEE: tl.constexpr,
    UPCAST: tl.constexpr,
    FP8: tl.constexpr,
    A_POW2: tl.constexpr,
    SCALE_BLOCK: tl.constexpr,
):
    b = tl.program_id(0)
    expert = tl.load(block_expert_ptr + b)
    if expert >= 0:
        slots = b * BLOCK_M + tl.arange(0, BLOCK_M)
        pair = tl.load(sorted_ptr + slots)
        valid = pair < n_pairs
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < H
        kk = tl.arange(0, BLOCK_K)
        a_rows = inter_ptr + slots[:, None].to(tl.int64) * stride_inter
        w_base = w_ptr + expert.to(tl.int64) * stride_we + cols[None, :].to(tl.int64) * stride_wn
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        if FP8:
            s_w = s_ptr + expert.to(tl.int64) * stride_se + (tl.program_id(1) * BLOCK_N // SCALE_BLOCK) * stride_sn
        for k0 in range(0, I, BLOCK_K):
            k = k0 + kk
            if EVEN_K:
                a = tl.load(a_rows + k[None, :])
                w = tl.load(w_base + k[:, None], mask=col_ok[None, :], other=0.0)
            else:
                k_ok = k < I
                a = tl.load(a_rows + k[None, :], mask=k_ok[None, :], other=0.0)
                w = tl.load(w_base + k[:, None], mask=k_ok[:, None] & col_ok[None, :], other=0.0)
            if UPCAST:
                a = a.to(tl.float32)
                w = w.to(tl.float32)
            if FP8:
                # As in `_gate_up_kernel`: fp16 operands, the tile scale on the fp32 partial product.
                sw = tl.load(s_w + (k0 // SCALE_BLOCK) * stride_sk)
                if IEEE:
                    acc += tl.dot(a, w.to(tl.float32), input_precision="ieee") * sw
                elif A_POW2:
                    a16, p = _pow2_fp16(a)
                    acc += tl.dot(a16, w.to(tl.float16)) * (p[:, None] * sw)
                else:
                    acc += tl.dot(a.to(tl.float16), w.to(tl.float16)) * sw
            elif IEEE:
                acc = tl.dot(a, w, acc, input_precision="ieee")
            else:
                acc = tl.dot(a, w, acc)
        pair64 = tl.where(valid, pair, 0).to(tl.int64)
        wt = tl.load(topk_w_ptr + pair64, mask=valid, other=0.0)
        acc = acc * wt[:, None]
        dst = out_ptr + pair64[:, None] * stride_out + cols[None, :]
        tl.store(dst, acc, mask=valid[:, None] & col_ok[None, :])


@triton.jit
def _combine_kernel(
    pair_ptr,
    live_ptr,
    ids_ptr,
    out_ptr,
    top_k,
    H,
    e_start,
    n_experts,
    HAS_LIVE: tl.constexpr,
    HAS_RANGE: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """``out[n] = sum_j pair_out[n * k + j]`` in order ``j = 0 .. k - 1`` (0 for a dead row: nothing read;
    with ``HAS_RANGE`` only the pairs of experts ``[e_start, e_start + n_experts)``, the others never written)."""
    n = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    ok = cols < H
    if HAS_LIVE:
        ok_read = ok & (tl.load(live_ptr + n) != 0)
    else:
        ok_read = ok
    acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
    for j in range(0, top_k):
        ok_j = ok_read
        if HAS_RANGE:
            e = tl.load(ids_ptr + n * top_k + j).to(tl.int32)
            ok_j = ok_j & (e >= e_start) & (e < e_start + n_experts)
        acc += tl.load(pair_ptr + (n * top_k + j) * H + cols, mask=ok_j, other=0.0)
    tl.store(out_ptr + n * H + cols, acc, mask=ok)


# The counts vary with the batch's rows: specialising on them (Triton's ``% 16`` / ``== 1`` variants of int
# arguments) compiled a new variant for a batch the start-up warm-up had not met (an H100 server at concurrency
# 64 compiled this kernel while serving: a stall). P_PAD, BLOCK_M and HAS_LIVE are the variants that matter.
@triton.jit(do_not_specialize=["n_pairs", "n_slots", "n_blocks"])
def _align_sort_kernel(
    ids_ptr,
    live_ptr,
    sorted_ptr,
    block_expert_ptr,
    offset_ptr,
    n_pairs,
    top_k,
    n_experts,
    e_start,
    n_slots,
    n_blocks,
    HAS_LIVE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_E: tl.constexpr,
    P_PAD: tl.constexpr,
    CHUNK: tl.constexpr,
):
    """One program, every pair in registers: `ops.moe_align`'s layout from one sort of (expert, pair) keys.

    The only global round trip is the per-expert slot offset: a short dependency chain whatever the pair count.
    """
    q = tl.arange(0, P_PAD)
    ok = q < n_pairs
    ids = tl.load(ids_ptr + q, mask=ok, other=0).to(tl.int32)
    if HAS_LIVE:
        ok = ok & (tl.load(live_ptr + q // top_k, mask=ok, other=0) != 0)
    # Expert parallelism: another rank's experts are left out like dead rows; ids relative to this rank's block.
    ids = ids - e_start
    ok = ok & (ids >= 0) & (ids < n_experts)
    # Dead and padding lanes sort after every real run under the virtual expert `n_experts` (a spare bin).
    e = tl.where(ok, ids, n_experts)
    counts = tl.histogram(e, BLOCK_E)
    e_idx = tl.arange(0, BLOCK_E)
    counts = tl.where(e_idx < n_experts, counts, 0)
    padded = (counts + (BLOCK_M - 1)) // BLOCK_M * BLOCK_M
    pad_start = tl.cumsum(padded, 0) - padded
    run_start = tl.cumsum(counts, 0) - counts
    # Sorted position i of a pair of expert e goes to slot i + (pad_start[e] - run_start[e]).
    tl.store(offset_ptr + e_idx, pad_start - run_start, mask=e_idx < n_experts)
    # Padding slots and unused blocks first; the pairs overwrite theirs after the barrier.
    c_idx = tl.arange(0, CHUNK)
    for s0 in range(0, n_slots, CHUNK):
        s = s0 + c_idx
        tl.store(sorted_ptr + s, tl.full((CHUNK,), 0, tl.int32) + n_pairs, mask=s < n_slots)
    for b0 in range(0, n_blocks, CHUNK):
        b = b0 + c_idx
        tl.store(block_expert_ptr + b, tl.full((CHUNK,), -1, tl.int32), mask=b < n_blocks)
    # Keys (expert, pair) in one int32: ascending pair id within each run, as the reference's stable sort.
    key = tl.sort(e * P_PAD + q)
    e_s = key // P_PAD
    q_s = key % P_PAD
    live = e_s < n_experts
    tl.debug_barrier()
    dest = q + tl.load(offset_ptr + e_s, mask=live, other=0)
    tl.store(sorted_ptr + dest, q_s, mask=live)
    # Every block of a run holds at least one pair (a run is padded by less than a block), so the pairs name
    # every used block's expert; equal values written by several lanes of a block are a benign race.
    tl.store(block_expert_ptr + dest // BLOCK_M, e_s, mask=live)


def default_align() -> str:
    """Pair sorting `fused_moe` uses unless told: ``TRTLLM_GLM_MOE_ALIGN`` (read per call, so one process can A/B
    it; a captured graph keeps what it was captured with) or ``"triton"``."""
    return envs.MOE_ALIGN.get()


def moe_align(
    topk_ids: torch.Tensor,
    num_experts: int,
    block_m: int,
    row_live: torch.Tensor | None = None,
    expert_start: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Kernel version of `ops.moe_align` (identical output): one single-program launch instead of ~20 torch ops.

    Up to `SORT_ALIGN_MAX_PAIRS` pairs (``N * k`` rounded up to a power of two); larger batches run the torch
    ops themselves (as fast there, and no register spills).

    Args:
        topk_ids: ``[N, k]`` int expert ids in ``[0, E)``.
        num_experts: ``E``.
        block_m: row block ``M``.
        row_live: optional ``[N]`` int or bool flags; the pairs of rows flagged 0 are left out.
        expert_start: this rank's first expert (expert parallelism; `ops.moe_align`).

    Returns:
        ``(sorted_pairs [L] int32, block_expert [L // M] int32)``, as `ops.moe_align`.
    """
    if INTERPRETED or topk_ids.device.type == "cuda":
        return _moe_align(topk_ids, num_experts, block_m, row_live, expert_start)
    from trtllm_glm.triton_interp import interpreting as _interpreting

    mod = _interpreted_module()
    with _interpreting():
        return mod._moe_align(topk_ids, num_experts, block_m, row_live, expert_start)


def _moe_align(
    topk_ids: torch.Tensor,
    num_experts: int,
    block_m: int,
    row_live: torch.Tensor | None,
    expert_start: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    dev = topk_ids.device
    ids = topk_ids.reshape(-1)
    if not ids.is_contiguous():
        ids = ids.contiguous()
    p = ids.numel()
    if row_live is not None and row_live.shape != (topk_ids.shape[0],):
        raise ValueError(f"row_live must be [N={topk_ids.shape[0]}], got {tuple(row_live.shape)}")
    p_pad = max(16, triton.next_power_of_2(p))
    if p_pad > SORT_ALIGN_MAX_PAIRS:
        return torch_moe_align(topk_ids, num_experts, block_m, row_live, expert_start)
    slots = padded_pairs_bound(p, num_experts, block_m)
    n_blocks = slots // block_m
    sorted_pairs = torch.empty(slots, dtype=torch.int32, device=dev)
    block_expert = torch.empty(n_blocks, dtype=torch.int32, device=dev)
    if n_blocks == 0:
        return sorted_pairs, block_expert
    offset = torch.empty(num_experts, dtype=torch.int32, device=dev)
    # One spare bin past the experts (BLOCK_E): the dead pairs' virtual expert.
    _align_sort_kernel[(1,)](
        ids, _live_arg(row_live, ids), sorted_pairs, block_expert, offset, p, max(1, topk_ids.shape[1]),
        num_experts, expert_start, slots, n_blocks, HAS_LIVE=row_live is not None, BLOCK_M=block_m,
        BLOCK_E=triton.next_power_of_2(num_experts + 1), P_PAD=p_pad, CHUNK=256,
        num_warps=4 if p_pad <= 1024 else 8,
    )  # fmt: skip
    return sorted_pairs, block_expert


def _live_arg(row_live: torch.Tensor | None, fallback: torch.Tensor) -> torch.Tensor:
    """``row_live`` as a contiguous int tensor a kernel can load (``fallback``, never read, when absent)."""
    if row_live is None:
        return fallback
    if row_live.dtype == torch.bool:
        row_live = row_live.view(torch.uint8)
    return row_live if row_live.is_contiguous() else row_live.contiguous()


# Batch-invariant mode (`trtllm_glm.numerics`): the row block and the columns per program, the same for any number
# of pairs, so a pair's MMA tiles never depend on the step's other rows (the decode defaults: rows are few there).
INVARIANT_BLOCK_M = 16
INVARIANT_BLOCK_N = 32


def default_block_m(num_pairs: int, num_experts: int) -> int:
    """Row block ``M``: 16 (the smallest tensor-core tile) while experts average at most ~16 pairs, else 64;
    `INVARIANT_BLOCK_M` in the batch-invariant mode."""
    if batch_invariant():
        return INVARIANT_BLOCK_M
    return 16 if num_pairs <= 16 * num_experts else 64


# Pairs per expert on average from which `fused_moe` takes the large-M launch (`large_m_launch`): prefill chunks.
# At 128 pairs an expert's run fills two 64-row blocks and its padding wastes at most a third of a block per run.
LARGE_M_PAIRS_PER_EXPERT = 128


def large_m_launch(num_pairs: int, num_experts: int) -> dict[str, object] | None:
    """Launch of both grouped GEMMs for prefill-sized batches (``None``: the decode defaults apply).

    At decode sizes each expert holds a few pairs and the kernels are bound by the weight bytes; at prefill sizes
    (``num_pairs >= LARGE_M_PAIRS_PER_EXPERT * num_experts``, e.g. 8 x 288 x 128 pairs = 4,608 rows of the real
    model) each expert's weights are reused over hundreds of rows and the kernels are bound by the tensor cores:
    64-row blocks, narrower K steps (64) software-pipelined over 4 stages, and a 128-wide down tile (one fp32
    accumulator: 64 registers per thread at 4 warps; the gate_up kernel keeps 64 columns for its two
    accumulators). Shared memory: 24 KB per stage in both kernels (bf16). FP8 weights keep the same tiles
    (128 divides them: one scale per K step and column block).

    Returns:
        ``{"block_m", "block_n": (gate_up, down), "block_k": (gate_up, down), "num_warps", "num_stages"}``;
        ``None`` in the batch-invariant mode too.
    """
    if num_pairs < LARGE_M_PAIRS_PER_EXPERT * num_experts or batch_invariant():
        # Batch-invariant mode (`trtllm_glm.numerics`): no launch may depend on the number of rows.
        return None
    return {"block_m": 64, "block_n": (64, 128), "block_k": (64, 64), "num_warps": 4, "num_stages": 4}


def _block_n(n_blocks: int, width: int, wide: int = 64) -> int:
    """Columns per program: ``wide`` unless that leaves fewer than ~1024 programs (small N: fill the SMs);
    `INVARIANT_BLOCK_N` in the batch-invariant mode."""
    if batch_invariant():
        return INVARIANT_BLOCK_N
    return wide if n_blocks * triton.cdiv(width, wide) >= 1024 else max(16, wide // 2)


def _scratch(
    scratch: dict[str, torch.Tensor] | None, name: str, shape: tuple[int, int], dtype: torch.dtype, dev: torch.device
) -> torch.Tensor:
    """``scratch[name]`` when it already holds a matching buffer (reused as is), else a new one (stored there)."""
    buf = scratch.get(name) if scratch is not None else None
    if buf is None or tuple(buf.shape) != shape or buf.dtype != dtype or buf.device != dev or not buf.is_contiguous():
        buf = torch.empty(shape, dtype=dtype, device=dev)
        if scratch is not None:
            scratch[name] = buf
    return buf


def _fused_moe(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_w: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    swiglu_limit: float | None,
    out: torch.Tensor | None,
    block_m: int | None,
    block_n: tuple[int | None, int | None],
    block_k: tuple[int, int] | None,
    num_warps: int | None,
    num_stages: int | None,
    scratch: dict[str, torch.Tensor] | None,
    align: str,
    row_live: torch.Tensor | None,
    w_gate_up_scale: torch.Tensor | None,
    w_down_scale: torch.Tensor | None,
    expert_start: int | None = None,
    fp8_block: int = FP8_BLOCK,
) -> torch.Tensor:
    """The launches of this copy of the module (compiled or interpreted); see `fused_moe`."""
    n, h, k, e, inter = check_fused_moe_args(
        x, topk_ids, topk_w, w_gate_up, w_down, row_live, w_gate_up_scale, w_down_scale, fp8_block
    )
    fp8 = w_gate_up_scale is not None
    dev = x.device
    if out is None:
        out = torch.empty(n, h, dtype=torch.float32, device=dev)
    elif out.shape != (n, h) or out.dtype != torch.float32 or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous [N={n}, H={h}] fp32 tensor, got {tuple(out.shape)} {out.dtype}")
    if n == 0 or k == 0:
        return out.zero_()
    if x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"x must be fp32, fp16 or bf16, got {x.dtype}")
    if not fp8 and (w_gate_up.dtype != x.dtype or w_down.dtype != x.dtype):
        raise ValueError(f"weights must have x's dtype {x.dtype}, got {w_gate_up.dtype} / {w_down.dtype}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    if w_gate_up.stride(-1) != 1 or w_down.stride(-1) != 1:
        raise ValueError("expert weights must be contiguous along their last dim")
    p = n * k
    # Prefill-sized batches take the large-M tiles where the caller left the launch to us (`large_m_launch`).
    big = large_m_launch(p, e) if block_m is None and block_n == (None, None) and block_k is None else None
    if big is not None and num_warps is None and num_stages is None:
        block_m, block_n, block_k = big["block_m"], big["block_n"], big["block_k"]  # type: ignore[assignment]
        num_warps, num_stages = big["num_warps"], big["num_stages"]  # type: ignore[assignment]
        if fp8:  # a K step and a column block stay inside one scale tile
            block_n = tuple(min(b, fp8_block) for b in block_n)  # type: ignore[assignment]
            block_k = tuple(min(b, fp8_block) for b in block_k)  # type: ignore[assignment]
    num_warps = 4 if num_warps is None else num_warps
    m = block_m if block_m is not None else default_block_m(p, e)
    e0 = expert_start or 0
    if align == "triton":
        sorted_pairs, block_expert = _moe_align(topk_ids, e, m, row_live, e0)
    elif align == "torch":
        sorted_pairs, block_expert = torch_moe_align(topk_ids, e, m, row_live, e0)
    else:
        raise ValueError(f"align must be 'triton' or 'torch', got {align!r}")
    n_blocks = block_expert.numel()
    slots = padded_pairs_bound(p, e, m)
    # Combine weights as a flat fp32 vector indexed by pair id (a no-op for contiguous fp32 input).
    flat_w = topk_w.reshape(-1).to(torch.float32).contiguous()
    if scratch is not None:
        scratch["sorted_pairs"], scratch["block_expert"] = sorted_pairs, block_expert
    inter_buf = _scratch(scratch, "inter", (slots, inter), x.dtype, dev)
    pair_out = _scratch(scratch, "pair_out", (p, h), torch.float32, dev)
    ieee = x.dtype == torch.float32
    bn1 = block_n[0] if block_n[0] is not None else _block_n(n_blocks, inter)
    bn2 = block_n[1] if block_n[1] is not None else _block_n(n_blocks, h)
    if fp8:
        if fp8_block < 16 or fp8_block & (fp8_block - 1):
            raise ValueError(f"fp8_block must be a power of two >= 16 for the fused kernels, got {fp8_block}")
        # A program's K step and columns stay inside one scale tile: the defaults shrink to a smaller tile.
        bn1 = min(bn1, fp8_block) if block_n[0] is None else bn1
        bn2 = min(bn2, fp8_block) if block_n[1] is None else bn2
    bk1, bk2 = block_k if block_k is not None else (min(128, fp8_block) if fp8 else 128,) * 2
    for name, v in (("block_m", m), ("block_n", bn1), ("block_n", bn2), ("block_k", bk1), ("block_k", bk2)):
        if v < 16 or v & (v - 1):
            raise ValueError(f"{name} must be a power of two >= 16 (a tensor-core tile), got {v}")
        if fp8 and name != "block_m" and v > fp8_block:
            raise ValueError(f"{name} must be at most {fp8_block} with FP8 weights (one scale tile), got {v}")
    # FP8: the scales' pointers and strides; otherwise unused (any tensor, never read).
    s13 = w_gate_up_scale if w_gate_up_scale is not None else w_gate_up
    s2 = w_down_scale if w_down_scale is not None else w_down
    s13_strides = s13.stride() if fp8 else (0, 0, 0)
    s2_strides = s2.stride() if fp8 else (0, 0, 0)
    launch: dict[str, int] = {"num_warps": num_warps}
    if num_stages is not None:
        launch["num_stages"] = num_stages
    _gate_up_kernel[(n_blocks, triton.cdiv(inter, bn1))](
        x,
        w_gate_up,
        sorted_pairs,
        block_expert,
        inter_buf,
        p,
        k,
        h,
        inter,
        x.stride(0),
        w_gate_up.stride(0),
        w_gate_up.stride(1),
        inter_buf.stride(0),
        float(swiglu_limit) if swiglu_limit is not None else 0.0,
        s13,
        *s13_strides,
        triton.cdiv(inter, fp8_block),
        HAS_LIMIT=swiglu_limit is not None,
        BLOCK_M=m,
        BLOCK_N=bn1,
        BLOCK_K=bk1,
        EVEN_K=h % bk1 == 0,
        IEEE=ieee,
        UPCAST=INTERPRETED,
        FP8=fp8,
        A_POW2=fp8 and x.dtype == torch.bfloat16,
        SCALE_BLOCK=fp8_block,
        **launch,
    )
    _down_kernel[(n_blocks, triton.cdiv(h, bn2))](
        inter_buf,
        w_down,
        sorted_pairs,
        block_expert,
        flat_w,
        pair_out,
        p,
        h,
        inter,
        inter_buf.stride(0),
        w_down.stride(0),
        w_down.stride(1),
        pair_out.stride(0),
        s2,
        *s2_strides,
        BLOCK_M=m,
        BLOCK_N=bn2,
        BLOCK_K=bk2,
        EVEN_K=inter % bk2 == 0,
        IEEE=ieee,
        UPCAST=INTERPRETED,
        FP8=fp8,
        A_POW2=fp8 and x.dtype == torch.bfloat16,
        SCALE_BLOCK=fp8_block,
        **launch,
    )
    # Deterministic combine: slots are summed in order j = 0..k-1 (no atomics anywhere). A dead row's pairs
    # were never computed (their `pair_out` rows hold stale values): the combine writes 0 without reading them.
    block_h = min(triton.next_power_of_2(h), 4096 if INTERPRETED else 1024)
    ids = topk_ids if topk_ids.is_contiguous() else topk_ids.contiguous()
    _combine_kernel[(n, triton.cdiv(h, block_h))](
        pair_out,
        _live_arg(row_live, pair_out),
        ids,
        out,
        k,
        h,
        e0,
        e,
        HAS_LIVE=row_live is not None,
        HAS_RANGE=expert_start is not None,
        BLOCK_H=block_h,
        num_warps=4,
    )
    return out


def _interpreted_module() -> types.ModuleType:
    """This file imported a second time, with the interpreter on, under its own module name."""
    with _interp_lock:
        mod = sys.modules.get(_INTERP_NAME)
        if mod is None:
            spec = importlib.util.spec_from_file_location(_INTERP_NAME, __file__)
            assert spec is not None and spec.loader is not None
            mod = importlib.util.module_from_spec(spec)
            # `from .ops import ...` above resolves against the real package.
            mod.__package__ = __package__
            # triton.jit picks compiled or interpreted functions at decoration time; the scope restores the knob.
            with triton.knobs.runtime.scope():
                triton.knobs.runtime.interpret = True
                spec.loader.exec_module(mod)
            sys.modules[_INTERP_NAME] = mod
        return mod


def fused_moe(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_w: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    swiglu_limit: float | None = None,
    *,
    out: torch.Tensor | None = None,
    block_m: int | None = None,
    block_n: tuple[int | None, int | None] = (None, None),
    block_k: tuple[int, int] | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    scratch: dict[str, torch.Tensor] | None = None,
    align: str | None = None,
    row_live: torch.Tensor | None = None,
    w_gate_up_scale: torch.Tensor | None = None,
    w_down_scale: torch.Tensor | None = None,
    expert_start: int | None = None,
    fp8_block: int = FP8_BLOCK,
) -> torch.Tensor:
    """Kernel version of `ops.fused_moe_ref`: routed experts, ``[N, H]`` fp32.

    No host synchronisation and no allocation whose size depends on the routing (the sorted-pair buffers,
    the ``[padded_pairs_bound(N*k, E, M), I]`` intermediate and the ``[N*k, H]`` fp32 pair outputs follow
    from the shapes), so it can be captured in a CUDA graph. Expert ids must lie in ``[0, E)`` (not checked).

    Args:
        x: ``[N, H]`` activations (fp32, fp16 or bf16).
        topk_ids: ``[N, k]`` int expert ids.
        topk_w: ``[N, k]`` combine weights (used in fp32).
        w_gate_up: ``[E, 2I, H]`` stacked ``gate_proj`` then ``up_proj`` weights, ``x``'s dtype (or
            ``float8_e4m3fn`` with ``w_gate_up_scale``), unit last stride.
        w_down: ``[E, H, I]`` stacked ``down_proj`` weights, same dtype, unit last stride.
        swiglu_limit: the clamp ``L`` (``None``: plain SwiGLU).
        out: optional contiguous ``[N, H]`` fp32 output buffer.
        block_m: row block ``M`` (default `default_block_m`, or `large_m_launch`'s for prefill-sized batches);
            at least 16.
        block_n: columns per program of the gate_up and down kernels (``None``: by the grid size).
        block_k: reduction tile of the two kernels (at least 16; default 128, or the FP8 scale tile if smaller).
        num_warps, num_stages: launch options (tuning only; ``None``: 4 warps and Triton's stages, or
            `large_m_launch`'s when every tile argument is left ``None`` too).
        scratch: optional dict of work buffers: ``inter`` (``[slots, I]``, ``x``'s dtype) and ``pair_out``
            (``[N*k, H]`` fp32) are reused when present with the right shape, else allocated and stored
            there; ``sorted_pairs`` / ``block_expert`` of the call are stored too. For tests (poisoned
            buffers) and callers that keep persistent workspaces.
        align: pair sorting: ``"triton"`` (`moe_align`, one launch) or ``"torch"`` (`ops.moe_align`, ~20
            small device ops; same layout). Default: ``TRTLLM_GLM_MOE_ALIGN`` or ``"triton"``.
        row_live: optional ``[N]`` int or bool flags on ``x``'s device. A row flagged 0 (a CUDA-graph padding
            row, a verify row past its sequence's proposed drafts) gets no (token, slot) pair: its experts are
            neither read nor computed for it, and its output row is 0. The other rows' outputs are bit-equal
            to an unflagged call's (each GEMM row depends on its own operands only).
        w_gate_up_scale: block-FP8 weights: ``[E, 2 ceil(I/128), ceil(H/128)]`` fp32 tile scales of
            ``w_gate_up`` (gate tile rows, then up tile rows; see `ops`); ``block_n`` and ``block_k`` must then be
            at most 128 (how the kernels use them: docs/kernels.md, "Fused MoE").
        w_down_scale: block-FP8 weights: ``[E, ceil(H/128), ceil(I/128)]`` fp32 tile scales of ``w_down``.
        expert_start: expert parallelism: the weights hold experts ``[expert_start, expert_start + E)`` of the
            router's; pairs routed to other experts are left out of the sort (never computed) and add nothing,
            so ``out`` is this rank's partial sum (``None``: every id lies in ``[0, E)``).
        fp8_block: the FP8 scale tile's edge (``weight_block_size``, a power of two >= 16; 128 in the real
            checkpoint); the K steps and, by default, the column blocks shrink to it when it is smaller.

    Returns:
        ``out``: ``[N, H]`` fp32.
    """
    args = (x, topk_ids, topk_w, w_gate_up, w_down, swiglu_limit, out, block_m, block_n, block_k)
    align = align if align is not None else default_align()
    rest = (num_warps, num_stages, scratch, align, row_live, w_gate_up_scale, w_down_scale, expert_start, fp8_block)
    if INTERPRETED or x.device.type == "cuda":
        return _fused_moe(*args, *rest)
    # Interpreted launches: `_interpreting` also lets triton.language's own jit helpers run interpreted.
    from trtllm_glm.triton_interp import interpreting as _interpreting

    mod = _interpreted_module()
    with _interpreting():
        return mod._fused_moe(*args, *rest)
