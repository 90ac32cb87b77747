"""Test harness: drive a model directly on fresh caches, chunk by chunk (tests only)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from trtllm_glm.attention.sparse.glm_kpool.metadata import GlmKpoolMetadata
from trtllm_glm.cache.manager import Glm5NextCacheManager
from trtllm_glm.models.glm5_next import Glm5NextForCausalLM

__all__ = ["ModelHarness"]


class ModelHarness:
    """A model with its own cache manager and metadata, fed explicit (request, rows) steps.

    Args:
        model: the model.
        max_seq_len: longest sequence.
        tokens_per_block: page size.
        max_num_requests: state slots.
        include_mtp_layer: store the MTP layer's sparse plane in this manager (shared-draft mode).
        page_order: optional permutation of page ids (tests that page placement does not matter).
    """

    def __init__(
        self,
        model: Glm5NextForCausalLM,
        *,
        max_seq_len: int = 256,
        tokens_per_block: int = 8,
        max_num_requests: int = 4,
        include_mtp_layer: bool = False,
        page_order: Sequence[int] | None = None,
    ) -> None:
        self.model = model
        p = next(model.parameters())
        pages_per_seq = -(-max_seq_len // tokens_per_block)
        self.manager = Glm5NextCacheManager(
            model.config,
            num_pages=pages_per_seq * max_num_requests,
            tokens_per_block=tokens_per_block,
            max_num_requests=max_num_requests,
            include_mtp_layer=include_mtp_layer,
            dtype=p.dtype,
            device=p.device,
        )
        if page_order is not None:
            if sorted(page_order) != list(range(self.manager.num_pages)):
                raise ValueError("page_order must be a permutation of every page id")
            # The free list pops from the end.
            self.manager._free_pages = list(reversed(list(page_order)))
        self.meta = GlmKpoolMetadata(
            kv_cache_manager=self.manager,
            max_num_seqs=max_num_requests,
            max_num_tokens=max_seq_len * max_num_requests,
            max_pages_per_seq=pages_per_seq,
            select_width=model.config.index_select_width,
            device=p.device,
        )
        self.device = p.device
        self.lengths: dict[int, int] = {}

    @torch.no_grad()
    def step(self, rows: Sequence[tuple[int, Sequence[int]]], num_decode_seqs: int = 0) -> torch.Tensor:
        """Feed ``rows`` = [(request_id, tokens)] (decode sequences first); returns hidden ``[N, D]``."""
        for rid, toks in rows:
            if rid not in self.lengths:
                self.manager.add_request(rid)
                self.lengths[rid] = 0
            self.manager.ensure_capacity(rid, self.lengths[rid] + len(toks))
        rids = [r for r, _ in rows]
        self.meta.prepare(
            rids, past_lens=[self.lengths[r] for r in rids], q_lens=[len(t) for _, t in rows],
            num_decode_seqs=num_decode_seqs,
        )  # fmt: skip
        ids = torch.tensor([t for _, toks in rows for t in toks], dtype=torch.int64, device=self.device)
        hidden = self.model(ids, self.meta, self.manager)
        for rid, toks in rows:
            self.lengths[rid] += len(toks)
        return hidden

    @torch.no_grad()
    def prefill_logits(self, rid: int, tokens: Sequence[int], chunks: Sequence[int] | None = None) -> torch.Tensor:
        """Logits of every row of ``tokens`` fed in ``chunks`` (sizes; default one pass) ``[T, V]``."""
        chunks = list(chunks) if chunks is not None else [len(tokens)]
        out, i = [], 0
        while i < len(tokens):
            n = chunks[min(len(out), len(chunks) - 1)] if chunks else len(tokens)
            part = list(tokens[i : i + n])
            out.append(self.model.compute_logits(self.step([(rid, part)], num_decode_seqs=int(len(part) == 1))))
            i += len(part)
        return torch.cat(out)
