"""The skinny fp32 GEMM (`trtllm_glm.linear`) under Triton's interpreter against an fp64 reference, its split-K
reduction (fixed order, counters reset), the dispatcher and its environment override, and its use by the router.

Shapes are small and awkward on purpose: ``N = 40`` (not a multiple of the 16-row weight tile), ``K = 200`` (not
a multiple of the 32-column step), ``M`` in {1, 3, 16, 17} (17 needs a 32-row x tile). Inputs are fp32 and fp16
(the interpreter's bf16 arithmetic is wrong; the kernel upcasts right after loading). Outputs are poisoned with
NaN first.

Error bound: an fp32 sum evaluated as a tree of depth ``d`` (any order) is within ``d * u * sum(|terms|)`` of the
exact sum, ``u = 2^-24``, to first order (Higham, "Accuracy and Stability of Numerical Algorithms", §4.2); fp32
products add one more rounding. Interpreted, each ``BLOCK_K`` step is a numpy fp32 matmul of ``BLOCK_K`` terms
(depth at most ``BLOCK_K``) added to the running sum, the steps of a chunk run in sequence and the ``SPLIT``
partials are added in sequence: ``d <= BLOCK_K + steps + SPLIT + 1``. With ``sum(|terms|) = (|x| @ |W|^T)`` this is
``|y - ref| <= d * u * (|x| @ |W|^T)`` (~2e-6 relative here); a dropped product or partial is off by ~1/K of that
sum or more, orders of magnitude above the bound.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from trtllm_glm.linear import (
    MAX_M,
    SKINNY_GEMM_BACKEND_ENV,
    kernel_module,
    linear_fp32,
    skinny_gemm,
    skinny_gemm_backend,
    skinny_gemm_reference,
)

pytestmark = pytest.mark.cpu_only

N, K, BLOCK_K, SPLIT = 40, 200, 32, 3
U = 2.0**-24


def _inputs(m: int, dtype: torch.dtype, seed: int, n: int = N, k: int = K) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(m, k, generator=g) * 2).to(dtype)
    w = (torch.randn(n, k, generator=g) * k**-0.5).to(dtype)
    return x, w


def _bound(x: torch.Tensor, w: torch.Tensor, split: int | None, block_k: int | None) -> torch.Tensor:
    """``d * u * (|x| @ |W|^T)`` for the interpreted kernel's summation tree (module docstring)."""
    n, k = w.shape
    cfg = kernel_module("cpu").launch_config(n, k, w.element_size(), True, split_k=split, block_k=block_k)
    depth = cfg.block_k + cfg.k_per_split // cfg.block_k + cfg.split + 1
    return depth * U * (x.double().abs() @ w.double().abs().T)


def _check(
    y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, split: int | None = SPLIT, block_k: int | None = BLOCK_K
) -> None:
    assert y.dtype == torch.float32 and y.shape == (x.shape[0], w.shape[0])
    assert torch.isfinite(y).all(), "an output element was not written"
    err = (y.double() - x.double() @ w.double().T).abs()
    bound = _bound(x, w, split, block_k)
    assert (err <= bound).all(), f"max err {err.max().item():.3g}, worst err / bound {(err / bound).max().item():.3g}"


@pytest.mark.parametrize("m", [1, 3, 16, 17])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_matches_fp64_reference(m: int, dtype: torch.dtype) -> None:
    x, w = _inputs(m, dtype, seed=m)
    out = torch.full((m, N), float("nan"))
    y = skinny_gemm(x, w, out=out, split_k=SPLIT, block_k=BLOCK_K)
    assert y is out
    _check(y, x, w)


