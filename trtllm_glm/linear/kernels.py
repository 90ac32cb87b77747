"""One Triton kernel for ``y = x @ W^T`` with fp32 accumulation and an fp32 result, for a few rows of ``x``
(`trtllm_glm.linear.skinny_gemm`), and the batch-invariant mode's GEMM (`launch_invariant_gemm`).

Split-K partials summed in split order by the last-arriving program: bitwise reproducible, a row's bits never
depend on ``M``. Launches that share a scratch must be ordered (one stream). Why and how: docs/kernels.md,
"Skinny fp32 GEMM".
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

__all__ = [
    "BLOCK_N",
    "INTERPRETED",
    "INVARIANT_BLOCK_M",
    "INVARIANT_GROUP_N",
    "MAX_M",
    "SkinnyConfig",
    "clear_scratch",
    "launch_config",
    "launch_invariant_gemm",
    "launch_skinny_gemm",
]

# Fixed when this module is imported: `KernelPackage` imports an interpreted copy for CPU tensors.
INTERPRETED: bool = bool(triton.knobs.runtime.interpret)

# Rows of x one launch handles: the partial tiles are sized for it, and beyond it the x tile (BLOCK_M x BLOCK_K
# per stage) outgrows the point of a skinny kernel (cuBLAS serves larger M well).
MAX_M = 64
# Weight rows per program: the smallest MMA tile side, which keeps the partials (SPLIT x BLOCK_N x M per tile)
# small and the programs many.
BLOCK_N = 16
# Rows of x per program of the batch-invariant GEMM (`launch_invariant_gemm`), whatever M is: the MMA shape
# (BLOCK_N x INVARIANT_BLOCK_M x block_k) is one per weight. 16 from the H200 (4-layer slice, plain decode with CUDA
# graphs, benchmarks/results/e2e/e2e_batch_invariant_h200_2026-12-03.log): replay 1.81 / 2.24 / 3.35 ms at batch 1 and
# 2.96 / 3.37 / 4.56 ms at batch 16 for 16 / 32 / 64 (a wider tile multiplies a decode row's MMA work); 32 is
# faster for 64-row verify steps (5.48 vs 6.79 ms at batch 16 x 4), which TRTLLM_GLM_INVARIANT_BLOCK_M selects.
INVARIANT_BLOCK_M = 16
# Weight tiles per program of the invariant GEMM beyond one row tile (prefill): 1 until the H200 measurement
# (benchmarks/bench_invariant_linear.py) says 4 is faster; the bits are the same either way.
INVARIANT_GROUP_N = 1
# Weight bytes one program reads (its K chunk): enough to keep the SM's memory pipe busy for one round trip,
# small enough to give ~100+ programs at the router's [288, 4096] (18 tiles x 8 splits of 512 bf16 columns).
_BYTES_PER_PROGRAM = 16384
# Programs a launch should have at least (while chunks stay >= block_k): more memory requests in flight for a
# narrow weight, at the price of more partials for the last program of each tile to add.
_MIN_PROGRAMS = 32


# Launch shapes measured best per bf16 weight ``(N, K)`` on the H200 (`benchmarks/bench_invariant_linear.py --sweep`,
# then ``--apply``): the least time summed over M = 1 and 16 (a launch shape may depend on the weight, never on M, or
# a row's bits would change with the batch). Knobs a table entry may set: `TUNABLE`.
TUNABLE = ("split_k", "block_k", "num_warps", "num_stages")
# BEGIN TUNED
_TUNED_SHAPES: dict[tuple[int, int], dict[str, int]] = {
    (24896, 4096): {"block_k": 256, "num_stages": 4, "num_warps": 4, "split_k": 1},
    (4096, 8192): {"block_k": 256, "num_stages": 4, "num_warps": 4, "split_k": 2},
    (8192, 128): {"block_k": 128, "num_stages": 4, "num_warps": 4, "split_k": 1},
    (2176, 4096): {"block_k": 128, "num_stages": 4, "num_warps": 4, "split_k": 4},
    (16384, 1536): {"block_k": 128, "num_stages": 4, "num_warps": 4, "split_k": 1},
    (4096, 16384): {"block_k": 256, "num_stages": 4, "num_warps": 4, "split_k": 2},
    (24576, 4096): {"block_k": 256, "num_stages": 4, "num_warps": 4, "split_k": 1},
    (4096, 12288): {"block_k": 256, "num_stages": 4, "num_warps": 4, "split_k": 2},
    (4096, 4096): {"block_k": 256, "num_stages": 4, "num_warps": 4, "split_k": 1},
    (4096, 2048): {"block_k": 256, "num_stages": 4, "num_warps": 4, "split_k": 1},
    (154880, 4096): {"block_k": 128, "num_stages": 4, "num_warps": 4, "split_k": 1},
}
# END TUNED


@dataclasses.dataclass(frozen=True)
class SkinnyConfig:
    """One launch shape: ``split`` programs per tile of `BLOCK_N` weight rows, each covering ``k_per_split``
    reduction columns (a multiple of ``block_k``) in steps of ``block_k``."""

    block_k: int
    k_per_split: int
    split: int
    num_warps: int
    num_stages: int


def launch_config(
    n: int,
    k: int,
    weight_bytes: int,
    dot_fp32: bool,
    *,
    split_k: int | None = None,
    block_k: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    tuned: bool = True,
) -> SkinnyConfig:
    """The launch shape for ``W [n, k]`` (shapes and dtypes only, never ``M``: see the module docstring).

    Args:
        n: output columns (weight rows).
        k: reduction length.
        weight_bytes: bytes per weight element.
        dot_fp32: the IEEE fp32 dot path (register-bound on the GPU: smaller ``block_k``).
        split_k: at most this many K chunks (default: about `_BYTES_PER_PROGRAM` of weight per program, and at
            least `_MIN_PROGRAMS` programs in all).
        block_k: reduction columns per step, a power of two >= 16 (default 128 for tensor cores, 32 for fp32).
        num_warps: warps per program (default 4).
        num_stages: pipelined steps in flight (default: up to 4, no more than the steps of a chunk + 1).
        tuned: fill the knobs not given from `_TUNED_SHAPES` (16-bit weights on tensor cores only; False: the rule
            alone, for the sweep).

    Raises:
        ValueError: a bad ``block_k`` or ``split_k``.
    """
    hit = _TUNED_SHAPES.get((n, k)) if tuned and weight_bytes == 2 and not dot_fp32 else None
    if hit:
        split_k = hit.get("split_k") if split_k is None else split_k
        block_k = hit.get("block_k") if block_k is None else block_k
        num_warps = hit.get("num_warps") if num_warps is None else num_warps
        num_stages = hit.get("num_stages") if num_stages is None else num_stages
    if block_k is None:
        block_k = 32 if dot_fp32 else 128
    if block_k < 16 or block_k & (block_k - 1):
        raise ValueError(f"block_k must be a power of two >= 16, got {block_k}")
    if split_k is None:
        per = max(block_k, _BYTES_PER_PROGRAM // (BLOCK_N * weight_bytes))
        # A narrow weight (the indexer's 32 rows: 2 tiles) still gets _MIN_PROGRAMS programs, in smaller chunks.
        split_k = max(triton.cdiv(k, per), triton.cdiv(_MIN_PROGRAMS, triton.cdiv(n, BLOCK_N)))
    if split_k < 1:
        raise ValueError(f"split_k must be >= 1, got {split_k}")
    kps = triton.cdiv(triton.cdiv(k, split_k), block_k) * block_k
    split = triton.cdiv(k, kps)  # <= split_k; no chunk is empty
    steps = kps // block_k
    if num_stages is None:
        num_stages = max(2, min(4, steps + 1))
    return SkinnyConfig(block_k, kps, split, 4 if num_warps is None else num_warps, num_stages)


@triton.jit
def _skinny_gemm_kernel(
    x_ptr,
    w_ptr,
    y_ptr,
    part_ptr,
    cnt_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_ym,
    K_PER_SPLIT,
    SPLIT: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PART_M: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    tile = tl.program_id(0)
    s = tl.program_id(1)
    nl = tl.arange(0, BLOCK_N)
    n = tile * BLOCK_N + nl
    m = tl.arange(0, BLOCK_M)
    n_ok = n < N
    m_ok = m < M
    acc = _chunk_dot(x_ptr, w_ptr, m, n, m_ok, n_ok, K, stride_xm, stride_wn, s * K_PER_SPLIT, K_PER_SPLIT,
                     BLOCK_N, BLOCK_M, BLOCK_K, DOT_FP32)  # fmt: skip

    y_ptrs = y_ptr + m.to(tl.int64)[None, :] * stride_ym + n[:, None]
    y_mask = n_ok[:, None] & m_ok[None, :]
    if SPLIT == 1:
        tl.store(y_ptrs, acc, mask=y_mask)
    else:
        part_tile = part_ptr + (tile * SPLIT * BLOCK_N + nl)[:, None] * PART_M + m[None, :]
        tl.store(part_tile + s * (BLOCK_N * PART_M), acc, mask=m_ok[None, :])
        # Every warp's partial stores before the (single-thread) release below: CTA barrier, then a gpu-scope
        # acq_rel atomic, which is cumulative over what the barrier ordered before it.
        tl.debug_barrier()
        arrived = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT - 1:
            # The last program of the tile: every partial is visible (acquire above). Fixed order 0..SPLIT-1,
            # whichever program got here; ".cg" reads from L2, never from a stale L1 line.
            total = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
            for i in tl.static_range(SPLIT):
                total += tl.load(
                    part_tile + i * (BLOCK_N * PART_M), mask=m_ok[None, :], other=0.0, cache_modifier=".cg"
                )
            tl.store(y_ptrs, total, mask=y_mask)
            # Ready for the next launch (or graph replay): nobody else touches this counter in this launch.
            tl.atomic_xchg(cnt_ptr + tile, 0, sem="relaxed", scope="gpu")


_SCRATCH: dict[tuple[str, int, int, int], tuple[torch.Tensor, torch.Tensor]] = {}


def clear_scratch() -> None:
    """Drop the cached scratch buffers (tests; the next launch allocates fresh zeroed counters)."""
    _SCRATCH.clear()


def _scratch(device: torch.device, tiles: int, split: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(partials [tiles * split * BLOCK_N * MAX_M] fp32, counters [tiles] int32 zeros)`` for ``device``.

    Cached per (device, tiles, split): every launch leaves its counters at zero. The first call of a shape
    should run outside CUDA-graph capture (a warm-up, as every capture in this package does); a first call
    inside a capture gets buffers of its own, not cached, whose zeroing is part of the graph.
    """
    key = (str(device), device.index if device.index is not None else -1, tiles, split)
    hit = _SCRATCH.get(key)
    if hit is not None:
        return hit
    partials = torch.empty(tiles * split * BLOCK_N * MAX_M, dtype=torch.float32, device=device)
    counters = torch.zeros(tiles, dtype=torch.int32, device=device)
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return partials, counters
    _SCRATCH[key] = (partials, counters)
    return partials, counters


