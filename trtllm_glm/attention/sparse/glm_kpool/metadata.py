"""`GlmKpoolMetadata`: batch metadata of the k-pool sparse MLA backend.

Adds to `AttentionMetadata` the persistent device slot table ``[max_num_seqs, max_pages_per_seq]``
(pinned, double-buffered host staging; one non-blocking copy per step) and the persistent selection
buffer. Slot tables come from the KV cache manager's ``get_batch_slot_tables``; a request that needs a
wider table than was allocated raises `TableWidthError` (never a reallocation, never a truncation).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ....cache.manager import Glm5NextCacheManager
from ....errors import TableWidthError
from ...metadata import AttentionMetadata, HostStaging

__all__ = ["GlmKpoolMetadata"]


class GlmKpoolMetadata(AttentionMetadata):
    """Batch metadata with paged slot tables for the k-pool sparse MLA layers.

    Args:
        kv_cache_manager: the manager whose page ids the slot table holds.
        max_num_seqs: sequences per step.
        max_num_tokens: flat rows per step.
        max_pages_per_seq: width of the persistent slot table.
        select_width: selection width (``index_topk + 3``).
        device: device of the persistent buffers.

    Device views after ``prepare()``:
        slot_table_t ``[B, max_pages_per_seq]`` int32 (unused entries are -1),
        selection buffer via ``selection(n)`` ``[n, select_width]`` int32.
    """

    def __init__(
        self,
        *,
        kv_cache_manager: Glm5NextCacheManager,
        max_num_seqs: int,
        max_num_tokens: int,
        max_pages_per_seq: int,
        select_width: int,
        device: torch.device | str = "cpu",
    ) -> None:
        super().__init__(max_num_seqs=max_num_seqs, max_num_tokens=max_num_tokens, device=device)
        if max_pages_per_seq <= 0:
            raise ValueError("max_pages_per_seq must be positive")
        self.kv_cache_manager = kv_cache_manager
        self.max_pages_per_seq = max_pages_per_seq
        self.page_size = kv_cache_manager.page_size
        self.select_width = select_width
        self.target_slot_table = torch.full(
            (max_num_seqs, max_pages_per_seq), -1, dtype=torch.int32, device=self.device
        )
        # The table kernels read. Draft forwards rebind it to a draft buffer (never overwrite it).
        self.slot_table = self.target_slot_table
        self._table_staging = HostStaging(
            {"table": (self.target_slot_table.shape, torch.int32)}, pin_memory=self.device.type == "cuda"
        )
        self.selection_buf = torch.full((max_num_tokens, select_width), -1, dtype=torch.int32, device=self.device)

    # --------------------------------------------------------------------------------------------
    @property
    def max_num_pages_tokens(self) -> int:
        """Tokens a sequence can hold under this table width."""
        return self.max_pages_per_seq * self.page_size

    def prepare(  # type: ignore[override]
        self,
        request_ids: Sequence[int],
        past_lens: Sequence[int],
        q_lens: Sequence[int],
        num_decode_seqs: int,
        state_slots: Sequence[int] | None = None,
    ) -> None:
        """Describe the step and refresh lengths, positions, state slots and the slot table in place.

        Args:
            request_ids: ``[B]`` requests, decode/verify sequences first.
            past_lens: ``[B]`` cached tokens before this step.
            q_lens: ``[B]`` rows per sequence this step.
            num_decode_seqs: leading decode/verify sequences.
            state_slots: ``[B]`` state slots; defaults to the manager's.
        """
        mgr = self.kv_cache_manager
        if state_slots is None:
            state_slots = mgr.get_batch_state_slots(request_ids)
        tables = mgr.get_batch_slot_tables(request_ids)
        for rid, p, q, row in zip(request_ids, past_lens, q_lens, tables):
            need = mgr.pages_needed(p + q)
            if need > self.max_pages_per_seq:
                raise TableWidthError(
                    f"request {rid} needs {need} pages for {p + q} tokens but the slot table holds "
                    f"max_pages_per_seq={self.max_pages_per_seq}"
                )
            if need > len(row):
                raise TableWidthError(f"request {rid} has {len(row)} pages allocated but {need} are needed")
        super().prepare(request_ids, past_lens, q_lens, state_slots, num_decode_seqs)
        self._fill_table(self.target_slot_table, tables)

    def _fill_table(self, dst: torch.Tensor, tables: Sequence[Sequence[int]]) -> None:
        """Write ``tables`` (raw page ids) into persistent ``dst`` through staging; rest is -1."""
        width = dst.shape[1]
        for i, row in enumerate(tables):
            if len(row) > width:
                raise TableWidthError(f"slot table row {i} holds {len(row)} pages but the buffer is {width} wide")
        host = self._table_staging.acquire()["table"]
        host.fill_(-1)
        for i, row in enumerate(tables):
            if row:
                host[i, : len(row)] = torch.tensor(row, dtype=torch.int32)
        dst.copy_(host, non_blocking=True)
        self._table_staging.release()

    @property
    def slot_table_t(self) -> torch.Tensor:
        """Active slot table rows of this step ``[B, max_pages_per_seq]``."""
        return self.slot_table[: self.num_seqs]

    def selection(self, num_rows: int) -> torch.Tensor:
        """The persistent selection buffer's first ``num_rows`` rows, filled with -1 (``[n, width]``)."""
        sel = self.selection_buf[:num_rows]
        sel.fill_(-1)
        return sel

    @property
    def max_pools(self) -> int:
        """Upper bound on complete pools any row of this step can see (host-known)."""
        return self.max_kv_len // 4

    def graph_buffers(self) -> dict[str, torch.Tensor]:
        d = super().graph_buffers()
        d.update(slot_table=self.slot_table, selection_buf=self.selection_buf)
        return d
