"""Fused mHC kernels (`trtllm_glm.mhc`) against the torch reference (`trtllm_glm.modules.mhc`), on the CPU
through Triton's interpreter, in fp32 (and fp16 for the dtype handling of the expand) at small sizes.

Inputs have a realistic spread: ``fn ~ N(0, (2 / sqrt(S * D))^2)`` gives mixing logits of std ~2 on the
RMS-normed streams, ``base ~ N(0, 1)``, ``scale ~ 1 + 0.3 N(0, 1)``, so the softmax is far from uniform and
the Sinkhorn iterations change ``comb`` a lot. Outputs are poisoned with NaN first (``out=`` buffers).
"""

from __future__ import annotations

import pytest
import torch

from trtllm_glm import mhc as K
from trtllm_glm.modules import mhc as R

pytestmark = pytest.mark.cpu_only

KW = dict(norm_eps=1e-6, hc_eps=1e-6, sinkhorn_iters=20)


def _inputs(n: int, s: int, d: int, seed: int, dtype: torch.dtype = torch.float32):
    g = torch.Generator().manual_seed(seed)
    m = (2 + s) * s
    streams = (3.0 * torch.randn(n, s, d, generator=g)).to(dtype)
    fn = torch.randn(m, s * d, generator=g) * (2.0 / (s * d) ** 0.5)
    base = torch.randn(m, generator=g)
    scale = 1.0 + 0.3 * torch.randn(3, generator=g)
    block_out = torch.randn(n, d, generator=g).to(dtype)
    return streams, fn, base, scale, block_out


def _poisoned_pre(n: int, s: int, d: int, dtype: torch.dtype):
    return (
        torch.full((n, d), float("nan"), dtype=dtype),
        torch.full((n, s), float("nan")),
        torch.full((n, s, s), float("nan")),
    )


def _check_pre(streams, fn, base, scale, *, tol: float = 1e-5, **launch) -> tuple[torch.Tensor, torch.Tensor]:
    n, s, d = streams.shape
    x_in, post, comb = _poisoned_pre(n, s, d, streams.dtype)
    got = K.mhc_pre(streams, fn, base, scale, **KW, out=(x_in, post, comb), return_pre=True, **launch)
    assert got[0] is x_in and got[2] is post and got[3] is comb
    pre = got[1]
    want_pre, want_post, want_comb = R.mhc_weights(streams, fn, base, scale, **KW)
    torch.testing.assert_close(pre, want_pre, rtol=tol, atol=tol)
    torch.testing.assert_close(post, want_post, rtol=tol, atol=tol)
    torch.testing.assert_close(comb, want_comb, rtol=tol, atol=tol)
    torch.testing.assert_close(x_in, R.mhc_collapse(streams, want_pre), rtol=tol, atol=tol)
    return post, comb


@pytest.mark.parametrize("n,d", [(1, 64), (1, 200), (5, 64), (5, 200), (37, 200)])
def test_pre_and_post_match_reference_fp32(n: int, d: int) -> None:
    s = 4
    streams, fn, base, scale, block_out = _inputs(n, s, d, seed=10 * n + d)
    post, comb = _check_pre(streams, fn, base, scale)
    # Sinkhorn is non-trivial here: the softmax alone is far from doubly stochastic.
    assert (comb - torch.full_like(comb, 1.0 / s)).abs().max() > 0.1
    out = torch.full((n, s, d), float("nan"))
    got = K.mhc_post(streams, block_out, post, comb, out=out)
    assert got is out
    torch.testing.assert_close(out, R.mhc_expand(streams, block_out, post, comb), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "launch",
    [
        dict(split=1),  # one program reads all of fn
        dict(split=3, block_n=16, block_k=32, block_d=64),  # uneven units per program, masked d slices
        dict(split=1000, block_k=16),  # split capped at the number of units
    ],
)
def test_pre_launch_shapes(launch: dict) -> None:
    streams, fn, base, scale, _ = _inputs(9, 4, 72, seed=3)
    _check_pre(streams, fn, base, scale, **launch)


@pytest.mark.parametrize("s,d", [(2, 64), (3, 40)])
def test_other_stream_counts(s: int, d: int) -> None:
    """S = 2, and S = 3 (not a power of two: padded [S, S] tile, which must stay out of every sum)."""
    n = 5
    streams, fn, base, scale, block_out = _inputs(n, s, d, seed=s)
    post, comb = _check_pre(streams, fn, base, scale)
    torch.testing.assert_close(K.mhc_post(streams, block_out, post, comb), R.mhc_expand(streams, block_out, post, comb))


@pytest.mark.parametrize("iters", [1, 2, 5])
def test_sinkhorn_iteration_counts(iters: int) -> None:
    streams, fn, base, scale, _ = _inputs(3, 4, 64, seed=iters)
    kw = dict(KW, sinkhorn_iters=iters)
    got = K.mhc_pre(streams, fn, base, scale, **kw, return_pre=True)
    want = R.mhc_weights(streams, fn, base, scale, **kw)
    torch.testing.assert_close(got[1:], want, rtol=1e-5, atol=1e-5)


