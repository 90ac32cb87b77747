"""`KdaBackend`: the KDA mixer's backend, the per-slot counterpart of the attention backends
(`attention.interface.AttentionBackend`). It owns its **slot planes** (`slot_planes`: what the state owner allocates
per layer and state slot), its **layer-state view** (`layer_state`: `KdaLayerState` of one layer), its layer
(`make_layer`) and its **dispatch** (`ops`, `backend_name`). The cache manager and the model ask it
(`resolve_kda_backend`) instead of spelling the planes out (docs/architecture.md, "Attention backends").
"""

from __future__ import annotations

from collections.abc import Mapping
from types import ModuleType
from typing import ClassVar

import torch
from torch import nn

from ..config import Glm5NextConfig
from ..state import KdaLayerState, SlotPlane
from . import ops as _ops
from .layer import KimiDeltaAttention
from .static_layout import StaticKdaStep

__all__ = ["DEFAULT_KDA_BACKEND", "KdaBackend", "StaticKdaStep", "resolve_kda_backend"]


class KdaBackend:
    """KDA's per-slot state, layer and dispatch (implements `state.SlotStateBackend`).

    Attributes:
        name: the backend's name.
        LayerState: the view class `layer_state` returns.
        plane_names: the slot planes it declares (``owner.planes[name]``, also ``manager.<name>``).
    """

    name: ClassVar[str] = "kda"
    LayerState: ClassVar[type[KdaLayerState]] = KdaLayerState
    plane_names: ClassVar[tuple[str, ...]] = ("kda_recurrent", "kda_conv")

    def slot_planes(self, config: Glm5NextConfig) -> tuple[SlotPlane, ...]:
        """A KDA layer's planes per state slot: ``kda_recurrent [H, K, V]`` fp32 delta-rule state and ``kda_conv
        [H*(2K+V), W-1]`` fp32 short-conv window (channels ``q | k | v``); ``V = K``, ``W`` the conv kernel."""
        H, K, W = config.kda_num_heads, config.kda_head_dim, config.kda_short_conv_kernel_size
        V, f32 = K, torch.float32
        return (SlotPlane("kda_recurrent", (H, K, V), f32), SlotPlane("kda_conv", (H * (2 * K + V), W - 1), f32))

    def layer_state(self, planes: Mapping[str, torch.Tensor], layer: int) -> KdaLayerState:
        """Views of KDA layer ``layer``'s planes: ``recurrent [S, H, K, V]``, ``conv [S, C, W-1]``."""
        return KdaLayerState(recurrent=planes["kda_recurrent"][layer], conv=planes["kda_conv"][layer])

    def make_layer(self, config: Glm5NextConfig, kda_idx: int) -> nn.Module:
        """The mixer of the ``kda_idx``-th KDA layer (`KimiDeltaAttention`), called as ``layer(x [N, D], batch,
        layer_state) -> [N, D]``."""
        return KimiDeltaAttention(config, kda_idx)

    def ops(self, device: torch.device) -> ModuleType:
        """The module implementing the KDA ops (`kda.ops`: each op picks fla-core, Triton or the torch reference for
        its tensors' device and the KDA settings, docs/settings.md)."""
        return _ops

    def backend_name(self, device: torch.device) -> str:
        """The prefill / decode recurrence's backend on ``device``: ``"fla"`` or ``"torch"`` (`ops.resolve_backend`)."""
        return _ops.resolve_backend(device)


DEFAULT_KDA_BACKEND = KdaBackend()


def resolve_kda_backend(backend: KdaBackend | None) -> KdaBackend:
    """``backend``, or the default `KdaBackend` for None."""
    return DEFAULT_KDA_BACKEND if backend is None else backend
