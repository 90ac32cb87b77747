"""The fused row-normalisation kernel (`trtllm_glm.norm`) under Triton's interpreter against the torch
references (`rms_norm`, `GatedRMSNorm`, `l2_normalize`), and the backend dispatch of the three callers.

Inputs are fresh random values with a spread of scales per row, in FP32 and FP16 (the interpreter's bf16
arithmetic is wrong); outputs are poisoned with NaN first, so an element the kernel never writes shows.
Views with two leading strides (a per-head slice of a split projection) run without a copy.
"""

from __future__ import annotations

import pytest
import torch

from trtllm_glm.kda.layer import GatedRMSNorm
from trtllm_glm.kda.ops.gate import L2NORM_EPS, l2_normalize
from trtllm_glm.modules.norm import rms_norm
from trtllm_glm.norm import NORM_BACKEND_ENV, norm_backend, row_norm


def _x(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    scale = torch.exp(torch.randn(*shape[:-1], 1, generator=g))  # rows of very different norms
    return (torch.randn(*shape, generator=g) * scale).to(dtype)


def _poisoned(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return torch.full(shape, float("nan"), dtype=dtype)


def _close(got: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    assert got.dtype == ref.dtype and got.shape == ref.shape
    assert not torch.isnan(got).any()
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(got.float(), ref.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("shape", [(1, 96), (5, 300), (2, 3, 64), (2, 3, 2, 40)])
def test_rms_norm_matches_reference(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    x = _x(shape, dtype, 0)
    w = (1.0 + 0.5 * torch.randn(shape[-1], generator=torch.Generator().manual_seed(1))).to(dtype)
    ref = rms_norm(x, w, 1e-5)  # CPU tensors: the reference
    got = row_norm(x, 1e-5, weight=w, out=_poisoned(shape, dtype))
    _close(got, ref, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_gated_rms_norm_matches_reference(dtype: torch.dtype) -> None:
    N, H, V = 3, 4, 64
    norm = GatedRMSNorm(V, 1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(1.0 + 0.3 * torch.randn(V, generator=torch.Generator().manual_seed(2)))
    x, gate = _x((N, H, V), dtype, 3), 2.0 * _x((N, H, V), dtype, 4)
    with torch.no_grad():
        ref = norm(x, gate)
    got = row_norm(x, 1e-5, weight=norm.weight, gate=gate, out=_poisoned((N, H, V), torch.float32))
    _close(got, ref, torch.float32 if dtype == torch.float32 else dtype)


def test_gated_rms_norm_out_dtype_is_one_rounding(monkeypatch: pytest.MonkeyPatch) -> None:
    """The KDA output norm writes the o_proj dtype directly: both backends equal the FP32 result rounded once."""
    N, H, V = 3, 4, 64
    norm = GatedRMSNorm(V, 1e-5)
    with torch.no_grad():
        norm.weight.copy_(1.0 + 0.3 * torch.randn(V, generator=torch.Generator().manual_seed(2)))
    x, gate = _x((N, H, V), torch.float32, 3), 2.0 * _x((N, H, V), torch.float32, 4)
    for backend in ("torch", "triton"):
        monkeypatch.setenv(NORM_BACKEND_ENV, backend)
        with torch.no_grad():
            fp32, half = norm(x, gate), norm(x, gate, torch.float16)
        assert half.dtype == torch.float16
        assert torch.equal(half, fp32.to(torch.float16))


def test_l2_normalize_of_a_split_view_matches_reference() -> None:
    """``q`` and ``k`` of the KDA layer are per-head views of one conv output ``[N, 3 * H * K]``: strides
    ``(3HK, K, 1)``, read in place."""
    N, H, K = 4, 3, 32
    y = _x((N, 3 * H * K), torch.float32, 5)
    q = y[:, : H * K].view(N, H, K)
    k = y[:, H * K : 2 * H * K].view(N, H, K)
    assert not q.is_contiguous()
    for t in (q, k):
        ref = l2_normalize(t)
        got = row_norm(t, L2NORM_EPS, mean=False, out_dtype=torch.float32, out=_poisoned((N, H, K), torch.float32))
        _close(got, ref, torch.float32)
        # Unit rows.
        torch.testing.assert_close(got.norm(dim=-1), torch.ones(N, H), rtol=1e-5, atol=1e-5)


def test_rejects_bad_shapes() -> None:
    x = torch.randn(2, 8)
    with pytest.raises(ValueError, match="weight"):
        row_norm(x, 1e-5, weight=torch.ones(7))
    with pytest.raises(ValueError, match="gate"):
        row_norm(x, 1e-5, gate=torch.ones(2, 7))
    with pytest.raises(ValueError, match="contiguous"):
        row_norm(torch.randn(8, 2).t(), 1e-5)
    with pytest.raises(ValueError, match="merged"):
        row_norm(torch.randn(2, 2, 2, 8), 1e-5, out=torch.empty(2, 2, 2, 8).transpose(0, 1))


def test_backend_dispatch(monkeypatch) -> None:
    """auto: the reference on the CPU and under autograd, the kernel for CUDA inference; an explicit
    'triton' runs the kernel anywhere (interpreted on the CPU); a bad name is an error."""
    x = torch.randn(2, 8)
    assert norm_backend(x) == "torch"
    assert norm_backend(x, backend="triton") == "triton"
    if torch.cuda.is_available():
        assert norm_backend(x.cuda()) == "triton"
    w = torch.ones(8, requires_grad=True)
    with pytest.raises(RuntimeError, match="no backward"):
        norm_backend(x, w, backend="triton")
    with pytest.raises(ValueError, match="backend"):
        norm_backend(x, backend="cuda")
    # The callers follow the environment: with 'triton' the CPU path runs the interpreted kernel.
    monkeypatch.setenv(NORM_BACKEND_ENV, "triton")
    xw = _x((3, 40), torch.float32, 6)
    w2 = torch.rand(40) + 0.5
    got = rms_norm(xw, w2, 1e-5)
    monkeypatch.setenv(NORM_BACKEND_ENV, "torch")
    torch.testing.assert_close(got, rms_norm(xw, w2, 1e-5), rtol=1e-5, atol=1e-6)


def test_model_with_the_kernel_matches_reference(monkeypatch) -> None:
    """The whole tiny model (prefill, decode, speculative verify) with every norm on the interpreted kernel
    gives the reference's greedy tokens: every call site's shapes and strides go through the kernel."""
    from trtllm_glm.models.glm5_next import Glm5NextForCausalLM
    from trtllm_glm.runtime.executor import ExecutorConfig
    from trtllm_glm.runtime.sampling import SamplingParams
    from trtllm_glm.runtime.speculative_executor import SpeculativeExecutor
    from trtllm_glm.speculative.config import MTPDecodingConfig

    model = Glm5NextForCausalLM.from_pretrained("tiny", layers=[0, 3], dtype="float32").eval()
    cfg = ExecutorConfig(tokens_per_block=8, max_tokens=512, max_batch_size=2, max_num_tokens=64, max_seq_len=64)

    def run(backend: str):
        monkeypatch.setenv(NORM_BACKEND_ENV, backend)
        ex = SpeculativeExecutor(model, cfg, MTPDecodingConfig(adaptive=False, num_nextn_predict_layers=2))
        reqs = [ex.add_request(p, SamplingParams(max_tokens=6, ignore_eos=True)) for p in ([5, 9, 2, 7, 5], [3, 1])]
        ex.run_until_done()
        return [r.output_ids for r in reqs], [r.num_accepted_total for r in reqs]

    assert run("triton") == run("torch")
