"""Builders shared by the KDA layer tests: a tiny `KimiDeltaAttention`, random state planes, and an op recorder for the
ops the layer's own code (``kda/layer.py``) issues."""

from __future__ import annotations

import traceback

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from trtllm_glm.config import Glm5NextConfig
from trtllm_glm.kda import KimiDeltaAttention
from trtllm_glm.state import KdaLayerState

__all__ = ["LayerOps", "random_kda_state", "tiny_kda_layer"]


def tiny_kda_layer(seed: int) -> KimiDeltaAttention:
    """A KDA layer of hidden 32, 2 heads of 16, low rank 8, its weights drawn from ``seed`` (std 0.2)."""
    cfg = Glm5NextConfig(hidden_size=32, kda_num_heads=2, kda_head_dim=16, kda_gate_low_rank=8)
    layer = KimiDeltaAttention(cfg, kda_idx=0)
    layer.reset_parameters(torch.Generator().manual_seed(seed), std=0.2)
    return layer


def random_kda_state(layer: KimiDeltaAttention, num_slots: int, seed: int, scale: float) -> KdaLayerState:
    """State planes of ``num_slots`` slots, random (never zeros: a layer must not rely on zeroed slots):
    ``recurrent [S, H, K, V]`` normal times ``scale``, ``conv [S, conv_dim, W - 1]`` standard normal."""
    gen = torch.Generator().manual_seed(seed)
    H, K, V, W = layer.num_heads, layer.head_k_dim, layer.head_v_dim, layer.conv_size
    return KdaLayerState(
        recurrent=torch.randn(num_slots, H, K, V, generator=gen) * scale,
        conv=torch.randn(num_slots, layer.conv_dim, W - 1, generator=gen),
    )


class LayerOps(TorchDispatchMode):
    """Aten ops issued inside ``with``, each as ``(op name, caller)``: ``caller`` is the function of ``kda/layer.py``
    that issued it (the innermost frame outside torch), ``None`` for ops issued elsewhere (the ops modules)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[str, str | None]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        frames = [f for f in traceback.extract_stack()[:-1] if "/torch/" not in f.filename]
        caller = frames[-1] if frames else None
        where = caller.name if caller is not None and caller.filename.endswith("kda/layer.py") else None
        self.ops.append((func.overloadpacket.__name__, where))
        return func(*args, **(kwargs or {}))

    def own(self) -> list[str]:
        """Names of the ops the layer's own code issued."""
        return [op for op, where in self.ops if where is not None]
