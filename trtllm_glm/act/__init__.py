"""The clamped SwiGLU of the dense MLP after one fused gate|up GEMM, in one launch on CUDA.

`kernels.swiglu` replaces the reference's four launches (`trtllm_glm.act.reference.clamped_swiglu` on the two
halves of the GEMM output), bit for bit like it on CUDA. `trtllm_glm.modules.ffn.GatedMLP` calls `swiglu` once its
gate and up weights share one storage (`GatedMLP.fuse_weights`), through `swiglu_backend`
(``TRTLLM_GLM_SWIGLU_BACKEND``). CUDA tensors go to the compiled kernel, the CPU to an interpreted copy
(`trtllm_glm.triton_interp`); importing this package needs only torch. Numerics: docs/kernels.md, "Clamped SwiGLU".
"""

from __future__ import annotations

from typing import Any

import torch

from trtllm_glm import envs
from trtllm_glm.act.reference import clamped_swiglu
from trtllm_glm.triton_interp import KernelPackage, kernel_backend

__all__ = [
    "SWIGLU_BACKEND_ENV",
    "check_gate_up",
    "clamped_swiglu",
    "kernel_module",
    "swiglu",
    "swiglu_backend",
    "swiglu_reference",
]

SWIGLU_BACKEND_ENV = envs.SWIGLU_BACKEND.name

_PACKAGE = KernelPackage(__name__, __path__)


def kernel_module(device: torch.device | str) -> Any:
    """`kernels` built for ``device``: compiled on CUDA, an interpreted copy elsewhere."""
    return _PACKAGE.module("kernels", device)


def swiglu_backend(*tensors: torch.Tensor | None, backend: str | None = None) -> str:
    """``"torch"`` or ``"triton"`` for one SwiGLU call (decided from devices and flags only).

    ``backend`` (default: ``TRTLLM_GLM_SWIGLU_BACKEND``, else ``"auto"``): ``"torch"``, the reference;
    ``"triton"``, the kernel on any device (the CPU runs it through Triton's interpreter); ``"auto"``, the kernel
    for CUDA tensors when no gradient is needed (it has no backward), the reference otherwise.

    Args:
        *tensors: the call's inputs (``None`` entries are skipped); the first one's device decides.
        backend: overrides the environment.
    """
    return kernel_backend(envs.SWIGLU_BACKEND, tensors, backend)


def check_gate_up(gate_up: torch.Tensor, out: torch.Tensor | None = None) -> int:
    """Validate ``gate_up [N, 2I]`` (and ``out [N, I]`` when given) for either backend; return ``I``.

    Raises:
        ValueError: not 2-D, an odd last dim, or an ``out`` of the wrong shape, dtype or device.
    """
    if gate_up.dim() != 2:
        raise ValueError(f"swiglu: gate_up must be 2-D [N, 2I], got shape {tuple(gate_up.shape)}")
    if gate_up.shape[1] % 2:
        raise ValueError(f"swiglu: gate_up's last dim must be even (gate columns, then up), got {gate_up.shape[1]}")
    inter = gate_up.shape[1] // 2
    if out is not None:
        if out.shape != (gate_up.shape[0], inter):
            raise ValueError(f"swiglu: out must be [{gate_up.shape[0]}, {inter}], got {tuple(out.shape)}")
        if out.dtype != gate_up.dtype or out.device != gate_up.device:
            raise ValueError(
                f"swiglu: out must be {gate_up.dtype} on {gate_up.device}, got {out.dtype} on {out.device}"
            )
    return inter


def swiglu_reference(gate_up: torch.Tensor, limit: float | None) -> torch.Tensor:
    """`clamped_swiglu` of the two halves of ``gate_up``: the torch reference of `kernels.swiglu`.

    Args:
        gate_up: ``[N, 2I]``, gate columns then up columns.
        limit: the clamp ``L`` (``None``: plain SwiGLU).

    Returns:
        ``[N, I]`` in ``gate_up``'s dtype.
    """
    inter = check_gate_up(gate_up)
    return clamped_swiglu(gate_up[:, :inter], gate_up[:, inter:], limit)


def swiglu(
    gate_up: torch.Tensor,
    limit: float | None,
    backend: str | None = None,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``silu(min(gate, L)) * clamp(up, -L, L)`` over the halves of a fused gate|up GEMM output.

    Args:
        gate_up: ``[N, 2I]`` (columns contiguous, any row stride), gate columns ``[:, :I]`` then up ``[:, I:]``.
        limit: the clamp ``L`` (``None``: plain SwiGLU).
        backend: ``"torch"`` / ``"triton"`` / ``"auto"``; ``None`` follows ``TRTLLM_GLM_SWIGLU_BACKEND``
            (`swiglu_backend`).
        out: optional preallocated ``[N, I]`` result in ``gate_up``'s dtype.

    Returns:
        ``[N, I]`` in ``gate_up``'s dtype (``out`` when given). The kernel equals the reference bit for bit on
        CUDA (see `kernels`), to an ulp under the interpreter.

    Raises:
        ValueError: ``gate_up`` not 2-D or with an odd last dim, a mismatched ``out``, an unknown backend.
    """
    check_gate_up(gate_up, out)
    if swiglu_backend(gate_up, backend=backend) == "triton":
        return kernel_module(gate_up.device).swiglu(gate_up, limit, out=out)
    ref = swiglu_reference(gate_up, limit)
    if out is None:
        return ref
    return out.copy_(ref)
