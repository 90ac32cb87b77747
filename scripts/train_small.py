"""Train the `small` preset: a GLM-5.3-Flash-architecture model of a few million parameters on the CPython
standard library, with a warmed-up pooled indexer and a trained MTP layer.

The trunk is the published reference (`transformers` ``Glm5NextForConditionalGeneration``, text model): its
modules hold the parameters, and this script runs them through a differentiable forward that computes the
reference's function (mHC hyper-connections, the reference's norms, MLPs and MoE called as they are) with
two changes that only affect speed or what is observable during training:

* KDA layers use a chunked delta-rule form with a triangular solve (`kda_chunked`) instead of the
  reference's per-row loop (same math; it is the bulk of the reference's CPU time);
* sparse MLA layers compute their dense score matrix once, so the dense attention distribution (the
  indexer's KL target) is available whether the layer attends densely or under the indexer's top-k
  selection (taken from the reference indexer itself, so the sparse mask is exactly the reference's).

Training (one run, seeded):

1. trunk next-byte loss with dense attention, the indexer warmed up by a KL loss from each sparse layer's
   dense attention (summed over heads, pooled to 4-token pools) to the softmax of its differentiable pooled
   scores (`indexer_pool_logits`, inputs detached as DeepSeek-V3.2 does), and the MTP layer trained on the
   next-next byte from the trunk's detached final hidden;
2. the same with the trunk attending under the indexer's selection (the shipped model runs sparse);
3. the MTP layer alone on the frozen final trunk.

Router biases follow DeepSeek-V3's auxiliary-loss-free balancing. The result is written in the real
checkpoint layout through our own `Glm5NextForCausalLM.save_pretrained` (strict names and shapes), with the
MTP block at ``model.language_model.layers.{L}``.

Usage::

    python scripts/train_small.py --out /tmp/small     # the small preset's run: ~27 min on one CPU thread
    python scripts/train_small.py --out /tmp/small --device cuda --steps 4000 --batch 32
    python scripts/train_small.py --smoke --out /tmp/smoke     # seconds, toy size
"""

from __future__ import annotations

import argparse
import copy
import glob
import importlib
import json
import math
import os
import random
import sys
import sysconfig
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

BOS, EOS, PAD = 256, 257, 258
VOCAB = 264

# The small preset's text config (reference key names). Sparse MLA at i % 4 == 3 (layers 3 and 7) with
# their own indexers, a dense FFN in layer 0 and MoE elsewhere, mHC with 4 streams and 20 Sinkhorn
# iterations, clamped SwiGLU; index_topk = 64 bytes (16 pools) so that selection drops pools beyond 64
# bytes of context.
SMALL_TEXT_CONFIG: dict = {
    "vocab_size": VOCAB,
    "hidden_size": 128,
    "num_hidden_layers": 8,
    "intermediate_size": 384,
    "moe_intermediate_size": 128,
    "n_routed_experts": 8,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "routed_scaling_factor": 1.0,
    "mlp_layer_types": ["dense"] + ["sparse"] * 7,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "q_lora_rank": 96,
    "kv_lora_rank": 64,
    "qk_nope_head_dim": 32,
    "qk_rope_head_dim": 0,
    "v_head_dim": 32,
    "index_n_heads": 4,
    "index_head_dim": 128,
    "index_topk": 64,
    "index_kpool": 4,
    "linear_num_heads": 4,
    "linear_head_dim": 32,
    "linear_conv_kernel_dim": 4,
    "swiglu_limit": 10.0,
    "hc_mult": 4,
    "bos_token_id": BOS,
    "eos_token_id": EOS,
    "pad_token_id": PAD,
    "max_position_embeddings": 4096,
    "initializer_range": 0.02,
}

# Toy size for --smoke and the tests: same structure (8 layers, sparse at 3 and 7, MoE, mHC, MTP), narrow.
SMOKE_TEXT_CONFIG: dict = {
    **SMALL_TEXT_CONFIG,
    "hidden_size": 32,
    "intermediate_size": 64,
    "moe_intermediate_size": 16,
    "n_routed_experts": 4,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "q_lora_rank": 16,
    "kv_lora_rank": 16,
    "qk_nope_head_dim": 8,
    "v_head_dim": 8,
    "index_n_heads": 2,
    "index_topk": 8,
    "linear_num_heads": 2,
    "linear_head_dim": 16,
}

# Vision tower of the reference (never run; it only has to exist for the VL class).
_VISION = {
    "depth": 1,
    "hidden_size": 32,
    "num_heads": 2,
    "intermediate_size": 32,
    "out_hidden_size": 32,
    "projection_intermediate_size": 32,
}

# Standard-library modules never trained on (the module and its tests); evaluation uses their sources.
HELD_OUT_MODULES = (
    "json",
    "textwrap",
    "fractions",
    "heapq",
    "bisect",
    "colorsys",
    "shlex",
    "getopt",
    "calendar",
    "statistics",
    "string",
    "graphlib",
)
_TEST_DIRS = ("test", "tests", "idle_test", "idlelib/idle_test", "lib2to3/tests")


