"""`GlmKpoolBackend`: the k-pool sparse MLA backend (`attention.interface.AttentionBackend`): its metadata
(`GlmKpoolMetadata`), its cache layout (`cache_layout`), its layer (`GlmKpoolSparseMLA`) and its dispatch between
the torch reference ops and the Triton kernels (`dispatch`: ``kpool_ops``, ``backend_name``, re-exported here).
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import torch
from torch import nn

from ....config import Glm5NextConfig
from ...interface import AttentionBackend, PagedPlane
from .cache_layout import KPOOL_PLANE_NAMES, KpoolLayerCache, kpool_paged_planes
from .dispatch import backend_name, kpool_ops
from .layer import GlmKpoolSparseMLA
from .metadata import GlmKpoolMetadata

__all__ = ["GlmKpoolBackend", "kpool_ops", "backend_name"]


class GlmKpoolBackend(AttentionBackend):
    """The k-pool sparse MLA backend: `GlmKpoolMetadata`, paged latent rows (+ FP8 scales) + pooled index keys (+ FP8
    scales) per layer, the indexer tail rings of the manager's state owner, and `kpool_ops` dispatch."""

    name = "glm_kpool"
    Metadata = GlmKpoolMetadata
    plane_names = KPOOL_PLANE_NAMES

    def paged_planes(
        self,
        config: Glm5NextConfig,
        *,
        tokens_per_block: int,
        dtype: torch.dtype,
        indexer_key_dtype: torch.dtype,
        latent_dtype: torch.dtype | None = None,
    ) -> tuple[PagedPlane, ...]:
        return kpool_paged_planes(
            config,
            tokens_per_block=tokens_per_block,
            dtype=dtype,
            indexer_key_dtype=indexer_key_dtype,
            latent_dtype=latent_dtype,
        )

    def layer_cache(self, manager: Any, layer: int) -> KpoolLayerCache:
        planes = manager.planes
        scale = planes.get("index_scale")
        lat_scale = planes.get("latent_scale")
        return KpoolLayerCache(
            latent=planes["latent"][layer],
            index_k=planes["index_k"][layer],
            index_scale=None if scale is None else scale[layer],
            tail_ring=manager.state.tail_ring[layer],
            tokens_per_block=manager.tokens_per_block,
            decode_tail_ring=manager.state.decode_tail_ring(layer),
            latent_scale=None if lat_scale is None else lat_scale[layer],
        )

    def make_layer(self, config: Glm5NextConfig, layer_idx: int) -> nn.Module:
        return GlmKpoolSparseMLA(config, shared_indexer=config.shares_indexer(layer_idx))

    def ops(self, device: torch.device) -> ModuleType:
        return kpool_ops(device)
