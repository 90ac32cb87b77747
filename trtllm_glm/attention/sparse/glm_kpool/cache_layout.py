"""The k-pool backend's cache layout: the paged planes of one sparse layer (`kpool_paged_planes`, what the cache
manager allocates) and `KpoolLayerCache`, the views one layer reads (docs/architecture.md, "Cache layout")."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ....config import INDEX_HEAD_DIM, INDEX_KPOOL, Glm5NextConfig
from ...interface import PagedPlane

__all__ = ["KPOOL_PLANE_NAMES", "KpoolLayerCache", "kpool_paged_planes"]

KPOOL_PLANE_NAMES = ("latent", "index_k", "index_scale")


def kpool_paged_planes(
    config: Glm5NextConfig, *, tokens_per_block: int, dtype: torch.dtype, indexer_key_dtype: torch.dtype
) -> tuple[PagedPlane, ...]:
    """A sparse layer's planes per page of ``P = tokens_per_block`` tokens: ``latent [P, kv_lora]`` (model dtype),
    ``index_k [P // 4, 128]`` pooled keys (``indexer_key_dtype``) and, for FP8 keys only, ``index_scale [P // 4]``
    fp32 (BF16 keys carry no scale: pages hold only what the scoring reads)."""
    P = tokens_per_block
    planes = [
        PagedPlane("latent", (P, config.kv_lora_rank), dtype),
        PagedPlane("index_k", (P // INDEX_KPOOL, INDEX_HEAD_DIM), indexer_key_dtype),
    ]
    if indexer_key_dtype == torch.float8_e4m3fn:
        planes.append(PagedPlane("index_scale", (P // INDEX_KPOOL,), torch.float32))
    return tuple(planes)


@dataclass
class KpoolLayerCache:
    """Views of one sparse layer's cache planes.

    Attributes:
        latent: ``[num_pages, P, kv_lora]`` latent rows (model dtype).
        index_k: ``[num_pages, P // 4, 128]`` pooled index keys: FP8 e4m3 (rotated, scaled) or BF16
            (``indexer_key_dtype="bf16"``: the pooled key itself); the ops read the format from its dtype.
        index_scale: ``[num_pages, P // 4]`` FP32 power-of-two scale per FP8 pooled key; ``None`` with
            BF16 keys.
        tail_ring: ``[num_state_slots, 2, 4, 128]`` FP32 open-pool members (``[:, 0]`` key, ``[:, 1]``
            gate), indexed by ``pos % 4``.
        tokens_per_block: tokens per page ``P``.
    """

    latent: torch.Tensor
    index_k: torch.Tensor
    index_scale: torch.Tensor | None
    tail_ring: torch.Tensor
    tokens_per_block: int
    # Speculative rollback of the tail ring (docs/design.md §6.2); None when the manager serves no verify rounds.
    decode_tail_ring: Any = None

    @property
    def page_size(self) -> int:
        """Deprecated name of `tokens_per_block`."""
        return self.tokens_per_block