# --------------------------------------------------------------------------------------------------
# The reference
# --------------------------------------------------------------------------------------------------
def import_reference():
    """The reference's config and model classes with its plain-torch KDA and conv paths.

    The reference binds fla-core's Triton kernels when fla imports at module load; on a CPU those cannot
    run, so fla is hidden while the modeling module is first imported (this script never calls the
    reference's KDA kernels during training anyway; evaluation and tests do, through its forward).
    """
    name = "transformers.models.glm5_next.modeling_glm5_next"
    if name not in sys.modules:
        saved = {k: sys.modules[k] for k in list(sys.modules) if k == "fla" or k.startswith("fla.")}
        for k in saved:
            del sys.modules[k]
        sys.modules["fla"] = None  # type: ignore[assignment]
        try:
            importlib.import_module(name)
        finally:
            del sys.modules["fla"]
            sys.modules.update(saved)
    from transformers import Glm5NextConfig, Glm5NextForConditionalGeneration

    return Glm5NextConfig, Glm5NextForConditionalGeneration, sys.modules[name]


def reference_config(text: dict):
    """A reference `Glm5NextConfig` (eager attention) from a text config dict."""
    cfg_cls, _, _ = import_reference()
    cfg = cfg_cls(text_config=dict(text), vision_config=dict(_VISION))
    cfg._attn_implementation = "eager"
    cfg.text_config._attn_implementation = "eager"
    return cfg


class MTPBlock(nn.Module):
    """The MTP layer as a training module, built from the reference's own submodules.

    ``eh_proj(cat[enorm(embed(t_{i+1})), hnorm(h_i)])``, one plain pre-norm block (sparse MLA with its own
    indexer, MoE with the clamp), ``shared_head.norm``; the caller applies the shared LM head. Attribute
    names follow the checkpoint's (``model.language_model.layers.{L}.*``).
    """

    def __init__(self, text_cfg) -> None:
        super().__init__()
        _, _, mod = import_reference()
        D = text_cfg.hidden_size
        eps = text_cfg.rms_norm_eps
        self.enorm = mod.Glm5NextTextRMSNorm(D, eps)
        self.hnorm = mod.Glm5NextTextRMSNorm(D, eps)
        self.eh_proj = nn.Linear(2 * D, D, bias=False)
        # Any sparse layer index with its own indexer gives the same module (the index is only read to
        # decide whether the layer shares a selection).
        first_sparse = text_cfg.layer_types.index("indexed_attention")
        self.input_layernorm = mod.Glm5NextTextRMSNorm(D, eps)
        self.self_attn = mod.Glm5NextTextAttention(text_cfg, first_sparse)
        self.post_attention_layernorm = mod.Glm5NextTextRMSNorm(D, eps)
        self.mlp = mod.Glm5NextTextMoE(text_cfg)
        self.shared_head = nn.Module()
        self.shared_head.norm = mod.Glm5NextTextRMSNorm(D, eps)

    @torch.no_grad()
    def init_from(self, model, seed: int) -> None:
        """Initialise like the reference: its ``_init_weights`` on every submodule and a normal ``eh_proj``;
        the attention block then takes the last trunk sparse layer's initial weights (drawn from the same
        distribution; the shipped preset was trained from this start, so it stays for reproducibility)."""
        g = torch.Generator().manual_seed(seed)
        text = model.model.language_model
        for m in self.modules():
            text._init_weights(m)
        std = model.config.text_config.initializer_range
        self.eh_proj.weight.copy_(torch.randn(self.eh_proj.weight.shape, generator=g) * std)
        last_sparse = [i for i, t in enumerate(model.config.text_config.layer_types) if t == "indexed_attention"][-1]
        self.self_attn.load_state_dict(text.layers[last_sparse].self_attn.state_dict())


def build_models(text: dict, seed: int):
    """A freshly initialised reference model (fp32, train mode) and its MTP block."""
    _, model_cls, _ = import_reference()
    torch.manual_seed(seed)
    model = model_cls(reference_config(text)).float()
    mtp = MTPBlock(model.config.text_config).float()
    mtp.init_from(model, seed + 1)
    return model.train(), mtp.train()


