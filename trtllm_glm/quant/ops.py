"""The weight-only block-FP8 linear: the torch reference, the kernel op and the dispatcher.

`fp8_linear_reference` is the definition (dequantise to fp32, multiply in fp32, cast to the activations' dtype);
`fp8_linear_triton` computes it in one launch (`kernels`, e4m3 codes decoded in registers); `fp8_linear` picks as
`fp8_linear_backend` (``TRTLLM_GLM_FP8_LINEAR_BACKEND``) decides. CUDA tensors go to the compiled kernel, the CPU to
an interpreted copy (`trtllm_glm.triton_interp`); importing this module needs only torch. docs/fp8.md;
docs/kernels.md, "Block-FP8 linear".
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.nn.functional as F

from trtllm_glm import envs
from trtllm_glm.numerics import batch_invariant
from trtllm_glm.triton_interp import KernelPackage, kernel_backend

from .fp8 import block_scale_shape, dequantize_block_fp8

__all__ = [
    "DEQUANT_MIN_ROWS",
    "FP8_DEQUANT_ROWS_ENV",
    "FP8_LINEAR_BACKEND_ENV",
    "dequant_min_rows",
    "fp8_dequantize_triton",
    "fp8_linear",
    "fp8_linear_backend",
    "fp8_linear_invariant",
    "fp8_linear_reference",
    "fp8_linear_triton",
    "kernel_module",
]

FP8_LINEAR_BACKEND_ENV = envs.FP8_LINEAR_BACKEND.name
FP8_DEQUANT_ROWS_ENV = envs.FP8_DEQUANT_MIN_ROWS.name
# From this many rows on (prefill chunks), 16-bit CUDA calls dequantise the weight in one launch and run the GEMM on
# cuBLAS: a GEMM of many rows is compute-bound, where cuBLAS beats a Triton tile that decodes e4m3 in its loop, and
# the dequantisation (one byte read, two written per weight) is small beside it. H200
# (benchmarks/results/fp8/fp8_linear_h200_2026-12-03.log): at 256 rows dequant+cuBLAS wins on all 12 real shapes
# (e.g. mlp.gate|up 153 vs 258 us), at 64 rows the kernel wins on 10 of 12 (95 vs 142 us): the cut lies between.
DEQUANT_MIN_ROWS = 128
# Rows of one launch in the batch-invariant mode (`fp8_linear_invariant`): every launch takes the launch shape of
# this M (and at most this many rows), for any M.
INVARIANT_ROWS = 64

_ACT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_PACKAGE = KernelPackage(__package__ or "trtllm_glm.quant", [os.path.dirname(os.path.abspath(__file__))])


def kernel_module(device: torch.device | str) -> Any:
    """`kernels` built for ``device``: compiled on CUDA, an interpreted copy elsewhere."""
    return _PACKAGE.module("kernels", device)


def _check_weight(weight: torch.Tensor, scale_inv: torch.Tensor, block: int) -> None:
    if weight.dim() != 2 or weight.dtype != torch.float8_e4m3fn:
        raise ValueError(f"fp8_linear: weight must be 2-D float8_e4m3fn, got {tuple(weight.shape)} {weight.dtype}")
    want = block_scale_shape(weight.shape, block)
    if tuple(scale_inv.shape) != want or scale_inv.dtype != torch.float32:
        raise ValueError(
            f"fp8_linear: scale_inv must be {list(want)} float32 for weight {tuple(weight.shape)} with {block}x{block}"
            f" tiles, got {tuple(scale_inv.shape)} {scale_inv.dtype}"
        )
    if scale_inv.device != weight.device:
        raise ValueError(f"fp8_linear: weight on {weight.device}, scale_inv on {scale_inv.device}")


def _unit_last_strides(*ts: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``ts`` with a unit last stride each (a copy only where needed): what the kernels' row pointers assume."""
    return tuple(t if t.stride(-1) == 1 else t.contiguous() for t in ts)


