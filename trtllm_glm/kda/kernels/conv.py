"""Triton kernels of the KDA short convolution's front half: decode update, prefill, speculative verify and commit.

Drop-ins for `trtllm_glm.kda.ops.conv`. The conv state's channel order is ``q | k | v``, head-major within each,
``C = H * (2K + V)``; a window holds the last ``W - 1`` inputs, oldest first. FP32 arithmetic (agreement to FP32
rounding; the commit is bit-exact data movement), no host sync. Per-kernel design: docs/kernels.md, "KDA short
convolution".
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from trtllm_glm.kda.contract import L2NORM_EPS
from trtllm_glm.numerics import batch_invariant
from trtllm_glm.pdl import late_trigger, launch_kwargs, pdl_enter, pdl_leave, use_pdl

__all__ = ["conv_commit_slots", "conv_decode", "conv_prefill", "conv_verify_qkv"]


def _fusion_opts() -> dict[str, bool]:
    """Batch-invariant mode: no mul/add contraction, so the decode and verify kernels' shared arithmetic
    (taps, SiLU, norms) rounds as written in both, whatever the surrounding code (the interpreter ignores it)."""
    return {"enable_fp_fusion": False} if batch_invariant() else {}


@triton.jit
def _conv_channels(
    x_ptr,
    state_ptr,
    w_ptr,
    row,
    slot,
    ch,
    mask,
    stride_xn,
    stride_ss,
    stride_sc,
    stride_wc,
    W: tl.constexpr,
):
    """SiLU(conv) of channels ``ch`` of one row; shifts the slot's window in place. Returns FP32 ``[BLOCK]``."""
    xv = tl.load(x_ptr + row * stride_xn + ch, mask=mask, other=0.0).to(tl.float32)
    sbase = state_ptr + slot * stride_ss + ch * stride_sc
    acc = tl.zeros_like(xv)
    prev = tl.load(sbase, mask=mask, other=0.0).to(tl.float32)
    for w in tl.static_range(W - 1):
        acc += prev * tl.load(w_ptr + ch * stride_wc + w, mask=mask, other=0.0).to(tl.float32)
        if w + 1 < W - 1:
            nxt = tl.load(sbase + w + 1, mask=mask, other=0.0).to(tl.float32)
        else:
            nxt = xv
        # The window moves one to the left: entry w takes what entry w + 1 held (the newest input last).
        tl.store(sbase + w, nxt.to(state_ptr.dtype.element_ty), mask=mask)
        prev = nxt
    acc += xv * tl.load(w_ptr + ch * stride_wc + (W - 1), mask=mask, other=0.0).to(tl.float32)
    return acc / (1.0 + tl.exp(-acc))


@triton.jit
def _conv_decode_kernel(
    x_ptr,
    state_ptr,
    w_ptr,
    slots_ptr,
    q_ptr,
    k_ptr,
    v_ptr,
    stride_xn,
    stride_ss,
    stride_sc,
    stride_wc,
    eps,
    H: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    W: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    PDL: tl.constexpr,
    PDL_LATE: tl.constexpr,
):
    pdl_enter(PDL, PDL_LATE)  # `trtllm_glm.pdl`: launched early, it waits here for the kernel before it
    row = tl.program_id(0)
    h = tl.program_id(1)
    slot = tl.load(slots_ptr + row).to(tl.int64)
    row64 = row.to(tl.int64)
    kk = tl.arange(0, BK)
    km = kk < K
    vv = tl.arange(0, BV)
    vm = vv < V

    q = _conv_channels(x_ptr, state_ptr, w_ptr, row64, slot, h * K + kk, km, stride_xn, stride_ss, stride_sc,
                       stride_wc, W)  # fmt: skip
    q = tl.where(km, q, 0.0)
    q = q / tl.sqrt(tl.sum(q * q, axis=0) + eps)
    tl.store(q_ptr + (row64 * H + h) * K + kk, q, mask=km)

    k = _conv_channels(x_ptr, state_ptr, w_ptr, row64, slot, H * K + h * K + kk, km, stride_xn, stride_ss,
                       stride_sc, stride_wc, W)  # fmt: skip
    k = tl.where(km, k, 0.0)
    k = k / tl.sqrt(tl.sum(k * k, axis=0) + eps)
    tl.store(k_ptr + (row64 * H + h) * K + kk, k, mask=km)

    v = _conv_channels(x_ptr, state_ptr, w_ptr, row64, slot, 2 * H * K + h * V + vv, vm, stride_xn, stride_ss,
                       stride_sc, stride_wc, W)  # fmt: skip
    tl.store(v_ptr + (row64 * H + h) * V + vv, v, mask=vm)
    pdl_leave(PDL, PDL_LATE)


