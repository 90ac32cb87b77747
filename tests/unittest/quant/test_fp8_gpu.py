"""Block-FP8 weights on the H200: the compiled FP8 linear at GLM-5.3-Flash's real shapes against the fp64 product
of the dequantised weight, its CUDA-graph capture and row independence, and an FP8 model on CUDA (graphs on and
off give the same greedy tokens; logits close to the fp32 dequantised reference).

Bounds: bf16 activations times e4m3 weights are exact products on tensor cores (fp32 activations: fp32 FMAs),
summed in fp32 and scaled once per 128-column step: an fp32 sum of K terms in any order is within
``K * 2^-24 * sum|terms|`` of the exact sum, so ``|y - exact| <= (K + 8) * 2^-24 * (|x| @ |W|^T)``, plus one
rounding to the output dtype.
"""

from __future__ import annotations

import pytest
import torch

from trtllm_glm.quant import dequantize_block_fp8, quantize_block_fp8
from trtllm_glm.quant.ops import fp8_linear, fp8_linear_reference, fp8_linear_triton

pytestmark = pytest.mark.gpu

SHAPES = [(3 * 8192 + 256, 4096), (4096, 16384), (8192, 128), (2176, 4096), (4096, 2048), (1000, 1000)]


def _case(n: int, k: int, m: int, dtype: torch.dtype, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q, s = quantize_block_fp8(torch.randn(n, k, device="cuda", generator=g) * k**-0.5)
    s = s * torch.exp(torch.randn(s.shape, device="cuda", generator=g))  # tile-varying scales
    x = torch.randn(m, k, device="cuda", generator=g).to(dtype)
    return x, q, s


@pytest.mark.parametrize("n, k", SHAPES)
@pytest.mark.parametrize("m", [1, 4, 16, 64, 256])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fp8_linear_real_shapes(n, k, m, dtype) -> None:
    x, q, s = _case(n, k, m, dtype, seed=n + m)
    out = torch.full((m, n), float("nan"), device="cuda", dtype=dtype)
    y = fp8_linear_triton(x, q, s, out=out)
    w = dequantize_block_fp8(q, s).double()
    exact = x.double() @ w.T
    mag = x.double().abs() @ w.abs().T
    out_ulp = 2.0**-8 if dtype == torch.bfloat16 else 0.0
    bound = (k + 8) * 2.0**-24 * mag + out_ulp * exact.abs()
    assert torch.isfinite(y).all()
    assert ((y.double() - exact).abs() <= bound).all()


# Launch variants the decode sweep may make defaults (`kernels.launch_config` knobs; bench_fp8_linear --sweep).
VARIANTS = [
    dict(x_as_a=True),
    dict(x_as_a=True, block_n=32, k_chunk=2048),
    dict(x_as_a=True, block_n=64, k_chunk=1 << 30),
    dict(x_as_a=True, block_n=64, k_chunk=2048, unroll=2),
    dict(x_as_a=False, block_n=64, k_chunk=2048, unroll=2),
    dict(x_as_a=True, block_n=128, k_chunk=2048, pdl=True),
    dict(x_as_a=True, block_n=128, stream_k=264),
    dict(x_as_a=True, block_n=64, stream_k=264, pdl=True),
]


@pytest.mark.parametrize("knobs", VARIANTS, ids=lambda kw: "-".join(f"{k}{v}" for k, v in kw.items()))
@pytest.mark.parametrize("n, k", [(3 * 8192 + 256, 4096), (8192, 128), (1000, 1000)])
@pytest.mark.parametrize("m", [1, 16, 64])
def test_fp8_linear_variants_real_shapes(n, k, m, knobs) -> None:
    """Each variant within the bound, reproducible, and (decode tiles) a row alone gives the bits it has in the
    batch; ``[1000, 1000]``: K not a multiple of 16 (masked tails)."""
    x, q, s = _case(n, k, m, torch.bfloat16, seed=n + k + m)
    out = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
    y = fp8_linear_triton(x, q, s, out=out, **knobs)
    w = dequantize_block_fp8(q, s).double()
    exact = x.double() @ w.T
    bound = (k + 8) * 2.0**-24 * (x.double().abs() @ w.abs().T) + 2.0**-8 * exact.abs()
    assert torch.isfinite(y).all() and ((y.double() - exact).abs() <= bound).all()
    assert torch.equal(fp8_linear_triton(x, q, s, **knobs), y)
    if m <= 16:
        assert torch.equal(fp8_linear_triton(x[m // 2 : m // 2 + 1], q, s, **knobs), y[m // 2 : m // 2 + 1])


def test_fp8_linear_graph_capture_and_row_independence() -> None:
    x, q, s = _case(4096, 8192, 4, torch.bfloat16, seed=3)
    y_eager = fp8_linear_triton(x, q, s)  # warm-up: compiles and caches the split scratch
    assert torch.equal(fp8_linear_triton(x, q, s), y_eager)  # bitwise reproducible
    out = torch.empty_like(y_eager)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fp8_linear_triton(x, q, s, out=out)
    for _ in range(3):
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, y_eager)
    # A decode row gives the same bits alone as inside a verify batch (the launch shape ignores M within a tile).
    assert torch.equal(fp8_linear_triton(x[1:2], q, s), y_eager[1:2])


@pytest.mark.parametrize("n, k", [(3 * 8192 + 256, 4096), (4096, 12288), (8192, 128), (1000, 1000)])
@pytest.mark.parametrize("m", [1, 16])
@pytest.mark.parametrize("trigger", ["start", "end"])
def test_pdl_launch_waits_for_the_kernel_before_it(n, k, m, trigger, monkeypatch) -> None:
    """Programmatic dependent launch (`trtllm_glm.pdl`): the FP8 linear may start while the norm before it (which
    triggers at its start, or after its last store with ``TRTLLM_GLM_PDL_TRIGGER=end``) still writes x, and a second
    norm may start while the linear still writes y (with ``end`` the linear triggers after its main loop, before
    it stores y or joins its partials). Poisoned before every step (NaN), x is produced by the first norm and read
    by the PDL linear, y produced by the linear and read by the second norm: a read before the wait gives NaN or
    stale rows. Eager and graph-replayed, over many steps with fresh inputs, y and the second norm's output equal
    the plain launches' bit for bit (PDL changes no arithmetic)."""
    from trtllm_glm.norm import row_norm
    from trtllm_glm.pdl import PDL_ENV, PDL_TRIGGER_ENV, has_pdl

    if not has_pdl(torch.device("cuda")):
        pytest.skip("needs sm_90+")
    monkeypatch.setenv(PDL_TRIGGER_ENV, trigger)
    _, q, s = _case(n, k, m, torch.bfloat16, seed=n + 7 * m)
    src = torch.randn(m, k, device="cuda").to(torch.bfloat16)
    w = torch.rand(k, device="cuda").to(torch.bfloat16) + 0.5
    x = torch.empty(m, k, device="cuda", dtype=torch.bfloat16)
    y = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    z = torch.empty(m, n, device="cuda", dtype=torch.float32)

    def step(pdl: bool) -> None:
        x.fill_(float("nan"))
        row_norm(src, 1e-6, weight=w, out=x)
        fp8_linear_triton(x, q, s, out=y, pdl=pdl)
        row_norm(y, 1e-6, out=z)

    def fresh(i: int) -> None:
        src.copy_(torch.randn(m, k, device="cuda", generator=torch.Generator(device="cuda").manual_seed(i)))
        y.fill_(float("nan"))
        z.fill_(float("nan"))

    monkeypatch.setenv(PDL_ENV, "0")
    want = []
    for i in range(8):
        fresh(i)
        step(False)
        want.append((y.clone(), z.clone()))
    monkeypatch.setenv(PDL_ENV, "1")  # the norms too: launched with PDL, they trigger where the variable says
    step(True)  # compile, cache the scratch
    for i in range(8):
        fresh(i)
        step(True)
        assert torch.equal(y, want[i][0]) and torch.equal(z, want[i][1]), i
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step(True)
    for _ in range(3):
        for i in range(8):
            fresh(i)
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(y, want[i][0]) and torch.equal(z, want[i][1]), i


def test_dispatch_takes_the_kernel_on_cuda() -> None:
    x, q, s = _case(512, 384, 3, torch.bfloat16, seed=5)
    y = fp8_linear(x, q, s)
    torch.testing.assert_close(y.float(), fp8_linear_reference(x.float(), q, s), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("skip", [["lm_head", "mlp.experts"], ["lm_head"]], ids=["experts-bf16", "experts-fp8"])
def test_fp8_model_on_cuda_graphs_and_reference(skip) -> None:
    """``experts-fp8`` also needs the FP8 MoE kernels (branch fp8moe); ``experts-bf16`` checks this branch alone."""
    from trtllm_glm import LLM, SamplingParams
    from trtllm_glm.config import Glm5NextConfig, QuantConfig
    from trtllm_glm.models.glm5_next import Glm5NextForCausalLM
    from trtllm_glm.modules.linear import Fp8Linear, dequantize_fp8_linears_

    cfg = Glm5NextConfig.from_pretrained("tiny")

    def build(dtype: torch.dtype) -> Glm5NextForCausalLM:
        m = Glm5NextForCausalLM.from_config(cfg, seed=4)
        m.quantize_fp8_(QuantConfig.block_fp8(128, skip))
        m = m.to(device="cuda", dtype=dtype)
        m.keep_fp32_params_()
        return m.eval()

    fp8 = build(torch.bfloat16)
    assert isinstance(fp8.model.layers[0].self_attn.q_proj, Fp8Linear)
    assert fp8.model.layers[0].self_attn.q_proj.weight.is_cuda
    assert fp8.model.layers[0].self_attn.q_proj.weight.dtype == torch.float8_e4m3fn
    prompts = [[5, 6, 7, 8, 9, 10, 11], list(range(30, 70))]
    sp = SamplingParams(max_tokens=12, ignore_eos=True)
    eager = [o.outputs[0].token_ids for o in LLM(fp8, cuda_graph_config=None, warmup=False).generate(prompts, sp)]
    graphs = [o.outputs[0].token_ids for o in LLM(fp8, warmup=False).generate(prompts, sp)]
    assert graphs == eager
    # Context logits of the FP8 path against the fp32 model holding the dequantised weights.
    ctx = SamplingParams(max_tokens=1, return_context_logits=True)
    a = LLM(fp8, cuda_graph_config=None, warmup=False).generate(prompts[1], ctx).context_logits.float()
    ref = build(torch.float32)
    dequantize_fp8_linears_(ref, torch.float32)
    b = LLM(ref, cuda_graph_config=None, warmup=False).generate(prompts[1], ctx).context_logits.float()
    assert (a - b).abs().max() <= 0.05 * b.abs().max()  # bf16 activations against fp32
