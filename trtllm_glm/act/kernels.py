"""One Triton kernel for the clamped SwiGLU after a fused gate|up GEMM (`trtllm_glm.act.swiglu`).

Bit for bit the torch reference on CUDA (same operations, precisions and roundings: libdevice ``expf``,
``div_rn``); to an ulp under the interpreter. Why each step matches: docs/kernels.md, "Clamped SwiGLU".
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

# Absolute: the interpreted copy of this module lives in an alias package without the package's own names.
from trtllm_glm.act import check_gate_up
from trtllm_glm.pdl import late_trigger, launch_kwargs, pdl_enter, pdl_leave, use_pdl

__all__ = ["INTERPRETED", "swiglu"]

# Fixed when this module is imported: `KernelPackage` imports an interpreted copy for CPU tensors, and the
# interpreter cannot call libdevice.
INTERPRETED: bool = bool(triton.knobs.runtime.interpret)

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@triton.jit
def _silu(x, PRECISE_EXP: tl.constexpr):
    # torch's CUDA silu for fp32 / bf16 / fp16: `x / (1 + expf(-x))` in fp32, correctly rounded division.
    if PRECISE_EXP:
        e = libdevice.exp(-x)
    else:
        e = tl.exp(-x)
    return tl.math.div_rn(x, 1.0 + e)


@triton.jit
def _swiglu_kernel(
    gu_ptr,
    out_ptr,
    I,
    stride_gu,
    stride_out,
    limit,
    HAS_LIMIT: tl.constexpr,
    PRECISE_EXP: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
    PDL_LATE: tl.constexpr,
):
    # With PDL (`trtllm_glm.pdl`) the down projection after this launches now (or at the end: ``PDL_LATE``) and
    # starts streaming its weight.
    pdl_enter(PDL, PDL_LATE)
    # int64 row offsets: N * 2I exceeds 2**31 elements for long prefills of the 12288-wide dense MLP.
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = cols < I
    src = gu_ptr + row * stride_gu
    g = tl.load(src + cols, mask=m, other=0.0).to(tl.float32)
    u = tl.load(src + I + cols, mask=m, other=0.0).to(tl.float32)
    if HAS_LIMIT:
        # `where` on `>` / `<` keeps NaN (every comparison with it is false), as torch's clamp does.
        g = tl.where(g > limit, limit, g)
        u = tl.where(u < -limit, -limit, u)
        u = tl.where(u > limit, limit, u)
    # Round silu to the input dtype as torch's silu kernel does before the multiplication.
    s = _silu(g, PRECISE_EXP).to(gu_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, (s * u).to(out_ptr.dtype.element_ty), mask=m)
    pdl_leave(PDL, PDL_LATE)


@functools.lru_cache(maxsize=64)
def _limit_in(limit: float, dtype: torch.dtype) -> float:
    """``limit`` rounded to fp32, then to ``dtype`` (torch's conversions of a clamp's scalar bound), as a float."""
    return float(torch.tensor(float(limit), dtype=torch.float32).to(dtype).float().item())


def swiglu(
    gate_up: torch.Tensor,
    limit: float | None,
    *,
    out: torch.Tensor | None = None,
    block: int | None = None,
    num_warps: int = 4,
) -> torch.Tensor:
    """``silu(min(gate, L)) * clamp(up, -L, L)`` over the halves of ``gate_up``, one launch.

    Graph safe: the launch depends on shapes and strides only (no host sync); nothing is allocated but the
    result, and not even that when ``out`` is given.

    Args:
        gate_up: ``[N, 2I]`` fp32 / fp16 / bf16, gate columns ``[:, :I]`` then up ``[:, I:]``; any row stride,
            columns contiguous.
        limit: the clamp ``L`` (``None``: plain SwiGLU).
        out: optional preallocated ``[N, I]`` result (same dtype and device; any row stride, columns
            contiguous).
        block: columns per program (a power of two; default ``min(1024, next_pow2(I))``).
        num_warps: warps per program.

    Returns:
        ``[N, I]`` in ``gate_up``'s dtype (``out`` when given).

    Raises:
        ValueError: bad shapes (`trtllm_glm.act.check_gate_up`), an unsupported dtype, or non-contiguous columns.
    """
    inter = check_gate_up(gate_up, out)
    if gate_up.dtype not in _DTYPES:
        raise ValueError(f"swiglu: dtype must be one of {_DTYPES}, got {gate_up.dtype}")
    if out is None:
        out = torch.empty(gate_up.shape[0], inter, dtype=gate_up.dtype, device=gate_up.device)
    if out.numel() == 0:
        return out
    for name, t in (("gate_up", gate_up), ("out", out)):
        if t.stride(1) != 1:
            raise ValueError(f"swiglu: {name}'s columns must be contiguous, got strides {t.stride()}")
    blk = block or min(1024, triton.next_power_of_2(inter))
    lim = 0.0 if limit is None else _limit_in(limit, gate_up.dtype)
    grid = (gate_up.shape[0], triton.cdiv(inter, blk))
    pdl = use_pdl(gate_up.device)
    _swiglu_kernel[grid](
        gate_up, out, inter, gate_up.stride(0), out.stride(0), lim,
        HAS_LIMIT=limit is not None, PRECISE_EXP=not INTERPRETED, BLOCK=blk, PDL=pdl,
        PDL_LATE=late_trigger(pdl), num_warps=num_warps, **launch_kwargs(pdl),
    )  # fmt: skip
    return out
