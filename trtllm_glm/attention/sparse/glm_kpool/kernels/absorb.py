"""Triton kernel: the absorbed-MLA per-head products with one tile shape for every row count (`head_matmul`).

The sparse-MLA layer multiplies every row's per-head vectors by a per-head matrix twice: ``q_abs[n, h] =
q[n, h] @ W_uk[h]`` before the attention and ``o[n, h] = o_lat[n, h] @ W_uv[h]^T`` after it. ``torch.einsum``
runs them as batched GEMMs whose algorithm (tiles, split-K) cuBLAS picks from the number of rows, so a row
rounds differently alone, in a batch, or as a verify row. In the batch-invariant mode
(`trtllm_glm.numerics.batch_invariant`) the layer runs this kernel instead.

``_head_matmul_kernel``, grid ``(H, cdiv(N, BM), cdiv(J, BN))``: a program computes a ``[BM, BN]`` output tile of
one head, looping over ``Kd`` in ``BK`` steps in order, with fp32 accumulation on the tensor cores (bf16 / fp16
inputs) or IEEE fp32 dots (fp32 inputs, the interpreter). An output element is the same sequence of MMA
instructions over the same ``k`` order whatever the other rows of its tile hold (rows past ``N`` are zeros), so
a row's result does not depend on ``N`` or on its position. Any strides; no host sync: graph-capturable.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import INTERPRETED

__all__ = ["head_matmul"]

# Decode / verify sizes (N <= 64 rows, Kd and J of 256 / 512): 16-row tiles waste little on one row and keep the
# grid at H * (J / 128) programs; BK = 64 feeds the MMA with 16-byte loads.
_BM, _BN, _BK = 16, 128, 64


@triton.jit
def _head_matmul_kernel(
    a_ptr,
    b_ptr,
    c_ptr,
    N,
    Kd,
    J,
    sa_n,
    sa_h,
    sa_k,
    sb_h,
    sb_k,
    sb_j,
    sc_n,
    sc_h,
    sc_j,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    FP32: tl.constexpr,
):
    h = tl.program_id(0).to(tl.int64)
    rm = tl.program_id(1) * BM + tl.arange(0, BM)
    rj = tl.program_id(2) * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    m_ok = rm < N
    j_ok = rj < J
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in range(0, Kd, BK):
        k = k0 + rk
        k_ok = k < Kd
        a = tl.load(
            a_ptr + rm[:, None].to(tl.int64) * sa_n + h * sa_h + k[None, :] * sa_k,
            mask=m_ok[:, None] & k_ok[None, :],
            other=0.0,
        )
        b = tl.load(
            b_ptr + h * sb_h + k[:, None] * sb_k + rj[None, :] * sb_j, mask=k_ok[:, None] & j_ok[None, :], other=0.0
        )
        if FP32:
            acc += tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
    tl.store(
        c_ptr + rm[:, None].to(tl.int64) * sc_n + h * sc_h + rj[None, :] * sc_j,
        acc.to(c_ptr.dtype.element_ty),
        mask=m_ok[:, None] & j_ok[None, :],
    )


def head_matmul(a: torch.Tensor, b: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """``einsum("nhk,hkj->nhj", a, b)`` with a launch shape independent of ``N`` (see the module docstring).

    Args:
        a: ``[N, H, Kd]`` rows (any strides).
        b: ``[H, Kd, J]`` per-head matrices (any strides: ``W_uv[h]^T`` is a transposed view), ``a``'s dtype.
        out: optional ``[N, H, J]`` buffer of ``a``'s dtype.

    Returns:
        ``[N, H, J]`` in ``a``'s dtype (fp32 accumulation, one rounding at the end).

    Raises:
        ValueError: shapes or dtypes disagree.
    """
    if a.dim() != 3 or b.dim() != 3 or a.shape[1] != b.shape[0] or a.shape[2] != b.shape[1]:
        raise ValueError(f"head_matmul: a {tuple(a.shape)} and b {tuple(b.shape)} are not [N, H, K] and [H, K, J]")
    if a.dtype != b.dtype:
        raise ValueError(f"head_matmul: a is {a.dtype} but b is {b.dtype}")
    N, H, Kd = a.shape
    J = b.shape[2]
    if out is None:
        out = torch.empty(N, H, J, dtype=a.dtype, device=a.device)
    elif tuple(out.shape) != (N, H, J) or out.dtype != a.dtype:
        raise ValueError(f"head_matmul: out must be [{N}, {H}, {J}] {a.dtype}, got {tuple(out.shape)} {out.dtype}")
    if N == 0 or H == 0 or J == 0:
        return out
    # The interpreter rounds fp32 -> bf16 stores incorrectly: write fp32 there and cast with torch.
    dst = out
    if INTERPRETED and out.dtype != torch.float32:
        dst = torch.empty(out.shape, dtype=torch.float32, device=out.device)
    fp32 = INTERPRETED or a.dtype == torch.float32
    _head_matmul_kernel[(H, triton.cdiv(N, _BM), triton.cdiv(J, _BN))](
        a, b, dst, N, Kd, J, *a.stride(), *b.stride(), *dst.stride(),
        BM=_BM, BN=_BN, BK=_BK, FP32=fp32, num_warps=4,
    )  # fmt: skip
    if dst is not out:
        out.copy_(dst)
    return out
