"""Fused residual sites (`trtllm_glm.mhc.mhc_pre_norm`, `post_mix_partials`; ``TRTLLM_GLM_MHC_FUSE``) against their
torch reference (`trtllm_glm.modules.mhc.mhc_pre_norm_reference`) and against the unfused kernels, on the CPU through
Triton's interpreter (fp32 and fp16; the interpreter's bf16 arithmetic is wrong). Outputs are poisoned with NaN
first (``out=`` buffers), shapes ragged: token counts across the 16-row tile, hidden sizes off the 32-wide units,
3 streams (a padded ``[S, S]`` tile)."""

from __future__ import annotations

import pytest
import torch

from trtllm_glm import mhc as K
from trtllm_glm.modules import mhc as R
from trtllm_glm.norm import row_norm
from trtllm_glm.numerics import batch_invariant_mode

pytestmark = pytest.mark.cpu_only

KW = dict(norm_eps=1e-6, hc_eps=1e-6, sinkhorn_iters=20)
RMS_EPS = 1e-5


def _inputs(n: int, s: int, d: int, seed: int, dtype: torch.dtype = torch.float32):
    g = torch.Generator().manual_seed(seed)
    m = (2 + s) * s
    streams = (3.0 * torch.randn(n, s, d, generator=g)).to(dtype)
    fn = torch.randn(m, s * d, generator=g) * (2.0 / (s * d) ** 0.5)
    base = torch.randn(m, generator=g)
    scale = 1.0 + 0.3 * torch.randn(3, generator=g)
    w = 1.0 + 0.5 * torch.randn(d, generator=g)
    block_out = torch.randn(n, d, generator=g).to(dtype)
    post = 2.0 * torch.rand(n, s, generator=g)
    comb = torch.rand(n, s, s, generator=g)
    return streams, fn, base, scale, w, (block_out, post, comb)


def _poisoned(n: int, s: int, d: int, dtype: torch.dtype):
    nan = float("nan")
    return (
        torch.full((n, s, d), nan, dtype=dtype),
        torch.full((n, d), nan, dtype=dtype),
        torch.full((n, s), nan),
        torch.full((n, s, s), nan),
    )


@pytest.mark.parametrize("with_prev", [False, True])
@pytest.mark.parametrize(
    "n,s,d,dtype",
    [(1, 4, 64, torch.float32), (5, 4, 200, torch.float32), (17, 3, 40, torch.float32), (3, 4, 72, torch.float16)],
)
def test_site_matches_reference(with_prev: bool, n: int, s: int, d: int, dtype: torch.dtype) -> None:
    streams, fn, base, scale, w, prev = _inputs(n, s, d, seed=100 * n + d + with_prev, dtype=dtype)
    prev = prev if with_prev else None
    out = _poisoned(n, s, d, dtype)
    got = K.mhc_pre_norm(streams, fn, base, scale, w, **KW, rms_eps=RMS_EPS, prev=prev, out=out)
    want = R.mhc_pre_norm_reference(streams, fn, base, scale, w, **KW, rms_eps=RMS_EPS, prev=prev)
    if with_prev:
        assert got[0] is out[0]
    else:
        assert got[0] is streams
    assert all(g is o for g, o in zip(got[1:], out[1:]))
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    for g, r in zip(got, want):
        assert not g.isnan().any()
        torch.testing.assert_close(g, r, rtol=tol, atol=tol)


@pytest.mark.parametrize(
    "launch",
    [dict(split=1), dict(split=3, block_n=16, block_k=16), dict(split=1000, block_k=16), dict(block_n=32)],
)
@pytest.mark.parametrize("n,d", [(1, 40), (18, 72)])
def test_post_mix_is_post_then_projection_bit_for_bit(launch: dict, n: int, d: int) -> None:
    """The fused expand + projection gives `mhc_post`'s streams and `mix_partials`'s workspace exactly, at the same
    launch shape (uneven units per program, units off the hidden size, token tiles with masked rows)."""
    s = 4
    streams, fn, _, _, _, prev = _inputs(n, s, d, seed=n + d)
    out = torch.full((n, s, d), float("nan"))
    got, ws = K.post_mix_partials(streams, *prev, fn, out=out, **launch)
    assert got is out
    want = K.mhc_post(streams, *prev)
    assert torch.equal(got, want)
    want_ws = K.kernel_module("cpu").mix_partials(want, fn, **launch)
    assert torch.equal(ws, want_ws)


