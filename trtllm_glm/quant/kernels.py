"""Triton kernels for the weight-only block-FP8 linear ``y = x @ (fp8 * scale_inv)^T`` (`trtllm_glm.quant.ops`).

e4m3 tiles decoded in registers, fp32 accumulation, one scale multiply per tile; split-K with a last-arrival
reduction in split order (bitwise reproducible, no memset), graph-capturable after one eager call of a shape.
Design (operand orientations, stream-K, PDL, the e4m3 decode): docs/kernels.md, "Block-FP8 linear"; the tuned
launch tables below and how they are swept: docs/fp8.md.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from trtllm_glm.pdl import (
    has_pdl,
    late_trigger,
    launch_kwargs,
    pdl_from_env,
    pdl_leave,
    pdl_trigger,
    pdl_wait,
    prefetch_l2,
)

__all__ = [
    "INTERPRETED",
    "MAX_M_SPLIT",
    "PDL_PREFETCH_BYTES",
    "TUNABLE",
    "TUNED_BLOCK_M",
    "Fp8LinearConfig",
    "clear_scratch",
    "launch_config",
    "shape_class",
    "tuned_knobs",
    "launch_fp8_dequant",
    "launch_fp8_linear",
]

# Fixed when this module is imported: `KernelPackage` imports an interpreted copy for CPU tensors.
INTERPRETED: bool = bool(triton.knobs.runtime.interpret)

# Rows up to which the launch splits K (one row tile: the partials are sized for it). Beyond it the rows alone
# give the programs that stream the weight.
MAX_M_SPLIT = 64
# Weight bytes one program of a split launch reads (its K chunk): enough to keep the memory pipe busy. With 64-row
# tiles, 1024 columns per program (H200 sweep, benchmarks/results/fp8/fp8_linear_sweep_h200_2026-12-03.log: 64 rows x
# split 8 ran kda.o_proj [4096, 8192] at M = 1 in 17.2 us against 34.2 us for 16 rows x 2048 columns).
_BYTES_PER_PROGRAM = 65536
# Programs a split launch should have at least (H200: 132 SMs).
_MIN_PROGRAMS = 264


# Tuned decode launches (M <= MAX_M_SPLIT, 16-bit activations, 128 x 128 scale tiles): knob dicts of `launch_config`
# keyed by the weight's exact ``(N, K)`` (`_TUNED_SHAPES`), else by its size class (`shape_class`, `_TUNED_CLASSES`).
# Keys never include M, so a row's launch (and its bits) stay the same whatever the batch within one row tile.
# Written by `benchmarks/bench_fp8_linear.py --apply SWEEP.json` from an H200 sweep (`--sweep --json`) between the
# markers below; empty: `launch_config`'s rule.
# BEGIN TUNED
_TUNED_SHAPES: dict[tuple[int, int], dict[str, int | bool]] = {
    (24832, 4096): {"x_as_a": True, "block_n": 128, "k_chunk": 2048},
    (4096, 8192): {"x_as_a": True, "block_n": 128, "k_chunk": 1024, "num_warps": 8},
    (8192, 128): {"x_as_a": False, "block_n": 32, "k_chunk": 1024},
    (2176, 4096): {"x_as_a": True},
    (16384, 1536): {"x_as_a": True, "block_n": 64, "k_chunk": 2048, "num_stages": 3},
    (4096, 16384): {"x_as_a": True, "block_n": 128, "k_chunk": 2048},
    (4096, 1536): {"x_as_a": True},
    (24576, 4096): {"x_as_a": True, "block_n": 128, "k_chunk": 2048},
    (4096, 12288): {"x_as_a": True, "block_n": 128, "k_chunk": 1024},
    (4096, 4096): {"x_as_a": True, "block_n": 64, "k_chunk": 1024},
    (4096, 2048): {"x_as_a": True},
}
_TUNED_CLASSES: dict[str, dict[str, int | bool]] = {
    "large": {"x_as_a": True, "block_n": 128, "k_chunk": 2048},
    "tiny": {"x_as_a": False, "block_n": 32, "k_chunk": 1024},
    "small": {"x_as_a": True},
}
# END TUNED
# Weight bytes (e4m3) below which a matrix is "tiny" (launch-latency bound: a few microseconds whatever the kernel)
# and "small" (fewer bytes than ~2 waves of 64 KB programs on 132 SMs); the rest are "large".
_TINY_BYTES = 4 << 20
_SMALL_BYTES = 24 << 20
# The row tile the tuned knobs are for (decode and verify, M <= 16: what the sweep measures); larger row tiles keep
# the rule.
TUNED_BLOCK_M = 16
# The knobs a tuned entry may set.
TUNABLE = (
    "block_n",
    "block_k",
    "k_chunk",
    "num_warps",
    "num_stages",
    "unroll",
    "x_as_a",
    "pdl",
    "prefetch",
    "stream_k",
)
# Programmatic dependent launch of the decode launches (`trtllm_glm.pdl`): `pdl.PDL_ENV` "1" / "0" overrides the tuned
# table and the default (off until an H200 A/B says it pays).
# With PDL, bytes of each weight row a program asks L2 to prefetch before it waits for the kernel before it (the
# start of its K chunk): ~17 MB over 264 resident programs of 128 rows, what HBM moves in ~4 us.
PDL_PREFETCH_BYTES = 512


@dataclasses.dataclass(frozen=True)
class Fp8LinearConfig:
    """One launch shape: ``split`` programs per tile of ``block_n`` weight rows and ``block_m`` activation rows,
    each covering ``k_per_split`` reduction columns (a multiple of ``block_k * unroll``) in steps of ``block_k``,
    ``unroll`` steps per loop iteration; ``x_as_a``: x is the MMA's left operand (the fused MoE's orientation)."""

    block_n: int
    block_m: int
    block_k: int
    k_per_split: int
    split: int
    num_warps: int
    num_stages: int
    unroll: int = 1
    x_as_a: bool = False
    pdl: bool = False
    prefetch: int = 0
    # > 0: a stream-K launch of this many programs (`_fp8_linear_sk_kernel`); ``split`` is then the most partials a
    # tile can have and ``k_per_split`` is unused.
    programs: int = 0


def _pow2_divisor(qblock: int, cap: int) -> int:
    """The largest power of two ``<= cap`` that divides ``qblock``."""
    b = cap
    while b > 1 and qblock % b:
        b //= 2
    return b


def shape_class(n: int, k: int) -> str:
    """``"tiny"`` / ``"small"`` / ``"large"`` by the e4m3 weight's bytes (`_TUNED_CLASSES` keys)."""
    nbytes = n * k
    return "tiny" if nbytes < _TINY_BYTES else "small" if nbytes < _SMALL_BYTES else "large"


