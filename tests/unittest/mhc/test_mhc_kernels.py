"""Fused mHC kernels (`trtllm_glm.mhc`) against the torch reference (`trtllm_glm.modules.mhc`), on the CPU
through Triton's interpreter, in fp32 (and fp16 for the dtype handling of the expand) at small sizes.

Inputs have a realistic spread: ``fn ~ N(0, (2 / sqrt(S * D))^2)`` gives mixing logits of std ~2 on the
RMS-normed streams, ``base ~ N(0, 1)``, ``scale ~ 1 + 0.3 N(0, 1)``, so the softmax is far from uniform and
the Sinkhorn iterations change ``comb`` a lot. Outputs are poisoned with NaN first (``out=`` buffers).
"""

from __future__ import annotations

import pytest
import torch

from benchmarks.harness.mhc_fp64 import mhc_weights_fp64
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


# --------------------------------------------------------------------------------------------------
# The tensor-core projection (bf16 streams at prefill sizes). The interpreter runs its exact three-part split
# of fn with IEEE fp32 dots (its bf16 arithmetic is wrong), so these tests check the split, the masking and the
# launch shape; the tensor cores' rounding is checked on the GPU (test_mhc_kernels_gpu.py).


def _bf16_inputs(n: int, s: int, d: int, seed: int):
    streams, fn, base, scale, _ = _inputs(n, s, d, seed)
    return streams.to(torch.bfloat16), fn, base, scale


def _check_pre_fp64(streams, fn, base, scale, *, tol: float = 2e-6, **launch) -> None:
    """pre / post / comb against the weights in fp64 of the same (bf16) streams; x_in to one bf16 ulp (the
    interpreter's fp32 -> bf16 cast of the result is not round-to-nearest)."""
    n, s, d = streams.shape
    x_in, post, comb = _poisoned_pre(n, s, d, streams.dtype)
    _, pre, _, _ = K.mhc_pre(streams, fn, base, scale, **KW, out=(x_in, post, comb), return_pre=True, **launch)
    want = mhc_weights_fp64(streams, fn, base, scale, **KW)
    for got, ref in zip((pre, post, comb), want):
        torch.testing.assert_close(got.double(), ref, rtol=tol, atol=tol)
    want_x = (want[0][:, :, None] * streams.double()).sum(1)
    torch.testing.assert_close(x_in.double(), want_x, rtol=2.0**-7, atol=1e-6)


def test_tc_path_is_taken_for_prefill_sizes() -> None:
    mod = K.kernel_module("cpu")
    bf16 = torch.bfloat16
    assert mod.pre_path(mod.TC_MIN_ROWS, bf16) == "tc"
    assert mod.pre_path(mod.TC_MIN_ROWS - 1, bf16) == "fma"  # decode / verify sizes: unchanged
    assert mod.pre_path(8192, torch.float32) == "fma" and mod.pre_path(8192, torch.float16) == "fma"
    with pytest.raises(ValueError):
        mod.pre_path(8, torch.float32, "tc")  # fp32 streams are not exact bf16 MMA operands
    with pytest.raises(ValueError):
        mod.pre_path(8, bf16, "gemm")
    streams, fn, base, scale = _bf16_inputs(2, 4, 32, seed=0)
    with pytest.raises(ValueError):
        K.mhc_pre(streams, fn, base, scale, **KW, path="tc", mma="fp64")
    # Launch shape: 128-row tiles from 1024 tokens, every unit covered once, a small split.
    units = 4 * 64  # S = 4, D = 4096, block_k 64
    for n in (300, 1000, 8192):
        bn, bk, split, upp = mod.pre_tc_launch_config(n, 4, 4096, torch.device("cpu"))
        assert bk == 64 and bn == (128 if n >= 1024 else 64)
        assert split * upp >= units and (split - 1) * upp < units and split <= 64


