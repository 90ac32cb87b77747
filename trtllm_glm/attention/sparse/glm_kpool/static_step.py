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
- slot table, state slots and selection buffer: the metadata's persistent buffers whole (``[max_num_seqs,
  max_pages_per_seq]``, ``[max_num_seqs + 1]``, ``[max_num_tokens, width]``): a real row reads entry ``row_seq``
  of them, which `prepare` refreshed in place; the rows past the batch are never read (padding rows name none).
- score columns: ``graph_pool_capacity``, the pools of the widest slot-table row (the decode graphs' choice).
  A row's columns past its complete pools score ``-inf`` and are never selected (`select_topk_pools`: the chosen
  pools are the top ``min(topk, n_c)`` of the valid columns, ties to the lower id), so the selection of a real row
  does not depend on the column count.
- no decode pass: the indexer writes every row as a prefill chunk (``num_decode_tokens = 0``), exactly what the
  eager indexer does for a mixed step without an MTP tail ring (`GlmKpoolIndexer.forward`). Steps whose eager
  indexer takes the decode pass (decode rows only, or a tail ring) do not qualify.
"""

from __future__ import annotations

import numpy as np
import torch

from ....state.spec_metadata import SpecMetadata

__all__ = ["StaticSparseStep", "describe_sparse_rows"]


class StaticSparseStep:
    """What a sparse-MLA layer reads as ``meta`` inside a captured piecewise graph of ``T`` rows (module doc).

    Quacks like the `GlmKpoolMetadata` attributes `GlmKpoolSparseMLA.forward` and `GlmKpoolIndexer.forward` read:
    ``positions_t``, ``row_seq_t``, ``slot_table_t``, ``state_slots_t``, ``num_decode_tokens`` (0),
    ``num_decode_seqs`` (0), ``selection_buf`` / ``selection``, ``score_columns`` and ``spec`` (an empty
    `SpecMetadata`; the indexer leaves its ``last_pool_ids`` there).

    Args:
        buf: ``[2 * T]`` int64 device view of the runner's step buffer: positions, then row owners.
        slot_table: ``[S, W]`` int32, the metadata's persistent target slot table (whole).
        state_slots: ``[S']`` int64, the metadata's persistent target state slots (whole).
        selection_buf: ``[max_num_tokens, width]`` int32, the metadata's persistent selection buffer (whole).
        score_columns: the score matrix's columns (``graph_pool_capacity``).
    """

    num_decode_tokens = 0
    num_decode_seqs = 0

    def __init__(
        self,
        buf: torch.Tensor,
        slot_table: torch.Tensor,
        state_slots: torch.Tensor,
        selection_buf: torch.Tensor,
        score_columns: int,
    ) -> None:
        T = buf.shape[0] // 2
        if buf.shape != (2 * T,) or buf.dtype != torch.int64 or selection_buf.shape[0] < T:
            raise ValueError(f"static sparse step needs [2 T] int64 with T <= {selection_buf.shape[0]}")
        self.num_tokens = T
        self.positions_t, self.row_seq_t = buf[:T], buf[T:]
        self.slot_table_t = slot_table
        self.state_slots_t = state_slots
        self.selection_buf = selection_buf
        self.score_columns = score_columns
        self.spec = SpecMetadata()

    def selection(self, num_rows: int) -> torch.Tensor:
        """The selection buffer's first ``num_rows`` rows filled with -1 (`GlmKpoolMetadata.selection`)."""
        sel = self.selection_buf[:num_rows]
        sel.fill_(-1)
        return sel


def describe_sparse_rows(meta: object, num_rows: int, out: np.ndarray) -> None:
    """Fill ``out [2 T]`` (the host side of `StaticSparseStep`'s buffer) with the step's positions and row owners
    (``meta``'s ``num_rows`` real rows, as `AttentionMetadata.prepare` writes them), the padding rows position 0
    and owner -1.

    Args:
        meta: the prepared step (`GlmKpoolMetadata`: host ``past_lens``, ``q_lens``, ``cu_seqlens``).
        num_rows: ``n``, the step's real rows (``<= T``).
        out: int64 host array of ``2 T`` entries.
    """
    T = out.shape[0] // 2
    q = np.asarray(meta.q_lens, dtype=np.int64)  # type: ignore[attr-defined]
    seq = np.repeat(np.arange(q.shape[0], dtype=np.int64), q)
    starts = np.asarray(meta.past_lens, dtype=np.int64) - np.asarray(meta.cu_seqlens[:-1], dtype=np.int64)  # type: ignore[attr-defined]
    out[:num_rows] = starts[seq] + np.arange(num_rows, dtype=np.int64)
    out[num_rows:T] = 0
    out[T : T + num_rows] = seq
    out[T + num_rows :] = -1
