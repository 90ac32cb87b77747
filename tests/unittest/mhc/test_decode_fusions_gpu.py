"""The decode-step fusions of issue 44 (compiled, CUDA): the fused mHC residual sites (``TRTLLM_GLM_MHC_FUSE``:
`trtllm_glm.mhc.mhc_pre_norm`, `post_mix_partials`, `mhc_post_mean_norm`) and the top-k sampling kernel
(``TRTLLM_GLM_SAMPLING_BACKEND``: `trtllm_glm.logits.kernels.sample_top_k`) at the real GLM-5.3-Flash sizes
(S = 4 streams of D = 4096 in bf16, a 154,880-token vocabulary), against the unfused kernels and the torch
references; then a model with the fusion off and on: greedy tokens with CUDA graphs equal, and in the
batch-invariant mode the context logits bit for bit. Each test prints what it measured (run with ``-s``).
Needs CUDA (tests/conftest.py skips ``gpu`` tests without it).
"""

from __future__ import annotations

import math

import pytest
import torch

from trtllm_glm import mhc as K
from trtllm_glm.logits import draw_reference, filter_sorted, sample_rows
from trtllm_glm.modules import mhc as R
from trtllm_glm.norm import row_norm

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

KW = dict(norm_eps=1e-6, hc_eps=1e-6, sinkhorn_iters=20)
RMS_EPS = 1e-5
S, D, V = 4, 4096, 154880


