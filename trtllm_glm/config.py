"""Model configuration for GLM-5.3-Flash-class hybrid models.

`Glm5NextConfig` reads a checkpoint's ``config.json`` in the real (VL, ``text_config`` inside) or a flat text-only
layout, with the reference's field names and a few older aliases. **Every key must be known**: an unknown key raises
`ConfigError` naming it, because silently ignoring one (a new mixing scheme, a different pool size) would load a
checkpoint and compute a different function; keys that do not change the computation are listed in
`_IGNORED_TEXT_KEYS` / `_IGNORED_TOP_KEYS`. Every inconsistency raises `ConfigError` naming the field.
docs/model.md, "Config".
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "ConfigError",
    "Glm5NextConfig",
    "QuantConfig",
    "PRESETS",
    "PRESET_CHECKPOINTS",
    "resolve_preset_dir",
    "LAYER_KDA",
    "LAYER_SPARSE_MLA",
    "MLP_DENSE",
    "MLP_SPARSE",
    "INDEXER_FULL",
    "INDEXER_SHARED",
]

LAYER_KDA = "kda"
LAYER_SPARSE_MLA = "sparse_mla"
MLP_DENSE = "dense"
MLP_SPARSE = "sparse"
INDEXER_FULL = "full"
INDEXER_SHARED = "shared"

# Spellings accepted in a config file's ``layer_types`` list (the reference writes
# ``linear_attention`` / ``indexed_attention``; ``full_attention`` and ``deepseek_sparse_attention`` are
# older names of the indexed MLA layer).
_LAYER_ALIASES = {
    "kda": LAYER_KDA,
    "linear_attention": LAYER_KDA,
    "linear": LAYER_KDA,
    "sparse_mla": LAYER_SPARSE_MLA,
    "indexed_attention": LAYER_SPARSE_MLA,
    "deepseek_sparse_attention": LAYER_SPARSE_MLA,
    "sparse_attention": LAYER_SPARSE_MLA,
    "full_attention": LAYER_SPARSE_MLA,
    "mla": LAYER_SPARSE_MLA,
}
_MLP_ALIASES = {"dense": MLP_DENSE, "sparse": MLP_SPARSE, "moe": MLP_SPARSE}

# The Hadamard rotation before FP8 is defined for 128-wide vectors only, and the cache layout (pool
# entries per page, the 4-entry tail ring) for pools of 4 tokens.
INDEX_HEAD_DIM = 128
INDEX_KPOOL = 4

# Text-config keys that do not change what the model computes (or are derived from other fields and
# checked where it matters). Anything else unknown is an error.
_IGNORED_TEXT_KEYS = frozenset(
    {
        "architectures", "model_type", "transformers_version", "dtype", "use_cache", "output_router_logits",
        "router_aux_loss_coef", "attention_dropout", "head_dim", "qk_head_dim", "_name_or_path",
        "keys_to_ignore_at_inference", "auto_map", "output_hidden_states", "output_attentions",
        "return_dict", "chunk_size_feed_forward", "is_encoder_decoder", "id2label", "label2id",
        "problem_type", "tokenizer_class", "task_specific_params", "use_return_dict", "num_labels",
        "scoring_func", "topk_method", "ep_size", "moe_layer_freq", "rope_scaling", "rope_theta",
        "rope_parameters", "rope_interleave", "index_topk_freq", "index_skip_topk_offset", "index_topk_pattern",
    }
)  # fmt: skip
# Top-level keys of the VL layout besides ``text_config`` / ``quantization_config``.
_IGNORED_TOP_KEYS = frozenset(
    {
        "architectures", "model_type", "transformers_version", "dtype", "torch_dtype", "vision_config",
        "image_token_id", "video_token_id", "image_start_token_id", "image_end_token_id",
        "video_start_token_id", "video_end_token_id", "tie_word_embeddings", "_name_or_path", "auto_map",
        "use_cache", "bos_token_id", "eos_token_id", "pad_token_id", "output_hidden_states",
        "output_attentions", "return_dict", "num_nextn_predict_layers",
    }
)  # fmt: skip
# Values an ignored key must hold when present (anything else would change the computation).
_REQUIRED_VALUES = {"scoring_func": "sigmoid", "topk_method": "noaux_tc", "ep_size": 1}

# Older/alternative spellings -> field names.
_ALIASES = {
    "linear_head_dim": "kda_head_dim",
    "linear_num_heads": "kda_num_heads",
    "linear_conv_kernel_dim": "kda_short_conv_kernel_size",
    "linear_lower_bound": "kda_gate_lower_bound",
    "num_local_experts": "n_routed_experts",
}
_LINEAR_ATTN_KEYS = {
    "num_heads": "kda_num_heads",
    "head_dim": "kda_head_dim",
    "short_conv_kernel_size": "kda_short_conv_kernel_size",
    "gate_lower_bound": "kda_gate_lower_bound",
    "gate_low_rank": "kda_gate_low_rank",
}
_LINEAR_ATTN_IGNORED = {"safe_gate", "kda_layers", "full_attn_layers", "full_attention_layers"}


class ConfigError(ValueError):
    """A config file or preset is inconsistent; the message names the field."""


@dataclass
class QuantConfig:
    """Block-FP8 weight quantisation of a checkpoint (``quantization_config``).

    Attributes:
        weight_block_size: tile of one scale, ``(128, 128)`` in the real checkpoint.
        modules_to_not_convert: module-name patterns stored unquantised (a weight is stored in FP8
            exactly when it has a ``weight_scale_inv`` partner; this list is kept for the round trip).
        raw: the object as read (written back unchanged).
    """

    weight_block_size: tuple[int, int] = (128, 128)
    modules_to_not_convert: list[str] = field(default_factory=list)
    raw: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, d: Any) -> QuantConfig:
        if not isinstance(d, dict):
            raise ConfigError("quantization_config: must be an object")
        method = d.get("quant_method", "fp8")
        if method != "fp8":
            raise ConfigError(f"quantization_config.quant_method: only 'fp8' (block FP8) is supported, got {method!r}")
        fmt = d.get("fmt", "e4m3")
        if fmt not in ("e4m3", "float8_e4m3fn"):
            raise ConfigError(f"quantization_config.fmt: only e4m3 is supported, got {fmt!r}")
        act = d.get("activation_scheme", "dynamic")
        if act != "dynamic":
            raise ConfigError(f"quantization_config.activation_scheme: only 'dynamic' is supported, got {act!r}")
        block = d.get("weight_block_size", [128, 128])
        if not (
            isinstance(block, (list, tuple)) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)
        ):
            raise ConfigError(f"quantization_config.weight_block_size: expected two positive ints, got {block!r}")
        skip = d.get("modules_to_not_convert") or []
        if not isinstance(skip, list) or not all(isinstance(s, str) for s in skip):
            raise ConfigError("quantization_config.modules_to_not_convert: must be a list of strings")
        return cls(weight_block_size=(int(block[0]), int(block[1])), modules_to_not_convert=list(skip), raw=dict(d))

    @classmethod
    def block_fp8(cls, block: int = 128, modules_to_not_convert: list[str] | None = None) -> QuantConfig:
        """The config a model quantised at load writes back (``quant_method: fp8``, e4m3, dynamic activations)."""
        skip = ["lm_head"] if modules_to_not_convert is None else list(modules_to_not_convert)
        raw = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
               "weight_block_size": [block, block], "modules_to_not_convert": skip}  # fmt: skip
        return cls(weight_block_size=(block, block), modules_to_not_convert=skip, raw=raw)

    @property
    def block(self) -> int:
        """The square scale tile edge (a non-square ``weight_block_size`` is refused)."""
        rows, cols = self.weight_block_size
        if rows != cols:
            raise ConfigError(
                f"quantization_config.weight_block_size: only square tiles are supported, got {[rows, cols]}"
            )
        return rows

    def skips(self, module: str) -> bool:
        """Whether module name ``module`` (e.g. ``model.language_model.layers.3.mlp.gate``) is listed in
        ``modules_to_not_convert``: an entry matches whole dotted segments (``lm_head``, ``mlp.gate``, a full
        module name), never part of a segment (``gate`` does not match ``gate_proj``)."""
        name = f".{module}."
        return any(f".{p.strip('.')}." in name for p in self.modules_to_not_convert if p.strip("."))


@dataclass
class Glm5NextConfig:
    """Geometry of a GLM-5.3-Flash-class hybrid model (the text model; reference field names).

    Sparse MLA layers sit at ``i % 4 == 3`` unless ``layer_types`` lists every layer; the first
    ``min(3, L)`` layers have dense FFNs unless ``mlp_layer_types`` (or ``first_k_dense_replace``) says
    otherwise; every sparse layer runs its own indexer unless ``indexer_types`` marks it ``"shared"``
    (it then reuses the selection of the previous sparse layer that runs one).
    """

    vocab_size: int = 154880
    hidden_size: int = 4096
    num_hidden_layers: int = 45
    intermediate_size: int = 12288
    moe_intermediate_size: int = 2048
    n_routed_experts: int = 288
    n_shared_experts: int = 1
    num_experts_per_tok: int = 8
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 2.5
    norm_topk_prob: bool = True
    swiglu_limit: float | None = 10.0
    hidden_act: str = "silu"
    # Sparse MLA (NoPE: qk_rope_head_dim must be 0).
    num_attention_heads: int = 64
    num_key_value_heads: int | None = None
    q_lora_rank: int = 1536
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 256
    qk_rope_head_dim: int = 0
    v_head_dim: int = 256
    attention_bias: bool = False
    # Pooled (C4) lightning indexer.
    index_n_heads: int = 32
    index_head_dim: int = 128
    index_topk: int = 2048
    index_kpool: int = 4
    index_kpool_always_select_tail: bool = True
    index_share_for_mtp_iteration: bool = False
    # KDA.
    kda_num_heads: int = 64
    kda_head_dim: int = 128
    kda_short_conv_kernel_size: int = 4
    kda_gate_lower_bound: float = -5.0
    kda_gate_low_rank: int | None = None
    # mHC residual streams.
    hc_mult: int = 4
    hc_eps: float = 1e-6
    hc_sinkhorn_iters: int = 20
    # MTP (the reference's config has no such key: a checkpoint it wrote has no MTP layer).
    num_nextn_predict_layers: int = 0
    # Misc.
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = 154820
    torch_dtype: str = "bfloat16"
    max_position_embeddings: int = 1048576
    initializer_range: float = 0.02
    layer_types: list[str] | None = None
    mlp_layer_types: list[str] | None = None
    indexer_types: list[str] | None = None
    first_k_dense_replace: int | None = None
    # Block-FP8 weights of the checkpoint (None: unquantised). Only the loader reads it.
    quantization: QuantConfig | None = field(default=None, repr=False)
    # Top-level VL fields of the file this came from (vision_config, image token ids...), written back
    # by `to_dict` so that a save round-trips the real layout; never used to compute.
    vl_extras: dict[str, Any] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        L = self.num_hidden_layers
        if not isinstance(L, int) or isinstance(L, bool) or L <= 0:
            raise ConfigError(f"num_hidden_layers: must be a positive int, got {L!r}")
        if self.layer_types is None:
            self.layer_types = [LAYER_SPARSE_MLA if i % 4 == 3 else LAYER_KDA for i in range(L)]
        else:
            self.layer_types = [
                self._canon(i, t, _LAYER_ALIASES, "layer_types") for i, t in enumerate(self.layer_types)
            ]
        if self.mlp_layer_types is None:
            k = min(3, L) if self.first_k_dense_replace is None else self.first_k_dense_replace
            if not isinstance(k, int) or not 0 <= k <= L:
                raise ConfigError(f"first_k_dense_replace: must be an int in [0, {L}], got {k!r}")
            self.mlp_layer_types = [MLP_DENSE if i < k else MLP_SPARSE for i in range(L)]
        else:
            self.mlp_layer_types = [
                self._canon(i, t, _MLP_ALIASES, "mlp_layer_types") for i, t in enumerate(self.mlp_layer_types)
            ]
        lead = 0
        while lead < len(self.mlp_layer_types) and self.mlp_layer_types[lead] == MLP_DENSE:
            lead += 1
        self.first_k_dense_replace = lead
        if self.indexer_types is None:
            self.indexer_types = [INDEXER_FULL] * L
        else:
            canon = {INDEXER_FULL: INDEXER_FULL, INDEXER_SHARED: INDEXER_SHARED}
            self.indexer_types = [self._canon(i, t, canon, "indexer_types") for i, t in enumerate(self.indexer_types)]
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.kda_gate_low_rank is None:
            self.kda_gate_low_rank = self.kda_head_dim
        self.validate()

    # ----------------------------------------------------------------------------------------------
    @staticmethod
    def _canon(i: int, t: Any, aliases: dict[str, str], fld: str) -> str:
        key = str(t).lower()
        if key not in aliases:
            raise ConfigError(f"{fld}[{i}]: unknown value {t!r} (expected one of {sorted(aliases)})")
        return aliases[key]

    def validate(self) -> None:
        """Raise `ConfigError` naming the first inconsistent field."""

        def need(cond: bool, fld: str, msg: str) -> None:
            if not cond:
                raise ConfigError(f"{fld}: {msg}")

        positive = [
            "vocab_size", "hidden_size", "num_hidden_layers", "intermediate_size", "num_attention_heads",
            "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "v_head_dim", "index_n_heads",
            "index_topk", "kda_num_heads", "kda_head_dim", "kda_gate_low_rank", "hc_mult", "hc_sinkhorn_iters",
            "max_position_embeddings",
        ]  # fmt: skip
        for name in positive:
            v = getattr(self, name)
            need(isinstance(v, int) and not isinstance(v, bool) and v > 0, name, f"must be a positive int, got {v!r}")
        need(self.qk_rope_head_dim == 0, "qk_rope_head_dim", f"must be 0 (NoPE MLA), got {self.qk_rope_head_dim}")
        need(
            self.num_key_value_heads == self.num_attention_heads,
            "num_key_value_heads",
            f"must equal num_attention_heads={self.num_attention_heads} (MLA), got {self.num_key_value_heads}",
        )
        need(self.attention_bias is False, "attention_bias", "biased MLA projections are not supported")
        need(self.hidden_act == "silu", "hidden_act", f"only 'silu' is supported, got {self.hidden_act!r}")
        need(
            self.index_head_dim == INDEX_HEAD_DIM,
            "index_head_dim",
            f"must be {INDEX_HEAD_DIM} (the FWHT rotation is 128 wide), got {self.index_head_dim}",
        )
        need(
            self.index_kpool == INDEX_KPOOL,
            "index_kpool",
            f"must be {INDEX_KPOOL} (the cache stores pools of 4 tokens), got {self.index_kpool}",
        )
        need(
            self.index_topk % self.index_kpool == 0,
            "index_topk",
            f"must be a multiple of index_kpool={self.index_kpool}, got {self.index_topk}",
        )
        need(
            self.index_kpool_always_select_tail is True,
            "index_kpool_always_select_tail",
            "must be true: the backend always attends the open pool's tail (a model trained without it "
            "would compute a different function here)",
        )
        need(
            isinstance(self.index_share_for_mtp_iteration, bool),
            "index_share_for_mtp_iteration",
            "must be a bool",
        )
        need(
            self.kda_short_conv_kernel_size >= 2,
            "kda_short_conv_kernel_size",
            f"must be >= 2, got {self.kda_short_conv_kernel_size}",
        )
        need(
            self.kda_gate_lower_bound is not None,
            "linear_lower_bound",
            "only the safe (lower-bounded) gate is supported",
        )
        need(self.kda_gate_lower_bound < 0, "kda_gate_lower_bound", "must be negative")
        need(self.swiglu_limit is None or self.swiglu_limit > 0, "swiglu_limit", "must be positive or null")
        need(self.hc_eps >= 0, "hc_eps", "must be >= 0")
        need(
            self.num_nextn_predict_layers in (0, 1),
            "num_nextn_predict_layers",
            "must be 0 or 1 (one MTP layer, chained)",
        )
        assert self.layer_types is not None and self.mlp_layer_types is not None and self.indexer_types is not None
        for fld in ("layer_types", "mlp_layer_types", "indexer_types"):
            n = len(getattr(self, fld))
            need(n == self.num_hidden_layers, fld, f"lists {n} layers but num_hidden_layers={self.num_hidden_layers}")
        if MLP_SPARSE in self.mlp_layer_types or self.num_nextn_predict_layers:
            need(self.moe_intermediate_size > 0, "moe_intermediate_size", "must be positive with MoE layers")
            need(self.n_routed_experts > 0, "n_routed_experts", "must be positive with MoE layers")
            need(
                0 < self.num_experts_per_tok <= self.n_routed_experts,
                "num_experts_per_tok",
                f"must be in [1, n_routed_experts={self.n_routed_experts}], got {self.num_experts_per_tok}",
            )
            need(self.n_shared_experts >= 0, "n_shared_experts", "must be >= 0")
            need(
                self.n_group >= 1 and self.n_routed_experts % self.n_group == 0,
                "n_group",
                f"must divide n_routed_experts={self.n_routed_experts}, got {self.n_group}",
            )
            need(1 <= self.topk_group <= self.n_group, "topk_group", f"must be in [1, n_group={self.n_group}]")
        seen_full = False
        for i, (kind, ix) in enumerate(zip(self.layer_types, self.indexer_types)):
            if kind != LAYER_SPARSE_MLA:
                continue
            need(
                ix == INDEXER_FULL or seen_full,
                f"indexer_types[{i}]",
                "a 'shared' sparse layer needs an earlier sparse layer that runs its own indexer",
            )
            seen_full = seen_full or ix == INDEXER_FULL
        need(self.torch_dtype in ("bfloat16", "float16", "float32"), "torch_dtype", f"unsupported {self.torch_dtype!r}")
        for name in ("bos_token_id", "pad_token_id"):
            v = getattr(self, name)
            need(v is None or 0 <= v < self.vocab_size, name, f"{v} outside the vocabulary")
        for e in self.eos_token_ids:
            need(0 <= e < self.vocab_size, "eos_token_id", f"{e} outside the vocabulary")

    # ----------------------------------------------------------------------------------------------
    @property
    def eos_token_ids(self) -> list[int]:
        if self.eos_token_id is None:
            return []
        if isinstance(self.eos_token_id, int):
            return [self.eos_token_id]
        return list(self.eos_token_id)

    @property
    def sparse_layer_ids(self) -> list[int]:
        """Trunk layer indices that are sparse MLA (the MTP layer is not included)."""
        assert self.layer_types is not None
        return [i for i, t in enumerate(self.layer_types) if t == LAYER_SPARSE_MLA]

    @property
    def kda_layer_ids(self) -> list[int]:
        assert self.layer_types is not None
        return [i for i, t in enumerate(self.layer_types) if t == LAYER_KDA]

    @property
    def index_topk_pools(self) -> int:
        return self.index_topk // self.index_kpool

    @property
    def index_select_width(self) -> int:
        """Selection width: top-k tokens plus the open pool's tail (at most kpool - 1 tokens)."""
        return self.index_topk + self.index_kpool - 1

    @property
    def softmax_scale(self) -> float:
        return 1.0 / math.sqrt(self.qk_nope_head_dim + self.qk_rope_head_dim)

    def is_moe_layer(self, layer_idx: int) -> bool:
        """Whether trunk layer ``layer_idx`` has a routed-expert FFN (the MTP layer always has one)."""
        assert self.mlp_layer_types is not None
        if layer_idx >= self.num_hidden_layers:
            return True
        return self.mlp_layer_types[layer_idx] == MLP_SPARSE

    def shares_indexer(self, layer_idx: int) -> bool:
        """Whether sparse layer ``layer_idx`` reuses the previous full sparse layer's selection."""
        assert self.indexer_types is not None
        return layer_idx < self.num_hidden_layers and self.indexer_types[layer_idx] == INDEXER_SHARED

    # ----------------------------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Glm5NextConfig:
        """Build from a config dict (VL layout with ``text_config``, or flat); unknown keys raise."""
        if not isinstance(d, dict):
            raise ConfigError("config: must be a JSON object")
        d = dict(d)
        quant = None
        vl_extras: dict[str, Any] = {}
        if "text_config" in d:
            text = d.pop("text_config")
            if not isinstance(text, dict):
                raise ConfigError("text_config: must be an object")
            qc = d.pop("quantization_config", None)
            quant = QuantConfig.from_dict(qc) if qc is not None else None
            unknown = sorted(k for k in d if k not in _IGNORED_TOP_KEYS)
            if unknown:
                raise ConfigError(f"{unknown[0]}: unknown top-level config key (not part of the GLM-5.3-Flash config)")
            mt = d.get("model_type", "glm5_next")
            if mt != "glm5_next":
                raise ConfigError(f"model_type: expected 'glm5_next' for a config with text_config, got {mt!r}")
            tmt = text.get("model_type", "glm5_next_text")
            if tmt != "glm5_next_text":
                raise ConfigError(f"text_config.model_type: expected 'glm5_next_text', got {tmt!r}")
            vl_extras = {k: d[k] for k in d if k not in ("architectures", "model_type", "transformers_version")}
            merged = dict(text)
            # Top-level copies of token ids / tying only fill what the text config leaves unset.
            for k in ("tie_word_embeddings", "num_nextn_predict_layers"):
                if k in d and k not in merged:
                    merged[k] = d[k]
            for k in ("bos_token_id", "eos_token_id", "pad_token_id"):
                if k in d and merged.get(k) is None:
                    merged[k] = d[k]
            if "torch_dtype" not in merged and "dtype" not in merged:
                merged["torch_dtype"] = d.get("torch_dtype", d.get("dtype", "bfloat16"))
            d = merged
        else:
            qc = d.pop("quantization_config", None)
            quant = QuantConfig.from_dict(qc) if qc is not None else None
        kwargs = cls._text_kwargs(d)
        try:
            return cls(**kwargs, quantization=quant, vl_extras=vl_extras)
        except TypeError as e:  # pragma: no cover - kwargs are filtered in _text_kwargs
            raise ConfigError(str(e)) from e

    @classmethod
    def _text_kwargs(cls, d: dict[str, Any]) -> dict[str, Any]:
        names = {f.name for f in dataclasses.fields(cls)} - {"quantization", "vl_extras"}
        out: dict[str, Any] = {}
        lac = d.pop("linear_attn_config", None)
        if lac is not None:
            if not isinstance(lac, dict):
                raise ConfigError("linear_attn_config: must be an object")
            for k, v in lac.items():
                if k in _LINEAR_ATTN_KEYS:
                    out[_LINEAR_ATTN_KEYS[k]] = v
                elif k not in _LINEAR_ATTN_IGNORED:
                    raise ConfigError(f"linear_attn_config.{k}: unknown key")
        if "dtype" in d and "torch_dtype" not in d:
            d["torch_dtype"] = d["dtype"]
        if isinstance(d.get("torch_dtype"), str) and d["torch_dtype"].startswith("torch."):
            d["torch_dtype"] = d["torch_dtype"][len("torch.") :]
        for k, v in d.items():
            name = _ALIASES.get(k, k)
            if name in names:
                out[name] = v
            elif k in _IGNORED_TEXT_KEYS:
                want = _REQUIRED_VALUES.get(k)
                if want is not None and v != want:
                    raise ConfigError(f"{k}: only {want!r} is supported, got {v!r}")
            else:
                raise ConfigError(f"{k}: unknown config key (not part of the GLM-5.3-Flash text config)")
        return out

    @classmethod
    def from_json_file(cls, path: str | os.PathLike[str]) -> Glm5NextConfig:
        try:
            with open(path, encoding="utf-8") as f:
                d = json.load(f)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}: not valid JSON ({e})") from e
        except OSError as e:
            raise ConfigError(f"{path}: cannot read ({e.strerror})") from e
        if not isinstance(d, dict):
            raise ConfigError(f"{path}: top level must be a JSON object")
        # The defaults are the full model's: a file that leaves out its geometry would silently describe it.
        text = d.get("text_config", d)
        missing = [k for k in _REQUIRED_FILE_KEYS if not isinstance(text, dict) or k not in text]
        if missing:
            where = "text_config" if "text_config" in d else "the config"
            raise ConfigError(f"{path}: {where} lacks required key(s) {', '.join(missing)}")
        try:
            return cls.from_dict(d)
        except ConfigError as e:
            raise ConfigError(f"{path}: {e}") from e

    @classmethod
    def from_pretrained(cls, name_or_dir: str | os.PathLike[str]) -> Glm5NextConfig:
        """A preset name (``tiny``, ``glm-5.3-flash``) or a checkpoint directory holding ``config.json``."""
        key = str(name_or_dir)
        if key in PRESETS:
            return cls.from_dict(PRESETS[key])
        if os.path.isfile(key):
            # Never a preset, and never the config alone: that would serve seeded random weights.
            raise ConfigError(
                f"model: {key!r} is a file; give the checkpoint directory that holds it or a preset ({sorted(PRESETS)})"
            )
        if not os.path.isdir(key):
            raise ConfigError(f"model: {key!r} is neither a preset ({sorted(PRESETS)}) nor a checkpoint directory")
        path = os.path.join(key, "config.json")
        if not os.path.exists(path):
            raise ConfigError(f"model: {key!r} has no config.json")
        return cls.from_json_file(path)

    def text_dict(self) -> dict[str, Any]:
        """The text config under the reference's key names (``Glm5NextTextConfig``)."""
        d: dict[str, Any] = {"model_type": "glm5_next_text"}
        skip = {"quantization", "vl_extras", "first_k_dense_replace", "torch_dtype", "kda_gate_low_rank"}
        rename = {v: k for k, v in _ALIASES.items() if k.startswith("linear_")}
        for f in dataclasses.fields(self):
            if f.name in skip:
                continue
            d[rename.get(f.name, f.name)] = getattr(self, f.name)
        d["layer_types"] = [
            "linear_attention" if t == LAYER_KDA else "indexed_attention" for t in self.layer_types or []
        ]
        if self.kda_gate_low_rank != self.kda_head_dim:
            d["linear_attn_config"] = {"gate_low_rank": self.kda_gate_low_rank}
        d["dtype"] = self.torch_dtype
        return d

    def to_dict(self) -> dict[str, Any]:
        """The real (VL) layout: ``text_config`` inside, ``quantization_config`` at the top when set."""
        d: dict[str, Any] = {
            "architectures": ["Glm5NextForConditionalGeneration"],
            "model_type": "glm5_next",
            "text_config": self.text_dict(),
            "tie_word_embeddings": self.tie_word_embeddings,
            "dtype": self.torch_dtype,
        }
        for k, v in self.vl_extras.items():
            d.setdefault(k, v)
        if self.quantization is not None:
            d["quantization_config"] = dict(self.quantization.raw)
        return d

    def save(self, directory: str | os.PathLike[str]) -> None:
        os.makedirs(directory, exist_ok=True)
        with open(os.path.join(directory, "config.json"), "w", encoding="utf-8") as f:
            json.dump(self.to_dict(), f, indent=2)


