"""The batch-invariant mode (issue 31) on the GPU, bf16, at the real GLM-5.3-Flash geometry: each kernel of this
part's dispatch gives a row the same bits at M = 1, 3, 8, 64 and beyond (alone, shifted, inside more rows, and
replayed from a CUDA graph), and end to end on the 4-layer real-geometry slice (CUDA graphs on) speculative greedy
decoding (MTP K = 3, n-gram K = 7, oracle drafts) gives plain greedy decoding's logits bit for bit at batch 1 and
16 with mixed prompt lengths, and a request alone gives the logits it gets inside a batch of 16.

The end-to-end cases need the attention side of issue 31 too (KDA verify == decode bits, sparse-MLA split counts
per context length): they fail on a branch without it. Needs CUDA (tests/conftest.py skips ``gpu`` tests
without it). About 2 minutes on an H200 (one model, built on the device; few tokens).
"""

from __future__ import annotations

import random
from functools import partial

import pytest
import torch
import torch.nn.functional as F

from trtllm_glm.config import Glm5NextConfig
from trtllm_glm.linear import invariant_linear_triton, linear_fp32, model_linear
from trtllm_glm.numerics import batch_invariant_mode

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

ROWS = [1, 3, 8, 64]
FULL = 200  # rows of the reference call: more than one 64-row block, not a multiple of it
H = 4096


