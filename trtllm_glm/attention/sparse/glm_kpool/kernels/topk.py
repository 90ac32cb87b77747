"""Triton kernels: top-k complete pools per row (`ops.select_topk_pools`), ids identical to the reference's.

Chunked path (a chunk pass, then a merge) by default, one program per row when a row fits one chunk; no host
sync, graph-capturable. Semantics, the threshold searches and the H200 measurements: docs/kernels.md, "Pool top-k".
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from trtllm_glm.pdl import late_trigger, pdl_leave, pdl_trigger, pdl_wait

from ._common import INTERPRETED

__all__ = ["chunked_shape", "select_topk_pools"]

_MAX_BLOCK = 32768
_DEFAULT_CHUNK = 4096
_DEFAULT_SEARCH = "bisect"
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
            lo, hi = _search_bounds(keys, BLOCK, GROUPS)
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


# --------------------------------------------------------------------------------------------------------
# Chunked path: several programs per row (see the module docstring).


@triton.jit
def _search_bounds(keys, BLOCK: tl.constexpr, GROUPS: tl.constexpr):
    """``(lo, hi)`` int32 bounds of a threshold search over one block of keys (invalid ones ``INT_MIN``).

    ``hi`` is the largest key. ``lo`` is the smallest valid key, or with ``GROUPS > 0`` a tighter start:
    split the block into ``GROUPS >= take`` strided groups (key ``i`` in group ``i % GROUPS``); every group
    holding a valid key has one at or above its own maximum, so at least ``min(GROUPS, valid) >= take`` keys
    lie at or above the smallest group maximum, a valid lower end far above the minimum (it saves about a
    third of the probes).
    """
    hi = tl.max(keys, axis=0)
    if GROUPS > 0:
        gmax = tl.max(tl.reshape(keys, (BLOCK // GROUPS, GROUPS)), axis=0)
        lo = tl.min(tl.where(gmax == _INT_MIN, _INT_MAX, gmax), axis=0)
    else:
        lo = tl.min(tl.where(keys == _INT_MIN, _INT_MAX, keys), axis=0)
    return lo, hi


@triton.jit
def _threshold(keys, take, win, lo, hi, BIG: tl.constexpr):
    """Threshold over keys held in registers: ``(kth, need)`` such that the keys ``> kth`` plus the first
    ``need`` keys ``== kth`` (in pool order) are between ``take`` and ``win`` keys that include the top
    ``take`` under (key desc, pool asc).

    Bisection of the integer interval ``[lo, hi]`` (int64: ``hi - lo`` can exceed the int32 range) for the
    largest ``K`` with ``count(key >= K) >= take``, stopped early as soon as a probe counts between ``take``
    and ``win`` keys at or above it (then every key at or above the probe is taken and no tie is broken).
    Requires ``0 < take <= count(key >= lo)``, ``hi`` the largest key and ``BIG > win``.
    """
    lo64 = lo.to(tl.int64)
    hi64 = hi.to(tl.int64)
    # c_lo = count(key >= lo) once a probe has moved lo (BIG before: unknown); c_hi = count(key > hi).
    c_lo = take - take + BIG
    c_hi = take - take
    found = take - take
    while lo64 < hi64:
        mid = lo64 + (hi64 - lo64 + 1) // 2
        cnt = tl.sum((keys >= mid.to(tl.int32)).to(tl.int32), axis=0)
        ge = cnt >= take
        hit = ge & (cnt <= win)
        lo64 = tl.where(ge, mid, lo64)
        c_lo = tl.where(ge, cnt, c_lo)
        hi64 = tl.where(hit, mid, tl.where(ge, hi64, mid - 1))
        c_hi = tl.where(ge, c_hi, cnt)
        found = found | hit.to(tl.int32)
    # Early stop: every key >= kth (at most win) is taken. Otherwise lo == hi == K: count(key > K) = c_hi <
    # take; all keys == K fit if count(key >= K) = c_lo <= win, else the first take - c_hi of them.
    need = tl.where(found != 0, win, tl.where(c_lo <= win, c_lo - c_hi, take - c_hi))
    return lo64.to(tl.int32), need


@triton.jit
def _sum_min_max(n0, a0, b0, n1, a1, b1):
    return n0 + n1, tl.minimum(a0, a1), tl.maximum(b0, b1)


@triton.jit
def _threshold_snap(keys, take, win, lo, hi, BIG: tl.constexpr):
    """`_threshold`'s contract, with fewer probes: each probe ``t`` also finds the smallest key ``>= t`` and
    the largest key ``< t`` (one three-way reduction), and the bracket's ends move onto those actual keys.
    Then exact ties end the search at once (the bracket holds one distinct key), and the next probe can be
    placed by linear interpolation of the counts at the bracket's ends (aiming at ``take + 0.5`` keys);
    an interpolation step that does not halve the bracket is followed by a bisection step.

    Requires ``0 < take <= count(key >= lo)`` with ``lo`` an actual key, ``hi`` the largest key, ``BIG > win``.
    """
    lo64 = lo.to(tl.int64)
    hi64 = hi.to(tl.int64)
    # c_lo = count(key >= lo) once a probe has moved lo (BIG before: unknown); c_hi = count(key > hi).
    c_lo = take - take + BIG
    c_hi = take - take
    found = take - take
    bis = take - take + 1
    # c_hi == take - 1 means the answer is hi: count(key >= hi) >= c_hi + 1 and count(key > hi) < take.
    while (lo64 < hi64) & (found == 0) & (c_hi != take - 1):
        w = hi64 - lo64
        frac = ((c_lo - take).to(tl.float32) + 0.5) / (c_lo - c_hi).to(tl.float32)
        mid_i = tl.minimum(tl.maximum(lo64 + (frac * (w + 1).to(tl.float32)).to(tl.int64), lo64 + 1), hi64)
        mid = tl.where((bis != 0) | (c_lo == BIG), lo64 + (w + 1) // 2, mid_i)
        t = mid.to(tl.int32)
        ge = keys >= t
        cnt, succ, pred = tl.reduce(
            (ge.to(tl.int32), tl.where(ge, keys, _INT_MAX), tl.where(ge, _INT_MIN, keys)), 0, _sum_min_max
        )
        up = cnt >= take
        found = found | (up & (cnt <= win)).to(tl.int32)
        new_lo = tl.where(up, succ.to(tl.int64), lo64)
        new_hi = tl.where(up, hi64, pred.to(tl.int64))
        c_lo = tl.where(up, cnt, c_lo)
        c_hi = tl.where(up, c_hi, cnt)
        bis = ((bis == 0) & ((new_hi - new_lo) * 2 > w)).to(tl.int32)
        lo64 = new_lo
        hi64 = new_hi
    # found: every key >= lo (at most win) is taken. Otherwise the answer K is hi (lo == hi, or c_hi == take
    # - 1): the keys > K (c_hi < take of them) and the first take - c_hi keys == K.
    kth = tl.where(found != 0, lo64, hi64).to(tl.int32)
    need = tl.where(found != 0, win, take - c_hi)
    return kth, need


@triton.jit
def _slots(keys, kth, need):
    """Output slot of each chosen key (keys ``> kth``, then the first ``need`` keys ``== kth``, in order),
    the chosen mask and the number chosen. One scan of both indicators packed in one int32: the count of
    keys ``> kth`` in the low 16 bits, of keys ``== kth`` in the high 16 (block sizes are at most 32768)."""
    gt = keys > kth
    eq = keys == kth
    packed = gt.to(tl.int32) + (eq.to(tl.int32) << 16)
    inc = tl.cumsum(packed, axis=0)
    eq_inc = (inc >> 16) & 0xFFFF
    chosen = gt | (eq & (eq_inc <= need))
    col = (inc & 0xFFFF) + tl.minimum(eq_inc, need) - 1
    tot = tl.sum(packed, axis=0)
    n_sel = (tot & 0xFFFF) + tl.minimum((tot >> 16) & 0xFFFF, need)
    return col, chosen, n_sel


@triton.jit
def _chunk_kernel(
    scores_ptr,
    pos_ptr,
    ckey_ptr,
    cid_ptr,
    thr_ptr,
    max_pools,
    topk,
    stride_s,
    BLOCK: tl.constexpr,
    NCHUNK: tl.constexpr,
    SLOTS: tl.constexpr,
    GROUPS: tl.constexpr,
    EVEN: tl.constexpr,
    PDL: tl.constexpr,
    SNAP: tl.constexpr,
    PDL_LATE: tl.constexpr,
):
    """Pass 1, program (chunk c, row n): a superset of the chunk's top ``take`` (at most SLOTS keys)."""
    if PDL and not PDL_LATE:
        # The merge pass may be scheduled now (``PDL_LATE``: at the end); it waits for this grid's completion and
        # flush before reading.
        pdl_trigger()
    c = tl.program_id(0)
    n64 = tl.program_id(1).to(tl.int64)
    pos = tl.load(pos_ptr + n64).to(tl.int64)
    n_c = tl.minimum(tl.maximum((pos + 1) // 4, 0), max_pools).to(tl.int32)
    take = tl.minimum(n_c, topk)
    base = c * BLOCK
    valid = tl.minimum(tl.maximum(n_c - base, 0), BLOCK)
    take_c = tl.minimum(take, valid)
    keys = _keys(scores_ptr + n64 * stride_s, base, n_c, max_pools, BLOCK, EVEN)
    # take_c == valid (including 0): every valid pool of the chunk is a candidate (invalid keys are INT_MIN).
    kth = take_c - take_c + _INT_MIN
    need = take_c - take_c
    if take_c < valid:
        lo, hi = _search_bounds(keys, BLOCK, GROUPS)
        if SNAP:
            kth, need = _threshold_snap(keys, take_c, SLOTS, lo, hi, BLOCK + 1)
        else:
            kth, need = _threshold(keys, take_c, SLOTS, lo, hi, BLOCK + 1)
    col, chosen, n_sel = _slots(keys, kth, need)
    dst = (n64 * NCHUNK + c) * SLOTS
    tl.store(ckey_ptr + dst + col, keys, mask=chosen)
    tl.store(cid_ptr + dst + col, base + tl.arange(0, BLOCK), mask=chosen)
    j = tl.arange(0, SLOTS)
    # Unused slots get the smallest key, which the merge pass never takes (every valid key is larger).
    tl.store(ckey_ptr + dst + j, tl.full([SLOTS], _INT_MIN, tl.int32), mask=j >= n_sel)
    # A lower bound for the row's threshold from a chunk that holds take candidates at or above kth.
    tl.store(thr_ptr + n64 * NCHUNK + c, tl.where(take_c == take, kth, _INT_MIN))
    pdl_leave(PDL, PDL_LATE)


@triton.jit
def _merge_kernel(
    pos_ptr,
    ckey_ptr,
    cid_ptr,
    thr_ptr,
    out_ptr,
    max_pools,
    topk,
    stride_o,
    NCHUNK: tl.constexpr,
    CPOW: tl.constexpr,
    SLOTS: tl.constexpr,
    CAND: tl.constexpr,
    GROUPS: tl.constexpr,
    FILL: tl.constexpr,
    PDL: tl.constexpr,
    SNAP: tl.constexpr,
):
    """Pass 2, program n: the exact top ``take`` of the row's candidates, ascending ids, ``-1`` padding."""
    if PDL:
        # Launched early (programmatic dependent launch): wait for the chunk pass to complete and flush.
        pdl_wait()
    n64 = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + n64).to(tl.int64)
    n_c = tl.minimum(tl.maximum((pos + 1) // 4, 0), max_pools).to(tl.int32)
    take = tl.minimum(n_c, topk)
    out_row = out_ptr + n64 * stride_o
    for j0 in range(0, topk, FILL):
        j = j0 + tl.arange(0, FILL)
        tl.store(out_row + j, tl.full([FILL], -1, tl.int32), mask=(j >= take) & (j < topk))
    if take > 0:
        j = tl.arange(0, CAND)
        src = n64 * (NCHUNK * SLOTS)
        if CAND == NCHUNK * SLOTS:
            keys = tl.load(ckey_ptr + src + j)
        else:
            keys = tl.load(ckey_ptr + src + j, mask=j < NCHUNK * SLOTS, other=_INT_MIN)
        # Candidates sit chunk after chunk, each chunk's in ascending pool order: slot order is pool order.
        cj = tl.arange(0, CPOW)
        lo = tl.max(tl.load(thr_ptr + n64 * NCHUNK + cj, mask=cj < NCHUNK, other=_INT_MIN), axis=0)
        hi = tl.max(keys, axis=0)
        # Strided groups of slots (slot s in group s % GROUPS): chunk 0 holds take candidates in slots
        # 0 .. take - 1 (it has at least min(n_c, BLOCK) >= take valid pools), so at least take groups are
        # non-empty and the smallest non-empty group maximum is a valid lower end as well.
        gmax = tl.max(tl.reshape(keys, (CAND // GROUPS, GROUPS)), axis=0)
        lo = tl.maximum(lo, tl.min(tl.where(gmax == _INT_MIN, _INT_MAX, gmax), axis=0))
        if SNAP:
            kth, need = _threshold_snap(keys, take, take, lo, hi, CAND + 1)
        else:
            kth, need = _threshold(keys, take, take, lo, hi, CAND + 1)
        col, chosen, n_sel = _slots(keys, kth, need)
        ids = tl.load(cid_ptr + src + j, mask=chosen, other=0)
        tl.store(out_row + col, ids, mask=chosen)


@functools.cache
def _has_pdl(index: int | None) -> bool:
    """Programmatic dependent launch (``griddepcontrol``) exists from compute capability 9.0 on."""
    return torch.cuda.get_device_capability(index)[0] >= 9


def _pow2(x: int) -> int:
    return triton.next_power_of_2(max(int(x), 1))


def chunked_shape(
    max_pools: int, topk_pools: int, chunk: int | None = None, slots: int | None = None
) -> tuple[int, int, int] | None:
    """``(chunk, n_chunks, slots)`` of the chunked path for these shapes, or ``None`` when it does not apply.

    The path needs at least two chunks of a power-of-two size ``>= next_pow2(topk_pools)`` and at most
    32768 candidate slots per row. Defaults: ``chunk`` = 4096 pools (at least ``next_pow2(topk_pools)``),
    ``slots`` = ``2 * next_pow2(topk_pools)`` per chunk when that fits, else ``next_pow2(topk_pools)``.
    """
    takep = _pow2(topk_pools)
    if chunk is None:
        chunk = max(_DEFAULT_CHUNK, takep)
    n_chunks = triton.cdiv(max(max_pools, 1), chunk)
    if slots is None:
        slots = 2 * takep if n_chunks * 2 * takep <= _MAX_BLOCK else takep
    if n_chunks < 2 or chunk < takep or slots < takep or n_chunks * slots > _MAX_BLOCK or chunk > _MAX_BLOCK:
        return None
    if chunk & (chunk - 1) or slots & (slots - 1):
        return None
    return chunk, n_chunks, slots


def select_topk_pools(
    scores: torch.Tensor,
    positions: torch.Tensor,
    topk_pools: int,
    *,
    out: torch.Tensor | None = None,
    method: str | None = None,
    chunk: int | None = None,
    slots: int | None = None,
    num_warps: int | None = None,
    merge_warps: int | None = None,
    pdl: bool | None = None,
    search: str | None = None,
    block: int | None = None,
    sub: int | None = None,
) -> torch.Tensor:
    """Top ``min(topk_pools, (pos + 1) // 4)`` complete pools per row; see the package's `select_topk_pools`.

    Args:
        scores: ``[N, max_pools]`` fp32 scores (last dim contiguous).
        positions: ``[N]`` int token positions.
        topk_pools: pools to keep per row.
        out: optional ``[N, topk_pools]`` int32 buffer to write into (every column is written).
        method: ``"chunked"`` (several programs per row, two launches) or ``"row"`` (one program per row);
            default: chunked whenever `chunked_shape` allows it (``max_pools`` above one chunk).
        chunk: pools per chunk program of the chunked path (power of two ``>= next_pow2(topk_pools)``);
            tuning only.
        slots: candidate slots per chunk (power of two ``>= next_pow2(topk_pools)``); tuning only.
        num_warps: warps per program (the chunk pass of the chunked path); tuning only.
        merge_warps: warps per program of the merge pass; tuning only.
        pdl: launch the merge pass with programmatic dependent launch (default: on CUDA devices of compute
            capability 9.0 or newer; never under the interpreter); tuning only. The chunk pass lets it launch at
            its start, or at its end under ``TRTLLM_GLM_PDL_TRIGGER=end`` (`trtllm_glm.pdl.late_trigger`).
        search: threshold search of the chunked path: ``"bisect"`` (default; `_threshold`) or ``"snap"``
            (`_threshold_snap`), or ``"CHUNK/MERGE"`` (e.g. ``"bisect/snap"``) for one per pass; tuning only.
        block: row path only: pools per register block (power of two; default ``min(next_pow2(max_pools),
            32768)``); giving it (or ``sub``) selects the row path; tuning only.
        sub: row path only: pools per sub-block of the final emit pass (power of two, at most 32768;
            default 16 per thread); tuning only.

    Returns:
        ``[N, topk_pools]`` int32 pool ids in ascending order, then ``-1`` padding.

    Raises:
        ValueError: shapes, dtypes or layouts disagree, or a tuning argument is invalid.
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
    if method is None:
        method = "row" if block is not None or sub is not None else "auto"
    if method not in ("auto", "row", "chunked"):
        raise ValueError(f"method must be 'row' or 'chunked', got {method!r}")
    shape = None if method == "row" else chunked_shape(max_pools, topk_pools, chunk, slots)
    if method == "chunked" and shape is None:
        raise ValueError(f"no chunked launch for {max_pools} pools, topk {topk_pools}, chunk {chunk}, slots {slots}")
    if shape is None:
        return _select_rows(scores, positions, topk_pools, out, block, num_warps, sub)
    chunk, n_chunks, slots = shape
    takep = _pow2(topk_pools)
    cand = _pow2(n_chunks * slots)
    if pdl is None:
        pdl = scores.device.type == "cuda" and _has_pdl(scores.device.index)
    pdl = bool(pdl) and not INTERPRETED
    modes = (search or _DEFAULT_SEARCH).split("/")
    if len(modes) not in (1, 2) or any(m not in ("snap", "bisect") for m in modes):
        raise ValueError(f"search must be 'snap', 'bisect' or 'CHUNK/MERGE' of those, got {search!r}")
    snap_chunk, snap_merge = modes[0] == "snap", modes[-1] == "snap"
    # Scratch from the caching allocator (sizes from shapes only, so the call can be captured in a graph).
    ckey = torch.empty(n_rows, n_chunks, slots, dtype=torch.int32, device=scores.device)
    cid = torch.empty_like(ckey)
    thr = torch.empty(n_rows, n_chunks, dtype=torch.int32, device=scores.device)
    _chunk_kernel[(n_chunks, n_rows)](
        scores,
        positions,
        ckey,
        cid,
        thr,
        max_pools,
        topk_pools,
        scores.stride(0),
        BLOCK=chunk,
        NCHUNK=n_chunks,
        SLOTS=slots,
        GROUPS=takep if takep <= chunk // 2 else 0,
        EVEN=max_pools % chunk == 0,
        PDL=pdl,
        SNAP=snap_chunk,
        PDL_LATE=late_trigger(pdl),
        num_warps=num_warps or min(max(chunk // 1024, 1), 8),
    )
    merge_kw = {"launch_pdl": True} if pdl else {}
    _merge_kernel[(n_rows,)](
        positions,
        ckey,
        cid,
        thr,
        out,
        max_pools,
        topk_pools,
        out.stride(0),
        NCHUNK=n_chunks,
        CPOW=_pow2(n_chunks),
        SLOTS=slots,
        CAND=cand,
        GROUPS=takep,
        FILL=min(1024, takep),
        PDL=pdl,
        SNAP=snap_merge,
        num_warps=merge_warps or min(max(cand // 1024, 4), 8),
        **merge_kw,
    )
    return out


def _select_rows(
    scores: torch.Tensor,
    positions: torch.Tensor,
    topk_pools: int,
    out: torch.Tensor,
    block: int | None,
    num_warps: int | None,
    sub: int | None,
) -> torch.Tensor:
    """The row path: one `_topk_kernel` program per row."""
    n_rows, max_pools = scores.shape
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
