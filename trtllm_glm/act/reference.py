"""The clamped SwiGLU in plain torch: the reference of `trtllm_glm.act.kernels.swiglu` and the activation of
every dense MLP and expert (`trtllm_glm.modules.ffn`, `trtllm_glm.moe.ops`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["clamped_swiglu"]


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float | None) -> torch.Tensor:
    """``silu(min(gate, limit)) * clamp(up, -limit, limit)``; no clamp when ``limit`` is ``None``.

    Args:
        gate: ``[..., I]`` gate projection.
        up: ``[..., I]`` up projection.
        limit: ``swiglu_limit`` (10 in GLM-5.3-Flash).
    """
    if limit is not None:
        gate = gate.clamp(max=limit)
        up = up.clamp(min=-limit, max=limit)
    return F.silu(gate) * up
