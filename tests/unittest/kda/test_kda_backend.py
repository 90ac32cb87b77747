"""`KdaBackend`: the state owner's KDA planes come from the backend's declaration (shapes, dtypes, bytes per slot), and
a backend declaring one more plane gets it allocated, reset, snapshotted and counted with no other change (CPU)."""

from __future__ import annotations

from collections.abc import Mapping

import pytest
import torch

from trtllm_glm.cache.manager import Glm5NextCacheManager
from trtllm_glm.config import Glm5NextConfig
from trtllm_glm.errors import StateError
from trtllm_glm.kda import KdaBatch, KimiDeltaAttention
from trtllm_glm.kda.backend import DEFAULT_KDA_BACKEND, KdaBackend, resolve_kda_backend
from trtllm_glm.kda.ops.backend import resolve_backend
from trtllm_glm.models.glm5_next import Glm5NextDecoderLayer
from trtllm_glm.state import KdaLayerState, RequestStateOwner, SlotPlane

pytestmark = pytest.mark.cpu_only

S = 3


def _config() -> Glm5NextConfig:
    return Glm5NextConfig(hidden_size=32, kda_num_heads=2, kda_head_dim=16, kda_short_conv_kernel_size=4,
                          kda_gate_low_rank=8)  # fmt: skip


def _manager(cfg: Glm5NextConfig, **kw) -> Glm5NextCacheManager:
    return Glm5NextCacheManager(cfg, num_pages=4, tokens_per_block=8, max_num_requests=S, **kw)


@pytest.mark.parametrize("tiny", [False, True])
def test_owner_planes_come_from_the_backend(tiny: bool) -> None:
    cfg = Glm5NextConfig.from_pretrained("tiny") if tiny else _config()
    H, K, W = cfg.kda_num_heads, cfg.kda_head_dim, cfg.kda_short_conv_kernel_size
    m = _manager(cfg)
    Lk, Ls = m.num_kda_layers, m.num_sparse_layers
    assert Lk == len(cfg.kda_layer_ids) > 0 and m.kda_backend is DEFAULT_KDA_BACKEND
    specs = KdaBackend().slot_planes(cfg)
    assert m.state.slot_plane_specs == specs and tuple(m.state.planes) == KdaBackend.plane_names
    assert specs == (
        SlotPlane("kda_recurrent", (H, K, K), torch.float32),
        SlotPlane("kda_conv", (H * 3 * K, W - 1), torch.float32),
    )
    for p in specs:
        t = m.state.planes[p.name]
        assert t.shape == (Lk, S, *p.shape) and t.dtype == p.dtype
        # The public names read the same storage through the owner and the manager.
        assert getattr(m.state, p.name) is t and getattr(m, p.name) is t
        assert t[:, 0].numel() * t.element_size() == Lk * p.bytes_per_slot
    kda_bytes = 4 * (H * K * K + 3 * H * K * (W - 1))
    assert sum(p.bytes_per_slot for p in specs) == kda_bytes
    assert m.state_bytes_per_request == Ls * 2 * 4 * 128 * 4 + Lk * kda_bytes
    paged = sum(t.numel() * t.element_size() for t in m.planes.values())
    owned = sum(t.numel() * t.element_size() for t in (m.tail_ring, *m.state.planes.values()))
    kw = dict(num_pages=4, tokens_per_block=8, max_num_requests=S)
    assert Glm5NextCacheManager.estimate_bytes(cfg, **kw) == paged + owned
    # The layer view is the backend's, over the owner's planes.
    st = m.kda_layer_state(Lk - 1)
    assert isinstance(st, KdaBackend.LayerState)
    assert st.recurrent.data_ptr() == m.kda_recurrent[Lk - 1].data_ptr()
    assert st.conv.data_ptr() == m.kda_conv[Lk - 1].data_ptr()
    with pytest.raises(IndexError):
        m.kda_layer_state(Lk)


