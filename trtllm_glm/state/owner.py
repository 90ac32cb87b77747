"""`RequestStateOwner`: the one owner of per-request (per state slot) state and of its rollback planes.

Everything a request carries between steps apart from its append-only pages lives here: the slot planes the KDA
backend declares (`kda.backend.KdaBackend.slot_planes`: recurrent state and conv window), the indexer tail rings,
the speculative rollback planes (`DecodeTailRing`, pending KDA verify records, the MTP chain backup), the draft's
last hidden and each slot's committed length. `snapshot` / `restore` are byte for byte, and a restore whose committed
length disagrees with its endpoint is rejected (`StateError`). Depends only on `config`, `errors` and `state/`:
callers reach state through it (and hand it the planes to allocate), never the other way round. Planes, shapes and
the contract: docs/architecture.md, "Per-request state".
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from ..config import INDEX_HEAD_DIM, INDEX_KPOOL
from ..errors import CapacityError, StateError
from .slot_planes import SlotPlane
from .tail_ring import DecodeTailRing

__all__ = ["KdaLayerState", "RequestStateOwner", "StateSnapshot", "VerifyRecords"]


@dataclass
class KdaLayerState:
    """Views of one KDA layer's per-request state (`kda.backend.KdaBackend.layer_state`).

    Attributes:
        recurrent: ``[num_state_slots, H, K, V]`` FP32 delta-rule state.
        conv: ``[num_state_slots, C, kernel - 1]`` last inputs of the short convolution, ``C = H*(2K+V)``.
    """

    recurrent: torch.Tensor
    conv: torch.Tensor


class VerifyRecords(Protocol):
    """What a KDA layer's verify pass leaves for the commit (`kda.layer.KdaLayerRecords`)."""

    def commit(self, num_accepted: Sequence[int] | torch.Tensor, state: KdaLayerState) -> None:
        """Fold the first ``num_accepted[b]`` rows of each verified batch sequence into ``state``."""
        ...


@dataclass
class StateSnapshot:
    """Byte-exact copy of one state slot's planes at a committed endpoint.

    Attributes:
        endpoint: committed length the copy was taken at (tokens folded into the state).
        planes: plane name -> ``[L, ...]`` copy of that plane's slot row (every layer of the plane).
        draft_hidden: ``[D]`` copy of the draft's last hidden, or None when not tracked.
    """

    endpoint: int
    planes: dict[str, torch.Tensor] = field(default_factory=dict)
    draft_hidden: torch.Tensor | None = None

    @property
    def nbytes(self) -> int:
        """Bytes held by the copy (its storages: `RequestStateOwner.snapshot` packs planes into shared buffers)."""
        return held_bytes([*self.planes.values(), *([self.draft_hidden] if self.draft_hidden is not None else [])])


def held_bytes(tensors: Sequence[torch.Tensor]) -> int:
    """Bytes of the storages behind ``tensors``, each counted once (copies packed by `packed_copies` share one)."""
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())


def _rows(t: torch.Tensor, L: int) -> torch.Tensor:
    """``t [L, ...]`` (trailing dims contiguous) as a ``[L, n]`` view, its last stride 1 (a single element's stride is
    free: a per-slot count taken from ``[1, S]`` keeps ``S``'s, which a dtype view refuses)."""
    v = t.reshape(L, math.prod(t.shape[1:]))
    return v if v.stride(-1) == 1 or v.shape[1] != 1 else v.as_strided(v.shape, (v.stride(0), 1))


