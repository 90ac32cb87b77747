"""Block-FP8 tiles (DeepSeek-V3 convention): quantise a weight to ``float8_e4m3fn`` with one fp32 scale per
``block x block`` tile, and undo it.

A weight ``W [O, I]`` is held as ``fp8 [O, I]`` (float8_e4m3fn) and ``scale_inv [ceil(O/block), ceil(I/block)]``
(fp32) with ``W ~= fp8.float() * scale_inv`` over each tile (ragged last tiles cut). This module needs only torch,
so layers, kernels and the checkpoint loader can all import it.
"""

from __future__ import annotations

import math

import torch

__all__ = ["FP8_MAX", "block_scale_shape", "dequantize_block_fp8", "expand_blocks", "quantize_block_fp8"]

FP8_MAX = 448.0
"""Largest finite float8_e4m3fn magnitude; a block's scale maps its absmax onto it."""


def _check_2d(name: str, t: torch.Tensor) -> None:
    if t.dim() != 2:
        raise ValueError(f"{name}: block FP8 needs a 2-D tensor, got shape {tuple(t.shape)}")


def block_scale_shape(shape: tuple[int, int] | torch.Size, block: int = 128) -> tuple[int, int]:
    """``(ceil(O/block), ceil(I/block))``: the scale grid of an ``[O, I]`` weight."""
    rows, cols = shape
    return math.ceil(rows / block), math.ceil(cols / block)


def expand_blocks(scale: torch.Tensor, shape: tuple[int, int] | torch.Size, block: int) -> torch.Tensor:
    """``[ceil(O/b), ceil(I/b)]`` -> ``[O, I]``, each scale repeated over its block (ragged edges cut)."""
    rows, cols = shape
    return scale.repeat_interleave(block, dim=0)[:rows].repeat_interleave(block, dim=1)[:, :cols]


def quantize_block_fp8(w: torch.Tensor, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise a weight to float8_e4m3fn with one fp32 scale per ``block x block`` tile.

    Each tile's scale is ``amax / 448`` so its largest entry lands on the top of the e4m3 range; an
    all-zero tile gets scale 1 (any scale reproduces zeros, and 1 keeps the scale finite).

    Args:
        w: ``[O, I]`` floating weight.
        block: tile edge.

    Returns:
        ``(fp8 [O, I] float8_e4m3fn, scale_inv [ceil(O/block), ceil(I/block)] fp32)`` with
        ``w ~= fp8.float() * scale_inv`` per tile.
    """
    _check_2d("w", w)
    rows, cols = w.shape
    rb, cb = block_scale_shape((rows, cols), block)
    wf = w.float()
    # Zero padding never raises a tile's absmax, so ragged tiles get the scale of their real entries.
    padded = torch.zeros(rb * block, cb * block, dtype=torch.float32, device=w.device)
    padded[:rows, :cols] = wf
    amax = padded.reshape(rb, block, cb, block).abs().amax(dim=(1, 3))
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (wf / expand_blocks(scale, (rows, cols), block)).clamp(-FP8_MAX, FP8_MAX)
    return q.to(torch.float8_e4m3fn), scale


def dequantize_block_fp8(fp8: torch.Tensor, scale_inv: torch.Tensor, block: int = 128) -> torch.Tensor:
    """Undo `quantize_block_fp8`: ``fp8.float() * scale_inv`` broadcast over ``block x block`` tiles.

    Args:
        fp8: ``[O, I]`` (any dtype; float8_e4m3fn in checkpoints).
        scale_inv: ``[ceil(O/block), ceil(I/block)]``.
        block: tile edge.

    Returns:
        ``[O, I]`` fp32 on ``fp8``'s device.

    Raises:
        ValueError: ``fp8`` not 2-D, or ``scale_inv`` not of the tile grid's shape.
    """
    _check_2d("fp8", fp8)
    rows, cols = fp8.shape
    want = block_scale_shape((rows, cols), block)
    if tuple(scale_inv.shape) != want:
        raise ValueError(
            f"scale_inv shape {tuple(scale_inv.shape)} does not match weight {tuple(fp8.shape)} "
            f"with {block}x{block} blocks (expected {want})"
        )
    scale = scale_inv.to(device=fp8.device, dtype=torch.float32)
    return fp8.float() * expand_blocks(scale, (rows, cols), block)
