"""The fused KDA decode step (`kda.kernels.kda_decode_fused`, ``TRTLLM_GLM_KDA_FUSED_DECODE``) on CUDA at the real
GLM-5.3-Flash geometry (the 4-layer slice's KDA layers: 64 heads, K = V = 128, low rank 128, W = 4).

Needs CUDA (tests/conftest.py skips ``gpu`` tests without it). Against its torch reference (FP32 pools, bf16 rows,
slots out of order in a pool larger than the batch whose other slots hold NaN, NaN-filled output buffers), and a
`KimiDeltaAttention` layer (bf16, fused weights; float and block-FP8 low-rank weights) over several decode steps
with the switch off (the unfused path: conv kernel, low-rank GEMMs, gate kernel, fla-core's decode, gated
RMSNorm) and on; then the switched-on layer captured in a CUDA graph and replayed on fresh inputs written into
the captured buffers, against eager steps. Run with ``-s`` to see the measured differences.
"""

from __future__ import annotations

import pytest
import torch

from trtllm_glm import envs
from trtllm_glm.config import Glm5NextConfig
from trtllm_glm.kda import KdaBatch, KimiDeltaAttention
from trtllm_glm.kda import kernels as KK
from trtllm_glm.kda import layer as L
from trtllm_glm.kda.ops.decode_fused import kda_decode_fused_reference
from trtllm_glm.models.glm5_next import subset_config
from trtllm_glm.modules.linear import Fp8Linear
from trtllm_glm.state import KdaLayerState

pytestmark = pytest.mark.gpu

_REAL = subset_config(Glm5NextConfig.from_pretrained("glm-5.3-flash"), [0, 1, 2, 3])
H, K, W, R = _REAL.kda_num_heads, _REAL.kda_head_dim, _REAL.kda_short_conv_kernel_size, _REAL.kda_gate_low_rank
V = K
C = H * (2 * K + V)
DEV = "cuda"


def _report(name: str, got: torch.Tensor, ref: torch.Tensor) -> float:
    """Prints and returns max|got - ref| / max|ref| (NaN positions must agree)."""
    assert torch.equal(got.isnan(), ref.isnan()), name
    got, ref = got.float().nan_to_num(), ref.float().nan_to_num()
    err = (got - ref).abs().max().item()
    top = ref.abs().max().item()
    print(f"[kda-fused-decode-gpu] {name}: max|err| = {err:.3e} (max|ref| = {top:.3e})")
    return err / max(top, 1e-30)


def _case(seed: int, n: int, S: int):
    g = torch.Generator(device=DEV).manual_seed(seed)

    def rnd(*shape: int, s: float = 1.0) -> torch.Tensor:
        return torch.randn(*shape, generator=g, device=DEV) * s

    proj = rnd(n, C + 2 * R + H).bfloat16()
    rows = (proj[:, :C], proj[:, C : C + R], proj[:, C + R : C + R + H], proj[:, C + R + H :])
    slots = torch.randperm(S, generator=g, device=DEV)[:n]
    conv = torch.full((S, C, W - 1), float("nan"), device=DEV)
    state = torch.full((S, H, K, V), float("nan"), device=DEV)
    conv[slots] = rnd(n, C, W - 1)
    state[slots] = rnd(n, H, K, V, s=0.5)
    p = (rnd(C, W, s=W**-0.5).bfloat16(), rnd(H * K, R, s=0.1).bfloat16(),
         torch.empty(H, device=DEV).uniform_(1.0, 16.0, generator=g).log(), rnd(H * K, s=0.1),
         rnd(H * V, R, s=0.1).bfloat16(), (1.0 + rnd(V, s=0.1)).bfloat16())  # fmt: skip
    return rows, conv, state, slots, p


@pytest.mark.parametrize("n", [1, 16, 64])
def test_kernel_matches_reference_at_real_geometry(n: int) -> None:
    rows, conv, state, slots, (cw, fb, A_log, dt_bias, gb, nw) = _case(n, n, S=n + 7)
    conv_ref, state_ref = conv.clone(), state.clone()
    args = (cw, slots, fb, A_log, dt_bias, -5.0)
    tail = (gb, nw, 1e-5, K**-0.5, torch.bfloat16)
    y_ref, o_ref = kda_decode_fused_reference(*rows, conv_ref, *args, state_ref, *tail)
    out = (torch.full((n, H * V), float("nan"), dtype=torch.bfloat16, device=DEV),
           torch.full((n, H, V), float("nan"), device=DEV))  # fmt: skip
    y, o = KK.kda_decode_fused(*rows, conv, *args, state, *tail, out=out)
    assert _report("o", o, o_ref) < 1e-5
    assert _report("y (bf16)", y, y_ref) < 1e-2
    assert _report("recurrent state", state, state_ref) < 1e-5
    torch.testing.assert_close(conv, conv_ref, equal_nan=True, atol=0, rtol=0)


