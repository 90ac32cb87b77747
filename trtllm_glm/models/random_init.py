"""Seeded random fill of one parameter at a time, on the parameter's own device (no whole-model draw).

`Glm5NextForCausalLM.from_config(..., local_init=True)` builds a rank's share on the meta device, materialises
it with ``to_empty`` and fills each parameter here: the draws are made on the target device from a generator
seeded by ``(seed, key)``, where ``key`` names the tensor in the whole model (so a replicated tensor is the same
on every rank and a cut one differs by its cut). The scales are the model's own `reset_parameters` ones, so the
model is as well-conditioned as the whole-model draw; the values differ from it (other generators, other order).
"""

from __future__ import annotations

import hashlib
import math

import torch

__all__ = ["draw", "fill_random_", "init_kind", "key_seed"]


def key_seed(seed: int, key: str) -> int:
    """A 63-bit generator seed from the run's ``seed`` and a tensor's ``key`` (stable across processes)."""
    h = hashlib.blake2b(f"{seed}:{key}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") & ((1 << 63) - 1)


def init_kind(name: str) -> tuple[str, float]:
    """How `Glm5NextForCausalLM.reset_parameters` draws the parameter ``name`` (a model parameter name):
    ``("const", c)``, ``("normal", s)`` (scaled by ``std`` when ``s`` is negative: ``N(0, -s * std)``),
    ``("scale", s)`` (``1 + N(0, s)``), ``("log_uniform", 0)`` (``log U(1, 16)``) or ``("conv", 0)``
    (``N(0, 1 / sqrt(W))``)."""
    leaf = name.rsplit(".", 1)[-1]
    if name.endswith("norm.weight") or ".norm." in name:
        return "const", 1.0
    if name.endswith("norm.bias") or (leaf == "bias" and "norm" in name):
        return "const", 0.0
    if name.endswith("embed_tokens.weight") or leaf == "index_kpool_compress_ape":
        return "normal", 1.0
    if leaf == "A_log":
        return "log_uniform", 0.0
    if leaf == "dt_bias":
        return "normal", 0.1
    if leaf.startswith("hc_") and leaf.endswith("_base"):
        return "normal", 0.5
    if leaf.startswith("hc_") and leaf.endswith("_scale"):
        return "scale", 0.25
    if name.endswith("conv1d.weight"):
        return "conv", 0.0
    if leaf == "bias":  # a linear's bias (none in this model; zero as `init_linear_` makes it)
        return "const", 0.0
    return "normal", -1.0  # linears, router weight and bias, hc_*_fn, the indexer's pooling gate


@torch.no_grad()
def fill_random_(p: torch.Tensor, name: str, key: str, *, seed: int, std: float, conv_size: int) -> torch.Tensor:
    """Fill ``p`` in place per `init_kind` (``name``) from a generator on ``p``'s device seeded by ``key``.

    Draws straight into ``p`` in its dtype (no fp32 copy: the embedding and LM head of the real model are 1.2 GiB
    each in bf16). For a block-FP8 linear, `draw` its weight in fp32 and quantise it (``Fp8Linear.set_weight_``).

    Returns:
        ``p``.
    """
    if p.dtype == torch.float8_e4m3fn:
        raise ValueError(f"{name}: draw FP8 weights with `draw` and quantise them (Fp8Linear.set_weight_)")
    return _draw_into(p, name, key, seed=seed, std=std, conv_size=conv_size)


def draw(
    shape: tuple[int, ...], device: torch.device, name: str, key: str, *, seed: int, std: float, conv_size: int
) -> torch.Tensor:
    """A new fp32 ``shape`` tensor on ``device`` drawn as `init_kind` (``name``) says, seeded by ``key``."""
    t = torch.empty(shape, dtype=torch.float32, device=device)
    return _draw_into(t, name, key, seed=seed, std=std, conv_size=conv_size)


def _draw_into(t: torch.Tensor, name: str, key: str, *, seed: int, std: float, conv_size: int) -> torch.Tensor:
    kind, s = init_kind(name)
    if kind == "const":
        return t.fill_(s)
    g = torch.Generator(device=t.device).manual_seed(key_seed(seed, key))
    if kind == "log_uniform":
        return t.uniform_(1.0, 16.0, generator=g).log_()
    if kind == "conv":
        return t.normal_(0.0, 1.0 / math.sqrt(conv_size), generator=g)
    if kind == "scale":
        return t.normal_(0.0, s, generator=g).add_(1.0)
    return t.normal_(0.0, -s * std if s < 0 else s, generator=g)