def test_backend_builds_the_layer_and_names_its_dispatch() -> None:
    cfg = _config()
    b = resolve_kda_backend(None)
    assert b is DEFAULT_KDA_BACKEND and resolve_kda_backend(b) is b
    layer = b.make_layer(cfg, 2)
    assert isinstance(layer, KimiDeltaAttention) and layer.kda_idx == 2
    assert b.ops(torch.device("cpu")).kda_prefill is not None
    assert b.backend_name(torch.device("cpu")) == resolve_backend(torch.device("cpu")) == "torch"
    # The model's KDA decoder layers take their mixer from the backend.
    dec = Glm5NextDecoderLayer(cfg, 0, "kda", 1)
    assert type(dec.self_attn) is KimiDeltaAttention and dec.self_attn.kda_idx == 1


class ToyBackend(KdaBackend):
    """KDA plus one more per-slot plane (what a new state-space mixer would declare)."""

    plane_names = (*KdaBackend.plane_names, "toy_window")

    def slot_planes(self, config: Glm5NextConfig) -> tuple[SlotPlane, ...]:
        return (*super().slot_planes(config), SlotPlane("toy_window", (5, config.kda_num_heads), torch.bfloat16))

    def layer_state(self, planes: Mapping[str, torch.Tensor], layer: int) -> KdaLayerState:
        st = super().layer_state(planes, layer)
        st.toy = planes["toy_window"][layer]  # type: ignore[attr-defined]
        return st


def test_a_declared_extra_plane_is_allocated_reset_snapshotted_and_counted() -> None:
    cfg = _config()
    kw = dict(num_pages=4, tokens_per_block=8, max_num_requests=S)
    ref = _manager(cfg)
    m = _manager(cfg, kda_backend=ToyBackend())
    Lk = m.num_kda_layers
    toy = m.state.planes["toy_window"]
    assert toy.shape == (Lk, S, 5, 2) and toy.dtype == torch.bfloat16 and m.toy_window is toy
    assert m.kda_layer_state(1).toy.data_ptr() == toy[1].data_ptr()
    extra = Lk * 5 * 2 * 2
    assert m.state_bytes_per_request == ref.state_bytes_per_request + extra
    assert Glm5NextCacheManager.estimate_bytes(cfg, **kw, kda_backend=ToyBackend()) == (
        Glm5NextCacheManager.estimate_bytes(cfg, **kw) + S * extra
    )
    # Snapshot / restore carry it byte for byte; a new request's slot starts at zero.
    slot = m.add_request(1, num_tokens=3)
    toy[:, slot].normal_()
    m.kda_recurrent[:, slot].normal_()
    before = toy[:, slot].clone()
    snap = m.state.snapshot(slot, endpoint=0)
    assert "toy_window" in snap.planes
    m.free_request(1)
    assert m.add_request(2, num_tokens=3) == slot and not toy[:, slot].any() and not m.kda_recurrent[:, slot].any()
    m.state.restore(slot, snap)
    assert torch.equal(toy[:, slot], before)
    # An owner without the plane refuses the snapshot (geometry).
    with pytest.raises(StateError, match="geometry"):
        ref.state.check_snapshot(snap)


def test_the_kda_layer_runs_the_same_over_a_toy_backends_state() -> None:
    cfg = _config()
    layer = KimiDeltaAttention(cfg, kda_idx=0)
    layer.reset_parameters(torch.Generator().manual_seed(0), std=0.2)
    x = torch.randn(5, 32, generator=torch.Generator().manual_seed(1))
    outs = []
    for m in (_manager(cfg), _manager(cfg, kda_backend=ToyBackend())):
        slot = m.add_request(7, num_tokens=5)
        outs.append((layer(x, KdaBatch.build([5], [0], [slot]), m.kda_layer_state(0)), m.kda_recurrent[0, slot]))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])


def test_plane_names_are_checked() -> None:
    f32 = torch.float32
    for planes in ([SlotPlane("a", (1,), f32), SlotPlane("a", (2,), f32)], [SlotPlane("tail_ring", (1,), f32)],
                   [SlotPlane("ring0.snapshot", (1,), f32)], [SlotPlane("reset", (1,), f32)]):  # fmt: skip
        with pytest.raises(ValueError, match="slot plane names"):
            RequestStateOwner(num_state_slots=2, num_sparse_layers=1, num_kda_layers=1, slot_planes=planes)
    own = RequestStateOwner(num_state_slots=2, num_sparse_layers=1, num_kda_layers=1)
    assert own.planes == {} and own.state_bytes_per_slot == 2 * 4 * 128 * 4
    with pytest.raises(AttributeError):
        own.kda_recurrent  # noqa: B018
