"""Triton kernel: top-k complete pools per row (`ops.select_topk_pools`).

One program per row. The row's scores become order-preserving int32 keys (float bits with the magnitude
bits of negatives flipped; ``-0.0`` folded onto ``+0.0`` and every NaN onto the largest key, so that the
order is exactly ``torch.sort``'s; pools at or beyond the row's complete-pool count get the smallest key
and are never counted). Then:

1. Threshold search: the largest key ``K`` with ``count(key >= K) >= take`` (``take = min(topk, n_c)``),
   by bisection of an integer interval of keys. It starts at ``[smallest strided-group maximum, row
   maximum]`` (see the kernel: a valid lower end far above the row minimum) and stops early when a probe
   counts exactly ``take`` keys at or above it (then no tie needs breaking). Each probe is one
   compare-and-count over the row held in registers; random scores need about 12 to 20 probes, not 32.
2. Selection and compaction in one scan: every key ``> K``, then the first ``take - count(key > K)`` keys
   equal to ``K`` in pool order (ties go to the lower pool id, as the reference's stable sort does). A
   joint inclusive prefix sum of the two indicator vectors gives each chosen pool its output column, so
   ids come out ascending without a sort. Columns ``take .. topk - 1`` get ``-1``.

Rows longer than ``BLOCK`` pools (``max_pools > 32768`` by default) are processed in ``NCHUNK`` chunks that
are re-read from memory (L2) for every probe; at the model's sizes the row fits one chunk and is read once.

Defensive difference from the reference (which raises): a row whose complete-pool count exceeds the score
columns uses all columns. No host synchronisation, no allocation besides the output.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["select_topk_pools"]

_MAX_BLOCK = 32768
_INT_MIN = tl.constexpr(-2147483648)
_INT_MAX = tl.constexpr(2147483647)


@triton.jit
def _keys(row_ptr, base, n_c, max_pools, BLOCK: tl.constexpr, EVEN: tl.constexpr):
    """Order-preserving int32 keys of scores ``base .. base + BLOCK - 1``; invalid pools get INT_MIN."""
    p = base + tl.arange(0, BLOCK)
    valid = p < n_c
    if EVEN:
        # max_pools is a multiple of BLOCK: unmasked (16-byte) loads; the validity mask is applied below.
        x = tl.load(row_ptr + p)
    else:
        x = tl.load(row_ptr + p, mask=p < max_pools, other=0.0)
    bits = x.to(tl.int32, bitcast=True)
    # -0.0 compares equal to +0.0 in the reference's sort: give it +0.0's key.
    bits = tl.where(bits == _INT_MIN, 0, bits)
    # Negative floats: flip the magnitude bits so that a larger magnitude is a smaller signed integer.
    key = bits ^ ((bits >> 31) & _INT_MAX)
    # torch.sort puts every NaN first in descending order (both signs).
    key = tl.where(x != x, _INT_MAX, key)
    return tl.where(valid, key, _INT_MIN)


@triton.jit
def _count(
    row_ptr,
    n_c,
    max_pools,
    keys,
    t,
    STRICT: tl.constexpr,
    BLOCK: tl.constexpr,
    NCHUNK: tl.constexpr,
    EVEN: tl.constexpr,
):
    """Number of keys ``>= t`` (``> t`` if ``STRICT``); ``t`` is a valid key, so invalid pools never count."""
    if NCHUNK == 1:
        if STRICT:
            cnt = tl.sum((keys > t).to(tl.int32), axis=0)
        else:
            cnt = tl.sum((keys >= t).to(tl.int32), axis=0)
    else:
        cnt = 0
        for c in range(NCHUNK):
            kc = _keys(row_ptr, c * BLOCK, n_c, max_pools, BLOCK, EVEN)
            if STRICT:
                cnt += tl.sum((kc > t).to(tl.int32), axis=0)
            else:
                cnt += tl.sum((kc >= t).to(tl.int32), axis=0)
    return cnt


@triton.jit
def _emit(row_ptr, out_row, n_c, max_pools, kth, need, SUB: tl.constexpr, EVEN: tl.constexpr):
    """Write the chosen pool ids at their output columns, ``SUB`` pools at a time.

    The keys are re-read (from cache) per sub-block rather than kept from the search: the scan and the
    scattered stores need several registers per pool, which the whole row would not leave.
    """
    gt_off = 0
    eq_off = 0
    # Sub-blocks past the row's complete pools hold no candidate.
    for base in range(0, n_c, SUB):
        kc = _keys(row_ptr, base, n_c, max_pools, SUB, EVEN)
        # One scan of both indicators, packed: the count of keys > kth in the low 16 bits, of keys == kth
        # in the high 16 (each count is at most SUB <= 32768, so the low half never carries into the high
        # one; the int32 sum wraps, which keeps the bits).
        packed = (kc > kth).to(tl.int32) + ((kc == kth).to(tl.int32) << 16)
        inc = tl.cumsum(packed, axis=0)
        gt_inc = (inc & 0xFFFF) + gt_off
        eq_inc = ((inc >> 16) & 0xFFFF) + eq_off
        chosen = (kc > kth) | ((kc == kth) & (eq_inc <= need))
        col = gt_inc + tl.minimum(eq_inc, need) - 1
        tl.store(out_row + col, base + tl.arange(0, SUB), mask=chosen)
        tot = tl.sum(packed, axis=0)
        gt_off += tot & 0xFFFF
        eq_off += (tot >> 16) & 0xFFFF


@triton.jit
def _topk_kernel(
    scores_ptr,
    pos_ptr,
    out_ptr,
    max_pools,
    topk,
    stride_s,
    stride_o,
    BLOCK: tl.constexpr,
    NCHUNK: tl.constexpr,
    SUB: tl.constexpr,
    FILL: tl.constexpr,
    EVEN: tl.constexpr,
    GROUPS: tl.constexpr,
):
    n64 = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + n64).to(tl.int64)
    n_c = tl.minimum(tl.maximum((pos + 1) // 4, 0), max_pools).to(tl.int32)
    take = tl.minimum(n_c, topk)
    row_ptr = scores_ptr + n64 * stride_s
    out_row = out_ptr + n64 * stride_o

    # Columns take .. topk - 1 are padding; the chosen ids fill 0 .. take - 1 below (disjoint stores, so
    # every column is written exactly once and the output needs no pre-fill).
    for j0 in range(0, topk, FILL):
        j = j0 + tl.arange(0, FILL)
        tl.store(out_row + j, tl.full([FILL], -1, tl.int32), mask=(j >= take) & (j < topk))

    if take > 0:
        keys = _keys(row_ptr, 0, n_c, max_pools, BLOCK, EVEN)
        if NCHUNK == 1:
            hi = tl.max(keys, axis=0)
            if GROUPS > 0:
                # Tighter start: split the row into GROUPS >= topk strided groups (pool i in group i % GROUPS).
                # Every group holding a valid pool has one at or above its own maximum, so at least
                # min(GROUPS, n_c) >= take pools lie at or above the smallest group maximum: a valid lower
                # end that is far above the row's minimum (it saves about a third of the probes).
                gmax = tl.max(tl.reshape(keys, (BLOCK // GROUPS, GROUPS)), axis=0)
                lo = tl.min(tl.where(gmax == _INT_MIN, _INT_MAX, gmax), axis=0)
            else:
                lo = tl.min(tl.where(keys == _INT_MIN, _INT_MAX, keys), axis=0)
        else:
            hi = _INT_MIN
            lo = _INT_MAX
            for c in range(NCHUNK):
                kc = _keys(row_ptr, c * BLOCK, n_c, max_pools, BLOCK, EVEN)
                hi = tl.maximum(hi, tl.max(kc, axis=0))
                lo = tl.minimum(lo, tl.min(tl.where(kc == _INT_MIN, _INT_MAX, kc), axis=0))
        # Invariant: count(key >= lo) >= take (lo starts at the smallest valid key and take <= n_c), and
        # the answer is <= hi. Bisection in int64 (hi - lo can exceed the int32 range).
        lo64 = lo.to(tl.int64)
        hi64 = hi.to(tl.int64)
        while lo64 < hi64:
            mid = lo64 + (hi64 - lo64 + 1) // 2
            cnt = _count(row_ptr, n_c, max_pools, keys, mid.to(tl.int32), False, BLOCK, NCHUNK, EVEN)
            ge = cnt >= take
            # Exactly take keys at or above mid: that set is the answer, whatever K the full search would
            # find (no key lies between it and mid), so stop here.
            hi64 = tl.where(cnt == take, mid, tl.where(ge, hi64, mid - 1))
            lo64 = tl.where(ge, mid, lo64)
        kth = lo64.to(tl.int32)
        need = take - _count(row_ptr, n_c, max_pools, keys, kth, True, BLOCK, NCHUNK, EVEN)
        _emit(row_ptr, out_row, n_c, max_pools, kth, need, SUB, EVEN)


def select_topk_pools(
    scores: torch.Tensor,
    positions: torch.Tensor,
    topk_pools: int,
    *,
    out: torch.Tensor | None = None,
    block: int | None = None,
    num_warps: int | None = None,
    sub: int | None = None,
) -> torch.Tensor:
    """Top ``min(topk_pools, (pos + 1) // 4)`` complete pools per row; see the package's `select_topk_pools`.

    Args:
        scores: ``[N, max_pools]`` fp32 scores (last dim contiguous).
        positions: ``[N]`` int token positions.
        topk_pools: pools to keep per row.
        out: optional ``[N, topk_pools]`` int32 buffer to write into (every column is written).
        block: pools per chunk (power of two; default ``min(next_pow2(max_pools), 32768)``); tuning only.
        num_warps: warps per program; tuning only.
        sub: pools per sub-block of the final emit pass (power of two, at most 32768; default 16 per thread);
            tuning only.

    Returns:
        ``[N, topk_pools]`` int32 pool ids in ascending order, then ``-1`` padding.

    Raises:
        ValueError: shapes, dtypes or layouts disagree.
    """
    if scores.dim() != 2 or scores.dtype != torch.float32 or positions.shape != (scores.shape[0],):
        raise ValueError(
            f"expected scores [N, max_pools] fp32 and positions [N], got {tuple(scores.shape)} {scores.dtype}, "
            f"{tuple(positions.shape)}"
        )
    n_rows, max_pools = scores.shape
    if scores.stride(-1) != 1:
        scores = scores.contiguous()
    if out is None:
        out = torch.empty(n_rows, topk_pools, dtype=torch.int32, device=scores.device)
    elif out.shape != (n_rows, topk_pools) or out.dtype != torch.int32 or out.stride(-1) != 1:
        raise ValueError(f"out must be [N={n_rows}, {topk_pools}] int32, got {tuple(out.shape)} {out.dtype}")
    if n_rows == 0 or topk_pools == 0:
        return out
    if block is None:
        block = min(triton.next_power_of_2(max(max_pools, 16)), _MAX_BLOCK)
    if num_warps is None:
        # 8 warps measured fastest on the H200 for 32768 and 8192 pools (16: +5%, 32: +35%).
        num_warps = 8 if block >= 4096 else 4
    if sub is None:
        # 16 pools per thread keep the scan and the scattered stores within the register budget.
        sub = min(block, 16 * 32 * num_warps)
    groups = triton.next_power_of_2(topk_pools)
    if block > _MAX_BLOCK or sub > block or block & (block - 1) or sub & (sub - 1):
        raise ValueError(f"block and sub must be powers of two with sub <= block <= {_MAX_BLOCK}, got {block}, {sub}")
    _topk_kernel[(n_rows,)](
        scores,
        positions,
        out,
        max_pools,
        topk_pools,
        scores.stride(0),
        out.stride(0),
        BLOCK=block,
        NCHUNK=triton.cdiv(max(max_pools, 1), block),
        SUB=sub,
        FILL=min(1024, triton.next_power_of_2(topk_pools)),
        EVEN=max_pools % block == 0 and max_pools % sub == 0,
        GROUPS=groups if groups <= block // 2 else 0,
        num_warps=num_warps,
    )
    return out
