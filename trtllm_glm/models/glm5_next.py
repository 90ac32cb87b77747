"""`Glm5NextForCausalLM`: the GLM-5.3-Flash-class hybrid reference model (KDA + k-pool sparse MLA) and
its MTP layer, running on the paged caches of `Glm5NextCacheManager`.

Weight names follow the HF layout of GLM-5.3-Flash checkpoints (``model.embed_tokens``,
``model.layers.{i}.{input_layernorm, self_attn, post_attention_layernorm, mlp}``, ``model.norm``,
``lm_head``; the MTP block is ``model.layers.{num_hidden_layers}`` with ``enorm``, ``hnorm``,
``eh_proj`` and ``shared_head.norm``).
"""

from __future__ import annotations

import copy
import dataclasses
import math
import os
import re
from collections.abc import Iterable

import torch
from torch import nn

from ..attention.interface import AttentionBackend
from ..attention.metadata import AttentionMetadata
from ..attention.registry import resolve_attention_backend
from ..cache.manager import Glm5NextCacheManager
from ..config import LAYER_SPARSE_MLA, Glm5NextConfig, QuantConfig, resolve_preset_dir
from ..distributed.comm import NULL_COMM, Comm
from ..distributed.mapping import Mapping
from ..distributed.sharding import local_config, shard_fn, shard_state_dict
from ..errors import CheckpointError
from ..kda.backend import DEFAULT_KDA_BACKEND, StaticKdaStep
from ..modules.ffn import MoE, make_ffn
from ..modules.init import init_linear_
from ..modules.linear import (
    Fp8Linear,
    dequantize_fp8_linears_,
    swap_fp8_linears_,
    unswap_empty_,
    use_numerics_linears_,
)
from ..modules.mhc import (
    mhc_backend,
    mhc_block,
    mhc_block_post,
    mhc_block_pre,
    mhc_fuse,
    mhc_post_mean_norm,
    mhc_pre_norm,
)
from ..modules.norm import RMSNorm
from ..numerics import batch_invariant

__all__ = [
    "DEFAULT_FP8_LM_HEAD",
    "FP8_LM_HEAD_MODES",
    "QUANTIZATION_MODES",
    "Glm5NextDecoderLayer",
    "Glm5NextMTPLayer",
    "Glm5NextModel",
    "Glm5NextForCausalLM",
    "decide_fp8_lm_head",
    "resolve_dtype",
    "resolve_fp8_lm_head",
    "resolve_quantization",
]


# Parameters kept in FP32 whatever the model dtype: router scores and bias (a bf16 bias reorders near-tied
# experts), the KDA gate constants and conv taps (the reference keeps these in FP32 too), the indexer's
# FP32 head weights and pooling bias (docs/design.md §3), and the mHC mixing weights (computed in FP32).
FP32_PARAM_SUFFIXES = (
    "mlp.gate.weight",
    "mlp.gate.e_score_correction_bias",
    "self_attn.A_log",
    "self_attn.dt_bias",
    "conv1d.weight",
    "indexer.index_kpool_compress_ape",
    "indexer.weights_proj.weight",
    "hc_attn_fn",
    "hc_attn_base",
    "hc_attn_scale",
    "hc_ffn_fn",
    "hc_ffn_base",
    "hc_ffn_scale",
)


def is_fp32_param(name: str) -> bool:
    return name.endswith(FP32_PARAM_SUFFIXES)


SCALE_SUFFIX = "_scale_inv"
QUANTIZATION_MODES = ("auto", "fp8", "none")
"""How `Glm5NextForCausalLM.from_pretrained` holds the weights (vLLM's ``quantization`` name):

* ``"auto"`` (default): as the source has them: a block-FP8 checkpoint's quantized weights stay FP8 (e4m3 codes
  plus fp32 tile scales), everything else in ``dtype``;
* ``"fp8"``: like ``"auto"``, and a source without ``quantization_config`` (a bf16 checkpoint, a preset's
  random weights) is quantised to block FP8 at load (128 x 128 tiles; ``lm_head`` kept);
* ``"none"``: every weight dequantised to ``dtype`` at load (debugging)."""


def resolve_quantization(mode: str | None) -> str:
    """``None`` -> ``"auto"``; anything else must be one of `QUANTIZATION_MODES` (``"bf16"`` is taken as
    ``"none"``, the name ``bench_e2e.py --weights`` uses)."""
    if mode is None:
        return "auto"
    mode = {"bf16": "none", "bfloat16": "none"}.get(mode, mode)
    if mode not in QUANTIZATION_MODES:
        raise ValueError(f"unsupported quantization {mode!r} (expected one of {list(QUANTIZATION_MODES)})")
    return mode


FP8_LM_HEAD_MODES: tuple[str | bool | None, ...] = (None, "auto", True, False)
"""How `Glm5NextForCausalLM.from_pretrained` holds ``lm_head`` (``fp8_lm_head``; docs/fp8.md, "The LM head"):

* ``None`` (the default, `DEFAULT_FP8_LM_HEAD`): as the source holds it, the behaviour before the option: a
  checkpoint's ``lm_head`` as stored (GLM's FP8 checkpoints list it in ``modules_to_not_convert``: bf16), and
  quantising at load (``quantization="fp8"``) keeps it in the model dtype;
* ``"auto"``: block FP8 when the rest of the model holds block-FP8 weights (an FP8 checkpoint, or
  ``quantization="fp8"``), else in the model dtype: where the trunk is FP8 the head is the largest weight left in
  16 bits (1.27 GB at the real size, about half of the FP8 decode step's bytes on the 4-layer slice);
* ``True``: block FP8 (128 x 128 tiles, or the checkpoint's; quantised at load when stored in float), whatever the
  trunk holds;
* ``False``: in the model dtype (a head stored in FP8 is dequantised at load).

A head tied to the embedding (``tie_word_embeddings``) stays tied and in the model dtype: ``"auto"`` keeps it so,
``True`` is refused (the embedding is a row lookup that stays float, and an FP8 copy beside it would add bytes, not
save them)."""

DEFAULT_FP8_LM_HEAD: str | bool | None = None
"""The default of ``fp8_lm_head``: ``None``, as the source holds the head (no FP8 head unless a checkpoint stores
one). ``"auto"`` is not the default: on the trained ``small`` preset (CPU, 2026-12-07, held-out stdlib prompts,
``bench_e2e.py --trained --quality --weights fp8``) the FP8 head's argmax agreement with the bf16 model is below the
bf16 floor's (99.07 % vs 99.53 % over 1,929 positions, 99.20 % vs 99.48 % over 7,718) and so is its KL (2.13e-4 vs
9.71e-5; 1.89e-4 vs 1.43e-4), where issue 44 asks for both within the floor (docs/fp8.md, "The LM head")."""


def resolve_fp8_lm_head(value: object) -> str | bool | None:
    """``value`` checked against `FP8_LM_HEAD_MODES` (``None``, ``"auto"``, ``True``, ``False``) and returned.

    Raises:
        ValueError: anything else (``1``, ``"on"``, ``"fp8"`` ...): one line naming the accepted values.
    """
    if value is None or value is True or value is False or value == "auto":
        return value  # type: ignore[return-value]
    raise ValueError(f"fp8_lm_head must be 'auto', True, False or None (as stored), got {value!r}")


def decide_fp8_lm_head(value: object, *, trunk_fp8: bool, tied: bool) -> bool | None:
    """Whether ``lm_head`` is held in block FP8 for ``fp8_lm_head=value`` (`FP8_LM_HEAD_MODES`); ``None`` for the
    default (``value`` None: the head as the source holds it, nothing to change).

    Args:
        value: ``None``, ``"auto"``, ``True`` or ``False``.
        trunk_fp8: whether the rest of the model holds block-FP8 weights (what ``"auto"`` follows).
        tied: whether ``lm_head`` is tied to the embedding (``"auto"`` then keeps it float).

    Raises:
        ValueError: a bad value, or ``True`` for a tied head.
    """
    mode = resolve_fp8_lm_head(value)
    if mode is None:
        return None
    if mode is True and tied:
        raise ValueError(
            "fp8_lm_head=True: this model ties lm_head to the embedding (tie_word_embeddings), which stays in the "
            "model dtype; use fp8_lm_head='auto', False or None"
        )
    return bool(trunk_fp8 and not tied) if mode == "auto" else bool(mode)