def test_fused_kernels_are_batch_invariant() -> None:
    """In the batch-invariant mode a row's fused-site and end results do not depend on the other rows of the step
    (row 0 alone and among 20: one token tile and one split whatever the row count)."""
    n, s, d = 20, 4, 72
    streams, fn, base, scale, w, prev = _inputs(n, s, d, seed=12)
    with batch_invariant_mode(True):
        full = K.mhc_pre_norm(streams, fn, base, scale, w, **KW, rms_eps=RMS_EPS, prev=prev)
        one = K.mhc_pre_norm(streams[:1], fn, base, scale, w, **KW, rms_eps=RMS_EPS, prev=tuple(t[:1] for t in prev))
        end_full = K.mhc_post_mean_norm(streams, *prev, w, rms_eps=RMS_EPS)
        end_one = K.mhc_post_mean_norm(streams[:1], *(t[:1] for t in prev), w, rms_eps=RMS_EPS)
    for a, b in zip(full, one):
        assert torch.equal(a[:1], b)
    assert torch.equal(end_full[:1], end_one)


@pytest.mark.parametrize("invariant", [False, True])
def test_site_is_the_unfused_kernels_bit_for_bit(invariant: bool) -> None:
    """`mhc_pre_norm` equals `mhc_post`, `mhc_pre` and `row_norm` run apart (the interpreter's reductions are exact
    numpy sums, so this checks the same operations in the same roundings, not the GPU's reduction trees)."""
    n, s, d = 6, 4, 96
    streams, fn, base, scale, w, prev = _inputs(n, s, d, seed=5)
    with batch_invariant_mode(invariant):
        new, x, post, comb, x_in = K.mhc_pre_norm(
            streams, fn, base, scale, w, **KW, rms_eps=RMS_EPS, prev=prev, return_x_in=True
        )
        want_new = K.mhc_post(streams, *prev)
        want_x_in, want_post, want_comb = K.mhc_pre(want_new, fn, base, scale, **KW)
        want_x = row_norm(want_x_in, RMS_EPS, weight=w)
    for g, r in [(new, want_new), (x_in, want_x_in), (post, want_post), (comb, want_comb), (x, want_x)]:
        assert torch.equal(g, r)


@pytest.mark.parametrize(
    "n,s,d,dtype", [(1, 4, 64, torch.float32), (9, 4, 200, torch.float32), (4, 3, 40, torch.float32),
                    (5, 4, 72, torch.float16)],
)  # fmt: skip
def test_end_matches_reference(n: int, s: int, d: int, dtype: torch.dtype) -> None:
    """`mhc_post_mean_norm` (last expand + stream mean + final norm) against its torch reference; with 4 streams
    in fp32 against the unfused kernels and torch's mean bit for bit, streams read in place with stride 0."""
    streams, _, _, _, w, prev = _inputs(n, s, d, seed=7 * n + d, dtype=dtype)
    out = torch.full((n, d), float("nan"), dtype=dtype)
    got = K.mhc_post_mean_norm(streams, *prev, w, rms_eps=RMS_EPS, out=out)
    assert got is out and not out.isnan().any()
    want = R.mhc_post_mean_norm_reference(streams, *prev, w, rms_eps=RMS_EPS)
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    if s == 4 and dtype == torch.float32:
        assert torch.equal(got, row_norm(K.mhc_post(streams, *prev).mean(dim=1), RMS_EPS, weight=w))
        flat = streams[:, 0].contiguous()
        wide = flat.unsqueeze(1).expand(-1, s, -1)
        assert torch.equal(
            K.mhc_post_mean_norm(wide, *prev, w, rms_eps=RMS_EPS),
            K.mhc_post_mean_norm(wide.contiguous(), *prev, w, rms_eps=RMS_EPS),
        )


def test_empty_batch_and_shape_errors() -> None:
    streams, fn, base, scale, w, prev = _inputs(0, 4, 32, seed=1)
    new, x, post, comb = K.mhc_pre_norm(streams, fn, base, scale, w, **KW, rms_eps=RMS_EPS, prev=prev)
    assert new.shape == (0, 4, 32) and x.shape == (0, 32) and post.shape == (0, 4) and comb.shape == (0, 4, 4)
    streams, fn, base, scale, w, prev = _inputs(2, 4, 32, seed=2)
    with pytest.raises(ValueError, match="norm"):
        K.mhc_pre_norm(streams, fn, base, scale, w[:-1], **KW, rms_eps=RMS_EPS)
    with pytest.raises(ValueError, match="must not be the input streams"):
        K.post_mix_partials(streams, *prev, fn, out=streams)


