"""Floors a measurement is compared with: the bytes a decode step must read, the FLOPs of a prefill."""

from __future__ import annotations

import torch

from trtllm_glm.config import Glm5NextConfig
from trtllm_glm.models.glm5_next import Glm5NextForCausalLM

# Op classes of `prefill_flops` (and of bench_prefill's timed ranges).
FLOP_CLASSES = ("kda_proj", "kda_core", "mla_proj", "indexer_score", "sparse_mla", "mlp", "moe_routed", "other_gemm")
KDA_CHUNK = 64  # fla's chunk length (the intra-chunk part of the FLOP count)


def weight_bytes(model: Glm5NextForCausalLM, mtp: bool) -> tuple[int, int]:
    """(dense bytes, routed-expert bytes) of the trunk (``mtp=False``) or of the MTP layer.

    The input embedding is left out: a step reads only its rows' embeddings (counted by the caller).
    """
    dense = experts = 0
    act = model.model.embed_tokens.weight.element_size()
    for name, p in model.named_parameters():
        if name.startswith("mtp.") != mtp or name.endswith("embed_tokens.weight"):
            continue
        size = p.element_size()
        if name.endswith("kv_b_proj.weight") and p.dtype == torch.float8_e4m3fn:
            # The absorbed attention multiplies by the whole matrix: an FP8 kv_b_proj is read as its
            # dequantised copy (`GlmKpoolSparseMLA._absorbed_fp8`), in the activations' dtype.
            size = act
        if ".experts." in name:
            experts += p.numel() * size
        else:
            dense += p.numel() * size
    return dense, experts


