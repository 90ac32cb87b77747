"""Normalised fast Walsh-Hadamard transform (torch reference).

The indexer rotates pooled keys and query rows by ``H / sqrt(128)`` before FP8 so that outliers spread
over all channels. ``H`` is the Sylvester Hadamard matrix, ``H[i, j] = (-1) ** popcount(i & j)``, which is
symmetric, so ``x @ H == H @ x`` for a vector and the transform is its own inverse once normalised.
"""

from __future__ import annotations

import math

import torch

__all__ = ["hadamard_matrix", "fwht"]


def _check_pow2(n: int) -> None:
    if n <= 0 or n & (n - 1):
        raise ValueError(f"Walsh-Hadamard size must be a positive power of two, got {n}")


def hadamard_matrix(
    n: int, dtype: torch.dtype = torch.float32, device: torch.device | str | None = None
) -> torch.Tensor:
    """Sylvester Hadamard matrix with entries +-1 (not normalised).

    Args:
        n: size, a positive power of two.
        dtype: output dtype.
        device: output device.

    Returns:
        ``[n, n]`` tensor with ``H[i, j] = (-1) ** popcount(i & j)``; ``H @ H.T == n * I``.
    """
    _check_pow2(n)
    idx = torch.arange(n, device=device)
    bits = torch.bitwise_and(idx[:, None], idx[None, :])
    # Parity of popcount(i & j): indices have log2(n) bits, so fold exactly that many.
    parity = torch.zeros_like(bits)
    for shift in range(max(n.bit_length() - 1, 0)):
        parity ^= (bits >> shift) & 1
    return (1 - 2 * parity).to(dtype)


def fwht(x: torch.Tensor) -> torch.Tensor:
    """Normalised fast Walsh-Hadamard transform along the last dimension, computed in fp32.

    Mathematically ``x @ hadamard_matrix(n) / sqrt(n)``. The rounding is fixed by this exact order, which
    kernels must mirror to agree bit for bit:

    1. Stages ``h = 1, 2, 4, ..., n/2`` in that order. In stage ``h`` every index ``i`` with bit ``h``
       clear is paired with ``j = i + h`` and ``(x[i], x[j]) <- (x[i] + x[j], x[i] - x[j])``, each an fp32
       add/sub (correctly rounded, so the within-stage order does not matter).
    2. After the last stage, one fp32 multiply of every element by the fp32 constant
       ``float32(1 / sqrt(n))`` (for ``n = 128``: ``0x3DB504F3`` = 0.08838834...).

    Args:
        x: ``[..., n]`` tensor, ``n`` a power of two; any float dtype (computed and returned as fp32).

    Returns:
        ``[..., n]`` fp32 transform of ``x``.
    """
    n = x.shape[-1]
    _check_pow2(n)
    lead = x.shape[:-1]
    y = x.to(torch.float32).reshape(-1, n)
    h = 1
    while h < n:
        # View index i as (block, bit h of i, low bits): the pair (i, i + h) differ only in the middle axis.
        pairs = y.view(-1, n // (2 * h), 2, h)
        a, b = pairs[:, :, 0, :], pairs[:, :, 1, :]
        y = torch.stack((a + b, a - b), dim=2).reshape(-1, n)
        h *= 2
    # The fp32-rounded 1/sqrt(n) as a Python scalar: applied in fp32 (same bits as an fp32 tensor constant)
    # without a host-to-device copy, so the op can be captured in a CUDA graph.
    norm = float(torch.tensor(1.0 / math.sqrt(n), dtype=torch.float32))
    return (y * norm).reshape(*lead, n)
