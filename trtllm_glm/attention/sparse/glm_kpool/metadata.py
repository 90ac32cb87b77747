"""`GlmKpoolMetadata`: batch metadata of the k-pool sparse MLA backend.

Adds to `AttentionMetadata` the persistent device slot table ``[max_num_seqs, max_pages_per_seq]`` (pinned,
double-buffered host staging; one non-blocking copy per step) and the persistent selection buffer. A request that
needs a wider table than was allocated raises `TableWidthError` (never a reallocation, never a truncation). Draft
forwards with a separate draft KV manager: `prepare_for_draft_forward` fills ``draft_slot_table`` /
``draft_state_slots`` (never while a graph captures) and *rebinds* the active binding to them,
`restore_after_draft_forward` rebinds the target's; nothing is copied into the target buffers, so the target binding
survives any failure of the draft path. docs/design.md §5 and §6.1.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch

from .... import traffic
from ....errors import StateError, TableWidthError
from ...interface import PagedCacheManager
from ...metadata import AttentionMetadata, HostStaging

__all__ = ["DraftBinding", "GlmKpoolMetadata"]


def _is_capturing(device: torch.device) -> bool:
    """Whether the current CUDA stream is capturing a graph (always False off CUDA / on CPU-only builds)."""
    return device.type == "cuda" and torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


@dataclass(frozen=True)
class DraftBinding:
    """What `GlmKpoolMetadata.prepare_for_draft_forward` replaced; hand it back to restore.

    Attributes:
        slot_table: the slot table bound before (the tensor object itself).
        state_slots_buf: the state-slot buffer bound before.
        kv_cache_manager: the manager bound before.
        tokens_per_block: the page size bound before.
        host_batch: every attribute before (a shallow snapshot of ``vars()``), when the draft forward swapped
            lengths (``prepare`` reassigns the host batch lists and per-step fields); else None.
        shared: True when nothing was swapped (no draft manager, or the draft shares the target manager).
    """

    slot_table: torch.Tensor
    state_slots_buf: torch.Tensor
    kv_cache_manager: PagedCacheManager
    tokens_per_block: int
    host_batch: dict[str, Any] | None = None
    shared: bool = False


class GlmKpoolMetadata(AttentionMetadata):
    """Batch metadata with paged slot tables for the k-pool sparse MLA layers.

    Args:
        kv_cache_manager: the (target) manager whose page ids the slot table holds.
        max_num_seqs: sequences per step.
        max_num_tokens: flat rows per step.
        max_pages_per_seq: width of the persistent slot table.
        select_width: selection width (``index_topk + 3``).
        device: device of the persistent buffers.
        max_draft_pages_per_seq: width of the persistent draft slot table (default ``max_pages_per_seq``).

    Device views after ``prepare()``:
        slot_table_t ``[B, W]`` int32 rows of the active table (unused entries are -1; ``W`` is
        ``max_pages_per_seq``, or ``max_draft_pages_per_seq`` while a draft binding is active),
        state_slots_t ``[B]`` int64 state slots of the active manager,
        selection buffer via ``selection(n)`` ``[n, select_width]`` int32.

    Bindings: ``slot_table`` is the table kernels read (through ``slot_table_t``); it is either
    ``target_slot_table`` or ``draft_slot_table``, never a copy. Likewise ``state_slots_buf`` is either
    ``target_state_slots`` (row 0 of the per-sequence buffer) or ``draft_state_slots``.
    """

    def __init__(
        self,
        *,
        kv_cache_manager: PagedCacheManager,
        max_num_seqs: int,
        max_num_tokens: int,
        max_pages_per_seq: int,
        select_width: int,
        device: torch.device | str = "cpu",
        max_draft_pages_per_seq: int | None = None,
    ) -> None:
        super().__init__(max_num_seqs=max_num_seqs, max_num_tokens=max_num_tokens, device=device)
        if max_pages_per_seq <= 0:
            raise ValueError("max_pages_per_seq must be positive")
        if max_draft_pages_per_seq is None:
            max_draft_pages_per_seq = max_pages_per_seq
        if max_draft_pages_per_seq <= 0:
            raise ValueError("max_draft_pages_per_seq must be positive")
        self.kv_cache_manager = kv_cache_manager
        self.target_kv_cache_manager = kv_cache_manager
        self.max_pages_per_seq = max_pages_per_seq
        self.tokens_per_block = kv_cache_manager.tokens_per_block
        self.select_width = select_width
        self.target_slot_table = torch.full(
            (max_num_seqs, max_pages_per_seq), -1, dtype=torch.int32, device=self.device
        )
        # The table kernels read. Draft forwards rebind it to a draft buffer (never overwrite it).
        self.slot_table = self.target_slot_table
        self._table_staging = HostStaging(
            {"table": (self.target_slot_table.shape, torch.int32)}, pin_memory=self.device.type == "cuda"
        )
        self._table_rows = _TableRows(self._table_staging, "table")
        # Rows of the table last copied to ``target_slot_table`` (None: none yet); nothing rewrites that buffer on the
        # device, so an equal table is not copied again (`_fill_table`).
        self._table_on_device: int | None = None
        self.selection_buf = torch.full((max_num_tokens, select_width), -1, dtype=torch.int32, device=self.device)
        # Power-of-two score widths where the indexer's kernels are compiled (`score_columns`).
        self.round_score_columns = self.device.type == "cuda"
        # Set while a CUDA graph is captured: the score width baked into the graph must hold any later
        # replay's pools, so it is the table's capacity rather than this step's longest sequence.
        self.graph_max_pools: int | None = None

        # Draft domain: allocated here, once, so that a graph captured with the draft binding reads a
        # fixed address that every later pre-replay prepare refreshes in place.
        self.max_draft_pages_per_seq = max_draft_pages_per_seq
        self.draft_slot_table = torch.full(
            (max_num_seqs, max_draft_pages_per_seq), -1, dtype=torch.int32, device=self.device
        )
        self.draft_state_slots = torch.zeros(max_num_seqs, dtype=torch.int64, device=self.device)
        # A view of the per-sequence buffer's state-slot row: the target binding is the buffer `prepare()`
        # fills, so binding it costs nothing and the target path reads exactly what it read before.
        self.target_state_slots = self._seq_buf[0]
        self.state_slots_buf = self.target_state_slots
        self._draft_staging = HostStaging(
            {
                "table": (self.draft_slot_table.shape, torch.int32),
                "slots": (self.draft_state_slots.shape, torch.int64),
            },
            pin_memory=self.device.type == "cuda",
        )
        self._draft_rows = _TableRows(self._draft_staging, "table")

    # --------------------------------------------------------------------------------------------
    @property
    def max_num_pages_tokens(self) -> int:
        """Tokens a sequence can hold under this table width."""
        return self.max_pages_per_seq * self.tokens_per_block

    @property
    def page_size(self) -> int:
        """Deprecated name of ``tokens_per_block`` (the page size of the bound manager)."""
        return self.tokens_per_block

    def prepare(  # type: ignore[override]
        self,
        request_ids: Sequence[int],
        past_lens: Sequence[int],
        q_lens: Sequence[int],
        num_decode_seqs: int,
        state_slots: Sequence[int] | None = None,
        num_padding_seqs: int = 0,
        valid_q_lens: Sequence[int] | None = None,
        live_q_lens: Sequence[int] | None = None,
    ) -> None:
        """Describe the step and refresh lengths, positions, state slots and the slot table in place.

        Args:
            request_ids: ``[B]`` requests, decode/verify sequences first.
            past_lens: ``[B]`` cached tokens before this step.
            q_lens: ``[B]`` rows per sequence this step.
            num_decode_seqs: leading decode/verify sequences.
            state_slots: ``[B]`` state slots; defaults to the manager's. Required with padding.
            num_padding_seqs: trailing CUDA-graph padding sequences: not in the manager (their ids are
                ignored), an all ``-1`` slot-table row, rows with ``row_seq = -1``; ``state_slots`` names
                the slot their KDA rows may scribble on (the executor's reserved padding slot).
            valid_q_lens: optional ``[B]`` real rows per sequence (the rest padding of a captured width).
            live_q_lens: optional ``[B]`` rows per sequence whose outputs are read (``row_live_t``; verify
                filler past them is still computed and cached, its routed experts skipped).

        Raises:
            StateError: a draft binding is active (restore it first; filling now would put the draft
                manager's ids into the target table).
        """
        if self.draft_binding_active:
            raise StateError(
                "prepare() called while a draft binding is active; call restore_after_draft_forward() first"
            )
        mgr = self.kv_cache_manager
        if num_padding_seqs and state_slots is None:
            raise ValueError("padded prepare() needs explicit state_slots (the padding slot included)")
        real = list(request_ids)[: len(request_ids) - num_padding_seqs]
        if state_slots is None:
            state_slots = mgr.get_batch_state_slots(real)
        tables = mgr.page_lists(real)
        q_real = valid_q_lens if valid_q_lens is not None else q_lens
        P = mgr.tokens_per_block
        for rid, p, q, row in zip(real, past_lens, q_real, tables):
            need = -(-(p + q) // P)
            if need > len(row) or need > self.max_pages_per_seq:
                if need > self.max_pages_per_seq:
                    raise TableWidthError(
                        f"request {rid} needs {need} pages for {p + q} tokens but the slot table holds "
                        f"max_pages_per_seq={self.max_pages_per_seq}"
                    )
                raise TableWidthError(f"request {rid} has {len(row)} pages allocated but {need} are needed")
        super().prepare(
            request_ids, past_lens, q_lens, state_slots, num_decode_seqs, num_padding_seqs, valid_q_lens, live_q_lens
        )
        self._fill_table(self.target_slot_table, tables)

    def _fill_table(self, dst: torch.Tensor, tables: Sequence[Sequence[int]]) -> None:
        """Write ``tables`` (raw page ids) into persistent ``dst`` through staging; rest is -1."""
        width = dst.shape[1]
        for i, row in enumerate(tables):
            if len(row) > width:
                raise TableWidthError(f"slot table row {i} holds {len(row)} pages but the buffer is {width} wide")
        st = self._table_staging
        host = st.acquire()["table"]
        self._table_rows.write(tables)
        B = len(tables)
        if self._table_on_device == B:
            # Nothing rewrites the target table on the device: it holds the set copied last (the other one).
            last = st.all_arrays()[st.index ^ 1]["table"]
            if np.array_equal(st.arrays()["table"][:B], last[:B]):
                self.num_copies_skipped += 1
                return  # the current set stays current: nothing was copied from it
        dst.copy_(host, non_blocking=True)
        traffic.put()
        st.release()
        self._table_on_device = B

    @property
    def slot_table_t(self) -> torch.Tensor:
        """Active slot table rows of this step ``[B, W]`` (target or draft binding)."""
        return self.slot_table[: self.num_seqs]

    @property
    def state_slots_t(self) -> torch.Tensor:
        """State slots of this step's sequences in the active manager ``[B]`` int64."""
        return self.state_slots_buf[: self.num_seqs]

    # --------------------------------------------------------------------------------------------
    # Draft forwards (docs/design.md §5, hazard §6.1)
    @property
    def draft_binding_active(self) -> bool:
        """True while the draft buffers are bound (between prepare and restore of a draft forward)."""
        return self.slot_table is not self.target_slot_table or self.state_slots_buf is not self.target_state_slots

    def prepare_for_draft_forward(
        self,
        draft_kv_cache_manager: PagedCacheManager | None = None,
        *,
        past_lens: Sequence[int] | None = None,
        q_lens: Sequence[int] | None = None,
        num_decode_seqs: int | None = None,
    ) -> DraftBinding:
        """Bind the draft manager's own slot table and state slots for a draft forward.

        With no draft manager, or one that is the target manager (shared mode: the MTP layer's pages live
        in the target manager), the tables are left alone. Otherwise the draft manager's slot tables and
        state slots of this step's requests are validated, written into the persistent draft buffers and
        those buffers are bound (``slot_table is draft_slot_table``); the target buffers are never written.
        While a CUDA graph is capturing nothing is filled (a fill would be recorded from host staging, and
        staging waits on events): only the binding changes, and the pre-replay call of this method (outside
        capture) fills the same buffers before each replay.

        Every check runs before anything is written or rebound, so a raise leaves the metadata as it was.

        Args:
            draft_kv_cache_manager: the draft's manager; None or the target manager means shared mode.
            past_lens: optional ``[B]`` cached tokens of the draft forward (default: this step's).
            q_lens: optional ``[B]`` rows of the draft forward (default: this step's).
            num_decode_seqs: optional leading decode sequences of the draft forward (default: this step's).

        Returns:
            What was replaced; pass it to `restore_after_draft_forward`.

        Raises:
            ValueError: the draft manager's page size differs from the target's.
            TableWidthError: a draft row is wider than ``max_draft_pages_per_seq`` (nothing is truncated),
                or a request lacks a page its draft kv length needs.
            RuntimeError: lengths were given while a graph is capturing.
        """
        saved = DraftBinding(
            slot_table=self.slot_table,
            state_slots_buf=self.state_slots_buf,
            kv_cache_manager=self.kv_cache_manager,
            tokens_per_block=self.tokens_per_block,
        )
        swap_lengths = past_lens is not None or q_lens is not None or num_decode_seqs is not None
        shared = draft_kv_cache_manager is None or draft_kv_cache_manager is self.target_kv_cache_manager
        if shared and not swap_lengths:
            return replace(saved, shared=True)
        capturing = _is_capturing(self.device)
        if swap_lengths and capturing:
            raise RuntimeError("draft lengths must be prepared outside graph capture (before capture or replay)")
        mgr = self.target_kv_cache_manager if shared else draft_kv_cache_manager
        assert mgr is not None
        if mgr.tokens_per_block != self.target_kv_cache_manager.tokens_per_block:
            raise ValueError(
                f"the draft manager's tokens_per_block={mgr.tokens_per_block} differs from the target's "
                f"{self.target_kv_cache_manager.tokens_per_block}; draft and target must share one page size"
            )
        rids = self.request_ids
        past = list(past_lens) if past_lens is not None else self.past_lens
        ql = list(q_lens) if q_lens is not None else self.q_lens
        # Page checks count real rows only (rows past a sequence's valid length are padding).
        q_real = list(q_lens) if q_lens is not None else (self.valid_q_lens or self.q_lens)
        nd = num_decode_seqs if num_decode_seqs is not None else self.num_decode_seqs
        if len(past) != len(rids) or len(ql) != len(rids):
            raise ValueError(f"draft past_lens/q_lens must have one entry per sequence ({len(rids)})")

        # During capture the draft manager is not even asked: the batch being captured may be a warm-up
        # batch, and the pre-replay call validates and fills the real one.
        fill = not shared and not capturing
        # CUDA-graph padding sequences (trailing) have no pages anywhere: empty rows, slot 0 (their rows
        # have row_seq = -1, so no kernel reads either).
        n_real = len(rids) - self.num_padding_seqs
        if fill or swap_lengths:
            tables = mgr.page_lists(rids[:n_real])
            width = self.max_pages_per_seq if shared else self.max_draft_pages_per_seq
            for rid, p, q, row in zip(rids, past, q_real, tables):
                if len(row) > width:
                    what = (
                        "slot table is max_pages_per_seq" if shared else "draft slot table is max_draft_pages_per_seq"
                    )
                    raise TableWidthError(f"request {rid} holds {len(row)} pages but the {what}={width} wide")
                need = mgr.pages_needed(p + q)
                if need > len(row):
                    raise TableWidthError(
                        f"request {rid} has {len(row)} {'target' if shared else 'draft'} pages allocated but "
                        f"{need} are needed for {p + q} tokens"
                    )
            slots = mgr.get_batch_state_slots(rids[:n_real]) + [0] * (len(rids) - n_real) if fill else []
            tables = tables + [[]] * (len(rids) - n_real)
        host_batch = None
        if swap_lengths:
            # A shallow snapshot of every attribute: `prepare` reassigns (never mutates) its host fields, and
            # other components add per-step fields that it resets, so identity restore brings all of them back.
            host_batch = dict(vars(self))
            # Validates before writing anything; rewrites the per-sequence/per-token buffers in place (same
            # addresses). Row 0 keeps the target's state slots: the draft's live in their own buffer.
            AttentionMetadata.prepare(self, rids, past, ql, host_batch["state_slots"], nd)
        if fill:
            try:
                self._fill_draft(tables, slots)
            except BaseException:
                if host_batch is not None:
                    self._restore_host_batch(host_batch)
                raise
        if not shared:
            self.slot_table = self.draft_slot_table
            self.state_slots_buf = self.draft_state_slots
            self.kv_cache_manager = mgr
            self.tokens_per_block = mgr.tokens_per_block
        return replace(saved, host_batch=host_batch, shared=shared)

    def restore_after_draft_forward(self, saved: DraftBinding) -> None:
        """Rebind what `prepare_for_draft_forward` replaced (target table, state slots, manager, lengths).

        When the draft forward swapped lengths, every attribute is restored by identity and, outside graph
        capture, the per-sequence/per-token buffers are refilled with the target's lengths (during capture
        the caller must run ``prepare()`` again before the next target forward).
        """
        self.slot_table = saved.slot_table
        self.state_slots_buf = saved.state_slots_buf
        self.kv_cache_manager = saved.kv_cache_manager
        self.tokens_per_block = saved.tokens_per_block
        if saved.host_batch is not None:
            self._restore_host_batch(saved.host_batch)

    def _restore_host_batch(self, host_batch: dict[str, Any]) -> None:
        """Put the saved attributes back (identity) and, outside capture, refill the batch's device buffers."""
        if not _is_capturing(self.device):
            AttentionMetadata.prepare(
                self,
                host_batch["request_ids"],
                host_batch["past_lens"],
                host_batch["q_lens"],
                host_batch["state_slots"],
                host_batch["num_decode_seqs"],
            )
        for k in [k for k in vars(self) if k not in host_batch]:
            delattr(self, k)
        self.__dict__.update(host_batch)

    def _fill_draft(self, tables: Sequence[Sequence[int]], slots: Sequence[int]) -> None:
        """Write the draft rows and state slots into the persistent draft buffers through their staging."""
        host = self._draft_staging.acquire()
        ht, hs = host["table"], host["slots"]
        arr = self._draft_staging.arrays()
        self._draft_rows.write(tables)
        arr["slots"][:] = 0
        arr["slots"][: len(slots)] = slots
        self.draft_slot_table.copy_(ht, non_blocking=True)
        self.draft_state_slots.copy_(hs, non_blocking=True)
        traffic.put(n=2)
        self._draft_staging.release()

    def draft_swap_addresses(self) -> dict[str, set[int]]:
        """The declared swaps of a draft forward, for `GraphAddressGuard.check` (name -> allowed addresses)."""
        return {
            "slot_table": {self.target_slot_table.data_ptr(), self.draft_slot_table.data_ptr()},
            "state_slots": {self.target_state_slots.data_ptr(), self.draft_state_slots.data_ptr()},
        }

    def selection(self, num_rows: int) -> torch.Tensor:
        """The persistent selection buffer's first ``num_rows`` rows, filled with -1 (``[n, width]``)."""
        sel = self.selection_buf[:num_rows]
        sel.fill_(-1)
        return sel

    @property
    def max_pools(self) -> int:
        """Upper bound on complete pools any row of this step can see (host-known).

        While ``graph_max_pools`` is set (graph capture) it is that fixed bound instead: scores of pools a
        row cannot see yet are ``-inf`` and never selected, so the selection is the same.
        """
        if self.graph_max_pools is not None:
            return self.graph_max_pools
        return self.max_kv_len // 4

    @property
    def score_columns(self) -> int:
        """Columns of the indexer's ``[N, columns]`` score matrix this step: `max_pools` rounded up to a power of
        two (eager steps), or ``graph_max_pools`` under capture.

        The top-k launch derives compile-time constants from the column count (chunks per row, evenness), and
        Triton specialises integer arguments on their divisibility by 16; a growing prompt's chunks would
        otherwise each see a new count and compile new kernels (a 1M-token prompt in 8K chunks: 128 of them,
        ~1 s each), and decoding would compile again every few hundred tokens. Powers of two bound that to about
        ``log2(max_pools)`` shapes; columns past a row's complete pools score ``-inf`` and are never selected, so
        the selection is the same. Cost: at most twice the score bytes (fp32 per column). Only where kernels are
        compiled (`round_score_columns`: CUDA buffers): the CPU's reference scoring would pay the padding columns
        and compiles nothing.
        """
        if self.graph_max_pools is not None:
            return self.graph_max_pools
        n = self.max_kv_len // 4
        if not self.round_score_columns:
            return n
        return 1 << (n - 1).bit_length() if n > 1 else n

    @property
    def graph_pool_capacity(self) -> int:
        """Complete pools a sequence of the widest slot-table row can have (a bound for captured graphs)."""
        return self.max_num_pages_tokens // 4

    def graph_buffers(self) -> dict[str, torch.Tensor]:
        """Persistent tensors a captured graph may read, by name.

        ``slot_table`` and ``state_slots`` are the *active* bindings (what kernels read); the persistent
        buffers behind them are reported under their own names as well.
        """
        d = super().graph_buffers()
        d.update(
            slot_table=self.slot_table,
            state_slots=self.state_slots_buf,
            target_slot_table=self.target_slot_table,
            draft_slot_table=self.draft_slot_table,
            draft_state_slots=self.draft_state_slots,
            selection_buf=self.selection_buf,
        )
        return d


class _TableRows:
    """Slot-table rows written into a double-buffered staging table, each set only where it changed.

    Rewriting whole rows every step costs ~260 µs at batch 64 with 3K-token contexts (188 pages a row) and
    grows with the context, while a decode step adds a page to a row only every ``tokens_per_block`` tokens. Per
    staging set, this remembers which page list each row holds and how many of its pages are written: the
    manager's own list object for a live allocation (`Glm5NextCacheManager.page_lists`), which only ever
    grows. A row whose list is the same object gets its new pages appended; any other row is rewritten in
    full and its old tail cleared to -1; rows past the batch are cleared. Holding the list objects keeps a
    freed request's list alive, so a later allocation can never be the same object. The invariant: row
    ``i`` of a set holds ``lists[i][:lens[i]]`` and -1 after it, which `_write_rows` (the reference) checks
    in the tests.
    """

    def __init__(self, staging: HostStaging, key: str) -> None:
        self.staging, self.key = staging, key
        rows = staging.arrays()[key].shape[0]
        for arrays in staging.all_arrays():
            arrays[key][:] = -1
        self.lists: list[list[Sequence[int] | None]] = [[None] * rows, [None] * rows]
        self.lens = [[0] * rows, [0] * rows]

    def write(self, tables: Sequence[Sequence[int]]) -> None:
        """Make the acquired set's table ``tables`` (row ``i`` left-aligned, -1 elsewhere)."""
        s = self.staging.index
        arr = self.staging.arrays()[self.key]
        lists, lens = self.lists[s], self.lens[s]
        for i, row in enumerate(tables):
            n, old = len(row), lens[i]
            if lists[i] is row and old <= n:
                if n > old:
                    arr[i, old:n] = row[old:n]
            else:
                if n:
                    arr[i, :n] = row
                if old > n:
                    arr[i, n:old] = -1
                lists[i] = row
            lens[i] = n
        for i in range(len(tables), len(lists)):
            if lens[i]:
                arr[i, : lens[i]] = -1
                lens[i] = 0
            lists[i] = None


def _write_rows(host: np.ndarray, tables: Sequence[Sequence[int]]) -> None:
    """``host [R, W]`` int32 = ``tables`` (page ids, row ``i`` left-aligned), -1 everywhere else.

    The whole table at once: the reference of `_TableRows`.
    """
    B = len(tables)
    w = max((len(row) for row in tables), default=0)
    if w:
        host[:B, :w] = [[*row, *([-1] * (w - len(row)))] for row in tables]
    host[:B, w:] = -1
    host[B:] = -1
