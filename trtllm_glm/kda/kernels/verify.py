"""Triton kernels of the KDA speculative verify pass and its commit (`ops.verify` is the torch reference).

One program per (sequence, head, ``BV`` value channels), the state tile in FP32 registers; a commit of ``a = 0``
leaves the slot's bits untouched. The recurrences and the slot / ``fresh`` addressing: docs/kernels.md, "KDA verify
and commit".
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from trtllm_glm.kda.contract import KdaRecords
from trtllm_glm.numerics import batch_invariant

__all__ = ["kda_verify", "kda_commit", "kda_decode_inplace", "choose_block_v"]


def _fusion_opts() -> dict[str, bool]:
    """Compile options of a launch: in the batch-invariant mode no mul/add contraction into FMAs.

    The compiler contracts a product into an FMA depending on the product's other uses, which differ between
    the verify loop, the one-row decode and the commit; with contraction off every operation rounds as written,
    so the shared step (`_kda_step`) gives the same bits wherever it runs. (The interpreter ignores the option.)
    """
    return {"enable_fp_fusion": False} if batch_invariant() else {}


@triton.jit
def _decay_rank1(S, b_g, b_k, b_u):
    """``exp(g)[:, None] * S + k u^T`` of one row: the commit's replay of `_kda_step`'s state update.

    The same two operations as the step (a decay multiply, then the rank-one add as an explicit ``fma``, one
    rounding), so the compiler's mul/add contraction, which depends on how many other uses a product has, cannot
    make the commit round differently from the step.
    """
    S = S * tl.exp(b_g)[:, None]
    return tl.fma(b_k[:, None], b_u[None, :], S)


@triton.jit
def _kda_step(S, b_q, b_k, b_v, b_g, b_beta, scale):
    """One delta-rule row on an FP32 state tile ``S [BK, BV]``; returns ``(S_new, o [BV], u [BV])``.

    The reference's order: decay first, the correction reads the decayed state, the output the updated one.
    The verify rows and the in-place decode run this very function (same launch shape in the batch-invariant
    mode), so a verify row's output has the decode's bits; `_decay_rank1` is the commit's replay.
    """
    S_dec = S * tl.exp(b_g)[:, None]
    b_u = b_beta * (b_v - tl.sum(b_k[:, None] * S_dec, 0))
    S_new = tl.fma(b_k[:, None], b_u[None, :], S_dec)
    b_o = tl.sum((b_q * scale)[:, None] * S_new, 0)
    return S_new, b_o, b_u


@triton.jit
def _kda_verify_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    g_ptr,
    beta_ptr,
    state_ptr,
    slot_ptr,
    fresh_ptr,
    widths_ptr,
    o_ptr,
    u_ptr,
    scale,
    W,
    sq_n,
    sq_w,
    sq_h,
    sq_k,
    sk_n,
    sk_w,
    sk_h,
    sk_k,
    sv_n,
    sv_w,
    sv_h,
    sv_v,
    sg_n,
    sg_w,
    sg_h,
    sg_k,
    sb_n,
    sb_w,
    sb_h,
    ss_n,
    ss_h,
    ss_k,
    ss_v,
    so_n,
    so_w,
    so_h,
    su_n,
    su_w,
    su_h,
    H: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    HAS_SLOTS: tl.constexpr,
    HAS_FRESH: tl.constexpr,
    HAS_WIDTHS: tl.constexpr,
    STAGES: tl.constexpr,
    STORE_U: tl.constexpr,
    STORE_STATE: tl.constexpr,
):
    i_nh = tl.program_id(0).to(tl.int64)
    i_v = tl.program_id(1)
    n = i_nh // H
    h = i_nh % H
    ok = tl.arange(0, BK)
    ov = i_v * BV + tl.arange(0, BV)
    mk = ok < K
    mv = ov < V
    m_s = mk[:, None] & mv[None, :]
    if HAS_SLOTS:
        s = tl.load(slot_ptr + n).to(tl.int64)
    else:
        s = n
    if HAS_FRESH:
        # Masked, not multiplied: a fresh sequence's slot may hold NaN/inf from an earlier owner.
        m_s = m_s & (tl.load(fresh_ptr + n) == 0)
    p_s = state_ptr + s * ss_n + h * ss_h + ok[:, None] * ss_k + ov[None, :] * ss_v
    S = tl.load(p_s, mask=m_s, other=0.0).to(tl.float32)

    p_q = q_ptr + n * sq_n + h * sq_h + ok * sq_k
    p_k = k_ptr + n * sk_n + h * sk_h + ok * sk_k
    p_g = g_ptr + n * sg_n + h * sg_h + ok * sg_k
    p_v = v_ptr + n * sv_n + h * sv_h + ov * sv_v
    p_b = beta_ptr + n * sb_n + h * sb_h
    p_o = o_ptr + n * so_n + h * so_h + ov
    p_u = u_ptr + n * su_n + h * su_h + ov
    if HAS_WIDTHS:
        # Only the sequence's own rows: a short sequence in a grid padded to a wider one (a decode row riding a
        # short prefill's grid) costs its own rows, not the widest's.
        rows = tl.minimum(tl.load(widths_ptr + n).to(tl.int32), W)
    else:
        rows = W
    # STAGES = 2: the pipeliner prefetches row t + 1's inputs (cp.async) while row t computes, as fla does.
    for t in tl.range(0, rows, num_stages=STAGES):
        b_q = tl.load(p_q + t * sq_w, mask=mk, other=0.0).to(tl.float32)
        b_k = tl.load(p_k + t * sk_w, mask=mk, other=0.0).to(tl.float32)
        b_g = tl.load(p_g + t * sg_w, mask=mk, other=0.0).to(tl.float32)
        b_v = tl.load(p_v + t * sv_w, mask=mv, other=0.0).to(tl.float32)
        b_beta = tl.load(p_b + t * sb_w).to(tl.float32)
        S, b_o, b_u = _kda_step(S, b_q, b_k, b_v, b_g, b_beta, scale)
        tl.store(p_o + t * so_w, b_o, mask=mv)
        if STORE_U:
            tl.store(p_u + t * su_w, b_u, mask=mv)
    if STORE_STATE:
        # The in-place decode (`kda_decode_inplace`): the running state goes back to the slot.
        tl.store(p_s, S.to(state_ptr.dtype.element_ty), mask=m_s)


@triton.jit
def _kda_commit_kernel(
    state_ptr,
    slot_ptr,
    fresh_ptr,
    a_ptr,
    g_ptr,
    k_ptr,
    u_ptr,
    W,
    sa_n,
    ss_n,
    ss_h,
    ss_k,
    ss_v,
    sg_n,
    sg_w,
    sg_h,
    sg_k,
    sk_n,
    sk_w,
    sk_h,
    sk_k,
    su_n,
    su_w,
    su_h,
    su_v,
    H: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    HAS_SLOTS: tl.constexpr,
    HAS_FRESH: tl.constexpr,
    STAGES: tl.constexpr,
):
    i_nh = tl.program_id(0).to(tl.int64)
    i_v = tl.program_id(1)
    n = i_nh // H
    h = i_nh % H
    ok = tl.arange(0, BK)
    ov = i_v * BV + tl.arange(0, BV)
    mk = ok < K
    mv = ov < V
    m_s = mk[:, None] & mv[None, :]
    if HAS_SLOTS:
        s = tl.load(slot_ptr + n).to(tl.int64)
    else:
        s = n
    a = tl.load(a_ptr + n * sa_n).to(tl.int32)
    a = tl.minimum(tl.maximum(a, 0), W)
    m_load = m_s
    m_store = m_s & (a > 0)
    if HAS_FRESH:
        f = tl.load(fresh_ptr + n)
        m_load = m_load & (f == 0)
        # A fresh sequence's slot becomes its (zero-started) state even when nothing is accepted.
        m_store = m_s & ((a > 0) | (f != 0))
    p_s = state_ptr + s * ss_n + h * ss_h + ok[:, None] * ss_k + ov[None, :] * ss_v
    S = tl.load(p_s, mask=m_load, other=0.0).to(tl.float32)

    p_g = g_ptr + n * sg_n + h * sg_h + ok * sg_k
    p_k = k_ptr + n * sk_n + h * sk_h + ok * sk_k
    p_u = u_ptr + n * su_n + h * su_h + ov * su_v
    # Run-time trip count: only the accepted rows' records are read.
    for t in tl.range(0, a, num_stages=STAGES):
        b_g = tl.load(p_g + t * sg_w, mask=mk, other=0.0).to(tl.float32)
        b_k = tl.load(p_k + t * sk_w, mask=mk, other=0.0).to(tl.float32)
        b_u = tl.load(p_u + t * su_w, mask=mv, other=0.0).to(tl.float32)
        S = _decay_rank1(S, b_g, b_k, b_u)
    # a = 0 (not fresh): no store, so the slot keeps its bits whatever they are.
    tl.store(p_s, S.to(state_ptr.dtype.element_ty), mask=m_store)


@functools.lru_cache(maxsize=8)
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count


def choose_block_v(programs_per_block: int, V: int, device: torch.device) -> int:
    """Value-block width: 32 (fla's choice for its decode kernel) unless that leaves SMs idle.

    In the batch-invariant mode (`trtllm_glm.numerics.batch_invariant`) always 32 (``V`` rounded up to a power
    of two when smaller): the value block sets how the ``K``-reductions are spread over threads, so it must not
    depend on the number of sequences, and verify, decode and commit must use the same one.

    Args:
        programs_per_block: sequences times heads (programs per value block).
        V: value head dim.
        device: where the kernel runs.

    Returns:
        ``BV``, a power of two.
    """
    bv = min(32, triton.next_power_of_2(V))
    if batch_invariant():
        return bv
    # Small batches (N = 1 has only 64 heads): narrower blocks give every SM a few programs to overlap.
    while bv > 8 and programs_per_block * triton.cdiv(V, bv) < 4 * _num_sms(device):
        bv //= 2
    return bv


def _check_state(state: torch.Tensor, N: int, H: int, K: int, V: int, slots: torch.Tensor | None) -> None:
    if state.dim() != 4 or tuple(state.shape[1:]) != (H, K, V):
        raise ValueError(f"state must be [*, {H}, {K}, {V}], got {tuple(state.shape)}")
    if not state.is_floating_point():
        raise ValueError(f"state must be a float tensor, got {state.dtype}")
    if slots is None:
        if state.shape[0] != N:
            raise ValueError(f"state has {state.shape[0]} sequences for {N} (pass state_slots to index a pool)")
    elif slots.shape != (N,) or slots.dtype.is_floating_point or slots.device != state.device:
        raise ValueError(f"state_slots must be [{N}] integers on {state.device}, got {tuple(slots.shape)}")


def _widths_arg(widths: torch.Tensor | None, N: int, state: torch.Tensor) -> torch.Tensor:
    if widths is None:
        return state  # never read (HAS_WIDTHS is off); any pointer will do
    if widths.shape != (N,) or widths.dtype.is_floating_point or widths.device != state.device:
        raise ValueError(f"widths must be [{N}] integers on {state.device}, got {tuple(widths.shape)}")
    return widths.contiguous()  # (the kernel reads a unit stride)


def _fresh_arg(fresh: torch.Tensor | None, N: int, state: torch.Tensor) -> torch.Tensor:
    if fresh is None:
        return state  # never read (HAS_FRESH is off); any pointer will do
    if fresh.shape != (N,) or fresh.device != state.device:
        raise ValueError(f"fresh must be [{N}] on {state.device}, got {tuple(fresh.shape)} on {fresh.device}")
    # Bool pointers load as i1 on some Triton paths; bytes compare the same everywhere.
    return fresh.view(torch.uint8) if fresh.dtype == torch.bool else fresh


def kda_verify(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float,
    state: torch.Tensor,
    *,
    state_slots: torch.Tensor | None = None,
    fresh: torch.Tensor | None = None,
    widths: torch.Tensor | None = None,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
    block_v: int | None = None,
    num_warps: int = 4,
    num_stages: int = 2,
) -> tuple[torch.Tensor, KdaRecords]:
    """Kernel version of `ops.verify.kda_verify` (same outputs to FP32 rounding; state never written).

    Inputs may be any float dtype and any strides (the layer passes ``v`` as a strided view of the conv
    output). ``records.g`` and ``records.k`` are ``g`` and ``k`` themselves when those are FP32 (the
    reference clones them): do not modify them before the commit.

    Args:
        q: ``[N, W, H, K]`` (or ``[W, H, K]``) L2-normalised queries.
        k: ``[N, W, H, K]`` L2-normalised keys.
        v: ``[N, W, H, V]``.
        g: ``[N, W, H, K]`` log decay.
        beta: ``[N, W, H]``.
        scale: query scale.
        state: ``[N, H, K, V]`` (or ``[H, K, V]``) committed state, or with ``state_slots`` the pool
            ``[S, H, K, V]``; any float dtype, read as FP32; not modified.
        state_slots: optional ``[N]`` integer slot of each sequence in ``state``.
        fresh: optional ``[N]`` bool: start those sequences from zeros (their state is not read).
        widths: optional ``[N]`` integer rows of each sequence (``<= W``): only those are run; ``o`` and ``u``
            rows at or past a sequence's width are then not written (a caller that never reads them: every row of
            a short prefill is committed, the padding rows' outputs are dropped).
        out: optional ``(o, u)`` FP32 buffers of shape ``[N, W, H, V]`` to write instead of allocating (any
            strides with a unit last one; fixed addresses for graph capture); every element is written (without
            ``widths``).
        block_v: value channels per program (default: `choose_block_v`).
        num_warps: warps per program.
        num_stages: software-pipeline depth of the row loop (1: no prefetch).

    Returns:
        ``(o [N, W, H, V] FP32, records)`` (``o [W, H, V]`` for one unbatched sequence).
    """
    single = q.dim() == 3
    if single:
        if state_slots is not None or state.dim() != 3:
            raise ValueError("an unbatched verify takes a [H, K, V] state and no slots")
        q, k, v, g, beta, state = (t.unsqueeze(0) for t in (q, k, v, g, beta, state))
        if out is not None:
            out = (out[0].unsqueeze(0), out[1].unsqueeze(0))
    N, W, H, K = q.shape
    V = v.shape[-1]
    for name, t, shape in (("k", k, (N, W, H, K)), ("g", g, (N, W, H, K)), ("v", v, (N, W, H, V))):
        if tuple(t.shape) != shape:
            raise ValueError(f"{name} must be {list(shape)}, got {list(t.shape)}")
    if tuple(beta.shape) != (N, W, H):
        raise ValueError(f"beta must be [{N}, {W}, {H}], got {list(beta.shape)}")
    _check_state(state, N, H, K, V, state_slots)
    dev = q.device
    if out is None:
        o = torch.empty(N, W, H, V, dtype=torch.float32, device=dev)
        u = torch.empty(N, W, H, V, dtype=torch.float32, device=dev)
    else:
        o, u = out
        for name, t in (("o", o), ("u", u)):
            if tuple(t.shape) != (N, W, H, V) or t.dtype != torch.float32 or t.device != dev or t.stride(-1) != 1:
                raise ValueError(f"out {name} must be [{N}, {W}, {H}, {V}] fp32 on {dev} with unit last stride")
    # FP32 records alias the inputs (no copy); other dtypes are upcast once so the records stay FP32.
    records = KdaRecords(g=g.float(), k=k.float(), u=u)
    if N * W > 0:
        bv = block_v or choose_block_v(N * H, V, dev)
        _kda_verify_kernel[(N * H, triton.cdiv(V, bv))](
            q,
            k,
            v,
            g,
            beta,
            state,
            state if state_slots is None else state_slots,
            _fresh_arg(fresh, N, state),
            _widths_arg(widths, N, state),
            o,
            u,
            float(scale),
            W,
            *q.stride(),
            *k.stride(),
            *v.stride(),
            *g.stride(),
            *beta.stride(),
            *state.stride(),
            *o.stride()[:3],
            *u.stride()[:3],
            H=H,
            K=K,
            V=V,
            BK=triton.next_power_of_2(K),
            BV=bv,
            HAS_SLOTS=state_slots is not None,
            HAS_FRESH=fresh is not None,
            HAS_WIDTHS=widths is not None,
            STAGES=num_stages,
            STORE_U=True,
            STORE_STATE=False,
            num_warps=num_warps,
            **_fusion_opts(),
        )
    return (o[0] if single else o), records


def kda_commit(
    state: torch.Tensor,
    records: KdaRecords,
    num_accepted: Sequence[int] | torch.Tensor | int,
    *,
    state_slots: torch.Tensor | None = None,
    fresh: torch.Tensor | None = None,
    block_v: int | None = None,
    num_warps: int = 4,
    num_stages: int = 2,
) -> torch.Tensor:
    """Kernel version of `ops.verify.kda_commit`: fold the first ``a`` records into the state, in place.

    Sequences with ``a = 0`` (and not fresh) are not stored at all, so their state keeps its bits. A device
    tensor ``num_accepted`` is read by the kernel (no host sync, values clamped to ``[0, W]`` rather than
    checked); host values are range-checked like the reference.

    Args:
        state: ``[N, H, K, V]`` (or ``[H, K, V]``) state the verify pass started from, or with
            ``state_slots`` the pool ``[S, H, K, V]``; updated in place.
        records: from a verify pass on that state (either implementation).
        num_accepted: ``a`` per sequence in ``0..W`` (list, ``[N]`` integer tensor, or one int).
        state_slots: optional ``[N]`` integer slot of each sequence in ``state``.
        fresh: optional ``[N]`` bool: those sequences start from zeros (the slot is not read) and their slot is
            written even with ``a = 0``.
        block_v: value channels per program (default: `choose_block_v`).
        num_warps: warps per program.
        num_stages: software-pipeline depth of the row loop (1: no prefetch).

    Returns:
        ``state`` (the same tensor).
    """
    from trtllm_glm.kda.contract import accepted_tensor as _accepted_tensor

    S = state.unsqueeze(0) if state.dim() == 3 and state_slots is None else state
    N, W, H, K = records.g.shape
    V = records.u.shape[-1]
    _check_state(S, N, H, K, V, state_slots)
    if isinstance(num_accepted, torch.Tensor):
        a = num_accepted.reshape(-1)
        if a.device != S.device:
            a = a.to(S.device)
        if a.numel() != N and a.numel() != 1:
            raise ValueError(f"num_accepted has {a.numel()} entries for {N} sequences")
        stride_a = 0 if a.numel() == 1 else a.stride(0)
    else:
        a = _accepted_tensor(num_accepted, N, W, S.device)
        stride_a = a.stride(0)
    if N == 0:
        return state
    bv = block_v or choose_block_v(N * H, V, S.device)
    _kda_commit_kernel[(N * H, triton.cdiv(V, bv))](
        S,
        S if state_slots is None else state_slots,
        _fresh_arg(fresh, N, S),
        a,
        records.g,
        records.k,
        records.u,
        W,
        stride_a,
        *S.stride(),
        *records.g.stride(),
        *records.k.stride(),
        *records.u.stride(),
        H=H,
        K=K,
        V=V,
        BK=triton.next_power_of_2(K),
        BV=bv,
        HAS_SLOTS=state_slots is not None,
        HAS_FRESH=fresh is not None,
        STAGES=num_stages,
        num_warps=num_warps,
        **_fusion_opts(),
    )
    return state


def kda_decode_inplace(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float,
    state: torch.Tensor,
    slots: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
    block_v: int | None = None,
    num_warps: int = 4,
) -> torch.Tensor:
    """One decode row per sequence on the state pool, in place: the verify kernel run with one row that stores
    its running state back (`ops.backend.kda_decode_inplace` takes it in the batch-invariant mode).

    A decode row therefore runs the very step a verify row runs (`_kda_step`, same value block and warps), so
    its output has a verify row's bits, and a commit of ``a`` verified rows leaves the state ``a`` decode steps
    leave (`_decay_rank1`). Allocates only ``o`` (or writes ``out``); no host sync: graph-capturable.

    Args:
        q: ``[n, H, K]`` L2-normalised queries (any float dtype and strides).
        k: ``[n, H, K]`` L2-normalised keys.
        v: ``[n, H, V]``.
        g: ``[n, H, K]`` log decay.
        beta: ``[n, H]``.
        scale: query scale.
        state: ``[S, H, K, V]`` float state pool, updated in place at ``slots`` only.
        slots: ``[n]`` integer slot of each sequence, distinct for real rows (on ``state``'s device).
        out: optional ``[n, H, V]`` FP32 output buffer (unit last stride).
        block_v: value channels per program (default: `choose_block_v`).
        num_warps: warps per program.

    Returns:
        ``o [n, H, V]`` FP32.
    """
    if q.dim() != 3:
        raise ValueError(f"q must be [n, H, K], got {list(q.shape)}")
    n, H, K = q.shape
    V = v.shape[-1]
    for name, t, shape in (("k", k, (n, H, K)), ("g", g, (n, H, K)), ("v", v, (n, H, V)), ("beta", beta, (n, H))):
        if tuple(t.shape) != shape:
            raise ValueError(f"{name} must be {list(shape)}, got {list(t.shape)}")
    _check_state(state, n, H, K, V, slots)
    dev = q.device
    if out is None:
        o = torch.empty(n, H, V, dtype=torch.float32, device=dev)
    else:
        o = out
        if tuple(o.shape) != (n, H, V) or o.dtype != torch.float32 or o.device != dev or o.stride(-1) != 1:
            raise ValueError(f"out must be [{n}, {H}, {V}] fp32 on {dev} with unit last stride")
    if n == 0:
        return o
    # [n, 1, ...] views: the verify kernel's row stride is never used with one row.
    q1, k1, v1, g1, b1, o1 = (t.unsqueeze(1) for t in (q, k, v, g, beta, o))
    bv = block_v or choose_block_v(n * H, V, dev)
    _kda_verify_kernel[(n * H, triton.cdiv(V, bv))](
        q1,
        k1,
        v1,
        g1,
        b1,
        state,
        slots,
        state,  # fresh: never read (HAS_FRESH is off)
        state,  # widths: never read (HAS_WIDTHS is off)
        o1,
        o1,  # u: never stored (STORE_U is off)
        float(scale),
        1,
        *q1.stride(),
        *k1.stride(),
        *v1.stride(),
        *g1.stride(),
        *b1.stride(),
        *state.stride(),
        *o1.stride()[:3],
        *o1.stride()[:3],
        H=H,
        K=K,
        V=V,
        BK=triton.next_power_of_2(K),
        BV=bv,
        HAS_SLOTS=True,
        HAS_FRESH=False,
        HAS_WIDTHS=False,
        STAGES=1,
        STORE_U=False,
        STORE_STATE=True,
        num_warps=num_warps,
        **_fusion_opts(),
    )
    return o
