"""`DecodeTailRing`: keeps rejected draft keys out of the indexer tail ring (docs/design.md §6.2).

Planes per slot: ``snapshot``, ``saved_rows``, ``saved_pos``, ``saved_count`` (0 after a width-one step, whose only
row is always committed); the next step restores the snapshot and replays the accepted saved rows, ``a`` derived from
positions. Pools completed by a rejected row are left alone on purpose: the real token at that position completes
the same pool again before any committed row can see it (a row at ``pos`` sees pools ``p < (pos + 1) // 4``). No
host sync, fixed-address buffers (graph-safe); `prepare_step` is one launch on CUDA (``TRTLLM_GLM_TAIL_RING_BACKEND``),
else `prepare_step_reference`, same bits. One instance per sparse layer's ring (the MTP layer's ring needs its own).
The kernel: docs/kernels.md, "Tail-ring rollback and backup".
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from trtllm_glm import envs
from trtllm_glm.config import INDEX_HEAD_DIM, INDEX_KPOOL
from trtllm_glm.triton_interp import kernel_backend

__all__ = ["DecodeTailRing", "TAIL_RING_BACKEND_ENV"]

# Picks `DecodeTailRing.prepare_step`'s implementation: auto (the Triton kernel for CUDA tensors), torch or triton.
TAIL_RING_BACKEND_ENV = envs.TAIL_RING_BACKEND.name

_INT64_MAX = torch.iinfo(torch.int64).max


class DecodeTailRing:
    """Per-state-slot backup of one sparse layer's tail ring around speculative decode steps.

    Args:
        num_state_slots: ``S``, state slots of the ring it protects (``tail_ring.shape[0]``).
        max_rows: widest decode step, ``1 + max_draft_len``.
        device: where the buffers live (the ring's device).

    Attributes:
        snapshot: ``[S, 2, 4, 128]`` fp32, the ring before the slot's last backed-up step.
        saved_rows: ``[S, max_rows, 2, 128]`` fp32, ``(key, gate)`` rows that step wrote, in order.
        saved_pos: ``[S]`` int64, that step's first position.
        saved_count: ``[S]`` int64, rows saved by that step; 0 = nothing to restore.
        num_disagreements_t: ``[]`` int64 device counter of sequence-steps whose bookkeeping disagreed
            (see `prepare_step`); `num_disagreements` reads it on the host.
    """

    def __init__(self, num_state_slots: int, max_rows: int, device: torch.device | str = "cpu") -> None:
        if num_state_slots <= 0:
            raise ValueError(f"num_state_slots must be positive, got {num_state_slots}")
        if max_rows <= 0:
            raise ValueError(f"max_rows must be positive (1 + num_speculative_tokens), got {max_rows}")
        S, D = num_state_slots, INDEX_HEAD_DIM
        dev = torch.device(device)
        self.num_state_slots = S
        self.max_rows = max_rows
        self.device = dev
        self.snapshot = torch.zeros(S, 2, INDEX_KPOOL, D, dtype=torch.float32, device=dev)
        self.saved_rows = torch.zeros(S, max_rows, 2, D, dtype=torch.float32, device=dev)
        self.saved_pos = torch.zeros(S, dtype=torch.int64, device=dev)
        # One extra "dump" entry, S, absorbs writes for padding / out-of-range slot ids without a host check.
        self._saved_count = torch.zeros(S + 1, dtype=torch.int64, device=dev)
        self.saved_count = self._saved_count[:S]
        self.num_disagreements_t = torch.zeros((), dtype=torch.int64, device=dev)
        # Per-slot step geometry (width, first position, first row), refreshed in place every step; the last
        # entry is the dump slot of padding rows.
        self._slot_width = torch.zeros(S + 1, dtype=torch.int64, device=dev)
        self._slot_first_pos = torch.zeros(S + 1, dtype=torch.int64, device=dev)
        self._slot_first_row = torch.zeros(S + 1, dtype=torch.int64, device=dev)
        self._entries = torch.arange(INDEX_KPOOL, dtype=torch.int64, device=dev)
        self._row_ids = torch.arange(max_rows, dtype=torch.int64, device=dev)

    @property
    def num_disagreements(self) -> int:
        """Host copy of `num_disagreements_t` (synchronises; for logs and tests, not the hot path)."""
        return int(self.num_disagreements_t.item())

    def reset(self, slot: int | None = None) -> None:
        """Forget the backup of ``slot`` (request teardown), or of every slot when ``slot`` is None.

        The counter is kept; only the backups are dropped.
        """
        if slot is None:
            self._saved_count.zero_()
            self.saved_pos.zero_()
            self.snapshot.zero_()
            self.saved_rows.zero_()
            return
        if not 0 <= slot < self.num_state_slots:
            raise IndexError(f"state slot {slot} not in [0, {self.num_state_slots})")
        self._saved_count[slot] = 0
        self.saved_pos[slot] = 0
        self.snapshot[slot].zero_()
        self.saved_rows[slot].zero_()

    def reset_slots(self, slots: torch.Tensor) -> None:
        """`reset` of the slots ``slots [n]`` (int64, on the ring's device, each in range), one fill per plane."""
        self._saved_count.index_fill_(0, slots, 0)
        self.saved_pos.index_fill_(0, slots, 0)
        self.snapshot.index_fill_(0, slots, 0)
        self.saved_rows.index_fill_(0, slots, 0)

    def committed_ring(self, ring: torch.Tensor, slot: int, committed_len: int) -> torch.Tensor:
        """The ring of ``slot`` as the next step will see it once a request has ``committed_len`` tokens.

        After a verify step the live ring still holds the rejected rows: the rollback happens lazily at the
        start of the next step. This returns what that rollback produces (inspection and tests; it syncs).

        Args:
            ring: ``[S, 2, 4, 128]`` the layer's live tail ring.
            slot: the request's state slot.
            committed_len: the request's committed length (the next step's first position).

        Returns:
            ``[2, 4, 128]`` a copy.
        """
        out = ring[slot].clone()
        n = int(self.saved_count[slot])
        if n == 0:
            return out
        p0 = int(self.saved_pos[slot])
        a = min(max(committed_len - p0, 0), n)
        out.copy_(self.snapshot[slot])
        for i in range(a):
            out[:, (p0 + i) % 4] = self.saved_rows[slot, i]
        return out

    def on_prefill(self, state_slots: torch.Tensor | Sequence[int]) -> None:
        """Drop the backups of slots whose tail a prefill chunk writes (fresh, chunked, resumed prefill).

        A prefill chunk rewrites the ring from real tokens; restoring a backup taken before it would put
        stale (possibly rejected) rows back. Call it for every prefill sequence of the step (before or
        after its tail write; it only touches the backup). Ids outside ``[0, S)`` (padding) are ignored.

        Args:
            state_slots: ``[M]`` int state slots (duplicates allowed).
        """
        slots = torch.as_tensor(state_slots, dtype=torch.int64, device=self.device).reshape(-1)
        S = self.num_state_slots
        self._saved_count.index_fill_(0, torch.where((slots >= 0) & (slots < S), slots, S), 0)

    @torch.no_grad()
    def prepare_step(
        self,
        ring: torch.Tensor,
        key: torch.Tensor,
        gate: torch.Tensor,
        positions: torch.Tensor,
        row_seq: torch.Tensor,
        state_slots: torch.Tensor,
        num_accepted_tokens: torch.Tensor | None = None,
        *,
        backend: str | None = None,
    ) -> None:
        """Roll back the previous step's rejected rows, then back up this step; before its ring writes.

        Per sequence with rows in this step (first position ``p0``, width ``W``, slot ``s``): restore the snapshot
        and replay the accepted saved rows (``a = p0 - saved_pos[s]``, clamped to ``[0, saved_count[s]]``), then
        back this step up when ``1 < W <= max_rows`` (else ``saved_count[s] = 0``). A clamp, a
        ``num_accepted_tokens`` differing from ``a`` (positions win) or a step wider than ``max_rows`` adds one to
        ``num_disagreements_t``. Slots without rows in this step keep their bits; padding rows and out-of-range
        slots are ignored. The rules step by step: docs/kernels.md, "Tail-ring rollback and backup".

        Args:
            ring: ``[S, 2, 4, 128]`` fp32 tail ring of the layer (``cache.tail_ring``), updated in place.
            key: ``[N, 128]`` this step's decode keys (stored as fp32, as the ring update does).
            gate: ``[N, 128]`` this step's gate logits.
            positions: ``[N]`` int token positions (consecutive within a sequence).
            row_seq: ``[N]`` int sequence index per row (rows of a sequence contiguous).
            state_slots: ``[B]`` int state slot per sequence.
            num_accepted_tokens: optional ``[B]`` int, the scheduler's count of the previous step's rows
                that were accepted, per sequence (a cross-check only).
            backend: ``"torch"`` (`prepare_step_reference`), ``"triton"`` (one launch of
                `trtllm_glm.state.kernels.tail_ring_prepare_step`; on the CPU through Triton's interpreter) or
                ``"auto"`` (Triton for CUDA tensors, torch otherwise); default ``TRTLLM_GLM_TAIL_RING_BACKEND``,
                else auto. Both give the same bits.

        Raises:
            ValueError: misshapen inputs (checked on the host from shapes alone; no synchronisation).
        """
        if kernel_backend(envs.TAIL_RING_BACKEND, [ring], backend) != "triton":
            self.prepare_step_reference(ring, key, gate, positions, row_seq, state_slots, num_accepted_tokens)
        elif self._check(ring, key, gate, positions, row_seq, state_slots, num_accepted_tokens):
            from .kernels import tail_ring_prepare_step

            tail_ring_prepare_step(
                ring, key, gate, positions, row_seq, state_slots, num_accepted_tokens,
                self.snapshot, self.saved_rows, self.saved_pos, self.saved_count, self.num_disagreements_t,
            )  # fmt: skip

    @torch.no_grad()
    def prepare_step_reference(
        self,
        ring: torch.Tensor,
        key: torch.Tensor,
        gate: torch.Tensor,
        positions: torch.Tensor,
        row_seq: torch.Tensor,
        state_slots: torch.Tensor,
        num_accepted_tokens: torch.Tensor | None = None,
    ) -> None:
        """The torch reference of `prepare_step` (same arguments and contract; the ``backend="torch"`` path).

        Vectorised over the step's sequences and sync-free, but about ninety small device ops (scatter geometry,
        gathers, selects, indexed writes, the counter); the Triton kernel is checked against it bit for bit.
        """
        if not self._check(ring, key, gate, positions, row_seq, state_slots, num_accepted_tokens):
            return
        S, R = self.num_state_slots, self.max_rows
        N, B = positions.shape[0], state_slots.shape[0]
        dev = ring.device
        positions = positions.to(torch.int64)
        row_seq = row_seq.to(torch.int64)
        slots_b = state_slots.to(torch.int64)

        # Step geometry per *slot*, from the rows. Every sequence naming slot s then computes identical
        # values for s, so duplicate (stale) slot ids in state_slots write identical bytes: no race.
        row_ok = (row_seq >= 0) & (row_seq < B)
        row_slot = slots_b[row_seq.clamp(0, B - 1)]
        row_ok &= (row_slot >= 0) & (row_slot < S)
        row_slot = torch.where(row_ok, row_slot, S)
        width = self._slot_width.zero_().scatter_add_(0, row_slot, torch.ones_like(row_slot))
        first_pos = self._slot_first_pos.fill_(_INT64_MAX).scatter_reduce_(0, row_slot, positions, "amin")
        row_ids = torch.arange(N, dtype=torch.int64, device=dev)
        first_row = self._slot_first_row.fill_(N).scatter_reduce_(0, row_slot, row_ids, "amin")

        # Per sequence: the slot it names (clamped into range; an out-of-range id then just recomputes some
        # valid slot's values, identical to what that slot's own sequence writes).
        s = slots_b.clamp(0, S - 1)
        W, p0, r0 = width[s], first_pos[s], first_row[s]
        touched = W > 0
        count = self._saved_count[s]
        restore = touched & (count > 0)

        # 1. Restore: snapshot, then the last (up to 4) accepted saved rows into their distinct entries.
        a_raw = p0 - self.saved_pos[s]
        a = torch.minimum(a_raw.clamp(min=0), count)
        base = torch.where(restore[:, None, None, None], self.snapshot[s], ring[s])  # [B, 2, 4, D]
        # Entry m was last written by saved row i_m = a-1-j, j = (saved_pos + a-1 - m) % 4 (if i_m >= 0).
        last = self.saved_pos[s, None] + a[:, None] - 1
        i_m = a[:, None] - 1 - (last - self._entries) % INDEX_KPOOL  # [B, 4]
        replay = restore[:, None] & (i_m >= 0)
        rows = self.saved_rows[s[:, None], i_m.clamp(0, R - 1)]  # [B, 4, 2, D]
        restored = torch.where(replay[:, None, :, None], rows.transpose(1, 2), base)
        ring[s] = restored

        # 2. Backup of this step (width > 1 only).
        backup = touched & (W > 1) & (W <= R)
        self.snapshot[s] = torch.where(backup[:, None, None, None], restored, self.snapshot[s])
        take = backup[:, None] & (self._row_ids < W[:, None])  # [B, R]
        src = (r0[:, None] + self._row_ids).clamp(0, N - 1)
        new_rows = torch.stack((key.to(torch.float32)[src], gate.to(torch.float32)[src]), dim=2)  # [B, R, 2, D]
        self.saved_rows[s] = torch.where(take[:, :, None, None], new_rows, self.saved_rows[s])
        self.saved_pos[s] = torch.where(backup, p0, self.saved_pos[s])
        self._saved_count[s] = torch.where(backup, W, torch.where(touched, 0, count))

        # Counted per sequence that owns the slot's rows (not per slot entry), so stale duplicates count nothing.
        seq_ids = torch.arange(B, dtype=torch.int64, device=dev)
        active = touched & (slots_b == s) & (row_seq[r0.clamp(max=N - 1)] == seq_ids)
        odd = restore & (a != a_raw)
        if num_accepted_tokens is not None:
            odd |= restore & (num_accepted_tokens.to(torch.int64) != a_raw)
        odd |= touched & (W > R)
        self.num_disagreements_t += (active & odd).sum()

    def _check(
        self,
        ring: torch.Tensor,
        key: torch.Tensor,
        gate: torch.Tensor,
        positions: torch.Tensor,
        row_seq: torch.Tensor,
        state_slots: torch.Tensor,
        num_accepted_tokens: torch.Tensor | None,
    ) -> bool:
        """Validate `prepare_step`'s shapes (host-side, no sync); False when the step has no row or no sequence."""
        S, D = self.num_state_slots, INDEX_HEAD_DIM
        if ring.shape != (S, 2, INDEX_KPOOL, D) or ring.dtype != torch.float32:
            raise ValueError(f"ring must be [{S}, 2, {INDEX_KPOOL}, {D}] fp32, got {tuple(ring.shape)} {ring.dtype}")
        N, B = positions.shape[0], state_slots.shape[0]
        if (
            key.shape != (N, D)
            or gate.shape != (N, D)
            or positions.dim() != 1
            or row_seq.shape != (N,)
            or state_slots.dim() != 1
        ):
            raise ValueError(
                f"expected key/gate [N, {D}], positions/row_seq [N] and state_slots [B], got key "
                f"{tuple(key.shape)}, gate {tuple(gate.shape)}, positions {tuple(positions.shape)}, row_seq "
                f"{tuple(row_seq.shape)}, state_slots {tuple(state_slots.shape)}"
            )
        if num_accepted_tokens is not None and num_accepted_tokens.shape != (B,):
            raise ValueError(f"num_accepted_tokens must be [B={B}], got {tuple(num_accepted_tokens.shape)}")
        return N > 0 and B > 0
