"""Fused MoE kernels (compiled, CUDA) at the real GLM-5.3-Flash expert geometry.

H = 4096, I = 2048, E = 288, top-8 (the ``glm-5.3-flash`` preset), bf16 weights (14.5 GB for one layer's
experts), N in {1, 16, 128}. The kernel is compared with the fp32 reference (``ops.fused_moe_ref``) on the
same bf16 inputs, and its error must not exceed the error of the existing per-expert bf16 loop (which rounds
more often). Inputs are large enough that the SwiGLU clamp is active. Outputs are poisoned with NaN first.
Also: fp32 inputs (IEEE dots) at a smaller geometry to a tight tolerance, bit-determinism, and a CUDA graph of
the fused op and of the whole `MoE` module captured once and replayed on new inputs copied into its static
buffers, equal bit for bit to eager calls. Needs CUDA (tests/conftest.py skips ``gpu`` tests without it);
run with ``-s`` to see the error figures.
"""

from __future__ import annotations

import pytest
import torch

from trtllm_glm.config import Glm5NextConfig
from trtllm_glm.modules.ffn import MoE
from trtllm_glm.moe import kernels as K
from trtllm_glm.moe import ops as R

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

X_SCALE = 8.0  # gate / up pre-activations of std ~ 8 * 0.02 * 64 ~ 10: the clamp at 10 is active


@pytest.fixture(scope="module")
def real_moe() -> MoE:
    """One MoE layer of the real geometry on the GPU in bf16, random weights (std 0.02)."""
    cfg = Glm5NextConfig.from_pretrained("glm-5.3-flash")
    with torch.device("meta"):
        m = MoE(cfg).to(torch.bfloat16)  # cast on meta: to_empty then allocates bf16 directly
    m.to_empty(device="cuda")
    g = torch.Generator(device="cuda").manual_seed(0)
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0.0, 0.02, generator=g)
        m.gate.float()
        m.gate.weight.normal_(0.0, 0.02, generator=g)
        m.gate.e_score_correction_bias.normal_(0.0, 0.02, generator=g)
    m.eval()
    return m


