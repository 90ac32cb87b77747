"""The batch description the KDA layer reads (a subset of the runtime's ``AttentionMetadata``)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

__all__ = ["KdaBatch", "KdaBatchLike"]


@runtime_checkable
class KdaBatchLike(Protocol):
    """Attributes the KDA layer reads; ``AttentionMetadata`` provides the same names.

    Host-side lists (length ``num_seqs``, ``cu_seqlens`` ``num_seqs + 1``) drive all control flow, so the
    layer never syncs with the device to plan a step. Rows of sequence ``b`` are
    ``hidden[cu_seqlens[b] : cu_seqlens[b + 1]]``; ``state_slots_t`` is the same slots as an int64 tensor on
    the model's device.
    """

    num_seqs: int
    q_lens: list[int]
    past_lens: list[int]
    cu_seqlens: list[int]
    state_slots: list[int]
    state_slots_t: torch.Tensor


@dataclass
class KdaBatch:
    """A plain `KdaBatchLike` (tests, benchmarks, anything without a full ``AttentionMetadata``).

    Attributes:
        num_seqs: sequences in the step.
        q_lens: rows of each sequence this step.
        past_lens: tokens each sequence already has in the cache (0 = fresh sequence: zero state).
        cu_seqlens: ``num_seqs + 1`` first-row offsets in the flat batch.
        state_slots: the state slot of each sequence.
        state_slots_t: ``[num_seqs]`` int64 copy of ``state_slots`` on the device.
    """

    num_seqs: int
    q_lens: list[int]
    past_lens: list[int]
    cu_seqlens: list[int]
    state_slots: list[int]
    state_slots_t: torch.Tensor

    @classmethod
    def build(
        cls,
        q_lens: Sequence[int],
        past_lens: Sequence[int],
        state_slots: Sequence[int],
        device: torch.device | str = "cpu",
    ) -> KdaBatch:
        """Build from per-sequence lengths and slots; rows are laid out in sequence order."""
        if not len(q_lens) == len(past_lens) == len(state_slots):
            raise ValueError("q_lens, past_lens and state_slots must have one entry per sequence")
        cu = [0]
        for n in q_lens:
            cu.append(cu[-1] + int(n))
        return cls(
            num_seqs=len(q_lens),
            q_lens=[int(n) for n in q_lens],
            past_lens=[int(n) for n in past_lens],
            cu_seqlens=cu,
            state_slots=[int(s) for s in state_slots],
            state_slots_t=torch.tensor([int(s) for s in state_slots], dtype=torch.int64, device=device),
        )
