"""`GlmKpoolSparseMLA`: NoPE sparse MLA attention over a paged latent cache, columns chosen by the
pooled FP8 indexer.
"""

from __future__ import annotations

import torch
from torch import nn

from ....cache.manager import KpoolLayerCache
from ....config import Glm5NextConfig
from ....modules.norm import RMSNorm
from .backend import kpool_ops
from .indexer import GlmKpoolIndexer
from .metadata import GlmKpoolMetadata

__all__ = ["GlmKpoolSparseMLA"]


class GlmKpoolSparseMLA(nn.Module):
    """Sparse MLA attention block (one latent KV head, absorbed queries, no RoPE).

    Weights (HF names): ``q_a_proj [q_lora, D]``, ``q_a_layernorm``, ``q_b_proj [H * qk_nope, q_lora]``,
    ``kv_a_proj_with_mqa [kv_lora, D]``, ``kv_a_layernorm``, ``kv_b_proj [H * (qk_nope + v_head), kv_lora]``,
    ``o_proj [D, H * v_head]`` and ``indexer.*``.

    A layer built with ``shared_indexer=True`` (``indexer_types[i] == "shared"``) has no indexer: it
    attends the columns the previous full sparse layer of the same forward selected (still in the
    metadata's persistent selection buffer) and only writes its own latent rows.
    """

    def __init__(self, config: Glm5NextConfig, *, shared_indexer: bool = False) -> None:
        super().__init__()
        D, H = config.hidden_size, config.num_attention_heads
        self.num_heads = H
        self.qk_nope = config.qk_nope_head_dim
        self.v_head = config.v_head_dim
        self.kv_lora = config.kv_lora_rank
        self.softmax_scale = config.softmax_scale
        self.q_a_proj = nn.Linear(D, config.q_lora_rank, bias=False)
        self.q_a_layernorm = RMSNorm(config.q_lora_rank, eps=config.rms_norm_eps)
        self.q_b_proj = nn.Linear(config.q_lora_rank, H * self.qk_nope, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(D, self.kv_lora, bias=False)
        self.kv_a_layernorm = RMSNorm(self.kv_lora, eps=config.rms_norm_eps)
        self.kv_b_proj = nn.Linear(self.kv_lora, H * (self.qk_nope + self.v_head), bias=False)
        self.o_proj = nn.Linear(H * self.v_head, D, bias=False)
        self.indexer = None if shared_indexer else GlmKpoolIndexer(config)

    @torch.no_grad()
    def reset_parameters(self, generator: torch.Generator, std: float) -> None:
        from ....modules.init import init_linear_

        init_linear_(self, generator, std)
        if self.indexer is not None:
            self.indexer.reset_parameters(generator, std)

    def absorbed_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``W_uk [H, qk_nope, kv_lora]`` and ``W_uv [H, v_head, kv_lora]`` split from ``kv_b_proj``."""
        w = self.kv_b_proj.weight.view(self.num_heads, self.qk_nope + self.v_head, self.kv_lora)
        return w[:, : self.qk_nope], w[:, self.qk_nope :]

    def forward(self, h: torch.Tensor, meta: GlmKpoolMetadata, cache: KpoolLayerCache) -> torch.Tensor:
        """Attend each row over its selected cached tokens.

        Args:
            h: ``[N, hidden]`` normalised layer input (decode rows first, then prefill chunks).
            meta: the step's metadata.
            cache: this layer's cache planes; this step's latent rows and pools are written first.

        Returns:
            ``[N, hidden]`` attention output.
        """
        N = h.shape[0]
        q_lora = self.q_a_layernorm(self.q_a_proj(h))
        latent = self.kv_a_layernorm(self.kv_a_proj_with_mqa(h))
        kpool_ops(h.device).write_latent_rows(
            cache.latent,
            latent.to(cache.latent.dtype),
            meta.positions_t,
            meta.row_seq_t,
            meta.slot_table_t,
            cache.page_size,
        )
        if self.indexer is not None:
            sel = self.indexer(h, q_lora, meta, cache)
        else:
            # Shared layer: the previous full layer's selection of these same rows is still in the buffer.
            sel = meta.selection_buf[:N]
        w_uk, w_uv = self.absorbed_weights()
        q = self.q_b_proj(q_lora).view(N, self.num_heads, self.qk_nope)
        q_abs = torch.einsum("nhd,hdr->nhr", q, w_uk)
        o_lat = kpool_ops(h.device).sparse_mla_attention(
            q_abs, cache.latent, sel, meta.row_seq_t, meta.slot_table_t, cache.page_size, self.softmax_scale
        )
        o = torch.einsum("nhr,hvr->nhv", o_lat, w_uv).reshape(N, self.num_heads * self.v_head)
        return self.o_proj(o)