def tuned_knobs(n: int, k: int, qblock: int, dot_fp32: bool) -> dict[str, int | bool]:
    """The tuned knobs for a decode launch of an ``[n, k]`` weight (empty: `launch_config`'s rule)."""
    if dot_fp32 or qblock != 128:
        return {}
    hit = _TUNED_SHAPES.get((n, k))
    return dict(hit if hit is not None else _TUNED_CLASSES.get(shape_class(n, k), {}))


def launch_config(
    m: int,
    n: int,
    k: int,
    qblock: int,
    dot_fp32: bool,
    *,
    split_k: int | None = None,
    block_n: int | None = None,
    block_k: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    k_chunk: int | None = None,
    unroll: int | None = None,
    x_as_a: bool | None = None,
    pdl: bool | None = None,
    prefetch: int | None = None,
    stream_k: int | None = None,
    tuned: bool = True,
) -> Fp8LinearConfig:
    """The launch shape for ``x [m, k] @ W [n, k]^T`` with ``qblock``-square scale tiles.

    Only whether ``m <= MAX_M_SPLIT`` and the row tile (a power of two >= 16 covering ``m``) depend on ``m``; the
    split, the K steps and the tuned knobs (`tuned_knobs`, for the 16-row tile the sweep measures:
    ``TUNED_BLOCK_M``) depend on ``(n, k, qblock)`` only, so a row's result does not change with the batch size
    within one row-tile size.

    Args:
        m, n, k: the GEMM.
        qblock: scale tile edge; ``block_k`` must divide it (a power of two >= 16 that does: `kernel_covers`).
        dot_fp32: IEEE fp32 products (register-bound: smaller ``block_k``).
        split_k: at most this many K chunks (decode launches; default from ``k_chunk``, else `_BYTES_PER_PROGRAM`
            / `_MIN_PROGRAMS`).
        block_n: weight rows per program (default 64 for decode launches, 128 otherwise).
        block_k: reduction columns per step (default the largest power of two <= 128 (32 for fp32) dividing
            ``qblock``).
        num_warps: warps per program (default 4 for decode launches, 8 otherwise).
        num_stages: pipelined iterations in flight (default: up to 4).
        k_chunk: decode launches: reduction columns per program (rounded up to a whole iteration; ``>= k``: no
            split). Ignored when ``split_k`` is given.
        unroll: ``block_k`` steps per loop iteration (default 1).
        x_as_a: x as the MMA's left operand, the weight tile as ``[block_k, block_n]`` (default False).
        pdl: decode launches: launch with programmatic dependent launch (`trtllm_glm.pdl`; default `pdl.PDL_ENV` if set,
            else the tuned knob, else off). Larger ``m`` never does. Applied on sm_90+ devices only.
        prefetch: with ``pdl``, bytes of each weight row prefetched into L2 before the wait (default
            `PDL_PREFETCH_BYTES`; rounded down to 16 and capped at the program's chunk; 0: none).
        stream_k: decode launches: this many programs share the ``tiles x steps`` units equally (stream-K, no wave
            tail; at most one per unit; x as the MMA's left operand; ``k_chunk`` / ``split_k`` / ``unroll`` do not
            apply). 0 / None: the split-K grid.
        tuned: launches with a ``TUNED_BLOCK_M``-row tile (``m <= 16``) take `tuned_knobs` for the knobs not given
            here.

    Raises:
        ValueError: a ``block_k`` that is not a power of two >= 16 dividing ``qblock``, ``split_k < 1``,
            ``unroll < 1``, ``k_chunk < 1``, ``prefetch < 0``, ``stream_k < 0`` or with ``x_as_a=False`` or
            ``unroll > 1``, or a `pdl.PDL_ENV` other than 0 / 1.
    """
    skinny = m <= MAX_M_SPLIT
    block_m = max(16, triton.next_power_of_2(m)) if skinny else 64
    asked_x_as_a, asked_unroll = x_as_a, unroll  # a stream-K launch overrides tuned values of these, not given ones
    if pdl is None:
        pdl = pdl_from_env()
    if block_m == TUNED_BLOCK_M and tuned:
        given = dict(block_n=block_n, block_k=block_k, num_warps=num_warps, num_stages=num_stages, k_chunk=k_chunk,
                     unroll=unroll, x_as_a=x_as_a, pdl=pdl, prefetch=prefetch, stream_k=stream_k)  # fmt: skip
        knobs = tuned_knobs(n, k, qblock, dot_fp32)
        if split_k is not None:
            knobs.pop("k_chunk", None)
        for name, value in knobs.items():
            if given.get(name) is None:
                given[name] = value
        block_n, block_k, num_warps, num_stages = (given[a] for a in ("block_n", "block_k", "num_warps", "num_stages"))
        k_chunk, unroll, x_as_a = given["k_chunk"], given["unroll"], given["x_as_a"]
        pdl, prefetch, stream_k = given["pdl"], given["prefetch"], given["stream_k"]
    if block_k is None:
        block_k = _pow2_divisor(qblock, 32 if dot_fp32 else 128)
    if block_k < 16 or block_k & (block_k - 1) or qblock % block_k:
        raise ValueError(f"block_k must be a power of two >= 16 dividing the scale block {qblock}, got {block_k}")
    unroll = 1 if unroll is None else int(unroll)
    if unroll < 1:
        raise ValueError(f"unroll must be >= 1, got {unroll}")
    step = block_k * unroll
    if block_n is None:
        # Prefill chunks: a 128 x 64 output tile per program (8 warps), the usual Hopper GEMM shape.
        block_n = 64 if skinny else 128
    if num_warps is None:
        num_warps = 4 if skinny else 8
    if not skinny:
        split_k = 1
    elif split_k is None:
        if k_chunk is not None:
            if k_chunk < 1:
                raise ValueError(f"k_chunk must be >= 1, got {k_chunk}")
            split_k = triton.cdiv(k, k_chunk)
        else:
            per = max(block_k, _BYTES_PER_PROGRAM // block_n)
            split_k = max(triton.cdiv(k, per), triton.cdiv(_MIN_PROGRAMS, triton.cdiv(n, block_n)))
    if split_k < 1:
        raise ValueError(f"split_k must be >= 1, got {split_k}")
    kps = triton.cdiv(triton.cdiv(k, split_k), step) * step
    split = triton.cdiv(k, kps)  # <= split_k; no chunk is empty
    steps = kps // step
    if num_stages is None:
        num_stages = max(2, min(4, steps + 1))
    pdl = bool(pdl) and skinny
    if prefetch is None:
        prefetch = PDL_PREFETCH_BYTES
    if prefetch < 0:
        raise ValueError(f"prefetch must be >= 0, got {prefetch}")
    stream_k = int(stream_k or 0)
    if stream_k < 0:
        raise ValueError(f"stream_k must be >= 0, got {stream_k}")
    if stream_k and skinny:
        if asked_x_as_a is False or (asked_unroll or 1) > 1:
            raise ValueError("stream_k launches take x as the MMA's left operand (x_as_a) and unroll 1")
        tiles, steps = triton.cdiv(n, block_n), triton.cdiv(k, block_k)
        programs = min(stream_k, tiles * steps)  # every program gets at least one unit
        max_seg = min(programs, steps, triton.cdiv(programs, tiles) + 1)
        prefetch = min(int(prefetch), triton.cdiv(tiles * steps, programs) * block_k) // 16 * 16 if pdl else 0
        if num_stages is None:
            num_stages = max(2, min(4, triton.cdiv(tiles * steps, programs) + 1))
        return Fp8LinearConfig(block_n, block_m, block_k, k, max_seg, num_warps, num_stages, 1, True, pdl, prefetch,
                               programs)  # fmt: skip
    prefetch = min(int(prefetch), kps) // 16 * 16 if pdl else 0
    return Fp8LinearConfig(
        block_n, block_m, block_k, kps, split, num_warps, num_stages, unroll, bool(x_as_a), pdl, prefetch
    )


@triton.jit
def _e4m3_to_f32(b):
    """Exact decode of e4m3 codes (int32 ``[0, 255]``) to fp32 without fp8 casts (the interpreter's are wrong):
    the 7 magnitude bits at fp16 bits 13..7 give the value times ``2**-8``; ``* 256`` is exact."""
    h = ((b & 0x7F) << 7) - ((b & 0x80) << 8)
    return h.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32) * 256.0