def _x(m: int, k: int, seed: int = 0, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(m, k, device="cuda", generator=g).to(dtype)


def _w(n: int, k: int, seed: int = 1) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(seed)
    return (torch.randn(n, k, device="cuda", generator=g) * k**-0.5).to(torch.bfloat16)


def _assert_rows_invariant(fn, x: torch.Tensor) -> None:
    full = fn(x)
    for m in ROWS:
        assert torch.equal(fn(x[:m]), full[:m]), f"M = {m}"
    for i in (7, 63, 64, 150):
        assert torch.equal(fn(x[i : i + 1])[0], full[i]), f"row {i} alone"
    assert torch.equal(fn(x[60:130]), full[60:130]), "rows across the 64-row tiles"


# Real projection shapes (N, K): KDA / MLA input GEMMs, o_proj, dense MLP gate|up and down, the router, the
# indexer head weights, and the LM head.
SHAPES = [(4096, 4096), (12288 * 2, 4096), (4096, 12288), (288, 4096), (32, 4096), (154880, 4096), (2112, 4096)]


@pytest.mark.parametrize(("n", "k"), SHAPES)
def test_invariant_gemm_rows_at_real_shapes(n: int, k: int) -> None:
    w = _w(n, k)
    x = _x(FULL, k)
    _assert_rows_invariant(lambda t: invariant_linear_triton(t, w), x)
    # Four weight tiles per program (the prefill option) and other row tiles keep the bits / the invariance.
    assert torch.equal(invariant_linear_triton(x, w, group_n=4), invariant_linear_triton(x, w, group_n=1))
    for bm in (16, 32):
        _assert_rows_invariant(partial(invariant_linear_triton, weight=w, block_m=bm, group_n=4), x)
    y = invariant_linear_triton(x, w, out_dtype=torch.float32)
    ref = x.double() @ w.double().T
    assert ((y.double() - ref).abs() <= 1e-5 * (x.double().abs() @ w.double().abs().T) + 1e-30).all()


@pytest.mark.parametrize(("n", "k"), [(512, 128), (128, 512)])
def test_invariant_bmm_rows_at_mla_shapes(n: int, k: int) -> None:
    """The absorbed attention's per-head products (64 heads): ``q_nope @ W_uk`` and ``o_lat @ W_uv^T``."""
    from trtllm_glm.linear import invariant_bmm

    g = torch.Generator(device="cuda").manual_seed(12)
    w = (torch.randn(64, n, k, device="cuda", generator=g) * k**-0.5).to(torch.bfloat16)
    x = torch.randn(FULL, 64 * k, device="cuda", generator=g).to(torch.bfloat16).view(FULL, 64, k)
    _assert_rows_invariant(lambda t: invariant_bmm(t, w), x)
    ref = torch.einsum("mbk,bnk->mbn", x.double(), w.double())
    bound = 1e-5 * torch.einsum("mbk,bnk->mbn", x.double().abs(), w.double().abs())
    assert ((invariant_bmm(x, w, out_dtype=torch.float32).double() - ref).abs() <= bound + 1e-30).all()


def test_mode_dispatch_rows_and_cuda_graph() -> None:
    """`model_linear`, `linear_fp32` (router) and the block-FP8 linear in the mode; a captured call replays the
    eager bits."""
    from trtllm_glm.quant.fp8 import quantize_block_fp8
    from trtllm_glm.quant.ops import fp8_linear

    w, wr = _w(4096, H, 2), _w(288, H, 3)
    q, s = quantize_block_fp8(_w(3072, H, 4).float(), 128)
    x = _x(FULL, H, 5)
    with torch.no_grad(), batch_invariant_mode(True):
        for fn in (lambda t: model_linear(t, w), lambda t: linear_fp32(t, wr), lambda t: fp8_linear(t, q, s, 128)):
            _assert_rows_invariant(fn, x)
        static = x[:8].clone()
        eager = model_linear(static, w)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = model_linear(static, w)
        static.copy_(x[8:16])
        graph.replay()
        assert torch.equal(out, model_linear(x[8:16], w))
        assert not torch.equal(out, eager)


def test_fused_moe_rows_in_mode() -> None:
    from trtllm_glm.moe.kernels import fused_moe

    e, inter, k = 288, 2048, 8
    g = torch.Generator(device="cuda").manual_seed(6)
    w13 = (torch.randn(e, 2 * inter, H, device="cuda", generator=g) * H**-0.5).to(torch.bfloat16)
    w2 = (torch.randn(e, H, inter, device="cuda", generator=g) * inter**-0.5).to(torch.bfloat16)
    x = _x(FULL, H, 7)
    ids = torch.stack([torch.randperm(e, device="cuda", generator=g)[:k] for _ in range(FULL)])
    wts = torch.rand(FULL, k, device="cuda", generator=g)
    with torch.no_grad(), batch_invariant_mode(True):

        def fn(t: torch.Tensor, rows: slice = slice(None)) -> torch.Tensor:
            return fused_moe(t, ids[rows], wts[rows], w13, w2, 7.0)

        full = fn(x)
        for m in ROWS:
            assert torch.equal(fn(x[:m], slice(0, m)), full[:m]), f"M = {m}"
        for i in (5, 150):
            assert torch.equal(fn(x[i : i + 1], slice(i, i + 1))[0], full[i])


def test_mhc_pre_rows_in_mode() -> None:
    from trtllm_glm.mhc import mhc_pre

    s = 4
    g = torch.Generator(device="cuda").manual_seed(8)
    streams = torch.randn(FULL, s, H, device="cuda", generator=g).to(torch.bfloat16)
    fn = torch.randn((2 + s) * s, s * H, device="cuda", generator=g) * 0.01
    base, scale = torch.randn((2 + s) * s, device="cuda", generator=g), torch.rand(3, device="cuda", generator=g)
    kw = dict(norm_eps=1e-6, hc_eps=1e-6, sinkhorn_iters=20)
    with batch_invariant_mode(True):
        full = mhc_pre(streams, fn, base, scale, **kw)
        for m in ROWS:
            part = mhc_pre(streams[:m], fn, base, scale, **kw)
            assert all(torch.equal(a, b[:m]) for a, b in zip(part, full)), f"M = {m}"


def test_default_mode_is_not_row_invariant() -> None:
    """What the mode buys: cuBLAS picks its algorithm (and split) by M, so some row changes bits (the tests above
    can fail)."""
    differs = []
    for n, k in ((4096, 4096), (24576, 4096), (4096, 12288)):
        w, x = _w(n, k, 9), _x(FULL, k, 10)
        full = F.linear(x, w)
        differs.append(any(not torch.equal(F.linear(x[:m], w), full[:m]) for m in ROWS))
    assert any(differs)


# --------------------------------------------------------------------------------------------------
# End to end on the 4-layer real-geometry slice.
GEN = 8


@pytest.fixture(scope="module")
def model():
    from trtllm_glm.models.glm5_next import Glm5NextForCausalLM, subset_config

    cfg = subset_config(Glm5NextConfig.from_pretrained("glm-5.3-flash"), [0, 1, 2, 3])
    cfg.num_nextn_predict_layers = 1
    with batch_invariant_mode(True):
        m = Glm5NextForCausalLM.from_config(cfg, seed=0, dtype="bfloat16", device="cuda", local_init=True)
    return m.eval()


def _prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1000, 50000) for _ in range(rng.choice([7, 40, 129, 300]))] for _ in range(n)]


