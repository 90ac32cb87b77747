"""The k-pool backend's cache layout: the paged planes of one sparse layer (`kpool_paged_planes`, what the cache
manager allocates) and `KpoolLayerCache`, the views one layer reads (docs/architecture.md, "Cache layout")."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ....config import INDEX_HEAD_DIM, INDEX_KPOOL, Glm5NextConfig
from ...interface import PagedPlane

__all__ = [
    "KPOOL_PLANE_NAMES",
    "KpoolLayerCache",
    "LATENT_SCALE_BLOCK",
    "kpool_paged_planes",
    "latent_scale_blocks",
]

KPOOL_PLANE_NAMES = ("latent", "index_k", "index_scale", "latent_scale")

LATENT_SCALE_BLOCK = 128
"""Latent columns that share one scale in the FP8 latent format (``latent_dtype="fp8"``): DeepSeek-V3.2 /
FlashMLA's 128-column tiles, so that one outlier column costs precision in its block only."""


def latent_scale_blocks(kv_lora_rank: int) -> int:
    """Scales per FP8 latent row: one per `LATENT_SCALE_BLOCK` columns (a last, narrower block included)."""
    return -(-kv_lora_rank // LATENT_SCALE_BLOCK)


def check_latent_planes(
    latent_cache: torch.Tensor, latent_scale: torch.Tensor | None, page_size: int | None = None
) -> bool:
    """Check a latent plane ``[num_pages, P, R]`` and its scale plane agree on the format (``latent_dtype``);
    returns whether the rows are FP8. Every writer and reader of the plane (torch ops and kernels) calls this.

    Raises:
        ValueError: a plane not ``[num_pages, page_size, R]`` (when ``page_size`` is given), an FP8 plane without
            contiguous ``[num_pages, P, ceil(R / 128)]`` fp32 scales, or scales beside a model-dtype plane.
    """
    if latent_cache.dim() != 3 or (page_size is not None and latent_cache.shape[1] != page_size):
        raise ValueError(f"latent cache {tuple(latent_cache.shape)} is not [num_pages, {page_size or 'P'}, R]")
    if latent_cache.dtype != torch.float8_e4m3fn:
        if latent_scale is not None:
            raise ValueError(f"a {latent_cache.dtype} latent plane takes no latent_scale (only FP8 latent rows do)")
        return False
    want = (*latent_cache.shape[:2], latent_scale_blocks(latent_cache.shape[2]))
    if latent_scale is None or tuple(latent_scale.shape) != want or latent_scale.dtype != torch.float32:
        got = None if latent_scale is None else (tuple(latent_scale.shape), latent_scale.dtype)
        raise ValueError(f"an FP8 latent plane needs latent_scale {want} float32, got {got}")
    if latent_scale.stride(-1) != 1:
        raise ValueError("latent_scale rows must be contiguous")
    return True


def kpool_paged_planes(
    config: Glm5NextConfig,
    *,
    tokens_per_block: int,
    dtype: torch.dtype,
    indexer_key_dtype: torch.dtype,
    latent_dtype: torch.dtype | None = None,
) -> tuple[PagedPlane, ...]:
    """A sparse layer's planes per page of ``P = tokens_per_block`` tokens: ``latent [P, kv_lora]`` (``latent_dtype``,
    default the model dtype ``dtype``) and, for an FP8 latent only, ``latent_scale [P, ceil(kv_lora / 128)]`` fp32;
    ``index_k [P // 4, 128]`` pooled keys (``indexer_key_dtype``) and, for FP8 keys only, ``index_scale [P // 4]``
    fp32 (BF16 keys carry no scale: pages hold only what the scoring reads)."""
    P = tokens_per_block
    lat = dtype if latent_dtype is None else latent_dtype
    if lat not in (dtype, torch.float8_e4m3fn):
        raise ValueError(f"latent_dtype must be the model dtype {dtype} or torch.float8_e4m3fn, got {lat}")
    planes = [
        PagedPlane("latent", (P, config.kv_lora_rank), lat),
        PagedPlane("index_k", (P // INDEX_KPOOL, INDEX_HEAD_DIM), indexer_key_dtype),
    ]
    if indexer_key_dtype == torch.float8_e4m3fn:
        planes.append(PagedPlane("index_scale", (P // INDEX_KPOOL,), torch.float32))
    if lat == torch.float8_e4m3fn:
        planes.append(PagedPlane("latent_scale", (P, latent_scale_blocks(config.kv_lora_rank)), torch.float32))
    return tuple(planes)


@dataclass
class KpoolLayerCache:
    """Views of one sparse layer's cache planes.

    Attributes:
        latent: ``[num_pages, P, kv_lora]`` latent rows: the model dtype, or float8_e4m3fn codes
            (``latent_dtype="fp8"``); the ops read the format from its dtype.
        index_k: ``[num_pages, P // 4, 128]`` pooled index keys: FP8 e4m3 (rotated, scaled) or BF16
            (``indexer_key_dtype="bf16"``: the pooled key itself); the ops read the format from its dtype.
        index_scale: ``[num_pages, P // 4]`` FP32 power-of-two scale per FP8 pooled key; ``None`` with
            BF16 keys.
        tail_ring: ``[num_state_slots, 2, 4, 128]`` FP32 open-pool members (``[:, 0]`` key, ``[:, 1]``
            gate), indexed by ``pos % 4``.
        tokens_per_block: tokens per page ``P``.
        latent_scale: ``[num_pages, P, ceil(kv_lora / 128)]`` FP32 power-of-two scale per 128-column block of each
            FP8 latent row (value = code * scale); ``None`` with a model-dtype latent.
    """

    latent: torch.Tensor
    index_k: torch.Tensor
    index_scale: torch.Tensor | None
    tail_ring: torch.Tensor
    tokens_per_block: int
    # Speculative rollback of the tail ring (docs/design.md §6.2); None when the manager serves no verify rounds.
    decode_tail_ring: Any = None
    # Last, with a default: callers build the cache positionally with the fields above.
    latent_scale: torch.Tensor | None = None

    @property
    def page_size(self) -> int:
        """Deprecated name of `tokens_per_block`."""
        return self.tokens_per_block
