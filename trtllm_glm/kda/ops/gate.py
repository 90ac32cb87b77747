"""KDA gate and normalisation helpers (torch, any device, FP32 math)."""

from __future__ import annotations

import torch

from ...norm import norm_backend, row_norm

__all__ = ["kda_gate", "l2_normalize", "L2NORM_EPS"]

# Added to the squared norm before the reciprocal square root; the same epsilon fla-core uses in its
# in-kernel L2 norm, so callers normalising outside the kernel match a kernel that normalises inside.
L2NORM_EPS = 1e-6


def kda_gate(g_raw: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, lower_bound: float) -> torch.Tensor:
    """The "safe" per-key-channel decay of KDA, in log space.

    ``g = lower_bound * sigmoid(exp(A_log[h]) * (g_raw + dt_bias[h, k]))``, so ``g`` lies in
    ``(lower_bound, 0)``: every step keeps at least ``exp(lower_bound)`` of each key channel.

    Args:
        g_raw: ``[N, H, K]`` gate logits (output of the low-rank gate projection), any float dtype.
        A_log: ``[H]`` per-head log rate.
        dt_bias: ``[H * K]`` per-channel bias.
        lower_bound: negative bound of the log decay (``-5`` for GLM-5.3-Flash).

    Returns:
        ``[N, H, K]`` FP32 log decay.
    """
    H, K = g_raw.shape[-2], g_raw.shape[-1]
    rate = A_log.float().exp().view(H, 1)
    x = g_raw.float() + dt_bias.float().view(H, K)
    return lower_bound * torch.sigmoid(rate * x)


def l2_normalize(x: torch.Tensor, eps: float = L2NORM_EPS) -> torch.Tensor:
    """``x / sqrt(sum(x^2) + eps)`` over the last dimension, in FP32.

    Args:
        x: ``[..., D]`` any float dtype.
        eps: added to the squared norm.

    Returns:
        ``[..., D]`` FP32.
    """
    if norm_backend(x) == "triton":
        return row_norm(x, eps, mean=False, out_dtype=torch.float32)
    x = x.float()
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)