@triton.jit
def _pow2_fp16(a, AXIS: tl.constexpr):
    """Activations (one row of x per slice along ``1 - AXIS``) -> ``(a / p`` in fp16, ``p`` fp32``)``: ``p`` a power
    of two per row of x putting its largest ``|a|`` in ``[2^14, 2^15)`` (``AXIS``: the K axis of ``a``). Exact for
    bf16 inputs (8 significant bits in fp16's 11, scaled by a power of two) except for entries more than ~30
    binades below their row's largest, which round in fp16's subnormals (an error below ``2^-40`` of the
    largest)."""
    af = a.to(tl.float32)
    amax = tl.max(tl.abs(af), axis=AXIS)
    e = (amax.to(tl.int32, bitcast=True) >> 23) & 0xFF
    pe = tl.maximum(e - 14, 1)  # an all-zero (padding) row: p = 2^-126, its zeros stay zeros
    p = (pe << 23).to(tl.float32, bitcast=True)
    inv = ((254 - pe) << 23).to(tl.float32, bitcast=True)
    if AXIS == 0:
        return (af * inv[None, :]).to(tl.float16), p
    else:
        return (af * inv[:, None]).to(tl.float16), p


@triton.jit
def _k_step(
    acc, x_base, w_base, s_rows, k0, kk, K, n_ok, m_ok,
    X_AS_A: tl.constexpr, QBLOCK: tl.constexpr, DOT_FP32: tl.constexpr, HW_FP8: tl.constexpr, X_POW2: tl.constexpr,
):  # fmt: skip
    """``acc`` plus one ``BLOCK_K`` step at column ``k0`` (inside one scale column): the step's partial product
    scaled by its tile scales. ``X_AS_A``: ``acc [BLOCK_M, BLOCK_N]``, ``x_base`` the rows' pointers ``[BLOCK_M, 1]``
    and ``w_base`` the weight rows' ``[1, BLOCK_N]``; else ``acc [BLOCK_N, BLOCK_M]`` and the transposes."""
    k = k0 + kk
    k_ok = k < K
    # One scale per weight row for this step (the step lies inside one scale column).
    sc = tl.load(s_rows + k0 // QBLOCK, mask=n_ok & (k0 < K), other=0.0)
    if X_AS_A:
        wb = tl.load(w_base + k[:, None], mask=k_ok[:, None] & n_ok[None, :], other=0)
        xa = tl.load(x_base + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
    else:
        wb = tl.load(w_base + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0)
        # x^T tile [BLOCK_K, BLOCK_M]: the rows of x are contiguous along K, the tile's first dim.
        xa = tl.load(x_base + k[:, None], mask=k_ok[:, None] & m_ok[None, :], other=0.0)
    if HW_FP8:
        w = wb.to(tl.float8e4nv, bitcast=True)
    else:
        w = _e4m3_to_f32(wb.to(tl.int32))
    if X_AS_A:
        if DOT_FP32:
            # "ieee": the default fp32 dot is TF32, which would round the activations.
            part = tl.dot(xa.to(tl.float32), w.to(tl.float32), input_precision="ieee")
        elif X_POW2:
            x16, p = _pow2_fp16(xa, 1)
            part = tl.dot(x16, w.to(tl.float16), out_dtype=tl.float32) * p[:, None]
        else:
            part = tl.dot(xa.to(tl.float16), w.to(tl.float16), out_dtype=tl.float32)
        return acc + part * sc[None, :]
    else:
        if DOT_FP32:
            part = tl.dot(w.to(tl.float32), xa.to(tl.float32), input_precision="ieee")
        elif X_POW2:
            # fp16 operands: e4m3 -> fp16 is one packed conversion per two weights, e4m3 -> bf16 costs two
            # more (the conversions, not the bytes, bounded the bf16 version: 19 % of the copy ceiling at
            # M = 1 on the H200). bf16 activations go to fp16 exactly after a power of two per row and step,
            # undone on the partial.
            x16, p = _pow2_fp16(xa, 0)
            part = tl.dot(w.to(tl.float16), x16, out_dtype=tl.float32) * p[None, :]
        else:
            part = tl.dot(w.to(tl.float16), xa.to(tl.float16), out_dtype=tl.float32)
        return acc + part * sc[:, None]


@triton.jit
def _join_partial(acc, part_tile, slot, n_slots, cnt, y_ptrs, y_mask, p_mask, TILE: tl.constexpr):
    """Store ``acc`` as partial ``slot`` of a tile (``part_tile``: its ``n_slots`` partials, ``TILE`` floats apart);
    the program arriving last at the tile's counter ``cnt`` sums them in slot order ``0, 1, ..`` (whichever program
    got there last: bitwise reproducible), stores ``y`` and resets the counter for the next launch."""
    tl.store(part_tile + slot * TILE, acc, mask=p_mask)
    # Every warp's partial stores before the (single-thread) release below: CTA barrier, then a gpu-scope
    # acq_rel atomic, which is cumulative over what the barrier ordered before it.
    tl.debug_barrier()
    arrived = tl.atomic_add(cnt, 1, sem="acq_rel", scope="gpu")
    if arrived == n_slots - 1:
        # Every partial is visible. ".cg" reads from L2, never from a stale L1 line. n_slots is a runtime value:
        # groups of 4 partials are loaded together (one L2 round trip per group, not per partial), then added in
        # order; past n_slots nothing is added.
        total = tl.zeros(acc.shape, dtype=tl.float32)
        for i0 in range(0, n_slots, 4):
            for j in tl.static_range(4):
                i = i0 + j
                v = tl.load(part_tile + i * TILE, mask=p_mask & (i < n_slots), other=0.0, cache_modifier=".cg")
                total = tl.where(i < n_slots, total + v, total)
        tl.store(y_ptrs, total.to(y_ptrs.dtype.element_ty), mask=y_mask)
        # Ready for the next launch (or graph replay): nobody else touches this counter in this launch.
        tl.atomic_xchg(cnt, 0, sem="relaxed", scope="gpu")


@triton.jit
def _pdl_start(
    w_ptr, rows, stride_wn, k0, nbytes, PDL: tl.constexpr, PREFETCH: tl.constexpr, PDL_LATE: tl.constexpr
):  # fmt: skip
    """With PDL (`trtllm_glm.pdl`): let the next kernel be scheduled (unless ``PDL_LATE``: then after the main loop,
    `pdl_leave`), start moving the first ``nbytes`` of each weight row (a constant) at column ``k0`` into L2 while
    the kernel before this one finishes, then wait for it: after this, x may be read and y, partials and counters
    written. ``rows``: in-bounds row indices (a row past N repeats the last one, harmless); ``PREFETCH > 0`` only
    when K, the row stride and the base are 16-byte aligned (host-checked) and ``0 < nbytes``, a multiple of 16."""
    if PDL:
        if not PDL_LATE:
            pdl_trigger()
        if PREFETCH > 0:
            prefetch_l2(
                (w_ptr + rows.to(tl.int64) * stride_wn + k0).to(tl.int64), tl.zeros(rows.shape, tl.int32) + nbytes
            )
        pdl_wait()


# M not specialised: a decode step (M = 1) and a verify batch share one compile.
@triton.jit(do_not_specialize=["M"])
def _fp8_linear_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    y_ptr,
    part_ptr,
    cnt_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_sn,
    stride_ym,
    K_PER_SPLIT,
    SPLIT,
    SPLIT_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UNROLL: tl.constexpr,
    X_AS_A: tl.constexpr,
    QBLOCK: tl.constexpr,
    DOT_FP32: tl.constexpr,
    HW_FP8: tl.constexpr,
    X_POW2: tl.constexpr,
    PDL: tl.constexpr,
    PREFETCH: tl.constexpr,
    PDL_LATE: tl.constexpr,
):
    tile = tl.program_id(0)
    s = tl.program_id(1)
    rt = tl.program_id(2)
    nl = tl.arange(0, BLOCK_N)
    ml = tl.arange(0, BLOCK_M)
    n = tile * BLOCK_N + nl
    m = rt * BLOCK_M + ml
    kk = tl.arange(0, BLOCK_K)
    n_ok = n < N
    m_ok = m < M
    s_rows = s_ptr + (n // QBLOCK).to(tl.int64) * stride_sn
    k_begin = s * K_PER_SPLIT
    k_end = tl.minimum(k_begin + K_PER_SPLIT, K)
    _pdl_start(w_ptr, tl.minimum(n, N - 1), stride_wn, k_begin, tl.minimum(k_end - k_begin, PREFETCH), PDL, PREFETCH,
               PDL_LATE)  # fmt: skip
    if X_AS_A:
        # The fused MoE's orientation: x [BLOCK_M, BLOCK_K] is the MMA's left operand, the weight tile the right one,
        # loaded as [BLOCK_K, BLOCK_N] (k runs along memory); y^T tiles [BLOCK_M, BLOCK_N].
        w_base = w_ptr + n.to(tl.int64)[None, :] * stride_wn
        x_base = x_ptr + m.to(tl.int64)[:, None] * stride_xm
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    else:
        # Weight rows on the MMA's "M" side (a single activation row still fills a tensor-core tile).
        w_base = w_ptr + n.to(tl.int64)[:, None] * stride_wn
        x_base = x_ptr + m.to(tl.int64)[None, :] * stride_xm
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    # UNROLL steps of BLOCK_K per iteration (more loads issued together); chunks are multiples of the iteration,
    # so only the end of K can cut a step (masked: zeros, scale 0).
    for k_it in range(k_begin, k_end, BLOCK_K * UNROLL):
        for u in tl.static_range(UNROLL):
            acc = _k_step(acc, x_base, w_base, s_rows, k_it + u * BLOCK_K, kk, K, n_ok, m_ok,
                          X_AS_A, QBLOCK, DOT_FP32, HW_FP8, X_POW2)  # fmt: skip
    # ``PDL_LATE``: the weight has streamed, the program's last MMA is issued; what is left is its epilogue (a store,
    # or the split's join). Every program passes here once, before any branch, so the next kernel can launch while
    # the last wave stores and joins (it still waits for this grid's completion before reading y).
    pdl_leave(PDL, PDL_LATE)

    if X_AS_A:
        y_ptrs = y_ptr + m.to(tl.int64)[:, None] * stride_ym + n[None, :]
        y_mask = m_ok[:, None] & n_ok[None, :]
        p_offs = ml[:, None] * BLOCK_N + nl[None, :]
        p_mask = m_ok[:, None] & (nl >= 0)[None, :]
    else:
        y_ptrs = y_ptr + m.to(tl.int64)[None, :] * stride_ym + n[:, None]
        y_mask = n_ok[:, None] & m_ok[None, :]
        p_offs = nl[:, None] * BLOCK_M + ml[None, :]
        # All rows: a mask along the partials' contiguous dim (rows) would cut their loads to 4 bytes.
        p_mask = (nl >= 0)[:, None] & (ml >= 0)[None, :]
    if not SPLIT_K:
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=y_mask)
    else:
        # x_as_a: partials of the tile's live activation rows only (a decode step's one row: 1/16 of the bytes).
        part_tile = part_ptr + tile.to(tl.int64) * SPLIT * (BLOCK_N * BLOCK_M) + p_offs
        _join_partial(acc, part_tile, s, SPLIT, cnt_ptr + tile, y_ptrs, y_mask, p_mask, BLOCK_N * BLOCK_M)


@triton.jit(do_not_specialize=["M"])
def _fp8_linear_sk_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    y_ptr,
    part_ptr,
    cnt_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_sn,
    stride_ym,
    TILES,
    STEPS,
    PROGRAMS,
    MAX_SEG,
    BLOCK_N: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    QBLOCK: tl.constexpr,
    DOT_FP32: tl.constexpr,
    HW_FP8: tl.constexpr,
    X_POW2: tl.constexpr,
    PDL: tl.constexpr,
    PREFETCH: tl.constexpr,
    PDL_LATE: tl.constexpr,
):
    """Stream-K decode launch (x as the MMA's left operand, one row tile), grid ``(PROGRAMS,)``: the ``TILES *
    STEPS`` units (a tile of ``BLOCK_N`` weight rows times one ``BLOCK_K`` step) are cut into ``PROGRAMS`` equal
    runs, program ``p`` taking units ``[p U / P, (p + 1) U / P)``; a run covers the end of one tile, whole tiles,
    the start of another. A tile covered by one run stores ``y`` directly; otherwise each of its runs stores a
    partial in the slot ``p - (first program of the tile)`` and the last to arrive sums them in slot order
    (`_join_partial`). The cut depends on ``(N, K, PROGRAMS)`` only, never on M."""
    p = tl.program_id(0).to(tl.int64)
    nl = tl.arange(0, BLOCK_N)
    ml = tl.arange(0, BLOCK_M)
    kk = tl.arange(0, BLOCK_K)
    m_ok = ml < M
    x_base = x_ptr + ml.to(tl.int64)[:, None] * stride_xm
    units = TILES.to(tl.int64) * STEPS
    u = p * units // PROGRAMS
    end = (p + 1) * units // PROGRAMS
    t0 = u // STEPS
    j0 = u - t0 * STEPS
    first = tl.minimum(end - u, STEPS - j0) * BLOCK_K
    _pdl_start(w_ptr, tl.minimum(t0 * BLOCK_N + nl, N - 1), stride_wn, j0 * BLOCK_K,
               tl.minimum(tl.minimum(first, K - j0 * BLOCK_K), PREFETCH) // 16 * 16, PDL, PREFETCH,
               PDL_LATE)  # fmt: skip
    p_offs = ml[:, None] * BLOCK_N + nl[None, :]
    p_mask = m_ok[:, None] & (nl >= 0)[None, :]
    while u < end:
        t = u // STEPS
        j0 = u - t * STEPS
        j1 = tl.minimum(STEPS, j0 + (end - u))
        n = t * BLOCK_N + nl
        n_ok = n < N
        s_rows = s_ptr + (n // QBLOCK).to(tl.int64) * stride_sn
        w_base = w_ptr + n.to(tl.int64)[None, :] * stride_wn
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for j in range(j0, j1):
            acc = _k_step(acc, x_base, w_base, s_rows, j * BLOCK_K, kk, K, n_ok, m_ok,
                          True, QBLOCK, DOT_FP32, HW_FP8, X_POW2)  # fmt: skip
        y_ptrs = y_ptr + ml.to(tl.int64)[:, None] * stride_ym + n[None, :]
        y_mask = m_ok[:, None] & n_ok[None, :]
        if (j0 == 0) & (j1 == STEPS):
            tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=y_mask)
        else:
            # Programs of this tile: from the one whose run holds its first unit to the one holding its last.
            lo = ((t * STEPS + 1) * PROGRAMS - 1) // units
            hi = ((t * STEPS + STEPS) * PROGRAMS - 1) // units
            part_tile = part_ptr + t * MAX_SEG * (BLOCK_N * BLOCK_M) + p_offs
            _join_partial(acc, part_tile, p - lo, hi - lo + 1, cnt_ptr + t, y_ptrs, y_mask, p_mask,
                          BLOCK_N * BLOCK_M)  # fmt: skip
        u += j1 - j0
    # ``PDL_LATE``: after the program's whole run (its units are its main loop, joins included: a run that ends
    # inside a tile may hold that tile's last partial).
    pdl_leave(PDL, PDL_LATE)


