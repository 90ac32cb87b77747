"""Model configuration for GLM-5.3-Flash-class hybrid models.

`Glm5NextConfig` reads an HF-style ``config.json`` with GLM-5.3-Flash key names, fills derived fields
and validates the geometry. Every inconsistency raises `ConfigError` naming the offending field.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass, field
from typing import Any

__all__ = ["ConfigError", "Glm5NextConfig", "PRESETS", "LAYER_KDA", "LAYER_SPARSE_MLA"]

LAYER_KDA = "kda"
LAYER_SPARSE_MLA = "sparse_mla"

# Spellings accepted in a config file's ``layer_types`` list.
_LAYER_ALIASES = {
    "kda": LAYER_KDA,
    "linear_attention": LAYER_KDA,
    "linear": LAYER_KDA,
    "sparse_mla": LAYER_SPARSE_MLA,
    "sparse_attention": LAYER_SPARSE_MLA,
    "full_attention": LAYER_SPARSE_MLA,
    "mla": LAYER_SPARSE_MLA,
}

# The Hadamard rotation before FP8 is defined for 128-wide vectors only.
INDEX_HEAD_DIM = 128
INDEX_KPOOL = 4


class ConfigError(ValueError):
    """A config file or preset is inconsistent; the message names the field."""


@dataclass
class Glm5NextConfig:
    """Geometry of a GLM-5.3-Flash-class hybrid model (HF ``config.json`` key names).

    Sparse MLA layers sit at ``i % 4 == 3`` unless ``layer_types`` lists every layer. KDA dimensions come
    from ``linear_attn_config`` (``num_heads``, ``head_dim``, ``short_conv_kernel_size``) or the flat
    ``kda_*`` fields.
    """

    vocab_size: int = 154880
    hidden_size: int = 4096
    num_hidden_layers: int = 45
    intermediate_size: int = 12288
    moe_intermediate_size: int = 1536
    n_routed_experts: int = 288
    n_shared_experts: int = 1
    num_experts_per_tok: int = 8
    first_k_dense_replace: int = 3
    routed_scaling_factor: float = 2.5
    norm_topk_prob: bool = True
    # Sparse MLA (NoPE: qk_rope_head_dim must be 0).
    num_attention_heads: int = 64
    q_lora_rank: int = 1536
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 256
    qk_rope_head_dim: int = 0
    v_head_dim: int = 256
    # Pooled (C4) lightning indexer.
    index_n_heads: int = 32
    index_head_dim: int = 128
    index_topk: int = 2048
    index_kpool: int = 4
    # KDA.
    kda_num_heads: int = 64
    kda_head_dim: int = 128
    kda_short_conv_kernel_size: int = 4
    kda_gate_lower_bound: float = -5.0
    kda_gate_low_rank: int = 128
    # MTP.
    num_nextn_predict_layers: int = 1
    # Misc.
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None
    torch_dtype: str = "bfloat16"
    max_position_embeddings: int = 131072
    initializer_range: float = 0.02
    layer_types: list[str] | None = None
    extra: dict[str, Any] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if self.layer_types is None:
            self.layer_types = [LAYER_SPARSE_MLA if i % 4 == 3 else LAYER_KDA for i in range(self.num_hidden_layers)]
        else:
            self.layer_types = [self._canon_layer_type(i, t) for i, t in enumerate(self.layer_types)]
        self.validate()

    # ----------------------------------------------------------------------------------------------
    @staticmethod
    def _canon_layer_type(i: int, t: Any) -> str:
        key = str(t).lower()
        if key not in _LAYER_ALIASES:
            raise ConfigError(f"layer_types[{i}]: unknown layer type {t!r} (expected one of {sorted(_LAYER_ALIASES)})")
        return _LAYER_ALIASES[key]

    def validate(self) -> None:
        """Raise `ConfigError` naming the first inconsistent field."""

        def need(cond: bool, fld: str, msg: str) -> None:
            if not cond:
                raise ConfigError(f"{fld}: {msg}")

        positive = [
            "vocab_size", "hidden_size", "num_hidden_layers", "intermediate_size", "num_attention_heads",
            "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "v_head_dim", "index_n_heads",
            "index_topk", "kda_num_heads", "kda_head_dim", "kda_gate_low_rank",
        ]  # fmt: skip
        for name in positive:
            v = getattr(self, name)
            need(isinstance(v, int) and not isinstance(v, bool) and v > 0, name, f"must be a positive int, got {v!r}")
        need(self.qk_rope_head_dim == 0, "qk_rope_head_dim", f"must be 0 (NoPE MLA), got {self.qk_rope_head_dim}")
        need(
            self.index_head_dim == INDEX_HEAD_DIM,
            "index_head_dim",
            f"must be {INDEX_HEAD_DIM} (the FWHT rotation is 128 wide), got {self.index_head_dim}",
        )
        need(self.index_kpool == INDEX_KPOOL, "index_kpool", f"must be {INDEX_KPOOL}, got {self.index_kpool}")
        need(
            self.index_topk % self.index_kpool == 0,
            "index_topk",
            f"must be a multiple of index_kpool={self.index_kpool}, got {self.index_topk}",
        )
        need(
            self.kda_short_conv_kernel_size >= 2,
            "kda_short_conv_kernel_size",
            f"must be >= 2, got {self.kda_short_conv_kernel_size}",
        )
        need(self.kda_gate_lower_bound < 0, "kda_gate_lower_bound", "must be negative")
        need(self.num_nextn_predict_layers >= 0, "num_nextn_predict_layers", "must be >= 0")
        need(0 <= self.first_k_dense_replace <= self.num_hidden_layers, "first_k_dense_replace", "out of range")
        if self.first_k_dense_replace < self.num_hidden_layers:
            need(self.moe_intermediate_size > 0, "moe_intermediate_size", "must be positive with MoE layers")
            need(self.n_routed_experts > 0, "n_routed_experts", "must be positive with MoE layers")
            need(
                0 < self.num_experts_per_tok <= self.n_routed_experts,
                "num_experts_per_tok",
                f"must be in [1, n_routed_experts={self.n_routed_experts}], got {self.num_experts_per_tok}",
            )
            need(self.n_shared_experts >= 0, "n_shared_experts", "must be >= 0")
        assert self.layer_types is not None
        need(
            len(self.layer_types) == self.num_hidden_layers,
            "layer_types",
            f"lists {len(self.layer_types)} layers but num_hidden_layers={self.num_hidden_layers}",
        )
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
        return layer_idx >= self.first_k_dense_replace

    # ----------------------------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Glm5NextConfig:
        """Build from an HF-style dict; unknown keys are kept in ``extra``."""
        d = dict(d)
        lac = d.pop("linear_attn_config", None)
        if lac is not None:
            if not isinstance(lac, dict):
                raise ConfigError("linear_attn_config: must be an object")
            mapping = {
                "num_heads": "kda_num_heads",
                "head_dim": "kda_head_dim",
                "short_conv_kernel_size": "kda_short_conv_kernel_size",
                "gate_lower_bound": "kda_gate_lower_bound",
                "gate_low_rank": "kda_gate_low_rank",
            }
            for k, v in lac.items():
                if k in mapping:
                    d.setdefault(mapping[k], v)
        names = {f.name for f in dataclasses.fields(cls)} - {"extra"}
        kwargs = {k: v for k, v in d.items() if k in names}
        extra = {k: v for k, v in d.items() if k not in names}
        try:
            return cls(**kwargs, extra=extra)
        except TypeError as e:  # pragma: no cover - defensive, dataclass kwargs are filtered above
            raise ConfigError(str(e)) from e

    @classmethod
    def from_json_file(cls, path: str | os.PathLike[str]) -> Glm5NextConfig:
        try:
            with open(path, encoding="utf-8") as f:
                d = json.load(f)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}: not valid JSON ({e})") from e
        if not isinstance(d, dict):
            raise ConfigError(f"{path}: top level must be a JSON object")
        return cls.from_dict(d)

    @classmethod
    def from_pretrained(cls, name_or_dir: str | os.PathLike[str]) -> Glm5NextConfig:
        """A preset name (``tiny``, ``glm-5.3-flash``) or a directory holding ``config.json``."""
        key = str(name_or_dir)
        if key in PRESETS:
            return cls.from_dict(PRESETS[key])
        path = os.path.join(key, "config.json") if os.path.isdir(key) else key
        if not os.path.exists(path):
            raise ConfigError(f"model: {key!r} is neither a preset ({sorted(PRESETS)}) nor a config path")
        return cls.from_json_file(path)

    def to_dict(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "extra"}
        d["linear_attn_config"] = {
            "num_heads": d.pop("kda_num_heads"),
            "head_dim": d.pop("kda_head_dim"),
            "short_conv_kernel_size": d.pop("kda_short_conv_kernel_size"),
            "gate_lower_bound": d.pop("kda_gate_lower_bound"),
            "gate_low_rank": d.pop("kda_gate_low_rank"),
        }
        d.update(self.extra)
        return d

    def save(self, directory: str | os.PathLike[str]) -> None:
        os.makedirs(directory, exist_ok=True)
        with open(os.path.join(directory, "config.json"), "w", encoding="utf-8") as f:
            json.dump(self.to_dict(), f, indent=2)


PRESETS: dict[str, dict[str, Any]] = {
    # Real GLM-5.3-Flash geometry (DESIGN §2).
    "glm-5.3-flash": {
        "architectures": ["Glm5NextForCausalLM"],
        "model_type": "glm5_next",
    },
    # Same structure at small sizes: 8 layers (sparse MLA at 3 and 7), indexer head dim 128, kpool 4,
    # and index_topk = 16 tokens (4 pools) so that selection drops pools beyond 16 tokens.
    "tiny": {
        "architectures": ["Glm5NextForCausalLM"],
        "model_type": "glm5_next",
        "vocab_size": 264,
        "hidden_size": 128,
        "num_hidden_layers": 8,
        "intermediate_size": 256,
        "moe_intermediate_size": 64,
        "n_routed_experts": 4,
        "n_shared_experts": 1,
        "num_experts_per_tok": 2,
        "first_k_dense_replace": 1,
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
        "linear_attn_config": {"num_heads": 4, "head_dim": 32, "short_conv_kernel_size": 4, "gate_low_rank": 16},
        "num_nextn_predict_layers": 1,
        "bos_token_id": 256,
        "eos_token_id": 257,
        "pad_token_id": 258,
        "torch_dtype": "float32",
        "max_position_embeddings": 4096,
        "initializer_range": 0.05,
    },
}