def test_switch_values(monkeypatch: pytest.MonkeyPatch) -> None:
    """``TRTLLM_GLM_MHC_FUSE`` wins; unset, ``TRTLLM_GLM_DECODE_FUSE`` decides (both graph fusions); else off."""
    from trtllm_glm.envs import DECODE_FUSE
    from trtllm_glm.logits import GREEDY_FUSE_CAST_ENV, greedy_fuse_cast

    DECODE_FUSE_ENV = DECODE_FUSE.name

    monkeypatch.delenv(R.MHC_FUSE_ENV, raising=False)
    monkeypatch.delenv(GREEDY_FUSE_CAST_ENV, raising=False)
    monkeypatch.delenv(DECODE_FUSE_ENV, raising=False)
    assert not R.mhc_fuse() and not greedy_fuse_cast()
    monkeypatch.setenv(DECODE_FUSE_ENV, "1")
    assert R.mhc_fuse() and greedy_fuse_cast()
    monkeypatch.setenv(R.MHC_FUSE_ENV, "0")
    assert not R.mhc_fuse() and greedy_fuse_cast()
    monkeypatch.setenv(DECODE_FUSE_ENV, "2")
    with pytest.raises(ValueError, match=DECODE_FUSE_ENV):
        greedy_fuse_cast()
    monkeypatch.delenv(DECODE_FUSE_ENV)
    monkeypatch.delenv(R.MHC_FUSE_ENV)
    assert not R.mhc_fuse()
    monkeypatch.setenv(R.MHC_FUSE_ENV, "1")
    assert R.mhc_fuse()
    monkeypatch.setenv(R.MHC_FUSE_ENV, "yes")
    with pytest.raises(ValueError, match="TRTLLM_GLM_MHC_FUSE"):
        R.mhc_fuse()


def _tiny4():
    from trtllm_glm.config import Glm5NextConfig
    from trtllm_glm.models.glm5_next import Glm5NextForCausalLM, subset_config

    cfg = subset_config(Glm5NextConfig.from_pretrained("tiny"), [0, 1, 2, 3])
    return Glm5NextForCausalLM.from_config(cfg, seed=3).eval()


@pytest.mark.parametrize("invariant", [False, True])
def test_model_with_fused_sites_is_the_unfused_model(monkeypatch: pytest.MonkeyPatch, invariant: bool) -> None:
    """The 4-layer tiny model (KDA x3 + sparse MLA) on its kernels: a prompt, then two decode rows of two requests;
    with ``TRTLLM_GLM_MHC_FUSE=1`` every step's final hidden states (after the fused end: last expand, stream mean,
    final norm) equal the unfused kernels' bit for bit, and the fused path is the one taken, except in the
    batch-invariant mode, which keeps the unfused launches (the GPU's norm sums would change its bits)."""

    from benchmarks.harness.model_harness import ModelHarness

    for var in ("TRTLLM_GLM_MHC_BACKEND", "TRTLLM_GLM_NORM_BACKEND"):
        monkeypatch.setenv(var, "triton")
    model = _tiny4()
    calls: dict[str, int] = {"fused": 0}
    real = K.mhc_pre_norm

    def counting(*a, **k):
        calls["fused"] += 1
        return real(*a, **k)

    outs = {}
    with batch_invariant_mode(invariant):
        for setting in ("0", "1"):
            monkeypatch.setenv(R.MHC_FUSE_ENV, setting)
            monkeypatch.setattr(K, "mhc_pre_norm", counting)
            h = ModelHarness(model, max_seq_len=32)
            steps = [h.step([(0, [3, 4, 5, 6, 7])]), h.step([(1, [9, 10, 11])])]
            steps.append(h.step([(0, [8]), (1, [12])], num_decode_seqs=2))
            steps.append(h.step([(0, [13]), (1, [14])], num_decode_seqs=2))
            outs[setting] = steps
    assert calls["fused"] == (0 if invariant else 4 * 2 * 4)  # 4 steps x 4 layers x 2 sites, in the fused run
    for a, b in zip(outs["0"], outs["1"]):
        assert torch.equal(a, b)


def test_fused_kernels_compile_for_sm90() -> None:
    """The fused kernels as the decode step launches them at the real geometry (bf16 streams, S = 4, D = 4096: the
    finishing kernel and the end holding the whole row with 8 warps) compile for the H200 (the interpreter never
    compiles them)."""
    from tests.triton_compile import compile_sm90, recording

    n, s, d = 1, 4, 4096
    streams, fn, base, scale, w, prev = _inputs(n, s, d, seed=11)
    streams, w = streams.bfloat16(), w.bfloat16()
    prev = (prev[0].bfloat16(), prev[1], prev[2])
    with recording() as rec:
        K.mhc_pre_norm(streams, fn, base, scale, w, **KW, rms_eps=RMS_EPS, prev=prev)
        K.mhc_pre_norm(streams, fn, base, scale, w, **KW, rms_eps=RMS_EPS)
        K.mhc_post_mean_norm(streams, *prev, w, rms_eps=RMS_EPS)
    assert not rec.unsupported
    names = {spec.kernel for spec in rec.specs.values()}
    assert {"_post_mix_kernel", "_pre_finish_kernel", "_mix_partial_kernel", "_post_mean_norm_kernel"} <= names
    results = compile_sm90(list(rec.specs.values()))
    assert all(r["ok"] for r in results), results