def _check(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor, block: int) -> None:
    _check_weight(weight, scale_inv, block)
    if x.dim() < 1 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"fp8_linear: x must be [..., {weight.shape[1]}], got {tuple(x.shape)}")
    if not x.device == weight.device == scale_inv.device:
        raise ValueError(f"fp8_linear: x on {x.device}, weight on {weight.device}, scale_inv on {scale_inv.device}")


def fp8_linear_reference(
    x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor, block: int = 128
) -> torch.Tensor:
    """``x @ (weight * scale_inv)^T`` with the weight dequantised to fp32, in fp32, cast to ``x.dtype``.

    Args:
        x: ``[..., K]`` float.
        weight: ``[N, K]`` float8_e4m3fn.
        scale_inv: ``[ceil(N/block), ceil(K/block)]`` fp32.
        block: scale tile edge.

    Returns:
        ``[..., N]`` in ``x.dtype``.
    """
    _check(x, weight, scale_inv, block)
    return F.linear(x.float(), dequantize_block_fp8(weight, scale_inv, block)).to(x.dtype)


def kernel_covers(x: torch.Tensor, block: int) -> bool:
    """Whether `fp8_linear_triton` takes this call: rows present, a float activation dtype, and a scale block that
    a power-of-two K step of at least 16 divides."""
    rows = x.numel() // x.shape[-1] if x.dim() and x.shape[-1] else 0
    return rows >= 1 and x.dtype in _ACT_DTYPES and block % 16 == 0


def fp8_linear_backend(
    x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor, block: int = 128, backend: str | None = None
) -> str:
    """``"torch"`` or ``"triton"`` for one `fp8_linear` call (shapes, devices and flags only).

    ``backend`` (default ``TRTLLM_GLM_FP8_LINEAR_BACKEND``, else ``"auto"``): ``"torch"``, the reference;
    ``"triton"``, the kernel on any device (the CPU through Triton's interpreter); ``"auto"``, the kernel for CUDA
    inference, the reference otherwise (also when a gradient is wanted). A call the kernel does not cover
    (`kernel_covers`) takes the reference.

    Raises:
        ValueError: an unknown backend name.
        RuntimeError: ``"triton"`` forced while a gradient is needed.
    """
    choice = kernel_backend(envs.FP8_LINEAR_BACKEND, [x, scale_inv], backend)
    return "triton" if choice == "triton" and kernel_covers(x, block) else "torch"


