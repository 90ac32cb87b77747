"""Fused MoE with block-FP8 expert weights (compiled, CUDA) at the real GLM-5.3-Flash expert geometry.

H = 4096, I = 2048, E = 288, top-8 (the ``glm-5.3-flash`` preset). The routed experts are quantized the way a
block-FP8 checkpoint holds them (each linear's ``weight`` float8_e4m3fn plus an fp32 ``weight_scale_inv`` per
128 x 128 tile; 7.2 GB of experts), from random bf16 weights whose tiles differ in magnitude (so the scales vary
tile to tile). The kernels are compared with the fp32 reference (``ops.fused_moe_ref``, weights dequantised per
tile) at N in {1, 16, 64, 128} with bf16 activations (the SwiGLU clamp active), and with fp32 activations (IEEE
dots) at a small geometry with H, I not multiples of 128 to a tight tolerance. Also: bit-determinism, both pair
sortings, the whole `MoE` module (router, FP8 routed experts, shared expert) and the fused op captured in one
CUDA graph and replayed on new inputs equal bit for bit to eager calls, and dead rows in a graph. Needs CUDA
(tests/conftest.py skips ``gpu`` tests without it); run with ``-s`` to see the error figures.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from trtllm_glm.config import Glm5NextConfig
from trtllm_glm.models.checkpoint import quantize_block_fp8
from trtllm_glm.modules.ffn import MoE
from trtllm_glm.moe import kernels as K
from trtllm_glm.moe import ops as R

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

X_SCALE = 8.0  # gate / up pre-activations of std ~ 8 * 0.02 * 64 ~ 10: the clamp at 10 is active


def _tile_factors(rows: int, cols: int, g: torch.Generator) -> torch.Tensor:
    """``[rows, cols]`` per-128x128-tile magnitudes in ~[0.3, 3] (mean ~1)."""
    t = torch.exp(torch.randn(math.ceil(rows / 128), math.ceil(cols / 128), device="cuda", generator=g) * 0.5) * 0.9
    return t.repeat_interleave(128, 0)[:rows].repeat_interleave(128, 1)[:, :cols]


@torch.no_grad()
def quantize_moe_experts(m: MoE, g: torch.Generator) -> None:
    """Scale each expert weight's tiles by random magnitudes, quantise it to block FP8 and make every expert
    linear's ``weight`` / ``weight_scale_inv`` views of new stacked FP8 / fp32 tensors (re-stacked zero-copy;
    the bf16 stack is freed)."""
    w13, w2 = m.stacked_expert_weights()
    e, two_i, h = w13.shape
    inter = two_i // 2
    s13_shape, s2_shape = R.expert_scale_shapes(e, h, inter)
    q13 = torch.empty(w13.shape, dtype=torch.float8_e4m3fn, device=w13.device)
    q2 = torch.empty(w2.shape, dtype=torch.float8_e4m3fn, device=w2.device)
    s13 = torch.empty(s13_shape, dtype=torch.float32, device=w13.device)
    s2 = torch.empty(s2_shape, dtype=torch.float32, device=w2.device)
    ti = s13_shape[1] // 2
    for i in range(e):
        for src, q, s in (
            (w13[i, :inter], q13[i, :inter], s13[i, :ti]),
            (w13[i, inter:], q13[i, inter:], s13[i, ti:]),
            (w2[i], q2[i], s2[i]),
        ):
            qi, si = quantize_block_fp8(src.float() * _tile_factors(*src.shape, g))
            q.copy_(qi)
            s.copy_(si)
    del w13, w2
    for i, ex in enumerate(m.experts):
        views = ((ex.gate_proj, q13[i, :inter], s13[i, :ti]), (ex.up_proj, q13[i, inter:], s13[i, ti:]))
        for lin, q, s in (*views, (ex.down_proj, q2[i], s2[i])):
            lin.weight = nn.Parameter(q, requires_grad=False)
            lin.weight_scale_inv = nn.Parameter(s, requires_grad=False)
    m.mark_weights_changed()
    assert m.stacked_expert_weights()[0].data_ptr() == q13.data_ptr()  # viewed, not copied


@pytest.fixture(scope="module")
def fp8_moe() -> MoE:
    """One MoE layer of the real geometry on the GPU: FP8 routed experts, bf16 shared expert, fp32 router."""
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
    quantize_moe_experts(m, g)
    torch.cuda.empty_cache()
    return m.eval()


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


@pytest.mark.parametrize("n", [1, 16, 64, 128])
def test_fp8_bf16_vs_fp32_reference(fp8_moe: MoE, n: int) -> None:
    m = fp8_moe
    g = torch.Generator(device="cuda").manual_seed(n)
    x = (torch.randn(n, m.hidden_size, device="cuda", generator=g) * X_SCALE).to(torch.bfloat16)
    w13, w2 = m.stacked_expert_weights()
    s13, s2 = m.stacked_expert_scales()
    assert w13.shape == (288, 4096, 4096) and w2.shape == (288, 4096, 2048) and w13.dtype == torch.float8_e4m3fn
    assert s13.shape == (288, 32, 32) and s2.shape == (288, 32, 16)
    assert s13.std() > 0.2 * s13.mean(), "tile scales should vary"
    scales = {"w_gate_up_scale": s13, "w_down_scale": s2}
    with torch.no_grad():
        ids, w = m.gate(x)
        # Token 0's gate pre-activations through its experts: some must exceed the limit.
        inter = m.intermediate_size
        gate0 = torch.stack([R.dequantize_experts(w13[e, :inter], s13[e, :16]) @ x[0].float() for e in ids[0].tolist()])
        assert (gate0 > m.swiglu_limit).any(), "the clamp should be active"
        ref = R.fused_moe_ref(x, ids, w, w13, w2, m.swiglu_limit, **scales)
        out = torch.full((n, m.hidden_size), float("nan"), device="cuda")
        K.fused_moe(x, ids, w, w13, w2, m.swiglu_limit, out=out, **scales)
        torch.cuda.synchronize()
        assert not out.isnan().any()
        loop = m._routed_loop(x, ids, w)  # FP8 experts: bf16 on the dequantised weights (a bf16-dequantised model)
        assert torch.equal(K.fused_moe(x, ids, w, w13, w2, m.swiglu_limit, align="torch", **scales), out)
        again = K.fused_moe(x, ids, w, w13, w2, m.swiglu_limit, **scales)
    err, err_loop = _rel_err(out, ref), _rel_err(loop, ref)
    print(f"N={n}: fused FP8 rel err {err:.2e}, loop on bf16-dequantised weights {err_loop:.2e}")
    assert err < 1e-2
    assert err <= 1.5 * err_loop + 1e-4
    assert torch.equal(out, again), "fused MoE must be bit-deterministic"


def test_fp8_fp32_ieee_small_geometry() -> None:
    g = torch.Generator(device="cuda").manual_seed(1)
    n, h, inter, e, k = 37, 520, 200, 16, 4  # H, I not multiples of 128 (I: the up rows start a new tile row)
    x = torch.randn(n, h, device="cuda", generator=g) * 4
    ids = torch.rand(n, e, device="cuda", generator=g).topk(k, dim=1).indices
    w = torch.rand(n, k, device="cuda", generator=g)
    q13, s13 = [], []
    q2, s2 = [], []
    for _ in range(e):
        (qg, sg), (qu, su) = (
            quantize_block_fp8(torch.randn(inter, h, device="cuda", generator=g) * _tile_factors(inter, h, g) * 0.05)
            for _ in range(2)
        )
        qd, sd = quantize_block_fp8(
            torch.randn(h, inter, device="cuda", generator=g) * _tile_factors(h, inter, g) * 0.05
        )
        q13.append(torch.cat([qg, qu]))
        s13.append(torch.cat([sg, su]))
        q2.append(qd)
        s2.append(sd)
    scales = {"w_gate_up_scale": torch.stack(s13), "w_down_scale": torch.stack(s2)}
    w13, w2 = torch.stack(q13), torch.stack(q2)
    ref = R.fused_moe_ref(x, ids, w, w13, w2, 10.0, **scales)
    for kw in ({}, {"block_n": (128, 16), "block_k": (32, 128)}, {"block_m": 32, "block_k": (64, 64)}):
        out = K.fused_moe(x, ids, w, w13, w2, 10.0, **scales, **kw)
        torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())


def test_fp8_cuda_graph_replay(fp8_moe: MoE) -> None:
    m = fp8_moe
    n = 16
    g = torch.Generator(device="cuda").manual_seed(7)
    w13, w2 = m.stacked_expert_weights()
    s13, s2 = m.stacked_expert_scales()
    scales = {"w_gate_up_scale": s13, "w_down_scale": s2}

    def inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        x = (torch.randn(n, m.hidden_size, device="cuda", generator=g) * X_SCALE).to(torch.bfloat16)
        with torch.no_grad():
            ids, w = m.gate(x)
        return x, ids, w

    sx, sids, sw = inputs()
    sout = torch.empty(n, m.hidden_size, device="cuda")
    s_mod_out = torch.empty(n, m.hidden_size, device="cuda", dtype=torch.bfloat16)
    m.backend = "triton"
    try:

        def step() -> None:
            K.fused_moe(sx, sids, sw, w13, w2, m.swiglu_limit, out=sout, **scales)
            with torch.no_grad():
                s_mod_out.copy_(m(sx))  # the whole module: router, fused FP8 routed experts, shared expert

        graph = _capture(step)
        for _ in range(3):
            x, ids, w = inputs()
            sx.copy_(x)
            sids.copy_(ids)
            sw.copy_(w)
            graph.replay()
            torch.cuda.synchronize()
            with torch.no_grad():
                eager = K.fused_moe(x, ids, w, w13, w2, m.swiglu_limit, **scales)
                eager_mod = m(x)
            assert torch.equal(sout, eager)
            assert torch.equal(s_mod_out, eager_mod)
    finally:
        m.backend = None


def test_fp8_dead_rows_in_a_graph(fp8_moe: MoE) -> None:
    m = fp8_moe
    n = 24  # three width-8 verify sequences
    g = torch.Generator(device="cuda").manual_seed(9)
    w13, w2 = m.stacked_expert_weights()
    s13, s2 = m.stacked_expert_scales()
    scales = {"w_gate_up_scale": s13, "w_down_scale": s2}
    x = (torch.randn(n, m.hidden_size, device="cuda", generator=g) * X_SCALE).to(torch.bfloat16)
    with torch.no_grad():
        ids, w = m.gate(x)
    live = torch.ones(n, dtype=torch.int64, device="cuda")
    out = torch.empty(n, m.hidden_size, device="cuda")
    scratch: dict[str, torch.Tensor] = {}

    def step() -> None:
        K.fused_moe(x, ids, w, w13, w2, m.swiglu_limit, out=out, row_live=live, scratch=scratch, **scales)

    graph = _capture(step)
    full = K.fused_moe(x, ids, w, w13, w2, m.swiglu_limit, **scales)
    for proposed in ([7, 7, 7], [2, 0, 5], [0, 0, 0]):
        flags = torch.tensor([int(j <= p) for p in proposed for j in range(8)], device="cuda")
        live.copy_(flags)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        on = flags.bool()
        assert torch.equal(out[on], full[on])
        assert torch.equal(out[~on], torch.zeros_like(out[~on]))
        assert set(scratch["block_expert"].tolist()) - {-1} == set(ids[on].unique().tolist())
