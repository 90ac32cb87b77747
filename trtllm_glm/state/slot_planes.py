"""`SlotPlane`: one per-slot state plane a mixer backend declares (`kda.backend.KdaBackend.slot_planes`), the slot
counterpart of the attention backends' `PagedPlane`; `SlotStateBackend`: what the state owner and the cache manager
read of such a backend. The owner allocates ``[L, S, *shape]`` of every declared plane (docs/architecture.md,
"Attention backends").
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from ..config import Glm5NextConfig

__all__ = ["SlotPlane", "SlotStateBackend"]


@dataclass(frozen=True)
class SlotPlane:
    """One state plane of every layer of a mixer backend: the owner allocates ``[L, num_state_slots, *shape]``.

    Attributes:
        name: the plane's name (``owner.planes[name]``, also ``owner.<name>``; snapshots key on it).
        shape: the plane's shape per slot, e.g. ``(H, K, V)``.
        dtype: its element type.
    """

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def bytes_per_slot(self) -> int:
        """Bytes of one slot of one layer."""
        n = 1
        for d in self.shape:
            n *= d
        return n * torch.empty(0, dtype=self.dtype).element_size()


class SlotStateBackend(Protocol):
    """A mixer backend with per-slot state (`kda.backend.KdaBackend`): its planes and its layer's view of them."""

    def slot_planes(self, config: Glm5NextConfig) -> tuple[SlotPlane, ...]:
        """The planes one layer keeps per state slot (``config``: the rank's local config under parallelism)."""
        ...

    def layer_state(self, planes: Mapping[str, torch.Tensor], layer: int) -> Any:
        """The views layer ``layer`` reads, from ``planes`` (name -> ``[L, S, *shape]``)."""
        ...