# Keys a checkpoint's config.json must give (the model's geometry), as the reference names them.
_REQUIRED_FILE_KEYS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads")

PRESETS: dict[str, dict[str, Any]] = {
    # Real GLM-5.3-Flash geometry (docs/design.md §2): the reference's defaults with the C4 pool.
    "glm-5.3-flash": {"model_type": "glm5_next_text", "index_kpool": 4, "num_nextn_predict_layers": 1},
    # Same structure at small sizes: 8 layers (sparse MLA at 3 and 7), mHC with 4 streams, clamped
    # SwiGLU, one MTP layer, indexer head dim 128, kpool 4, and index_topk = 16 tokens (4 pools) so that
    # selection drops pools beyond 16 tokens.
    "tiny": {
        "model_type": "glm5_next_text",
        "vocab_size": 264,
        "hidden_size": 128,
        "num_hidden_layers": 8,
        "intermediate_size": 256,
        "moe_intermediate_size": 64,
        "n_routed_experts": 4,
        "n_shared_experts": 1,
        "num_experts_per_tok": 2,
        "mlp_layer_types": ["dense"] + ["sparse"] * 7,
        "routed_scaling_factor": 1.0,
        "num_attention_heads": 4,
        "q_lora_rank": 64,
        "kv_lora_rank": 64,
        "qk_nope_head_dim": 32,
        "qk_rope_head_dim": 0,
        "v_head_dim": 32,
        "index_n_heads": 4,
        "index_head_dim": 128,
        "index_topk": 16,
        "index_kpool": 4,
        "linear_num_heads": 4,
        "linear_head_dim": 32,
        "linear_conv_kernel_dim": 4,
        "swiglu_limit": 10.0,
        "hc_mult": 4,
        "num_nextn_predict_layers": 1,
        "bos_token_id": 256,
        "eos_token_id": 257,
        "pad_token_id": 258,
        "torch_dtype": "float32",
        "max_position_embeddings": 4096,
        "initializer_range": 0.05,
    },
}

# Presets that ship trained weights: name -> checkpoint directory inside the package (package data). Their
# config comes from the shipped config.json, and `resolve_preset_dir` turns the name into the directory for
# the weight and tokenizer loaders.
PRESET_CHECKPOINTS: dict[str, str] = {
    # Trained on the CPython standard library by scripts/train_small.py (byte vocabulary; README).
    "small": os.path.join(os.path.dirname(os.path.abspath(__file__)), "presets", "small"),
}


def resolve_preset_dir(model: str | os.PathLike[str]) -> str | os.PathLike[str]:
    """The shipped checkpoint directory of a preset with trained weights; anything else unchanged."""
    directory = PRESET_CHECKPOINTS.get(model) if isinstance(model, str) else None
    return directory if directory is not None and os.path.isdir(directory) else model


def _add_checkpoint_presets() -> None:
    """List each shipped checkpoint's config in `PRESETS` (an install without the files lacks the preset)."""
    for name, directory in PRESET_CHECKPOINTS.items():
        path = os.path.join(directory, "config.json")
        if os.path.isfile(path):
            with open(path, encoding="utf-8") as f:
                PRESETS[name] = json.load(f)


_add_checkpoint_presets()
