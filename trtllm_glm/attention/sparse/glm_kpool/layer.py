"""`GlmKpoolSparseMLA`: NoPE sparse MLA attention over a paged latent cache (model dtype, or FP8 with block
scales), columns chosen by the pooled FP8 indexer.
"""

from __future__ import annotations

import torch
from torch import nn

from ....config import Glm5NextConfig
from ....linear import invariant_bmm, model_linear
from ....modules.norm import RMSNorm
from ....modules.weight_views import FusedWeights, refuse_stale
from ....numerics import batch_invariant
from .cache_layout import KpoolLayerCache
from .dispatch import kpool_ops
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
        # `fuse_weights`: the projections of the layer input in one storage (not a parameter or buffer).
        self._in_fused: FusedWeights | None = None
        # `_absorbed_fp8`: (key, dequantised kv_b_proj) when that weight is block FP8.
        self._kv_b_cache: tuple[tuple[int, ...], torch.Tensor] | None = None
        self._w_uk_t_cache: tuple[tuple[object, ...], torch.Tensor] | None = None

    def _fused_candidates(self) -> list[tuple[list[nn.Module], list[str] | None]]:
        """Groups `fuse_weights` tries, largest first. The pooling gate is a plain parameter: block-FP8
        projections fuse without it (and without ``wk`` when that one is not FP8 too)."""
        mods: list[nn.Module] = [self.q_a_proj, self.kv_a_proj_with_mqa]
        if self.indexer is None:
            return [(mods, None)]
        return [
            ([*mods, self.indexer.wk, self.indexer], ["weight", "weight", "weight", "index_kpool_compress_gate"]),
            ([*mods, self.indexer.wk], None),
            (mods, None),
        ]

    def fuse_weights(self) -> None:
        """Give the weights that multiply the layer input (``q_a_proj``, ``kv_a_proj_with_mqa`` and the
        indexer's ``wk`` and pooling gate) one storage, the parameters becoming views into it: one GEMM per
        step instead of four. Names, shapes and ``state_dict`` are unchanged and in-place loads write through
        the views; a parameter replaced later is noticed (`FusedWeights.intact`) and the layer falls back to
        separate GEMMs; casts re-fuse. Idempotent (CUDA graphs captured on the storage stay valid). Weights of
        different dtypes are left unfused.
        """
        self._in_fused = FusedWeights.ensure_first(self._in_fused, self._fused_candidates())

    def _apply(self, fn, recurse: bool = True):  # type: ignore[no-untyped-def]
        out = super()._apply(fn, recurse)
        refuse_stale(self, ("_in_fused",))
        return out

    def _input_projections(
        self, h: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
        """``h [N, D]`` -> ``q_a_proj(h)``, ``kv_a_proj_with_mqa(h)`` and, with fused weights and an indexer,
        the indexer's raw key and pooling-gate projections (else ``None``): one GEMM when fused."""
        f = self._in_fused
        if f is not None and f.usable():
            parts = f.linear(h).split(f.sizes, dim=-1)
            if len(parts) == 4:
                return parts[0], parts[1], (parts[2], parts[3])
            if len(parts) == 3 and self.indexer is not None:  # FP8 group: the pooling gate on its own
                gate = model_linear(h, self.indexer.index_kpool_compress_gate.to(h.dtype))
                return parts[0], parts[1], (parts[2], gate)
            return parts[0], parts[1], None
        return self.q_a_proj(h), self.kv_a_proj_with_mqa(h), None

    @torch.no_grad()
    def reset_parameters(self, generator: torch.Generator, std: float) -> None:
        from ....modules.init import init_linear_

        init_linear_(self, generator, std)
        if self.indexer is not None:
            self.indexer.reset_parameters(generator, std)

    def absorbed_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``W_uk [H, qk_nope, kv_lora]`` and ``W_uv [H, v_head, kv_lora]`` split from ``kv_b_proj``."""
        w = self.kv_b_proj.weight
        if w.dtype == torch.float8_e4m3fn:
            w = self._absorbed_fp8()
        w = w.view(self.num_heads, self.qk_nope + self.v_head, self.kv_lora)
        return w[:, : self.qk_nope], w[:, self.qk_nope :]

    def derived_weight_bytes(self, dtype: torch.dtype) -> int:
        """Bytes of the weight copy the forward keeps besides the parameters: a block-FP8 ``kv_b_proj`` dequantised
        in ``dtype`` (`_absorbed_fp8`: the absorbed attention multiplies by the whole matrix); else 0."""
        w = self.kv_b_proj.weight
        return w.numel() * torch.empty(0, dtype=dtype).element_size() if w.dtype == torch.float8_e4m3fn else 0

    def _absorbed_fp8(self) -> torch.Tensor:
        """``kv_b_proj`` dequantised once (its matrix is used as a whole, by the einsums of the absorbed
        attention), in the dtype of the layer's other float weights; cached while the FP8 weight and its scale
        keep their storage and version, so steps (and CUDA-graph captures after a warm-up) reuse it."""
        lin = self.kv_b_proj
        key = (
            lin.weight.data_ptr(),
            lin.weight._version,
            lin.weight_scale_inv.data_ptr(),
            lin.weight_scale_inv._version,
        )
        hit = self._kv_b_cache
        if hit is not None and hit[0] == key:
            return hit[1]
        if lin.weight.is_cuda and torch.cuda.is_current_stream_capturing():
            # Made here, the copy would come from the graph's private memory pool (not ours to keep).
            raise RuntimeError("GlmKpoolSparseMLA: FP8 kv_b_proj changed since the last eager call; run one first")
        dtype = self.q_a_layernorm.weight.dtype
        with torch.inference_mode(False), torch.no_grad():
            w = lin.dequantized(dtype)
        self._kv_b_cache = (key, w)
        return w

    def forward(self, h: torch.Tensor, meta: GlmKpoolMetadata, cache: KpoolLayerCache) -> torch.Tensor:
        """Attend each row over its selected cached tokens.

        Args:
            h: ``[N, hidden]`` normalised layer input (decode rows first, then prefill chunks).
            meta: the step's metadata, or inside a piecewise CUDA graph the bucket's fixed-shape `StaticSparseStep`
                (``N = T`` rows, padding rows with ``row_seq = -1``).
            cache: this layer's cache planes; this step's latent rows and pools are written first.

        Returns:
            ``[N, hidden]`` attention output.
        """
        N = h.shape[0]
        qa, kva, index_in = self._input_projections(h)
        q_lora = self.q_a_layernorm(qa)
        latent = self.kv_a_layernorm(kva)
        # An FP8 plane (``latent_dtype="fp8"``) quantises the model-dtype rows where they are written; any other
        # plane stores them in its own dtype.
        kpool_ops(h.device).write_latent_rows(
            cache.latent,
            latent if cache.latent_scale is not None else latent.to(cache.latent.dtype),
            meta.positions_t,
            meta.row_seq_t,
            meta.slot_table_t,
            cache.tokens_per_block,
            latent_scale=cache.latent_scale,
        )
        if self.indexer is not None:
            sel = self.indexer(h, q_lora, meta, cache, projected=index_in)
        else:
            # Shared layer: the previous full layer's selection of these same rows is still in the buffer.
            sel = meta.selection_buf[:N]
        w_uk, w_uv = self.absorbed_weights()
        q = self.q_b_proj(q_lora).view(N, self.num_heads, self.qk_nope)
        q_abs = absorb_q(q, w_uk, self._w_uk_t(w_uk) if batch_invariant() else None)
        o_lat = kpool_ops(h.device).sparse_mla_attention(
            q_abs,
            cache.latent,
            sel,
            meta.row_seq_t,
            meta.slot_table_t,
            cache.tokens_per_block,
            self.softmax_scale,
            latent_scale=cache.latent_scale,
        )
        o = absorb_o(o_lat, w_uv).reshape(N, self.num_heads * self.v_head)
        return self.o_proj(o)

    def _w_uk_t(self, w_uk: torch.Tensor) -> torch.Tensor:
        """``W_uk`` as ``[H, kv_lora, qk_nope]`` with a unit last stride (the batch-invariant GEMM's weight
        layout), copied once and cached while ``W_uk``'s storage and version stay (graph replays reuse it)."""
        key = (w_uk.data_ptr(), w_uk._version, w_uk.dtype)
        hit = self._w_uk_t_cache
        if hit is not None and hit[0] == key:
            return hit[1]
        if w_uk.is_cuda and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("GlmKpoolSparseMLA: W_uk changed since the last eager call; run one first")
        with torch.inference_mode(False), torch.no_grad():
            w = w_uk.transpose(1, 2).contiguous()
        self._w_uk_t_cache = (key, w)
        return w


def absorb_q(q: torch.Tensor, w_uk: torch.Tensor, w_uk_t: torch.Tensor | None = None) -> torch.Tensor:
    """``q [N, H, qk_nope]`` times the per-head ``W_uk [H, qk_nope, kv_lora]`` -> ``[N, H, kv_lora]``.

    ``torch.einsum`` by default; with ``w_uk_t`` (``W_uk`` as ``[H, kv_lora, qk_nope]``, unit last stride) in the
    batch-invariant mode, `trtllm_glm.linear.invariant_bmm`: cuBLAS picks a batched GEMM's algorithm from ``N``,
    so a row would round differently alone, in a batch or as a verify row.
    """
    if w_uk_t is not None and batch_invariant():
        return invariant_bmm(q, w_uk_t)
    return torch.einsum("nhd,hdr->nhr", q, w_uk)


def absorb_o(o_lat: torch.Tensor, w_uv: torch.Tensor) -> torch.Tensor:
    """``o_lat [N, H, kv_lora]`` times the per-head ``W_uv [H, v_head, kv_lora]``^T -> ``[N, H, v_head]``
    (``invariant_bmm`` in the batch-invariant mode, as `absorb_q`)."""
    if batch_invariant():
        return invariant_bmm(o_lat, w_uv)
    return torch.einsum("nhr,hvr->nhv", o_lat, w_uv)
