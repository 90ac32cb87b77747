"""`AttentionBackend`: what an attention backend owns, and what the cache manager, the model and the executor
ask it for (TensorRT-LLM's ``AttentionBackend`` with its ``Metadata``, vLLM's backend + metadata builder).

A backend owns its **metadata** (`Metadata`, `make_metadata`), its **cache layout** (`paged_planes`, `layer_cache`)
and its **dispatch** (`ops`, `make_layer`). A new backend is one module implementing this class, registered by name
(`attention.registry`); docs/architecture.md, "Attention backends", describes the members and the files it touches.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any, ClassVar, Protocol

import torch
from torch import nn

from ..config import Glm5NextConfig
from .metadata import AttentionMetadata

__all__ = ["AttentionBackend", "PagedCacheManager", "PagedPlane"]


@dataclass(frozen=True)
class PagedPlane:
    """One paged cache plane of every layer of a backend: the manager allocates ``[L, num_pages, *shape]``.

    Attributes:
        name: the plane's name (``manager.planes[name]``; page copies and block reuse key on it).
        shape: the plane's shape per page, e.g. ``(tokens_per_block, kv_lora_rank)``.
        dtype: its element type.
    """

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def bytes_per_page(self) -> int:
        """Bytes of one page of one layer."""
        n = 1
        for d in self.shape:
            n *= d
        return n * torch.empty(0, dtype=self.dtype).element_size()


class PagedCacheManager(Protocol):
    """What a backend's metadata reads of the KV cache manager (`trtllm_glm.cache.manager.Glm5NextCacheManager`)."""

    tokens_per_block: int

    def page_lists(self, request_ids: Sequence[int]) -> list[list[int]]: ...

    def get_batch_state_slots(self, request_ids: Sequence[int]) -> list[int]: ...

    def pages_needed(self, num_tokens: int) -> int: ...


class AttentionBackend(ABC):
    """An attention backend: its metadata class, its cache layout and its dispatch.

    Attributes:
        name: the registry key (`attention.registry.get_attention_backend`).
        Metadata: the step metadata class its layers read.
        plane_names: every paged plane the backend may declare (a plane its options leave out reads as None on
            the manager, e.g. the k-pool's FP8 scales with BF16 keys).
    """

    name: ClassVar[str]
    Metadata: ClassVar[type[AttentionMetadata]]
    plane_names: ClassVar[tuple[str, ...]]

    @abstractmethod
    def paged_planes(
        self,
        config: Glm5NextConfig,
        *,
        tokens_per_block: int,
        dtype: torch.dtype,
        indexer_key_dtype: torch.dtype,
        latent_dtype: torch.dtype | None = None,
    ) -> tuple[PagedPlane, ...]:
        """The paged planes one layer of this backend stores per page.

        Args:
            config: model geometry (the rank's local config under parallelism).
            tokens_per_block: tokens per page.
            dtype: the model dtype.
            indexer_key_dtype: the cache's pooled-key dtype option (a backend without an indexer ignores it).
            latent_dtype: the cache's latent storage dtype (``None``: the model dtype; ``torch.float8_e4m3fn`` for
                ``latent_dtype="fp8"``). A backend without that format must refuse it (``ValueError``).
        """

    @abstractmethod
    def layer_cache(self, manager: Any, layer: int) -> Any:
        """The views one layer reads: ``manager.planes[name][layer]`` and the state planes it needs (``manager`` is the
        `Glm5NextCacheManager`; ``layer`` the layer's index among this backend's layers there)."""

    @abstractmethod
    def make_layer(self, config: Glm5NextConfig, layer_idx: int) -> nn.Module:
        """The mixer of decoder layer ``layer_idx``: called as ``layer(x [N, D], meta, layer_cache) -> [N, D]`` (this
        rank's partial output; the decoder layer all-reduces it) and initialised by ``reset_parameters(generator,
        std)``."""

    @abstractmethod
    def ops(self, device: torch.device) -> ModuleType:
        """The module implementing the backend's ops for tensors on ``device`` (torch reference or kernels)."""

    def make_metadata(
        self,
        manager: PagedCacheManager,
        *,
        max_num_seqs: int,
        max_num_tokens: int,
        max_seq_len: int,
        select_width: int,
        device: torch.device | str,
    ) -> AttentionMetadata:
        """The step metadata with its persistent buffers, sized for ``max_num_seqs`` sequences of up to ``max_seq_len``
        tokens and ``max_num_tokens`` rows per step (``select_width``: columns of a sparse selection, if any)."""
        return self.Metadata(  # type: ignore[call-arg]
            kv_cache_manager=manager,
            max_num_seqs=max_num_seqs,
            max_num_tokens=max_num_tokens,
            max_pages_per_seq=-(-max_seq_len // manager.tokens_per_block),
            select_width=select_width,
            device=device,
        )
