"""The top-k sampling kernel (`trtllm_glm.logits.kernels.sample_top_k`, ``TRTLLM_GLM_SAMPLING_BACKEND=triton``)
under Triton's interpreter against its torch reference (`trtllm_glm.logits.draw_reference`): fresh random logits
with ragged vocabularies (off the 2,048-column chunk, below the rounded k), ties at the top (lower id first),
-inf columns, several temperatures / top-k / top-p per batch, and uniforms all over [0, 1) including the
ends. Rows not drawn keep the poison they were given.

The kernel's softmax and cumulative sums round in their own order, so a uniform within ~1e-6 of a boundary of the
reference's cumulative distribution may pick the neighbour; such draws are skipped (and counted: few)."""

from __future__ import annotations

import math

import pytest
import torch

from trtllm_glm.logits import SAMPLE_MAX_K, draw_reference, filter_sorted, sample_rows, sampling_backend
from trtllm_glm.runtime.sampling import Sampler, SamplingParams, make_generator

pytestmark = pytest.mark.cpu_only


def _rp(u, temps, top_p, top_k, rows) -> torch.Tensor:
    vals = []
    for x, t, p, k, r in zip(u, temps, top_p, top_k, rows):
        vals += [x, t, p if p < 1.0 else math.inf, k if k > 0 else math.inf, r]
    return torch.tensor(vals, dtype=torch.float64).view(-1, 5)


def _near_boundary(logits: torch.Tensor, rp: torch.Tensor, tol: float = 1e-6) -> list[bool]:
    """Per row of ``rp``: whether its uniform sits within ``tol`` of a boundary of the reference's kept mass."""
    rows = logits.index_select(0, rp[:, 4].long())
    _, probs, keep = filter_sorted(rows, rp)
    c = torch.cumsum((probs * keep).double(), dim=-1)
    c = c / c[:, -1:]
    return ((c - rp[:, 0:1]).abs() < tol).any(dim=-1).tolist()


