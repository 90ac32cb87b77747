"""Per-request state: state slots and every rollback / snapshot plane (`RequestStateOwner`), and the slot planes a
mixer backend declares for it to allocate (`SlotPlane`).

Below the attention backend, the KDA layer, the cache manager and the speculative mechanism: it imports
only `config` and `errors`. See docs/architecture.md ("Per-request state").
"""

from __future__ import annotations

from .owner import KdaLayerState, RequestStateOwner, StateSnapshot, VerifyRecords, held_bytes, packed_copies
from .slot_planes import SlotPlane, SlotStateBackend
from .spec_metadata import SpecMetadata
from .tail_ring import DecodeTailRing

__all__ = [
    "DecodeTailRing",
    "KdaLayerState",
    "RequestStateOwner",
    "SlotPlane",
    "SlotStateBackend",
    "SpecMetadata",
    "StateSnapshot",
    "VerifyRecords",
    "held_bytes",
    "packed_copies",
]