def _skip_list_for_head(model: nn.Module, quant: QuantConfig | None, head_fp8: bool) -> QuantConfig | None:
    """``quant`` with ``modules_to_not_convert`` made true about ``lm_head`` as ``model`` now holds it.

    A float head must be listed (GLM's checkpoints list ``lm_head``); an FP8 head must not be (a listed FP8 tensor is
    refused at load): entries matching ``lm_head`` are dropped. A model whose only FP8 linear is the head (a float
    trunk with ``fp8_lm_head=True``) gets a config listing every other linear, so that the list stays true.
    """
    tied = model.config.tie_word_embeddings  # type: ignore[union-attr]
    if quant is None:
        if not head_fp8:
            return None
        L = model.config.num_hidden_layers  # type: ignore[union-attr]
        everything = QuantConfig.block_fp8(getattr(model.lm_head, "block", 128), [])
        held = {n for n, mod in model.named_modules() if isinstance(mod, Fp8Linear)}
        rest = [_to_ckpt_name(_to_hf_name(n, L)) for n in fp8_linear_names(model, everything) if n not in held]
        return QuantConfig.block_fp8(everything.block, rest)
    skip = list(quant.modules_to_not_convert)
    if head_fp8 and quant.skips("lm_head"):
        skip = [p for p in skip if not QuantConfig(modules_to_not_convert=[p]).skips("lm_head")]
    elif not head_fp8 and not tied and not quant.skips("lm_head"):
        skip.append("lm_head")
    else:
        return quant
    return dataclasses.replace(quant, modules_to_not_convert=skip, raw={**quant.raw, "modules_to_not_convert": skip})


def fp8_linear_names(model: nn.Module, quant: QuantConfig) -> list[str]:
    """The ``nn.Linear`` modules of ``model`` that a block-FP8 ``quant`` holds in FP8: every one except those
    ``modules_to_not_convert`` lists (matched on the internal and the checkpoint name), those whose weight
    the model keeps in FP32 (`FP32_PARAM_SUFFIXES`) and a tied ``lm_head``. Used to quantise at load and for
    the memory estimate; an FP8 checkpoint's own tensors decide what it holds (`from_pretrained`)."""
    L = model.config.num_hidden_layers  # type: ignore[union-attr]
    tied = model.config.tie_word_embeddings  # type: ignore[union-attr]
    out = []
    for name, mod in model.named_modules():
        if not isinstance(mod, nn.Linear) or mod.bias is not None or is_fp32_param(name + ".weight"):
            continue
        if tied and name == "lm_head":  # its weight is the embedding's
            continue
        hf = _to_hf_name(name, L)
        if quant.skips(hf) or quant.skips(_to_ckpt_name(hf)) or quant.skips(name):
            continue
        out.append(name)
    return out


def resolve_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    table = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
             "float16": torch.float16, "fp16": torch.float16}  # fmt: skip
    if name not in table:
        raise ValueError(f"unsupported dtype {name!r} (expected one of {sorted(table)})")
    return table[name]