def _capture(step) -> torch.cuda.CUDAGraph:
    """``step`` run once on a side stream (compilation, allocator warm-up), then captured."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph


def _rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    return ((a.float() - ref).abs().max() / ref.abs().max()).item()


@pytest.mark.parametrize("n", [1, 16, 128])
def test_bf16_vs_fp32_reference(real_moe: MoE, n: int) -> None:
    m = real_moe
    g = torch.Generator(device="cuda").manual_seed(n)
    x = (torch.randn(n, m.hidden_size, device="cuda", generator=g) * X_SCALE).to(torch.bfloat16)
    w13, w2 = m.stacked_expert_weights()
    assert w13.shape == (288, 4096, 4096) and w2.shape == (288, 4096, 2048) and w13.dtype == torch.bfloat16
    with torch.no_grad():
        ids, w = m.gate(x)
        # Token 0's gate pre-activations through its experts: some must exceed the limit.
        gate0 = torch.stack([w13[e, : m.intermediate_size].float() @ x[0].float() for e in ids[0].tolist()])
        assert (gate0 > m.swiglu_limit).any(), "the clamp should be active"
        ref = R.fused_moe_ref(x, ids, w, w13, w2, m.swiglu_limit)
        out = torch.full((n, m.hidden_size), float("nan"), device="cuda")
        K.fused_moe(x, ids, w, w13, w2, m.swiglu_limit, out=out)
        torch.cuda.synchronize()
        assert not out.isnan().any()
        loop = m._routed_loop(x, ids, w)
        # The Triton pair sorting gives the reference's layout exactly, and so the same output bits.
        for a, b in zip(R.moe_align(ids, 288, 16), K.moe_align(ids, 288, 16)):
            assert torch.equal(a, b)
        assert torch.equal(K.fused_moe(x, ids, w, w13, w2, m.swiglu_limit, align="torch"), out)
        again = K.fused_moe(x, ids, w, w13, w2, m.swiglu_limit)
    err, err_loop = _rel_err(out, ref), _rel_err(loop, ref)
    print(f"N={n}: fused rel err {err:.2e}, per-expert bf16 loop {err_loop:.2e}")
    assert err < 1e-2
    assert err <= 1.5 * err_loop + 1e-4
    assert torch.equal(out, again), "fused MoE must be bit-deterministic"


def test_fp32_ieee_small_geometry() -> None:
    g = torch.Generator(device="cuda").manual_seed(1)
    n, h, inter, e, k = 37, 512, 256, 32, 4
    x = torch.randn(n, h, device="cuda", generator=g) * 4
    ids = torch.rand(n, e, device="cuda", generator=g).topk(k, dim=1).indices
    w = torch.rand(n, k, device="cuda", generator=g)
    w13 = torch.randn(e, 2 * inter, h, device="cuda", generator=g) * 0.05
    w2 = torch.randn(e, h, inter, device="cuda", generator=g) * 0.05
    ref = R.fused_moe_ref(x, ids, w, w13, w2, 10.0)
    out = K.fused_moe(x, ids, w, w13, w2, 10.0)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())


def test_cuda_graph_replay(real_moe: MoE) -> None:
    m = real_moe
    n = 16
    g = torch.Generator(device="cuda").manual_seed(7)
    w13, w2 = m.stacked_expert_weights()

    def inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        x = (torch.randn(n, m.hidden_size, device="cuda", generator=g) * X_SCALE).to(torch.bfloat16)
        with torch.no_grad():
            ids, w = m.gate(x)
        return x, ids, w

    sx, sids, sw = inputs()
    sout = torch.empty(n, m.hidden_size, device="cuda")
    s_mod_out = torch.empty(n, m.hidden_size, device="cuda", dtype=torch.bfloat16)

    def step() -> None:
        K.fused_moe(sx, sids, sw, w13, w2, m.swiglu_limit, out=sout)
        with torch.no_grad():
            s_mod_out.copy_(m(sx))  # the whole module: router, fused routed experts, shared expert

    graph = _capture(step)
    for _ in range(3):
        x, ids, w = inputs()
        sx.copy_(x)
        sids.copy_(ids)
        sw.copy_(w)
        graph.replay()
        torch.cuda.synchronize()
        with torch.no_grad():
            eager = K.fused_moe(x, ids, w, w13, w2, m.swiglu_limit)
            eager_mod = m(x)
        assert torch.equal(sout, eager)
        assert torch.equal(s_mod_out, eager_mod)


@pytest.mark.parametrize("align", ["triton", "torch"])
def test_dead_rows_in_a_graph(real_moe: MoE, align: str) -> None:
    """``row_live`` at real geometry, captured once and replayed with new flags: live rows bit-equal to the
    unflagged call, dead rows 0, and the experts only dead rows chose get no row block (either pair sort)."""
    m = real_moe
    n = 24  # three width-8 verify sequences
    g = torch.Generator(device="cuda").manual_seed(9)
    w13, w2 = m.stacked_expert_weights()
    x = (torch.randn(n, m.hidden_size, device="cuda", generator=g) * X_SCALE).to(torch.bfloat16)
    with torch.no_grad():
        ids, w = m.gate(x)
    live = torch.ones(n, dtype=torch.int64, device="cuda")
    out = torch.empty(n, m.hidden_size, device="cuda")
    scratch: dict[str, torch.Tensor] = {}

    def step() -> None:
        K.fused_moe(x, ids, w, w13, w2, m.swiglu_limit, out=out, row_live=live, scratch=scratch, align=align)

    graph = _capture(step)
    full = K.fused_moe(x, ids, w, w13, w2, m.swiglu_limit)
    for proposed in ([7, 7, 7], [2, 0, 5], [0, 0, 0]):
        flags = torch.tensor([int(j <= p) for p in proposed for j in range(8)], device="cuda")
        live.copy_(flags)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        on = flags.bool()
        assert torch.equal(out[on], full[on])
        assert torch.equal(out[~on], torch.zeros_like(out[~on]))
        used = set(scratch["block_expert"].tolist()) - {-1}
        assert used == set(ids[on].unique().tolist())


def test_prefill_rows_on_the_fused_path(real_moe: MoE) -> None:
    """A prefill chunk (8,192 + 37 rows: the large-M launch over two slabs of `fused_max_rows`) goes to the fused
    kernels under ``auto`` (no per-expert loop), within the bf16 loop's error of the fp32 reference."""
    m = real_moe
    n = m.fused_max_rows + 37
    g = torch.Generator(device="cuda").manual_seed(5)
    x = (torch.randn(n, m.hidden_size, device="cuda", generator=g) * X_SCALE).to(torch.bfloat16)
    calls: list[int] = []
    real = K.fused_moe

    def spy(x2, *a, **kw):
        calls.append(x2.shape[0])
        return real(x2, *a, **kw)

    with torch.no_grad():
        ids, w = m.gate(x)
        assert K.large_m_launch(m.fused_max_rows * 8, 288) is not None
        K.fused_moe = spy
        try:
            out = m(x)  # auto
        finally:
            K.fused_moe = real
        assert calls == [m.fused_max_rows, 37]
        routed = K.fused_moe(x, ids, w, *m.stacked_expert_weights(), m.swiglu_limit)
        w13, w2 = m.stacked_expert_weights()
        ref = R.fused_moe_ref(x, ids, w, w13, w2, m.swiglu_limit)
        loop = m._routed_loop(x, ids, w)
        shared = m.shared_experts(x).float()
    torch.cuda.synchronize()
    assert not out.isnan().any()
    err, err_loop = _rel_err(routed, ref), _rel_err(loop, ref)
    print(f"N={n}: fused (large-M) rel err {err:.2e}, per-expert bf16 loop {err_loop:.2e}")
    assert err < 1e-2 and err <= 1.5 * err_loop + 1e-4
    # The module's result is the fused routed part plus the shared experts, rounded once.
    full = m.fused_max_rows
    torch.testing.assert_close(out[:full].float(), (routed[:full] + shared[:full]).to(torch.bfloat16).float())
