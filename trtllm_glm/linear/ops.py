"""fp32 GEMMs of a few rows against a (usually bf16) weight: the torch reference, the kernel op, the dispatcher.

`skinny_gemm_reference` is the definition the reference (transformers' glm5_next) uses for the MoE router logits and
the indexer's head weights: ``F.linear(x.float(), W.float())``. `skinny_gemm` computes it in one Triton launch
(`kernels`), reading ``x`` and ``W`` in their own dtypes; `linear_fp32` picks as `skinny_gemm_backend` decides.
CUDA tensors go to the compiled kernel, the CPU to an interpreted copy of `kernels`
(`trtllm_glm.triton_interp.KernelPackage`); importing this module needs only torch. docs/kernels.md, "Skinny fp32
GEMM".
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.nn.functional as F

from trtllm_glm import envs
from trtllm_glm.numerics import batch_invariant
from trtllm_glm.triton_interp import KernelPackage, kernel_backend

__all__ = [
    "INVARIANT_BLOCK_M_ENV",
    "INVARIANT_LINEAR_BACKEND_ENV",
    "MAX_M",
    "invariant_linear",
    "invariant_block_m",
    "invariant_bmm",
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

SKINNY_GEMM_BACKEND_ENV = envs.SKINNY_GEMM_BACKEND.name
INVARIANT_LINEAR_BACKEND_ENV = envs.INVARIANT_LINEAR_BACKEND.name
# The invariant GEMM's row tile (`kernels.INVARIANT_BLOCK_M` unless set: 16, 32 or 64), read per call so that a
# benchmark can A/B it (`bench_e2e.py --env-ab`); a process must keep one value (it is part of the MMA shape).
INVARIANT_BLOCK_M_ENV = envs.INVARIANT_BLOCK_M.name
# Weight tiles per program of the invariant GEMM beyond one row tile (1 or 4; the same bits), for A/B.
INVARIANT_GROUP_N_ENV = envs.INVARIANT_GROUP_N.name
# Rows one kernel launch handles (`kernels.MAX_M`; repeated here so that the dispatcher needs no Triton import).
MAX_M = 64

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_PACKAGE = KernelPackage(__package__ or "trtllm_glm.linear", [os.path.dirname(os.path.abspath(__file__))])


def kernel_module(device: torch.device | str) -> Any:
    """`kernels` built for ``device``: compiled on CUDA, an interpreted copy elsewhere."""
    return _PACKAGE.module("kernels", device)


def skinny_gemm_reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x.float() @ weight.float()^T`` (torch; differentiable; any device).

    Args:
        x: ``[..., K]`` float.
        weight: ``[N, K]`` float.

    Returns:
        ``[..., N]`` fp32.
    """
    return F.linear(x.float(), weight.float())


def _check(x: torch.Tensor, weight: torch.Tensor) -> None:
    if weight.dim() != 2:
        raise ValueError(f"skinny_gemm: weight must be 2-D [N, K], got shape {tuple(weight.shape)}")
    if x.dim() < 1 or x.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"skinny_gemm: x must be [..., K] with K = {weight.shape[1]} (weight {tuple(weight.shape)}), "
            f"got shape {tuple(x.shape)}"
        )
    if x.device != weight.device:
        raise ValueError(f"skinny_gemm: x is on {x.device}, weight on {weight.device}")


def skinny_gemm_backend(x: torch.Tensor, weight: torch.Tensor, backend: str | None = None) -> str:
    """``"torch"`` or ``"triton"`` for one `linear_fp32` call (decided from shapes, devices and flags only).

    ``backend`` (default: ``TRTLLM_GLM_SKINNY_GEMM_BACKEND``, else ``"auto"``): ``"torch"``, the reference;
    ``"triton"``, the kernel on any device (the CPU runs it through Triton's interpreter); ``"auto"``, the kernel
    for CUDA tensors when no gradient is needed (it has no backward), the reference otherwise. Either way a call
    the kernel does not cover (more than `MAX_M` or no rows, an empty weight, a dtype other than fp32 / bf16 /
    fp16) takes the reference.

    Raises:
        ValueError: an unknown backend name.
        RuntimeError: ``"triton"`` forced while a gradient is needed.
    """
    choice = kernel_backend(envs.SKINNY_GEMM_BACKEND, [x, weight], backend)
    if choice == "torch":
        return "torch"
    rows = x.numel() // x.shape[-1] if x.dim() and x.shape[-1] else 0
    covered = (
        1 <= rows <= MAX_M
        and weight.dim() == 2
        and weight.shape[0] > 0
        and weight.shape[1] > 0
        and x.dtype in _DTYPES
        and weight.dtype in _DTYPES
    )
    return "triton" if covered else "torch"


