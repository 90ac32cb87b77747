"""The fused KDA decode conv kernel on CUDA at real GLM-5.3-Flash geometry (64 heads, K = V = 128, W = 4).

Needs CUDA (tests/conftest.py skips ``gpu`` tests without it). Against the torch reference on the same inputs:
FP32 and bf16 state pools (the bf16 window store rounds as ``.to(bfloat16)`` does: bitwise equal), slots out
of order in a pool larger than the batch whose other slots hold NaN, and a CUDA-graph capture replayed on
fresh inputs written into the captured buffers.
"""

from __future__ import annotations

import pytest
import torch

from trtllm_glm.config import Glm5NextConfig
from trtllm_glm.kda import kernels as KK
from trtllm_glm.kda.ops import conv_decode_reference

pytestmark = pytest.mark.gpu

_REAL = Glm5NextConfig.from_pretrained("glm-5.3-flash")
H, K, V, W = _REAL.kda_num_heads, _REAL.kda_head_dim, _REAL.kda_head_dim, _REAL.kda_short_conv_kernel_size
C = H * (2 * K + V)


def _case(seed: int, n: int, dtype: torch.dtype, S: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = (torch.randn(n, C, generator=g, device="cuda") * 2).to(torch.bfloat16).float()
    state = torch.full((S, C, W - 1), float("nan"), dtype=dtype, device="cuda")
    slots = torch.randperm(S, generator=g, device="cuda")[:n]
    state[slots] = (torch.randn(n, C, W - 1, generator=g, device="cuda") * 2).to(dtype)
    weight = torch.randn(C, W, generator=g, device="cuda") / W**0.5
    return x, state, weight, slots


@pytest.mark.parametrize("n", [1, 16, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_conv_decode_matches_reference_at_real_geometry(n, dtype) -> None:
    x, state, weight, slots = _case(n, n, dtype, S=n + 7)
    ref_state = state.clone()
    want = conv_decode_reference(x, ref_state, weight, slots, H, K, V)
    got = KK.conv_decode(x, state, weight, slots, H, K, V, 1e-6)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert torch.equal(state.isnan(), ref_state.isnan())
    torch.testing.assert_close(state, ref_state, equal_nan=True, atol=0, rtol=0)


def test_conv_decode_replays_in_a_cuda_graph() -> None:
    n = 16
    x, state, weight, slots = _case(3, n, torch.float32, S=40)
    KK.conv_decode(x, state.clone(), weight, slots, H, K, V, 1e-6)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = KK.conv_decode(x, state, weight, slots, H, K, V, 1e-6)
    for seed in (11, 12):
        x2, st2, _, sl2 = _case(seed, n, torch.float32, S=40)
        x.copy_(x2)
        state.copy_(st2)
        slots.copy_(sl2)
        ref_state = st2.clone()
        want = conv_decode_reference(x2, ref_state, weight, sl2, H, K, V)
        graph.replay()
        for a, b in zip(out, want):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(state, ref_state, equal_nan=True, atol=0, rtol=0)


@pytest.mark.parametrize("n", [1, 16, 64, 2048])
def test_gate_kernel_at_real_sizes(n: int) -> None:
    """`kda_gate_beta` (H = 64, K = 128) on bf16 logits against the FP32 reference, from strided views."""
    from trtllm_glm.kda.ops import kda_gate_beta, kda_gate_beta_reference

    H, K = 64, 128
    gen = torch.Generator(device="cuda").manual_seed(n)
    out = (torch.randn(n, H * K + H + 7, device="cuda", generator=gen) * 4).to(torch.bfloat16)
    g_raw, b = out[:, : H * K], out[:, H * K : H * K + H]
    A_log = torch.randn(H, device="cuda", generator=gen)
    dt_bias = torch.randn(H * K, device="cuda", generator=gen)
    g, beta = kda_gate_beta(g_raw, b, A_log, dt_bias, -5.0, backend="triton")
    rg, rbeta = kda_gate_beta_reference(g_raw, b, A_log, dt_bias, -5.0)
    torch.testing.assert_close(g, rg, rtol=2e-6, atol=2e-6)
    torch.testing.assert_close(beta, rbeta, rtol=2e-6, atol=2e-6)