_SCRATCH: dict[tuple[str, int, int, int, int, int], tuple[torch.Tensor, torch.Tensor]] = {}


def clear_scratch() -> None:
    """Drop the cached scratch buffers (tests; the next launch allocates fresh zeroed counters)."""
    _SCRATCH.clear()


def _scratch(
    device: torch.device, tiles: int, split: int, block_n: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(partials [tiles * split * block_n * block_m] fp32, counters [tiles] int32 zeros)`` for ``device``.

    Cached per shape: every launch leaves its counters at zero. A first call inside a CUDA-graph capture gets
    buffers of its own, not cached (their zeroing is part of the graph).
    """
    key = (str(device), device.index if device.index is not None else -1, tiles, split, block_n, block_m)
    hit = _SCRATCH.get(key)
    if hit is not None:
        return hit
    partials = torch.empty(tiles * split * block_n * block_m, dtype=torch.float32, device=device)
    counters = torch.zeros(tiles, dtype=torch.int32, device=device)
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return partials, counters
    _SCRATCH[key] = (partials, counters)
    return partials, counters


def launch_fp8_linear(
    x: torch.Tensor, w_codes: torch.Tensor, scale_inv: torch.Tensor, y: torch.Tensor, qblock: int,
    cfg: Fp8LinearConfig, dot_fp32: bool,
) -> None:  # fmt: skip
    """Launch `_fp8_linear_kernel` (arguments already checked by `trtllm_glm.quant.ops.fp8_linear`).

    Args:
        x: ``[M, K]`` fp32 / bf16 / fp16, unit last stride.
        w_codes: ``[N, K]`` uint8 view of the e4m3 weight, unit last stride.
        scale_inv: ``[ceil(N/qblock), ceil(K/qblock)]`` fp32, unit last stride.
        y: ``[M, N]`` (any float dtype), unit last stride; every element is written.
        qblock: scale tile edge.
        cfg: the launch shape (`launch_config`).
        dot_fp32: IEEE fp32 products instead of 16-bit MMAs (fp32 activations, and always interpreted).
    """
    m_rows, k = x.shape
    n = w_codes.shape[0]
    tiles = triton.cdiv(n, cfg.block_n)
    pdl = cfg.pdl and not INTERPRETED and has_pdl(x.device)
    aligned = k % 16 == 0 and w_codes.stride(0) % 16 == 0 and w_codes.data_ptr() % 16 == 0
    common = dict(BLOCK_N=cfg.block_n, BLOCK_M=cfg.block_m, BLOCK_K=cfg.block_k, QBLOCK=qblock,
                  DOT_FP32=dot_fp32 or INTERPRETED, HW_FP8=not INTERPRETED, X_POW2=x.dtype == torch.bfloat16,
                  PDL=pdl, PREFETCH=cfg.prefetch if pdl and aligned else 0, PDL_LATE=late_trigger(pdl),
                  num_warps=cfg.num_warps, num_stages=cfg.num_stages, **launch_kwargs(pdl))  # fmt: skip
    if cfg.programs:
        if m_rows > cfg.block_m:
            raise ValueError(f"a stream-K launch covers one row tile of {cfg.block_m} rows, got {m_rows}")
        partials, counters = _scratch(x.device, tiles, cfg.split, cfg.block_n, cfg.block_m)
        _fp8_linear_sk_kernel[(cfg.programs,)](
            x, w_codes, scale_inv, y, partials, counters, m_rows, n, k,
            x.stride(0), w_codes.stride(0), scale_inv.stride(0), y.stride(0),
            tiles, triton.cdiv(k, cfg.block_k), cfg.programs, cfg.split, **common,
        )  # fmt: skip
        return
    if cfg.split > 1:
        partials, counters = _scratch(x.device, tiles, cfg.split, cfg.block_n, cfg.block_m)
    else:
        partials = counters = y  # unused (SPLIT == 1 never touches them)
    grid = (tiles, cfg.split, triton.cdiv(m_rows, cfg.block_m))
    _fp8_linear_kernel[grid](
        x, w_codes, scale_inv, y, partials, counters,
        m_rows, n, k, x.stride(0), w_codes.stride(0), scale_inv.stride(0), y.stride(0), cfg.k_per_split, cfg.split,
        SPLIT_K=cfg.split > 1, UNROLL=cfg.unroll, X_AS_A=cfg.x_as_a, **common,
    )  # fmt: skip


@triton.jit
def _fp8_dequant_kernel(
    w_ptr, s_ptr, out_ptr, N, K, stride_wn, stride_sn, stride_on, QBLOCK: tl.constexpr, HW_FP8: tl.constexpr
):
    """Program ``(i, j)``: the ``QBLOCK x QBLOCK`` tile ``(i, j)`` of ``w`` times its scale, in ``out``'s dtype."""
    i = tl.program_id(0)
    j = tl.program_id(1)
    n = i * QBLOCK + tl.arange(0, QBLOCK)
    k = j * QBLOCK + tl.arange(0, QBLOCK)
    mask = (n < N)[:, None] & (k < K)[None, :]
    wb = tl.load(w_ptr + n.to(tl.int64)[:, None] * stride_wn + k[None, :], mask=mask, other=0)
    sc = tl.load(s_ptr + i * stride_sn + j)
    if HW_FP8:
        w = wb.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    else:
        w = _e4m3_to_f32(wb.to(tl.int32))
    tl.store(
        out_ptr + n.to(tl.int64)[:, None] * stride_on + k[None, :], (w * sc).to(out_ptr.dtype.element_ty), mask=mask
    )


def launch_fp8_dequant(w_codes: torch.Tensor, scale_inv: torch.Tensor, out: torch.Tensor, qblock: int) -> None:
    """``out [N, K] = w * scale_inv`` per ``qblock`` tile (fp32 product, rounded once to ``out``'s dtype).

    Args:
        w_codes: ``[N, K]`` uint8 view of the e4m3 weight, unit last stride.
        scale_inv: ``[ceil(N/qblock), ceil(K/qblock)]`` fp32, unit last stride.
        out: ``[N, K]`` float, unit last stride.
        qblock: scale tile edge (a power of two).
    """
    n, k = w_codes.shape
    grid = (triton.cdiv(n, qblock), triton.cdiv(k, qblock))
    _fp8_dequant_kernel[grid](
        w_codes, scale_inv, out, n, k, w_codes.stride(0), scale_inv.stride(0), out.stride(0), QBLOCK=qblock,
        HW_FP8=not INTERPRETED, num_warps=8,
    )  # fmt: skip
