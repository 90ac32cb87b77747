"""Fused row normalisations for the CUDA decode path: RMSNorm, gated RMSNorm and L2 normalisation.

`kernels.row_norm` does any of them in one launch instead of ~6-11 small torch kernels (a decode step calls them ~20
times); references: `trtllm_glm.modules.norm.rms_norm`, `trtllm_glm.kda.layer.GatedRMSNorm`,
`trtllm_glm.kda.ops.gate.l2_normalize`. Callers dispatch through `norm_backend` (``TRTLLM_GLM_NORM_BACKEND``). CUDA
tensors go to the compiled kernels, the CPU to an interpreted copy (`trtllm_glm.triton_interp`); importing this
package needs only torch. docs/kernels.md, "Row normalisations".
"""

from __future__ import annotations

from typing import Any

import torch

from trtllm_glm import envs
from trtllm_glm.triton_interp import KernelPackage, kernel_backend

__all__ = ["NORM_BACKEND_ENV", "kernel_module", "norm_backend", "row_norm"]

NORM_BACKEND_ENV = envs.NORM_BACKEND.name

_PACKAGE = KernelPackage(__name__, __path__)


def kernel_module(device: torch.device | str) -> Any:
    """`kernels` built for ``device``: compiled on CUDA, an interpreted copy elsewhere."""
    return _PACKAGE.module("kernels", device)


def norm_backend(*tensors: torch.Tensor | None, backend: str | None = None) -> str:
    """``"torch"`` or ``"triton"`` for one normalisation call (decided from devices and flags only).

    ``backend`` (default: ``TRTLLM_GLM_NORM_BACKEND``, else ``"auto"``): ``"torch"``, the references;
    ``"triton"``, the kernel on any device (the CPU runs it through Triton's interpreter); ``"auto"``, the
    kernel for CUDA tensors when no gradient is needed (it has no backward), the reference otherwise.

    Args:
        *tensors: the call's inputs (``None`` entries are skipped); the first one's device decides.
        backend: overrides the environment.
    """
    return kernel_backend(envs.NORM_BACKEND, tensors, backend)


def row_norm(
    x: torch.Tensor,
    eps: float,
    *,
    weight: torch.Tensor | None = None,
    gate: torch.Tensor | None = None,
    mean: bool = True,
    out_dtype: torch.dtype | None = None,
    **launch: Any,
) -> torch.Tensor:
    """``x * rsqrt(mean_or_sum(x^2) + eps) [* weight] [* sigmoid(gate)]`` over the last dim (`kernels.row_norm`).

    Args:
        x: ``[..., D]`` any float dtype (the last dim contiguous).
        eps: added to the statistic.
        weight: optional ``[D]`` scale.
        gate: optional ``[..., D]`` gate logits, shaped like ``x``.
        mean: mean of squares (RMSNorm) or sum (L2 normalisation).
        out_dtype: result dtype (default ``x``'s).
        **launch: ``out`` (preallocated result), ``num_warps``.

    Returns:
        ``[..., D]`` in ``out_dtype``.
    """
    mod = kernel_module(x.device)
    return mod.row_norm(x, eps, weight=weight, gate=gate, mean=mean, out_dtype=out_dtype, **launch)
