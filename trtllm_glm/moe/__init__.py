"""Fused mixture-of-experts for decode / verify: torch reference (`ops`) and Triton kernels (`kernels`).

`ops` is plain torch (any device); `kernels` imports Triton and is imported lazily by its users
(``from trtllm_glm.moe import kernels``), so that importing this package does not need Triton.
"""

from __future__ import annotations

from .ops import (
    FP8_BLOCK,
    check_fused_moe_args,
    dequantize_experts,
    expert_scale_shapes,
    fused_moe_ref,
    moe_align,
    padded_pairs_bound,
)

__all__ = [
    "FP8_BLOCK",
    "check_fused_moe_args",
    "dequantize_experts",
    "expert_scale_shapes",
    "fused_moe_ref",
    "moe_align",
    "padded_pairs_bound",
]