def launch_skinny_gemm(x: torch.Tensor, w: torch.Tensor, y: torch.Tensor, cfg: SkinnyConfig, dot_fp32: bool) -> None:
    """Launch `_skinny_gemm_kernel` (arguments already checked by `trtllm_glm.linear.skinny_gemm`).

    Args:
        x: ``[M, K]``, ``1 <= M <= MAX_M``, unit last stride.
        w: ``[N, K]``, unit last stride.
        y: ``[M, N]`` fp32, unit last stride; every element is written.
        cfg: the launch shape (`launch_config`).
        dot_fp32: the IEEE fp32 dot instead of 16-bit MMAs (required for fp32 / mixed inputs and interpreted).
    """
    m_rows, k = x.shape
    n = w.shape[0]
    tiles = triton.cdiv(n, BLOCK_N)
    if cfg.split > 1:
        partials, counters = _scratch(x.device, tiles, cfg.split)
    else:
        partials = counters = y  # unused (SPLIT == 1 never touches them)
    block_m = max(16, triton.next_power_of_2(m_rows))  # tl.dot needs >= 16 on every side
    _skinny_gemm_kernel[(tiles, cfg.split)](
        x, w, y, partials, counters,
        m_rows, n, k, x.stride(0), w.stride(0), y.stride(0), cfg.k_per_split,
        SPLIT=cfg.split, BLOCK_N=BLOCK_N, BLOCK_M=block_m, BLOCK_K=cfg.block_k, PART_M=MAX_M,
        DOT_FP32=dot_fp32 or INTERPRETED, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip


@triton.jit
def _chunk_dot(
    x_ptr, w_ptr, m, n, m_ok, n_ok, K, stride_xm, stride_wn, k_begin, K_PER_SPLIT,
    BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, DOT_FP32: tl.constexpr,
):  # fmt: skip
    """``W[n, chunk] @ x[m, chunk]^T`` as ``[BLOCK_N, BLOCK_M]`` fp32, the chunk ``[k_begin, k_begin + K_PER_SPLIT)``
    walked in ``BLOCK_K`` steps from a zero accumulator (the same steps whichever program calls it)."""
    kk = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + n.to(tl.int64)[:, None] * stride_wn
    x_cols = x_ptr + m.to(tl.int64)[None, :] * stride_xm
    k_end = tl.minimum(k_begin + K_PER_SPLIT, K)
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k0 in range(k_begin, k_end, BLOCK_K):
        k = k0 + kk
        k_ok = k < K
        w = tl.load(w_rows + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        # x^T tile [BLOCK_K, BLOCK_M]: the rows of x are contiguous along K, the tile's first dim.
        xt = tl.load(x_cols + k[:, None], mask=k_ok[:, None] & m_ok[None, :], other=0.0)
        if DOT_FP32:
            # "ieee": the default fp32 dot is TF32, which would round the inputs.
            acc = tl.dot(w.to(tl.float32), xt.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(w, xt, acc, out_dtype=tl.float32)
    return acc


@triton.jit
def _chunk_dot4(
    x_ptr, w_ptr, m, n, m_ok, N, K, stride_xm, stride_wn, k_begin, K_PER_SPLIT,
    BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, DOT_FP32: tl.constexpr,
):  # fmt: skip
    """`_chunk_dot` of four consecutive weight tiles (rows ``n``, ``n + BLOCK_N``, ..) against one x tile loaded
    once per step: four independent ``[BLOCK_N, BLOCK_K] @ [BLOCK_K, BLOCK_M]`` chains, each the very sequence of
    dots `_chunk_dot` makes for its tile (the x tile is shared, never the sums)."""
    kk = tl.arange(0, BLOCK_K)
    n1, n2, n3 = n + BLOCK_N, n + 2 * BLOCK_N, n + 3 * BLOCK_N
    x_cols = x_ptr + m.to(tl.int64)[None, :] * stride_xm
    k_end = tl.minimum(k_begin + K_PER_SPLIT, K)
    a0 = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    a1 = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    a2 = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    a3 = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k0 in range(k_begin, k_end, BLOCK_K):
        k = k0 + kk
        k_ok = k < K
        xt = tl.load(x_cols + k[:, None], mask=k_ok[:, None] & m_ok[None, :], other=0.0)
        w0 = tl.load(w_ptr + n.to(tl.int64)[:, None] * stride_wn + k[None, :],
                     mask=(n < N)[:, None] & k_ok[None, :], other=0.0)  # fmt: skip
        w1 = tl.load(w_ptr + n1.to(tl.int64)[:, None] * stride_wn + k[None, :],
                     mask=(n1 < N)[:, None] & k_ok[None, :], other=0.0)  # fmt: skip
        w2 = tl.load(w_ptr + n2.to(tl.int64)[:, None] * stride_wn + k[None, :],
                     mask=(n2 < N)[:, None] & k_ok[None, :], other=0.0)  # fmt: skip
        w3 = tl.load(w_ptr + n3.to(tl.int64)[:, None] * stride_wn + k[None, :],
                     mask=(n3 < N)[:, None] & k_ok[None, :], other=0.0)  # fmt: skip
        if DOT_FP32:
            xf = xt.to(tl.float32)
            a0 = tl.dot(w0.to(tl.float32), xf, a0, input_precision="ieee")
            a1 = tl.dot(w1.to(tl.float32), xf, a1, input_precision="ieee")
            a2 = tl.dot(w2.to(tl.float32), xf, a2, input_precision="ieee")
            a3 = tl.dot(w3.to(tl.float32), xf, a3, input_precision="ieee")
        else:
            a0 = tl.dot(w0, xt, a0, out_dtype=tl.float32)
            a1 = tl.dot(w1, xt, a1, out_dtype=tl.float32)
            a2 = tl.dot(w2, xt, a2, out_dtype=tl.float32)
            a3 = tl.dot(w3, xt, a3, out_dtype=tl.float32)
    return a0, a1, a2, a3


@triton.jit
def _invariant_gemm4_kernel(
    x_ptr,
    w_ptr,
    y_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_ym,
    stride_wn,
    stride_xb,
    stride_wb,
    stride_yb,
    N_RB,
    K_PER_SPLIT,
    SPLIT: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    """The in-program-chunks path of `_invariant_gemm_kernel` for four weight tiles per program (more rows, from
    ``block_m`` on: fewer x loads per product). Program ``(g, b * N_RB + r)``: weight tiles ``4g .. 4g + 3`` of
    batch ``b``, x rows ``r * BLOCK_M ..``; each tile's chunks added in order 0, 1, .. as there (the same bits)."""
    bid = tl.program_id(1) // N_RB
    x_ptr += bid.to(tl.int64) * stride_xb
    w_ptr += bid.to(tl.int64) * stride_wb
    y_ptr += bid.to(tl.int64) * stride_yb
    n = tl.program_id(0) * (4 * BLOCK_N) + tl.arange(0, BLOCK_N)
    m = (tl.program_id(1) % N_RB) * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = m < M
    if SPLIT == 1:
        t0, t1, t2, t3 = _chunk_dot4(
            x_ptr, w_ptr, m, n, m_ok, N, K, stride_xm, stride_wn, 0, K_PER_SPLIT, BLOCK_N, BLOCK_M, BLOCK_K, DOT_FP32
        )
    else:
        t0 = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        t1 = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        t2 = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        t3 = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        for i in tl.static_range(SPLIT):
            c0, c1, c2, c3 = _chunk_dot4(
                x_ptr, w_ptr, m, n, m_ok, N, K, stride_xm, stride_wn, i * K_PER_SPLIT, K_PER_SPLIT, BLOCK_N,
                BLOCK_M, BLOCK_K, DOT_FP32,
            )  # fmt: skip
            t0 += c0
            t1 += c1
            t2 += c2
            t3 += c3
    y_rows = y_ptr + m.to(tl.int64)[None, :] * stride_ym
    n1, n2, n3 = n + BLOCK_N, n + 2 * BLOCK_N, n + 3 * BLOCK_N
    tl.store(y_rows + n[:, None], t0.to(y_ptr.dtype.element_ty), mask=(n < N)[:, None] & m_ok[None, :])
    tl.store(y_rows + n1[:, None], t1.to(y_ptr.dtype.element_ty), mask=(n1 < N)[:, None] & m_ok[None, :])
    tl.store(y_rows + n2[:, None], t2.to(y_ptr.dtype.element_ty), mask=(n2 < N)[:, None] & m_ok[None, :])
    tl.store(y_rows + n3[:, None], t3.to(y_ptr.dtype.element_ty), mask=(n3 < N)[:, None] & m_ok[None, :])


@triton.jit
def _invariant_gemm_kernel(
    x_ptr,
    w_ptr,
    y_ptr,
    part_ptr,
    cnt_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_ym,
    stride_xb,
    stride_wb,
    stride_yb,
    N_RB,
    K_PER_SPLIT,
    SPLIT: tl.constexpr,
    SPLIT_PROGRAMS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    """Program ``(t, s, b * N_RB + r)``: weight rows ``t * BLOCK_N ..`` of batch ``b`` (the ``stride_*b`` offsets;
    one batch for a plain GEMM), x rows ``r * BLOCK_M ..``. ``SPLIT_PROGRAMS``: the ``SPLIT`` chunks are programs
    ``s`` (one row block; partials reduced by the last arrival in order 0, 1, ..); otherwise the program computes
    the chunks one after the other and adds them in the same order. Either way each output is
    ``((0 + p_0) + p_1) + ..`` of the same chunk partials (``p_0`` alone when ``SPLIT == 1``)."""
    bid = tl.program_id(2) // N_RB
    x_ptr += bid.to(tl.int64) * stride_xb
    w_ptr += bid.to(tl.int64) * stride_wb
    y_ptr += bid.to(tl.int64) * stride_yb
    # Split partials and arrival counters per (batch, tile).
    tile_b = bid * tl.cdiv(N, BLOCK_N) + tl.program_id(0)
    tile = tl.program_id(0)
    nl = tl.arange(0, BLOCK_N)
    n = tile * BLOCK_N + nl
    m = (tl.program_id(2) % N_RB) * BLOCK_M + tl.arange(0, BLOCK_M)
    n_ok = n < N
    m_ok = m < M
    y_ptrs = y_ptr + m.to(tl.int64)[None, :] * stride_ym + n[:, None]
    y_mask = n_ok[:, None] & m_ok[None, :]
    if SPLIT == 1:
        acc = _chunk_dot(
            x_ptr, w_ptr, m, n, m_ok, n_ok, K, stride_xm, stride_wn, 0, K_PER_SPLIT, BLOCK_N, BLOCK_M, BLOCK_K,
            DOT_FP32,
        )  # fmt: skip
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=y_mask)
    elif SPLIT_PROGRAMS:
        s = tl.program_id(1)
        acc = _chunk_dot(
            x_ptr, w_ptr, m, n, m_ok, n_ok, K, stride_xm, stride_wn, s * K_PER_SPLIT, K_PER_SPLIT, BLOCK_N, BLOCK_M,
            BLOCK_K, DOT_FP32,
        )  # fmt: skip
        part_tile = part_ptr + (tile_b * SPLIT * BLOCK_N + nl)[:, None] * BLOCK_M + tl.arange(0, BLOCK_M)[None, :]
        tl.store(part_tile + s * (BLOCK_N * BLOCK_M), acc)
        # As `_skinny_gemm_kernel`: CTA barrier, then the gpu-scope acq_rel arrival; the last one reduces.
        tl.debug_barrier()
        arrived = tl.atomic_add(cnt_ptr + tile_b, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT - 1:
            total = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
            for i in tl.static_range(SPLIT):
                total += tl.load(part_tile + i * (BLOCK_N * BLOCK_M), cache_modifier=".cg")
            tl.store(y_ptrs, total.to(y_ptr.dtype.element_ty), mask=y_mask)
            tl.atomic_xchg(cnt_ptr + tile_b, 0, sem="relaxed", scope="gpu")
    else:
        total = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        for i in tl.static_range(SPLIT):
            total += _chunk_dot(
                x_ptr, w_ptr, m, n, m_ok, n_ok, K, stride_xm, stride_wn, i * K_PER_SPLIT, K_PER_SPLIT, BLOCK_N,
                BLOCK_M, BLOCK_K, DOT_FP32,
            )  # fmt: skip
        tl.store(y_ptrs, total.to(y_ptr.dtype.element_ty), mask=y_mask)


def launch_invariant_gemm(
    x: torch.Tensor,
    w: torch.Tensor,
    y: torch.Tensor,
    cfg: SkinnyConfig,
    dot_fp32: bool,
    block_m: int = INVARIANT_BLOCK_M,
    group_n: int = 1,
) -> None:
    """Launch `_invariant_gemm_kernel`: ``y = x @ w^T`` (fp32 sums, rounded once to ``y``'s dtype) for any number
    of rows, with one tile shape (`BLOCK_N` x ``block_m`` x ``cfg.block_k``) and one reduction order
    (``cfg``'s chunks, summed in order) per weight: a row's bits never depend on ``M`` or on the other rows.

    Up to ``block_m`` rows (decode, verify) the chunks are programs of their own (grid ``(tiles, split, 1)``,
    partials in the cached `_scratch`, as `launch_skinny_gemm`); beyond, the rows give the programs (grid
    ``(tiles, 1, row blocks)``) and each adds its chunks itself in the same order.

    Batched (``x`` ``[M, B, K]``, ``w`` ``[B, N, K]``, ``y`` ``[M, B, N]``): batch ``b``'s rows times its own
    weight, every batch with the same launch shape (the absorbed attention's per-head products).

    Args:
        x: ``[M, K]`` or ``[M, B, K]``, ``M >= 1``, unit last stride.
        w: ``[N, K]`` or ``[B, N, K]``, unit last stride.
        y: ``[M, N]`` or ``[M, B, N]``, fp32 / bf16 / fp16, unit last stride; every element is written.
        cfg: `launch_config` of ``(N, K)`` (never of ``M``).
        dot_fp32: the IEEE fp32 dot instead of 16-bit MMAs (required for fp32 / mixed inputs and interpreted).
        block_m: rows per program, a power of two in [16, `MAX_M`] (the same for every call of a weight: the
            row tile is part of the MMA shape).
        group_n: 1, or 4: beyond ``block_m`` rows a program computes four weight tiles against one x tile
            (`_invariant_gemm4_kernel`; the same tiles, dots and order: the same bits, fewer loads).
    """
    if block_m < 16 or block_m > MAX_M or block_m & (block_m - 1):
        raise ValueError(f"block_m must be a power of two in [16, {MAX_M}], got {block_m}")
    if group_n not in (1, 4):
        raise ValueError(f"group_n must be 1 or 4, got {group_n}")
    m_rows, k = x.shape[0], x.shape[-1]
    n = w.shape[-2]
    if x.dim() == 3:
        nb, sxb, swb, syb = x.shape[1], x.stride(1), w.stride(0), y.stride(1)
    else:
        nb, sxb, swb, syb = 1, 0, 0, 0
    tiles = triton.cdiv(n, BLOCK_N)
    n_rb = triton.cdiv(m_rows, block_m)
    if group_n == 4 and m_rows > block_m:
        _invariant_gemm4_kernel[(triton.cdiv(tiles, 4), nb * n_rb)](
            x, w, y, m_rows, n, k, x.stride(0), y.stride(0), w.stride(-2), sxb, swb, syb, n_rb, cfg.k_per_split,
            SPLIT=cfg.split, BLOCK_N=BLOCK_N, BLOCK_M=block_m, BLOCK_K=cfg.block_k, DOT_FP32=dot_fp32 or INTERPRETED,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )  # fmt: skip
        return
    split_programs = cfg.split > 1 and m_rows <= block_m
    if split_programs:
        partials, counters = _scratch(x.device, nb * tiles, cfg.split)
    else:
        partials = counters = y  # unused
    grid = (tiles, cfg.split if split_programs else 1, nb * n_rb)
    _invariant_gemm_kernel[grid](
        x, w, y, partials, counters,
        m_rows, n, k, x.stride(0), w.stride(-2), y.stride(0), sxb, swb, syb, n_rb, cfg.k_per_split,
        SPLIT=cfg.split, SPLIT_PROGRAMS=split_programs, BLOCK_N=BLOCK_N, BLOCK_M=block_m,
        BLOCK_K=cfg.block_k, DOT_FP32=dot_fp32 or INTERPRETED, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