def test_one_split_strided_rows_and_mixed_dtypes() -> None:
    x, w = _inputs(3, torch.float32, seed=7)
    big = torch.randn(3, K + 24)
    big[:, :K] = x
    view = big[:, :K]  # row stride K + 24, columns contiguous
    _check(skinny_gemm(view, w, split_k=1, block_k=BLOCK_K), x, w, split=1)
    w16 = w.to(torch.float16)  # fp32 x, fp16 weight: both upcast (the model's fp32 activations, 16-bit weight)
    _check(skinny_gemm(x, w16, split_k=SPLIT, block_k=BLOCK_K), x, w16.float())


def test_reproducible_and_counters_reset() -> None:
    mod = kernel_module("cpu")
    mod.clear_scratch()
    x, w = _inputs(5, torch.float32, seed=11)
    x2, _ = _inputs(5, torch.float32, seed=12)
    y1 = skinny_gemm(x, w, split_k=SPLIT, block_k=BLOCK_K)
    # Other inputs through the same cached scratch: the first launch must have left its counters at zero, or
    # this launch's reducing program would be the wrong one (and read partials not yet written).
    y2 = skinny_gemm(x2, w, split_k=SPLIT, block_k=BLOCK_K)
    _check(y2, x2, w)
    assert not torch.equal(y1, y2)
    y3 = skinny_gemm(x, w, split_k=SPLIT, block_k=BLOCK_K)
    assert torch.equal(y1, y3)  # bitwise: fixed summation order
    (scratch,) = mod._SCRATCH.values()
    assert scratch[1].tolist() == [0, 0, 0]  # one counter per 16-row tile, all reset


def test_dispatcher_picks_by_device_rows_and_grad(monkeypatch: pytest.MonkeyPatch) -> None:
    assert kernel_module("cpu").MAX_M == MAX_M  # the dispatcher's copy of the kernel's row limit
    monkeypatch.delenv(SKINNY_GEMM_BACKEND_ENV, raising=False)
    x, w = _inputs(4, torch.float32, seed=3)
    assert skinny_gemm_backend(x, w) == "torch"  # auto: the CPU takes the reference
    assert skinny_gemm_backend(x, w, "triton") == "triton"
    big = torch.randn(MAX_M + 1, K)
    assert skinny_gemm_backend(big, w, "triton") == "torch"  # beyond the kernel's rows
    assert skinny_gemm_backend(torch.randn(0, K), w, "triton") == "torch"
    assert skinny_gemm_backend(x.double(), w, "triton") == "torch"  # a dtype the kernel does not read
    monkeypatch.setenv(SKINNY_GEMM_BACKEND_ENV, "triton")
    assert skinny_gemm_backend(x, w) == "triton"
    assert skinny_gemm_backend(x, w, "torch") == "torch"  # the argument beats the environment
    wg = w.clone().requires_grad_(True)
    with pytest.raises(RuntimeError, match="no backward"):
        skinny_gemm_backend(x, wg)
    monkeypatch.setenv(SKINNY_GEMM_BACKEND_ENV, "auto")
    assert skinny_gemm_backend(x, wg) == "torch"
    monkeypatch.setenv(SKINNY_GEMM_BACKEND_ENV, "fast")
    with pytest.raises(ValueError, match="backend"):
        skinny_gemm_backend(x, w)


