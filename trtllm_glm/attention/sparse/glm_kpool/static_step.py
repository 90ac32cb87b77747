"""Graph-safe, fixed-shape metadata of the sparse-MLA cores of an admission step, for the piecewise CUDA graphs
(`trtllm_glm.runtime.piecewise`): with it (and the KDA cores' `trtllm_glm.kda.static_step`) a step of decode rows
and short prefills runs its whole trunk as one graph per (bucket, width class).

A captured core cannot take shapes or index tensors from the step's host lists. What `GlmKpoolSparseMLA` and its
indexer read from the metadata is, here, of the bucket's fixed shape:

- positions ``[T]`` and row owners ``[T]``: views of the runner's step buffer, refreshed by the step's one
  host-to-device copy (`describe_sparse_rows`). The ``T - n`` padding rows get ``row_seq = -1`` and position 0:
  every k-pool kernel skips such a row (no latent row, pool, tail-ring entry or score is written or read through
  a slot table; the attention outputs zeros for it), as for the decode graphs' padding sequences, and so do the
  torch references the CPU runs. So padding rows write no page, pool, ring or state slot at all, the padding
  request's included, and add only zero rows to the layer's output.
- state slots ``[min(T, max_num_seqs)]``: in the step buffer too, the batch's then the padding slot (the tail ring's
  rollback visits every entry: one past the batch names the padding slot, which no row of the step names, and
  is rewritten unchanged; never a real request's slot).
- slot table and selection buffer: the metadata's persistent buffers whole (``[max_num_seqs, max_pages_per_seq]``,
  ``[max_num_tokens, width]``): a real row reads entry ``row_seq`` of the table, which `prepare` refreshed in place;
  the rows past the batch are never read (padding rows name none).
- score columns: ``graph_pool_capacity``, the pools of the widest slot-table row (the decode graphs' choice).
  A row's columns past its complete pools score ``-inf`` and are never selected (`select_topk_pools`: the chosen
  pools are the top ``min(topk, n_c)`` of the valid columns, ties to the lower id), so the selection of a real row
  does not depend on the column count.
- the pool and tail writes: without an MTP tail ring every row is written as a prefill chunk
  (``num_decode_tokens = 0``), exactly what the eager indexer does for a mixed step without one
  (`GlmKpoolIndexer.forward`; a step of decode rows only takes its decode pass there: it does not qualify). With a
  tail ring (``pool_rows``) the eager indexer's two passes, each on all ``T`` rows with the other pass's rows
  masked as padding: the decode pass (`update_decode_pools` with the ring's rollback and backup) on the decode rows'
  owners (``-1`` elsewhere), the backups of the prefill sequences' slots dropped (`DecodeTailRing.on_prefill`, a
  fixed ``[T]`` list padded with ``-1``, which it ignores), then the prefill pass on the prefill rows' owners. The
  kernels select a sequence's rows by owner, so each pass sees exactly the rows the eager slice gives it.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ....state.spec_metadata import SpecMetadata

__all__ = ["StaticSparseStep", "describe_sparse_rows", "sparse_rows_size"]


def sparse_rows_size(rows: int, ring: bool) -> int:
    """int64 entries of a ``rows``-row bucket's description: positions, owners and state slots, with a tail ring also
    the decode and prefill passes' owners and the prefill sequences' slots."""
    return (6 if ring else 3) * rows


class StaticSparseStep:
    """What a sparse-MLA layer reads as ``meta`` inside a captured piecewise graph of ``T`` rows (module doc).

    Quacks like the `GlmKpoolMetadata` attributes `GlmKpoolSparseMLA.forward` and `GlmKpoolIndexer.forward` read:
    ``positions_t``, ``row_seq_t``, ``slot_table_t``, ``state_slots_t``, ``num_decode_tokens`` (0),
    ``num_decode_seqs`` (0), ``selection_buf`` / ``selection``, ``score_columns`` and ``spec`` (an empty
    `SpecMetadata` but for ``num_accepted_t``; the indexer leaves its ``last_pool_ids`` there), and ``pool_rows``:
    None, or with a tail ring ``(decode owners [T], prefill owners [T], prefill slots [T])`` (the module doc).

    Args:
        buf: ``[sparse_rows_size(T, ring)]`` int64 device view of the runner's step buffer: positions, row owners,
            state slots (``[T]``, the first ``Sb`` read) and, with ``ring``, the decode pass's owners, the prefill
            pass's owners, the prefill sequences' slots.
        slot_table: ``[max_num_seqs, W]`` int32, the metadata's persistent target slot table (whole).
        selection_buf: ``[max_num_tokens, width]`` int32, the metadata's persistent selection buffer (whole).
        score_columns: the score matrix's columns (``graph_pool_capacity``).
        max_seqs: the metadata's ``max_num_seqs``: ``Sb = min(T, max_seqs)`` state-slot entries.
        ring: the layers have MTP tail rings (the eager indexer's two passes).
        num_accepted: ``[max_seqs]`` int64, the metadata's persistent accepted counts (its first ``Sb`` read: the
            ring's cross-check), or None.
    """

    num_decode_tokens = 0
    num_decode_seqs = 0

    def __init__(
        self,
        buf: torch.Tensor,
        slot_table: torch.Tensor,
        selection_buf: torch.Tensor,
        score_columns: int,
        max_seqs: int,
        *,
        ring: bool = False,
        num_accepted: torch.Tensor | None = None,
    ) -> None:
        k = 6 if ring else 3
        T = buf.shape[0] // k
        if buf.shape != (k * T,) or buf.dtype != torch.int64 or selection_buf.shape[0] < T:
            raise ValueError(f"static sparse step needs [{k} T] int64 with T <= {selection_buf.shape[0]}")
        Sb = min(T, max_seqs)
        self.num_tokens = T
        self.buf = buf
        self.positions_t, self.row_seq_t = buf[:T], buf[T : 2 * T]
        self.state_slots_t = buf[2 * T : 2 * T + Sb]
        self.pool_rows = (buf[3 * T : 4 * T], buf[4 * T : 5 * T], buf[5 * T :]) if ring else None
        self.slot_table_t = slot_table
        self.selection_buf = selection_buf
        self.score_columns = score_columns
        self.spec = SpecMetadata(num_accepted_t=None if num_accepted is None else num_accepted[:Sb])

    def selection(self, num_rows: int) -> torch.Tensor:
        """The selection buffer's first ``num_rows`` rows filled with -1 (`GlmKpoolMetadata.selection`)."""
        sel = self.selection_buf[:num_rows]
        sel.fill_(-1)
        return sel


def describe_sparse_rows(meta: Any, num_rows: int, out: np.ndarray, padding_slot: int, ring: bool = False) -> None:
    """Fill ``out`` (the host side of `StaticSparseStep`'s buffer, ``sparse_rows_size(T, ring)`` entries) with the
    step's positions and row owners (``meta``'s ``num_rows`` real rows, as `AttentionMetadata.prepare` writes them),
    the padding rows position 0 and owner -1, the sequences' state slots, then ``padding_slot``; with ``ring`` also
    the decode pass's owners (the leading ``num_decode_tokens`` rows'), the prefill pass's (the others'), -1
    elsewhere, and the prefill sequences' state slots, -1 after them. ``meta`` None: padding rows only.

    Args:
        meta: the prepared step (`GlmKpoolMetadata`: host ``past_lens``, ``q_lens``, ``cu_seqlens``,
            ``num_decode_tokens``, ``num_decode_seqs``, ``state_slots``), or None.
        num_rows: ``n``, the step's real rows (``<= T``; 0 without ``meta``).
        out: int64 host array.
        padding_slot: the executor's reserved padding slot.
        ring: the layers have MTP tail rings.
    """
    T = out.shape[0] // (6 if ring else 3)
    out[: 2 * T] = -1
    out[:T] = 0
    out[2 * T : 3 * T] = padding_slot
    if ring:
        out[3 * T :] = -1
    if meta is None:
        return
    n, m = num_rows, meta
    q = np.asarray(m.q_lens, dtype=np.int64)
    seq = np.repeat(np.arange(q.shape[0], dtype=np.int64), q)
    starts = np.asarray(m.past_lens, dtype=np.int64) - np.asarray(m.cu_seqlens[:-1], dtype=np.int64)
    out[:n] = starts[seq] + np.arange(n, dtype=np.int64)
    out[T : T + n] = seq
    out[2 * T : 2 * T + q.shape[0]] = m.state_slots
    if not ring:
        return
    nd = m.num_decode_tokens
    out[3 * T : 3 * T + nd] = seq[:nd]
    out[4 * T + nd : 4 * T + n] = seq[nd:]
    pre = m.state_slots[m.num_decode_seqs :]
    out[5 * T : 5 * T + len(pre)] = pre