def conv_decode(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    slots: torch.Tensor,
    num_heads: int,
    head_k_dim: int,
    head_v_dim: int,
    eps: float,
    *,
    num_warps: int = 1,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Triton `conv_decode_reference` (same arguments and results; the state is updated in place).

    Args:
        x: ``[n, C]`` one new conv input row per sequence (any float dtype, unit last stride), ``C = H * (2K + V)``.
        conv_state: ``[S, C, W - 1]`` state pool (unit last stride), updated in place at ``slots`` only.
        weight: ``[C, W]`` taps (unit last stride).
        slots: ``[n]`` integer state slot of each row, distinct for real rows.
        num_heads, head_k_dim, head_v_dim: ``H``, ``K``, ``V``.
        eps: added to the squared norm of each query / key head.
        num_warps: warps per program (tuning only).

    Returns:
        ``(q [n, H, K], k [n, H, K], v [n, H, V])`` FP32, contiguous; ``q`` and ``k`` L2-normalised per head.
    """
    n, C = x.shape
    H, K, V = num_heads, head_k_dim, head_v_dim
    Wm1 = conv_state.shape[-1]
    if C != H * (2 * K + V) or conv_state.shape[1] != C or weight.shape != (C, Wm1 + 1):
        raise ValueError(
            f"conv_decode: x {tuple(x.shape)}, conv_state {tuple(conv_state.shape)}, weight {tuple(weight.shape)} "
            f"do not fit H={H}, K={K}, V={V}"
        )
    if Wm1 < 1 or slots.shape != (n,):
        raise ValueError(f"conv_decode: need W >= 2 and [n] slots, got state {tuple(conv_state.shape)}, "
                         f"slots {tuple(slots.shape)}")  # fmt: skip
    if n and (x.stride(1) != 1 or conv_state.stride(2) != 1 or weight.stride(1) != 1):
        raise ValueError("conv_decode: x, conv_state and weight need a unit last stride")
    dev = x.device
    q = torch.empty(n, H, K, dtype=torch.float32, device=dev)
    k = torch.empty(n, H, K, dtype=torch.float32, device=dev)
    v = torch.empty(n, H, V, dtype=torch.float32, device=dev)
    if n == 0:
        return q, k, v
    pdl = use_pdl(dev)
    _conv_decode_kernel[(n, H)](
        x, conv_state, weight, slots, q, k, v,
        x.stride(0), conv_state.stride(0), conv_state.stride(1), weight.stride(0), eps,
        H=H, K=K, V=V, W=Wm1 + 1, BK=triton.next_power_of_2(K), BV=triton.next_power_of_2(V), PDL=pdl,
        PDL_LATE=late_trigger(pdl),
        num_warps=num_warps, **_fusion_opts(), **launch_kwargs(pdl),
    )  # fmt: skip
    return q, k, v


# ------------------------------------------------------------------------------------------------------------------
# Speculative verify and commit


@triton.jit
def _verify_channels(
    x_ptr,
    state_ptr,
    w_ptr,
    row0,
    slot,
    j,
    use_state,
    ch,
    mask,
    stride_xn,
    stride_ss,
    stride_sc,
    stride_wc,
    W: tl.constexpr,
):
    """SiLU(conv) of channels ``ch`` at verify row ``j`` of a sequence; reads only. Returns FP32 ``[BLOCK]``.

    Position ``t = j + w`` of the history-then-rows sequence feeds tap ``w``: ``t < W - 1`` is a stored input
    (zero for a fresh sequence), otherwise the sequence's row ``t - (W - 1)``.
    """
    sbase = state_ptr + slot * stride_ss + ch * stride_sc
    acc = tl.zeros(ch.shape, dtype=tl.float32)
    for w in tl.static_range(W):
        t = j + w
        in_state = t < W - 1
        sv = tl.load(sbase + t, mask=mask & in_state & use_state, other=0.0).to(tl.float32)
        xv = tl.load(x_ptr + (row0 + t - (W - 1)) * stride_xn + ch, mask=mask & (t >= W - 1), other=0.0)
        val = tl.where(in_state, sv, xv.to(tl.float32))
        # Taps in order, oldest first, as the decode kernel sums them.
        acc += val * tl.load(w_ptr + ch * stride_wc + w, mask=mask, other=0.0).to(tl.float32)
    return acc / (1.0 + tl.exp(-acc))


@triton.jit
def _conv_verify_kernel(
    x_ptr,
    state_ptr,
    w_ptr,
    slots_ptr,
    row0_ptr,
    widths_ptr,
    fresh_ptr,
    q_ptr,
    k_ptr,
    v_ptr,
    Wm,
    stride_xn,
    stride_ss,
    stride_sc,
    stride_wc,
    eps,
    H: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    W: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    HAS_ROWS: tl.constexpr,
    HAS_FRESH: tl.constexpr,
    ZERO_PADDING: tl.constexpr,
):
    s = tl.program_id(0)
    h = tl.program_id(1)
    j = tl.program_id(2)
    s64 = s.to(tl.int64)
    slot = tl.load(slots_ptr + s).to(tl.int64)
    if HAS_ROWS:
        row0 = tl.load(row0_ptr + s).to(tl.int64)
        width = tl.minimum(tl.load(widths_ptr + s).to(tl.int32), Wm)
    else:
        row0 = s64 * Wm
        width = Wm
    if HAS_FRESH:
        # Masked, not multiplied: a fresh sequence's slot may hold NaN/inf from an earlier owner.
        use_state = tl.load(fresh_ptr + s) == 0
    else:
        use_state = True
    kk = tl.arange(0, BK)
    km = kk < K
    vv = tl.arange(0, BV)
    vm = vv < V
    q_ch = h * K + kk
    k_ch = H * K + h * K + kk
    v_ch = 2 * H * K + h * V + vv

    out = (s64 * Wm + j) * H + h
    if j < width:
        q = _verify_channels(x_ptr, state_ptr, w_ptr, row0, slot, j, use_state, q_ch, km, stride_xn, stride_ss,
                             stride_sc, stride_wc, W)  # fmt: skip
        q = tl.where(km, q, 0.0)
        q = q / tl.sqrt(tl.sum(q * q, axis=0) + eps)
        tl.store(q_ptr + out * K + kk, q, mask=km)
        k = _verify_channels(x_ptr, state_ptr, w_ptr, row0, slot, j, use_state, k_ch, km, stride_xn, stride_ss,
                             stride_sc, stride_wc, W)  # fmt: skip
        k = tl.where(km, k, 0.0)
        k = k / tl.sqrt(tl.sum(k * k, axis=0) + eps)
        tl.store(k_ptr + out * K + kk, k, mask=km)
        v = _verify_channels(x_ptr, state_ptr, w_ptr, row0, slot, j, use_state, v_ch, vm, stride_xn, stride_ss,
                             stride_sc, stride_wc, W)  # fmt: skip
        tl.store(v_ptr + out * V + vv, v, mask=vm)
    elif ZERO_PADDING:
        # Padding rows: zeros (the wrapper allocates the outputs uninitialised).
        tl.store(q_ptr + out * K + kk, tl.zeros([BK], dtype=tl.float32), mask=km)
        tl.store(k_ptr + out * K + kk, tl.zeros([BK], dtype=tl.float32), mask=km)
        tl.store(v_ptr + out * V + vv, tl.zeros([BV], dtype=tl.float32), mask=vm)


@triton.jit
def _conv_commit_kernel(
    x_ptr,
    state_ptr,
    slots_ptr,
    row0_ptr,
    acc_ptr,
    fresh_ptr,
    C,
    Wm,
    stride_xn,
    stride_ss,
    stride_sc,
    WM1: tl.constexpr,
    BC: tl.constexpr,
    BW: tl.constexpr,
    HAS_ROWS: tl.constexpr,
    HAS_FRESH: tl.constexpr,
):
    s = tl.program_id(0)
    cb = tl.program_id(1)
    slot = tl.load(slots_ptr + s).to(tl.int64)
    if HAS_ROWS:
        row0 = tl.load(row0_ptr + s).to(tl.int64)
    else:
        row0 = s.to(tl.int64) * Wm
    a = tl.load(acc_ptr + s).to(tl.int64)
    if HAS_FRESH:
        # A fresh sequence starts from zeros (its slot may hold garbage) and is stored even when a = 0.
        fresh = tl.load(fresh_ptr + s) != 0
        use_state = fresh == 0
        write = (a > 0) | fresh
    else:
        use_state = True
        write = a > 0
    ch = cb * BC + tl.arange(0, BC)
    i = tl.arange(0, BW)
    m = (ch < C)[:, None] & (i < WM1)[None, :]
    # New entry i is entry a + i of history-then-rows: a stored input while a + i < W - 1, else row a + i - (W - 1)
    # (< a, so only accepted rows are read).
    t = a + i
    in_state = (t < WM1)[None, :]
    sbase = state_ptr + slot * stride_ss + ch[:, None] * stride_sc
    sv = tl.load(sbase + t[None, :], mask=m & in_state & use_state, other=0.0)
    xv = tl.load(x_ptr + (row0 + t - WM1)[None, :] * stride_xn + ch[:, None], mask=m & (t >= WM1)[None, :], other=0.0)
    # Stored entries keep their bits; new inputs are rounded as `.float().to(state dtype)` rounds them.
    val = tl.where(in_state, sv, xv.to(tl.float32).to(state_ptr.dtype.element_ty))
    # Entry i is overwritten while another thread of this program may still have to read it (as entry a + i'):
    # every load of the tile completes before any store.
    tl.debug_barrier()
    # a = 0 (not fresh) stores nothing: the slot keeps its bits.
    tl.store(sbase + i[None, :], val, mask=m & write)


def _index_arg(t: torch.Tensor | None, n: int, name: str, fallback: torch.Tensor) -> torch.Tensor:
    """``t`` checked to be ``[n]`` on ``fallback``'s device (bool viewed as bytes), or ``fallback`` when absent
    (its pointer is then never read: the kernel's ``HAS_*`` flag is off)."""
    if t is None:
        return fallback
    if t.shape != (n,) or t.device != fallback.device or (n > 1 and t.stride(0) != 1):
        raise ValueError(f"{name} must be a contiguous [{n}] on {fallback.device}, got {tuple(t.shape)} "
                         f"(strides {t.stride()}) on {t.device}")  # fmt: skip
    return t.view(torch.uint8) if t.dtype == torch.bool else t


def _check_conv_args(what: str, x: torch.Tensor, conv_state: torch.Tensor, slots: torch.Tensor) -> None:
    if x.dim() != 2 or conv_state.dim() != 3 or conv_state.shape[1] != x.shape[1] or conv_state.shape[2] < 1:
        raise ValueError(f"{what}: x {tuple(x.shape)} and conv_state {tuple(conv_state.shape)} do not fit "
                         "([N, C] and [S, C, W - 1], W >= 2)")  # fmt: skip
    if slots.dim() != 1 or slots.device != conv_state.device or x.device != conv_state.device:
        raise ValueError(f"{what}: need [n] slots and x on conv_state's device {conv_state.device}")
    if slots.shape[0] > 1 and slots.stride(0) != 1:
        raise ValueError(f"{what}: slots need a unit stride")
    if x.stride(1) != 1 or conv_state.stride(2) != 1:
        raise ValueError(f"{what}: x and conv_state need a unit last stride")


def conv_verify_qkv(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    slots: torch.Tensor,
    num_heads: int,
    head_k_dim: int,
    head_v_dim: int,
    width_max: int,
    *,
    row0: torch.Tensor | None = None,
    widths: torch.Tensor | None = None,
    fresh: torch.Tensor | None = None,
    eps: float = L2NORM_EPS,
    zero_padding: bool = True,
    num_warps: int = 1,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Triton `conv_verify_qkv_reference` (same arguments and results; the state pool is only read). With
    ``zero_padding=False`` the rows past a sequence's width are left unwritten (uninitialised) instead of zeroed:
    for a caller that never reads them (a short prefill: its verify runs each sequence's own rows only).

    Args:
        x: ``[N, C]`` the step's conv inputs (any float dtype, unit last stride), ``C = H * (2K + V)``.
        conv_state: ``[S, C, W - 1]`` state pool (unit last stride), read at ``slots`` only.
        weight: ``[C, W]`` taps (unit last stride).
        slots: ``[n]`` integer state slot of each sequence.
        num_heads, head_k_dim, head_v_dim: ``H``, ``K``, ``V``.
        width_max: ``Wm``, the padded rows per sequence.
        row0: ``[n]`` integer first row of each sequence in ``x``; with ``widths``. Both ``None``: the uniform
            layout, sequence ``j`` owning rows ``j * Wm .. j * Wm + Wm - 1``.
        widths: ``[n]`` integer rows of each sequence (``1..Wm``); with ``row0``.
        fresh: optional ``[n]`` bool: those sequences start from zeros (their slot is not read).
        eps: added to the squared norm of each query / key head.
        num_warps: warps per program (tuning only).

    Returns:
        ``(q [n, Wm, H, K], k [n, Wm, H, K], v [n, Wm, H, V])`` FP32, contiguous; ``q`` and ``k`` L2-normalised
        per head; rows past a sequence's width are zeros.
    """
    _check_conv_args("conv_verify_qkv", x, conv_state, slots)
    n, (N, C), Wm1 = slots.shape[0], x.shape, conv_state.shape[2]
    H, K, V, Wm = num_heads, head_k_dim, head_v_dim, width_max
    if C != H * (2 * K + V) or weight.shape != (C, Wm1 + 1) or weight.stride(1) != 1:
        raise ValueError(f"conv_verify_qkv: x {tuple(x.shape)}, weight {tuple(weight.shape)} (unit last stride) "
                         f"do not fit H={H}, K={K}, V={V}, W={Wm1 + 1}")  # fmt: skip
    if (row0 is None) != (widths is None):
        raise ValueError("conv_verify_qkv: give both row0 and widths, or neither (the uniform layout)")
    if Wm < 0 or (row0 is None and n * Wm > N):
        raise ValueError(f"conv_verify_qkv: {N} rows cannot hold {n} sequences of {Wm} rows")
    dev = x.device
    q = torch.empty(n, Wm, H, K, dtype=torch.float32, device=dev)
    k = torch.empty(n, Wm, H, K, dtype=torch.float32, device=dev)
    v = torch.empty(n, Wm, H, V, dtype=torch.float32, device=dev)
    if n == 0 or Wm == 0:
        return q, k, v
    _conv_verify_kernel[(n, H, Wm)](
        x, conv_state, weight, slots, _index_arg(row0, n, "row0", slots), _index_arg(widths, n, "widths", slots),
        _index_arg(fresh, n, "fresh", slots), q, k, v,
        Wm, x.stride(0), conv_state.stride(0), conv_state.stride(1), weight.stride(0), eps,
        H=H, K=K, V=V, W=Wm1 + 1, BK=triton.next_power_of_2(K), BV=triton.next_power_of_2(V),
        HAS_ROWS=row0 is not None, HAS_FRESH=fresh is not None, ZERO_PADDING=zero_padding, num_warps=num_warps,
        **_fusion_opts(),
    )  # fmt: skip
    return q, k, v


def conv_commit_slots(
    conv_state: torch.Tensor,
    x: torch.Tensor,
    slots: torch.Tensor,
    accepted: torch.Tensor,
    width_max: int,
    *,
    row0: torch.Tensor | None = None,
    fresh: torch.Tensor | None = None,
    block_c: int = 256,
    num_warps: int = 4,
) -> torch.Tensor:
    """Triton `conv_commit_slots_reference`: re-base each sequence's window on its accepted rows, in place.

    Args:
        conv_state: ``[S, C, W - 1]`` state pool (unit last stride), updated in place at ``slots`` only; a
            sequence with ``a = 0`` that is not fresh is not written at all.
        x: ``[N, C]`` the verify step's conv inputs (any float dtype, unit last stride).
        slots: ``[n]`` integer state slot of each sequence, distinct for real sequences.
        accepted: ``[n]`` integer device tensor, ``a`` in ``0..width`` per sequence (not checked: no sync).
        width_max: ``Wm`` of the verify step (the uniform layout's row stride; unused with ``row0``).
        row0: optional ``[n]`` integer first row of each sequence in ``x`` (``None``: row ``j * Wm``).
        fresh: optional ``[n]`` bool: the window starts from zeros (the slot is not read) and is stored even
            when ``a = 0``.
        block_c: channels per program (tuning only).
        num_warps: warps per program (tuning only).

    Returns:
        ``conv_state``.
    """
    _check_conv_args("conv_commit_slots", x, conv_state, slots)
    n, C, Wm1 = slots.shape[0], x.shape[1], conv_state.shape[2]
    if n == 0:
        return conv_state
    accepted = _index_arg(accepted, n, "accepted", slots)
    _conv_commit_kernel[(n, triton.cdiv(C, block_c))](
        x, conv_state, slots, _index_arg(row0, n, "row0", slots), accepted, _index_arg(fresh, n, "fresh", slots),
        C, width_max, x.stride(0), conv_state.stride(0), conv_state.stride(1),
        WM1=Wm1, BC=block_c, BW=triton.next_power_of_2(Wm1), HAS_ROWS=row0 is not None,
        HAS_FRESH=fresh is not None, num_warps=num_warps,
    )  # fmt: skip
    return conv_state


# ------------------------------------------------------------------------------------------------------------------
# Prefill (chunked path)

# Depth of the prefill kernel's binary search over cu_seqlens: one compiled variant for every batch up to 256
# sequences (a deeper search than needed only repeats guarded loads). The exact depth made a variant per power of
# two, and a served step whose prompt count the warm-up had not used compiled one while serving (H100, 1K-token
# prompts at concurrency 16: a 1.5 s TTFT tail).
_SEARCH_DEPTH = 8


def _search_depth(n: int) -> int:
    return max(_SEARCH_DEPTH, (n - 1).bit_length())


# T and n vary with every step: Triton's specialisation of integer arguments (== 1, % 16 == 0) would make more
# variants for the warm-up to cover.
@triton.jit(do_not_specialize=["T", "n"])
def _conv_prefill_kernel(
    x_ptr,
    state_ptr,
    w_ptr,
    slots_ptr,
    cu_ptr,
    row0_ptr,
    fresh_ptr,
    q_ptr,
    k_ptr,
    v_ptr,
    T,
    n,
    stride_xn,
    stride_ss,
    stride_sc,
    stride_wc,
    eps,
    H: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    W: tl.constexpr,
    BT: tl.constexpr,
    BD: tl.constexpr,
    LOG_N: tl.constexpr,
    HAS_ROWS: tl.constexpr,
    HAS_FRESH: tl.constexpr,
):
    pid_t = tl.program_id(0)
    p = tl.program_id(1)  # 0..3H-1: q heads, k heads, v heads
    h = p % H
    r = pid_t * BT + tl.arange(0, BT)  # packed output rows
    rm = r < T
    # Sequence of each row: the largest s < n with cu[s] <= r (branch-free binary search over cu_seqlens; an
    # empty sequence, cu[s] == cu[s + 1], is skipped since the later of equal offsets wins).
    s = tl.zeros([BT], dtype=tl.int32)
    for b in tl.static_range(LOG_N - 1, -1, -1):
        cand = s + (1 << b)
        ok = cand < n
        c_off = tl.load(cu_ptr + cand, mask=ok & rm, other=0)
        s = tl.where(ok & (c_off <= r), cand, s)
    start = tl.load(cu_ptr + s, mask=rm, other=0)
    j = r - start  # position of the row in its sequence
    if HAS_ROWS:
        xrow = tl.load(row0_ptr + s, mask=rm, other=0).to(tl.int64) + j
    else:
        xrow = r.to(tl.int64)
    slot = tl.load(slots_ptr + s, mask=rm, other=0).to(tl.int64)
    if HAS_FRESH:
        # Masked, not multiplied: a fresh sequence's slot may hold NaN/inf from an earlier owner.
        use_state = rm & (tl.load(fresh_ptr + s, mask=rm, other=1) == 0)
    else:
        use_state = rm
    is_qk = p < 2 * H
    ch0 = tl.where(is_qk, p * K, 2 * H * K + h * V)
    D = tl.where(is_qk, K, V)
    d = tl.arange(0, BD)
    dm = d < D
    ch = ch0 + d
    # Only blocks holding one of a sequence's first W - 1 rows read windows (the others skip those loads).
    reads_state = tl.min(tl.where(rm, j, W - 1), axis=0) < W - 1
    acc = tl.zeros([BT, BD], dtype=tl.float32)
    for w in tl.static_range(W):
        # Tap w of row j reads position j + w - (W - 1) of the sequence: its own row when >= 0, else stored entry
        # j + w of the slot's window (zeros for a fresh sequence). Taps in order, oldest first, as the decode and
        # verify kernels sum them.
        in_x = (j + w - (W - 1)) >= 0
        xv = tl.load(x_ptr + (xrow + (w - (W - 1)))[:, None] * stride_xn + ch[None, :],
                     mask=(rm & in_x)[:, None] & dm[None, :], other=0.0).to(tl.float32)  # fmt: skip
        if reads_state:
            in_state = (j + w - (W - 1)) < 0
            sv = tl.load(state_ptr + slot[:, None] * stride_ss + ch[None, :] * stride_sc + (j + w)[:, None],
                         mask=(use_state & in_state)[:, None] & dm[None, :], other=0.0).to(tl.float32)  # fmt: skip
            val = tl.where(in_x[:, None], xv, sv)
        else:
            val = xv
        acc += val * tl.load(w_ptr + ch * stride_wc + w, mask=dm, other=0.0).to(tl.float32)[None, :]
    y = acc / (1.0 + tl.exp(-acc))
    y = tl.where(dm[None, :], y, 0.0)
    if is_qk:
        y = y / tl.sqrt(tl.sum(y * y, axis=1) + eps)[:, None]
    om = rm[:, None] & dm[None, :]
    r64 = r.to(tl.int64)
    if p < H:
        tl.store(q_ptr + ((r64 * H + h) * K)[:, None] + d[None, :], y, mask=om)
    elif p < 2 * H:
        tl.store(k_ptr + ((r64 * H + h) * K)[:, None] + d[None, :], y, mask=om)
    else:
        tl.store(v_ptr + ((r64 * H + h) * V)[:, None] + d[None, :], y, mask=om)


def conv_prefill(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    slots: torch.Tensor,
    cu_seqlens: torch.Tensor,
    num_heads: int,
    head_k_dim: int,
    head_v_dim: int,
    *,
    row0: torch.Tensor | None = None,
    num_rows: int | None = None,
    fresh: torch.Tensor | None = None,
    eps: float = L2NORM_EPS,
    block_t: int = 32,
    num_warps: int = 4,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Triton `conv_prefill_reference`: two launches (the rows, then the windows) and one tiny subtraction.

    Args:
        x: ``[N, C]`` conv inputs (any float dtype, unit last stride), ``C = H * (2K + V)``.
        conv_state: ``[S, C, W - 1]`` state pool (unit last stride); each sequence's slot gets its new window
            (the last ``W - 1`` inputs of window-then-rows), no other slot is written.
        weight: ``[C, W]`` taps (unit last stride).
        slots: ``[n]`` integer state slot of each sequence, distinct.
        cu_seqlens: ``[n + 1]`` integer offsets of the sequences in the packed output (``cu[0] = 0``, ascending).
        num_heads, head_k_dim, head_v_dim: ``H``, ``K``, ``V``.
        row0: optional ``[n]`` integer first row of each sequence in ``x`` (then give ``num_rows``); ``None``:
            ``x`` holds the packed rows themselves (sequence ``i`` at rows ``cu[i] .. cu[i + 1] - 1``).
        num_rows: ``T = cu[-1]`` on the host (default ``N`` when ``row0`` is ``None``).
        fresh: optional ``[n]`` bool: those sequences start from zeros (their slot is not read).
        eps: added to the squared norm of each query / key head.
        block_t: rows per program; num_warps: warps per program (tuning only).

    Returns:
        ``(q [T, H, K], k [T, H, K], v [T, H, V])`` FP32, contiguous; ``q`` and ``k`` L2-normalised per head.
    """
    _check_conv_args("conv_prefill", x, conv_state, slots)
    n, (N, C), Wm1 = slots.shape[0], x.shape, conv_state.shape[2]
    H, K, V = num_heads, head_k_dim, head_v_dim
    if C != H * (2 * K + V) or weight.shape != (C, Wm1 + 1) or weight.stride(1) != 1:
        raise ValueError(f"conv_prefill: x {tuple(x.shape)}, weight {tuple(weight.shape)} (unit last stride) "
                         f"do not fit H={H}, K={K}, V={V}, W={Wm1 + 1}")  # fmt: skip
    if row0 is not None and num_rows is None:
        raise ValueError("conv_prefill: give num_rows (the packed row count) with row0")
    T = N if num_rows is None else int(num_rows)
    if T < 0 or (row0 is None and T > N):
        raise ValueError(f"conv_prefill: {T} packed rows do not fit x with {N} rows")
    cu = _index_arg(cu_seqlens, n + 1, "cu_seqlens", slots)
    dev = x.device
    q = torch.empty(T, H, K, dtype=torch.float32, device=dev)
    k = torch.empty(T, H, K, dtype=torch.float32, device=dev)
    v = torch.empty(T, H, V, dtype=torch.float32, device=dev)
    if n == 0:
        return q, k, v
    if T > 0:
        _conv_prefill_kernel[(triton.cdiv(T, block_t), 3 * H)](
            x, conv_state, weight, slots, cu, _index_arg(row0, n, "row0", slots), _index_arg(fresh, n, "fresh", slots),
            q, k, v, T, n, x.stride(0), conv_state.stride(0), conv_state.stride(1), weight.stride(0), eps,
            H=H, K=K, V=V, W=Wm1 + 1, BT=block_t, BD=triton.next_power_of_2(max(K, V)),
            LOG_N=_search_depth(n), HAS_ROWS=row0 is not None, HAS_FRESH=fresh is not None,
            num_warps=num_warps, **_fusion_opts(),
        )  # fmt: skip
    # The new windows after every row was read (stream order): the commit of all `len` rows of each sequence
    # is exactly a prefill's window update (data movement, bit-exact).
    lengths = cu[1:] - cu[:-1]
    conv_commit_slots(conv_state, x, slots, lengths, 0, row0=cu[:-1] if row0 is None else row0, fresh=fresh)
    return q, k, v
