"""FP8 e4m3 numerics of the indexer (grid rounding, power-of-two scales, the rotate-quantise chain) and of the FP8
latent cache (`quant_latent`, `dequant_latent`: block-scaled rows, ``latent_dtype="fp8"``).

Everything here is plain fp32 arithmetic (exponent extraction, power-of-two multiplies, round-half-to-even)
so that a Triton kernel can mirror it without relying on fp8 casts, which Triton's interpreter gets wrong.
"""

from __future__ import annotations

import torch

from trtllm_glm.attention.sparse.glm_kpool.cache_layout import LATENT_SCALE_BLOCK, latent_scale_blocks

from .fwht import fwht

__all__ = [
    "E4M3_MAX",
    "AMAX_FLOOR",
    "round_to_e4m3",
    "pow2_scale",
    "rotate_quant",
    "dequant",
    "quant_latent",
    "dequant_latent",
]

E4M3_MAX = 448.0
"""Largest finite float8_e4m3fn value."""

AMAX_FLOOR = 1e-4
"""Lower bound on the absmax before the scale is derived, so all-zero vectors get a finite scale."""

_INDEX_DIM = 128
# e4m3fn: 3 mantissa bits; normal exponents -6 .. 8; below 2**-6 the grid step stays 2**-9 (subnormals).
_E4M3_MANT_BITS = 3
_E4M3_MIN_EXP = -6
_E4M3_MAX_EXP = 8


def _exp2i(e: torch.Tensor) -> torch.Tensor:
    """Exact ``2.0 ** e`` in fp32 for integer ``e`` in ``[-126, 127]``, built from the exponent bits."""
    return ((e.to(torch.int32) + 127) << 23).view(torch.float32)


def _bf16(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.bfloat16).to(torch.float32)


def round_to_e4m3(x: torch.Tensor) -> torch.Tensor:
    """Round fp32 values to the nearest float8_e4m3fn grid value, ties to even, saturating at +-448.

    Equals ``x.to(torch.float8_e4m3fn).float()`` (including subnormals, signed zeros, and torch's
    saturation of large finite values and infinities to +-448); NaN stays NaN. Steps:

    1. ``e = clamp(floor(log2|x|), -6, 8)``. ``floor(log2|x|)`` is ``frexp(x).exponent - 1``, which for a
       normal fp32 equals its biased exponent field minus 127. fp32 subnormals and zero land below -6 and
       are clamped, so they use the subnormal step like every other value below ``2**-6``.
    2. ``quantum = 2**(e - 3)`` (exact, built from exponent bits), ``v = x / quantum`` (exact: a
       power-of-two divide into the normal range).
    3. ``r = rint(v) * quantum`` with round-half-to-even ``rint`` (``torch.round``; in a kernel
       ``libdevice.rint`` or ``(|v| + 2**23) - 2**23`` with the sign restored), then clamp to +-448.

    Args:
        x: any-shape float tensor (computed as fp32).

    Returns:
        fp32 tensor of ``x``'s shape holding e4m3-representable values.
    """
    x = x.to(torch.float32)
    _, exponent = torch.frexp(x)
    e = torch.clamp(exponent - 1, min=_E4M3_MIN_EXP, max=_E4M3_MAX_EXP)
    quantum = _exp2i(e - _E4M3_MANT_BITS)
    r = torch.round(x / quantum) * quantum
    return torch.clamp(r, min=-E4M3_MAX, max=E4M3_MAX)


def pow2_scale(amax: torch.Tensor) -> torch.Tensor:
    """Power-of-two scale ``2 ** ceil(log2(max(amax, 1e-4) / 448))`` in fp32, exactly.

    ``r = max(amax, 1e-4) / 448`` is one fp32 divide; ``ceil(log2 r)`` is read from ``frexp(r)`` (``r =
    m * 2**k`` with ``0.5 <= m < 1``: the answer is ``k - 1`` when ``m == 0.5``, i.e. ``r`` is a power of
    two, else ``k``), so there is no ``log2`` rounding error. In bits (``r`` is a normal fp32): the biased
    exponent field minus 127, plus 1 when the mantissa field is non-zero.

    The divide cannot round ``r`` down onto a power of two from above: ``448 = 7 * 2**6`` and the smallest
    fp32 above ``448 * 2**k`` is ``448 * 2**k * (1 + 2**-21 / 7)``, whose quotient lies more than half an
    fp32 ulp above ``2**k``. Hence ``amax / scale <= 448`` always holds, and an exact ``amax = 448 * 2**k``
    gives exactly ``2**k``.

    Args:
        amax: ``[...]`` non-negative absmax values (computed as fp32).

    Returns:
        ``[...]`` fp32 powers of two (``2**-22`` for anything at or below the 1e-4 floor). A NaN or
        infinite ``amax`` gives a NaN or infinite scale.
    """
    r = torch.clamp(amax.to(torch.float32), min=AMAX_FLOOR) / E4M3_MAX
    mant, exponent = torch.frexp(r)
    k = torch.where(mant == 0.5, exponent - 1, exponent)
    # For finite r, k lies in [-22, 120], inside _exp2i's range; non-finite r is passed through.
    k = torch.where(torch.isfinite(r), k, torch.zeros_like(k))
    return torch.where(torch.isfinite(r), _exp2i(k), r)