def skinny_gemm(
    x: torch.Tensor,
    weight: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
    split_k: int | None = None,
    block_k: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> torch.Tensor:
    """``x.float() @ weight.float()^T`` in one Triton launch (`kernels`), for at most `MAX_M` rows.

    fp32 accumulation of the exact products of the inputs' values (bf16 x bf16 and fp16 x fp16 on tensor
    cores, otherwise IEEE fp32 FMAs), never TF32; bitwise reproducible; compiled, a row's result does not depend
    on the other rows. Nothing reads tensor values on the host and launch parameters depend on shapes only, so the
    call can be captured in a CUDA graph (run it once outside the capture first: it allocates its cached
    scratch then).

    Args:
        x: ``[M, K]`` fp32 / bf16 / fp16, ``1 <= M <= MAX_M``, any row stride (a non-unit last stride is copied).
        weight: ``[N, K]`` fp32 / bf16 / fp16 on ``x``'s device (a non-unit last stride is copied).
        out: optional ``[M, N]`` fp32 result buffer with a unit last stride; written and returned.
        split_k: at most this many K chunks per weight tile (tuning only; `kernels.launch_config`).
        block_k: reduction columns per step (tuning only).
        num_warps: warps per program (tuning only).
        num_stages: pipelined steps (tuning only).

    Returns:
        ``[M, N]`` fp32.

    Raises:
        ValueError: wrong dims, mismatched K or devices, an unsupported dtype, ``M`` out of range or a bad
            ``out``.
    """
    _check(x, weight)
    if x.dim() != 2:
        raise ValueError(f"skinny_gemm: x must be 2-D [M, K], got shape {tuple(x.shape)}")
    if x.dtype not in _DTYPES or weight.dtype not in _DTYPES:
        raise ValueError(f"skinny_gemm: dtypes must be fp32 / bf16 / fp16, got x {x.dtype}, weight {weight.dtype}")
    m_rows, k = x.shape
    n = weight.shape[0]
    if not 1 <= m_rows <= MAX_M:
        raise ValueError(f"skinny_gemm: x must have 1 to {MAX_M} rows, got {m_rows}")
    if out is None:
        out = torch.empty(m_rows, n, dtype=torch.float32, device=x.device)
    elif out.shape != (m_rows, n) or out.dtype != torch.float32 or out.device != x.device or out.stride(-1) != 1:
        raise ValueError(
            f"skinny_gemm: out must be [{m_rows}, {n}] float32 on {x.device} with a unit last stride, "
            f"got {tuple(out.shape)} {out.dtype} on {out.device} strides {out.stride()}"
        )
    if n == 0:
        return out
    if k == 0:
        return out.zero_()
    x, weight, mod, cfg, dot_fp32 = _launch_plan(x, weight, split_k, block_k, num_warps, num_stages)
    mod.launch_skinny_gemm(x, weight, out, cfg, dot_fp32)
    return out


def _launch_plan(
    x: torch.Tensor,
    weight: torch.Tensor,
    split_k: int | None,
    block_k: int | None,
    num_warps: int | None,
    num_stages: int | None,
) -> tuple[torch.Tensor, torch.Tensor, Any, Any, bool]:
    """``(x, weight)`` with unit last strides, the kernel module, its `launch_config` for ``weight``'s shape
    (never ``M``) and whether the dot is IEEE fp32: what `skinny_gemm` and `invariant_linear_triton` share."""
    if x.stride(1) != 1:
        x = x.contiguous()
    if weight.stride(1) != 1:
        weight = weight.contiguous()
    mod = kernel_module(x.device)
    # Tensor cores for two 16-bit inputs of one dtype on CUDA; IEEE fp32 otherwise (and always when interpreted).
    dot_fp32 = bool(mod.INTERPRETED) or x.dtype != weight.dtype or x.dtype == torch.float32
    n, k = weight.shape
    cfg = mod.launch_config(
        n, k, weight.element_size(), dot_fp32,
        split_k=split_k, block_k=block_k, num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    return x, weight, mod, cfg, dot_fp32


def linear_fp32(x: torch.Tensor, weight: torch.Tensor, *, backend: str | None = None) -> torch.Tensor:
    """``F.linear(x.float(), weight.float())``: `skinny_gemm` when `skinny_gemm_backend` says ``"triton"``, else
    `skinny_gemm_reference` (on the CPU by default: exactly the reference's result).

    Args:
        x: ``[..., K]`` float.
        weight: ``[N, K]`` float on ``x``'s device.
        backend: ``"auto"`` / ``"torch"`` / ``"triton"`` (default ``TRTLLM_GLM_SKINNY_GEMM_BACKEND``, else auto).

    Returns:
        ``[..., N]`` fp32.

    With the batch-invariant mode on (`trtllm_glm.numerics`) and no ``backend`` given, `invariant_linear` instead
    (a row's bits then do not depend on the other rows, at any M).

    Raises:
        ValueError: ``weight`` not 2-D, a K that does not match, or different devices.
    """
    _check(x, weight)
    if batch_invariant() and backend is None:
        # One tile shape and reduction order per weight for any number of rows (`invariant_linear`).
        return invariant_linear(x, weight, out_dtype=torch.float32)
    if skinny_gemm_backend(x, weight, backend) == "torch":
        return skinny_gemm_reference(x, weight)
    y = skinny_gemm(x.reshape(-1, x.shape[-1]), weight)
    return y.view(*x.shape[:-1], weight.shape[0])


def invariant_linear_reference(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *, out_dtype: torch.dtype | None = None
) -> torch.Tensor:
    """``x @ weight^T (+ bias)`` one row at a time in fp32 (a matrix-vector product per row, whose summation order
    depends on the weight alone), rounded once to ``out_dtype``: row-invariant on any device, for the CPU.

    Args:
        x: ``[..., K]`` float.
        weight: ``[N, K]`` float.
        bias: optional ``[N]``.
        out_dtype: the result's dtype (default ``x.dtype``).

    Returns:
        ``[..., N]`` in ``out_dtype``.
    """
    _check(x, weight)
    x2 = x.reshape(-1, x.shape[-1]).float()
    w = weight.float()
    rows = [torch.mv(w, r) for r in x2]  # differentiable; M is small wherever this runs
    y = torch.stack(rows) if rows else x2.new_zeros(0, weight.shape[0])
    if bias is not None:
        y += bias.float()
    return y.to(out_dtype or x.dtype).view(*x.shape[:-1], weight.shape[0])


def invariant_block_m() -> int | None:
    """``TRTLLM_GLM_INVARIANT_BLOCK_M`` as an int (``None``: the kernel's default).

    Raises:
        ValueError: not 16, 32 or 64.
    """
    return envs.INVARIANT_BLOCK_M.get()


def invariant_linear_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    *,
    out_dtype: torch.dtype | None = None,
    block_m: int | None = None,
    group_n: int | None = None,
    split_k: int | None = None,
    block_k: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> torch.Tensor:
    """``x @ weight^T`` in one Triton launch whose tile shape and reduction order depend on ``weight``'s shape and
    the dtypes only, never on ``M`` (`kernels.launch_invariant_gemm`): the same row gives the same bits at any
    ``M`` and beside any other rows. fp32 accumulation of exact products, rounded once to ``out_dtype``.
    Capturable in a CUDA graph after one eager call of the weight's shape (the split scratch is cached then).

    Args:
        x: ``[M, K]`` fp32 / bf16 / fp16, ``M >= 0``.
        weight: ``[N, K]`` fp32 / bf16 / fp16 on ``x``'s device.
        out_dtype: fp32 / bf16 / fp16 (default ``x.dtype``).
        block_m: rows per program (default ``TRTLLM_GLM_INVARIANT_BLOCK_M``, else `kernels.INVARIANT_BLOCK_M`).
        group_n: weight tiles per program beyond ``block_m`` rows, 1 or 4 (default ``TRTLLM_GLM_INVARIANT_GROUP_N``,
            else `kernels.INVARIANT_GROUP_N`); the same bits either way.
        split_k, block_k, num_warps, num_stages: tuning only (`kernels.launch_config`). Any choice is
            row-invariant as long as every call of a weight makes the same one.

    Returns:
        ``[M, N]`` in ``out_dtype``.

    Raises:
        ValueError: wrong dims, mismatched K or devices, or an unsupported dtype.
    """
    _check(x, weight)
    out_dtype = out_dtype or x.dtype
    if x.dim() != 2:
        raise ValueError(f"invariant_linear: x must be 2-D [M, K], got shape {tuple(x.shape)}")
    if x.dtype not in _DTYPES or weight.dtype not in _DTYPES or out_dtype not in _DTYPES:
        raise ValueError(
            f"invariant_linear: dtypes must be fp32 / bf16 / fp16, got x {x.dtype}, weight {weight.dtype}, "
            f"out {out_dtype}"
        )
    m_rows, k = x.shape
    n = weight.shape[0]
    out = torch.empty(m_rows, n, dtype=out_dtype, device=x.device)
    if n == 0 or m_rows == 0:
        return out
    if k == 0:
        return out.zero_()
    x, weight, mod, cfg, dot_fp32 = _launch_plan(x, weight, split_k, block_k, num_warps, num_stages)
    bm = block_m or invariant_block_m() or mod.INVARIANT_BLOCK_M
    gn = group_n or envs.INVARIANT_GROUP_N.get() or mod.INVARIANT_GROUP_N
    mod.launch_invariant_gemm(x, weight, out, cfg, dot_fp32, bm, gn)
    return out


def invariant_linear_backend(x: torch.Tensor, weight: torch.Tensor, backend: str | None = None) -> str:
    """``"rows"`` (`invariant_linear_reference`) or ``"triton"`` (`invariant_linear_triton`) for one call.

    ``backend`` (default ``TRTLLM_GLM_INVARIANT_LINEAR_BACKEND``, else ``"auto"``): ``"torch"`` names the
    per-row reference, ``"triton"`` the kernel on any device (the CPU through Triton's interpreter: slow, for
    tests); ``"auto"`` the kernel for CUDA inference, the per-row reference otherwise (the CPU; a gradient).

    Raises:
        ValueError: an unknown backend name.
    """
    choice = kernel_backend(envs.INVARIANT_LINEAR_BACKEND, [x, weight], backend)
    covered = x.dtype in _DTYPES and weight.dtype in _DTYPES
    return "triton" if choice == "triton" and covered else "rows"


def invariant_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    out_dtype: torch.dtype | None = None,
    backend: str | None = None,
) -> torch.Tensor:
    """The batch-invariant ``F.linear``: ``x @ weight^T (+ bias)`` whose every row has the bits it would have alone
    (`invariant_linear_triton` on CUDA, `invariant_linear_reference` elsewhere; `invariant_linear_backend`).

    Args:
        x: ``[..., K]`` float.
        weight: ``[N, K]`` float on ``x``'s device.
        bias: optional ``[N]``, added to the fp32 product before the one rounding (none of the model's linears has
            one).
        out_dtype: the result's dtype (default ``x.dtype``).
        backend: ``"auto"`` / ``"torch"`` / ``"triton"`` (default ``TRTLLM_GLM_INVARIANT_LINEAR_BACKEND``).

    Returns:
        ``[..., N]`` in ``out_dtype``.
    """
    _check(x, weight)
    if invariant_linear_backend(x, weight, backend) == "rows":
        return invariant_linear_reference(x, weight, bias, out_dtype=out_dtype)
    x2 = x.reshape(-1, x.shape[-1])
    if bias is None:
        y = invariant_linear_triton(x2, weight, out_dtype=out_dtype)
    else:
        y = (invariant_linear_triton(x2, weight, out_dtype=torch.float32) + bias.float()).to(out_dtype or x.dtype)
    return y.view(*x.shape[:-1], weight.shape[0])


def model_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """What the model's float projections call: `invariant_linear` with the batch-invariant mode on
    (`trtllm_glm.numerics.batch_invariant`), ``F.linear`` otherwise."""
    if batch_invariant():
        return invariant_linear(x, weight, bias)
    return F.linear(x, weight, bias)


def invariant_bmm(
    x: torch.Tensor, weight: torch.Tensor, *, out_dtype: torch.dtype | None = None, backend: str | None = None
) -> torch.Tensor:
    """Per-batch ``y[m, b] = weight[b] @ x[m, b]`` (``torch.einsum("mbk,bnk->mbn", x, weight)``) with every row's
    bits independent of ``M``: the batched `invariant_linear` (the absorbed attention's per-head products,
    e.g. ``einsum("nhd,hdr->nhr", q, w_uk)`` is ``invariant_bmm(q, w_uk.transpose(1, 2))`` with the transposed
    weight made contiguous once by the caller).

    On CUDA one launch of `kernels.launch_invariant_gemm` (every batch with the launch shape of ``(N, K)``);
    elsewhere one row at a time through a batched matrix-vector product (`invariant_linear_backend` decides).

    Args:
        x: ``[M, B, K]`` fp32 / bf16 / fp16, any strides but a unit last one (else copied).
        weight: ``[B, N, K]`` on ``x``'s device, any strides but a unit last one (else it is copied on every
            call: keep a copy with a unit last stride).
        out_dtype: the result's dtype (default ``x.dtype``).
        backend: ``"auto"`` / ``"torch"`` / ``"triton"`` (default ``TRTLLM_GLM_INVARIANT_LINEAR_BACKEND``).

    Returns:
        ``[M, B, N]`` in ``out_dtype``.

    Raises:
        ValueError: shapes, dtypes or devices that do not match.
    """
    if x.dim() != 3 or weight.dim() != 3 or x.shape[1] != weight.shape[0] or x.shape[2] != weight.shape[2]:
        raise ValueError(
            f"invariant_bmm: x must be [M, B, K] and weight [B, N, K], got {tuple(x.shape)} and {tuple(weight.shape)}"
        )
    if x.device != weight.device:
        raise ValueError(f"invariant_bmm: x is on {x.device}, weight on {weight.device}")
    out_dtype = out_dtype or x.dtype
    m_rows, nb, k = x.shape
    n = weight.shape[1]
    if invariant_linear_backend(x, weight, backend) == "rows":
        w = weight.float()
        rows = [torch.einsum("bnk,bk->bn", w, r) for r in x.float()]
        y = torch.stack(rows) if rows else x.new_zeros(0, nb, n, dtype=torch.float32)
        return y.to(out_dtype)
    if x.dtype not in _DTYPES or weight.dtype not in _DTYPES or out_dtype not in _DTYPES:
        raise ValueError(f"invariant_bmm: dtypes must be fp32 / bf16 / fp16, got {x.dtype}, {weight.dtype}")
    out = torch.empty(m_rows, nb, n, dtype=out_dtype, device=x.device)
    if out.numel() == 0:
        return out
    if k == 0:
        return out.zero_()
    if x.stride(2) != 1:
        x = x.contiguous()
    if weight.stride(2) != 1:
        weight = weight.contiguous()
    mod = kernel_module(x.device)
    dot_fp32 = bool(mod.INTERPRETED) or x.dtype != weight.dtype or x.dtype == torch.float32
    cfg = mod.launch_config(n, k, weight.element_size(), dot_fp32)
    bm = invariant_block_m() or mod.INVARIANT_BLOCK_M
    gn = envs.INVARIANT_GROUP_N.get() or mod.INVARIANT_GROUP_N
    mod.launch_invariant_gemm(x, weight, out, cfg, dot_fp32, bm, gn)
    return out


def model_bmm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``torch.einsum("mbk,bnk->mbn", x, weight)`` normally; `invariant_bmm` in the batch-invariant mode."""
    if batch_invariant():
        return invariant_bmm(x, weight)
    return torch.einsum("mbk,bnk->mbn", x, weight)