def floor_bytes(
    cfg: Glm5NextConfig,
    model: Glm5NextForCausalLM,
    rows: int,
    batch: int,
    context: int,
    mtp_steps: int = 0,
    expert_rows: float | None = None,
) -> int:
    """Bytes one decode/verify step of ``rows`` rows over ``batch`` requests must read at least.

    Dense weights once (the LM head included; of the embedding only the rows' entries); of each MoE layer
    only the experts the step's tokens can reach (expected distinct experts for ``rows`` tokens of uniform
    top-k routing); KDA states read and written; per sparse layer the selected latent rows of every row
    plus the FP8 pool entries it scores. ``mtp_steps`` MTP forwards (an MTP round: the catch-up over the
    committed rows, then chained steps of one row per request) add the MTP layer's weights each time (its
    dense part and the experts that ``batch`` tokens reach; the catch-up's extra rows are not counted).
    ``expert_rows`` (default ``rows``): the rows that reach experts (verify filler rows skip them).
    """
    E, k = cfg.n_routed_experts, cfg.num_experts_per_tok

    def reached(n: int) -> float:
        return E * (1 - (1 - k / E) ** n) / E

    dense, expert_bytes = weight_bytes(model, mtp=False)
    emb = cfg.hidden_size * next(model.parameters()).element_size()
    total = dense + rows * emb + int(expert_bytes * reached(rows if expert_rows is None else expert_rows))
    kda_state = cfg.kda_num_heads * cfg.kda_head_dim * cfg.kda_head_dim * 4
    total += 2 * kda_state * batch * len(cfg.kda_layer_ids)
    sel = min(context, cfg.index_select_width)
    per_sparse = rows * sel * cfg.kv_lora_rank * 2 + batch * (context // 4) * 132
    total += per_sparse * len(cfg.sparse_layer_ids)
    if mtp_steps:
        m_dense, m_experts = weight_bytes(model, mtp=True)
        head = model.lm_head.weight
        # The MTP layer's own weights, the LM head it shares with the trunk (each draft step reads it again),
        # and the selected latent rows of its sparse attention.
        per_mtp = m_dense + head.numel() * head.element_size() + batch * emb + int(m_experts * reached(batch))
        total += mtp_steps * (per_mtp + batch * sel * cfg.kv_lora_rank * 2)
    return total


def pool_rows(n: int) -> int:
    """``sum_{t < n} floor((t + 1) / 4)``: (query row, complete pool) pairs the indexer scores over a prompt."""
    q, r = divmod(n, 4)
    return 2 * q * (q - 1) + q * (r + 1)


def selected_rows(n: int, width: int) -> int:
    """``sum_{t < n} min(t + 1, width)``: (query row, selected token) pairs of sparse MLA over a prompt."""
    if n <= width:
        return n * (n + 1) // 2
    return width * (width + 1) // 2 + (n - width) * width


def prefill_flops(cfg: Glm5NextConfig, model: Glm5NextForCausalLM, n: int) -> dict[str, float]:
    """FLOPs of one ``n``-token prefill of ``model``'s trunk, per op class (multiply-adds count 2).

    * Weight GEMMs: ``2 * numel`` per token of every matrix-shaped trunk parameter (``p.dim() >= 2``: linears,
      depthwise conv taps, mHC maps), by where it lives: ``kda_proj`` (a KDA layer's ``self_attn``), ``mla_proj``
      (a sparse-MLA layer's, indexer projections included; ``kv_b_proj`` is applied absorbed, as two einsums of the
      same FLOPs), ``mlp`` (dense MLPs and shared experts), ``other_gemm`` (mHC); routed experts count
      ``top_k`` of them per token (``moe_routed``), and ``lm_head`` one row. FP8 scale grids are left out.
    * ``kda_core``: per token and head ``6 dk dv`` (state read for the output and for the delta, state update) plus
      ``3 C (dk + dv)`` (the intra-chunk products, ``C = 64``); an approximation of fla's chunk algorithm.
    * ``indexer_score``: ``2 * index_n_heads * 128`` per (row, complete pool) pair, per layer with its own indexer.
    * ``sparse_mla``: ``4 * heads * (kv_lora_rank + rope)`` per (row, selected token) pair (scores and values on
      the latent), up to ``index_topk`` tokens per row, per sparse-MLA layer.
    """
    out = dict.fromkeys(FLOP_CLASSES, 0.0)
    trunk = model.model.layers[: cfg.num_hidden_layers]
    for i, layer in enumerate(trunk):
        kda = i in cfg.kda_layer_ids
        for name, p in layer.named_parameters():
            if p.dim() < 2 or name.endswith("_scale_inv") or ".experts." in name:
                continue
            if name.startswith("self_attn."):
                cls = "kda_proj" if kda else "mla_proj"
            elif name.startswith("mlp."):
                cls = "mlp"
            else:
                cls = "other_gemm"
            out[cls] += 2.0 * p.numel() * n
        if cfg.is_moe_layer(i):
            out["moe_routed"] += 2.0 * 3 * cfg.hidden_size * cfg.moe_intermediate_size * cfg.num_experts_per_tok * n
        if kda:
            dk = dv = cfg.kda_head_dim
            out["kda_core"] += float(n) * cfg.kda_num_heads * (6 * dk * dv + 3 * KDA_CHUNK * (dk + dv))
        else:
            r = cfg.kv_lora_rank + cfg.qk_rope_head_dim
            out["sparse_mla"] += 4.0 * cfg.num_attention_heads * r * selected_rows(n, cfg.index_topk)
            if not cfg.shares_indexer(i):
                out["indexer_score"] += 2.0 * cfg.index_n_heads * cfg.index_head_dim * pool_rows(n)
    out["other_gemm"] += 2.0 * cfg.vocab_size * cfg.hidden_size  # lm_head on the last row
    return out


def floor_ms(flops: dict[str, float], bf16_tflops: float, fp8_tflops: float, fp8_weights: bool) -> dict[str, float]:
    """Milliseconds of each class at its rate: weight GEMMs at the FP8 rate with FP8 weights, the rest (and the
    indexer's fp16 dots) at the bf16 rate."""
    weight = ("kda_proj", "mla_proj", "mlp", "moe_routed", "other_gemm")
    out = {}
    for k, f in flops.items():
        rate = fp8_tflops if fp8_weights and k in weight and fp8_tflops == fp8_tflops else bf16_tflops
        out[k] = f / (rate * 1e12) * 1e3
    return out
