"""Skinny fp32 GEMMs for the decode path: ``x.float() @ W.float()^T`` for a few rows, in one Triton launch.

The MoE router logits and the sparse-attention indexer's head weights are fp32 products of a bf16 weight with the
step's decode / verify rows. `linear_fp32` is what the model calls: `skinny_gemm` (`kernels`: the weight read once
in its own dtype, split along K, partials reduced in a fixed order) for CUDA inference with at most `MAX_M` rows,
`skinny_gemm_reference` (``F.linear(x.float(), W.float())``) otherwise; ``TRTLLM_GLM_SKINNY_GEMM_BACKEND``
(``auto`` / ``torch`` / ``triton``) forces either (`ops`).

The batch-invariant mode (`trtllm_glm.numerics`, issue 31) adds `invariant_linear`: ``x @ W^T`` with one tile shape
and one reduction order per weight for any number of rows (`kernels.launch_invariant_gemm` on CUDA, a per-row
fp32 matrix-vector reference elsewhere); `model_linear` is the model's float projection (``F.linear`` or, in the
mode, `invariant_linear`), and `linear_fp32` takes `invariant_linear` in the mode.

Importing this package needs only torch; Triton is imported on the first kernel call.
"""

from __future__ import annotations

from .ops import (
    INVARIANT_LINEAR_BACKEND_ENV,
    MAX_M,
    SKINNY_GEMM_BACKEND_ENV,
    invariant_bmm,
    invariant_linear,
    invariant_linear_backend,
    invariant_linear_reference,
    invariant_linear_triton,
    kernel_module,
    linear_fp32,
    model_bmm,
    model_linear,
    skinny_gemm,
    skinny_gemm_backend,
    skinny_gemm_reference,
)

__all__ = [
    "INVARIANT_LINEAR_BACKEND_ENV",
    "MAX_M",
    "invariant_bmm",
    "invariant_linear",
    "invariant_linear_backend",
    "invariant_linear_reference",
    "invariant_linear_triton",
    "model_bmm",
    "model_linear",
    "SKINNY_GEMM_BACKEND_ENV",
    "kernel_module",
    "linear_fp32",
    "skinny_gemm",
    "skinny_gemm_backend",
    "skinny_gemm_reference",
]
