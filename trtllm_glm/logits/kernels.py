"""Triton kernels of `trtllm_glm.logits`: each row's greedy token and top-2 logit gap in two launches.

Exact (bit for bit `greedy_top2_reference`: first maximum, gap with multiplicity, NaN rows as torch). CPU: an
interpreted copy (`trtllm_glm.triton_interp`). Launches: docs/kernels.md, "Greedy id and top-2 gap".
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

__all__ = ["SAMPLE_MAX_K", "greedy_top2", "sample_top_k", "split_for", "warm_up_row_counts"]

# Larger than any column index (int32 columns: vocabularies below 2**31).
_NONE = tl.constexpr(2**31 - 1)


# Row counts never specialise (a grammar step's masked rows, an eager step's sampled rows: any count): the variants
# are only the constexprs, which `warm_up_row_counts` can reach at start-up.
@triton.jit(do_not_specialize=["NPART"])
def _partial_kernel(
    x_ptr,
    val_ptr,
    idx_ptr,
    V,
    cols_per_prog,
    stride_xn,
    NPART,
    f_ptr,
    stride_fn,
    m_ptr,
    stride_mn,
    BLOCK: tl.constexpr,
    WRITE_F32: tl.constexpr,
    HAS_MASK: tl.constexpr,
):
    n = tl.program_id(0)
    s = tl.program_id(1)
    nsplit = tl.num_programs(1)
    start = s * cols_per_prog
    end = tl.minimum(start + cols_per_prog, V)
    row = x_ptr + n.to(tl.int64) * stride_xn
    f_row = f_ptr + n.to(tl.int64) * stride_fn
    offs = tl.arange(0, BLOCK)
    m1 = tl.full((), float("-inf"), tl.float32)
    m2 = tl.full((), float("-inf"), tl.float32)
    i1 = tl.full((), _NONE, tl.int32)
    inan = tl.full((), _NONE, tl.int32)
    for b in range(start, end, BLOCK):
        cols = b + offs
        ok = cols < end
        x = tl.load(row + cols, mask=ok, other=float("-inf")).to(tl.float32)
        if WRITE_F32:  # the fp32 logits the step returns: the LM head's cast done by this read (exact)
            tl.store(f_row + cols, x, mask=ok)
        if HAS_MASK:  # a grammar's token bitmask: bit c % 32 of word c // 32 allows column c; the rest is -inf
            words = tl.load(m_ptr + n.to(tl.int64) * stride_mn + cols // 32, mask=ok, other=0)
            x = tl.where(((words >> (cols % 32)) & 1) != 0, x, float("-inf"))
        isnan = x != x
        inan = tl.minimum(inan, tl.min(tl.where(isnan & ok, cols, _NONE), axis=0))
        x = tl.where(isnan, float("-inf"), x)
        bm = tl.max(x, axis=0)
        # Masked columns hold -inf too, but come after every real column of the tile: min picks a real one.
        bi = tl.min(tl.where(x == bm, cols, _NONE), axis=0)
        b2 = tl.max(tl.where(cols == bi, float("-inf"), x), axis=0)
        # Tiles run in column order, so on an equal maximum the earlier column stays (the first maximum).
        take = (bm > m1) | (i1 == _NONE)
        m2 = tl.where(take, tl.maximum(m1, b2), tl.maximum(m2, bm))
        i1 = tl.where(take, bi, i1)
        m1 = tl.where(take, bm, m1)
    p = n * nsplit + s
    tl.store(val_ptr + p, m1)
    tl.store(val_ptr + NPART + p, m2)
    tl.store(idx_ptr + p, i1)
    tl.store(idx_ptr + NPART + p, inan)


@triton.jit(do_not_specialize=["N", "NSPLIT", "NPART"])
def _finish_kernel(
    val_ptr,
    idx_ptr,
    ids_ptr,
    gap_ptr,
    packed_ptr,
    acc_ptr,
    N,
    NSPLIT,
    NPART,
    BLOCK_N: tl.constexpr,
    SPLIT_PAD: tl.constexpr,
    WRITE_IDS: tl.constexpr,
    WRITE_GAP: tl.constexpr,
    WRITE_PACKED: tl.constexpr,
    HAS_ACC: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    sp = tl.arange(0, SPLIT_PAD)
    r_ok = rows < N
    ok = r_ok[:, None] & (sp < NSPLIT)[None, :]
    p = rows[:, None] * NSPLIT + sp[None, :]
    m1 = tl.load(val_ptr + p, mask=ok, other=float("-inf"))
    m2 = tl.load(val_ptr + NPART + p, mask=ok, other=float("-inf"))
    i1 = tl.load(idx_ptr + p, mask=ok, other=_NONE)
    inan = tl.load(idx_ptr + NPART + p, mask=ok, other=_NONE)
    gm = tl.max(m1, axis=1)
    # Columns of different partials are disjoint: the lowest column among the maxima is the first maximum.
    gi = tl.min(tl.where(m1 == gm[:, None], i1, _NONE), axis=1)
    win = i1 == gi[:, None]
    g2 = tl.max(tl.where(win, m2, m1), axis=1)
    gap = gm - g2
    fn = tl.min(inan, axis=1)
    has_nan = fn != _NONE
    ids = tl.where(has_nan, fn, gi)
    gap = tl.where(has_nan, float("nan"), gap)
    if WRITE_IDS:
        tl.store(ids_ptr + rows, ids.to(tl.int64), mask=r_ok)
    if WRITE_GAP:
        tl.store(gap_ptr + rows, gap, mask=r_ok)
    if WRITE_PACKED:
        if HAS_ACC:
            acc = tl.load(acc_ptr + rows, mask=r_ok, other=0).to(tl.float64)
        else:
            acc = tl.full((BLOCK_N,), 1.0, tl.float64)
        base = packed_ptr + rows.to(tl.int64) * 3
        tl.store(base, ids.to(tl.float64), mask=r_ok)
        tl.store(base + 1, gap.to(tl.float64), mask=r_ok)
        tl.store(base + 2, acc, mask=r_ok)


@functools.lru_cache(maxsize=8)
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # the interpreter: a few programs, enough to exercise the split path
    return torch.cuda.get_device_properties(device).multi_processor_count


def split_for(n: int, v: int, device: torch.device, block: int) -> int:
    """Programs per row of ``_partial_kernel`` (shapes only): about two waves of the GPU's SMs in all, at
    least one tile of ``block`` columns each, at most 1024 (the finish kernel holds a row's partials)."""
    want = triton.cdiv(2 * _num_sms(device), max(n, 1))
    return max(1, min(want, triton.cdiv(v, block), 1024))


def _columns(v: int, nsplit: int, block: int) -> tuple[int, int]:
    """``(programs, columns each)`` for ``nsplit`` asked: whole tiles per program, no empty programs."""
    cols = triton.cdiv(triton.cdiv(v, nsplit), block) * block
    return triton.cdiv(v, cols), cols


def warm_up_row_counts(n_max: int, v: int, device: torch.device, block: int = 1024) -> list[int]:
    """One row count up to ``n_max`` per compiled variant of `greedy_top2`'s kernels (the finish kernel's
    ``SPLIT_PAD`` and warp count follow `split_for`; nothing else depends on the row count)."""
    seen: dict[tuple[int, int], int] = {}
    for n in range(1, n_max + 1):
        nsplit, _ = _columns(v, split_for(n, v, device, block), block)
        seen.setdefault((max(2, triton.next_power_of_2(nsplit)), 1 if nsplit <= 32 else 4), n)
    return sorted(seen.values())


def greedy_top2(
    logits: torch.Tensor,
    *,
    want_ids: bool = True,
    want_gap: bool = True,
    packed: torch.Tensor | None = None,
    accepted: torch.Tensor | None = None,
    split: int | None = None,
    block: int = 1024,
    f32_out: torch.Tensor | None = None,
    bitmask: torch.Tensor | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Greedy ids and top-2 gaps of ``logits`` rows (see the module docstring), two launches.

    Args:
        logits: ``[N, V]`` float, last dim contiguous.
        want_ids: return the ``[N]`` int64 ids.
        want_gap: return the ``[N]`` fp32 gaps.
        packed: optional ``[N, 3]`` float64 output, written with ``(id, gap, accepted)`` per row.
        accepted: optional ``[N]`` integer counts for ``packed``'s last column (default 1).
        split: programs per row (default `split_for`).
        block: columns per tile.
        f32_out: optional ``[N, V]`` fp32 (last dim contiguous), written with ``logits`` upcast (the first launch
            reads every logit anyway: the LM head's ``.float()`` without its own launch).
        bitmask: optional ``[N, >= ceil(V / 32)]`` int32 on ``logits``' device, last dim contiguous: column ``c`` of
            row ``n`` counts only where bit ``c % 32`` of word ``c // 32`` is set (a grammar's mask; the others are
            read as ``-inf``, as the reference's ``masked_fill``); not with ``f32_out``.

    Returns:
        ``(ids or None, gap or None)``.
    """
    N, V = logits.shape
    dev = logits.device
    ids = torch.empty(N, dtype=torch.int64, device=dev) if want_ids else None
    gap = torch.empty(N, dtype=torch.float32, device=dev) if want_gap else None
    if N == 0:
        return ids, gap
    nsplit, cols = _columns(V, split or split_for(N, V, dev, block), block)
    npart = N * nsplit
    vals = torch.empty(2 * npart, dtype=torch.float32, device=dev)
    idxs = torch.empty(2 * npart, dtype=torch.int32, device=dev)
    if f32_out is not None and (f32_out.shape != (N, V) or f32_out.dtype != torch.float32 or f32_out.stride(-1) != 1):
        raise ValueError("greedy_top2: f32_out must be [N, V] fp32, last dim contiguous")
    f = f32_out if f32_out is not None else logits
    if bitmask is not None and (
        bitmask.dtype != torch.int32 or bitmask.shape[0] != N or bitmask.shape[1] * 32 < V or bitmask.stride(-1) != 1
    ):
        raise ValueError(f"greedy_top2: bitmask must be [{N}, >= {triton.cdiv(V, 32)}] int32, last dim contiguous")
    m = bitmask if bitmask is not None else idxs  # (unused pointer when there is no mask: its loads compile out)
    _partial_kernel[(N, nsplit)](
        logits, vals, idxs, V, cols, logits.stride(0), npart, f, f.stride(0), m, m.stride(0),
        BLOCK=block, WRITE_F32=f32_out is not None, HAS_MASK=bitmask is not None, num_warps=4,
    )  # fmt: skip
    block_n = 4
    dummy = vals  # unused pointer arguments (their stores are compiled out)
    _finish_kernel[(triton.cdiv(N, block_n),)](
        vals, idxs,
        ids if ids is not None else dummy,
        gap if gap is not None else dummy,
        packed if packed is not None else dummy,
        accepted if accepted is not None else dummy,
        N, nsplit, npart,
        BLOCK_N=block_n, SPLIT_PAD=max(2, triton.next_power_of_2(nsplit)),
        WRITE_IDS=ids is not None, WRITE_GAP=gap is not None, WRITE_PACKED=packed is not None,
        HAS_ACC=accepted is not None, num_warps=1 if nsplit <= 32 else 4,
    )  # fmt: skip
    return ids, gap


# ---------------------------------------------------------------------------------------------------------------
# Top-k sampling (`trtllm_glm.logits.sample_top_k`): temperature, top-k (k <= `SAMPLE_MAX_K`), top-p and the draw
# at each row's uniform, in two launches instead of ~25 torch ops with a sort of the whole vocabulary.
#
# Order: a token's key is its scaled logit's order-preserving int32 in the high half and ``2**31 - 1 - column`` in
# the low half, so one descending integer sort is the reference's stable descending sort (ties to the lower id).
#
# 1. ``_topk_chunk_kernel``, grid ``(R, cdiv(V, BLOCK))``: a program scales one ``BLOCK``-column chunk of its row
#    (``x / T`` in fp32, IEEE division as torch's), sorts its keys and stores the first ``KP`` (``KP``: the batch's
#    largest k, rounded to a power of two).
# 2. ``_sample_finish_kernel``, grid ``(R,)``: merges the chunks' sorted runs into the row's top ``KP`` (a descending
#    run and an ascending one give the top half of their union elementwise, bitonic, then one sort), then the
#    reference's arithmetic on them: the softmax of the first k, top-p (token j stays while the fp32 cumulative mass
#    before it is below p), the draw (the kept mass's fp64 cumulative sum searched at ``u`` times its total) and the
#    id written to ``out[row]``.
#
# Numerics: the scaled logits, their order and the kept set's ids are the reference's exactly; the softmax sum and
# the two cumulative sums run in a tree order (torch: its own), so probabilities agree to a few fp32 ulps and the
# token differs only where ``u`` lands within that rounding of a boundary, as between torch's devices.
# ---------------------------------------------------------------------------------------------------------------

SAMPLE_MAX_K = 256


@triton.jit
def _sample_key(y, cols):
    """int64 keys of fp32 ``y`` at int32 ``cols``: descending key order = descending value, then ascending column."""
    y = tl.where(y == 0.0, 0.0, y)  # -0.0 sorts with +0.0, as torch's comparisons do
    bits = y.to(tl.int32, bitcast=True)
    key32 = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    return (key32.to(tl.int64) << 32) | (2147483647 - cols).to(tl.int64)


@triton.jit
def _topk_chunk_kernel(
    x_ptr,
    rp_ptr,
    cand_ptr,
    V,
    stride_xn,
    NCHUNK,
    KP: tl.constexpr,
    BLOCK: tl.constexpr,
):
    r = tl.program_id(0)
    c = tl.program_id(1)
    row = tl.load(rp_ptr + r * 5 + 4).to(tl.int64)
    t = tl.load(rp_ptr + r * 5 + 1).to(tl.float32)
    cols = c * BLOCK + tl.arange(0, BLOCK)
    ok = cols < V
    x = tl.load(x_ptr + row * stride_xn + cols, mask=ok, other=0.0).to(tl.float32)
    key = _sample_key(tl.math.div_rn(x, tl.zeros_like(x) + t), cols)
    key = tl.where(ok, key, -9223372036854775807 - 1)  # past the vocabulary: below every real key
    key = ~tl.sort(~key)  # descending: the ascending sort of the inverted keys (the interpreter sorts it in numpy)
    pos = tl.arange(0, BLOCK)
    tl.store(cand_ptr + (r * NCHUNK + c).to(tl.int64) * KP + pos, key, mask=pos < KP)


@triton.jit
def _sample_finish_kernel(
    cand_ptr,
    rp_ptr,
    out_ptr,
    V,
    NCHUNK,
    KP: tl.constexpr,
):
    r = tl.program_id(0)
    pos = tl.arange(0, KP)
    base = cand_ptr + r.to(tl.int64) * NCHUNK * KP
    top = tl.load(base + pos)
    for c in range(1, NCHUNK):
        # The chunk's run read backwards is ascending: the elementwise max with the descending run holds the KP
        # largest keys of both (a bitonic sequence), sorted again.
        run = tl.load(base + c * KP + (KP - 1 - pos))
        top = ~tl.sort(~tl.maximum(top, run))
    hi = (top >> 32).to(tl.int32)
    vals = (hi ^ ((hi >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)
    ids = (2147483647 - (top & 0x7FFFFFFF)).to(tl.int64)
    u = tl.load(rp_ptr + r * 5)
    top_p = tl.load(rp_ptr + r * 5 + 2)
    k = tl.load(rp_ptr + r * 5 + 3)
    row = tl.load(rp_ptr + r * 5 + 4).to(tl.int64)
    # Softmax of the first k (the reference masks the rest to -inf; their exp is 0); a vocabulary below KP ends
    # the run early (the keys past it are padding).
    k_i = tl.minimum(k.to(tl.int32), V)
    in_k = pos < k_i
    v = tl.where(in_k, vals, float("-inf"))
    e = tl.exp(v - tl.max(v, axis=0))
    probs = e / tl.sum(e, axis=0)
    # Top-p: token j stays while the mass before it is < p, i.e. the kept prefix is 1 + #{i < KP - 1: c_i < p}.
    csum = tl.cumsum(probs, axis=0)
    n_keep = 1 + tl.sum(((pos < KP - 1) & (csum.to(tl.float64) < top_p)).to(tl.int32), axis=0)
    n_keep = tl.minimum(n_keep, k_i)
    kept = tl.where(pos < n_keep, probs, 0.0).to(tl.float64)
    c2 = tl.cumsum(kept, axis=0)
    total = tl.max(c2, axis=0)
    j = tl.sum((c2 <= u * total).to(tl.int32), axis=0)
    j = tl.minimum(j, n_keep - 1)
    tok = tl.sum(tl.where(pos == j, ids, 0), axis=0)
    tl.store(out_ptr + row, tok)


def sample_top_k(logits: torch.Tensor, rp: torch.Tensor, out: torch.Tensor, k_max: int, *, block: int = 2048) -> None:
    """Draw one token for each row listed in ``rp`` and write it to ``out`` (two launches, see above).

    Args:
        logits: ``[N, V]`` float, last dim contiguous.
        rp: ``[R, 5]`` float64 per drawn row: uniform, temperature, top-p (``inf`` when off), top-k, and the row of
            ``logits`` / ``out`` (exact in float64).
        out: ``[N]`` int64; only the listed rows are written.
        k_max: the largest top-k of the rows (1 .. `SAMPLE_MAX_K`).
        block: columns per chunk program (a power of two >= the rounded k).
    """
    R = rp.shape[0]
    if R == 0:
        return
    if not 1 <= k_max <= SAMPLE_MAX_K:
        raise ValueError(f"sample_top_k: k_max must be in [1, {SAMPLE_MAX_K}], got {k_max}")
    kp = max(2, triton.next_power_of_2(k_max))
    block = max(block, kp)
    V = logits.shape[1]
    nchunk = triton.cdiv(V, block)
    cand = torch.empty(R * nchunk * kp, dtype=torch.int64, device=logits.device)
    _topk_chunk_kernel[(R, nchunk)](logits, rp, cand, V, logits.stride(0), nchunk, KP=kp, BLOCK=block, num_warps=8)
    _sample_finish_kernel[(R,)](cand, rp, out, V, nchunk, KP=kp, num_warps=4)
