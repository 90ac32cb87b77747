"""The sharding plan: each rank's local config and, per checkpoint tensor, the slice that rank holds.

One rule per parameter (`param_shard`): replicated (``None``), not held by this rank (a routed expert of another
block), or cut along one dimension into ``[start, stop)`` (`Shard`; heads are contiguous row blocks in every
projection). The loader applies the same `Shard` to a block-FP8 weight and its ``_scale_inv`` (`Shard.scale_shard`),
`shard_state_dict` cuts an in-memory state dict: one plan either way. A rank's routed experts ``[e0, e0 + E / ep)``
are renamed ``e - e0``. The plan per parameter: docs/parallelism.md, "Sharding plan".
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..config import LAYER_SPARSE_MLA, Glm5NextConfig
from .mapping import Mapping, ParallelConfigError

__all__ = [
    "Shard",
    "SKIP",
    "check_shardable",
    "local_config",
    "param_shard",
    "shard_fn",
    "shard_state_dict",
    "expert_block",
]


@dataclass(frozen=True)
class Shard:
    """``tensor.narrow(dim, start, stop - start)``: the rank's part of a tensor."""

    dim: int
    start: int
    stop: int

    def apply(self, t: torch.Tensor) -> torch.Tensor:
        return t.narrow(self.dim, self.start, self.stop - self.start)

    def index(self, ndim: int) -> tuple[slice, ...]:
        """The indexing tuple of this cut (for safetensors' ``get_slice``)."""
        return tuple(slice(self.start, self.stop) if d == self.dim else slice(None) for d in range(ndim))

    def scale_shard(self, full: int, block: int, what: str) -> Shard:
        """The cut of a block-FP8 weight's ``_scale_inv`` (one scale per ``block`` x ``block`` tile).

        Args:
            full: the weight's full length along `dim`.
            block: the tile edge.
            what: the tensor's name, for the error.

        Raises:
            ParallelConfigError: the cut is not on tile boundaries (a tile would be split between ranks).
        """
        if self.start % block or (self.stop % block and self.stop != full):
            raise ParallelConfigError(
                f"{what}: this rank's slice [{self.start}, {self.stop}) of dim {self.dim} is not on {block}-wide FP8 "
                f"tile boundaries; use a parallel size that cuts the dimension ({full}) into multiples of {block}"
            )
        return Shard(self.dim, self.start // block, -(-self.stop // block))


SKIP = "skip"
"""`param_shard`'s answer for a tensor this rank does not hold (another block's expert)."""

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.*)$")
_EXPERT = re.compile(r"^mlp\.experts\.(\d+)\.(.*)$")
# Row-split (dim 0) and column-split (dim 1) tensors of each mixer (names under ``self_attn.``).
_MLA_ROWS = ("q_b_proj.weight", "kv_b_proj.weight")
_KDA_ROWS = (
    "q_proj.weight",
    "k_proj.weight",
    "v_proj.weight",
    "q_conv1d.weight",
    "k_conv1d.weight",
    "v_conv1d.weight",
    "f_b_proj.weight",
    "g_b_proj.weight",
    "b_proj.weight",
    "A_log",
    "dt_bias",
)


def check_shardable(config: Glm5NextConfig, mapping: Mapping) -> None:
    """Refuse, in one line, a layout whose sizes do not divide the model's.

    Raises:
        ParallelConfigError: naming the first field that does not divide.
    """
    m = mapping
    checks = [
        ("num_attention_heads", config.num_attention_heads, m.tp_size, "tensor_parallel_size"),
        ("kda_num_heads (linear_num_heads)", config.kda_num_heads, m.tp_size, "tensor_parallel_size"),
        ("intermediate_size", config.intermediate_size, m.tp_size, "tensor_parallel_size"),
    ]
    if any(config.is_moe_layer(i) for i in range(config.num_hidden_layers)) or config.num_nextn_predict_layers:
        checks += [
            ("n_routed_experts", config.n_routed_experts, m.moe_ep_size, "moe_expert_parallel_size"),
            ("moe_intermediate_size", config.moe_intermediate_size, m.moe_tp_size, "moe_tensor_parallel_size"),
            (
                "moe_intermediate_size * n_shared_experts",
                config.moe_intermediate_size * config.n_shared_experts,
                m.world_size,
                "the world size",
            ),
        ]
    for field, total, parts, knob in checks:
        if total % parts:
            raise ParallelConfigError(f"{field}={total} is not divisible by {knob}={parts}")