def _inputs(n: int, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    m = (2 + S) * S
    streams = (3.0 * torch.randn(n, S, D, device="cuda", generator=g)).bfloat16()
    fn = torch.randn(m, S * D, device="cuda", generator=g) * (2.0 / (S * D) ** 0.5)
    base = torch.randn(m, device="cuda", generator=g)
    scale = 1.0 + 0.3 * torch.randn(3, device="cuda", generator=g)
    w = (1.0 + 0.2 * torch.randn(D, device="cuda", generator=g)).bfloat16()
    block_out = torch.randn(n, D, device="cuda", generator=g).bfloat16()
    _, post, comb = K.mhc_pre(streams, fn, base, scale, **KW)
    return streams, fn, base, scale, w, (block_out, post, comb)


@pytest.mark.parametrize("n", [1, 7, 16, 64, 300])
def test_fused_site_against_unfused_kernels(n: int) -> None:
    """The fused expand + projection is the unfused pair bit for bit (same arithmetic, same launch shape); the
    finishing kernel with the norm agrees with `mhc_pre` + `row_norm` (bits counted and printed: the norm's
    reduction runs in another kernel's layout) and with the fp32 torch reference. n = 300 takes the tensor-core
    projection (expand apart)."""
    streams, fn, base, scale, w, prev = _inputs(n, seed=n)
    nan = float("nan")
    out = (
        torch.full((n, S, D), nan, device="cuda", dtype=torch.bfloat16),
        torch.full((n, D), nan, device="cuda", dtype=torch.bfloat16),
        torch.full((n, S), nan, device="cuda"),
        torch.full((n, S, S), nan, device="cuda"),
    )
    new, x, post, comb, x_in = K.mhc_pre_norm(
        streams, fn, base, scale, w, **KW, rms_eps=RMS_EPS, prev=prev, out=out, return_x_in=True
    )
    want_new = K.mhc_post(streams, *prev)
    assert torch.equal(new, want_new)
    if n < 256:
        _, ws = K.post_mix_partials(streams, *prev, fn)
        assert torch.equal(ws, K.kernel_module("cuda").mix_partials(want_new, fn))
    want_x_in, want_post, want_comb = K.mhc_pre(want_new, fn, base, scale, **KW)
    want_x = row_norm(want_x_in, RMS_EPS, weight=w)
    # The finishing kernel keeps mhc_pre's warps and tiles: the weights and the collapse are its bits.
    assert torch.equal(post, want_post) and torch.equal(comb, want_comb) and torch.equal(x_in, want_x_in)
    same = (x == want_x).float().mean().item()
    print(f"\nn={n}: normed input bit-equal to mhc_pre + row_norm in {100 * same:.4f} % of values")
    torch.testing.assert_close(x, want_x, rtol=8e-3, atol=8e-3)
    ref = R.mhc_pre_norm_reference(streams, fn, base, scale, w, **KW, rms_eps=RMS_EPS, prev=prev)
    torch.testing.assert_close(x.float(), ref[1].float(), rtol=2e-2, atol=2e-2)


def test_fused_kernels_are_batch_invariant() -> None:
    """In the batch-invariant mode a row's fused results do not depend on the step's other rows (1 vs 48 rows)."""
    from trtllm_glm.numerics import batch_invariant_mode

    streams, fn, base, scale, w, prev = _inputs(48, seed=7)
    with batch_invariant_mode(True):
        full = K.mhc_pre_norm(streams, fn, base, scale, w, **KW, rms_eps=RMS_EPS, prev=prev)
        one = K.mhc_pre_norm(streams[:1], fn, base, scale, w, **KW, rms_eps=RMS_EPS, prev=tuple(t[:1] for t in prev))
        end_full = K.mhc_post_mean_norm(streams, *prev, w, rms_eps=RMS_EPS)
        end_one = K.mhc_post_mean_norm(streams[:1], *(t[:1] for t in prev), w, rms_eps=RMS_EPS)
    for a, b in zip(full, one):
        assert torch.equal(a[:1], b)
    assert torch.equal(end_full[:1], end_one)


@pytest.mark.parametrize("n", [1, 16, 64])
def test_fused_end_against_unfused_kernels(n: int) -> None:
    streams, _, _, _, w, prev = _inputs(n, seed=100 + n)
    out = torch.full((n, D), float("nan"), device="cuda", dtype=torch.bfloat16)
    got = K.mhc_post_mean_norm(streams, *prev, w, rms_eps=RMS_EPS, out=out)
    want = row_norm(K.mhc_post(streams, *prev).mean(dim=1), RMS_EPS, weight=w)
    same = (got == want).float().mean().item()
    print(f"\nn={n}: fused end bit-equal to mhc_post + mean + row_norm in {100 * same:.4f} % of values")
    torch.testing.assert_close(got, want, rtol=8e-3, atol=8e-3)


@pytest.mark.parametrize("n", [1, 16])
def test_fused_sites_in_a_graph_and_their_time(n: int) -> None:
    """Both variants of one residual site (expand, projection, finish, norm) captured and replayed: equal to the
    eager call, and the replay times printed."""
    streams, fn, base, scale, w, prev = _inputs(n, seed=200 + n)

    def unfused():
        new = K.mhc_post(streams, *prev)
        x_in, post, comb = K.mhc_pre(new, fn, base, scale, **KW)
        return row_norm(x_in, RMS_EPS, weight=w)

    def fused():
        return K.mhc_pre_norm(streams, fn, base, scale, w, **KW, rms_eps=RMS_EPS, prev=prev)[1]

    times = {}
    for name, f in (("unfused", unfused), ("fused", fused)):
        eager = f()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            f()
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(20):
                res = f()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(res, eager)
        t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0.record()
        for _ in range(10):
            graph.replay()
        t1.record()
        torch.cuda.synchronize()
        times[name] = 1e3 * t0.elapsed_time(t1) / 200
    print(f"\nn={n}: one residual site, graph replay: unfused {times['unfused']:.2f} us, fused {times['fused']:.2f} us")


def test_sampling_kernel_at_the_real_vocabulary() -> None:
    """Top-k sampling rows at V = 154,880: the kernel's token is the reference's wherever the uniform is not within
    rounding of a boundary; the times of both paths are printed."""
    g = torch.Generator(device="cuda").manual_seed(3)
    n = 16
    logits = torch.randn(n, V, device="cuda", generator=g) * 4.0
    logits[0, 100] = logits[0, 150000] = logits[0].max() + 0.5  # a tie across chunks: id 100 first
    top_k = [1, 5, 20, 50, 64, 100, 256, 40] * 2
    top_p = [1.0, 0.9, 0.8, 1.0, 0.95, 0.5, 0.99, 1.0] * 2
    temps = [0.7, 1.0, 0.3, 1.5, 0.8, 1.0, 2.0, 0.6] * 2
    checked = skipped = 0
    for trial in range(5):
        u = torch.rand(n, dtype=torch.float64, generator=torch.Generator().manual_seed(trial)).tolist()
        vals = []
        for i in range(n):
            vals += [u[i], temps[i], top_p[i] if top_p[i] < 1 else math.inf, top_k[i], i]
        rp = torch.tensor(vals, dtype=torch.float64, device="cuda").view(-1, 5)
        out = torch.full((n,), -1, dtype=torch.int64, device="cuda")
        sample_rows(logits, rp, out, top_k=top_k, backend="triton")
        want = draw_reference(logits, rp)
        _, probs, keep = filter_sorted(logits, rp)
        c = torch.cumsum((probs * keep).double(), dim=-1)
        near = ((c / c[:, -1:] - rp[:, 0:1]).abs() < 1e-6).any(dim=-1)
        for i in range(n):
            if bool(near[i]):
                skipped += 1
            else:
                checked += 1
                assert int(out[i]) == int(want[i]), (trial, i)
    assert checked >= 70
    times = {}
    for name, f in (
        ("kernel", lambda: sample_rows(logits, rp, out, top_k=top_k, backend="triton")),
        ("torch", lambda: sample_rows(logits, rp, out, top_k=top_k, backend="torch")),
    ):
        f()
        torch.cuda.synchronize()
        t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0.record()
        for _ in range(20):
            f()
        t1.record()
        torch.cuda.synchronize()
        times[name] = 1e3 * t0.elapsed_time(t1) / 20
    print(f"\n16 sampled rows at V={V}: kernel {times['kernel']:.1f} us, torch {times['torch']:.1f} us (eager)")


@pytest.mark.parametrize("invariant", [False, True])
def test_model_fused_sites_change_no_token(monkeypatch: pytest.MonkeyPatch, invariant: bool) -> None:
    """The tiny preset in bf16 with ``TRTLLM_GLM_MHC_FUSE`` 0 and 1: greedy tokens with CUDA graphs (captured under
    each setting) the same; context logits compared (bit for bit in the batch-invariant mode, which keeps the
    unfused launches; the difference printed otherwise)."""
    from trtllm_glm import LLM, SamplingParams
    from trtllm_glm.config import Glm5NextConfig
    from trtllm_glm.models.glm5_next import Glm5NextForCausalLM

    m = Glm5NextForCausalLM.from_config(Glm5NextConfig.from_pretrained("tiny"), seed=4)
    m = m.to(device="cuda", dtype=torch.bfloat16)
    m.keep_fp32_params_()
    prompts = [[5, 6, 7, 8, 9, 10, 11], list(range(30, 70))]
    sp = SamplingParams(max_tokens=16, ignore_eos=True)
    ctx = SamplingParams(max_tokens=1, return_context_logits=True)
    runs = {}
    for setting in ("0", "1"):
        monkeypatch.setenv(R.MHC_FUSE_ENV, setting)
        kw = {"batch_invariant": True} if invariant else {}
        logits = LLM(m.eval(), cuda_graph_config=None, **kw).generate(prompts[1], ctx).context_logits
        tokens = [o.outputs[0].token_ids for o in LLM(m.eval(), **kw).generate(prompts, sp)]
        runs[setting] = (logits, tokens)
    diff = (runs["0"][0] - runs["1"][0]).abs().max().item()
    print(f"\nbatch_invariant={invariant}: context logits max |fused - unfused| = {diff:.3g}")
    assert runs["0"][1] == runs["1"][1]
    if invariant:
        assert torch.equal(runs["0"][0], runs["1"][0])


def test_greedy_fuse_cast_changes_no_token(monkeypatch: pytest.MonkeyPatch) -> None:
    """``TRTLLM_GLM_GREEDY_FUSE_CAST`` 0 and 1 on the tiny preset in bf16 with CUDA graphs (captured under each
    setting): the same greedy tokens and the same generation logits (the fp32 copy is exact)."""
    from trtllm_glm import LLM, SamplingParams
    from trtllm_glm.config import Glm5NextConfig
    from trtllm_glm.logits import GREEDY_FUSE_CAST_ENV
    from trtllm_glm.models.glm5_next import Glm5NextForCausalLM

    m = Glm5NextForCausalLM.from_config(Glm5NextConfig.from_pretrained("tiny"), seed=5)
    m = m.to(device="cuda", dtype=torch.bfloat16)
    m.keep_fp32_params_()
    prompts = [[5, 6, 7, 8, 9, 10, 11], list(range(30, 70))]
    sp = SamplingParams(max_tokens=12, ignore_eos=True, return_generation_logits=True)
    runs = {}
    for setting in ("0", "1"):
        monkeypatch.setenv(GREEDY_FUSE_CAST_ENV, setting)
        outs = LLM(m.eval()).generate(prompts, sp)
        runs[setting] = [(o.outputs[0].token_ids, o.outputs[0].generation_logits) for o in outs]
    for (t0, l0), (t1, l1) in zip(runs["0"], runs["1"]):
        assert t0 == t1
        assert torch.equal(l0, l1)