# --------------------------------------------------------------------------------------------------
# Differentiable forward (the reference's function)
# --------------------------------------------------------------------------------------------------
def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """fla's l2norm (``x / sqrt(sum x^2 + eps)``), as the reference computes it."""
    return x / torch.sqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def kda_chunked(q, k, v, g, beta, chunk: int = 16) -> torch.Tensor:
    """KDA (gated delta rule, per-channel decay) from a zero state, chunked; differentiable.

    Computes what the reference's ``chunk_kimi_delta_attention(..., use_qk_l2norm_in_kernel=True)`` computes
    (recurrently: ``S <- diag(exp g_t) S``, ``S <- S + k_t (beta_t (v_t - k_t^T S))^T``, ``o_t = q_t^T S``
    with ``q`` scaled by ``d_k^-1/2``), with the in-chunk inverse by a triangular solve and the in-chunk
    decays factored through the chunk's middle row. The factoring keeps every exponent within
    ``chunk / 2 * 5`` because the reference's safe gate keeps each step's log decay in (-5, 0); 16 rows keep
    every factor (and masked products) finite in FP32.

    Args:
        q, k: ``[B, S, H, dk]``; v: ``[B, S, H, dv]``; g: ``[B, S, H, dk]`` log decay; beta: ``[B, S, H]``.
        chunk: rows per chunk.

    Returns:
        ``[B, S, H, dv]`` in q's dtype.
    """
    B, S, H, dk = k.shape
    dv = v.shape[-1]
    q, k, v, g, beta = (x.transpose(1, 2).float() for x in (q, k, v, g, beta))
    q = l2norm(q) * dk**-0.5
    k = l2norm(k)
    pad = (-S) % chunk
    if pad:
        q, k, v, g = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v, g))
        beta = F.pad(beta, (0, pad))
    n = (S + pad) // chunk
    q, k, v, g = (x.reshape(B, H, n, chunk, x.shape[-1]) for x in (q, k, v, g))
    beta = beta.reshape(B, H, n, chunk, 1)
    G = g.cumsum(dim=3)  # inclusive log decay from the chunk start
    ref = G[:, :, :, chunk // 2 : chunk // 2 + 1]
    up = torch.exp(G - ref)  # exp(G_i - r)
    down = torch.exp(ref - G)  # exp(r - G_j)
    kb = k * beta
    on_or_above = torch.ones(chunk, chunk, dtype=torch.bool, device=k.device).triu(0)
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=k.device).triu(1)
    # A[i, j] = sum_d kb[i,d] k[j,d] exp(G_i - G_j), j < i; T = (I + A)^-1 applied by a unit-lower solve.
    A = ((kb * up) @ (k * down).transpose(-1, -2)).masked_fill(on_or_above, 0.0)
    eye = torch.eye(chunk, dtype=A.dtype, device=A.device)
    rhs = torch.cat([v * beta, kb * torch.exp(G)], dim=-1)
    sol = torch.linalg.solve_triangular(A + eye, rhs, upper=False, unitriangular=True)
    u, w = sol[..., :dv], sol[..., dv:]
    intra = ((q * up) @ (k * down).transpose(-1, -2)).masked_fill(causal, 0.0)
    qg = q * torch.exp(G)
    g_last = G[:, :, :, -1:]
    kg = k * torch.exp(g_last - G)
    decay_last = torch.exp(g_last).transpose(-1, -2)  # [B, H, n, dk, 1]
    state = q.new_zeros(B, H, dk, dv)
    outs = []
    for i in range(n):
        v_new = u[:, :, i] - w[:, :, i] @ state
        outs.append(qg[:, :, i] @ state + intra[:, :, i] @ v_new)
        state = state * decay_last[:, :, i] + kg[:, :, i].transpose(-1, -2) @ v_new
    o = torch.stack(outs, dim=2).reshape(B, H, n * chunk, dv)[:, :, :S]
    return o.transpose(1, 2).contiguous()


def kda_forward(attn, x: torch.Tensor) -> torch.Tensor:
    """The reference's ``Glm5NextTextLinearAttention.forward`` without a cache, through `kda_chunked`."""
    B, S, _ = x.shape
    shape = (B, S, -1, attn.head_dim)
    mixed = torch.cat([attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)], dim=-1).transpose(1, 2)
    w = attn.conv1d.weight
    mixed = F.silu(F.conv1d(mixed.to(w.dtype), w, padding=w.shape[-1] - 1, groups=mixed.shape[1])[..., :S])
    q, k, v = torch.split(mixed.transpose(1, 2), [attn.qkv_dim] * 3, dim=-1)
    g = attn.forget_gate(x)
    beta = torch.sigmoid(attn.b_proj(x))
    core = kda_chunked(q.reshape(shape), k.reshape(shape), v.reshape(shape), g, beta)
    gate = attn.g_b_proj(attn.g_a_proj(x)).view(shape)
    return attn.o_proj(attn.o_norm(core, gate).reshape(B, S, -1))


def indexer_pool_logits(indexer, x: torch.Tensor, q_resid: torch.Tensor) -> torch.Tensor:
    """The indexer's pooled scores, differentiable, in FP32: ``[B, S, P]`` with invalid pools at -inf.

    The reference's ``Glm5NextTextIndexer.forward`` without padding: keys ``k_norm(wk x)``, pool ``p``'s key
    ``sum_m softmax_m(gate[4p+m] + ape[m]) * key[4p+m]`` with ``gate = x @ compress_gate^T``, score
    ``sum_h w_h relu(q_h . key_p / sqrt(128))`` with ``w = weights_proj(x) / sqrt(H_i)``; pool ``p`` is
    selectable from position ``4p + 3`` on. (Our runtime scores the same quantity through the FWHT rotation
    and FP8, which keep the dot products up to rounding.)
    """
    B, S, _ = x.shape
    kp = indexer.index_kpool
    P = S // kp
    q = indexer.wq_b(q_resid).view(B, S, indexer.n_heads, indexer.head_dim).float()
    key = indexer.k_norm(indexer.wk(x)).float()
    gate = F.linear(x, indexer.index_kpool_compress_gate).float()
    key = key[:, : P * kp].view(B, P, kp, -1)
    gate = gate[:, : P * kp].view(B, P, kp, -1) + indexer.index_kpool_compress_ape.float()
    pooled = (gate.softmax(dim=2) * key).sum(dim=2)  # [B, P, 128]
    scores = F.relu(torch.einsum("bshd,bpd->bshp", q, pooled) * indexer.softmax_scale)
    weights = indexer.weights_proj(x).float() * indexer.n_heads**-0.5
    logits = torch.einsum("bsh,bshp->bsp", weights, scores)
    return logits.masked_fill(~pool_visible(S, kp, x.device), float("-inf"))


