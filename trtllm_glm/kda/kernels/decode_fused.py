"""Triton kernel of a KDA layer's whole decode step between the input projection and ``o_proj``, in one launch.

``_decode_fused_kernel``, grid ``(n, H)``: program ``(i, h)`` takes row ``i`` of the fused input projection's
output (conv inputs ``q | k | v``, the gate's low-rank input ``f_a``, the beta logit ``b``, the output gate's
low-rank input ``g_a``) and, for head ``h`` of sequence ``i`` (state slot ``slots[i]``):

1. the short-conv step of the head's ``q``, ``k`` and ``v`` channels with SiLU, the slot's window shifted in place
   (`conv._conv_channels`, the decode conv kernel's own helper: the same arithmetic), and the q/k L2 norms;
2. the decay gate: ``f_a @ f_b[h*K : (h+1)*K]^T`` (the head's rows of the low-rank ``f_b_proj``; FP32 products
   and sum), then ``lower_bound * sigmoid(exp(A_log[h]) * (. + dt_bias))``, and ``beta = sigmoid(b)``;
3. the delta-rule step on the slot's ``[K, V]`` state tile, in place (`verify._kda_step`, the verify kernel's
   step), ``BV`` value channels at a time (the columns of the update are independent): the FP32 output ``o`` goes
   to an FP32 buffer (returned for tests) while the sum of its squares accumulates; in the same pass the output
   gate of those channels, ``w * sigmoid(g_a @ g_b[h*V : (h+1)*V]^T)``, to a second FP32 buffer (its low-rank
   loads do not wait for the state's);
4. the gated RMSNorm ``(o * rsqrt(mean(o^2) + eps)) * (w * sigmoid(gate))`` of the head (it needs every value
   channel's ``o``, hence the second pass over the value blocks, reading back what this program wrote after a
   barrier), stored in the ``o_proj`` input's dtype.

Why one program per (sequence, head) and not per value block too: the head's conv window and its RMSNorm span the
whole head (splitting ``V`` would have several programs shift one window, a race, and would need a second launch
for the norm). The low-rank weights (``K x R`` and ``V x R`` per head) are read by each program, ``BR`` columns a
step; ``n`` programs of one head read the same rows (L2 hits). The loops over value blocks and low-rank columns
take their trip counts (``NV``, ``R``) as run-time arguments, so the compiler keeps them loops: unrolled (constexpr
counts; 3-4x the PTX), or with whole ``[K, R]`` / ``[K, V]`` tiles, the kernel spilled registers at the real
geometry on sm_90 (``ptxas -v``); with ``BV = BR = 32`` it does not (4 or 8 warps, float or FP8 weights).

Numerics: FP32 between the projections. Against the unfused path (`trtllm_glm.kda.layer`) the difference is
rounding only: the two low-rank products are FP32 sums here, where the unfused path rounds ``f_b_proj(f_a)`` and
``g_b_proj(g_a)`` to the activation dtype (one bf16 rounding of the gate logits in a bf16 model), and the norm's
sum of squares is taken in ``BV`` blocks (its product grouped as above). Block-FP8 ``f_b`` / ``g_b`` weights
(``float8_e4m3fn`` with ``[ceil(O/B), ceil(I/B)]`` FP32 scales) are dequantised as they are loaded. A row's bits
do not depend on the other rows (one launch shape per row), but the batch-invariant mode (docs/numerics.md) also
promises that a decode step equals a width-one verify + commit bit for bit, and the verify path computes the gates
through the low-rank GEMMs: the layer keeps this kernel off in that mode. Shapes only, no host sync, allocates
only its outputs and one FP32 scratch of their size (or writes ``out=``): graph-capturable. Under the interpreter
(CPU tests) inputs are upcast right after loading (its bf16 arithmetic is not IEEE).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from trtllm_glm.kda.contract import L2NORM_EPS
from trtllm_glm.pdl import late_trigger, launch_kwargs, pdl_enter, pdl_leave, use_pdl

from .conv import _conv_channels
from .verify import _kda_step

__all__ = ["kda_decode_fused"]


@triton.jit
def _low_rank(
    a_ptr,
    w_ptr,
    ws_ptr,
    rows,
    rmask,
    stride_w,
    stride_s0,
    stride_s1,
    R,
    BR: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    QBLOCK: tl.constexpr,
):
    """``w[rows] @ a`` in FP32: ``a [R]`` at ``a_ptr``, ``w [O, R]`` rows ``rows [B]``; returns ``[B]``. ``BR``
    columns at a time in a loop that is not unrolled (a whole ``[B, R]`` tile would take every register). With
    ``HAS_SCALE`` the weight is block FP8, each element times its ``QBLOCK x QBLOCK`` tile's scale."""
    acc = tl.zeros(rows.shape, dtype=tl.float32)
    for r0 in tl.range(0, R, BR):
        rr = r0 + tl.arange(0, BR)
        rm = rr < R
        a = tl.load(a_ptr + rr, mask=rm, other=0.0).to(tl.float32)
        m = rmask[:, None] & rm[None, :]
        w = tl.load(w_ptr + rows[:, None] * stride_w + rr[None, :], mask=m, other=0.0).to(tl.float32)
        if HAS_SCALE:
            s = tl.load(ws_ptr + (rows // QBLOCK)[:, None] * stride_s0 + (rr // QBLOCK)[None, :] * stride_s1,
                        mask=m, other=0.0)  # fmt: skip
            w = w * s
        acc += tl.sum(w * a[None, :], axis=1)
    return acc


@triton.jit
def _decode_fused_kernel(
    x_ptr,
    fa_ptr,
    b_ptr,
    ga_ptr,
    conv_ptr,
    cw_ptr,
    slots_ptr,
    fb_ptr,
    fbs_ptr,
    a_log_ptr,
    dt_bias_ptr,
    state_ptr,
    gb_ptr,
    gbs_ptr,
    nw_ptr,
    o_ptr,
    z_ptr,
    y_ptr,
    stride_xn,
    stride_fan,
    stride_bn,
    stride_gan,
    stride_cs,
    stride_cc,
    stride_cw,
    stride_fb,
    stride_fbs0,
    stride_fbs1,
    stride_gb,
    stride_gbs0,
    stride_gbs1,
    ss_n,
    ss_h,
    ss_k,
    ss_v,
    stride_yn,
    scale,
    lower_bound,
    l2_eps,
    norm_eps,
    R,
    NV,
    H: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    W: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    BR: tl.constexpr,
    FB_SCALE: tl.constexpr,
    GB_SCALE: tl.constexpr,
    QBLOCK_F: tl.constexpr,
    QBLOCK_G: tl.constexpr,
    PDL: tl.constexpr,
    PDL_LATE: tl.constexpr,
):
    pdl_enter(PDL, PDL_LATE)  # `trtllm_glm.pdl`: launched early, it waits here for the input projection
    row = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    slot = tl.load(slots_ptr + row).to(tl.int64)
    kk = tl.arange(0, BK)
    km = kk < K

    # 1. conv step (the window of these channels shifted in place), SiLU, L2 norms: as `conv._conv_decode_kernel`.
    q = _conv_channels(x_ptr, conv_ptr, cw_ptr, row, slot, h * K + kk, km, stride_xn, stride_cs, stride_cc,
                       stride_cw, W)  # fmt: skip
    q = tl.where(km, q, 0.0)
    q = q / tl.sqrt(tl.sum(q * q, axis=0) + l2_eps)
    k = _conv_channels(x_ptr, conv_ptr, cw_ptr, row, slot, H * K + h * K + kk, km, stride_xn, stride_cs, stride_cc,
                       stride_cw, W)  # fmt: skip
    k = tl.where(km, k, 0.0)
    k = k / tl.sqrt(tl.sum(k * k, axis=0) + l2_eps)

    # 2. gates: the head's rows of f_b_proj, then `gate._gate_beta_kernel`'s formula.
    g_raw = _low_rank(fa_ptr + row * stride_fan, fb_ptr, fbs_ptr, h * K + kk, km, stride_fb, stride_fbs0,
                      stride_fbs1, R, BR, FB_SCALE, QBLOCK_F)  # fmt: skip
    g_raw += tl.load(dt_bias_ptr + h * K + kk, mask=km, other=0.0).to(tl.float32)
    rate = tl.exp(tl.load(a_log_ptr + h).to(tl.float32))
    g = lower_bound / (1.0 + tl.exp(-(rate * g_raw)))
    g = tl.where(km, g, 0.0)
    beta = 1.0 / (1.0 + tl.exp(-tl.load(b_ptr + row * stride_bn + h).to(tl.float32)))

    # 3. the recurrent step, BV value channels at a time (their conv channels shifted here too), and the output
    # gate's factor of the same channels (its low-rank loads are independent of the state's: they overlap).
    p_o = o_ptr + (row * H + h) * V
    p_z = z_ptr + (row * H + h) * V
    sumsq = tl.zeros([], dtype=tl.float32)
    for i in tl.range(0, NV):
        vv = i * BV + tl.arange(0, BV)
        vm = vv < V
        v = _conv_channels(x_ptr, conv_ptr, cw_ptr, row, slot, 2 * H * K + h * V + vv, vm, stride_xn, stride_cs,
                           stride_cc, stride_cw, W)  # fmt: skip
        m_s = km[:, None] & vm[None, :]
        p_s = state_ptr + slot * ss_n + h * ss_h + kk[:, None] * ss_k + vv[None, :] * ss_v
        S = tl.load(p_s, mask=m_s, other=0.0).to(tl.float32)
        S, o, _u = _kda_step(S, q, k, v, g, beta, scale)
        tl.store(p_s, S.to(state_ptr.dtype.element_ty), mask=m_s)
        o = tl.where(vm, o, 0.0)
        sumsq += tl.sum(o * o, axis=0)
        tl.store(p_o + vv, o, mask=vm)
        gate = _low_rank(ga_ptr + row * stride_gan, gb_ptr, gbs_ptr, h * V + vv, vm, stride_gb, stride_gbs0,
                         stride_gbs1, R, BR, GB_SCALE, QBLOCK_G)  # fmt: skip
        z = tl.load(nw_ptr + vv, mask=vm, other=0.0).to(tl.float32) * (1.0 / (1.0 + tl.exp(-gate)))
        tl.store(p_z + vv, z, mask=vm)
    # The second pass reads values other threads of this program stored: make them visible.
    tl.debug_barrier()

    # 4. the gated RMSNorm, ``(o * rstd) * (w * sigmoid(gate))``, in the o_proj input's dtype.
    rstd = 1.0 / tl.sqrt(sumsq / V + norm_eps)
    for i in tl.range(0, NV):
        vv = i * BV + tl.arange(0, BV)
        vm = vv < V
        o = tl.load(p_o + vv, mask=vm, other=0.0)
        z = tl.load(p_z + vv, mask=vm, other=0.0)
        tl.store(y_ptr + row * stride_yn + h * V + vv, ((o * rstd) * z).to(y_ptr.dtype.element_ty), mask=vm)
    pdl_leave(PDL, PDL_LATE)  # (`TRTLLM_GLM_PDL_TRIGGER=end`: the next kernel may launch now)


def _scale_args(w: torch.Tensor, scale: torch.Tensor | None, block: int, R: int, what: str) -> tuple:
    """``(scale pointer, stride0, stride1, HAS_SCALE, QBLOCK)`` of a low-rank weight (checked)."""
    if scale is None:
        if w.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"kda_decode_fused: {what} of dtype {w.dtype} needs its scale_inv")
        return w, 0, 0, False, 1
    want = (triton.cdiv(w.shape[0], block), triton.cdiv(R, block))
    if tuple(scale.shape) != want or scale.dtype != torch.float32 or scale.device != w.device:
        raise ValueError(f"kda_decode_fused: {what} scale must be {list(want)} fp32, got {tuple(scale.shape)}")
    return scale, scale.stride(0), scale.stride(1), True, int(block)