class Glm5NextDecoderLayer(nn.Module):
    """Decoder block: KDA or sparse MLA, then a dense or MoE FFN, each wrapped in mHC (trunk layers) or
    in a plain pre-norm residual (the MTP block, ``use_mhc=False``).

    Trunk layers map residual streams ``[N, hc_mult, D] -> [N, hc_mult, D]`` (`modules.mhc`): for each
    of attention and FFN, the streams collapse through ``pre`` into the block input, the block output
    expands through ``post`` and adds to the ``comb``-mixed input streams. mHC weights use the checkpoint
    names ``hc_attn_{fn,base,scale}`` and ``hc_ffn_{fn,base,scale}`` and stay in FP32.

    Args:
        config: geometry.
        layer_idx: index in the schedule (picks dense vs MoE FFN and the indexer mode).
        kind: ``"kda"`` or ``"sparse_mla"``.
        cache_idx: the layer's index among its kind (KDA state plane or sparse cache plane).
        use_mhc: wrap the blocks in mHC (trunk) or a plain residual (MTP).
        mapping: tensor / expert parallel layout (``config`` is then the rank's local config): the mixer's and
            the FFN's outputs are partial sums, all-reduced here through ``comm`` (set by the model).
        attention_backend: the backend that builds a sparse layer's mixer (default the k-pool backend); a KDA layer's
            mixer comes from `kda.backend.DEFAULT_KDA_BACKEND`.
    """

    def __init__(
        self,
        config: Glm5NextConfig,
        layer_idx: int,
        kind: str,
        cache_idx: int,
        *,
        use_mhc: bool = True,
        mapping: Mapping | None = None,
        attention_backend: AttentionBackend | None = None,
    ) -> None:
        super().__init__()
        # The collectives of the row-parallel outputs (a plain attribute; `Glm5NextForCausalLM.set_comm`).
        self.comm: Comm = NULL_COMM
        self.layer_idx = layer_idx
        self.kind = kind
        self.cache_idx = cache_idx
        self.use_mhc = use_mhc
        self.norm_eps = config.rms_norm_eps
        self.hc_eps = config.hc_eps
        self.hc_iters = config.hc_sinkhorn_iters
        D = config.hidden_size
        self.input_layernorm = RMSNorm(D, eps=config.rms_norm_eps)
        if kind == LAYER_SPARSE_MLA:
            self.self_attn: nn.Module = resolve_attention_backend(attention_backend).make_layer(config, layer_idx)
        else:
            self.self_attn = DEFAULT_KDA_BACKEND.make_layer(config, cache_idx)
        self.post_attention_layernorm = RMSNorm(D, eps=config.rms_norm_eps)
        self.mlp = make_ffn(config, layer_idx, mapping)
        if use_mhc:
            S = config.hc_mult
            mix = (2 + S) * S
            for blk in ("attn", "ffn"):
                self.register_parameter(f"hc_{blk}_fn", nn.Parameter(torch.zeros(mix, S * D)))
                self.register_parameter(f"hc_{blk}_base", nn.Parameter(torch.zeros(mix)))
                self.register_parameter(f"hc_{blk}_scale", nn.Parameter(torch.ones(3)))

    @property
    def is_sparse(self) -> bool:
        return self.kind == LAYER_SPARSE_MLA

    @torch.no_grad()
    def reset_parameters(self, generator: torch.Generator, std: float) -> None:
        """Seeded init of the mixer, the FFN, then (trunk) the mHC weights: ``fn ~ N(0, std)``, ``base ~
        N(0, 0.5)``, ``scale ~ 1 + N(0, 0.25)`` so that pre, post and comb all vary by token and stream."""
        self.self_attn.reset_parameters(generator, std)
        self.mlp.reset_parameters(generator, std)
        if self.use_mhc:
            stds = {"fn": std, "base": 0.5, "scale": 0.25}
            for blk in ("attn", "ffn"):
                for part, s in stds.items():
                    p = getattr(self, f"hc_{blk}_{part}")
                    t = torch.empty(p.shape, dtype=torch.float32).normal_(0.0, s, generator=generator)
                    p.copy_(t + 1.0 if part == "scale" else t)

    def _attn(
        self, x: torch.Tensor, meta: AttentionMetadata, manager: Glm5NextCacheManager, sparse_cache_idx: int | None,
        normed: bool = False,
    ) -> torch.Tensor:  # fmt: skip
        # Under tensor parallelism each rank's o_proj sums its heads only: one all-reduce joins them.
        return self.comm.all_reduce_tp(self._attn_local(x, meta, manager, sparse_cache_idx, normed))

    def _attn_local(
        self, x: torch.Tensor, meta: AttentionMetadata, manager: Glm5NextCacheManager, sparse_cache_idx: int | None,
        normed: bool = False,
    ) -> torch.Tensor:  # fmt: skip
        if not normed:  # the fused residual site (`forward_fused`) hands over the normed input
            x = self.input_layernorm(x)
        if self.is_sparse:
            idx = self.cache_idx if sparse_cache_idx is None else sparse_cache_idx
            return self.self_attn(x, meta, manager.layer_cache(idx))
        verify = meta.spec.verify_seqs
        if verify:
            a, rec = self.self_attn.forward_spec(x, meta, manager.kda_layer_state(self.cache_idx), verify)
            # The state owner keeps the records until the executor commits the accepted prefix.
            manager.state.record_verify(self.cache_idx, rec)
            return a
        return self.self_attn(x, meta, manager.kda_layer_state(self.cache_idx))

    def _mhc_params(self, blk: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return getattr(self, f"hc_{blk}_fn"), getattr(self, f"hc_{blk}_base"), getattr(self, f"hc_{blk}_scale")

    def _mhc(self, blk: str, streams: torch.Tensor, fn) -> torch.Tensor:
        return mhc_block(
            streams,
            fn,
            *self._mhc_params(blk),
            norm_eps=self.norm_eps,
            hc_eps=self.hc_eps,
            sinkhorn_iters=self.hc_iters,
        )

    def forward(
        self,
        h: torch.Tensor,
        meta: AttentionMetadata,
        manager: Glm5NextCacheManager,
        sparse_cache_idx: int | None = None,
    ) -> torch.Tensor:
        """Trunk: streams ``[N, S, D] -> [N, S, D]``; MTP block: ``[N, D] -> [N, D]``.

        ``sparse_cache_idx`` overrides the sparse plane (the MTP layer's).
        """
        if not self.use_mhc:
            h = h + self._attn(h, meta, manager, sparse_cache_idx)
            return h + self._ffn(self.post_attention_layernorm(h), meta.row_live_t)
        h = self._mhc("attn", h, lambda x: self._attn(x, meta, manager, sparse_cache_idx))
        return self.ffn_block(h, meta.row_live_t)

    def forward_fused(
        self,
        h: torch.Tensor,
        prev: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
        meta: AttentionMetadata,
        manager: Glm5NextCacheManager,
        backend: str,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """Trunk `forward` with fused residual sites (`mhc_pre_norm`, ``TRTLLM_GLM_MHC_FUSE=1``; the same values):
        each site runs the previous block's mHC expand, this block's mHC weights and collapse and the block's input
        RMSNorm together, so the FFN's expand is left to the next layer's first site (or the model's end).

        Args:
            h: the streams entering the previous block when ``prev`` is given, else this layer's input streams.
            prev: the previous layer's pending FFN expand ``(ffn_out, post, comb)``, or ``None``.
            backend: the resolved `mhc_backend` choice.

        Returns:
            ``(streams, pending)``: the streams entering this layer's FFN block and its pending expand.
        """
        kw = {"norm_eps": self.norm_eps, "hc_eps": self.hc_eps, "sinkhorn_iters": self.hc_iters, "backend": backend}
        ln = self.input_layernorm
        h, x, post, comb = mhc_pre_norm(h, *self._mhc_params("attn"), ln.weight, rms_eps=ln.eps, prev=prev, **kw)
        a = self._attn(x, meta, manager, None, normed=True)
        ln = self.post_attention_layernorm
        h, x, post, comb = mhc_pre_norm(
            h, *self._mhc_params("ffn"), ln.weight, rms_eps=ln.eps, prev=(a, post, comb), **kw
        )
        return h, (self._ffn(x, meta.row_live_t), post, comb)

    def _ffn(self, x: torch.Tensor, row_live: torch.Tensor) -> torch.Tensor:
        # The MoE skips the routed experts of rows nobody reads (padding, verify filler): fewer experts read.
        # Its output is this rank's experts' and shared-expert slice's partial sum: one all-reduce over every
        # rank (also when attention is replicated); a dense MLP's over the tensor-parallel ranks.
        if isinstance(self.mlp, MoE):
            return self.comm.all_reduce(self.mlp(x, row_live=row_live))
        return self.comm.all_reduce_tp(self.mlp(x))

    # --------------------------------------------------------------------------------------------
    # The trunk layer's forward in pieces, for the piecewise CUDA graphs (`trtllm_glm.runtime.piecewise`): every
    # piece but `attn_core` is token-wise (row i of its outputs depends on row i of its inputs only: no host
    # sync, no shape from data), so it can run on padded rows inside a graph. `forward` is, op for op,
    # ``attn_pre``, ``attn_in``, ``attn_core``, ``attn_out``, ``attn_post``, ``ffn_block`` (a verify step aside).
    def attn_pre(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """mHC collapse of the attention block: streams ``[N, S, D]`` -> ``(x_in [N, D], post [N, S], comb [N, S,
        S])`` (`mhc_block_pre`)."""
        fn, base, scale = self._mhc_params("attn")
        return mhc_block_pre(
            h, fn, base, scale, norm_eps=self.norm_eps, hc_eps=self.hc_eps, sinkhorn_iters=self.hc_iters,
            backend=mhc_backend(h, fn, base, scale),
        )  # fmt: skip

    def attn_in(self, x_in: torch.Tensor) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        """The attention's token-wise input side: ``(x [N, D], inputs)``: ``x`` the normed block input (what the
        mixer is called with) and, for KDA, ``inputs`` its projections (`KimiDeltaAttention.project`: conv
        inputs, decay, beta and, with fused weights, the output gate's low-rank input); ``()`` for sparse MLA."""
        x = self.input_layernorm(x_in)
        if self.is_sparse:
            return x, ()
        return x, self.self_attn.project(x)

    def attn_core(
        self, x: torch.Tensor, inputs: tuple[torch.Tensor | None, ...], meta: AttentionMetadata,
        manager: Glm5NextCacheManager,
    ) -> torch.Tensor:  # fmt: skip
        """The sequence-dependent part (reads the metadata and the caches): KDA's conv and delta rule ->
        ``o [N, H, V]`` fp32 (`KimiDeltaAttention.mix`); sparse MLA, the whole mixer -> its ``[N, D]`` partial
        output. In a step with verify rows a KDA layer runs `KimiDeltaAttention.mix_spec` and hands its records to
        the state owner, as `_attn_local` does; they keep copies of the conv input and decay rows (``inputs`` are
        the piecewise runner's carry rows, which the next layers overwrite before the commit)."""
        if self.is_sparse:
            return self.self_attn(x, meta, manager.layer_cache(self.cache_idx))
        state = manager.kda_layer_state(self.cache_idx)
        verify = meta.spec.verify_seqs
        if verify:
            kx, g, beta, ga = inputs
            o, rec = self.self_attn.mix_spec(x, meta, state, (kx.clone(), g.clone(), beta, ga), verify)
            manager.state.record_verify(self.cache_idx, rec)
            return o
        return self.self_attn.mix(x, meta, state, inputs)

    def attn_core_static(
        self, inputs: tuple[torch.Tensor | None, ...], step: StaticKdaStep, manager: Glm5NextCacheManager
    ) -> torch.Tensor:
        """A KDA layer's `attn_core` on the bucket's rows from a device-side step description (graph-safe:
        `KimiDeltaAttention.mix_static`) -> ``o [T, H, V]`` fp32."""
        if self.is_sparse:
            raise ValueError("attn_core_static is for KDA layers")
        return self.self_attn.mix_static(inputs, step, manager.kda_layer_state(self.cache_idx))

    def attn_out(self, x: torch.Tensor, core: torch.Tensor, ga: torch.Tensor | None) -> torch.Tensor:
        """The attention's output ``[N, D]`` (all-reduced) from `attn_core`'s: KDA's gated norm and ``o_proj``
        (``ga``: the output gate's low-rank input from `attn_in`, ``None`` without fused weights)."""
        local = core if self.is_sparse else self.self_attn.project_out(x, core, ga)
        return self.comm.all_reduce_tp(local)

    def attn_post(self, h: torch.Tensor, a: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
        """mHC expansion of the attention block: new streams ``[N, S, D]`` (`mhc_block_post`)."""
        fn, base, scale = self._mhc_params("attn")
        return mhc_block_post(h, a, post, comb, backend=mhc_backend(h, fn, base, scale))

    def ffn_block(self, h: torch.Tensor, row_live: torch.Tensor) -> torch.Tensor:
        """The mHC-wrapped FFN block: streams ``[N, S, D] -> [N, S, D]``; ``row_live [N]``: rows whose output is
        read (the MoE computes no routed expert for the others)."""
        return self._mhc("ffn", h, lambda x: self._ffn(self.post_attention_layernorm(x), row_live))


class Glm5NextModel(nn.Module):
    """Embedding, the layer schedule over ``hc_mult`` residual streams, the stream mean and the final norm."""

    def __init__(
        self, config: Glm5NextConfig, mapping: Mapping | None = None, attention_backend: AttentionBackend | None = None
    ) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        layers = []
        n_sparse = n_kda = 0
        for i, kind in enumerate(config.layer_types or []):
            if kind == LAYER_SPARSE_MLA:
                layers.append(
                    Glm5NextDecoderLayer(
                        config, i, kind, n_sparse, mapping=mapping, attention_backend=attention_backend
                    )
                )
                n_sparse += 1
            else:
                layers.append(Glm5NextDecoderLayer(config, i, kind, n_kda, mapping=mapping))
                n_kda += 1
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, meta: AttentionMetadata, manager: Glm5NextCacheManager) -> torch.Tensor:
        """``input_ids [N]`` -> final-normed hidden ``[N, D]`` (``norm(mean over streams)``)."""
        e = self.embed_tokens(input_ids)
        h = e.unsqueeze(1).expand(-1, self.config.hc_mult, -1)
        backend = self.fused_sites_backend(h)
        if backend is not None:
            # Fused residual sites (`Glm5NextDecoderLayer.forward_fused`): the first layer reads the embedding as
            # its streams in place (stride 0 across them: no copy), each layer leaves its FFN's expand to the next
            # layer's first site, and the last one runs with the stream mean and the final norm in one launch.
            prev = None
            for layer in self.layers:
                h, prev = layer.forward_fused(h, prev, meta, manager, backend)
            return mhc_post_mean_norm(h, *prev, self.norm.weight, rms_eps=self.norm.eps, backend=backend)
        h = h.contiguous()
        for layer in self.layers:
            h = layer(h, meta, manager)
        return self.norm(h.mean(dim=1))

    def fused_sites_backend(self, h: torch.Tensor) -> str | None:
        """The mHC backend of the fused residual sites when the forward takes them (``TRTLLM_GLM_MHC_FUSE=1``, mHC on
        its kernels, some layer, outside the batch-invariant mode), else ``None``. Eager and captured steps decide
        alike (flags and devices only). The batch-invariant mode keeps the unfused launches: the fused kernels are
        batch invariant too, but their norms sum in another layout than `trtllm_glm.norm.row_norm`, so the mode's
        bits would change with the flag (docs/gpu.md)."""
        if not self.layers or not mhc_fuse() or batch_invariant():
            return None
        first = self.layers[0]
        if not first.use_mhc:
            return None
        backend = mhc_backend(h, *first._mhc_params("attn"))
        return backend if backend == "triton" else None


class Glm5NextMTPLayer(nn.Module):
    """Native next-token-prediction block (layer index ``num_hidden_layers``).

    Row ``i`` pairs the embedding of token ``i + 1`` with the target's final hidden of token ``i``:
    ``eh_proj([enorm(embed(tok_{i+1})); hnorm(hidden_i)])``, one sparse-MLA decoder block with its own
    indexer and FFN, then ``shared_head.norm``; logits come from the model's shared LM head.
    """

    def __init__(
        self, config: Glm5NextConfig, mapping: Mapping | None = None, attention_backend: AttentionBackend | None = None
    ) -> None:
        super().__init__()
        D = config.hidden_size
        self.layer_idx = config.num_hidden_layers
        self.enorm = RMSNorm(D, eps=config.rms_norm_eps)
        self.hnorm = RMSNorm(D, eps=config.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * D, D, bias=False)
        self.block = Glm5NextDecoderLayer(
            config, self.layer_idx, LAYER_SPARSE_MLA, cache_idx=0, use_mhc=False, mapping=mapping,
            attention_backend=attention_backend,
        )  # fmt: skip
        self.shared_head = nn.Module()
        self.shared_head.norm = RMSNorm(D, eps=config.rms_norm_eps)

    def forward(
        self,
        token_embeds: torch.Tensor,
        prev_hidden: torch.Tensor,
        meta: AttentionMetadata,
        manager: Glm5NextCacheManager,
        sparse_cache_idx: int,
    ) -> torch.Tensor:
        """Draft hidden rows.

        Args:
            token_embeds: ``[N, D]`` embeddings of the next tokens.
            prev_hidden: ``[N, D]`` target final hidden of the current tokens.
            meta: metadata of the draft domain (its positions are the target positions of ``prev_hidden``).
            manager: the manager holding the MTP layer's sparse cache plane.
            sparse_cache_idx: the MTP plane's index in ``manager``.

        Returns:
            ``[N, D]`` normed hidden for the shared LM head.
        """
        x = torch.cat([self.enorm(token_embeds), self.hnorm(prev_hidden)], dim=-1)
        h = self.block(self.eh_proj(x), meta, manager, sparse_cache_idx=sparse_cache_idx)
        return self.shared_head.norm(h)


class Glm5NextForCausalLM(nn.Module):
    """The full model: trunk, LM head and (when configured) the MTP layer.

    With a parallel ``mapping`` (docs/parallelism.md) the module is one rank's share: ``config`` is that
    rank's local geometry (`trtllm_glm.distributed.sharding.local_config`: its heads and dense width; the
    caches an executor allocates follow it), ``full_config`` the model's, and the row-parallel outputs are
    all-reduced through the `Comm` given to `set_comm` (a forward without one refuses to run).

    ``attention_backend`` (a registered name or the backend; default the k-pool backend,
    `trtllm_glm.attention.registry`) builds the sparse layers; the executor asks it for the step metadata and
    the cache manager for the planes a page holds.
    """

    def __init__(
        self,
        config: Glm5NextConfig,
        *,
        mapping: Mapping | None = None,
        attention_backend: str | AttentionBackend | None = None,
    ) -> None:
        super().__init__()
        # A plain attribute: the backend is no module (its layers are).
        self.attention_backend = backend = resolve_attention_backend(attention_backend)
        self.mapping = mapping or Mapping()
        self.full_config = config
        config = local_config(config, self.mapping)
        self.config = config
        self.comm: Comm = NULL_COMM
        self.model = Glm5NextModel(config, self.mapping, backend)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.mtp = Glm5NextMTPLayer(config, self.mapping, backend) if config.num_nextn_predict_layers > 0 else None
        # The directory `from_pretrained` loaded the weights from (None: built from a config): files shipped
        # beside them (e.g. the draft vocabulary's token-frequency ranking) are looked up there.
        self.checkpoint_dir: str | None = None
        # Every float projection (the LM head too) follows the batch-invariant mode (`NumericsLinear`).
        use_numerics_linears_(self)

    def set_comm(self, comm: Comm) -> None:
        """Give every decoder layer (MTP block included) the rank's collectives."""
        if comm.mapping.world_size != self.mapping.world_size:
            raise ValueError(
                f"comm of world size {comm.mapping.world_size} for a model sharded {self.mapping.describe()}"
            )
        self.comm = comm
        for m in self.modules():
            if isinstance(m, Glm5NextDecoderLayer):
                m.comm = comm

    def check_comm(self) -> None:
        """Raise unless a sharded model has its collectives (`set_comm`): a forward without them would be wrong."""
        if self.mapping.is_parallel and self.comm is NULL_COMM:
            raise RuntimeError(f"model sharded as {self.mapping.describe()} has no collectives: call set_comm first")

    # --------------------------------------------------------------------------------------------
    @property
    def num_sparse_layers(self) -> int:
        return len(self.config.sparse_layer_ids)

    def forward(self, input_ids: torch.Tensor, meta: AttentionMetadata, manager: Glm5NextCacheManager) -> torch.Tensor:
        """Final hidden ``[N, D]`` of every row (logits via `compute_logits` on the rows needed)."""
        # Records of a step that was never committed (it raised) must not be folded by a later commit.
        manager.state.discard_pending()
        self.check_comm()
        return self.model(input_ids, meta, manager)

    def compute_logits(self, hidden: torch.Tensor, *, cast: bool = True) -> torch.Tensor:
        """``[n, D] -> [n, V]`` FP32 logits (``cast=False``: in the LM head's dtype, for a caller whose next kernel
        writes the FP32 copy as it reads them: `trtllm_glm.logits.greedy_pack`'s ``f32_out``)."""
        out = self.lm_head(hidden)
        return out.float() if cast else out

    def commit_kda(self, meta: AttentionMetadata, manager: Glm5NextCacheManager, num_accepted: list[int]) -> None:
        """Fold each verified sequence's first ``num_accepted[b]`` rows into every KDA layer's state.

        Args:
            meta: the metadata of the verify step (its state slots).
            manager: the cache manager whose state owner holds the records the forward stored.
            num_accepted: ``[num_seqs]`` accepted rows (root + accepted drafts) per batch sequence.
        """
        manager.state.commit_verified(meta.state_slots, num_accepted)

    def mtp_forward(
        self,
        next_tokens: torch.Tensor,
        prev_hidden: torch.Tensor,
        meta: AttentionMetadata,
        manager: Glm5NextCacheManager,
        sparse_cache_idx: int,
    ) -> torch.Tensor:
        """One MTP step: ``next_tokens [N]``, ``prev_hidden [N, D]`` -> draft hidden ``[N, D]``."""
        if self.mtp is None:
            raise RuntimeError("this model has no MTP layer (num_nextn_predict_layers == 0)")
        self.check_comm()
        return self.mtp(self.model.embed_tokens(next_tokens), prev_hidden, meta, manager, sparse_cache_idx)

    # --------------------------------------------------------------------------------------------
    @torch.no_grad()
    def reset_parameters(self, seed: int = 0) -> None:
        """Seeded random init (draws on the CPU, so a seed gives the same weights on every device)."""
        g = torch.Generator().manual_seed(seed)
        std = self.config.initializer_range
        for name, p in self.named_parameters():
            # Norm weights stay at 1; everything else is redrawn below per module.
            if name.endswith("norm.weight") or ".norm." in name:
                p.fill_(1.0)
        emb = torch.empty(self.model.embed_tokens.weight.shape).normal_(0.0, 1.0, generator=g)
        self.model.embed_tokens.weight.copy_(emb)
        # Each block's mixer and FFN initialise their own subtree once, in layer order.
        blocks = list(self.model.layers) + ([self.mtp.block] if self.mtp is not None else [])
        for block in blocks:
            block.reset_parameters(g, std)
        init_linear_(self.lm_head, g, std)
        if self.mtp is not None:
            init_linear_(self.mtp.eh_proj, g, std)

    @classmethod
    def from_config(
        cls,
        config: Glm5NextConfig,
        *,
        seed: int = 0,
        dtype: torch.dtype | str = "float32",
        device: str = "cpu",
        mapping: Mapping | None = None,
        quantization: str | None = None,
        local_init: bool | None = None,
        fp8_lm_head: str | bool | None = None,
    ) -> Glm5NextForCausalLM:
        """A seeded random model (the tiny preset's weights are this). With a parallel ``mapping``: this
        rank's share of the same weights (the whole model is drawn on the CPU, then cut);
        ``quantization="fp8"`` holds the draws quantised to block FP8 (`quantize_fp8_`; under a parallel
        mapping each rank quantises its own share, which equals a cut of the whole model's quantisation where
        the cuts fall on 128-wide tiles).

        ``local_init=True`` never builds the whole model: the rank's share is made on the meta device, held
        on ``device`` (``to_empty``) and each parameter drawn there (`_fill_local_`: seeded by its name in the
        whole model, the scales of `reset_parameters`, other values); an FP8 linear is drawn and quantised one
        at a time, so the peak is about the rank's FP8 share plus one linear in fp32. ``None`` (default) takes
        it when the whole model's fp32 draw would not fit in half the host's available memory
        (`needs_local_init`), so the presets keep the whole-model draw and the full config does not.

        ``fp8_lm_head`` (`FP8_LM_HEAD_MODES`): the LM head in block FP8 (quantised from the fp32 draw) or not;
        ``None`` leaves it as ``config.quantization``'s list says (``lm_head`` listed: float)."""
        mode = resolve_quantization(quantization)
        trunk_fp8 = mode == "fp8" or (mode == "auto" and config.quantization is not None)
        head = decide_fp8_lm_head(fp8_lm_head, trunk_fp8=trunk_fp8, tied=config.tie_word_embeddings)
        if head is not None:
            # The model records its head in ``config.quantization``: a copy, so that the caller's config (reused for
            # another model) keeps its own list.
            config = dataclasses.replace(config)
        if local_init is None:
            local_init = needs_local_init(config)
        if local_init:
            return cls._from_config_local(
                config, seed=seed, dtype=dtype, device=device, mapping=mapping, mode=mode, head=head
            )
        with torch.device("cpu"):
            m = cls(config)
        m.reset_parameters(seed)
        if mapping is not None and mapping.is_parallel:
            L = config.num_hidden_layers
            full = {_to_hf_name(n, L): t for n, t in m.state_dict().items()}
            with torch.device("meta"):
                m = cls(config, mapping=mapping)
            m.load_weights(shard_state_dict(full, config, mapping), device="cpu", source="preset")
        if trunk_fp8:
            m.quantize_fp8_(config.quantization)
        if head is not None:
            m.set_fp8_lm_head_(head)  # before the cast: an FP8 head is quantised from the fp32 draw
        m = m.to(device=device, dtype=resolve_dtype(dtype))
        m.keep_fp32_params_()
        return m.eval()

    @classmethod
    def _from_config_local(
        cls,
        config: Glm5NextConfig,
        *,
        seed: int,
        dtype: torch.dtype | str,
        device: str | torch.device,
        mapping: Mapping | None,
        mode: str,
        head: bool | None = None,
    ) -> Glm5NextForCausalLM:
        """`from_config(..., local_init=True)`: build on meta, hold on ``device``, fill parameter by parameter
        (``head``: `set_fp8_lm_head_` on meta first, unless None)."""
        dev = torch.device(device)
        if dev.type == "cuda" and dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        with torch.device("meta"):
            m = cls(config, mapping=mapping)
        if mode == "fp8" or (mode == "auto" and config.quantization is not None):
            m.quantize_fp8_(config.quantization)  # on meta: swaps the modules, quantises nothing yet
        if head is not None:
            m.set_fp8_lm_head_(head)  # on meta too: `_fill_local_` draws and quantises an FP8 head
        m = m.to(dtype=resolve_dtype(dtype))
        m.keep_fp32_params_()
        m = m.to_empty(device=dev)
        m._fill_local_(seed)
        return m.eval()

    @torch.no_grad()
    def _fill_local_(self, seed: int) -> None:
        """Draw every parameter on its device (`trtllm_glm.models.random_init`), keyed by its whole-model name:
        a routed expert by its global index, a tensor this rank holds a cut of by the cut as well (so replicated
        tensors are equal on every rank, as the lockstep needs, and cuts differ)."""
        from ..distributed.sharding import expert_block, param_shard
        from .random_init import draw, fill_random_

        full, L = self.full_config, self.config.num_hidden_layers
        e0 = expert_block(full, self.mapping)[0] if self.mapping.is_parallel else 0
        std = self.config.initializer_range
        conv = self.config.kda_short_conv_kernel_size
        fake = 128 * max(self.mapping.world_size, 1)  # a dim every split divides: only the cut's position is kept

        def key(name: str, ndim: int) -> str:
            hf = _to_hf_name(name, L)
            mt = _EXPERT_NAME.match(hf)
            if mt is not None:
                hf = f"{mt.group(1)}{int(mt.group(2)) + e0}{mt.group(3)}"
            if not self.mapping.is_parallel or ndim == 0:
                return hf
            got = param_shard(hf, (fake,) * ndim, full, self.mapping)
            cut = got[1] if isinstance(got, tuple) else None
            return hf if cut is None else f"{hf}@{cut.dim}:{cut.start}"

        fp8 = {n: mod for n, mod in self.named_modules() if isinstance(mod, Fp8Linear)}
        for n, mod in fp8.items():
            name = f"{n}.weight"
            w = draw(tuple(mod.weight.shape), mod.weight.device, name, key(name, 2), seed=seed, std=std, conv_size=conv)
            mod.set_weight_(w)  # quantised right away: one linear's fp32 draw alive at a time
            del w
        skip = {id(mod.weight) for mod in fp8.values()} | {id(mod.weight_scale_inv) for mod in fp8.values()}
        for name, p in self.named_parameters():
            if id(p) not in skip:
                fill_random_(p, name, key(name, p.dim()), seed=seed, std=std, conv_size=conv)

    @torch.no_grad()
    def quantize_fp8_(self, quant: QuantConfig | None = None) -> list[str]:
        """Hold the `fp8_linear_names` linears in block FP8 (`Fp8Linear`, weights quantised from their current
        values) and record ``quant`` (default `QuantConfig.block_fp8`: 128 x 128 tiles, ``lm_head`` kept) as the
        config's ``quantization_config``, so that `save_pretrained` writes a block-FP8 checkpoint.

        Returns:
            The module names now held in FP8.
        """
        quant = quant if quant is not None else QuantConfig.block_fp8()
        names = swap_fp8_linears_(self, fp8_linear_names(self, quant), quant.block)
        self.config.quantization = quant
        return names

    @torch.no_grad()
    def set_fp8_lm_head_(self, fp8: bool) -> bool:
        """Hold ``lm_head`` in block FP8 (``True``: `Fp8Linear`, quantised from its current weight in the tiles of
        ``config.quantization``, else 128 x 128) or in the embedding's dtype (``False``: dequantised); on the meta
        device only the module changes. ``config.quantization``'s ``modules_to_not_convert`` is kept true about the
        head (`_skip_list_for_head`), so `save_pretrained` writes what is held.

        Returns:
            Whether the head changed.

        Raises:
            ValueError: ``fp8`` for a head tied to the embedding.
        """
        held = isinstance(self.lm_head, Fp8Linear)
        if fp8 and self.config.tie_word_embeddings:
            decide_fp8_lm_head(True, trunk_fp8=True, tied=True)  # raises its one-line refusal
        if fp8 and not held:
            quant = self.config.quantization
            swap_fp8_linears_(self, ["lm_head"], quant.block if quant is not None else 128)
        elif held and not fp8:
            if self.lm_head.weight.device.type == "meta":
                unswap_empty_(self, ["lm_head"])
            else:
                dequantize_fp8_linears_(self, self.model.embed_tokens.weight.dtype, ["lm_head"])
        self.config.quantization = _skip_list_for_head(self, self.config.quantization, fp8)
        return held != fp8

    @torch.no_grad()
    def fuse_weights(self) -> None:
        """Give every submodule that can fuse its weights one storage per group of weights read by one GEMM
        (each submodule's ``fuse_weights``, e.g. `KimiDeltaAttention.fuse_weights`); idempotent. Executors call
        it on CUDA before capturing graphs."""
        for m in self.modules():
            if m is not self and callable(getattr(m, "fuse_weights", None)):
                m.fuse_weights()

    def keep_fp32_params_(self) -> None:
        """Return the `FP32_PARAM_SUFFIXES` parameters to FP32 after a cast of the whole model."""
        for name, p in self.named_parameters():
            if is_fp32_param(name) and p.dtype != torch.float32:
                p.data = p.data.float()

    @classmethod
    def from_pretrained(
        cls,
        model: str | os.PathLike[str],
        *,
        layers: Iterable[int] | None = None,
        dtype: torch.dtype | str | None = None,
        device: str = "cpu",
        seed: int = 0,
        mapping: Mapping | None = None,
        load_stats: dict[str, int] | None = None,
        quantization: str | None = None,
        fp8_lm_head: str | bool | None = None,
    ) -> Glm5NextForCausalLM:
        """A preset name (seeded random weights, or the shipped checkpoint of a trained preset such as
        ``"small"``) or a checkpoint directory (real VL layout or flat).

        With a parallel ``mapping`` the model is that rank's share, read as slices (``load_stats["bytes_read"]``).
        A model that cannot fit in the device's free memory is refused before anything is read. Block-FP8
        ``nn.Linear`` weights are held as FP8 (`Fp8Linear`), other FP8 tensors dequantised (the router, the
        FP32-kept weights, mHC); ``quantization`` changes that. docs/model.md, "Checkpoints"; docs/parallelism.md.

        Args:
            model: ``"tiny"``, ``"glm-5.3-flash"`` or a directory with ``config.json`` and safetensors.
            layers: keep only these trunk layers (in this order); the MTP layer is kept.
            dtype: parameter dtype; defaults to the config's ``torch_dtype``.
            device: parameter device.
            seed: seed for presets.
            quantization: ``"auto"`` (default), ``"fp8"`` or ``"none"`` (`QUANTIZATION_MODES`).
            fp8_lm_head: ``None`` (default: as stored), ``"auto"`` (FP8 when the rest is block FP8), ``True`` or
                ``False`` (`FP8_LM_HEAD_MODES`).

        Raises:
            ValueError: a bad ``fp8_lm_head``, or ``True`` for a head tied to the embedding.
            ConfigError: unknown preset, bad or unknown config keys.
            CheckpointError: missing / unexpected / misshapen / non-finite tensors or scales, an FP8 tensor
                listed in ``modules_to_not_convert``, unreadable files, not enough memory.
        """
        mode = resolve_quantization(quantization)
        model = resolve_preset_dir(model)  # a preset that ships trained weights loads like its directory
        config = Glm5NextConfig.from_pretrained(model)
        keep = list(layers) if layers is not None else None
        sub = subset_config(config, keep) if keep is not None else config
        dt = resolve_dtype(dtype if dtype is not None else config.torch_dtype)
        # What the weights will be held as: the checkpoint's block FP8, FP8 quantised at load, or plain.
        stored_quant = config.quantization  # (``sub`` may be ``config``: its field is replaced below)
        quant = stored_quant if mode != "none" else None
        if quant is None and mode == "fp8":
            quant = QuantConfig.block_fp8()
        sub.quantization = quant
        # What the head will be (None: as the source holds it); decided, and refused, before anything is read.
        head = decide_fp8_lm_head(fp8_lm_head, trunk_fp8=quant is not None, tied=sub.tie_word_embeddings)
        with torch.device("meta"):
            m = cls(sub, mapping=mapping)
        if quant is not None:
            swap_fp8_linears_(m, fp8_linear_names(m, quant), quant.block)
        if head is not None:
            # The estimate below counts the head as it will be held (and ``m.config.quantization`` says so);
            # ``quant`` stays what the rest of the model is read as.
            m.set_fp8_lm_head_(head)
        where = f" ({m.mapping.describe()})" if m.mapping.is_parallel else ""
        need = m.param_bytes(dt) + m.derived_weight_bytes(dt)
        free = free_bytes(device)
        if free is not None and need > free:
            fp8_bytes = None
            if quant is None or stored_quant is None:
                with torch.device("meta"):
                    alt = cls(dataclasses.replace(sub, quantization=None), mapping=mapping)
                q = stored_quant or QuantConfig.block_fp8()
                swap_fp8_linears_(alt, fp8_linear_names(alt, q), q.block)
                alt_head = decide_fp8_lm_head(fp8_lm_head, trunk_fp8=True, tied=sub.tie_word_embeddings)
                if alt_head is not None:
                    alt.set_fp8_lm_head_(alt_head)
                fp8_bytes = alt.param_bytes(dt) + alt.derived_weight_bytes(dt)
            check_memory(
                need, device, what=f"the parameters of {model!s}{where}", hint=_memory_hint(need, fp8_bytes, device)
            )
        if not os.path.isdir(str(model)):
            return cls.from_config(
                sub, seed=seed, dtype=dt, device=device, mapping=mapping, quantization="fp8" if quant else "none",
                fp8_lm_head=head,
            )  # fmt: skip
        from .checkpoint import load_state_dict

        # The full config's layer indices: the cut is decided before `layers` renumbers them.
        shard = shard_fn(config, m.mapping) if m.mapping.is_parallel else None
        sd = load_state_dict(model, layers=keep, shard=shard, stats=load_stats, dequantize=quant is None)
        if keep is not None:
            sd = remap_layer_keys(sd, keep, config.num_hidden_layers)
        if quant is not None:
            # The checkpoint's own tensors decide (the meta model above followed the config's list).
            names = set(_fp8_plan(m, sd, quant, quantize_plain=stored_quant is None))
            unswap_empty_(m, [n for n, mod in m.named_modules() if isinstance(mod, Fp8Linear) and n not in names])
            swap_fp8_linears_(m, sorted(names), quant.block)
        if head is not None:
            _head_to_plan(m, sd, head)
        m.load_weights(sd, device=device, dtype=dt, source=str(model))
        m.checkpoint_dir = os.fspath(model)
        return m.eval()

    def param_bytes(self, dtype: torch.dtype) -> int:
        """Bytes the parameters take in ``dtype`` (FP32-kept parameters and FP8 scales counted at 4 bytes, FP8
        weights at 1)."""
        size = torch.empty(0, dtype=dtype).element_size()
        seen: set[int] = set()
        total = 0
        for name, p in self.named_parameters(remove_duplicate=False):
            if id(p) in seen:
                continue
            seen.add(id(p))
            if p.dtype == torch.float8_e4m3fn:
                total += p.numel()
            elif is_fp32_param(name) or name.endswith(SCALE_SUFFIX):
                total += p.numel() * 4
            else:
                total += p.numel() * size
        return total

    def derived_weight_bytes(self, dtype: torch.dtype) -> int:
        """Bytes of the weight copies the forward makes and keeps besides the parameters: each sparse-MLA layer
        whose ``kv_b_proj`` is block FP8 holds it dequantised in ``dtype`` (the mixers' ``derived_weight_bytes``,
        where a backend's layer defines it); ``0`` for an unquantized model."""
        return sum(
            mod.self_attn.derived_weight_bytes(dtype)
            for mod in self.modules()
            if isinstance(mod, Glm5NextDecoderLayer) and hasattr(mod.self_attn, "derived_weight_bytes")
        )

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """Parameters under the real checkpoint's names: the text model under ``model.language_model.``,
        the MTP block flattened into ``model.language_model.layers.{L}``, ``lm_head.weight`` at the top."""
        if self.mapping.is_parallel:
            raise RuntimeError(f"cannot export one rank's share ({self.mapping.describe()}) as a checkpoint")
        out: dict[str, torch.Tensor] = {}
        L = self.config.num_hidden_layers
        for name, t in self.state_dict().items():
            out[_to_ckpt_name(_to_hf_name(name, L))] = t
        if self.config.tie_word_embeddings:
            out.pop("lm_head.weight", None)
        return out

    def save_pretrained(self, directory: str | os.PathLike[str], *, max_shard_bytes: int | None = None) -> list[str]:
        """Write ``config.json`` and the weights in the real checkpoint layout (see `hf_state_dict`)."""
        from .checkpoint import save_checkpoint

        return save_checkpoint(self.hf_state_dict(), self.config, directory, max_shard_bytes=max_shard_bytes)

    def load_weights(
        self,
        hf_state: dict[str, torch.Tensor],
        *,
        device: str = "cpu",
        dtype: torch.dtype | None = None,
        source: str = "checkpoint",
        assign: bool = False,
    ) -> None:
        """Load checkpoint-named weights strictly: every parameter present, nothing else, right shapes.

        Names may be canonical (``model.layers...``) or the real layout's (``model.language_model...``).
        With ``assign=True`` the parameters become the given tensors (moved / cast only where needed)
        instead of copies: no second copy of the weights is allocated (e.g. to share another model's).

        Raises:
            CheckpointError: one line naming the first missing / unexpected / misshapen tensor.
        """
        from .checkpoint import canonical_name

        L = self.config.num_hidden_layers
        state: dict[str, torch.Tensor] = {}
        for k, v in hf_state.items():
            c = canonical_name(k)
            if c is not None:
                state[c] = v
        own = {_to_hf_name(n, L): n for n in self.state_dict()}
        if self.config.tie_word_embeddings:
            own.pop("lm_head.weight", None)
        missing = sorted(set(own) - set(state))
        unexpected = sorted(set(state) - set(own))
        if missing:
            more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
            raise CheckpointError(f"{source}: missing tensor {_to_ckpt_name(missing[0])!r}{more}")
        if unexpected:
            more = f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else ""
            raise CheckpointError(
                f"{source}: unexpected tensor {_to_ckpt_name(unexpected[0])!r}{more} (not part of this config)"
            )
        shapes = dict(self.state_dict())
        local: dict[str, torch.Tensor] = {}
        for hf, name in own.items():
            t = state[hf]
            if tuple(t.shape) != tuple(shapes[name].shape):
                raise CheckpointError(
                    f"{source}: tensor {_to_ckpt_name(hf)!r} has shape {tuple(t.shape)}, "
                    f"the config needs {tuple(shapes[name].shape)}"
                )
            want = shapes[name].dtype
            if (t.dtype == torch.float8_e4m3fn) != (want == torch.float8_e4m3fn):
                raise CheckpointError(
                    f"{source}: tensor {_to_ckpt_name(hf)!r} is {t.dtype}, the model holds it as {want} "
                    "(block-FP8 weights load into Fp8Linear modules: see from_pretrained's quantization)"
                )
            if not _all_finite(t):
                raise CheckpointError(f"{source}: tensor {_to_ckpt_name(hf)!r} holds non-finite values")
            if want == torch.float8_e4m3fn:
                pass  # the e4m3 codes as stored
            elif name.endswith(SCALE_SUFFIX) or (t.is_floating_point() and is_fp32_param(name)):
                t = t.float()
            elif dtype is not None and t.is_floating_point():
                t = t.to(dtype)
            local[name] = t.to(device) if assign else t
        if assign:
            self.load_state_dict(local, strict=not self.config.tie_word_embeddings, assign=True)
        else:
            self.to_empty(device=device)
            if dtype is not None:
                self.to(dtype)
            self.keep_fp32_params_()
            self.load_state_dict(local, strict=not self.config.tie_word_embeddings)
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight


def _all_finite(t: torch.Tensor) -> bool:
    """No NaN / inf in a floating tensor (e4m3 has no inf; its NaN codes are ``0x7F`` / ``0xFF``)."""
    if t.dtype == torch.float8_e4m3fn:
        return not bool(((t.view(torch.uint8) & 0x7F) == 0x7F).any())
    return not t.is_floating_point() or bool(torch.isfinite(t).all())


def _fp8_plan(
    model: Glm5NextForCausalLM, sd: dict[str, torch.Tensor], quant: QuantConfig, *, quantize_plain: bool
) -> list[str]:
    """Which linears of the (meta) ``model`` hold FP8 for the loaded checkpoint ``sd``, making ``sd`` match.

    An FP8 tensor (with its scale) whose module is an ``nn.Linear`` stays FP8; one of any other parameter is
    dequantised in ``sd``. With ``quantize_plain`` (a source without ``quantization_config``), the plain
    weights of `fp8_linear_names` are quantised in ``sd``.

    Returns:
        The module names (internal) to swap to `Fp8Linear`.
    """
    from .checkpoint import canonical_name, dequantize_block_fp8, quantize_block_fp8

    L = model.config.num_hidden_layers
    linears = {_to_hf_name(n, L): n for n, mod in model.named_modules() if isinstance(mod, nn.Linear)}
    canon = {canonical_name(k): k for k in sd}
    names = []
    for c, k in canon.items():
        if c is None or not c.endswith(".weight") or sd[k].dtype != torch.float8_e4m3fn:
            continue
        module = c[: -len(".weight")]
        scale_key = k + SCALE_SUFFIX
        if module in linears and not is_fp32_param(linears[module] + ".weight"):
            names.append(linears[module])
        else:
            sd[k] = dequantize_block_fp8(sd[k], sd.pop(scale_key), quant.block)
    if quantize_plain:
        fp8 = set(names)
        for name in fp8_linear_names(model, quant):
            k = canon.get(_to_hf_name(name, L) + ".weight")
            if name in fp8 or k is None or not sd[k].is_floating_point():
                continue
            sd[k], sd[k + SCALE_SUFFIX] = quantize_block_fp8(sd[k], quant.block)
            names.append(name)
    return names


def _head_to_plan(model: Glm5NextForCausalLM, sd: dict[str, torch.Tensor], fp8: bool) -> None:
    """Make the loaded checkpoint ``sd`` and the (meta) ``model`` agree on an ``lm_head`` held in FP8 (``fp8``:
    a float-stored head quantised in ``sd``) or in float (an FP8-stored head dequantised in ``sd``)."""
    from .checkpoint import canonical_name, dequantize_block_fp8, quantize_block_fp8

    key = next((k for k in sd if canonical_name(k) == "lm_head.weight"), None)
    if key is None:  # tied: the embedding's weight serves (``fp8`` is refused for it before)
        return
    quant = model.config.quantization
    block = quant.block if quant is not None else 128
    t = sd[key]
    if fp8 and t.dtype != torch.float8_e4m3fn:
        sd[key], sd[key + SCALE_SUFFIX] = quantize_block_fp8(t, block)
    elif not fp8 and t.dtype == torch.float8_e4m3fn:
        sd[key] = dequantize_block_fp8(t, sd.pop(key + SCALE_SUFFIX), block)
    model.set_fp8_lm_head_(fp8)


def _to_ckpt_name(name: str) -> str:
    """Canonical ``model.X`` -> the real layout's ``model.language_model.X``."""
    return "model.language_model." + name[len("model.") :] if name.startswith("model.") else name


def check_memory(nbytes: int, device: str | torch.device, *, what: str, hint: str | None = None) -> None:
    """Refuse early (before allocating) when ``nbytes`` cannot fit in ``device``'s free memory.

    Args:
        nbytes: the estimate.
        device: where it would live.
        what: names the allocation in the message.
        hint: what would make it fit (default: a smaller dtype, fewer layers, or a larger device).

    Raises:
        CheckpointError: with the estimate and what is free.
    """
    free = free_bytes(device)
    if free is not None and nbytes > free:
        gib = 1 << 30
        hint = hint or "use a smaller dtype, fewer layers, or a larger device"
        raise CheckpointError(
            f"{what} need about {nbytes / gib:.1f} GiB on {torch.device(device)} but only {free / gib:.1f} GiB "
            f"is free ({hint})"
        )


def free_bytes(device: str | torch.device) -> int | None:
    """Free memory of ``device`` in bytes, ``None`` if unknown.

    CUDA: the driver's free memory (``mem_get_info``) plus what torch's caching allocator holds reserved but
    unallocated (freed tensors it keeps for reuse: after loading a checkpoint through staging copies that can be
    most of the card, which the driver then reports as used); CPU: ``MemAvailable``.
    """
    dev = torch.device(device)
    free = None
    if dev.type == "cuda" and torch.cuda.is_available():
        free = torch.cuda.mem_get_info(dev)[0]
        free += max(0, torch.cuda.memory_reserved(dev) - torch.cuda.memory_allocated(dev))
    elif dev.type == "cpu":
        try:
            with open("/proc/meminfo", encoding="ascii") as f:
                for line in f:
                    if line.startswith("MemAvailable:"):
                        free = int(line.split()[1]) * 1024
                        break
        except OSError:
            free = None
    return free


def _memory_hint(nbytes: int, fp8_bytes: int | None, device: str | torch.device) -> str:
    """What would make ``nbytes`` of parameters fit: FP8 weights when that is enough on this device, else
    fewer layers or splitting the model across devices (tensor / expert parallelism, docs/parallelism.md)."""
    gib = 1 << 30
    free = free_bytes(device)
    split = (
        "load fewer layers (layers=[...]), or split the model across devices with tensor / expert parallelism "
        "(tensor_parallel_size=N, moe_expert_parallel_size=N; --tp_size / --ep_size)"
    )
    if fp8_bytes is None or fp8_bytes >= nbytes:
        return f"FP8 weights are already counted; {split}"
    fp8 = f"block-FP8 weights (quantization='fp8') need about {fp8_bytes / gib:.1f} GiB"
    if free is not None and fp8_bytes <= free:
        return f"{fp8}, which fits"
    devices = "" if free is None or free <= 0 else f" (about {math.ceil(fp8_bytes / free)} such devices)"
    return f"{fp8}, still too much: {split}{devices}"


_EXPERT_NAME = re.compile(r"^(model\.layers\.\d+\.mlp\.experts\.)(\d+)(\..*)$")


def needs_local_init(config: Glm5NextConfig) -> bool:
    """Whether drawing the whole model in fp32 on the CPU (`from_config`'s default) would take more than half
    the host memory available now (``/proc/meminfo``'s MemAvailable; ``False`` where it cannot be read)."""
    try:
        with open("/proc/meminfo") as f:
            avail = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        return False
    with torch.device("meta"):
        whole = Glm5NextForCausalLM(config)
    return 2 * whole.param_bytes(torch.float32) > avail


def _to_hf_name(name: str, num_layers: int) -> str:
    if name.startswith("mtp.block."):
        return f"model.layers.{num_layers}." + name[len("mtp.block.") :]
    if name.startswith("mtp."):
        return f"model.layers.{num_layers}." + name[len("mtp.") :]
    return name


def subset_config(config: Glm5NextConfig, layers: list[int]) -> Glm5NextConfig:
    """The config of a model made of trunk ``layers`` only (schedule and FFN kinds kept per layer)."""
    if not layers:
        raise ValueError("layers must name at least one trunk layer")
    bad = [i for i in layers if not 0 <= i < config.num_hidden_layers]
    if bad:
        raise ValueError(f"layers {bad} outside [0, {config.num_hidden_layers})")
    # Each kept layer keeps its attention kind, FFN kind and indexer mode (a shared layer needs an
    # earlier full sparse layer in the subset too; the config says so if not).
    pick = lambda lst: [lst[i] for i in layers]  # noqa: E731
    return dataclasses.replace(
        copy.deepcopy(config),
        num_hidden_layers=len(layers),
        layer_types=pick(config.layer_types),
        mlp_layer_types=pick(config.mlp_layer_types),
        indexer_types=pick(config.indexer_types),
        first_k_dense_replace=None,
    )


def remap_layer_keys(sd: dict[str, torch.Tensor], layers: list[int], num_layers: int) -> dict[str, torch.Tensor]:
    """Rename ``model.layers.{layers[j]}`` to ``model.layers.{j}``, and the MTP block to the new count."""
    new_idx = {old: j for j, old in enumerate(layers)}
    new_idx[num_layers] = len(layers)
    out = {}
    for k, v in sd.items():
        if k.startswith("model.layers."):
            rest = k[len("model.layers.") :]
            i, tail = rest.split(".", 1)
            out[f"model.layers.{new_idx[int(i)]}.{tail}"] = v
        else:
            out[k] = v
    return out