@pytest.mark.parametrize(
    "n,d,launch",
    [
        (37, 200, dict(path="tc")),  # forced below TC_MIN_ROWS: one partial token tile, d not a multiple of 64
        (70, 72, dict(path="tc", split=3, block_n=16, block_k=16)),  # uneven units per program, several tiles
        (257, 40, dict()),  # auto from TC_MIN_ROWS: odd N, the last tile holds one token
    ],
)
def test_tc_path_matches_reference(n: int, d: int, launch: dict) -> None:
    streams, fn, base, scale = _bf16_inputs(n, 4, d, seed=n + d)
    if not launch:
        assert K.kernel_module("cpu").pre_path(n, streams.dtype) == "tc"
    _check_pre_fp64(streams, fn, base, scale, **launch)


def test_tc_projection_uses_all_of_fn() -> None:
    """The tensor-core path's workspace (`mix_partials`: mixing logits and sum of squares) against fp64, with
    positive streams and weights so that dropping ``fn``'s low part (relative size ~2^-17 on average, all of one
    sign here) shows: the bound, 2^-20 of the magnitudes, is ~8x below that."""
    mod = K.kernel_module("cpu")
    n, s, d = 45, 4, 136
    m, m_pad = (2 + s) * s, 32
    g = torch.Generator().manual_seed(4)
    streams = (1.0 + torch.rand(n, s, d, generator=g)).to(torch.bfloat16)
    fn = (torch.rand(m, s * d, generator=g) + 0.5) * 1e-2
    ws = mod.mix_partials(streams, fn, path="tc", block_n=16, block_k=32, split=3)
    assert ws.shape == (3, n, m_pad)
    got = ws.double().sum(0)
    x = streams.double().reshape(n, s * d)
    want = x @ fn.double().T
    assert ((got[:, :m] - want).abs() <= 2.0**-20 * want).all()
    torch.testing.assert_close(got[:, m], (x * x).sum(1), rtol=1e-6, atol=0)
    assert (got[:, m + 1 :] == 0).all()


def test_tc_path_not_used_in_batch_invariant_mode() -> None:
    """In the mode every N takes the FMA path (one tile, one split): a row's bits do not depend on N, across
    TC_MIN_ROWS too."""
    from trtllm_glm.numerics import batch_invariant_mode

    mod = K.kernel_module("cpu")
    n = mod.TC_MIN_ROWS + 3
    streams, fn, base, scale = _bf16_inputs(n, 4, 24, seed=6)
    with batch_invariant_mode(True):
        assert mod.pre_path(n, streams.dtype) == "fma"
        with pytest.raises(ValueError):
            mod.pre_path(n, streams.dtype, "tc")
        full = K.mhc_pre(streams, fn, base, scale, **KW)
        for rows in (slice(0, 1), slice(0, 17), slice(n - 5, n)):
            part = K.mhc_pre(streams[rows], fn, base, scale, **KW)
            assert all(torch.equal(a, b[rows]) for a, b in zip(part, full)), rows


def test_tc_kernel_compiles_for_sm90() -> None:
    """The tensor-core projection compiles for the H200 with every ``mma`` (the interpreter never compiles it),
    at both default token tiles; the launches are those `mix_partials` makes."""
    from tests.triton_compile import KernelSpec, compile_sm90

    mod = K.kernel_module("cpu")
    sig = dict(x_ptr="*bf16", fn_ptr="*fp32", ws_ptr="*fp32", N="i32", D="i32", stride_xn="i32", stride_xs="i32",
               stride_fm="i32", stride_wsp="i32", stride_wn="i32", units_per_prog="i32", n_units="i32")  # fmt: skip
    specs = [
        KernelSpec(
            "trtllm_glm.mhc.kernels",
            "_mix_partial_tc_kernel",
            sig,
            dict(M=24, M_PAD=32, BLOCK_N=bn, BLOCK_K=64, MMA=code),
        )  # fmt: skip
        for code in mod.MMA_MODES.values()
        for bn in ((64, 128) if code == 1 else (128,))
    ]
    results = compile_sm90(specs)
    assert all(r["ok"] for r in results), results
