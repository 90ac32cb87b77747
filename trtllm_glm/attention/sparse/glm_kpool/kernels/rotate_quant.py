"""Triton kernel: the rotate-quantise chain (bf16, FWHT-128, bf16, pow2 scale, e4m3) on ``[M, 128]`` rows.

Used for the query head rows of the indexer; the pool writers call the same device helper.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import INDEX_DIM, rotate_quant_rows

__all__ = ["rotate_quant"]

_BLOCK_M = 16


@triton.jit
def _rotate_quant_kernel(x_ptr, q_ptr, s_ptr, M, stride_x, stride_q, BLOCK_M: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    d = tl.arange(0, 128)
    ok = rows < M
    r64 = rows.to(tl.int64)
    x = tl.load(x_ptr + r64[:, None] * stride_x + d[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
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
            x2, q.view(torch.uint8), scale, m, x2.stride(0), INDEX_DIM, BLOCK_M=_BLOCK_M, enable_fp_fusion=False
        )
    return q, scale