def _layer(fp8: bool, dtype: torch.dtype = torch.bfloat16) -> KimiDeltaAttention:
    layer = KimiDeltaAttention(_REAL, kda_idx=0, device=DEV, dtype=dtype)
    layer.reset_parameters(torch.Generator().manual_seed(0), std=0.02)
    layer.A_log.data, layer.dt_bias.data = layer.A_log.data.float(), layer.dt_bias.data.float()
    if fp8:
        layer.f_b_proj = Fp8Linear.from_linear(layer.f_b_proj)
        layer.g_b_proj = Fp8Linear.from_linear(layer.g_b_proj)
    layer.fuse_weights()
    return layer.eval()


def _state(layer: KimiDeltaAttention, S: int, live: list[int]) -> KdaLayerState:
    g = torch.Generator(device=DEV).manual_seed(5)
    st = KdaLayerState(recurrent=torch.full((S, H, K, V), float("nan"), device=DEV),
                       conv=torch.full((S, C, W - 1), float("nan"), device=DEV))  # fmt: skip
    st.recurrent[live] = torch.randn(len(live), H, K, V, generator=g, device=DEV) * 0.5
    st.conv[live] = torch.randn(len(live), C, W - 1, generator=g, device=DEV)
    return st


@pytest.mark.parametrize(("dtype", "fp8"), [(torch.bfloat16, False), (torch.bfloat16, True), (torch.float32, False)])
@pytest.mark.parametrize("n", [1, 16])
def test_layer_switch_off_and_on_agree(monkeypatch: pytest.MonkeyPatch, n: int, dtype: torch.dtype, fp8: bool) -> None:
    layer = _layer(fp8, dtype)
    S = 2 * n + 3
    slots = list(range(S - 1, 0, -2))[:n]  # reversed, with gaps
    gen = torch.Generator(device=DEV).manual_seed(9)
    hiddens = [torch.randn(n, _REAL.hidden_size, generator=gen, device=DEV).to(dtype) for _ in range(4)]
    calls = {"fused": 0}
    real = L.kda_decode_fused

    def counting(*a, **k):
        calls["fused"] += 1
        return real(*a, **k)

    monkeypatch.setattr(L, "kda_decode_fused", counting)
    runs = {}
    for setting in ("0", "1"):
        monkeypatch.setenv(envs.KDA_FUSED_DECODE.name, setting)
        st = _state(layer, S, slots)
        outs = [layer(h, KdaBatch.build([1] * n, [5 + t] * n, slots, DEV), st) for t, h in enumerate(hiddens)]
        runs[setting] = (outs, st)
    assert calls["fused"] == len(hiddens)
    (o0, s0), (o1, s1) = runs["0"], runs["1"]
    # A bf16 model's unfused path rounds the low-rank gate products to bf16 (the fused one keeps them in FP32); an
    # FP32 model's differs by rounding only (fla's decode kernel against the fused step, the GEMMs' sum orders).
    tol = 5e-2 if dtype == torch.bfloat16 else 1e-3
    for t, (a, b) in enumerate(zip(o0, o1)):
        assert _report(f"layer out step {t}", b, a) < tol
    assert _report("recurrent state", s1.recurrent, s0.recurrent) < tol
    torch.testing.assert_close(s1.conv, s0.conv, equal_nan=True, atol=0, rtol=0)


def test_fused_layer_replays_in_a_cuda_graph(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(envs.KDA_FUSED_DECODE.name, "1")
    layer = _layer(False)
    n, S = 8, 12
    slots = [11, 0, 7, 3, 9, 1, 5, 2]
    batch = KdaBatch.build([1] * n, [4] * n, slots, DEV)  # slots on the device: no copy in the graph
    hidden = torch.randn(n, _REAL.hidden_size, device=DEV).bfloat16()
    st = _state(layer, S, slots)
    eager_st = _state(layer, S, slots)
    layer(hidden, batch, _state(layer, S, slots))  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = layer(hidden, batch, st)
    # The capture ran nothing: the state is still the initial one.
    torch.testing.assert_close(st.recurrent, eager_st.recurrent, equal_nan=True, atol=0, rtol=0)
    for seed in (1, 2, 3):
        hidden.copy_(torch.randn(n, _REAL.hidden_size, generator=torch.Generator(device=DEV).manual_seed(seed),
                                 device=DEV).bfloat16())  # fmt: skip
        graph.replay()
        want = layer(hidden, batch, eager_st)
        torch.cuda.synchronize()
        torch.testing.assert_close(out, want, atol=0, rtol=0)
        torch.testing.assert_close(st.recurrent, eager_st.recurrent, equal_nan=True, atol=0, rtol=0)
        torch.testing.assert_close(st.conv, eager_st.conv, equal_nan=True, atol=0, rtol=0)