def kda_decode_fused(
    x: torch.Tensor,
    fa: torch.Tensor,
    b: torch.Tensor,
    ga: torch.Tensor,
    conv_state: torch.Tensor,
    conv_weight: torch.Tensor,
    slots: torch.Tensor,
    f_b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    lower_bound: float,
    state: torch.Tensor,
    g_b: torch.Tensor,
    norm_weight: torch.Tensor,
    norm_eps: float,
    scale: float,
    out_dtype: torch.dtype,
    *,
    f_b_scale: torch.Tensor | None = None,
    g_b_scale: torch.Tensor | None = None,
    quant_block: int = 128,
    l2_eps: float = L2NORM_EPS,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
    block_v: int = 32,
    block_r: int = 32,
    num_warps: int = 4,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A KDA decode step from the input projection's row to ``o_proj``'s input, in one launch (module docstring).

    Args:
        x: ``[n, C]`` conv inputs ``q | k | v`` (any float dtype, unit last stride), ``C = H * (2K + V)``.
        fa: ``[n, R]`` the decay gate's low-rank input (unit last stride).
        b: ``[n, H]`` beta logits (unit last stride).
        ga: ``[n, R]`` the output gate's low-rank input (unit last stride).
        conv_state: ``[S, C, W - 1]`` conv window pool (unit last stride), updated in place at ``slots`` only.
        conv_weight: ``[C, W]`` taps (unit last stride).
        slots: ``[n]`` integer state slot of each row (distinct), on the device.
        f_b: ``[H * K, R]`` ``f_b_proj.weight`` (float, or block FP8 with ``f_b_scale``).
        A_log: ``[H]`` per-head log rate.
        dt_bias: ``[H * K]`` per-channel bias.
        lower_bound: negative bound of the log decay.
        state: ``[S, H, K, V]`` recurrent state pool (any strides), updated in place at ``slots`` only.
        g_b: ``[H * V, R]`` ``g_b_proj.weight`` (float, or block FP8 with ``g_b_scale``).
        norm_weight: ``[V]`` the gated RMSNorm's weight.
        norm_eps: the gated RMSNorm's epsilon.
        scale: query scale (``K ** -0.5``).
        out_dtype: dtype of the returned ``o_proj`` input.
        f_b_scale, g_b_scale: optional ``[ceil(O / B), ceil(R / B)]`` FP32 scales of block-FP8 weights.
        quant_block: ``B``, their tile edge.
        l2_eps: added to each q / k head's squared norm.
        out: optional ``(y, o)`` buffers shaped like the results (``y`` may have a row stride, unit last
            stride; ``o`` contiguous) to write instead of allocating; every element is written.
        block_v: value channels per inner step (tuning only; a power of two).
        block_r: low-rank columns per inner step of the gate products (tuning only; a power of two).
        num_warps: warps per program (tuning only).

    Returns:
        ``(y [n, H * V] out_dtype, o [n, H, V] FP32)``: the ``o_proj`` input and the recurrent output before the
        norm.
    """
    n, C = x.shape
    H = b.shape[1]
    R = fa.shape[1]
    S_, Hs, K, V = state.shape
    Wm1 = conv_state.shape[-1]
    if Hs != H or C != H * (2 * K + V) or conv_state.shape[1] != C or conv_weight.shape != (C, Wm1 + 1):
        raise ValueError(
            f"kda_decode_fused: x {tuple(x.shape)}, b {tuple(b.shape)}, state {tuple(state.shape)}, conv_state "
            f"{tuple(conv_state.shape)}, conv_weight {tuple(conv_weight.shape)} do not fit one geometry"
        )
    shapes = {"fa": (fa, (n, R)), "b": (b, (n, H)), "ga": (ga, (n, R)), "slots": (slots, (n,)),
              "f_b": (f_b, (H * K, R)), "g_b": (g_b, (H * V, R)), "A_log": (A_log, (H,)),
              "dt_bias": (dt_bias, (H * K,)), "norm_weight": (norm_weight, (V,))}  # fmt: skip
    for name, (t, want) in shapes.items():
        if tuple(t.shape) != want:
            raise ValueError(f"kda_decode_fused: {name} must be {list(want)}, got {list(t.shape)}")
    unit = (x, fa, b, ga, conv_state, conv_weight, f_b, g_b, A_log, dt_bias, norm_weight)
    if Wm1 < 1 or any(t.stride(-1) != 1 for t in unit):
        raise ValueError("kda_decode_fused: need W >= 2 and a unit last stride on every input but the state pool")
    fbs = _scale_args(f_b, f_b_scale, quant_block, R, "f_b")
    gbs = _scale_args(g_b, g_b_scale, quant_block, R, "g_b")
    dev = x.device
    if out is None:
        y = torch.empty(n, H * V, dtype=out_dtype, device=dev)
        o = torch.empty(n, H, V, dtype=torch.float32, device=dev)
    else:
        y, o = out
        if y.shape != (n, H * V) or y.dtype != out_dtype or y.stride(1) != 1 or y.device != dev:
            raise ValueError(f"kda_decode_fused: out y must be [{n}, {H * V}] {out_dtype} with unit last stride")
        if o.shape != (n, H, V) or o.dtype != torch.float32 or not o.is_contiguous() or o.device != dev:
            raise ValueError(f"kda_decode_fused: out o must be [{n}, {H}, {V}] contiguous fp32")
    if n == 0:
        return y, o
    z = torch.empty(n, H, V, dtype=torch.float32, device=dev)  # the output gate's factor (between the passes)
    bv = min(block_v, triton.next_power_of_2(V))
    pdl = use_pdl(dev)
    _decode_fused_kernel[(n, H)](
        x, fa, b, ga, conv_state, conv_weight, slots, f_b, fbs[0], A_log, dt_bias, state, g_b, gbs[0],
        norm_weight, o, z, y,
        x.stride(0), fa.stride(0), b.stride(0), ga.stride(0), conv_state.stride(0), conv_state.stride(1),
        conv_weight.stride(0), f_b.stride(0), fbs[1], fbs[2], g_b.stride(0), gbs[1], gbs[2], *state.stride(),
        y.stride(0), float(scale), float(lower_bound), float(l2_eps), float(norm_eps),
        R, triton.cdiv(V, bv),
        H=H, K=K, V=V, W=Wm1 + 1, BK=triton.next_power_of_2(K), BV=bv,
        BR=min(block_r, triton.next_power_of_2(R)), FB_SCALE=fbs[3], GB_SCALE=gbs[3], QBLOCK_F=fbs[4],
        QBLOCK_G=gbs[4], PDL=pdl, PDL_LATE=late_trigger(pdl), num_warps=num_warps, **launch_kwargs(pdl),
    )  # fmt: skip
    return y, o
