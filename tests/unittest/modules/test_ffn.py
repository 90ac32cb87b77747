"""GatedMLP / MoE / make_ffn against explicit per-token references; GatedMLP's fused gate|up weights."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import trtllm_glm.act as act
import trtllm_glm.modules.ffn as ffn
from trtllm_glm.act import SWIGLU_BACKEND_ENV
from trtllm_glm.config import Glm5NextConfig
from trtllm_glm.modules.ffn import GatedMLP, MoE, make_ffn

pytestmark = pytest.mark.cpu_only


def _cfg(**kw) -> Glm5NextConfig:
    base = Glm5NextConfig.from_pretrained("tiny")
    d = base.text_dict()
    if "first_k_dense_replace" in kw:
        d.pop("mlp_layer_types")
    d.update(
        hidden_size=32,
        moe_intermediate_size=16,
        intermediate_size=48,
        n_routed_experts=6,
        num_experts_per_tok=3,
        n_shared_experts=1,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
    )
    d.update(kw)
    return Glm5NextConfig.from_dict(d)


def _moe(cfg: Glm5NextConfig, seed: int = 0) -> MoE:
    m = MoE(cfg)
    m.reset_parameters(torch.Generator().manual_seed(seed), 0.2)
    return m


def _mlp_ref(mlp: GatedMLP, x: torch.Tensor) -> torch.Tensor:
    g = x @ mlp.gate_proj.weight.T
    u = x @ mlp.up_proj.weight.T
    return (g * torch.sigmoid(g) * u) @ mlp.down_proj.weight.T


def _moe_ref(m: MoE, x: torch.Tensor, cfg: Glm5NextConfig) -> torch.Tensor:
    """Per-token loop: sigmoid scores, biased pick (ties to lower id), unbiased weights."""
    out = torch.zeros_like(x)
    w = m.gate.weight
    b = m.gate.e_score_correction_bias
    for t in range(x.shape[0]):
        s = torch.sigmoid(w @ x[t])
        chosen = sorted(range(cfg.n_routed_experts), key=lambda e: (-(s[e] + b[e]).item(), e))[
            : cfg.num_experts_per_tok
        ]
        ws = torch.stack([s[e] for e in chosen])
        if cfg.norm_topk_prob:
            ws = ws / ws.sum()
        ws = ws * cfg.routed_scaling_factor
        for e, we in zip(chosen, ws):
            out[t] += we * _mlp_ref(m.experts[e], x[t : t + 1])[0]
        if m.shared_experts is not None:
            out[t] += _mlp_ref(m.shared_experts, x[t : t + 1])[0]
    return out


def test_gated_mlp_names_and_math() -> None:
    torch.manual_seed(1)
    mlp = GatedMLP(24, 40)
    mlp.reset_parameters(torch.Generator().manual_seed(3), 0.1)
    assert set(mlp.state_dict()) == {"gate_proj.weight", "up_proj.weight", "down_proj.weight"}
    assert mlp.gate_proj.weight.shape == (40, 24) and mlp.down_proj.weight.shape == (24, 40)
    x = torch.randn(5, 24)
    torch.testing.assert_close(mlp(x), _mlp_ref(mlp, x), rtol=1e-5, atol=1e-6)
    # Seeded init is reproducible and not degenerate.
    mlp2 = GatedMLP(24, 40)
    mlp2.reset_parameters(torch.Generator().manual_seed(3), 0.1)
    assert torch.equal(mlp.up_proj.weight, mlp2.up_proj.weight)
    assert not torch.equal(mlp.gate_proj.weight, mlp.up_proj.weight)


@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("shared", [0, 2])
def test_moe_matches_per_token_reference(norm: bool, shared: int) -> None:
    cfg = _cfg(norm_topk_prob=norm, n_shared_experts=shared)
    m = _moe(cfg, seed=7)
    with torch.no_grad():
        m.gate.e_score_correction_bias.copy_(
            torch.randn(cfg.n_routed_experts, generator=torch.Generator().manual_seed(5))
        )
    assert (m.shared_experts is None) == (shared == 0)
    if shared:
        assert m.shared_experts.intermediate_size == cfg.moe_intermediate_size * shared
    x = torch.randn(11, cfg.hidden_size, generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        y = m(x)
        ref = _moe_ref(m, x, cfg)
    assert y.shape == x.shape
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)
    # Leading dims are flattened and restored.
    with torch.no_grad():
        torch.testing.assert_close(m(x.reshape(1, 11, -1)), y.reshape(1, 11, -1))


def test_moe_state_dict_names() -> None:
    cfg = _cfg()
    keys = set(MoE(cfg).state_dict())
    assert {"gate.weight", "gate.e_score_correction_bias"} <= keys
    for e in range(cfg.n_routed_experts):
        for p in ("gate_proj", "up_proj", "down_proj"):
            assert f"experts.{e}.{p}.weight" in keys
    assert {
        "shared_experts.gate_proj.weight",
        "shared_experts.up_proj.weight",
        "shared_experts.down_proj.weight",
    } <= keys
    assert MoE(cfg).gate.weight.shape == (cfg.n_routed_experts, cfg.hidden_size)


def test_bias_selects_but_does_not_weight() -> None:
    cfg = _cfg(norm_topk_prob=False, routed_scaling_factor=1.5)
    m = _moe(cfg, seed=2)
    x = torch.randn(8, cfg.hidden_size, generator=torch.Generator().manual_seed(4))
    scores = torch.sigmoid(x @ m.gate.weight.detach().T)
    with torch.no_grad():
        m.gate.e_score_correction_bias.zero_()
        m.gate.e_score_correction_bias[4] = 10.0  # forces expert 4 into every token's top-k
        ids, w = m.gate(x)
    assert (ids == 4).any(dim=1).all()
    assert (ids[:, 0] == 4).all()
    # Weights are the un-biased sigmoid scores times the scaling factor.
    torch.testing.assert_close(w, scores.gather(1, ids) * 1.5)
    assert (w[:, 0] < 1.5).all()  # a biased weight would be > 10
    # Without the bias, expert 4 is not always chosen (so the test above really depended on it).
    with torch.no_grad():
        m.gate.e_score_correction_bias.zero_()
        ids0, _ = m.gate(x)
    assert not (ids0 == 4).any(dim=1).all()


def test_norm_topk_weights_sum_to_scaling_factor() -> None:
    cfg = _cfg(routed_scaling_factor=2.5)
    m = _moe(cfg, seed=3)
    x = torch.randn(10, cfg.hidden_size, generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        _, w = m.gate(x)
    torch.testing.assert_close(w.sum(-1), torch.full((10,), 2.5))


def test_ties_resolved_to_lower_expert_id() -> None:
    cfg = _cfg(n_routed_experts=6, num_experts_per_tok=2)
    m = _moe(cfg, seed=1)
    with torch.no_grad():
        # Identical router rows give identical scores for experts 1, 3, 5; bias lifts them above the rest.
        row = torch.randn(cfg.hidden_size, generator=torch.Generator().manual_seed(6))
        for e in (1, 3, 5):
            m.gate.weight[e] = row
        m.gate.e_score_correction_bias.zero_()
        for e in (1, 3, 5):
            m.gate.e_score_correction_bias[e] = 5.0
        x = torch.randn(7, cfg.hidden_size, generator=torch.Generator().manual_seed(10))
        ids, _ = m.gate(x)
    assert ids.tolist() == [[1, 3]] * 7


def test_moe_bf16_runs_and_tracks_fp32() -> None:
    cfg = _cfg()
    m = _moe(cfg, seed=4)
    x = torch.randn(6, cfg.hidden_size, generator=torch.Generator().manual_seed(12))
    with torch.no_grad():
        ref = m(x)
        y = m.to(torch.bfloat16)(x.bfloat16())
    assert y.dtype == torch.bfloat16
    assert (y.float() - ref).abs().max() < 0.05 * ref.abs().max()


def test_moe_empty_batch() -> None:
    cfg = _cfg()
    m = _moe(cfg)
    with torch.no_grad():
        assert m(torch.empty(0, cfg.hidden_size)).shape == (0, cfg.hidden_size)


def test_reset_parameters_seeded() -> None:
    cfg = _cfg()
    a, b, c = _moe(cfg, 0), _moe(cfg, 0), _moe(cfg, 1)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not torch.equal(sa["experts.0.up_proj.weight"], sc["experts.0.up_proj.weight"])
    assert sa["gate.e_score_correction_bias"].abs().sum() > 0


def test_make_ffn_dense_then_moe() -> None:
    cfg = _cfg(first_k_dense_replace=3)
    kinds = [type(make_ffn(cfg, i)) for i in range(cfg.num_hidden_layers + 1)]
    assert kinds[:3] == [GatedMLP] * 3
    assert kinds[3:] == [MoE] * (cfg.num_hidden_layers + 1 - 3)
    dense = make_ffn(cfg, 0)
    assert dense.intermediate_size == cfg.intermediate_size
    assert make_ffn(dataclasses.replace(cfg, mlp_layer_types=None, first_k_dense_replace=0), 0).__class__ is MoE


def test_silu_matches_reference_formula() -> None:
    # Guards against a swapped gate/up (silu applied to the wrong branch).
    mlp = GatedMLP(8, 12)
    mlp.reset_parameters(torch.Generator().manual_seed(0), 0.3)
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(1))
    wrong = mlp.down_proj(mlp.gate_proj(x) * F.silu(mlp.up_proj(x)))
    assert not torch.allclose(mlp(x), wrong)


# ------------------------------------------------------------------------------------------------------
# GatedMLP.fuse_weights: gate and up weights as views of one [2I, H] storage, one GEMM in the forward
# ------------------------------------------------------------------------------------------------------
def _mlp(seed: int = 3, hidden: int = 24, inter: int = 40, limit: float | None = 1.5) -> GatedMLP:
    # A small limit for unit-scale activations: the clamps act on many elements.
    mlp = GatedMLP(hidden, inter, limit)
    mlp.reset_parameters(torch.Generator().manual_seed(seed), 0.5)
    return mlp


def _x(n: int = 6, hidden: int = 24, seed: int = 11) -> torch.Tensor:
    return torch.randn(n, hidden, generator=torch.Generator().manual_seed(seed)) * 2


def _count_fused_calls(monkeypatch: pytest.MonkeyPatch) -> list[str | None]:
    """Wrap the SwiGLU dispatch GatedMLP calls on its fused path; each call appends its backend argument."""
    calls: list[str | None] = []
    real = ffn.swiglu

    def counting(gate_up, limit, backend=None, **kw):  # type: ignore[no-untyped-def]
        calls.append(backend)
        return real(gate_up, limit, backend, **kw)

    monkeypatch.setattr(ffn, "swiglu", counting)
    return calls


def test_fuse_weights_keeps_names_and_is_idempotent() -> None:
    mlp = _mlp()
    before = {k: v.clone() for k, v in mlp.state_dict().items()}
    gate_param, up_param = mlp.gate_proj.weight, mlp.up_proj.weight
    mlp.fuse_weights()
    f = mlp._gate_up
    assert f is not None and f.weight.shape == (80, 24) and f.intact()
    after = mlp.state_dict()
    assert list(after) == list(before) and all(torch.equal(after[k], before[k]) for k in before)
    # The parameters are views of the fused storage: gate rows, then up rows.
    w = f.weight
    assert mlp.gate_proj.weight.data_ptr() == w.data_ptr()
    assert mlp.up_proj.weight.data_ptr() == w[40:].data_ptr()
    assert isinstance(mlp.up_proj.weight, nn.Parameter) and mlp.up_proj.weight.requires_grad
    assert gate_param.requires_grad and up_param.requires_grad
    # The fused tensor is no parameter or buffer of the module.
    assert all(t.data_ptr() != w.data_ptr() or t.shape != w.shape for t in mlp.parameters())
    assert list(mlp.buffers()) == []
    # Idempotent: a second call keeps the storage (CUDA graphs captured on it stay valid).
    mlp.fuse_weights()
    assert mlp._gate_up is f and mlp.gate_proj.weight.data_ptr() == w.data_ptr()


@pytest.mark.parametrize("how", ["argument", "env", "torch"])
@pytest.mark.parametrize("limit", [1.5, None])
def test_fused_forward_matches_unfused(monkeypatch: pytest.MonkeyPatch, how: str, limit: float | None) -> None:
    ref, mlp = _mlp(limit=limit), _mlp(limit=limit)
    x = _x().reshape(2, 3, 24)  # leading dims are flattened and restored
    with torch.no_grad():
        want = ref(x)
    mlp.fuse_weights()
    calls = _count_fused_calls(monkeypatch)
    monkeypatch.delenv(SWIGLU_BACKEND_ENV, raising=False)
    if how == "argument":
        mlp.backend = "triton"
    elif how == "env":
        monkeypatch.setenv(SWIGLU_BACKEND_ENV, "triton")
    kernel_calls: list[int] = []
    real_kernel_module = act.kernel_module
    monkeypatch.setattr(act, "kernel_module", lambda d: kernel_calls.append(1) or real_kernel_module(d))
    with torch.no_grad():
        got = mlp(x)
    assert len(calls) == 1  # one fused GEMM + one SwiGLU dispatch
    assert len(kernel_calls) == (0 if how == "torch" else 1)
    assert got.shape == want.shape
    if how == "torch":
        # Same reference arithmetic on the halves of one GEMM: equal up to the GEMM's blocking.
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    else:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("how", ["parameter", "assign_load"])
def test_replaced_parameter_is_detected_and_falls_back(monkeypatch: pytest.MonkeyPatch, how: str) -> None:
    mlp, other = _mlp(seed=3), _mlp(seed=4)
    mlp.fuse_weights()
    f = mlp._gate_up
    if how == "parameter":
        mlp.up_proj.weight = nn.Parameter(other.up_proj.weight.detach().clone())
    else:
        mlp.load_state_dict({k: v.clone() for k, v in other.state_dict().items()}, assign=True)
    assert not f.intact()
    # The fused storage still holds the old weights: using it would give the old module's output.
    want_mod = _mlp(seed=3)
    want_mod.load_state_dict(mlp.state_dict())
    calls = _count_fused_calls(monkeypatch)
    x = _x()
    with torch.no_grad():
        assert torch.equal(mlp(x), want_mod(x))  # exactly the separate-GEMM code
    assert calls == []
    # Fusing again picks up the new weights, in new storage.
    mlp.fuse_weights()
    assert mlp._gate_up is not f and mlp._gate_up.intact()
    with torch.no_grad():
        torch.testing.assert_close(mlp(x), want_mod(x), rtol=1e-6, atol=1e-6)
    assert len(calls) == 1


def test_to_dtype_refuses_and_noop_conversions_keep_storage() -> None:
    ref, mlp = _mlp(), _mlp()
    mlp.fuse_weights()
    ptr = mlp._gate_up.weight.data_ptr()
    mlp.to(torch.float32)  # changes nothing: the fused storage stays
    assert mlp._gate_up.intact() and mlp._gate_up.weight.data_ptr() == ptr
    mlp.to(torch.float64)
    f = mlp._gate_up
    assert f is not None and f.intact() and f.weight.dtype == torch.float64 and f.weight.data_ptr() != ptr
    assert mlp.gate_proj.weight.dtype == torch.float64 and mlp.gate_proj.weight.data_ptr() == f.weight.data_ptr()
    ref.to(torch.float64)
    x = _x().double()
    with torch.no_grad():
        torch.testing.assert_close(mlp(x), ref(x), rtol=1e-12, atol=1e-12)


def test_in_place_load_state_dict_writes_through_the_views() -> None:
    mlp, other = _mlp(seed=3), _mlp(seed=5)
    mlp.fuse_weights()
    f = mlp._gate_up
    mlp.load_state_dict(other.state_dict())
    assert mlp._gate_up is f and f.intact()
    assert torch.equal(f.weight, torch.cat([other.gate_proj.weight, other.up_proj.weight]))
    x = _x()
    with torch.no_grad():
        torch.testing.assert_close(mlp(x), other(x), rtol=1e-6, atol=1e-6)


def test_fused_path_steps_aside_for_gradients() -> None:
    ref, mlp = _mlp(), _mlp()
    mlp.fuse_weights()
    x = _x()
    ref(x).square().sum().backward()
    mlp(x).square().sum().backward()
    # The fused tensor is no parameter: a GEMM on it would leave these gradients None.
    for name in ("gate_proj", "up_proj", "down_proj"):
        got, want = getattr(mlp, name).weight.grad, getattr(ref, name).weight.grad
        assert got is not None and torch.equal(got, want)


def test_moe_fuses_its_shared_experts_only() -> None:
    cfg = _cfg(n_shared_experts=2)
    m = _moe(cfg, seed=6)
    x = torch.randn(9, cfg.hidden_size, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = m(x)
    w13, _ = m.stacked_expert_weights()
    # What Glm5NextForCausalLM.fuse_weights does: every submodule with a fuse_weights.
    for sub in m.modules():
        if callable(getattr(sub, "fuse_weights", None)):
            sub.fuse_weights()
    # The routed experts stay views of the MoE's stacked tensors (fusing them would re-home every expert).
    assert all(ex._gate_up is None for ex in m.experts)
    assert m._stack_is_current() and m.stacked_expert_weights()[0].data_ptr() == w13.data_ptr()
    assert m.shared_experts is not None and m.shared_experts._gate_up is not None
    with torch.no_grad():
        torch.testing.assert_close(m(x), want, rtol=1e-6, atol=1e-6)
