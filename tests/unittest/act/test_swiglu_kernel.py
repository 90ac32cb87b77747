"""The clamped SwiGLU kernel (`trtllm_glm.act`) under Triton's interpreter against the torch reference
(`clamped_swiglu` on the two halves of ``gate_up``), the input checks, and the backend dispatch.

Inputs are fresh random values spread well beyond +-L (so both clamps act), never zero, in FP32 and FP16 (the
interpreter's bf16 arithmetic is wrong; bf16 bit-exactness is checked on CUDA in test_swiglu_kernel_gpu.py);
outputs are poisoned with NaN first, so an element the kernel never writes shows.
"""

from __future__ import annotations

import pytest
import torch

import trtllm_glm.act as act
from trtllm_glm.act import SWIGLU_BACKEND_ENV, clamped_swiglu, kernel_module, swiglu, swiglu_backend, swiglu_reference

pytestmark = [
    pytest.mark.cpu_only,
    # Triton's interpreter itself trips this numpy deprecation.
    pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0 to a scalar:DeprecationWarning"),
    # numpy's exp of a large argument (silu of a very negative gate): inf is what the division needs there.
    pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning"),
]

LIMIT = 10.0


def _gate_up(n: int, inter: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """``[n, 2 * inter]`` with magnitudes in [0.05, ~40] and random signs: no zeros, many values past +-L."""
    g = torch.Generator().manual_seed(seed)
    mag = 0.05 + torch.rand(n, 2 * inter, generator=g) * 40
    sign = torch.randint(0, 2, (n, 2 * inter), generator=g) * 2 - 1
    return (mag * sign).to(dtype)


def _poisoned(n: int, inter: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.full((n, inter), float("nan"), dtype=dtype)


def _close(got: torch.Tensor, ref: torch.Tensor) -> None:
    assert got.dtype == ref.dtype and got.shape == ref.shape
    assert not torch.isnan(got).any()
    # numpy's exp (the interpreter) and torch's CPU exp may differ by an ulp; fp16 then rounds silu once more.
    tol = 1e-6 if got.dtype == torch.float32 else 2e-3
    torch.testing.assert_close(got.float(), ref.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("n", [1, 5, 64])
@pytest.mark.parametrize("limit", [LIMIT, None])
def test_kernel_matches_reference(dtype: torch.dtype, n: int, limit: float | None) -> None:
    inter = 100  # not a power of two: the last block is masked
    gate_up = _gate_up(n, inter, dtype, seed=n)
    gate, up = gate_up[:, :inter], gate_up[:, inter:]
    assert (gate > LIMIT).any() and (up > LIMIT).any() and (up < -LIMIT).any()
    ref = clamped_swiglu(gate, up, limit)
    got = swiglu(gate_up, limit, "triton", out=_poisoned(n, inter, dtype))
    _close(got, ref)
    assert torch.equal(swiglu_reference(gate_up, limit), ref)
    if limit is not None:
        # The clamps matter here: a kernel that skipped them would fail the comparison above.
        assert not torch.allclose(clamped_swiglu(gate, up, None).float(), ref.float(), rtol=0.1)


def test_row_strides_are_read_and_written_in_place() -> None:
    n, inter = 5, 37
    gate_up = _gate_up(n, inter, torch.float32, seed=7)
    wide = torch.zeros(n, 2 * inter + 11)
    wide[:, 3 : 3 + 2 * inter] = gate_up
    src = wide[:, 3 : 3 + 2 * inter]  # row stride 2I + 11
    out_wide = torch.full((n, inter + 5), float("nan"))
    out = out_wide[:, 2 : 2 + inter]  # row stride I + 5
    got = swiglu(src, LIMIT, "triton", out=out)
    assert got.data_ptr() == out.data_ptr()
    _close(got, clamped_swiglu(gate_up[:, :inter], gate_up[:, inter:], LIMIT))
    # Nothing written outside the view.
    assert torch.isnan(out_wide[:, :2]).all() and torch.isnan(out_wide[:, 2 + inter :]).all()


@pytest.mark.filterwarnings("ignore:invalid value encountered in divide:RuntimeWarning")  # -inf / inf, as torch
def test_nan_and_inf_follow_the_reference() -> None:
    inter = 8
    gate = torch.tensor([[float("nan"), float("inf"), -float("inf"), 1.0, 30.0, -30.0, 0.5, -0.5]])
    up = torch.tensor([[1.0, 2.0, 3.0, float("nan"), float("inf"), -float("inf"), 25.0, -25.0]])
    gate_up = torch.cat([gate, up], dim=1)
    for limit in (LIMIT, None):
        got = swiglu(gate_up, limit, "triton", out=_poisoned(1, inter, torch.float32))
        torch.testing.assert_close(got, clamped_swiglu(gate, up, limit), rtol=1e-6, atol=1e-6, equal_nan=True)


def test_empty_rows() -> None:
    gate_up = torch.empty(0, 2 * 16)
    assert swiglu(gate_up, LIMIT, "triton").shape == (0, 16)
    assert swiglu(gate_up, LIMIT, "torch").shape == (0, 16)


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_bad_inputs_raise(backend: str) -> None:
    with pytest.raises(ValueError, match="even"):
        swiglu(torch.randn(3, 7), LIMIT, backend)
    with pytest.raises(ValueError, match="2-D"):
        swiglu(torch.randn(8), LIMIT, backend)
    with pytest.raises(ValueError, match="2-D"):
        swiglu(torch.randn(2, 3, 8), LIMIT, backend)
    with pytest.raises(ValueError, match="out must be"):
        swiglu(torch.randn(3, 8), LIMIT, backend, out=torch.empty(3, 8))
    with pytest.raises(ValueError, match="out must be"):
        swiglu(torch.randn(3, 8), LIMIT, backend, out=torch.empty(3, 4, dtype=torch.float16))


def test_kernel_rejects_what_it_cannot_read() -> None:
    mod = kernel_module("cpu")
    with pytest.raises(ValueError, match="contiguous"):
        mod.swiglu(torch.randn(8, 3).t(), LIMIT)  # [3, 8] with column stride 3
    with pytest.raises(ValueError, match="dtype"):
        mod.swiglu(torch.randn(3, 8, dtype=torch.float64), LIMIT)
    with pytest.raises(ValueError, match="2-D"):
        mod.swiglu(torch.randn(2, 3, 8), LIMIT)


def test_backend_dispatch(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    real = act.kernel_module

    def counting(device):  # type: ignore[no-untyped-def]
        calls.append(str(device))
        return real(device)

    monkeypatch.setattr(act, "kernel_module", counting)
    monkeypatch.delenv(SWIGLU_BACKEND_ENV, raising=False)
    x = _gate_up(2, 16, torch.float32, seed=3)
    assert swiglu_backend(x) == "torch"  # "auto" keeps the reference on the CPU
    swiglu(x, LIMIT)
    assert calls == []
    monkeypatch.setenv(SWIGLU_BACKEND_ENV, "triton")
    assert swiglu_backend(x) == "triton"
    _close(swiglu(x, LIMIT), swiglu_reference(x, LIMIT))
    assert calls == ["cpu"]
    swiglu(x, LIMIT, "torch")  # the argument wins over the environment
    assert calls == ["cpu"]
    monkeypatch.setenv(SWIGLU_BACKEND_ENV, "bogus")
    with pytest.raises(ValueError, match="backend"):
        swiglu(x, LIMIT)
    with pytest.raises(RuntimeError, match="backward"):
        swiglu(x.requires_grad_(), LIMIT, "triton")