def test_linear_fp32_reference_is_exactly_f_linear(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(SKINNY_GEMM_BACKEND_ENV, raising=False)
    x, w = _inputs(6, torch.bfloat16, seed=5)
    ref = F.linear(x.float(), w.float())
    assert torch.equal(linear_fp32(x, w), ref)  # the CPU default: the old code's result bit for bit
    assert torch.equal(skinny_gemm_reference(x, w), ref)
    # Forced kernel with leading dims (flattened to rows) and the reference beyond MAX_M rows.
    x3, w3 = _inputs(6, torch.float32, seed=6)
    got = linear_fp32(x3.view(2, 3, K), w3, backend="triton")
    assert got.shape == (2, 3, N)
    _check(got.view(6, N), x3, w3, split=None, block_k=None)  # the default launch shape
    wide = torch.randn(MAX_M + 1, K)
    assert torch.equal(linear_fp32(wide, w3, backend="triton"), F.linear(wide, w3))


def test_bad_input_is_refused() -> None:
    x, w = _inputs(2, torch.float32, seed=1)
    with pytest.raises(ValueError, match="K = 200"):
        skinny_gemm(x[:, :-1], w)
    with pytest.raises(ValueError, match="K = 200"):
        linear_fp32(x[:, :-1], w)
    with pytest.raises(ValueError, match="weight must be 2-D"):
        skinny_gemm(x, w[0])
    with pytest.raises(ValueError, match="x must be 2-D"):
        skinny_gemm(x.view(1, 2, K), w)
    with pytest.raises(ValueError, match="rows"):
        skinny_gemm(torch.randn(MAX_M + 1, K), w)
    with pytest.raises(ValueError, match="rows"):
        skinny_gemm(torch.randn(0, K), w)
    with pytest.raises(ValueError, match="dtypes"):
        skinny_gemm(x.double(), w)
    with pytest.raises(ValueError, match="out must be"):
        skinny_gemm(x, w, out=torch.empty(2, N, dtype=torch.float16))
    with pytest.raises(ValueError, match="block_k"):
        skinny_gemm(x, w, block_k=24)


def test_router_logits_go_through_the_dispatcher(monkeypatch: pytest.MonkeyPatch) -> None:
    from trtllm_glm.modules import ffn
    from trtllm_glm.moe.router import route_reference

    gate = ffn.MoEGate(K, N, 4, True, 2.5)
    gate.reset_parameters(torch.Generator().manual_seed(0), 0.05)
    x = torch.randn(3, K)
    calls: list[str | None] = []

    def spy(a: torch.Tensor, b: torch.Tensor, *, backend: str | None = None) -> torch.Tensor:
        calls.append(backend)
        return linear_fp32(a, b, backend=backend)

    monkeypatch.setattr(ffn, "linear_fp32", spy)
    monkeypatch.delenv(SKINNY_GEMM_BACKEND_ENV, raising=False)
    ids, w = gate(x)
    assert calls == [None]
    ref_ids, ref_w = route_reference(F.linear(x, gate.weight), gate.e_score_correction_bias, 4, True, 2.5)
    assert torch.equal(ids, ref_ids) and torch.equal(w, ref_w)  # unchanged on the CPU


def test_gpu_launches_compile_for_sm90() -> None:
    """The CUDA path's variants, which the interpreter never runs (16-bit tensor-core dots: ``DOT_FP32`` False),
    at the launch shapes of the router ``[288, 4096]`` and indexer ``[32, 4096]`` weights."""
    from tests.triton_compile import KernelSpec, compile_sm90

    mod = "trtllm_glm.linear.kernels"
    sig = dict(x_ptr="*bf16", w_ptr="*bf16", y_ptr="*fp32", part_ptr="*fp32", cnt_ptr="*i32", M="i32", N="i32",
               K="i32", stride_xm="i32", stride_wn="i32", stride_ym="i32", K_PER_SPLIT="i32")  # fmt: skip
    base = dict(BLOCK_N=16, PART_M=MAX_M)
    specs = [
        KernelSpec(
            mod, "_skinny_gemm_kernel", sig, {**base, "SPLIT": split, "BLOCK_M": bm, "BLOCK_K": 128, "DOT_FP32": False}
        )  # fmt: skip
        for split, bm in ((8, 16), (16, 64))
    ]
    specs.append(  # the fp32 model's path on CUDA: IEEE fp32 FMAs
        KernelSpec(
            mod,
            "_skinny_gemm_kernel",
            {**sig, "x_ptr": "*fp32", "w_ptr": "*fp32"},
            {**base, "SPLIT": 16, "BLOCK_M": 64, "BLOCK_K": 32, "DOT_FP32": True},
        )  # fmt: skip
    )
    results = compile_sm90(specs)
    assert all(r["ok"] for r in results), results