@pytest.mark.parametrize("v", [300, 2048, 5000])
def test_kernel_draws_the_reference_token(v: int) -> None:
    g = torch.Generator().manual_seed(v)
    n = 7
    logits = torch.randn(n, v, generator=g) * 3.0
    logits[0, 11] = logits[0, 3] = logits[0].max() + 1.0  # a tie at the top: id 3 first
    logits[2, : v // 3] = float("-inf")
    logits[4, 17] = logits[4, v - 1] = logits[4].max() + 0.01  # tie across chunks (v > 2048)
    rows = [0, 1, 2, 4, 5, 6]  # row 3 is greedy: left as it was
    temps = [0.7, 1.0, 2.5, 0.3, 1.3, 1.0]
    top_k = [1, 2, 5, 17, 64, SAMPLE_MAX_K]
    top_p = [1.0, 0.5, 0.9, 1.0, 0.8, 0.95]
    skipped = checked = 0
    for trial in range(6):
        u = torch.rand(len(rows), dtype=torch.float64, generator=g).tolist()
        if trial == 0:
            u[0], u[1] = 0.0, 1.0 - 1e-12  # the ends of the range
        rp = _rp(u, temps, top_p, top_k, rows)
        out = torch.full((n,), -7, dtype=torch.int64)
        got = sample_rows(logits, rp, out, top_k=top_k, backend="triton")
        assert got is out and int(out[3]) == -7
        want = draw_reference(logits.index_select(0, rp[:, 4].long()), rp)
        for i, (r, near) in enumerate(zip(rows, _near_boundary(logits, rp))):
            if near:
                skipped += 1
                continue
            checked += 1
            assert int(out[r]) == int(want[i]), (trial, r)
    assert checked >= 30 and skipped <= 3


def test_top1_and_temperature_edge_cases() -> None:
    """k = 1 is the argmax whatever u is; a vocabulary smaller than k keeps all of it; tiny temperatures."""
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(3, 40, generator=g)
    rp = _rp([0.999, 0.5, 0.25], [1.0, 0.05, 3.0], [1.0, 1.0, 1.0], [1, 64, 100], [0, 1, 2])
    out = torch.full((3,), -1, dtype=torch.int64)
    sample_rows(logits, rp, out, top_k=[1, 64, 100], backend="triton")
    assert int(out[0]) == int(logits[0].argmax())
    torch.testing.assert_close(out, draw_reference(logits, rp))


def test_dispatch(monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernel only with the backend asked for and every row's k in 1 .. SAMPLE_MAX_K; the default is the
    reference; `Sampler.sample` goes through it and keeps the greedy rows' argmax."""
    from trtllm_glm.logits import kernels as _unused  # noqa: F401  (import check: the module loads)

    x = torch.randn(2, 50)
    monkeypatch.delenv("TRTLLM_GLM_SAMPLING_BACKEND", raising=False)
    assert sampling_backend(x) == "torch"
    monkeypatch.setenv("TRTLLM_GLM_SAMPLING_BACKEND", "auto")
    assert sampling_backend(x) == "torch"  # CPU logits
    monkeypatch.setenv("TRTLLM_GLM_SAMPLING_BACKEND", "triton")
    calls = []
    from trtllm_glm import logits as L

    real = L.kernel_module

    def spy(dev):
        calls.append(dev)
        return real(dev)

    monkeypatch.setattr(L, "kernel_module", spy)
    params = [SamplingParams(), SamplingParams(temperature=0.8, top_k=20, top_p=0.9)]
    gens = [make_generator(SamplingParams(seed=i)) for i in range(2)]
    out = Sampler().sample(x, params, gens)
    assert calls and int(out[0]) == int(x[0].argmax())
    assert int(out[1]) in Sampler.filtered_probs(x[1], params[1])[0].tolist()
    calls.clear()
    Sampler().sample(x, [SamplingParams(temperature=1.0), SamplingParams(temperature=0.5, top_k=300)], gens)
    assert not calls  # k off / above the bound: the reference


def test_sampler_draws_the_same_with_either_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    """Seeded requests give the same tokens with the kernel as with the reference (uniforms away from boundaries
    at these seeds), in a batch mixing greedy and sampled rows."""
    g = torch.Generator().manual_seed(9)
    logits = torch.randn(5, 3001, generator=g) * 2.0
    params = [
        SamplingParams(temperature=0.9, top_k=40, seed=1),
        SamplingParams(),
        SamplingParams(temperature=1.2, top_k=8, top_p=0.7, seed=2),
        SamplingParams(temperature=0.6, top_k=128, top_p=0.95, seed=3),
        SamplingParams(),
    ]
    res = {}
    for backend in ("torch", "triton"):
        monkeypatch.setenv("TRTLLM_GLM_SAMPLING_BACKEND", backend)
        gens = [make_generator(p) for p in params]
        res[backend] = [Sampler().sample(logits, params, gens).tolist() for _ in range(4)]
    assert res["torch"] == res["triton"]


def test_sampling_kernels_compile_for_sm90() -> None:
    """Both launches at the real vocabulary's chunking (2,048 columns, k rounded to 64 and to the 256 bound) compile
    for the H200: int64 sorts, fp32 and fp64 cumulative sums (the interpreter never compiles them)."""
    from tests.triton_compile import compile_sm90, recording

    logits = torch.randn(2, 4100)
    out = torch.zeros(2, dtype=torch.int64)
    with recording() as rec:
        for k in (50, SAMPLE_MAX_K):
            sample_rows(logits, _rp([0.5, 0.2], [1.0, 0.7], [0.9, 1.0], [k, 3], [0, 1]), out, top_k=[k, 3],
                        backend="triton")  # fmt: skip
    assert not rec.unsupported and len(rec.specs) == 4
    results = compile_sm90(list(rec.specs.values()))
    assert all(r["ok"] for r in results), results


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_greedy_pack_writes_the_fp32_logits(backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """``greedy_pack(f32_out=)`` (``TRTLLM_GLM_GREEDY_FUSE_CAST``: the decode graph's ``.float()`` of the LM head
    done by the greedy kernel's read): the buffer (poisoned first) holds ``logits.float()`` exactly, NaN and -inf
    included, across several partials and a ragged last tile; ids and packed rows as without it."""
    from trtllm_glm.logits import GREEDY_FUSE_CAST_ENV, greedy_fuse_cast, greedy_pack

    g = torch.Generator().manual_seed(4)
    x = (torch.randn(5, 3001, generator=g) * 4).half()
    x[1, 7] = float("nan")
    x[2, :100] = float("-inf")
    buf = torch.full((5, 3001), 12345.0)
    ids, packed = greedy_pack(x, backend=backend, f32_out=buf)
    assert torch.equal(torch.isnan(buf), torch.isnan(x))
    assert torch.equal(torch.nan_to_num(buf), torch.nan_to_num(x.float()))
    want_ids, want_packed = greedy_pack(x, backend=backend)
    assert torch.equal(ids, want_ids) and torch.equal(packed.nan_to_num(), want_packed.nan_to_num())
    monkeypatch.setenv(GREEDY_FUSE_CAST_ENV, "1")
    assert greedy_fuse_cast()
    monkeypatch.setenv(GREEDY_FUSE_CAST_ENV, "on")
    with pytest.raises(ValueError, match=GREEDY_FUSE_CAST_ENV):
        greedy_fuse_cast()
