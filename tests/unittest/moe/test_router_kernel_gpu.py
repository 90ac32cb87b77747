"""The fused MoE router kernel (compiled, CUDA) at the real GLM-5.3-Flash geometry (E = 288 experts, top 8)
against the torch reference `route_reference`: exact ids (same experts, same order), weights to rtol 1e-6
(bitwise without normalisation: the kernel's sigmoid is torch's CUDA arithmetic), adversarial ties, NaN rows,
the router module's auto dispatch, and a CUDA graph of the kernel and of the module. Outputs are poisoned
first. Needs CUDA (tests/conftest.py skips ``gpu`` tests without it).
"""

from __future__ import annotations

import pytest
import torch

from tests.router_checks import count_fused_route_calls
from trtllm_glm.moe import router as R
from trtllm_glm.moe.router import fused_route, route_reference

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

E, TOP_K, HIDDEN, SCALING = 288, 8, 4096, 2.5


def _logits(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 router logits of bf16 hidden states (as `MoEGate` computes them) and an fp32 correction bias."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    hidden = (torch.randn(n, HIDDEN, device="cuda", generator=g) * 2).to(torch.bfloat16)
    weight = (torch.randn(E, HIDDEN, device="cuda", generator=g) * HIDDEN**-0.5).to(torch.bfloat16)
    bias = torch.randn(E, device="cuda", generator=g) * 0.05
    return torch.nn.functional.linear(hidden.float(), weight.float()), bias


def _check(logits, bias, norm, rows_per_program=None, equal_nan=False):
    n = logits.shape[0]
    out = (
        torch.full((n, TOP_K), -7, dtype=torch.int64, device="cuda"),
        torch.full((n, TOP_K), float("nan"), device="cuda"),
    )
    ids, w = fused_route(logits, bias, TOP_K, norm, SCALING, out=out, rows_per_program=rows_per_program)
    ref_ids, ref_w = route_reference(logits, bias, TOP_K, norm, SCALING)
    assert (ids >= 0).all()
    assert torch.equal(ids, ref_ids)
    if norm:
        torch.testing.assert_close(w, ref_w, rtol=1e-6, atol=1e-12, equal_nan=equal_nan)
    else:
        # Same sigmoid bit for bit (libdevice expf, IEEE division), same scaling product.
        torch.testing.assert_close(w, ref_w, rtol=0, atol=0, equal_nan=equal_nan)
    return ids, w


@pytest.mark.parametrize("n", [1, 16, 128])
@pytest.mark.parametrize("norm", [True, False])
def test_real_geometry_matches_reference(n: int, norm: bool) -> None:
    for seed in range(4):
        logits, bias = _logits(n, 100 * n + seed)
        _check(logits, bias, norm)


@pytest.mark.parametrize("rows_per_program", [2, 4, 16])
def test_rows_per_program(rows_per_program: int) -> None:
    logits, bias = _logits(131, 5)
    _check(logits, bias, True, rows_per_program=rows_per_program)


def test_many_rows_bf16_bias() -> None:
    """Prefill-sized batch; a bf16 model's correction bias is bf16 (upcast in the kernel)."""
    logits, bias = _logits(4096, 6)
    ids, w = fused_route(logits, bias.bfloat16(), TOP_K, True, SCALING)
    ref_ids, ref_w = route_reference(logits, bias.bfloat16(), TOP_K, True, SCALING)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(w, ref_w, rtol=1e-6, atol=1e-12)


def test_ties_saturation_and_nan() -> None:
    g = torch.Generator(device="cuda").manual_seed(9)
    n = 64
    levels = torch.tensor([-2.75, -0.5, 0.625, 1.25, 3.0, 1e4, -1e4, float("inf"), -200.0, 40.0], device="cuda")
    logits = levels[torch.randint(0, levels.numel(), (n, E), device="cuda", generator=g)]
    logits[0] = 0.75
    logits[1] = -1e4
    for bias in (torch.zeros(E, device="cuda"), torch.where(torch.rand(E, device="cuda", generator=g) < 0.3, 2.0, 0.0)):
        for norm in (True, False):
            ids, _ = _check(logits, bias, norm)
            if not bias.any():
                assert ids[0].tolist() == ids[1].tolist() == list(range(TOP_K))
    nan_logits, bias = _logits(4, 10)
    nan_logits[0, [17, 3]] = float("nan")
    nan_logits[1] = float("nan")
    ids, _ = _check(nan_logits, bias, True, equal_nan=True)
    assert ids[0, :2].tolist() == [3, 17] and ids[1].tolist() == list(range(TOP_K))


def test_module_auto_dispatch_uses_the_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    from trtllm_glm.modules.ffn import MoEGate

    monkeypatch.delenv(R.ROUTER_BACKEND_ENV, raising=False)
    calls = count_fused_route_calls(monkeypatch)
    gate = MoEGate(HIDDEN, E, TOP_K, True, SCALING)
    gate.reset_parameters(torch.Generator().manual_seed(0), 0.02)
    gate = gate.cuda()
    x = torch.randn(16, HIDDEN, device="cuda").to(torch.bfloat16)
    with torch.no_grad():
        ids, w = gate(x)
        assert calls == [1]
        gate.backend = "torch"
        ref_ids, ref_w = gate(x)
        assert calls == [1]
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(w, ref_w, rtol=1e-6, atol=1e-12)
    # Training keeps the differentiable reference.
    gate.backend = None
    _, w_train = gate(x)
    assert calls == [1] and w_train.requires_grad


def test_cuda_graph_replay() -> None:
    """The kernel and the whole router module captured once, replayed on new inputs: the eager results."""
    from trtllm_glm.modules.ffn import MoEGate

    n = 16
    logits, bias = _logits(n, 11)
    gate = MoEGate(HIDDEN, E, TOP_K, True, SCALING)
    gate.reset_parameters(torch.Generator().manual_seed(1), 0.02)
    gate = gate.cuda().to(torch.bfloat16)
    static_logits = logits.clone()
    static_x = torch.randn(n, HIDDEN, device="cuda").to(torch.bfloat16)
    results: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def step() -> None:
        results["kernel"] = fused_route(static_logits, bias, TOP_K, True, SCALING)
        with torch.no_grad():
            results["module"] = gate(static_x)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # compile outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for seed in range(3):
        new_logits, _ = _logits(n, 20 + seed)
        new_x = torch.randn(n, HIDDEN, device="cuda").to(torch.bfloat16)
        static_logits.copy_(new_logits)
        static_x.copy_(new_x)
        graph.replay()
        torch.cuda.synchronize()
        ids, w = results["kernel"]
        assert torch.equal(ids, route_reference(new_logits, bias, TOP_K, True, SCALING)[0])
        assert torch.equal(ids, fused_route(new_logits, bias, TOP_K, True, SCALING)[0])
        assert torch.equal(w, fused_route(new_logits, bias, TOP_K, True, SCALING)[1])
        with torch.no_grad():
            eager_ids, eager_w = gate(new_x)
        assert torch.equal(results["module"][0], eager_ids)
        assert torch.equal(results["module"][1], eager_w)
