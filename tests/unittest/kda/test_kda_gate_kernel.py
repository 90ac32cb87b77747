"""The KDA gate kernel (`trtllm_glm.kda.kernels.kda_gate_beta`, Triton's interpreter on the CPU) against its
torch reference (`kda_gate_beta_reference`: ``kda_gate`` and ``sigmoid(b)``), and the layer's dispatch.

Inputs are fresh random logits spread well past the sigmoids' linear range, in FP32 and FP16 (the
interpreter's bf16 arithmetic is wrong), including strided row views as the fused input GEMM produces.
"""

from __future__ import annotations

import pytest
import torch

from trtllm_glm.kda.ops import kda_gate_beta, kda_gate_beta_reference
from trtllm_glm.kda.ops.gate import GATE_BACKEND_ENV


def _inputs(N: int, H: int, K: int, dtype: torch.dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    g_raw = (torch.randn(N, H * K, generator=g) * 4).to(dtype)
    b = (torch.randn(N, H, generator=g) * 4).to(dtype)
    A_log = torch.randn(H, generator=g)
    dt_bias = torch.randn(H * K, generator=g)
    return g_raw, b, A_log, dt_bias


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("N,H,K", [(1, 4, 16), (5, 6, 20), (3, 64, 8)])
def test_kernel_matches_reference(N: int, H: int, K: int, dtype: torch.dtype) -> None:
    g_raw, b, A_log, dt_bias = _inputs(N, H, K, dtype, seed=N * H + K)
    g, beta = kda_gate_beta(g_raw, b, A_log, dt_bias, -5.0, backend="triton")
    rg, rbeta = kda_gate_beta_reference(g_raw, b, A_log, dt_bias, -5.0)
    assert g.dtype == beta.dtype == torch.float32
    assert g.shape == (N, H, K) and beta.shape == (N, H)
    torch.testing.assert_close(g, rg, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(beta, rbeta, rtol=1e-5, atol=1e-6)
    assert (g <= 0).all() and (g >= -5.0).all()


def test_strided_views_of_one_projection() -> None:
    # The fused input GEMM's output split into columns: row stride wider than each part.
    N, H, K = 4, 6, 16
    out = torch.randn(N, 3 * H * K + H, generator=torch.Generator().manual_seed(3)) * 3
    g_raw, b = out[:, H * K : 2 * H * K], out[:, 3 * H * K :]
    A_log, dt_bias = torch.randn(H), torch.randn(H * K)
    got = kda_gate_beta(g_raw, b, A_log, dt_bias, -3.0, backend="triton")
    ref = kda_gate_beta_reference(g_raw, b, A_log, dt_bias, -3.0)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)


def test_env_and_kda_switch_select_the_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    from trtllm_glm.kda import kernels

    calls = []
    real = kernels.kda_gate_beta
    monkeypatch.setattr(kernels, "kda_gate_beta", lambda *a, **k: calls.append(1) or real(*a, **k))
    args = _inputs(2, 4, 8, torch.float32, seed=0)
    monkeypatch.setenv(GATE_BACKEND_ENV, "triton")
    kda_gate_beta(*args, -5.0)
    assert calls == [1]
    monkeypatch.setenv("TRTLLM_GLM_KDA_BACKEND", "torch")
    kda_gate_beta(*args, -5.0)
    assert calls == [1]
    monkeypatch.delenv("TRTLLM_GLM_KDA_BACKEND")
    monkeypatch.setenv(GATE_BACKEND_ENV, "torch")
    kda_gate_beta(*args, -5.0)
    assert calls == [1]


def test_bad_shapes_are_refused() -> None:
    g_raw, b, A_log, dt_bias = _inputs(2, 4, 8, torch.float32, seed=0)
    with pytest.raises(ValueError, match="g_raw"):
        kda_gate_beta(g_raw[:, :-1], b, A_log, dt_bias, -5.0)
    with pytest.raises(ValueError, match="A_log"):
        kda_gate_beta(g_raw, b, A_log[:3], dt_bias, -5.0)
    with pytest.raises(ValueError, match="g_raw"):
        kda_gate_beta(g_raw, b[:1], A_log, dt_bias, -5.0)


def test_kernel_compiles_for_sm90() -> None:
    """The compiled path (Triton's interpreter does not compile)."""
    from tests.triton_compile import KernelSpec, compile_sm90

    sig = dict(g_raw_ptr="*bf16", b_ptr="*bf16", a_log_ptr="*fp32", dt_bias_ptr="*fp32", g_ptr="*fp32",
               beta_ptr="*fp32", stride_gn="i32", stride_bn="i32", lower_bound="fp32")  # fmt: skip
    const = {"H": 64, "K": 128, "BLOCK": 1024, "H_PAD": 64, "PDL": False, "PDL_LATE": False}
    results = compile_sm90([KernelSpec("trtllm_glm.kda.kernels.gate", "_gate_beta_kernel", sig, const)])
    assert all(r["ok"] for r in results), results
