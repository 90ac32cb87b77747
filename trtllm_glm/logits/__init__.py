"""What a step reads off its final logits: each row's greedy token and the gap between its two best logits.

`greedy_top2_reference` is the torch definition (``torch.argmax``: the first maximum; ``torch.topk(k=2)``:
the two largest values with multiplicity, so a repeated maximum has gap 0). On CUDA, `greedy_top2` and
`greedy_pack` run it in two Triton launches (`kernels`) instead of ~10 (topk's radix select alone is ~40 µs
at batch 1 over a 155K vocabulary), with identical results (no arithmetic beyond comparisons and one
subtraction). ``TRTLLM_GLM_LOGITS_BACKEND`` (``auto`` / ``torch`` / ``triton``) forces either path.

Where the kernels run: CUDA tensors go to the compiled kernels; any other device (the CPU) goes to an
interpreted copy of the same module (`trtllm_glm.triton_interp`) when the triton backend is forced.
"""

from __future__ import annotations

from typing import Any

import torch

from trtllm_glm.triton_interp import KernelPackage, kernel_backend

__all__ = [
    "LOGITS_BACKEND_ENV",
    "greedy_pack",
    "greedy_top2",
    "greedy_top2_reference",
    "kernel_module",
    "logits_backend",
]

LOGITS_BACKEND_ENV = "TRTLLM_GLM_LOGITS_BACKEND"

_PACKAGE = KernelPackage(__name__, __path__)


def kernel_module(device: torch.device | str) -> Any:
    """`kernels` built for ``device``: compiled on CUDA, an interpreted copy elsewhere."""
    return _PACKAGE.module("kernels", device)


def logits_backend(logits: torch.Tensor, backend: str | None = None) -> str:
    """``"torch"`` or ``"triton"`` for one call (``backend``, else ``TRTLLM_GLM_LOGITS_BACKEND``, else auto:
    the kernels for CUDA tensors)."""
    return kernel_backend("logits", LOGITS_BACKEND_ENV, [logits], backend)


def _check(logits: torch.Tensor) -> None:
    if logits.dim() != 2 or logits.shape[1] < 2:
        raise ValueError(f"logits must be [N, V] with V >= 2, got shape {tuple(logits.shape)}")
    if not logits.is_floating_point():
        raise ValueError(f"logits must be a float tensor, got {logits.dtype}")


def greedy_top2_reference(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``logits [N, V]`` -> ``(ids [N] int64, gap [N] fp32)``: the first maximum and ``top1 - top2``."""
    _check(logits)
    top = torch.topk(logits.float(), 2, dim=-1).values
    return torch.argmax(logits, dim=-1), top[:, 0] - top[:, 1]


def greedy_top2(logits: torch.Tensor, *, backend: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's greedy token and top-2 gap (`greedy_top2_reference`; two launches on CUDA).

    Args:
        logits: ``[N, V]`` any float dtype, ``V >= 2``.
        backend: ``"auto"`` / ``"torch"`` / ``"triton"`` (default ``TRTLLM_GLM_LOGITS_BACKEND``).

    Returns:
        ``(ids [N] int64, gap [N] fp32)`` on ``logits``' device.
    """
    _check(logits)
    if logits_backend(logits, backend) == "torch":
        return greedy_top2_reference(logits)
    return kernel_module(logits.device).greedy_top2(_rows_contiguous(logits))


def greedy_pack(
    logits: torch.Tensor, accepted: torch.Tensor | None = None, *, backend: str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The greedy ids and the ``[N, 3]`` float64 rows ``(id, gap, accepted)`` a step copies to the host once.

    Args:
        logits: ``[N, V]`` any float dtype, ``V >= 2``.
        accepted: optional ``[N]`` integer accepted count of each row's sequence (default 1: no drafts).
        backend: as in `greedy_top2`.

    Returns:
        ``(ids [N] int64, packed [N, 3] float64)``; token ids and counts are exact in float64.
    """
    _check(logits)
    N = logits.shape[0]
    if accepted is not None and accepted.shape != (N,):
        raise ValueError(f"accepted must be [{N}], got shape {tuple(accepted.shape)}")
    if logits_backend(logits, backend) == "torch":
        ids, gap = greedy_top2_reference(logits)
        acc = torch.ones_like(ids) if accepted is None else accepted
        return ids, torch.stack([ids.to(torch.float64), gap.to(torch.float64), acc.to(torch.float64)], dim=1)
    packed = torch.empty(N, 3, dtype=torch.float64, device=logits.device)
    ids, _ = kernel_module(logits.device).greedy_top2(
        _rows_contiguous(logits), want_gap=False, packed=packed, accepted=accepted
    )
    return ids, packed


def _rows_contiguous(logits: torch.Tensor) -> torch.Tensor:
    return logits if logits.stride(-1) == 1 else logits.contiguous()