def local_config(config: Glm5NextConfig, mapping: Mapping) -> Glm5NextConfig:
    """The geometry one rank builds: its attention and KDA heads and its dense-MLP width.

    The MoE keeps the global sizes (its router is replicated); `trtllm_glm.modules.ffn.MoE` takes its
    expert block and slices from the `Mapping`. The caches a rank allocates follow this config (KDA state
    of the local heads; the MLA latent cache is per token, not per head, and stays whole on every rank).
    """
    check_shardable(config, mapping)
    if mapping.tp_size == 1:
        return config
    tp = mapping.tp_size
    return dataclasses.replace(
        config,
        num_attention_heads=config.num_attention_heads // tp,
        num_key_value_heads=config.num_attention_heads // tp,
        kda_num_heads=config.kda_num_heads // tp,
        intermediate_size=config.intermediate_size // tp,
    )


def expert_block(config: Glm5NextConfig, mapping: Mapping) -> tuple[int, int]:
    """``(e0, count)``: this rank's routed experts are ``[e0, e0 + count)``."""
    e0, e1 = Mapping.split(config.n_routed_experts, mapping.moe_ep_size, mapping.moe_ep_rank, "n_routed_experts")
    return e0, e1 - e0


def _even(shape: tuple[int, ...], dim: int, parts: int, index: int, name: str) -> Shard:
    start, stop = Mapping.split(shape[dim], parts, index, f"{name} dim {dim}")
    return Shard(dim, start, stop)


def param_shard(
    name: str, shape: tuple[int, ...], config: Glm5NextConfig, mapping: Mapping
) -> tuple[str, Shard | None] | str:
    """This rank's part of checkpoint tensor ``name`` (canonical ``model.*`` name, full ``shape``).

    Returns:
        `SKIP` when the rank does not hold it, else ``(local name, shard)`` with ``shard`` ``None`` for a
        replicated tensor. Local names differ from ``name`` only for routed experts (renumbered from 0).
    """
    m = mapping
    if not m.is_parallel:
        return name, None
    mt = _LAYER.match(name)
    if mt is None:
        return name, None  # embedding, final norm, LM head: replicated
    layer, rest = int(mt.group(1)), mt.group(2)
    prefix = f"model.layers.{layer}."
    if rest.startswith("self_attn."):
        if m.tp_size == 1:
            return name, None
        sub = rest[len("self_attn.") :]
        sparse = layer >= config.num_hidden_layers or config.layer_types[layer] == LAYER_SPARSE_MLA
        rows = _MLA_ROWS if sparse else _KDA_ROWS
        if sub in rows:
            return name, _even(shape, 0, m.tp_size, m.tp_rank, name)
        if sub == "o_proj.weight":
            return name, _even(shape, 1, m.tp_size, m.tp_rank, name)
        return name, None
    if not rest.startswith("mlp."):
        return name, None  # norms, mHC, the MTP block's own projections
    ex = _EXPERT.match(rest)
    if ex is not None:
        e0, count = expert_block(config, m)
        e = int(ex.group(1))
        if not e0 <= e < e0 + count:
            return SKIP
        local = f"{prefix}mlp.experts.{e - e0}.{ex.group(2)}"
        dim = 1 if ex.group(2).startswith("down_proj") else 0
        if m.moe_tp_size == 1:
            return local, None
        return local, _even(shape, dim, m.moe_tp_size, m.moe_tp_rank, name)
    if rest.startswith("mlp.shared_experts."):
        dim = 1 if rest.endswith("down_proj.weight") else 0
        return name, _even(shape, dim, m.world_size, m.rank, name)
    if rest.startswith("mlp.gate."):
        return name, None  # the router: replicated
    if rest in ("mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight"):
        if m.tp_size == 1:
            return name, None
        dim = 1 if rest == "mlp.down_proj.weight" else 0
        return name, _even(shape, dim, m.tp_size, m.tp_rank, name)
    return name, None


ShardFn = Callable[[str, tuple[int, ...]], "tuple[str, Shard | None] | str"]


def shard_fn(config: Glm5NextConfig, mapping: Mapping) -> ShardFn:
    """`param_shard` bound to one rank (what `trtllm_glm.models.checkpoint.load_state_dict` takes)."""
    check_shardable(config, mapping)
    return lambda name, shape: param_shard(name, shape, config, mapping)


def shard_state_dict(sd: dict[str, torch.Tensor], config: Glm5NextConfig, mapping: Mapping) -> dict[str, torch.Tensor]:
    """This rank's part of a full in-memory state dict (canonical names): views, no copies."""
    fn = shard_fn(config, mapping)
    out: dict[str, torch.Tensor] = {}
    for name, t in sd.items():
        got = fn(name, tuple(t.shape))
        if got == SKIP:
            continue
        assert not isinstance(got, str)
        local, shard = got
        out[local] = t if shard is None else shard.apply(t)
    return out
