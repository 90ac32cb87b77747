"""`Glm5NextForCausalLM`: the GLM-5.3-Flash-class hybrid reference model (KDA + k-pool sparse MLA) and
its MTP layer, running on the paged caches of `Glm5NextCacheManager`.

Weight names follow the HF layout of GLM-5.3-Flash checkpoints (``model.embed_tokens``,
``model.layers.{i}.{input_layernorm, self_attn, post_attention_layernorm, mlp}``, ``model.norm``,
``lm_head``; the MTP block is ``model.layers.{num_hidden_layers}`` with ``enorm``, ``hnorm``,
``eh_proj`` and ``shared_head.norm``).
"""

from __future__ import annotations

import copy
import os
from collections.abc import Iterable

import torch
from torch import nn

from ..attention.sparse.glm_kpool.layer import GlmKpoolSparseMLA
from ..attention.sparse.glm_kpool.metadata import GlmKpoolMetadata
from ..cache.manager import Glm5NextCacheManager
from ..config import LAYER_SPARSE_MLA, Glm5NextConfig
from ..kda.layer import KimiDeltaAttention
from ..modules.ffn import make_ffn
from ..modules.init import init_linear_
from ..modules.norm import RMSNorm

__all__ = ["Glm5NextDecoderLayer", "Glm5NextMTPLayer", "Glm5NextModel", "Glm5NextForCausalLM", "resolve_dtype"]


# Parameters kept in FP32 whatever the model dtype: router scores and bias (a bf16 bias reorders near-tied
# experts), the KDA gate constants and the indexer's FP32 head weights and pooling bias (DESIGN §3).
FP32_PARAM_SUFFIXES = (
    "mlp.gate.weight",
    "mlp.gate.e_score_correction_bias",
    "self_attn.A_log",
    "self_attn.dt_bias",
    "indexer.ape",
    "indexer.weights_proj.weight",
)


def is_fp32_param(name: str) -> bool:
    return name.endswith(FP32_PARAM_SUFFIXES)


def resolve_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    table = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
             "float16": torch.float16, "fp16": torch.float16}  # fmt: skip
    if name not in table:
        raise ValueError(f"unsupported dtype {name!r} (expected one of {sorted(table)})")
    return table[name]


