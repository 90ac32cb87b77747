"""KDA gate and normalisation helpers (torch, any device, FP32 math), and the gates' one-launch dispatch."""

from __future__ import annotations

import torch

from ... import envs
from ...norm import norm_backend, row_norm
from ...triton_interp import kernel_backend
from ..contract import L2NORM_EPS

__all__ = ["GATE_BACKEND_ENV", "kda_gate", "kda_gate_beta", "kda_gate_beta_reference", "l2_normalize", "L2NORM_EPS"]

# Picks `kda_gate_beta`'s implementation: auto (the Triton kernel for CUDA tensors), torch or triton.
GATE_BACKEND_ENV = envs.KDA_GATE_BACKEND.name


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


def kda_gate_beta_reference(
    g_raw: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, lower_bound: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """A KDA layer's per-row gates: ``kda_gate`` of the gate logits and ``sigmoid(b)``.

    Args:
        g_raw: ``[N, H * K]`` gate logits (the low-rank gate projection's output), any float dtype.
        b: ``[N, H]`` beta logits, any float dtype.
        A_log: ``[H]`` per-head log rate.
        dt_bias: ``[H * K]`` per-channel bias.
        lower_bound: negative bound of the log decay.

    Returns:
        ``(g [N, H, K], beta [N, H])`` FP32.
    """
    N, H = b.shape
    g = kda_gate(g_raw.reshape(N, H, -1), A_log, dt_bias, lower_bound)
    return g, torch.sigmoid(b.float())


def kda_gate_beta(
    g_raw: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    lower_bound: float,
    *,
    backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`kda_gate_beta_reference`, in one Triton launch (`trtllm_glm.kda.kernels.kda_gate_beta`) for CUDA tensors.

    ``backend`` (default ``TRTLLM_GLM_KDA_GATE_BACKEND``, else auto): ``"torch"``, ``"triton"`` (on the CPU
    through Triton's interpreter) or ``"auto"``; ``TRTLLM_GLM_KDA_BACKEND=torch`` (the KDA torch-everything
    switch) also selects the reference. Same arguments and results (to FP32 rounding) as the reference.

    Raises:
        ValueError: shapes that do not match ``[N, H * K]``, ``[N, H]``, ``[H]``, ``[H * K]``.
    """
    if g_raw.dim() != 2 or b.dim() != 2 or b.shape[0] != g_raw.shape[0] or g_raw.shape[1] % max(b.shape[1], 1):
        raise ValueError(f"kda_gate_beta needs g_raw [N, H*K] and b [N, H], got {tuple(g_raw.shape)}, {tuple(b.shape)}")
    if A_log.numel() != b.shape[1] or dt_bias.numel() != g_raw.shape[1]:
        raise ValueError(f"A_log must have H={b.shape[1]} and dt_bias H*K={g_raw.shape[1]} elements")
    choice = kernel_backend(envs.KDA_GATE_BACKEND, [g_raw], backend)
    if choice == "triton" and (backend is not None or envs.KDA_BACKEND.get() != "torch"):
        from ..kernels import kda_gate_beta as kernel

        if g_raw.stride(-1) != 1 or b.stride(-1) != 1:
            g_raw, b = g_raw.contiguous(), b.contiguous()
        return kernel(g_raw, b, A_log.reshape(-1), dt_bias.reshape(-1), lower_bound)
    return kda_gate_beta_reference(g_raw, b, A_log, dt_bias, lower_bound)


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
