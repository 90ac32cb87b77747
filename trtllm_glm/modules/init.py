"""Seeded weight initialisation shared by the layers."""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["init_linear_"]


@torch.no_grad()
def init_linear_(module: nn.Module, generator: torch.Generator, std: float) -> None:
    """Fill every ``nn.Linear`` weight under ``module`` from N(0, std) (biases zero), in a fixed order; a
    `trtllm_glm.modules.linear.Fp8Linear` holds the same draw quantised to block FP8.

    Args:
        module: root module; its ``named_modules()`` order fixes the draw order.
        generator: CPU generator (draws are made on the CPU and copied, so a seed gives the same
            weights on every device).
        std: standard deviation.
    """
    for _, m in module.named_modules():
        if isinstance(m, nn.Linear):
            w = torch.empty(m.weight.shape, dtype=torch.float32).normal_(0.0, std, generator=generator)
            set_weight = getattr(m, "set_weight_", None)  # a block-FP8 linear quantises the draw
            if callable(set_weight):
                set_weight(w)
            else:
                m.weight.copy_(w)
            if m.bias is not None:
                m.bias.zero_()