class Glm5NextDecoderLayer(nn.Module):
    """Pre-norm decoder block: KDA or sparse MLA, then a dense or MoE FFN.

    Args:
        config: geometry.
        layer_idx: index in the schedule (picks dense vs MoE FFN).
        kind: ``"kda"`` or ``"sparse_mla"``.
        cache_idx: the layer's index among its kind (KDA state plane or sparse cache plane).
    """

    def __init__(self, config: Glm5NextConfig, layer_idx: int, kind: str, cache_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.kind = kind
        self.cache_idx = cache_idx
        D = config.hidden_size
        self.input_layernorm = RMSNorm(D, eps=config.rms_norm_eps)
        if kind == LAYER_SPARSE_MLA:
            self.self_attn: nn.Module = GlmKpoolSparseMLA(config)
        else:
            self.self_attn = KimiDeltaAttention(config, cache_idx)
        self.post_attention_layernorm = RMSNorm(D, eps=config.rms_norm_eps)
        self.mlp = make_ffn(config, layer_idx)

    @property
    def is_sparse(self) -> bool:
        return self.kind == LAYER_SPARSE_MLA

    def forward(
        self,
        h: torch.Tensor,
        meta: GlmKpoolMetadata,
        manager: Glm5NextCacheManager,
        sparse_cache_idx: int | None = None,
    ) -> torch.Tensor:
        """``[N, D] -> [N, D]``; ``sparse_cache_idx`` overrides the sparse plane (the MTP layer's)."""
        x = self.input_layernorm(h)
        if self.is_sparse:
            idx = self.cache_idx if sparse_cache_idx is None else sparse_cache_idx
            a = self.self_attn(x, meta, manager.kpool_layer_cache(idx))
        elif meta.verify_seqs:
            a, rec = self.self_attn.forward_spec(x, meta, manager.kda_layer_state(self.cache_idx), meta.verify_seqs)
            meta.kda_records[self.cache_idx] = rec
        else:
            a = self.self_attn(x, meta, manager.kda_layer_state(self.cache_idx))
        h = h + a
        return h + self.mlp(self.post_attention_layernorm(h))


class Glm5NextModel(nn.Module):
    """Embedding, the layer schedule, the final norm."""

    def __init__(self, config: Glm5NextConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        layers = []
        n_sparse = n_kda = 0
        for i, kind in enumerate(config.layer_types or []):
            if kind == LAYER_SPARSE_MLA:
                layers.append(Glm5NextDecoderLayer(config, i, kind, n_sparse))
                n_sparse += 1
            else:
                layers.append(Glm5NextDecoderLayer(config, i, kind, n_kda))
                n_kda += 1
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, meta: GlmKpoolMetadata, manager: Glm5NextCacheManager) -> torch.Tensor:
        """``input_ids [N]`` -> final-normed hidden ``[N, D]``."""
        h = self.embed_tokens(input_ids)
        for layer in self.layers:
            h = layer(h, meta, manager)
        return self.norm(h)


class Glm5NextMTPLayer(nn.Module):
    """Native next-token-prediction block (layer index ``num_hidden_layers``).

    Row ``i`` pairs the embedding of token ``i + 1`` with the target's final hidden of token ``i``:
    ``eh_proj([enorm(embed(tok_{i+1})); hnorm(hidden_i)])``, one sparse-MLA decoder block with its own
    indexer and FFN, then ``shared_head.norm``; logits come from the model's shared LM head.
    """

    def __init__(self, config: Glm5NextConfig) -> None:
        super().__init__()
        D = config.hidden_size
        self.layer_idx = config.num_hidden_layers
        self.enorm = RMSNorm(D, eps=config.rms_norm_eps)
        self.hnorm = RMSNorm(D, eps=config.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * D, D, bias=False)
        self.block = Glm5NextDecoderLayer(config, self.layer_idx, LAYER_SPARSE_MLA, cache_idx=0)
        self.shared_head = nn.Module()
        self.shared_head.norm = RMSNorm(D, eps=config.rms_norm_eps)

    def forward(
        self,
        token_embeds: torch.Tensor,
        prev_hidden: torch.Tensor,
        meta: GlmKpoolMetadata,
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
    """The full model: trunk, LM head and (when configured) the MTP layer."""

    def __init__(self, config: Glm5NextConfig) -> None:
        super().__init__()
        self.config = config
        self.model = Glm5NextModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.mtp = Glm5NextMTPLayer(config) if config.num_nextn_predict_layers > 0 else None

    # --------------------------------------------------------------------------------------------
    @property
    def num_sparse_layers(self) -> int:
        return len(self.config.sparse_layer_ids)

    def forward(self, input_ids: torch.Tensor, meta: GlmKpoolMetadata, manager: Glm5NextCacheManager) -> torch.Tensor:
        """Final hidden ``[N, D]`` of every row (logits via `compute_logits` on the rows needed)."""
        return self.model(input_ids, meta, manager)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[n, D] -> [n, V]`` FP32 logits."""
        return self.lm_head(hidden).float()

    def commit_kda(self, meta: GlmKpoolMetadata, manager: Glm5NextCacheManager, num_accepted: list[int]) -> None:
        """Fold each verified sequence's first ``num_accepted[b]`` rows into every KDA layer's state.

        Args:
            meta: the metadata of the verify step (holds the records its forward stored).
            manager: the cache manager holding the KDA state.
            num_accepted: ``[num_seqs]`` accepted rows (root + accepted drafts) per batch sequence.
        """
        for layer in self.model.layers:
            rec = meta.kda_records.get(layer.cache_idx) if not layer.is_sparse else None
            if rec is not None:
                layer.self_attn.commit(rec, num_accepted, manager.kda_layer_state(layer.cache_idx))
        meta.kda_records = {}

    def mtp_forward(
        self,
        next_tokens: torch.Tensor,
        prev_hidden: torch.Tensor,
        meta: GlmKpoolMetadata,
        manager: Glm5NextCacheManager,
        sparse_cache_idx: int,
    ) -> torch.Tensor:
        """One MTP step: ``next_tokens [N]``, ``prev_hidden [N, D]`` -> draft hidden ``[N, D]``."""
        if self.mtp is None:
            raise RuntimeError("this model has no MTP layer (num_nextn_predict_layers == 0)")
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
            block.self_attn.reset_parameters(g, std)
            block.mlp.reset_parameters(g, std)
        init_linear_(self.lm_head, g, std)
        if self.mtp is not None:
            init_linear_(self.mtp.eh_proj, g, std)

    @classmethod
    def from_config(
        cls, config: Glm5NextConfig, *, seed: int = 0, dtype: torch.dtype | str = "float32", device: str = "cpu"
    ) -> Glm5NextForCausalLM:
        """A seeded random model (the tiny preset's weights are this)."""
        with torch.device("cpu"):
            m = cls(config)
        m.reset_parameters(seed)
        m = m.to(device=device, dtype=resolve_dtype(dtype))
        m.keep_fp32_params_()
        return m.eval()

    @torch.no_grad()
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
    ) -> Glm5NextForCausalLM:
        """A preset name (seeded random weights) or a checkpoint directory (HF layout).

        Args:
            model: ``"tiny"``, ``"glm-5.3-flash"`` or a directory with ``config.json`` and safetensors.
            layers: keep only these trunk layers (in this order); the MTP layer is kept.
            dtype: parameter dtype; defaults to the config's ``torch_dtype``.
            device: parameter device.
            seed: seed for presets.
        """
        config = Glm5NextConfig.from_pretrained(model)
        keep = list(layers) if layers is not None else None
        sub = subset_config(config, keep) if keep is not None else config
        dt = resolve_dtype(dtype if dtype is not None else config.torch_dtype)
        if not os.path.isdir(str(model)):
            return cls.from_config(sub, seed=seed, dtype=dt, device=device)
        from .checkpoint import load_state_dict

        sd = load_state_dict(model, layers=keep, dtype=dt)
        if keep is not None:
            sd = remap_layer_keys(sd, keep, config.num_hidden_layers)
        with torch.device("meta"):
            m = cls(sub)
        m.load_weights(sd, device=device, dtype=dt)
        return m.eval()

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """Parameters under HF checkpoint names (the MTP block flattened into ``model.layers.{L}``)."""
        out: dict[str, torch.Tensor] = {}
        L = self.config.num_hidden_layers
        for name, t in self.state_dict().items():
            out[_to_hf_name(name, L)] = t
        if self.config.tie_word_embeddings:
            out.pop("lm_head.weight", None)
        return out

    def load_weights(
        self, hf_state: dict[str, torch.Tensor], *, device: str = "cpu", dtype: torch.dtype | None = None
    ) -> None:
        """Load HF-named weights strictly: every parameter must be present with the right shape."""
        L = self.config.num_hidden_layers
        own = {_to_hf_name(n, L): n for n in self.state_dict()}
        if self.config.tie_word_embeddings:
            own.pop("lm_head.weight", None)
        missing = sorted(set(own) - set(hf_state))
        unexpected = sorted(set(hf_state) - set(own))
        if missing or unexpected:
            raise ValueError(f"checkpoint mismatch: missing {missing[:8]}, unexpected {unexpected[:8]}")
        shapes = dict(self.state_dict())
        local: dict[str, torch.Tensor] = {}
        for hf, name in own.items():
            t = hf_state[hf]
            if tuple(t.shape) != tuple(shapes[name].shape):
                raise ValueError(f"{hf}: shape {tuple(t.shape)} != expected {tuple(shapes[name].shape)}")
            if t.is_floating_point() and is_fp32_param(name):
                t = t.float()
            elif dtype is not None and t.is_floating_point():
                t = t.to(dtype)
            local[name] = t
        self.to_empty(device=device)
        if dtype is not None:
            self.to(dtype)
        self.keep_fp32_params_()
        self.load_state_dict(local, strict=not self.config.tie_word_embeddings)
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight


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
    # Dense/MoE is decided by index; a subset keeps each layer's kind only if the dense ones lead.
    dense = [i < config.first_k_dense_replace for i in layers]
    if any(d and not prev for prev, d in zip([True] + dense, dense)):
        raise ValueError("a layer subset must list dense-FFN layers before MoE layers")
    sub = copy.deepcopy(config)
    sub.num_hidden_layers = len(layers)
    sub.layer_types = [config.layer_types[i] for i in layers]  # type: ignore[index]
    sub.first_k_dense_replace = sum(dense)
    sub.validate()
    return sub


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