def rotate_quant(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The indexer's rotate-then-quantise chain for pooled keys and query head rows.

    ``y = bf16(x)``; ``y = bf16(fwht(y))`` (normalised transform, see `fwht` for its rounding order);
    ``scale = pow2_scale(amax(|y|))``; ``q = e4m3(y / scale)``. Dividing by a power of two is exact and
    ``|y / scale| <= 448``, so the e4m3 rounding never saturates.

    Args:
        x: ``[..., 128]`` float tensor (computed as fp32).

    Returns:
        ``(q, scale)``: ``q`` ``[..., 128]`` ``torch.float8_e4m3fn``, ``scale`` ``[...]`` fp32.
    """
    if x.shape[-1] != _INDEX_DIM:
        raise ValueError(f"rotate_quant expects a last dimension of {_INDEX_DIM}, got shape {tuple(x.shape)}")
    y = _bf16(x.to(torch.float32))
    y = _bf16(fwht(y))
    scale = pow2_scale(y.abs().amax(dim=-1))
    q = round_to_e4m3(y / scale.unsqueeze(-1))
    # q holds exact e4m3 grid values, so this cast is lossless.
    return q.to(torch.float8_e4m3fn), scale


def dequant(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Dequantise ``q * scale``.

    Args:
        q: ``[..., D]`` ``torch.float8_e4m3fn`` (or any float) values.
        scale: ``[...]`` fp32 scale per vector.

    Returns:
        ``[..., D]`` fp32.
    """
    return q.to(torch.float32) * scale.to(torch.float32).unsqueeze(-1)


def _latent_blocks(x: torch.Tensor) -> torch.Tensor:
    """``[..., R]`` -> ``[..., NB, 128]`` (zero-padded to whole 128-column blocks; a zero never raises an amax)."""
    r = x.shape[-1]
    nb = latent_scale_blocks(r)
    pad = nb * LATENT_SCALE_BLOCK - r
    if pad:
        x = torch.nn.functional.pad(x, (0, pad))
    return x.reshape(*x.shape[:-1], nb, LATENT_SCALE_BLOCK)


def quant_latent(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise latent rows to the FP8 cache format: per 128-column block ``b`` of each row, ``scale_b =
    pow2_scale(amax_b)`` and ``q = e4m3(x / scale_b)``.

    A power-of-two scale makes ``x / scale`` exact (the only rounding is the e4m3 one, never saturating since
    ``amax / scale <= 448``) and ``q * scale`` exact in bf16 as well as fp32, so a kernel that dequantises into
    bf16 for the tensor cores sees the reference's values. An all-zero block gets the floor's finite scale
    (``2**-22``) and zero codes.

    Args:
        rows: ``[..., R]`` float latent rows (computed as fp32; ``R`` need not be a multiple of 128).

    Returns:
        ``(q [..., R] torch.float8_e4m3fn, scale [..., ceil(R / 128)] fp32)``.
    """
    x = rows.to(torch.float32)
    blocks = _latent_blocks(x)
    scale = pow2_scale(blocks.abs().amax(dim=-1))
    q = round_to_e4m3(blocks / scale.unsqueeze(-1)).reshape(*x.shape[:-1], -1)[..., : x.shape[-1]]
    # q holds exact e4m3 grid values, so this cast is lossless.
    return q.to(torch.float8_e4m3fn), scale


def dequant_latent(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Dequantise FP8 latent rows: ``q * scale`` of each row's 128-column block.

    Args:
        q: ``[..., R]`` ``torch.float8_e4m3fn`` codes.
        scale: ``[..., ceil(R / 128)]`` fp32 block scales.

    Returns:
        ``[..., R]`` fp32.
    """
    r = q.shape[-1]
    blocks = _latent_blocks(q.to(torch.float32))
    return (blocks * scale.to(torch.float32).unsqueeze(-1)).reshape(*q.shape[:-1], -1)[..., :r]
