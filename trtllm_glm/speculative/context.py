"""What a drafter builder gets of the speculative executor (`DraftContext`) and returns (`DraftResources`).

Builders sit below the runtime: they see the executor's model, metadata, managers and graph runner through these
types and protocols, never its class (docs/architecture.md, dependency direction).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from ..attention.sparse.glm_kpool.metadata import GlmKpoolMetadata
from ..cache.manager import Glm5NextCacheManager
from ..models.glm5_next import Glm5NextForCausalLM
from .draft_vocab import DraftVocab
from .drafters import Drafter

__all__ = ["CacheSizes", "DraftContext", "DraftResources", "TargetGraphRunner"]


class CacheSizes(Protocol):
    """The executor's sizes a draft KV manager is made from (`runtime.executor.ExecutorConfig`)."""

    tokens_per_block: int
    max_tokens: int
    max_batch_size: int
    indexer_key_dtype: str
    latent_dtype: str


class TargetGraphRunner(Protocol):
    """What drafters' CUDA graphs use of the target's graph runner (`runtime.cuda_graph.CudaGraphRunner`)."""

    meta: Any  # the step metadata the graphs share (`GlmKpoolMetadata`)
    manager: Any  # the target cache manager
    config: Any  # its `CudaGraphConfig`: ``capture_sizes``, ``enable_padding``
    stats: Any  # its `GraphStats`: captures are counted there
    enabled: bool
    emulate: bool  # run the padded steps eagerly (CPU tests) instead of capturing
    padding_request_id: int  # the request holding the padding state slot
    padding_past_len: int  # the cached length padding sequences claim

    def padded_size(self, batch: int, sizes: Sequence[int]) -> int | None: ...

    def capture_pool(self) -> Any: ...

    def drop_pool_after(self, error: BaseException) -> None: ...


@dataclass(frozen=True)
class DraftContext:
    """The speculative executor's parts a drafter builder may use.

    Attributes:
        model: the target model.
        meta: the executor's batch metadata.
        manager: the target cache manager.
        sizes: the executor's cache and batch sizes.
        graph_runner: the target's CUDA-graph runner (None: eager steps only).
        padding_slot: the target manager's padding state slot (None without graphs).
    """

    model: Glm5NextForCausalLM
    meta: GlmKpoolMetadata
    manager: Glm5NextCacheManager
    sizes: CacheSizes
    graph_runner: TargetGraphRunner | None
    padding_slot: int | None

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device


@dataclass(frozen=True)
class DraftResources:
    """A built drafter and what it owns that the executor also reaches.

    Attributes:
        drafter: proposes each round's drafts.
        draft_manager: the manager holding the draft layer's KV (the target's own when they share it); None for
            a drafter with no KV cache.
        draft_plane: the draft layer's sparse plane in ``draft_manager``.
        draft_vocab: the restricted draft vocabulary (None: the full one, or no LM head).
    """

    drafter: Drafter
    draft_manager: Glm5NextCacheManager | None = None
    draft_plane: int | None = None
    draft_vocab: DraftVocab | None = None
