"""Skinny fp32 GEMMs for the decode path: ``x.float() @ W.float()^T`` for a few rows, in one Triton launch.

The MoE router logits and the indexer's head weights: `linear_fp32` takes `skinny_gemm` for CUDA inference with at
most `MAX_M` rows, `skinny_gemm_reference` otherwise (`ops`; ``TRTLLM_GLM_SKINNY_GEMM_BACKEND``). The batch-invariant
mode (`trtllm_glm.numerics`) adds `invariant_linear` (one tile shape and reduction order per weight for any number
of rows); `model_linear` is the model's float projection (``F.linear`` or, in the mode, `invariant_linear`), and
`linear_fp32` takes `invariant_linear` in the mode. Importing this package needs only torch; Triton is imported on
the first kernel call. docs/kernels.md, "Skinny fp32 GEMM"; docs/numerics.md.
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