def pool_visible(S: int, kp: int, device) -> torch.Tensor:
    """``[S, S // kp]``: pool ``p`` is complete and visible from position ``s`` iff ``kp p + kp - 1 <= s``."""
    pos = torch.arange(S, device=device)
    last = torch.arange(S // kp, device=device) * kp + kp - 1
    return last[None, :] <= pos[:, None]


def pooled_attention(probs: torch.Tensor, kp: int) -> torch.Tensor:
    """Dense attention ``[B, H, S, S]`` -> head-summed mass per complete pool ``[B, S, P]`` (unnormalised)."""
    B, _, S, _ = probs.shape
    P = S // kp
    return probs.sum(dim=1)[..., : P * kp].reshape(B, S, P, kp).sum(-1)


@dataclass
class SparseAux:
    """What a sparse MLA layer exposes for the indexer loss and the evaluation."""

    target: torch.Tensor  # [B, S, P] head-summed dense attention mass per pool (detached)
    logits: torch.Tensor | None  # [B, S, P] the indexer's differentiable pooled scores
    selected: torch.Tensor | None  # [B, S, W] the reference indexer's selection (token ids, -1 pad)


def _mla_project(attn, x: torch.Tensor):
    """``q_resid`` and per-head ``q, k, v`` ``[B, H, S, *]`` of the reference's NoPE MLA."""
    B, S, _ = x.shape
    q_resid = attn.q_a_layernorm(attn.q_a_proj(x))
    q = attn.q_b_proj(q_resid).view(B, S, -1, attn.qk_head_dim).transpose(1, 2)
    kv = attn.kv_a_layernorm(attn.kv_a_proj_with_mqa(x)[..., : attn.kv_lora_rank])
    kv = attn.kv_b_proj(kv).view(B, S, -1, attn.qk_nope_head_dim + attn.v_head_dim).transpose(1, 2)
    k, v = torch.split(kv, [attn.qk_nope_head_dim, attn.v_head_dim], dim=-1)
    return q_resid, q, k, v


def mla_forward(attn, x: torch.Tensor, *, sparse: bool, aux: list | None, index_loss: bool = True, kv_out=None):
    """The reference's ``Glm5NextTextAttention.forward`` (NoPE MLA, no cache), dense or under top-k.

    Args:
        attn: a reference ``Glm5NextTextAttention`` with its own indexer.
        x: ``[B, S, D]`` normed input.
        sparse: attend only the reference indexer's selection (as the shipped model does); else causal dense.
        aux: when a list, a `SparseAux` is appended.
        index_loss: compute the differentiable indexer scores for ``aux`` (inputs detached).
        kv_out: when a list, the layer's ``(k, v)`` are appended (the MTP chain pass attends them).

    Returns:
        ``[B, S, D]`` attention output (after ``o_proj``).
    """
    B, S, _ = x.shape
    q_resid, q, k, v = _mla_project(attn, x)
    if kv_out is not None:
        kv_out.append((k, v))
    scores = (q @ k.transpose(-1, -2)) * attn.scaling
    causal = torch.ones(S, S, dtype=torch.bool, device=x.device).tril()
    dense_scores = scores.masked_fill(~causal, torch.finfo(scores.dtype).min)
    selected = None
    if sparse:
        with torch.no_grad():
            selected = attn.indexer(x, q_resid, torch.ones(B, S, dtype=torch.bool, device=x.device), None)
            mask = attn.build_attention_mask_from_topk(selected, q, S)  # [B, 1, S, S] additive
        probs = torch.softmax(scores + mask, dim=-1)
    else:
        probs = torch.softmax(dense_scores, dim=-1)
    out = (probs @ v).transpose(1, 2).reshape(B, S, -1)
    if aux is not None:
        with torch.no_grad():
            dense = probs if not sparse else torch.softmax(dense_scores, dim=-1)
            target = pooled_attention(dense.detach(), attn.indexer.index_kpool)
        logits = indexer_pool_logits(attn.indexer, x.detach(), q_resid.detach()) if index_loss else None
        aux.append(SparseAux(target, logits, selected))
    return attn.o_proj(out)


def mla_chain_forward(attn, x: torch.Tensor, k1: torch.Tensor, v1: torch.Tensor) -> torch.Tensor:
    """Attention of chained MTP rows (dense): row ``j`` (position ``j + 1``) sees the first pass's rows at
    positions ``<= j`` and its own key, as a chained draft step sees the committed MTP rows and itself.

    Args:
        attn: the MTP layer's reference attention module.
        x: ``[B, S2, D]`` normed input of the chained rows (positions ``1 .. S2``).
        k1, v1: ``[B, H, S1, *]`` keys / values of the first pass (positions ``0 .. S1 - 1``), ``S1 >= S2``.
    """
    B, S2, _ = x.shape
    _, q, k, v = _mla_project(attn, x)
    cross = (q @ k1.transpose(-1, -2)) * attn.scaling  # [B, H, S2, S1]
    allowed = torch.ones(S2, k1.shape[2], dtype=torch.bool, device=x.device).tril()
    cross = cross.masked_fill(~allowed, torch.finfo(cross.dtype).min)
    own = (q * k).sum(-1, keepdim=True) * attn.scaling
    probs = torch.softmax(torch.cat([cross, own], dim=-1), dim=-1)
    out = probs[..., :-1] @ v1 + probs[..., -1:] * v
    return attn.o_proj(out.transpose(1, 2).reshape(B, S2, -1))


def _mix(post: torch.Tensor, comb: torch.Tensor, out: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """The reference's stream update after a block: ``post (x) out + comb^T @ streams``."""
    dtype = residual.dtype
    return post.to(dtype).unsqueeze(-1) * out.unsqueeze(-2) + torch.matmul(comb.to(dtype).transpose(-1, -2), residual)


def trunk_forward(model, ids: torch.Tensor, *, sparse: bool, aux: list | None = None, index_loss: bool = True):
    """Final normed hidden ``[B, S, D]`` of the reference trunk (``norm(mean over streams)``)."""
    text = model.model.language_model
    cfg = model.config.text_config
    h = text.embed_tokens(ids).unsqueeze(2).expand(-1, -1, cfg.hc_mult, -1).contiguous()
    for layer in text.layers:
        post, comb, x = layer.attn_hc(h)
        x = layer.input_layernorm(x)
        if layer.block_type == "linear_attention":
            a = kda_forward(layer.self_attn, x)
        else:
            a = mla_forward(layer.self_attn, x, sparse=sparse, aux=aux, index_loss=index_loss)
        h = _mix(post, comb, a, h)
        post, comb, x = layer.ffn_hc(h)
        h = _mix(post, comb, layer.mlp(layer.post_attention_layernorm(x)), h)
    return text.norm(h.mean(dim=2))


def mtp_forward(mtp: MTPBlock, model, hidden: torch.Tensor, ids: torch.Tensor, *, sparse: bool, aux=None, chain=False):
    """MTP hidden of the first pass and (``chain``) of the chained pass, for a window ``ids [B, S]``.

    First pass, rows ``i = 0 .. S-2``: ``embed(ids[i+1])`` with the trunk's ``hidden[i]``; predicts
    ``ids[i+2]``. Chained pass, rows ``j = 1 .. S-2``: ``embed(ids[j+1])`` with the first pass's output at
    row ``j - 1`` (what a chained draft step feeds itself), attending the first pass's rows before ``j`` and
    itself; predicts ``ids[j+2]`` too. Embedding and hidden inputs are detached: the MTP loss never moves
    the trunk (its shared embedding and LM head included).

    Returns:
        ``(m1 [B, S-1, D], m2 [B, S-2, D] or None)``, both after ``shared_head.norm``.
    """
    emb_w = model.model.language_model.embed_tokens.weight.detach()
    emb = F.embedding(ids[:, 1:], emb_w)
    kv: list = []
    x = mtp.eh_proj(torch.cat([mtp.enorm(emb), mtp.hnorm(hidden[:, :-1].detach())], dim=-1))
    x = x + mla_forward(mtp.self_attn, mtp.input_layernorm(x), sparse=sparse, aux=aux, kv_out=kv)
    x = x + mtp.mlp(mtp.post_attention_layernorm(x))
    m1 = mtp.shared_head.norm(x)
    if not chain:
        return m1, None
    k1, v1 = kv[0]
    y = mtp.eh_proj(torch.cat([mtp.enorm(emb[:, 1:]), mtp.hnorm(m1[:, :-1])], dim=-1))
    y = y + mla_chain_forward(mtp.self_attn, mtp.input_layernorm(y), k1, v1)
    y = y + mtp.mlp(mtp.post_attention_layernorm(y))
    return m1, mtp.shared_head.norm(y)


def indexer_kl(aux: SparseAux, kp: int) -> torch.Tensor:
    """KL(dense attention pooled ‖ softmax of the indexer's pooled scores), mean over rows with a pool."""
    target = aux.target
    S = target.shape[1]
    vis = pool_visible(S, kp, target.device)
    t = target.masked_fill(~vis, 0.0)
    t = t / t.sum(-1, keepdim=True).clamp_min(1e-20)
    logq = torch.log_softmax(aux.logits.masked_fill(~vis, float("-inf")), dim=-1)
    per_row = (t * (torch.log(t.clamp_min(1e-20)) - logq.clamp_min(-1e4))).masked_fill(~vis, 0.0).sum(-1)
    rows = vis.any(-1)  # [S]
    return per_row[:, rows].mean()


def _moe_modules(model, mtp):
    return [m for m in list(model.modules()) + list(mtp.modules()) if type(m).__name__ == "Glm5NextTextMoE"]


class RouterBalancer:
    """DeepSeek-V3's auxiliary-loss-free balancing: after each step, move every expert's routing bias by
    ``rate * sign(mean load - its load)`` (the bias only affects which experts are picked, not weights)."""

    def __init__(self, moes, rate: float) -> None:
        self.rate = rate
        self.loads: dict[int, torch.Tensor] = {}
        self.hooks = [m.gate.register_forward_hook(self._hook(i)) for i, m in enumerate(moes)]
        self.moes = moes

    def _hook(self, i: int):
        def fn(mod, _inp, out) -> None:
            idx = out[2].detach()
            cnt = torch.bincount(idx.flatten(), minlength=mod.num_experts).float()
            self.loads[i] = self.loads.get(i, 0) + cnt

        return fn

    @torch.no_grad()
    def step(self) -> None:
        for i, cnt in self.loads.items():
            bias = self.moes[i].gate.e_score_correction_bias
            bias += self.rate * torch.sign(cnt.mean() - cnt)
        self.loads = {}


# --------------------------------------------------------------------------------------------------
# Corpus
# --------------------------------------------------------------------------------------------------
def _module_of(rel: str) -> str:
    """Top-level module of a stdlib-relative path (``json/decoder.py`` -> ``json``)."""
    head = rel.split(os.sep)[0]
    return head[:-3] if head.endswith(".py") else head


def stdlib_files(stdlib: str | None = None) -> tuple[list[str], list[str]]:
    """``(train, held_out)`` stdlib ``*.py`` paths, sorted.

    Training skips test directories, ``site-packages``, the codec tables of ``encodings`` and the
    documentation strings of ``pydoc_data`` (data, not code), and every held-out module; held-out files are
    the `HELD_OUT_MODULES`' own sources.
    """
    root = stdlib or sysconfig.get_paths()["stdlib"]
    train, held = [], []
    for path in sorted(glob.glob(os.path.join(root, "**", "*.py"), recursive=True)):
        rel = os.path.relpath(path, root)
        parts = rel.split(os.sep)
        if parts[0] in ("site-packages", "encodings", "pydoc_data") or any(p in _TEST_DIRS for p in parts[:-1]):
            continue
        if parts[-1].startswith("test_"):
            continue
        (held if _module_of(rel) in HELD_OUT_MODULES else train).append(path)
    return train, held


def read_files(paths: list[str]) -> list[bytes]:
    """The bytes of each file."""
    out = []
    for p in paths:
        with open(p, "rb") as f:
            out.append(f.read())
    return out


class Corpus:
    """Training files as one byte stream (each file followed by EOS) and windows that start at a line.

    A window is ``[BOS] + stream[start : start + S]``: every prompt the runtime sees starts with BOS (the
    byte tokenizer adds it) and usually at the start of a line.
    """

    def __init__(self, paths: list[str], max_bytes: int | None = None) -> None:
        chunks: list[bytes] = []
        total = 0
        for p in paths:
            with open(p, "rb") as f:
                data = f.read()
            if not data:  # empty __init__.py files add nothing but an EOS
                continue
            chunks.append(data)
            total += len(data)
            if max_bytes is not None and total >= max_bytes:
                break
        ids: list[torch.Tensor] = []
        for data in chunks:
            ids.append(torch.frombuffer(bytearray(data), dtype=torch.uint8).long())
            ids.append(torch.tensor([EOS]))
        self.stream = torch.cat(ids)
        self.num_files = len(chunks)
        nl = torch.nonzero(self.stream == ord("\n")).flatten() + 1
        self.line_starts = torch.cat([torch.tensor([0]), nl])

    def __len__(self) -> int:
        return int(self.stream.numel())

    def batch(self, B: int, S: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """``(inputs [B, S], labels [B, S])`` from ``B`` random windows of ``S + 1`` tokens."""
        usable = self.line_starts[self.line_starts < len(self) - S]
        pick = usable[torch.randint(len(usable), (B,), generator=gen)]
        rows = torch.stack([self.stream[s : s + S] for s in pick.tolist()])
        win = torch.cat([torch.full((B, 1), BOS), rows], dim=1)
        return win[:, :-1], win[:, 1:]


# --------------------------------------------------------------------------------------------------
# Export in the real checkpoint layout
# --------------------------------------------------------------------------------------------------
def _checkpoint_names(prefix: str, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Reference in-memory names (under ``prefix``) -> checkpoint names: the fused experts and KDA conv are
    split back, the forget gate and hyper-connection modules take their checkpoint spellings."""
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        t = t.detach().float().contiguous()
        n = prefix + name.replace(".self_attn.forget_gate.", ".self_attn.")
        for blk in ("attn", "ffn"):
            for part in ("fn", "base", "scale"):
                n = n.replace(f".{blk}_hc.{part}", f".hc_{blk}_{part}")
        if n.endswith("mlp.experts.gate_up_proj"):
            inter = t.shape[1] // 2
            for e in range(t.shape[0]):
                out[n.replace("gate_up_proj", f"{e}.gate_proj.weight")] = t[e, :inter].clone()
                out[n.replace("gate_up_proj", f"{e}.up_proj.weight")] = t[e, inter:].clone()
        elif n.endswith("mlp.experts.down_proj"):
            for e in range(t.shape[0]):
                out[n.replace("down_proj", f"{e}.down_proj.weight")] = t[e].clone()
        elif n.endswith("self_attn.conv1d.weight"):
            c = t.shape[0] // 3
            for j, qkv in enumerate("qkv"):
                out[n.replace("conv1d", f"{qkv}_conv1d")] = t[j * c : (j + 1) * c].clone()
        else:
            out[n] = t
    return out


def checkpoint_state(model, mtp: MTPBlock) -> dict[str, torch.Tensor]:
    """Every text-model tensor of the reference plus the MTP block, under the real checkpoint's names."""
    tensors = dict(model.named_parameters())
    tensors.update(dict(model.named_buffers()))
    text = {k: v for k, v in tensors.items() if k.startswith("model.language_model.") or k == "lm_head.weight"}
    out = _checkpoint_names("", text)
    L = model.config.text_config.num_hidden_layers
    m = dict(mtp.named_parameters())
    m.update(dict(mtp.named_buffers()))
    out.update(_checkpoint_names(f"model.language_model.layers.{L}.", m))
    return out


def our_config(model):
    """Our `Glm5NextConfig` of the trained model: the reference's full config plus the MTP layer, FP32."""
    from trtllm_glm.config import Glm5NextConfig

    d = copy.deepcopy(model.config.to_diff_dict())
    d["text_config"]["num_nextn_predict_layers"] = 1
    d["text_config"]["dtype"] = "float32"
    d["dtype"] = "float32"
    d.pop("torch_dtype", None)
    d["text_config"].pop("torch_dtype", None)
    return Glm5NextConfig.from_dict(d)


def export(model, mtp: MTPBlock, out_dir: str) -> str:
    """Write the trained model in the real layout through our strict loader and `save_pretrained`.

    Loading the tensors into our `Glm5NextForCausalLM` first checks every name and shape against the
    config (a missing or misnamed MTP tensor fails here, not at serve time).
    """
    from trtllm_glm.models.glm5_next import Glm5NextForCausalLM

    cfg = our_config(model)
    with torch.device("meta"):
        ours = Glm5NextForCausalLM(cfg)
    ours.load_weights(checkpoint_state(model, mtp), dtype=torch.float32, source="trained model", assign=True)
    ours.save_pretrained(out_dir)
    return out_dir


# --------------------------------------------------------------------------------------------------
# Training
# --------------------------------------------------------------------------------------------------
LN2 = math.log(2.0)


@dataclass
class Phases:
    """Step counts: dense trunk, sparse trunk, then the MTP layer alone on the frozen trunk."""

    dense: int
    sparse: int
    mtp: int

    @classmethod
    def split(cls, steps: int, sparse_frac: float, mtp_frac: float) -> Phases:
        n_mtp = int(round(steps * mtp_frac))
        n_sparse = int(round(steps * sparse_frac))
        return cls(steps - n_sparse - n_mtp, n_sparse, n_mtp)

    def phase(self, step: int) -> str:
        if step < self.dense:
            return "dense"
        return "sparse" if step < self.dense + self.sparse else "mtp"


def lr_at(step: int, total: int, peak: float, warmup: int) -> float:
    """Linear warm-up, then cosine decay to a tenth of the peak at ``total``."""
    if step < warmup:
        return peak * (step + 1) / warmup
    t = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * t)))


def param_groups(model, mtp: MTPBlock) -> dict[str, list[nn.Parameter]]:
    """Trunk (LM loss), indexers (KL loss only: their inputs are detached and selection is not
    differentiable) and the MTP block (next-next-byte loss); the vision tower is never trained."""
    groups: dict[str, list[nn.Parameter]] = {"trunk": [], "indexer": [], "mtp": []}
    for name, p in model.named_parameters():
        if name.startswith("model.visual"):
            p.requires_grad_(False)
            continue
        groups["indexer" if ".indexer." in name else "trunk"].append(p)
    for name, p in mtp.named_parameters():
        groups["indexer" if ".indexer." in name else "mtp"].append(p)
    return groups


@torch.no_grad()
def held_out_bits(model, windows: torch.Tensor, *, sparse: bool) -> float:
    """Bits per byte of the trunk on fixed held-out windows ``[N, S + 1]`` (BOS first)."""
    model.eval()
    h = trunk_forward(model, windows[:, :-1], sparse=sparse)
    nll = F.cross_entropy(model.lm_head(h).flatten(0, 1), windows[:, 1:].flatten())
    model.train()
    return float(nll) / LN2


def held_out_windows(paths: list[str], n: int, S: int) -> torch.Tensor:
    """``n`` fixed windows of ``S + 1`` tokens (BOS + the first bytes of held-out files, cycled)."""
    rows = []
    data = [d for d in read_files(paths) if len(d) >= S]
    for i in range(n):
        d = data[i % len(data)]
        off = (i // len(data)) * S
        chunk = d[off : off + S] if off + S <= len(d) else d[:S]
        rows.append(torch.tensor([BOS] + list(chunk)))
    return torch.stack(rows)


def train(args: argparse.Namespace) -> dict:
    """Run the three phases and export; returns the summary written next to the checkpoint."""
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    random.seed(args.seed)
    device = torch.device(args.device)
    text = dict(SMOKE_TEXT_CONFIG if args.smoke else SMALL_TEXT_CONFIG)
    train_paths, held_paths = stdlib_files()
    corpus = Corpus(train_paths, max_bytes=args.max_corpus_bytes)
    model, mtp = build_models(text, args.seed)
    model.to(device)
    mtp.to(device)
    tcfg = model.config.text_config
    kp = tcfg.index_kpool
    groups = param_groups(model, mtp)
    opt = torch.optim.AdamW(
        [{"params": ps, "name": k} for k, ps in groups.items()],
        lr=args.lr,
        betas=(0.9, 0.95),
        weight_decay=args.weight_decay,
    )
    balancer = RouterBalancer(_moe_modules(model, mtp), rate=args.router_bias_rate)
    phases = Phases.split(args.steps, args.sparse_frac, args.mtp_frac)
    gen = torch.Generator().manual_seed(args.seed + 2)
    val = held_out_windows(held_paths, args.val_windows, args.seq_len).to(device)
    n_params = sum(p.numel() for ps in groups.values() for p in ps)
    n_mtp = sum(p.numel() for p in mtp.parameters())
    print(
        f"corpus: {corpus.num_files} files, {len(corpus) / 1e6:.2f} MB; held out: {len(held_paths)} files; "
        f"params: {n_params / 1e6:.2f} M ({n_mtp / 1e6:.2f} M MTP); phases {phases}",
        flush=True,
    )
    log: list[dict] = []
    trunk_steps = phases.dense + phases.sparse
    t0 = time.perf_counter()
    for step in range(args.steps):
        phase = phases.phase(step)
        x, y = (t.to(device) for t in corpus.batch(args.batch, args.seq_len, gen))
        if phase == "mtp":
            lr = lr_at(step - trunk_steps, phases.mtp, args.lr, max(1, phases.mtp // 10))
        else:
            lr = lr_at(step, trunk_steps, args.lr, args.warmup)
        for g in opt.param_groups:
            g["lr"] = lr
        sparse = phase != "dense"
        aux: list[SparseAux] = []
        rec: dict = {"step": step, "phase": phase, "lr": lr}
        loss = torch.zeros((), device=device)
        if phase == "mtp":
            with torch.no_grad():
                h = trunk_forward(model, x, sparse=True)
        else:
            h = trunk_forward(model, x, sparse=sparse, aux=aux)
            lm = F.cross_entropy(model.lm_head(h).flatten(0, 1), y.flatten())
            loss = loss + lm
            rec["bits"] = lm.item() / LN2
        m_aux: list[SparseAux] = []
        m1, m2 = mtp_forward(mtp, model, h, x, sparse=sparse, aux=m_aux, chain=True)
        head = model.lm_head.weight.detach()
        mtp1 = F.cross_entropy(F.linear(m1, head).flatten(0, 1), y[:, 1:].flatten())
        mtp2 = F.cross_entropy(F.linear(m2, head).flatten(0, 1), y[:, 2:].flatten())
        loss = loss + mtp1 + mtp2
        kls = [indexer_kl(a, kp) for a in aux + m_aux]
        loss = loss + sum(kls)
        rec.update(mtp1_bits=mtp1.item() / LN2, mtp2_bits=mtp2.item() / LN2, kl=[round(k.item(), 4) for k in kls])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        for g in opt.param_groups:
            torch.nn.utils.clip_grad_norm_(g["params"], args.clip)
        opt.step()
        balancer.step()
        rec["elapsed"] = time.perf_counter() - t0
        if step % args.eval_every == 0 or step == args.steps - 1:
            rec["val_bits_dense"] = held_out_bits(model, val, sparse=False)
            rec["val_bits_sparse"] = held_out_bits(model, val, sparse=True)
        log.append(rec)
        if step % args.log_every == 0 or step == args.steps - 1 or "val_bits_dense" in rec:
            msg = " ".join(
                f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in rec.items() if k != "step"
            )
            print(f"step {step}: {msg}", flush=True)
    balancer.loads = {}
    for hk in balancer.hooks:
        hk.remove()
    wall = time.perf_counter() - t0
    model.eval()
    mtp.eval()
    export(model.cpu(), mtp.cpu(), args.out)
    summary = {
        "text_config": text,
        "args": {k: v for k, v in vars(args).items()},
        "params": n_params,
        "mtp_params": n_mtp,
        "phases": vars(phases),
        "wall_s": wall,
        "corpus_bytes": len(corpus),
        "corpus_files": corpus.num_files,
        "held_out_modules": list(HELD_OUT_MODULES),
        "python": sys.version.split()[0],
        "final": log[-1],
    }
    with open(os.path.join(args.out, "training_summary.json"), "w", encoding="utf-8") as f:
        json.dump(summary, f, indent=1)
    if args.log:
        with open(args.log, "w", encoding="utf-8") as f:
            json.dump(log, f)
    print(f"wrote {args.out} after {wall:.1f} s", flush=True)
    return summary


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", required=True, help="checkpoint directory to write (real GLM-5.3-Flash layout)")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="training device")
    p.add_argument("--steps", type=int, default=1000, help="optimizer steps over all three phases")
    p.add_argument("--batch", type=int, default=8, help="windows per step")
    p.add_argument("--seq-len", type=int, default=256, help="bytes per window (after BOS)")
    p.add_argument("--lr", type=float, default=2e-3, help="peak learning rate (AdamW)")
    p.add_argument("--warmup", type=int, default=30, help="warm-up steps")
    p.add_argument("--weight-decay", type=float, default=0.01, help="AdamW weight decay")
    p.add_argument("--clip", type=float, default=1.0, help="gradient-norm clip per parameter group")
    p.add_argument("--sparse-frac", type=float, default=0.3, help="share of steps with the trunk attending sparse")
    p.add_argument("--mtp-frac", type=float, default=0.1, help="share of steps training the MTP layer alone")
    p.add_argument("--router-bias-rate", type=float, default=5e-3, help="aux-loss-free balancing step")
    p.add_argument("--seed", type=int, default=0, help="seed of init, data order and sampling")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    p.add_argument("--max-corpus-bytes", type=int, default=None, help="read training files up to this many bytes")
    p.add_argument("--val-windows", type=int, default=8, help="held-out windows for the running validation")
    p.add_argument("--eval-every", type=int, default=100, help="steps between held-out evaluations")
    p.add_argument("--log-every", type=int, default=10, help="steps between log lines")
    p.add_argument("--log", default=None, help="write the per-step log (JSON) here")
    p.add_argument("--smoke", action="store_true", help="toy size, a few steps: checks the pipeline in seconds")
    return p


SMOKE_ARGS = {
    "steps": 8,
    "batch": 2,
    "seq_len": 48,
    "warmup": 2,
    "max_corpus_bytes": 200_000,
    "val_windows": 2,
    "eval_every": 4,
    "log_every": 1,
}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.smoke:
        defaults = build_parser().parse_args(["--out", args.out])
        for k, v in SMOKE_ARGS.items():
            # Explicit options win over the smoke defaults.
            if getattr(args, k) == getattr(defaults, k):
                setattr(args, k, v)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("train_small: --device cuda asked for but CUDA is not available", file=sys.stderr)
        return 2
    train(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