def packed_copies(views: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Copies of ``views`` (each ``[L, ...]``, its trailing dims contiguous) in one new buffer ``[L, bytes]`` per
    leading size ``L`` (one ``torch.cat``: the rows' bytes side by side, widest dtypes first so that each copy is
    aligned, the row padded to 16 bytes), each copy a typed view of it. One allocation per leading size instead of
    one per plane; rows that are contiguous (``L = 1``: the decode tail rings' per-slot planes, 4 per sparse layer
    with MTP) are also copied in one launch, while CUDA's ``cat`` copies strided rows (``L > 1``) one at a time."""
    groups: dict[int, list[str]] = {}
    for name, t in views.items():
        groups.setdefault(t.shape[0], []).append(name)
    out: dict[str, torch.Tensor] = {}
    for L, names in groups.items():
        names.sort(key=lambda n: -views[n].element_size())
        sizes = [math.prod(views[n].shape[1:]) * views[n].element_size() for n in names]
        parts = [_rows(views[n], L).view(torch.uint8) for n in names]
        pad = -sum(sizes) % 16
        if pad or len(parts) == 1:
            parts.append(torch.empty(L, pad, dtype=torch.uint8, device=views[names[0]].device))
        packed = torch.cat(parts, dim=1)
        off = 0
        for n, nb in zip(names, sizes):
            t = views[n]
            out[n] = packed[:, off : off + nb].view(t.dtype).view(t.shape)
            off += nb
    return out


class RequestStateOwner:
    """State slots and every rollback / snapshot plane of one cache manager.

    Args:
        num_state_slots: ``S``, live requests at once.
        num_sparse_layers: ``Ls``, tail-ring planes (sparse layers stored by the manager).
        num_kda_layers: ``Lk``, KDA layers with state here (0 for a draft-only manager).
        slot_planes: the planes a KDA layer keeps per slot (`KdaBackend.slot_planes`): each is allocated
            ``[Lk, S, *shape]`` in ``planes`` and reads as an attribute (``owner.kda_recurrent``).
        layer_state: ``(planes, kda_idx) -> view`` of one KDA layer (`KdaBackend.layer_state`); `kda_layer_state`
            and the verify commit call it.
        device: where every plane lives.

    Attributes:
        planes: name -> ``[Lk, S, *shape]`` of every declared slot plane (zeroed, snapshotted, reset with the slot).
        slot_plane_specs: the declared planes (`SlotPlane`).
    """

    def __init__(
        self,
        *,
        num_state_slots: int,
        num_sparse_layers: int,
        num_kda_layers: int,
        slot_planes: Sequence[SlotPlane] = (),
        layer_state: Callable[[Mapping[str, torch.Tensor], int], Any] | None = None,
        device: torch.device | str = "cpu",
    ) -> None:
        if num_state_slots <= 0:
            raise ValueError(f"num_state_slots must be positive, got {num_state_slots}")
        S, dev = num_state_slots, torch.device(device)
        self.num_state_slots = S
        self.num_sparse_layers = num_sparse_layers
        self.num_kda_layers = num_kda_layers
        self.device = dev
        f32 = torch.float32
        self.tail_ring = torch.zeros(num_sparse_layers, S, 2, INDEX_KPOOL, INDEX_HEAD_DIM, dtype=f32, device=dev)
        # The KDA backend's slot planes (`KdaBackend.slot_planes`: kda_recurrent, kda_conv).
        self.slot_plane_specs = tuple(slot_planes)
        self.planes: dict[str, torch.Tensor] = {
            p.name: torch.zeros(num_kda_layers, S, *p.shape, dtype=p.dtype, device=dev) for p in self.slot_plane_specs
        }
        self._layer_state = layer_state
        # Rollback planes, enabled by the speculative executor (none for plain decoding).
        self.decode_tail_rings: list[DecodeTailRing] = []
        self.draft_hidden: torch.Tensor | None = None
        self._chain_backup: dict[int, torch.Tensor] = {}
        # KDA verify records of the current step by KDA layer index, folded by `commit_verified`.
        self._pending: dict[int, VerifyRecords] = {}
        # Host-side: the committed length per slot (tokens folded into the slot's state), and the free slots
        # (popped from the end; reversed so that slots come out ascending).
        self._committed = [0] * S
        self._free: list[int] = list(range(S - 1, -1, -1))
        self._in_use = [False] * S
        # Plane names are attributes and snapshot keys: identifiers, distinct, none an attribute of the owner.
        names = [p.name for p in self.slot_plane_specs]
        bad = [n for n in names if not n.isidentifier() or n in self.__dict__ or hasattr(type(self), n)]
        if bad or len(set(names)) != len(names):
            raise ValueError(f"slot plane names must be distinct identifiers the owner does not use: {names}")

    def __getattr__(self, name: str) -> Any:
        # The declared slot planes by name (`owner.kda_recurrent`); only reached when normal lookup fails.
        planes = self.__dict__.get("planes")
        if planes is not None and name in planes:
            return planes[name]
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    # --------------------------------------------------------------------------------------------
    # Set-up of the speculative planes
    def enable_decode_tail_rings(self, max_rows: int, num_layers: int | None = None) -> None:
        """Give the first ``num_layers`` tail-ring planes (default all) a `DecodeTailRing` of ``max_rows``
        rows (``1 + num_speculative_tokens``), so that verify rounds can roll back rejected ring entries."""
        n = self.num_sparse_layers if num_layers is None else num_layers
        self.decode_tail_rings = [DecodeTailRing(self.num_state_slots, max_rows, self.device) for _ in range(n)]

    def enable_draft_hidden(self, hidden_size: int, dtype: torch.dtype) -> None:
        """Track the draft's last hidden ``[S, hidden_size]`` per slot (MTP drafting)."""
        self.draft_hidden = torch.zeros(self.num_state_slots, hidden_size, dtype=dtype, device=self.device)

    def enable_speculative_rows(self, plane: int) -> None:
        """Allocate (once, fixed address) the backup `speculative_rows` uses for tail-ring plane ``plane``."""
        if plane not in self._chain_backup:
            self._chain_backup[plane] = torch.empty_like(self.tail_ring[plane])

    # --------------------------------------------------------------------------------------------
    # Views
    def kda_layer_state(self, kda_idx: int) -> KdaLayerState:
        """State planes of the ``kda_idx``-th KDA layer (views, the KDA backend's `layer_state`)."""
        if not 0 <= kda_idx < self.num_kda_layers:
            raise IndexError(f"KDA layer {kda_idx} not in [0, {self.num_kda_layers})")
        if self._layer_state is None:
            raise StateError("this state owner was given no layer_state view for its slot planes")
        return self._layer_state(self.planes, kda_idx)

    def decode_tail_ring(self, sparse_idx: int) -> DecodeTailRing | None:
        """The rollback of tail-ring plane ``sparse_idx``, or None when that plane has none."""
        return self.decode_tail_rings[sparse_idx] if sparse_idx < len(self.decode_tail_rings) else None

    def committed_len(self, slot: int) -> int:
        """Tokens folded into ``slot``'s state."""
        return self._committed[self._check(slot)]

    @property
    def state_bytes_per_slot(self) -> int:
        """Bytes of one slot's live planes (every declared slot plane, e.g. KDA recurrent + conv state, and every
        tail ring)."""
        return sum(t[:, 0].numel() * t.element_size() for t in (self.tail_ring, *self.planes.values()))

    # --------------------------------------------------------------------------------------------
    # Lifetime
    @property
    def num_free_slots(self) -> int:
        """Slots not held by a request."""
        return len(self._free)

    def acquire(self) -> int:
        """Take the lowest free slot (its planes are not zeroed here: `reset` does that).

        Raises:
            CapacityError: every slot is in use.
        """
        if not self._free:
            raise CapacityError(f"no free state slot: all {self.num_state_slots} slots are in use")
        slot = self._free.pop()
        self._in_use[slot] = True
        return slot

    def release(self, slot: int) -> None:
        """Return ``slot`` to the free slots (its planes keep their bytes until the next `reset`).

        Raises:
            StateError: the slot is not in use.
        """
        if not self._in_use[self._check(slot)]:
            raise StateError(f"state slot {slot} is not in use")
        self._in_use[slot] = False
        self._free.append(slot)

    def reset(self, slot: int) -> None:
        """Zero every plane of ``slot`` and drop its backups (a fresh request takes the slot)."""
        self._check(slot)
        self.tail_ring[:, slot].zero_()
        for t in self.planes.values():
            t[:, slot].zero_()
        for ring in self.decode_tail_rings:
            ring.reset(slot)
        if self.draft_hidden is not None:
            self.draft_hidden[slot].zero_()
        self._committed[slot] = 0

    def reset_slots(self, slots: Sequence[int], slots_t: torch.Tensor | None = None) -> None:
        """`reset` of several slots: one fill per plane for all of them (a step admitting many requests issued
        three to ten small launches per request), the same bytes as resetting each. ``slots_t``: ``slots`` as an
        int64 tensor on the planes' device, made by the caller without a stream sync (the cache manager's
        `transfer.to_device`); None builds it here."""
        for slot in slots:
            self._check(slot)
        if len(slots) <= 1:
            for slot in slots:
                self.reset(slot)
            return
        idx = torch.tensor(list(slots), dtype=torch.int64, device=self.tail_ring.device) if slots_t is None else slots_t
        self.tail_ring.index_fill_(1, idx, 0)
        for t in self.planes.values():
            t.index_fill_(1, idx, 0)
        for ring in self.decode_tail_rings:
            ring.reset_slots(idx)
        if self.draft_hidden is not None:
            self.draft_hidden.index_fill_(0, idx, 0)
        for slot in slots:
            self._committed[slot] = 0

    # --------------------------------------------------------------------------------------------
    # Speculative commit
    def record_verify(self, kda_idx: int, records: VerifyRecords | None) -> None:
        """Keep the verify records a KDA layer produced this step (state untouched until the commit)."""
        if records is None:
            self._pending.pop(kda_idx, None)
        else:
            self._pending[kda_idx] = records

    @property
    def has_pending(self) -> bool:
        """Whether this step left verify records to commit."""
        return bool(self._pending)

    def discard_pending(self) -> None:
        """Drop this step's verify records uncommitted (a new step is being prepared)."""
        self._pending = {}

    def commit_verified(self, slots: Sequence[int], num_accepted: Sequence[int]) -> None:
        """Commit one step: fold the accepted prefix of every verified sequence into its KDA state and
        advance every sequence's committed length.

        Verified sequences' KDA state stayed untouched during the step (records); all others (prefill
        chunks, width-one decodes) updated in place and only advance their length. The tail rings roll
        back lazily at the slot's next step (`DecodeTailRing`, positions decide), so nothing here.

        Args:
            slots: ``[B]`` state slot of each batch sequence of the step.
            num_accepted: ``[B]`` rows committed per sequence (root + accepted drafts for a verify
                sequence; all rows otherwise).
        """
        if len(slots) != len(num_accepted):
            raise ValueError(f"{len(slots)} slots but {len(num_accepted)} accepted counts")
        self.fold_pending(num_accepted)
        for s, a in zip(slots, num_accepted):
            self._committed[self._check(s)] += int(a)

    def fold_pending(self, num_accepted: Sequence[int] | torch.Tensor) -> None:
        """Fold this step's verify records into the KDA states and drop them; the lengths stay.

        A verify CUDA graph calls it with the device's accepted counts (no host sync, so it is captured);
        the host later calls `commit_verified` with the same counts, which then only advances the lengths.

        Args:
            num_accepted: ``[B]`` rows committed per batch sequence (host list or device tensor).
        """
        for kda_idx in sorted(self._pending):
            self._pending[kda_idx].commit(num_accepted, self.kda_layer_state(kda_idx))
        self._pending = {}

    def record_draft_hidden(self, slots: torch.Tensor, hidden: torch.Tensor) -> None:
        """Store ``hidden[j]`` as the draft's last hidden of ``slots[j]`` (no-op when not tracked).

        Args:
            slots: ``[n]`` int64 state slots.
            hidden: ``[n, D]`` the target hidden of each slot's last committed row.
        """
        if self.draft_hidden is not None and slots.numel():
            self.draft_hidden.index_copy_(0, slots, hidden.to(self.draft_hidden.dtype))

    @contextmanager
    def speculative_rows(self, plane: int, slots: torch.Tensor) -> Iterator[None]:
        """Rows written to tail-ring ``plane`` of ``slots`` inside the block are speculative: the ring rows
        of those slots are backed up on entry and restored on exit (also on an exception).

        Chained MTP drafts use it: their latent rows and pools are rewritten by the next catch-up before
        any committed row reads them, only the ring would keep their keys.

        Args:
            plane: tail-ring plane (the MTP layer's).
            slots: ``[n]`` int64 distinct state slots *of this owner* (the draft manager's in separate mode).
        """
        self.enable_speculative_rows(plane)
        buf, ring = self._chain_backup[plane], self.tail_ring[plane]
        n = slots.numel()
        buf[:n].copy_(ring.index_select(0, slots))
        try:
            yield
        finally:
            ring.index_copy_(0, slots, buf[:n])

    # --------------------------------------------------------------------------------------------
    # Snapshots
    def _slot_planes(self) -> dict[str, torch.Tensor]:
        """Every plane with the state slot as dimension 1 (``[L, S, ...]``)."""
        planes = {"tail_ring": self.tail_ring, **self.planes}
        for i, ring in enumerate(self.decode_tail_rings):
            # saved_count is [S] on a [S + 1] buffer: unsqueezed so every plane is [L, S, ...].
            planes[f"ring{i}.snapshot"] = ring.snapshot.unsqueeze(0)
            planes[f"ring{i}.saved_rows"] = ring.saved_rows.unsqueeze(0)
            planes[f"ring{i}.saved_pos"] = ring.saved_pos.unsqueeze(0)
            planes[f"ring{i}.saved_count"] = ring.saved_count.unsqueeze(0)
        return planes

    def snapshot(self, slot: int, endpoint: int) -> StateSnapshot:
        """Copy ``slot``'s planes, taken when its committed length is ``endpoint``.

        Args:
            slot: the state slot.
            endpoint: the committed length the caller believes the slot is at.

        Returns:
            A `StateSnapshot` (device copies; `restore` puts them back).

        Raises:
            StateError: the slot's committed length is not ``endpoint``, or verify records are pending
                (the step is not committed yet).
        """
        self._check(slot)
        if self._pending:
            raise StateError("cannot snapshot while verify records are pending (commit the step first)")
        if self._committed[slot] != endpoint:
            raise StateError(f"slot {slot} has {self._committed[slot]} committed tokens, not endpoint {endpoint}")
        planes = packed_copies({name: t[:, slot] for name, t in self._slot_planes().items()})
        hidden = self.draft_hidden[slot].clone() if self.draft_hidden is not None else None
        return StateSnapshot(endpoint=endpoint, planes=planes, draft_hidden=hidden)

    def restore(self, slot: int, snap: StateSnapshot, endpoint: int | None = None) -> None:
        """Put ``snap`` back into ``slot`` byte for byte and set its committed length to the snapshot's.

        Args:
            slot: the state slot (need not be the one the snapshot was taken from).
            snap: from `snapshot` of an owner of the same geometry.
            endpoint: the committed length the caller resumes at (defaults to ``snap.endpoint``).

        Raises:
            StateError: ``endpoint`` disagrees with the snapshot's committed length, or the snapshot's
                planes do not match this owner's (nothing is written then).
        """
        self._check(slot)
        self.check_snapshot(snap, endpoint)
        planes = self._slot_planes()
        for k, v in snap.planes.items():
            planes[k][:, slot].copy_(v)
        if self.draft_hidden is not None and snap.draft_hidden is not None:
            self.draft_hidden[slot].copy_(snap.draft_hidden)
        self._committed[slot] = snap.endpoint

    def check_snapshot(self, snap: StateSnapshot, endpoint: int | None = None) -> None:
        """Raise `StateError` unless `restore` would accept ``snap`` at ``endpoint`` (writes nothing).

        Args:
            snap: a snapshot.
            endpoint: the committed length the caller would resume at (``None``: the snapshot's own).
        """
        if endpoint is not None and endpoint != snap.endpoint:
            raise StateError(f"snapshot holds {snap.endpoint} committed tokens, restore asked for endpoint {endpoint}")
        planes = self._slot_planes()
        if set(planes) != set(snap.planes) or any(
            planes[k][:, 0].shape != v.shape or planes[k].dtype != v.dtype for k, v in snap.planes.items()
        ):
            raise StateError("snapshot planes do not match this state owner's geometry")
        if (snap.draft_hidden is None) != (self.draft_hidden is None):
            raise StateError("snapshot and state owner disagree on tracking the draft hidden")

    def _check(self, slot: Any) -> int:
        s = int(slot)
        if not 0 <= s < self.num_state_slots:
            raise IndexError(f"state slot {s} not in [0, {self.num_state_slots})")
        return s
