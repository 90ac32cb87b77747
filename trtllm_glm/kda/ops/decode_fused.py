"""A KDA layer's decode step from the fused input projection's row to ``o_proj``'s input: the torch reference, the
one-launch dispatch (`trtllm_glm.kda.kernels.kda_decode_fused`) and the switch that lets the layer take it.

The step (per decode row, one sequence each): short-conv update of the slot's window with SiLU, q/k L2 norms, the
decay gate through the low-rank ``f_b_proj`` and beta, the delta-rule update of the slot's recurrent state in place,
then the output gate through ``g_b_proj`` and the gated RMSNorm. FP32 between the projections. docs/kernels.md,
"Fused KDA decode step".
"""

from __future__ import annotations

import torch

from ... import envs
from ...numerics import batch_invariant
from ...quant.fp8 import dequantize_block_fp8
from ..contract import L2NORM_EPS
from .conv import _use_kernel, conv_decode_reference
from .gate import kda_gate_beta_reference
from .recurrent import recurrent_kda_step

__all__ = ["fused_decode_enabled", "kda_decode_fused", "kda_decode_fused_reference"]


def fused_decode_enabled(x: torch.Tensor) -> bool:
    """Whether a KDA layer runs its decode step as `kda_decode_fused` for inputs like ``x``.

    ``TRTLLM_GLM_KDA_FUSED_DECODE=1`` (unset: as ``TRTLLM_GLM_DECODE_FUSE``, else off; read per call), outside
    the batch-invariant mode (whose decode must equal a width-one verify + commit bit for bit: the fused kernel
    computes the gates in its own FP32 sums, the verify path through the low-rank GEMMs), and only where the KDA
    kernels run (`ops.conv`'s choice: CUDA tensors without a gradient, or ``TRTLLM_GLM_KDA_CONV_BACKEND=triton``,
    which the CPU tests use to run it interpreted; ``TRTLLM_GLM_KDA_BACKEND=torch`` keeps every reference)."""
    return envs.KDA_FUSED_DECODE.get() and not batch_invariant() and _use_kernel(x, None)


def _dense(w: torch.Tensor, scale_inv: torch.Tensor | None, block: int) -> torch.Tensor:
    """``w`` as an FP32 matrix (dequantised when it is block FP8)."""
    return w.float() if scale_inv is None else dequantize_block_fp8(w, scale_inv, block)


def kda_decode_fused_reference(
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
) -> tuple[torch.Tensor, torch.Tensor]:
    """The fused decode step in torch: the unfused layer's pieces, the low-rank products in FP32.

    Args:
        x: ``[n, C]`` conv inputs ``q | k | v``, ``C = H * (2K + V)``.
        fa: ``[n, R]`` the decay gate's low-rank input (``f_a_proj(hidden)``).
        b: ``[n, H]`` beta logits.
        ga: ``[n, R]`` the output gate's low-rank input (``g_a_proj(hidden)``).
        conv_state: ``[S, C, W - 1]`` conv window pool, updated in place at ``slots`` only.
        conv_weight: ``[C, W]`` taps.
        slots: ``[n]`` int64 distinct state slot of each row.
        f_b: ``[H * K, R]`` ``f_b_proj.weight`` (block FP8 with ``f_b_scale``).
        A_log: ``[H]``; dt_bias: ``[H * K]``; lower_bound: the decay gate's parameters.
        state: ``[S, H, K, V]`` recurrent state pool, updated in place at ``slots`` only.
        g_b: ``[H * V, R]`` ``g_b_proj.weight`` (block FP8 with ``g_b_scale``).
        norm_weight: ``[V]``; norm_eps: the gated RMSNorm's.
        scale: query scale.
        out_dtype: dtype of the ``o_proj`` input.
        f_b_scale, g_b_scale: optional block-FP8 scales (``[ceil(O / B), ceil(R / B)]``); quant_block: ``B``.
        l2_eps: added to each q / k head's squared norm.

    Returns:
        ``(y [n, H * V] out_dtype, o [n, H, V] FP32)``: the ``o_proj`` input and the recurrent output.
    """
    n, H = b.shape
    K, V = state.shape[-2], state.shape[-1]
    q, k, v = conv_decode_reference(x, conv_state, conv_weight, slots, H, K, V, l2_eps)
    g_raw = fa.float() @ _dense(f_b, f_b_scale, quant_block).t()
    g, beta = kda_gate_beta_reference(g_raw, b, A_log, dt_bias, lower_bound)
    o, S_new = recurrent_kda_step(q, k, v, g, beta, scale, state.index_select(0, slots))
    state.index_copy_(0, slots, S_new.to(state.dtype))
    gate = (ga.float() @ _dense(g_b, g_b_scale, quant_block).t()).view(n, H, V)
    y = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + norm_eps) * norm_weight.float() * torch.sigmoid(gate)
    return y.reshape(n, H * V).to(out_dtype), o


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
    backend: str = "auto",
    **kw: object,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`kda_decode_fused_reference` (same arguments and results, to FP32 rounding), in one Triton launch with
    ``backend="triton"`` (the CPU runs it interpreted) or ``"auto"`` for CUDA tensors; ``"torch"``: the reference.

    ``kw``: the reference's keyword arguments (``f_b_scale``, ``g_b_scale``, ``quant_block``, ``l2_eps``); the
    kernel also takes ``out``, ``block_v`` and ``num_warps``.
    """
    if backend not in ("auto", "torch", "triton"):
        raise ValueError(f"kda_decode_fused backend must be auto, torch or triton, got {backend!r}")
    args = (x, fa, b, ga, conv_state, conv_weight, slots, f_b, A_log, dt_bias, lower_bound, state, g_b,
            norm_weight, norm_eps, scale, out_dtype)  # fmt: skip
    if backend == "triton" or (backend == "auto" and x.is_cuda):
        from ..kernels import kda_decode_fused as kernel

        return kernel(*args, **kw)
    kw = {key: val for key, val in kw.items() if key not in ("out", "block_v", "num_warps")}
    return kda_decode_fused_reference(*args, **kw)  # type: ignore[arg-type]