def _run(model, prompts, spec=None, drafter=None):
    from trtllm_glm.runtime.cuda_graph import CudaGraphConfig
    from trtllm_glm.runtime.executor import Executor, ExecutorConfig
    from trtllm_glm.runtime.sampling import SamplingParams
    from trtllm_glm.runtime.speculative_executor import SpeculativeExecutor

    cfg = ExecutorConfig(tokens_per_block=64, max_tokens=32768, max_batch_size=16, max_num_tokens=1024,
                         max_seq_len=512,
                         cuda_graph_config=CudaGraphConfig(batch_sizes=[1, 4, 16], enable_padding=True))  # fmt: skip
    ex = Executor(model, cfg) if spec is None else SpeculativeExecutor(model, cfg, spec, drafter=drafter)
    sp = SamplingParams(max_tokens=GEN, ignore_eos=True, return_generation_logits=True)
    reqs = [ex.add_request(p, sp) for p in prompts]
    while ex.has_work:
        ex.step()
    return [(r.output_ids, torch.stack(list(r.generation_logits)).cpu()) for r in reqs]


def _first_difference(ref, got) -> str | None:
    for i, ((ids_a, lg_a), (ids_b, lg_b)) in enumerate(zip(ref, got)):
        if not torch.equal(lg_a, lg_b):
            step = next(j for j in range(len(lg_a)) if not torch.equal(lg_a[j], lg_b[j]))
            return f"request {i}: logits differ from step {step} (tokens equal: {ids_a == ids_b})"
    return None


@pytest.mark.parametrize("batch", [1, 16])
def test_speculative_equals_plain_bit_for_bit(model, batch: int) -> None:
    from trtllm_glm.speculative.config import MTPDecodingConfig, NGramDecodingConfig
    from trtllm_glm.speculative.drafters import OracleDrafter

    prompts = _prompts(batch, 11 + batch)
    with torch.no_grad(), batch_invariant_mode(True):
        plain = _run(model, prompts)
        cont = {i: ids for i, (ids, _) in enumerate(plain)}
        rng = random.Random(batch)
        wrong = {(i, j) for i in range(batch) for j in range(GEN) if rng.random() < 0.3}
        cases = {
            "mtp3": (MTPDecodingConfig(adaptive=False, num_nextn_predict_layers=3), None),
            "ngram7": (NGramDecodingConfig(max_draft_len=7), None),
            "oracle3": (NGramDecodingConfig(max_draft_len=3),
                        OracleDrafter(cont, lambda i, j: (i, j) in wrong, vocab_size=model.config.vocab_size)),
        }  # fmt: skip
        bad = {name: _first_difference(plain, _run(model, prompts, spec, drafter))
               for name, (spec, drafter) in cases.items()}  # fmt: skip
    assert all(v is None for v in bad.values()), bad


def test_request_alone_equals_inside_a_batch(model) -> None:
    prompts = _prompts(16, 99)
    with torch.no_grad(), batch_invariant_mode(True):
        batch = _run(model, prompts)
        alone = [_run(model, [prompts[i]])[0] for i in (0, 5, 15)]
    assert _first_difference([batch[i] for i in (0, 5, 15)], alone) is None
