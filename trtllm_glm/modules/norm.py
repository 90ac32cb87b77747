"""Normalisation layers shared by the model's blocks (torch reference; CUDA inference runs the fused kernel
of `trtllm_glm.norm`, chosen by ``TRTLLM_GLM_NORM_BACKEND``)."""

from __future__ import annotations

import torch
from torch import nn

from ..norm import norm_backend, row_norm

__all__ = ["RMSNorm", "rms_norm"]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMS-normalise the last dim in fp32, scale by ``weight``, return in ``x``'s dtype.

    Args:
        x: ``[..., D]``.
        weight: ``[D]``.
        eps: variance epsilon.
    """
    if norm_backend(x, weight) == "triton":
        return row_norm(x, eps, weight=weight)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * weight.float()).to(x.dtype)


class RMSNorm(nn.Module):
    """RMSNorm with a learned scale (fp32 statistics)."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)
