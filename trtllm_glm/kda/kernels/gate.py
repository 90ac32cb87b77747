"""Triton kernel of the KDA layer's per-row gates: the log decay ``g`` and the delta-rule strength ``beta``.

A drop-in for `trtllm_glm.kda.ops.gate.kda_gate_beta_reference` (about ten small launches per KDA layer).
``_gate_beta_kernel``, grid ``(N, cdiv(H * K, BLOCK))``: program ``(n, j)`` computes ``g`` for ``BLOCK`` channels
of row ``n`` (channel ``c`` belongs to head ``c // K``); programs with ``j == 0`` also ``beta = sigmoid(b)`` for the
row's ``H`` heads. FP32 in registers; ``exp`` and the division may differ from torch's by an ulp or two (agreement
to FP32 rounding, not bit for bit). Shapes only, no host sync: graph-capturable. The gate formula: docs/design.md §4.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from trtllm_glm.pdl import late_trigger, launch_kwargs, pdl_enter, pdl_leave, use_pdl

__all__ = ["kda_gate_beta"]


@triton.jit
def _gate_beta_kernel(
    g_raw_ptr,
    b_ptr,
    a_log_ptr,
    dt_bias_ptr,
    g_ptr,
    beta_ptr,
    stride_gn,
    stride_bn,
    lower_bound,
    H: tl.constexpr,
    K: tl.constexpr,
    BLOCK: tl.constexpr,
    H_PAD: tl.constexpr,
    PDL: tl.constexpr,
    PDL_LATE: tl.constexpr,
):
    pdl_enter(PDL, PDL_LATE)  # `trtllm_glm.pdl`: launched early, it waits here for the projections before it
    n = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1)
    c = j * BLOCK + tl.arange(0, BLOCK)
    ok = c < H * K
    x = tl.load(g_raw_ptr + n * stride_gn + c, mask=ok, other=0.0).to(tl.float32)
    x += tl.load(dt_bias_ptr + c, mask=ok, other=0.0).to(tl.float32)
    rate = tl.exp(tl.load(a_log_ptr + c // K, mask=ok, other=0.0).to(tl.float32))
    g = lower_bound / (1.0 + tl.exp(-(rate * x)))
    tl.store(g_ptr + n * (H * K) + c, g, mask=ok)
    if j == 0:
        h = tl.arange(0, H_PAD)
        hb = tl.load(b_ptr + n * stride_bn + h, mask=h < H, other=0.0).to(tl.float32)
        tl.store(beta_ptr + n * H + h, 1.0 / (1.0 + tl.exp(-hb)), mask=h < H)
    pdl_leave(PDL, PDL_LATE)  # every program, after the branch


def kda_gate_beta(
    g_raw: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    lower_bound: float,
    *,
    block: int = 1024,
    num_warps: int = 4,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton `ops.gate.kda_gate_beta_reference` in one launch.

    Args:
        g_raw: ``[N, H * K]`` gate logits (rows may be strided, channels contiguous).
        b: ``[N, H]`` beta logits (rows may be strided, heads contiguous).
        A_log: ``[H]`` per-head log rate.
        dt_bias: ``[H * K]`` per-channel bias.
        lower_bound: negative bound of the log decay.
        block: channels per program.
        num_warps: warps per program.

    Returns:
        ``(g [N, H, K], beta [N, H])`` FP32.
    """
    N, H = b.shape
    K = g_raw.shape[1] // H
    dev = g_raw.device
    g = torch.empty(N, H, K, dtype=torch.float32, device=dev)
    beta = torch.empty(N, H, dtype=torch.float32, device=dev)
    if N == 0:
        return g, beta
    block = min(block, triton.next_power_of_2(H * K))
    pdl = use_pdl(dev)
    _gate_beta_kernel[(N, triton.cdiv(H * K, block))](
        g_raw, b, A_log, dt_bias, g, beta, g_raw.stride(0), b.stride(0), float(lower_bound),
        H=H, K=K, BLOCK=block, H_PAD=triton.next_power_of_2(H), PDL=pdl, PDL_LATE=late_trigger(pdl),
        num_warps=num_warps, **launch_kwargs(pdl),
    )  # fmt: skip
    return g, beta
