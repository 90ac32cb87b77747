"""Triton kernels: the rotate-quantise chain (bf16, FWHT-128, bf16, pow2 scale, e4m3) on ``[M, 128]`` rows.

`rotate_quant` serves the query head rows of the indexer; the pool writers call the same device helper.
`fwht`, `round_to_e4m3` and `pow2_scale` expose the helpers of the chain on their own, so that the
butterfly order (visible in fp32 before any bf16 rounding hides it) and the rounding edge cases (ties,
subnormals, saturation, signed zeros, exact powers of two) can be tested directly.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import INDEX_DIM, e4m3_codes, fwht128, rotate_quant_rows
from ._common import pow2_scale as _pow2_scale

__all__ = ["rotate_quant", "round_to_e4m3", "pow2_scale", "fwht"]

_BLOCK_M = 16


@triton.jit
def _rotate_quant_kernel(x_ptr, q_ptr, s_ptr, M, stride_x, stride_q, BLOCK_M: tl.constexpr, FWHT_ONLY: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    d = tl.arange(0, 128)
    ok = rows < M
    r64 = rows.to(tl.int64)
    x = tl.load(x_ptr + r64[:, None] * stride_x + d[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
    if FWHT_ONLY:
        tl.store(q_ptr + r64[:, None] * stride_q + d[None, :], fwht128(x, BLOCK_M), mask=ok[:, None])
    else:
        codes, scale = rotate_quant_rows(x, BLOCK_M)
        tl.store(q_ptr + r64[:, None] * stride_q + d[None, :], codes.to(tl.uint8), mask=ok[:, None])
        tl.store(s_ptr + rows, scale, mask=ok)


def rotate_quant(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate and quantise ``[..., 128]`` rows exactly as `ops.rotate_quant`.

    Args:
        x: ``[..., 128]`` float tensor (any float dtype; computed in fp32).

    Returns:
        ``(q, scale)``: ``q`` ``[..., 128]`` ``torch.float8_e4m3fn``, ``scale`` ``[...]`` fp32.
    """
    if x.shape[-1] != INDEX_DIM:
        raise ValueError(f"rotate_quant expects a last dimension of {INDEX_DIM}, got shape {tuple(x.shape)}")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, INDEX_DIM)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    q = torch.empty(*lead, INDEX_DIM, dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty(lead, dtype=torch.float32, device=x.device)
    if m:
        grid = (triton.cdiv(m, _BLOCK_M),)
        _rotate_quant_kernel[grid](
            x2, q.view(torch.uint8), scale, m, x2.stride(0), INDEX_DIM, BLOCK_M=_BLOCK_M, FWHT_ONLY=False
        )
    return q, scale


def fwht(x: torch.Tensor) -> torch.Tensor:
    """Kernel version of `ops.fwht` for ``n = 128`` (same butterfly order, bit-identical fp32 result).

    Args:
        x: ``[..., 128]`` float tensor.

    Returns:
        ``[..., 128]`` fp32 normalised transform.
    """
    if x.shape[-1] != INDEX_DIM:
        raise ValueError(f"the kernel FWHT is {INDEX_DIM} wide, got shape {tuple(x.shape)}")
    x2 = x.reshape(-1, INDEX_DIM)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    if x2.shape[0]:
        grid = (triton.cdiv(x2.shape[0], _BLOCK_M),)
        _rotate_quant_kernel[grid](x2, out, out, x2.shape[0], x2.stride(0), INDEX_DIM, BLOCK_M=_BLOCK_M, FWHT_ONLY=True)
    return out


@triton.jit
def _elementwise_kernel(x_ptr, out_ptr, M, WHICH: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = i < M
    x = tl.load(x_ptr + i, mask=ok, other=0.0).to(tl.float32)
    if WHICH == 0:
        # Decode the code arithmetically (no fp8 cast): sign, then exponent/mantissa or the subnormal step.
        c = e4m3_codes(x)
        e = (c >> 3) & 15
        mant = c & 7
        mag_n = (((e + 120) << 23) | (mant << 20)).to(tl.float32, bitcast=True)
        mag = tl.where(e == 0, mant.to(tl.float32) * 0.001953125, mag_n)
        # The sign goes in as a bit: "-mag" would be 0 - mag, which turns -0.0 into +0.0.
        y = (mag.to(tl.int32, bitcast=True) | ((c & 0x80) << 24)).to(tl.float32, bitcast=True)
    else:
        y, _ = _pow2_scale(x)
    tl.store(out_ptr + i, y, mask=ok)


def _elementwise(x: torch.Tensor, which: int) -> torch.Tensor:
    xf = x.reshape(-1)
    if not xf.is_contiguous():
        xf = xf.contiguous()
    out = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    if xf.numel():
        block = 1024
        _elementwise_kernel[(triton.cdiv(xf.numel(), block),)](xf, out, xf.numel(), WHICH=which, BLOCK=block)
    return out


def round_to_e4m3(x: torch.Tensor) -> torch.Tensor:
    """Kernel version of `ops.round_to_e4m3`: nearest e4m3fn value, ties to even, saturating at +-448.

    Args:
        x: any-shape float tensor.

    Returns:
        fp32 tensor of ``x``'s shape (NaN inputs are not supported).
    """
    return _elementwise(x, 0)


def pow2_scale(amax: torch.Tensor) -> torch.Tensor:
    """Kernel version of `ops.pow2_scale`: ``2 ** ceil(log2(max(amax, 1e-4) / 448))``, exactly.

    Args:
        amax: any-shape non-negative float tensor.

    Returns:
        fp32 tensor of ``amax``'s shape.
    """
    return _elementwise(amax, 1)
