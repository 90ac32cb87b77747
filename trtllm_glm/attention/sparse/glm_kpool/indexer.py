"""`GlmKpoolIndexer`: the pooled (C4) FP8 (or BF16-key) lightning indexer of a sparse MLA layer.

Projections live here; numerics live in ``ops/`` (torch reference) and ``kernels/`` (Triton), picked by
`kpool_ops`. Per step it writes this step's keys into the cache (decode rows in order, then prefill
chunks), scores every complete pool and returns each row's selected token positions.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ....config import INDEX_HEAD_DIM, INDEX_KPOOL, Glm5NextConfig
from ....linear import linear_fp32, model_linear
from .cache_layout import KpoolLayerCache
from .dispatch import kpool_ops
from .metadata import GlmKpoolMetadata
from .ops import expand_selection_window, indexer_head_weights

__all__ = ["GlmKpoolIndexer"]


class GlmKpoolIndexer(nn.Module):
    """Pooled FP8 lightning indexer (docs/design.md §3).

    Weights (checkpoint names): ``wq_b [H_i * 128, q_lora]``, ``wk [128, hidden]``, ``k_norm`` (LayerNorm
    128, eps 1e-6), ``index_kpool_compress_gate [128, hidden]`` (a bare parameter: per-channel pooling
    gate logits), ``weights_proj [H_i, hidden]`` (head weights, applied in FP32) and
    ``index_kpool_compress_ape [4, 128]`` (learned position bias of the pool members).
    """

    def __init__(self, config: Glm5NextConfig) -> None:
        super().__init__()
        D, Hi = config.hidden_size, config.index_n_heads
        self.n_heads = Hi
        self.topk_pools = config.index_topk_pools
        self.select_width = config.index_select_width
        self.wq_b = nn.Linear(config.q_lora_rank, Hi * INDEX_HEAD_DIM, bias=False)
        self.wk = nn.Linear(D, INDEX_HEAD_DIM, bias=False)
        self.k_norm = nn.LayerNorm(INDEX_HEAD_DIM, eps=1e-6)
        self.index_kpool_compress_gate = nn.Parameter(torch.zeros(INDEX_HEAD_DIM, D))
        self.weights_proj = nn.Linear(D, Hi, bias=False)
        self.index_kpool_compress_ape = nn.Parameter(torch.zeros(INDEX_KPOOL, INDEX_HEAD_DIM))
        # `_k_norm_fp32`'s cached FP32 copies: (key, weight, bias).
        self._k_norm_cache: tuple[tuple, torch.Tensor, torch.Tensor] | None = None

    @torch.no_grad()
    def reset_parameters(self, generator: torch.Generator, std: float) -> None:
        from ....modules.init import init_linear_

        init_linear_(self, generator, std)
        self.k_norm.weight.fill_(1.0)
        self.k_norm.bias.zero_()
        gate = self.index_kpool_compress_gate
        gate.copy_(torch.empty(gate.shape).normal_(0.0, std, generator=generator))
        ape = self.index_kpool_compress_ape
        ape.copy_(torch.randn(ape.shape, generator=generator))

    def keys(
        self, h: torch.Tensor, projected: tuple[torch.Tensor, torch.Tensor] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Normalised index keys and pooling gate logits, both FP32 ``[N, 128]``.

        Args:
            h: ``[N, hidden]`` layer input rows.
            projected: ``(wk(h), h @ index_kpool_compress_gate^T)`` when the caller's fused GEMM computed them.
        """
        if projected is None:
            projected = (self.wk(h), model_linear(h, self.index_kpool_compress_gate.to(h.dtype)))
        raw_k, gate = projected
        weight, bias = self._k_norm_fp32()
        k = F.layer_norm(raw_k.float(), (INDEX_HEAD_DIM,), weight, bias, 1e-6)
        return k, gate.float()

    def _k_norm_fp32(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``k_norm``'s ``weight`` and ``bias`` ``[128]`` in FP32: the parameters themselves when they are FP32, else
        copies made once and kept while both keep their storage and version (a 16-bit model otherwise cast both,
        two launches, in every sparse layer of every step). A miss while a CUDA graph captures casts without keeping
        the copies (memory of the graph's pool is not ours to keep), as every call did before. A captured graph reads
        the copies: changed weights reach it at the next eager call, which refreshes them in place."""
        w, b = self.k_norm.weight, self.k_norm.bias
        if w.dtype == torch.float32 and b.dtype == torch.float32:
            return w, b
        key = (w.data_ptr(), w._version, w.dtype, b.data_ptr(), b._version, b.dtype)
        hit = self._k_norm_cache
        if hit is not None and hit[0] == key:
            return hit[1], hit[2]
        if w.is_cuda and torch.cuda.is_current_stream_capturing():
            return w.float(), b.float()
        with torch.inference_mode(False), torch.no_grad():
            if hit is not None and hit[1].shape == w.shape and hit[2].shape == b.shape and hit[1].device == w.device:
                wf, bf = hit[1].copy_(w), hit[2].copy_(b)  # the addresses a captured graph reads
            else:
                wf, bf = w.float(), b.float()
        self._k_norm_cache = (key, wf, bf)
        return wf, bf

    def forward(
        self,
        h: torch.Tensor,
        q_lora: torch.Tensor,
        meta: GlmKpoolMetadata,
        cache: KpoolLayerCache,
        projected: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Write this step's index keys into ``cache`` and select attention columns.

        Args:
            h: ``[N, hidden]`` layer input rows (decode rows first, then prefill chunks).
            q_lora: ``[N, q_lora]`` normalised MLA query low-rank rows.
            meta: the step's metadata (positions, slot table, state slots), or a `StaticSparseStep` (a captured
                piecewise step: its ``pool_rows`` give the two passes' rows with a tail ring).
            cache: this layer's cache planes.
            projected: the raw key and pooling-gate projections of ``h`` (`keys`), when already computed.

        Returns:
            ``[N, index_topk + 3]`` int32 selected token positions, -1 padded.
        """
        N = h.shape[0]
        ops = kpool_ops(h.device)
        key, gate = self.keys(h, projected)
        ape = self.index_kpool_compress_ape.float()
        pos, rs = meta.positions_t, meta.row_seq_t
        table, slots = meta.slot_table_t, meta.state_slots_t
        nd = meta.num_decode_tokens
        ring = cache.decode_tail_ring
        pool_rows = getattr(meta, "pool_rows", None)
        if pool_rows is not None:
            # A captured piecewise step's fixed-shape rows (`StaticSparseStep`, which has them only with a tail ring):
            # the two passes below on every row, each with the other pass's rows as padding (the kernels select a
            # sequence's rows by owner: each pass sees the rows the slices below give it).
            assert ring is not None
            dec_rs, pre_rs, pre_slots = pool_rows
            kw = {"tail_ring": ring, "num_accepted_tokens": meta.spec.num_accepted_t}
            ops.update_decode_pools(cache, key, gate, ape, pos, dec_rs, table, slots, **kw)
            ring.on_prefill(pre_slots)
            ops.update_prefill_pools(cache, key, gate, ape, pos, pre_rs, table, slots)
            ops.write_prefill_tail(cache.tail_ring, key, gate, pos, pre_rs, slots)
        else:
            if ring is None and 0 < nd < N:
                # A mixed step without verify backups: each decode sequence's rows are a chunk continuing it (pool
                # members before them from the ring, as the decode pass reads them), so the prefill writes take
                # every row, the same bits (`pool4` / `rotate_quant_rows` either way) in two launches instead of
                # three.
                nd = 0
            if nd:
                # Verify rounds roll the ring back to the accepted prefix of the previous step first (§6.2).
                kw = {} if ring is None else {"tail_ring": ring, "num_accepted_tokens": meta.spec.num_accepted_t}
                ops.update_decode_pools(cache, key[:nd], gate[:nd], ape, pos[:nd], rs[:nd], table, slots, **kw)
            if nd < N:
                if ring is not None:
                    # A prefill chunk rewrites the tail: a later decode must never restore a stale ring.
                    ring.on_prefill(slots[meta.num_decode_seqs :])
                ops.update_prefill_pools(cache, key[nd:], gate[nd:], ape, pos[nd:], rs[nd:], table, slots)
                ops.write_prefill_tail(cache.tail_ring, key[nd:], gate[nd:], pos[nd:], rs[nd:], slots)

        # The selection buffer's rows are written whole below (no -1 fill first: two launches less per sparse layer
        # and step, captured graphs included) unless the buffer is wider than this layer's selection.
        whole = meta.selection_buf.shape[1] == self.select_width
        if meta.spec.shared_pool_ids is not None:
            # A chained MTP step with index_share_for_mtp_iteration: step 0's pools plus the recent window.
            assert meta.spec.shared_window_start is not None
            sel = meta.selection_buf[:N]  # every column copied
            sel.copy_(
                expand_selection_window(meta.spec.shared_pool_ids, meta.spec.shared_window_start, pos, sel.shape[1])
            )
            return sel
        # In the projection's dtype: both branches below read it exactly (`rotate_quant` computes from its input cast
        # to fp32, the bf16 branch rounds once to bf16), so no separate fp32 copy (a launch per sparse layer and step).
        q_idx = self.wq_b(q_lora).view(N, self.n_heads, INDEX_HEAD_DIM)
        if cache.index_k.dtype == torch.bfloat16:
            # BF16 keys (docs/indexer_keys.md): bf16 queries, unrotated (the rotation only spreads outliers
            # for the FP8 scales) and unscaled, so that keys and queries keep 8 mantissa bits each.
            q, qscale = q_idx.to(torch.bfloat16), None
        else:
            q, qscale = ops.rotate_quant(q_idx)
        # fp32 head weights (step 4): one Triton launch for decode / verify rows on CUDA (`linear_fp32`).
        w = indexer_head_weights(linear_fp32(h, self.weights_proj.weight), qscale, self.n_heads)
        scores = ops.score_pools(
            q, w, cache.index_k, cache.index_scale, pos, rs, table, cache.tokens_per_block, meta.score_columns
        )
        pool_ids = ops.select_topk_pools(scores, pos, self.topk_pools)
        meta.spec.last_pool_ids = pool_ids
        if whole:  # the expansion writes every column, -1 past the selection
            return ops.expand_selection(pool_ids, pos, self.select_width, out=meta.selection_buf[:N])
        sel = meta.selection(N)
        sel[:, : self.select_width].copy_(ops.expand_selection(pool_ids, pos, self.select_width))
        return sel
