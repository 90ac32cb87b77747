"""The fused KDA decode conv kernel (`kda.kernels.conv_decode`) against its torch reference, on the CPU
interpreter (`trtllm_glm.kda.kernels` runs CPU tensors through an interpreted copy by itself).

Adversarial geometry: slots that are neither the row index nor contiguous, a pool larger than the batch
whose other slots hold NaN (they must stay untouched and never leak in), non-power-of-two head dims (masked
lanes), ``K != V``, rows taken from a wider tensor (a row stride other than ``C``) and fresh random values.
Outputs of the kernel are fresh allocations; the state pool is the in-place output, compared whole.
"""

from __future__ import annotations

import pytest
import torch

from trtllm_glm.kda import kernels as KK
from trtllm_glm.kda.ops import conv_decode, conv_decode_reference

pytest.importorskip("triton")

pytestmark = [
    pytest.mark.cpu_only,
    pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0 to a scalar:DeprecationWarning"),
]


def _case(seed: int, n: int, H: int, K: int, V: int, W: int, S: int, dtype: torch.dtype = torch.float32):
    g = torch.Generator().manual_seed(seed)
    C = H * (2 * K + V)
    wide = torch.randn(n, C + 5, generator=g) * 2
    x = wide[:, 3 : 3 + C]  # a row stride of C + 5
    state = torch.full((S, C, W - 1), float("nan"), dtype=dtype)
    slots = torch.randperm(S, generator=g)[:n]
    state[slots] = (torch.randn(n, C, W - 1, generator=g) * 2).to(dtype)
    weight = torch.randn(C, W, generator=g) / W**0.5
    return x, state, weight, slots


@pytest.mark.parametrize(
    ("n", "H", "K", "V", "W"), [(1, 2, 8, 8, 4), (5, 3, 6, 10, 4), (7, 2, 16, 12, 2), (3, 1, 5, 7, 3)]
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_conv_decode_kernel_matches_reference(n, H, K, V, W, dtype) -> None:
    x, state, weight, slots = _case(n * 100 + H * 10 + K, n, H, K, V, W, S=n + 4, dtype=dtype)
    ref_state = state.clone()
    q0, k0, v0 = conv_decode_reference(x, ref_state, weight, slots, H, K, V)
    q1, k1, v1 = KK.conv_decode(x, state, weight, slots, H, K, V, 1e-6)
    tol = {"atol": 2e-6, "rtol": 2e-6}
    torch.testing.assert_close(q1, q0, **tol)
    torch.testing.assert_close(k1, k0, **tol)
    torch.testing.assert_close(v1, v0, **tol)
    # Every slot: the batch's shifted windows (the new input last, in the state's dtype), the rest NaN untouched.
    torch.testing.assert_close(state, ref_state, equal_nan=True, atol=0, rtol=0)
    others = torch.ones(state.shape[0], dtype=torch.bool)
    others[slots] = False
    assert state[others].isnan().all()
    assert not state[slots].isnan().any()
    # q and k heads are unit vectors (up to eps).
    assert torch.allclose(q1.norm(dim=-1), torch.ones(n, H), atol=1e-4)


def test_conv_decode_dispatch_and_checks(monkeypatch) -> None:
    x, state, weight, slots = _case(1, 4, 2, 8, 8, 4, S=9)
    ref_state = state.clone()
    want = conv_decode_reference(x, ref_state, weight, slots, 2, 8, 8)
    monkeypatch.setenv("TRTLLM_GLM_KDA_CONV_BACKEND", "triton")
    got = conv_decode(x, state, weight, slots, 2, 8, 8)  # the interpreted kernel through the dispatch
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=2e-6, rtol=2e-6)
    with pytest.raises(ValueError, match="do not fit"):
        KK.conv_decode(x, state, weight, slots, 2, 8, 9, 1e-6)
    with pytest.raises(ValueError, match="unit last stride"):
        KK.conv_decode(x, state.transpose(1, 2).contiguous().transpose(1, 2), weight, slots, 2, 8, 8, 1e-6)
    monkeypatch.setenv("TRTLLM_GLM_KDA_CONV_BACKEND", "bogus")
    with pytest.raises(ValueError, match="backend must be one of"):
        conv_decode(x, state, weight, slots, 2, 8, 8)


def test_layer_decode_with_the_kernel_matches_the_reference(monkeypatch) -> None:
    """The KDA layer's decode rows (mixed with a prefill chunk, slots out of order) give the same outputs and
    state with the conv kernel as with the reference; slots outside the batch are left alone."""
    from trtllm_glm.config import Glm5NextConfig
    from trtllm_glm.kda import KdaBatch, KimiDeltaAttention
    from trtllm_glm.state import KdaLayerState

    cfg = Glm5NextConfig(hidden_size=32, kda_num_heads=2, kda_head_dim=16, kda_short_conv_kernel_size=4,
                         kda_gate_low_rank=8)  # fmt: skip
    layer = KimiDeltaAttention(cfg, kda_idx=0)
    layer.reset_parameters(torch.Generator().manual_seed(7), std=0.2)
    g = torch.Generator().manual_seed(8)
    H, K, V, W = layer.num_heads, layer.head_k_dim, layer.head_v_dim, layer.conv_size
    st = KdaLayerState(recurrent=torch.randn(9, H, K, V, generator=g), conv=torch.randn(9, layer.conv_dim, W - 1,
                                                                                        generator=g))  # fmt: skip
    hidden = torch.randn(6, 32, generator=g)
    batch = KdaBatch.build([1, 1, 1, 3], [5, 2, 9, 4], [7, 0, 4, 2])  # three decode rows, then a chunk
    outs, states = [], []
    for backend in ("torch", "triton"):
        monkeypatch.setenv("TRTLLM_GLM_KDA_CONV_BACKEND", backend)
        s = KdaLayerState(recurrent=st.recurrent.clone(), conv=st.conv.clone())
        outs.append(layer(hidden, batch, s))
        states.append(s)
    torch.testing.assert_close(outs[1], outs[0], atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(states[1].conv, states[0].conv, atol=0, rtol=0)
    torch.testing.assert_close(states[1].recurrent, states[0].recurrent, atol=2e-5, rtol=1e-4)
    untouched = [1, 3, 5, 6, 8]
    assert torch.equal(states[1].conv[untouched], st.conv[untouched])
    assert torch.equal(states[1].recurrent[untouched], st.recurrent[untouched])
