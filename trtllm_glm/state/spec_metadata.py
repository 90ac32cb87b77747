"""`SpecMetadata`: the per-step speculative description, apart from the attention batch description.

The speculative executor (and the MTP drafter) fill it after the attention metadata's ``prepare()``; the
KDA layers, the indexer and the tail-ring rollback read it as ``meta.spec``. ``prepare()`` replaces it
with a fresh instance (never mutates it), so an identity rollback of the metadata's attributes (the draft
replay interface) brings a step's speculative fields back too.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

__all__ = ["SpecMetadata"]


@dataclass
class SpecMetadata:
    """Speculative fields of one step (all empty for a plain step).

    Attributes:
        verify_seqs: batch indices of the width > 1 verify sequences (their KDA rows leave records for
            `RequestStateOwner.commit_verified`; every other sequence updates state in place).
        num_accepted_t: ``[B]`` int64, the scheduler's accepted count of each sequence's previous step
            (tail-ring cross-check only: positions decide), or None.
        shared_pool_ids: ``[N, topk_pools]`` MTP selection sharing (index_share_for_mtp_iteration): each
            row reuses step 0's top-k pools instead of scoring, or None.
        shared_window_start: ``[N]`` first position of the recent window each shared row also attends.
        last_pool_ids: ``[N, topk_pools]`` what the latest full indexer selected (written by the indexer).
    """

    verify_seqs: list[int] = field(default_factory=list)
    num_accepted_t: torch.Tensor | None = None
    shared_pool_ids: torch.Tensor | None = None
    shared_window_start: torch.Tensor | None = None
    last_pool_ids: torch.Tensor | None = None