def fp8_linear_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale_inv: torch.Tensor,
    block: int = 128,
    *,
    out: torch.Tensor | None = None,
    split_k: int | None = None,
    block_n: int | None = None,
    block_k: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    k_chunk: int | None = None,
    unroll: int | None = None,
    x_as_a: bool | None = None,
    pdl: bool | None = None,
    prefetch: int | None = None,
    stream_k: int | None = None,
    tuned: bool = True,
) -> torch.Tensor:
    """`fp8_linear_reference` in one Triton launch (`kernels`): e4m3 tiles decoded in registers, fp32 accumulation.

    Products are exact (an e4m3 value times a bf16 / fp16 activation on tensor cores, or fp32 FMAs for fp32
    activations), each ``block``-column step's partial sum is scaled by its fp32 tile scale, partials are summed
    in a fixed order (bitwise reproducible). Launch parameters depend on shapes only and nothing is read on the
    host: capturable in a CUDA graph after one eager call of the same shape (the split scratch is cached then).

    Args:
        x: ``[M, K]`` fp32 / bf16 / fp16 (a non-unit last stride is copied).
        weight: ``[N, K]`` float8_e4m3fn on ``x``'s device.
        scale_inv: ``[ceil(N/block), ceil(K/block)]`` fp32.
        block: scale tile edge (a multiple of 16).
        out: optional ``[M, N]`` result buffer in ``x.dtype`` with a unit last stride.
        split_k, block_n, block_k, num_warps, num_stages, k_chunk, unroll, x_as_a, pdl, prefetch, stream_k, tuned:
            tuning only (`kernels.launch_config`; decode launches take the tuned table's knobs for those not
            given; ``pdl``: programmatic dependent launch, which changes no bit of the result).

    Returns:
        ``[M, N]`` in ``x.dtype``.

    Raises:
        ValueError: wrong shapes, dtypes or devices, or a bad ``out``.
    """
    _check(x, weight, scale_inv, block)
    if x.dim() != 2:
        raise ValueError(f"fp8_linear_triton: x must be 2-D [M, K], got shape {tuple(x.shape)}")
    if x.dtype not in _ACT_DTYPES or block % 16:
        raise ValueError(
            f"fp8_linear_triton: x must be fp32 / bf16 / fp16 and block a multiple of 16, got {x.dtype}, {block}"
        )
    m_rows, k = x.shape
    n = weight.shape[0]
    if out is None:
        out = torch.empty(m_rows, n, dtype=x.dtype, device=x.device)
    elif out.shape != (m_rows, n) or out.dtype != x.dtype or out.device != x.device or out.stride(-1) != 1:
        raise ValueError(
            f"fp8_linear_triton: out must be [{m_rows}, {n}] {x.dtype} on {x.device} with a unit last stride, "
            f"got {tuple(out.shape)} {out.dtype} on {out.device} strides {out.stride()}"
        )
    if n == 0 or m_rows == 0:
        return out
    if k == 0:
        return out.zero_()
    x, weight, scale_inv = _unit_last_strides(x, weight, scale_inv)
    mod = kernel_module(x.device)
    dot_fp32 = bool(mod.INTERPRETED) or x.dtype == torch.float32
    cfg = mod.launch_config(
        m_rows, n, k, block, dot_fp32,
        split_k=split_k, block_n=block_n, block_k=block_k, num_warps=num_warps, num_stages=num_stages,
        k_chunk=k_chunk, unroll=unroll, x_as_a=x_as_a, pdl=pdl, prefetch=prefetch, stream_k=stream_k,
        tuned=tuned,
    )  # fmt: skip
    mod.launch_fp8_linear(x, weight.view(torch.uint8), scale_inv, out, block, cfg, dot_fp32)
    return out


def dequant_min_rows() -> int:
    """Rows from which a 16-bit CUDA `fp8_linear` dequantises and calls cuBLAS (``TRTLLM_GLM_FP8_DEQUANT_MIN_ROWS``,
    default `DEQUANT_MIN_ROWS`; read per call so that benchmarks can switch it)."""
    value = envs.FP8_DEQUANT_MIN_ROWS.get()
    return DEQUANT_MIN_ROWS if value is None else value