def test_strided_inputs() -> None:
    """Streams with a padded token stride, a non-contiguous block output and fn / base / scale of other dtypes."""
    n, s, d = 4, 4, 48
    streams_full, fn, base, scale, _ = _inputs(n, s, d + 8, seed=7)
    streams = streams_full[..., :d]  # token stride s * (d + 8), stream stride d + 8
    fn = fn[:, : s * d].contiguous()
    bo_full = torch.randn(n, 2 * d, generator=torch.Generator().manual_seed(8))
    block_out = bo_full[:, ::2]  # last-dim stride 2: copied by the wrapper
    x_in, post, comb = K.mhc_pre(streams, fn.double(), base.double(), scale.double(), **KW)
    pre, want_post, want_comb = R.mhc_weights(streams, fn, base, scale, **KW)
    torch.testing.assert_close((post, comb), (want_post, want_comb), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x_in, R.mhc_collapse(streams, pre), rtol=1e-5, atol=1e-5)
    want = R.mhc_expand(streams, block_out, want_post, want_comb)
    torch.testing.assert_close(K.mhc_post(streams, block_out, post, comb), want, rtol=1e-5, atol=1e-5)


def test_post_in_place() -> None:
    n, s, d = 3, 4, 40
    streams, fn, base, scale, block_out = _inputs(n, s, d, seed=9)
    _, post, comb = K.mhc_pre(streams, fn, base, scale, **KW)
    want = R.mhc_expand(streams, block_out, post, comb)
    buf = streams.clone()
    assert K.mhc_post(buf, block_out, post, comb, out=buf) is buf
    torch.testing.assert_close(buf, want, rtol=1e-5, atol=1e-5)


def test_post_fp16_rounds_like_reference() -> None:
    """fp16 streams: post / comb / block output rounded to fp16, the two terms rounded, then their sum."""
    n, s, d = 5, 4, 64
    streams, fn, base, scale, block_out = _inputs(n, s, d, seed=11, dtype=torch.float16)
    _, post, comb = R.mhc_weights(streams, fn, base, scale, **KW)
    got = K.mhc_post(streams, block_out.float(), post, comb)  # fp32 block output: cast to fp16 first
    assert got.dtype == torch.float16
    dt = torch.float16
    term1 = (post.to(dt).float()[..., None] * block_out.float()[:, None, :]).to(dt)
    term2 = torch.einsum("njs,njd->nsd", comb.to(dt).float(), streams.float()).to(dt)
    want = (term1.float() + term2.float()).to(dt)
    # Exact but for a rare one-ulp flip where the fp32 sum order differs on a rounding boundary.
    torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3)
    assert (got != want).float().mean() < 0.01
    torch.testing.assert_close(got, R.mhc_expand(streams, block_out, post, comb), rtol=2e-3, atol=2e-3)


def test_empty_batch() -> None:
    streams, fn, base, scale, block_out = _inputs(1, 4, 32, seed=0)
    x_in, post, comb = K.mhc_pre(streams[:0], fn, base, scale, **KW)
    assert x_in.shape == (0, 32) and post.shape == (0, 4) and comb.shape == (0, 4, 4)
    assert K.mhc_post(streams[:0], block_out[:0], post, comb).shape == (0, 4, 32)


def test_shape_errors() -> None:
    streams, fn, base, scale, block_out = _inputs(2, 4, 32, seed=0)
    with pytest.raises(ValueError):
        K.mhc_pre(streams, fn[:, :-1], base, scale, **KW)
    with pytest.raises(ValueError):
        K.mhc_post(streams, block_out[:, :-1], torch.zeros(2, 4), torch.zeros(2, 4, 4))


def test_block_dispatch(monkeypatch: pytest.MonkeyPatch) -> None:
    """``TRTLLM_GLM_MHC_BACKEND``: CPU default is the reference; ``triton`` runs the kernels interpreted."""
    n, s, d = 3, 4, 32
    streams, fn, base, scale, _ = _inputs(n, s, d, seed=5)
    lin = torch.nn.Linear(d, d)
    kw = dict(KW, sinkhorn_iters=4)
    with torch.no_grad():
        pre, post, comb = R.mhc_weights(streams, fn, base, scale, **kw)
        ref = R.mhc_expand(streams, lin(R.mhc_collapse(streams, pre)), post, comb)
        monkeypatch.delenv(R.MHC_BACKEND_ENV, raising=False)
        assert R.mhc_backend(streams, fn) == "torch"
        assert torch.equal(R.mhc_block(streams, lin, fn, base, scale, **kw), ref)
        monkeypatch.setenv(R.MHC_BACKEND_ENV, "triton")
        assert R.mhc_backend(streams, fn) == "triton"
        torch.testing.assert_close(R.mhc_block(streams, lin, fn, base, scale, **kw), ref, rtol=1e-5, atol=1e-5)
        assert torch.equal(R.mhc_block(streams, lin, fn, base, scale, **kw, backend="torch"), ref)
        monkeypatch.setenv(R.MHC_BACKEND_ENV, "cuda")
        with pytest.raises(ValueError):
            R.mhc_block(streams, lin, fn, base, scale, **kw)
    # Under autograd: auto takes the reference (the kernels have no backward), triton refuses.
    fn_p = torch.nn.Parameter(fn.clone())
    assert R.mhc_backend(streams, fn_p, backend="auto") == "torch"
    with pytest.raises(RuntimeError):
        R.mhc_backend(streams, fn_p, backend="triton")