def fp8_dequantize_triton(
    weight: torch.Tensor, scale_inv: torch.Tensor, block: int = 128, dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """``weight * scale_inv`` per ``block`` tile in one launch: the fp32 product rounded once to ``dtype``
    (`dequantize_block_fp8` in fp32, then ``.to(dtype)``, bit for bit).

    Args:
        weight: ``[N, K]`` float8_e4m3fn.
        scale_inv: ``[ceil(N/block), ceil(K/block)]`` fp32.
        block: scale tile edge (a power of two >= 16).
        dtype: the result's dtype.

    Returns:
        ``[N, K]`` ``dtype`` on ``weight``'s device.
    """
    _check_weight(weight, scale_inv, block)
    if block < 16 or block & (block - 1):
        raise ValueError(f"fp8_dequantize_triton: block must be a power of two >= 16, got {block}")
    out = torch.empty(weight.shape, dtype=dtype, device=weight.device)
    if out.numel():
        w = weight if weight.stride(1) == 1 else weight.contiguous()
        s = scale_inv if scale_inv.stride(-1) == 1 else scale_inv.contiguous()
        kernel_module(weight.device).launch_fp8_dequant(w.view(torch.uint8), s, out, block)
    return out


def fp8_linear(
    x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor, block: int = 128, *, backend: str | None = None
) -> torch.Tensor:
    """``x @ (weight * scale_inv)^T`` in ``x.dtype``: `fp8_linear_triton` when `fp8_linear_backend` says
    ``"triton"``, else `fp8_linear_reference`; on CUDA, 16-bit calls of at least `dequant_min_rows` rows (prefill
    chunks) dequantise the weight (`fp8_dequantize_triton`, rounded once to ``x.dtype``) and run cuBLAS.

    Args:
        x: ``[..., K]`` float.
        weight: ``[N, K]`` float8_e4m3fn on ``x``'s device.
        scale_inv: ``[ceil(N/block), ceil(K/block)]`` fp32.
        block: scale tile edge.
        backend: ``"auto"`` / ``"torch"`` / ``"triton"`` (default ``TRTLLM_GLM_FP8_LINEAR_BACKEND``, else auto).

    With the batch-invariant mode on (`trtllm_glm.numerics`) and no ``backend`` given: `fp8_linear_invariant`.

    Returns:
        ``[..., N]`` in ``x.dtype``.
    """
    _check(x, weight, scale_inv, block)
    if batch_invariant() and backend is None:
        return fp8_linear_invariant(x, weight, scale_inv, block)
    if fp8_linear_backend(x, weight, scale_inv, block, backend) == "torch":
        return fp8_linear_reference(x, weight, scale_inv, block)
    x2 = x.reshape(-1, x.shape[-1])
    if x.is_cuda and x.dtype != torch.float32 and x2.shape[0] >= dequant_min_rows() and block & (block - 1) == 0:
        return F.linear(x, fp8_dequantize_triton(weight, scale_inv, block, x.dtype))
    y = fp8_linear_triton(x2, weight, scale_inv, block)
    return y.view(*x.shape[:-1], weight.shape[0])


def fp8_linear_invariant(
    x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor, block: int = 128, *, backend: str | None = None
) -> torch.Tensor:
    """`fp8_linear` in the batch-invariant mode: each row's bits independent of ``M`` and of the other rows.

    Kernel path (`fp8_linear_backend` says ``"triton"``): every launch takes the launch shape of
    ``M = INVARIANT_ROWS`` (`kernels.launch_config`: its row tile, split and K steps, from the weight's shape),
    on at most `INVARIANT_ROWS` rows at a time (consecutive row slices, no copy): the same tiles and reduction
    order for every row whatever the call's ``M`` (no cuBLAS path for prefill rows; a row never mixes with another
    in a tile's MMA columns). Reference path (the CPU): the weight dequantised in fp32 and one matrix-vector
    product per row (its order depends on the weight alone), cast to ``x.dtype``.

    Args:
        x: ``[..., K]`` float.
        weight: ``[N, K]`` float8_e4m3fn on ``x``'s device.
        scale_inv: ``[ceil(N/block), ceil(K/block)]`` fp32.
        block: scale tile edge.
        backend: as `fp8_linear`.

    Returns:
        ``[..., N]`` in ``x.dtype``.
    """
    _check(x, weight, scale_inv, block)
    n, k = weight.shape
    x2 = x.reshape(-1, k)
    m_rows = x2.shape[0]
    if fp8_linear_backend(x, weight, scale_inv, block, backend) == "torch":
        w = dequantize_block_fp8(weight, scale_inv, block)
        rows = [torch.mv(w, r) for r in x2.float()]
        y = torch.stack(rows) if rows else x2.new_zeros(0, n, dtype=torch.float32)
        return y.to(x.dtype).view(*x.shape[:-1], n)
    out = torch.empty(m_rows, n, dtype=x.dtype, device=x.device)
    if n == 0 or m_rows == 0:
        return out.view(*x.shape[:-1], n)
    if k == 0:
        return out.zero_().view(*x.shape[:-1], n)
    x2, weight, scale_inv = _unit_last_strides(x2, weight, scale_inv)
    mod = kernel_module(x.device)
    dot_fp32 = bool(mod.INTERPRETED) or x.dtype == torch.float32
    cfg = mod.launch_config(INVARIANT_ROWS, n, k, block, dot_fp32)
    codes = weight.view(torch.uint8)
    for r0 in range(0, m_rows, INVARIANT_ROWS):
        r1 = min(r0 + INVARIANT_ROWS, m_rows)
        mod.launch_fp8_linear(x2[r0:r1], codes, scale_inv, out[r0:r1], block, cfg, dot_fp32)
    return out.view(*x.shape[:-1], n)
