"""The batch-invariant numerics mode (issue 31, docs/numerics.md) on the CPU: each kernel's row invariance under
Triton's interpreter (the same row alone, at M = 1, 3, 8, 64 and > 64, and at another position gives the same
bits), the dispatchers the model calls in the mode, the scheduler's prompt-only chunk grid, and the plumbing
(LLM argument, CLI flag, serve YAML key).

Shapes are awkward on purpose: ``N = 40`` (not a multiple of the 16-row weight tile), ``K = 200`` (not a multiple
of the step), splits > 1. Inputs are fp32 / fp16 (the interpreter's bf16 arithmetic is wrong).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from trtllm_glm.linear import invariant_bmm, invariant_linear, invariant_linear_triton, linear_fp32, model_linear
from trtllm_glm.modules.linear import NumericsLinear, use_numerics_linears_
from trtllm_glm.numerics import batch_invariant, batch_invariant_mode
from trtllm_glm.quant.fp8 import quantize_block_fp8
from trtllm_glm.quant.ops import fp8_linear

pytestmark = pytest.mark.cpu_only

N, K = 40, 200
ROWS = [1, 3, 8, 64, 70, 130]


def _inputs(m: int, dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(m, K, generator=g) * 2).to(dtype), (torch.randn(N, K, generator=g) * K**-0.5).to(dtype)


def _assert_rows_invariant(fn, x: torch.Tensor) -> None:
    """``fn(x[:m])`` row for row equal to ``fn(x)`` at every m of ROWS, and a row computed alone or shifted."""
    full = fn(x)
    assert torch.isfinite(full).all()
    for m in ROWS:
        assert torch.equal(fn(x[:m]), full[:m]), f"rows differ at M = {m}"
    for i in (5, 66, x.shape[0] - 1):
        assert torch.equal(fn(x[i : i + 1])[0], full[i]), f"row {i} alone differs"
    assert torch.equal(fn(x[60:75]), full[60:75]), "a block straddling the 64-row tile differs"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_invariant_kernel_rows(dtype: torch.dtype) -> None:
    x, w = _inputs(ROWS[-1], dtype)
    _assert_rows_invariant(lambda t: invariant_linear_triton(t, w, out_dtype=torch.float32), x)
    y = invariant_linear_triton(x, w, out_dtype=torch.float32)
    ref = x.double() @ w.double().T
    bound = 300 * 2.0**-24 * (x.double().abs() @ w.double().abs().T)  # block_k + steps + split, as test_skinny_gemm
    assert ((y.double() - ref).abs() <= bound).all()
    # The output dtype: the fp32 sum rounded once.
    assert torch.equal(invariant_linear_triton(x, w), y.to(dtype))


def test_invariant_linear_cpu_path_rows_and_bias() -> None:
    x, w = _inputs(ROWS[-1], torch.float32, seed=1)
    b = torch.randn(N)
    _assert_rows_invariant(lambda t: invariant_linear(t, w, b), x)
    torch.testing.assert_close(invariant_linear(x, w, b), F.linear(x, w, b), rtol=1e-5, atol=1e-5)
    assert invariant_linear(x[:0], w).shape == (0, N)


def test_mode_routes_model_linears() -> None:
    """In the mode, `model_linear`, `linear_fp32`, `NumericsLinear` and `fp8_linear` are row-invariant on the CPU
    (outside it they are ``F.linear`` and the references, whose CPU GEMM picks another kernel per M)."""
    x, w = _inputs(ROWS[-1], torch.float32, seed=2)
    q, s = quantize_block_fp8(torch.randn(130, K) * 0.1, 64)
    lin = nn.Linear(K, N, bias=False)
    assert use_numerics_linears_(nn.Sequential(lin)) == 1 and type(lin) is NumericsLinear
    with torch.no_grad(), batch_invariant_mode(True):
        for fn in (
            lambda t: model_linear(t, w),
            lambda t: linear_fp32(t, w),
            lin,
            lambda t: fp8_linear(t, q, s, 64),
        ):
            _assert_rows_invariant(fn, x)
    assert not batch_invariant()


def test_mode_off_is_unchanged() -> None:
    x, w = _inputs(9, torch.float32, seed=3)
    assert torch.equal(model_linear(x, w), F.linear(x, w))
    lin = NumericsLinear(K, N, bias=True)
    with torch.no_grad():
        assert torch.equal(lin(x), F.linear(x, lin.weight, lin.bias))


def test_invariant_rows_differ_from_plain_cpu_gemm() -> None:
    """The property the mode buys is not free on the CPU: torch's GEMM of many rows and its matrix-vector product
    of one row round differently for some row (so the tests above can fail)."""
    g = torch.Generator().manual_seed(4)
    x, w = torch.randn(130, 1000, generator=g), torch.randn(300, 1000, generator=g)
    full = F.linear(x, w)
    assert any(not torch.equal(F.linear(x[i : i + 1], w)[0], full[i]) for i in range(130))


# --------------------------------------------------------------------------------------------------
# Scheduler: chunk boundaries of the prompt alone.
def _req(rid: int, n_prompt: int, computed: int = 0):
    from trtllm_glm.runtime.request import Request
    from trtllm_glm.runtime.sampling import SamplingParams

    r = Request(rid, list(range(n_prompt)), SamplingParams(max_tokens=4))
    r.num_computed = computed
    return r


def test_scheduler_grid_in_mode() -> None:
    from trtllm_glm.runtime.scheduler import Scheduler

    sched = Scheduler(max_batch_size=4, max_num_tokens=32, prefill_chunk_size=None)
    assert sched.invariant_chunk == 16
    a, b = _req(0, 40, computed=5), _req(1, 40)
    with batch_invariant_mode(True):
        plan = sched.schedule([], [a, b])
        # a: to the next multiple of 16 (11 rows); b: a whole 16-row chunk.
        assert [(s.request.request_id, s.num_rows) for s in plan] == [(0, 11), (1, 16)]
        # A chunk that does not fit the budget waits whole (never cut by the budget).
        sched2 = Scheduler(max_batch_size=4, max_num_tokens=20, prefill_chunk_size=16)
        plan = sched2.schedule([], [_req(2, 40), _req(3, 3)])
        assert [(s.request.request_id, s.num_rows) for s in plan] == [(2, 16), (3, 3)]
        plan = sched2.schedule([], [_req(4, 40), _req(5, 40)])
        assert [(s.request.request_id, s.num_rows) for s in plan] == [(4, 16)]
    plan = Scheduler(4, 20, 16).schedule([], [_req(4, 40), _req(5, 40)])
    assert [(s.request.request_id, s.num_rows) for s in plan] == [(4, 16), (5, 4)]  # outside the mode: cut
    # A preempted request recomputing prompt + 5 generated tokens: the prompt's chunks end at its end, the
    # generated rows go one per step (as the decode steps made them).
    r = _req(6, 20, computed=16)
    r.tokens += [1, 2, 3, 4, 5]
    with batch_invariant_mode(True):
        assert [s.num_rows for s in sched.schedule([], [r])] == [4]
        r.num_computed = 20
        assert [s.num_rows for s in sched.schedule([], [r])] == [1]


# --------------------------------------------------------------------------------------------------
# Plumbing
def test_llm_argument_sets_the_mode(monkeypatch) -> None:
    from trtllm_glm.runtime.llm import AUTO_BATCH_INVARIANT, LLM, resolve_batch_invariant

    monkeypatch.delenv("TRTLLM_GLM_BATCH_INVARIANT", raising=False)
    assert resolve_batch_invariant(None) is AUTO_BATCH_INVARIANT
    monkeypatch.setenv("TRTLLM_GLM_BATCH_INVARIANT", "1")
    assert resolve_batch_invariant(None) is True and resolve_batch_invariant(False) is False
    monkeypatch.setenv("TRTLLM_GLM_BATCH_INVARIANT", "maybe")
    with pytest.raises(ValueError, match="TRTLLM_GLM_BATCH_INVARIANT must be 1 or 0"):
        resolve_batch_invariant(None)
    monkeypatch.delenv("TRTLLM_GLM_BATCH_INVARIANT")
    with pytest.raises(TypeError, match="batch_invariant must be True, False or None"):
        resolve_batch_invariant("yes")  # type: ignore[arg-type]
    with batch_invariant_mode(False):
        llm = LLM("tiny", device="cpu", batch_invariant=True, max_seq_len=64)
        assert llm.batch_invariant and batch_invariant()
        assert type(llm.model.lm_head) is NumericsLinear
        out = llm.generate([[1, 2, 3]], SamplingParams_greedy(4))
        assert len(out[0].outputs[0].token_ids) == 4
        llm.shutdown()
    assert not batch_invariant()


def SamplingParams_greedy(n: int):  # noqa: N802 - reads like the class it builds
    from trtllm_glm.runtime.sampling import SamplingParams

    return SamplingParams(max_tokens=n, ignore_eos=True)


def test_cli_flag_and_yaml_key(tmp_path) -> None:
    from trtllm_glm.cli import _batch_invariant, build_parser
    from trtllm_glm.config import ConfigError
    from trtllm_glm.serve.config import llm_options_from_dict

    p = build_parser()
    for flag, want in (("on", True), ("off", False), ("auto", None)):
        args = p.parse_args(["generate", "--prompt", "x", "--batch_invariant", flag])
        assert _batch_invariant(args) is want
    assert _batch_invariant(p.parse_args(["generate", "--prompt", "x"])) is None
    assert p.parse_args(["serve", "tiny", "--batch-invariant", "on"]).batch_invariant == "on"
    with pytest.raises(SystemExit):
        p.parse_args(["generate", "--prompt", "x", "--batch_invariant", "maybe"])
    assert llm_options_from_dict({"batch_invariant": True}) == {"batch_invariant": True}
    assert llm_options_from_dict({"batch_invariant": None}) == {"batch_invariant": None}
    with pytest.raises(ConfigError, match="batch_invariant: expected true or false or null"):
        llm_options_from_dict({"batch_invariant": "on"})


@pytest.mark.parametrize(("block_m", "group_n"), [(16, 1), (32, 4)])
def test_invariant_kernel_rows_other_tiles(block_m: int, group_n: int, monkeypatch) -> None:
    """Any row tile (and split) is row-invariant when every call uses it, and four weight tiles per program give
    the one-tile bits; bad values are refused."""
    x, w = _inputs(ROWS[-1], torch.float32, seed=5)
    _assert_rows_invariant(lambda t: invariant_linear_triton(t, w, block_m=block_m, split_k=2, group_n=group_n), x)
    one = invariant_linear_triton(x, w, block_m=block_m, split_k=3, group_n=1)
    assert torch.equal(invariant_linear_triton(x, w, block_m=block_m, split_k=3, group_n=group_n), one)
    monkeypatch.setenv("TRTLLM_GLM_INVARIANT_BLOCK_M", "48")
    with pytest.raises(ValueError, match="TRTLLM_GLM_INVARIANT_BLOCK_M must be 16 or 32 or 64"):
        invariant_linear_triton(x[:2], w)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fp8_invariant_kernel_rows(dtype: torch.dtype) -> None:
    """The block-FP8 kernel in the mode (interpreted): every launch at the 64-row launch shape, rows in slices."""
    from trtllm_glm.quant.ops import fp8_linear_invariant, fp8_linear_reference

    g = torch.Generator().manual_seed(6)
    q, s = quantize_block_fp8(torch.randn(70, 96, generator=g) * 0.1, 32)
    x = torch.randn(ROWS[-1], 96, generator=g).to(dtype)
    _assert_rows_invariant(lambda t: fp8_linear_invariant(t, q, s, 32, backend="triton"), x)
    torch.testing.assert_close(
        fp8_linear_invariant(x, q, s, 32, backend="triton").float(),
        fp8_linear_reference(x, q, s, 32).float(),
        rtol=2e-3 if dtype == torch.float16 else 1e-5,
        atol=2e-3 if dtype == torch.float16 else 1e-5,
    )


_PTX_CHILD = r"""
import json, re, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import trtllm_glm.linear.kernels as mod
out = []
for name, sig, consts, warps in json.loads(sys.stdin.read()):
    fn = getattr(mod, name)
    s = {n: ("constexpr" if n in consts else sig[n]) for n in fn.arg_names}
    k = triton.compile(ASTSource(fn=fn, signature=s, constexprs=consts), target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": warps})
    ptx = k.asm["ptx"]
    out.append({"wgmma": "wgmma" in ptx, "mma": sorted(set(re.findall(r"mma\.sync\.aligned\.\S+", ptx)))})
print(json.dumps(out))
"""


def test_invariant_kernels_compile_to_one_mma_for_sm90() -> None:
    """Compiled for the H200 (no GPU needed): every variant of the invariant GEMM (split programs, in-program
    chunks, one split, four weight tiles; bf16 and fp32 results) builds, and all of them multiply with the one
    16 x 8 x 16 tensor-core instruction (never wgmma, whose accumulation is another instruction's): the same
    products and the same accumulation chain per element in every variant."""
    import json
    import os
    import subprocess
    import sys

    common = dict(x_ptr="*bf16", w_ptr="*bf16", M="i32", N="i32", K="i32", stride_xm="i32", stride_wn="i32",
                  stride_ym="i32", stride_xb="i32", stride_wb="i32", stride_yb="i32", N_RB="i32",
                  K_PER_SPLIT="i32")  # fmt: skip
    specs = []
    for y in ("*bf16", "*fp32"):
        sig = dict(common, y_ptr=y, part_ptr="*fp32", cnt_ptr="*i32")
        for split, programs in ((8, True), (8, False), (1, False)):
            consts = dict(SPLIT=split, SPLIT_PROGRAMS=programs, BLOCK_N=16, BLOCK_M=64, BLOCK_K=128, DOT_FP32=False)
            specs.append(("_invariant_gemm_kernel", sig, consts, 4))
        specs.append(("_invariant_gemm4_kernel", dict(common, y_ptr=y),
                      dict(SPLIT=4, BLOCK_N=16, BLOCK_M=64, BLOCK_K=128, DOT_FP32=False), 4))  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(__import__("pathlib").Path(__file__).resolve().parents[3])])
    proc = subprocess.run([sys.executable, "-c", _PTX_CHILD], input=json.dumps(specs), capture_output=True,
                          text=True, env=env, timeout=600, check=False)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    want = {"wgmma": False, "mma": ["mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32"]}
    assert got == [want] * len(specs), got


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_invariant_bmm_rows(backend: str) -> None:
    """The batched form (per-head products of the absorbed attention): rows invariant, each batch equal to the
    plain GEMM of its slice, strided activations taken as they are."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(ROWS[-1], 3 * 72, generator=g).view(ROWS[-1], 3, 72)  # a head view of a flat projection
    w = (torch.randn(3, 50, 72, generator=g) * 0.1)[:, 10:]  # a slice of a fused weight (w_uv of kv_b_proj)
    _assert_rows_invariant(lambda t: invariant_bmm(t, w, backend=backend), x)
    y = invariant_bmm(x, w, backend=backend)
    torch.testing.assert_close(y, torch.einsum("mbk,bnk->mbn", x, w), rtol=1e-5, atol=1e-5)
    if backend == "triton":
        for b in range(3):
            assert torch.equal(y[:, b], invariant_linear_triton(x[:, b].contiguous(), w[b]))
    with pytest.raises(ValueError, match="invariant_bmm: x must be"):
        invariant_bmm(x, w[:, :, :70])


def test_tuned_launch_shapes_are_per_weight_shape(monkeypatch, tmp_path) -> None:
    """A tuned entry sets the launch shape of its bf16 weight `(N, K)` whatever M is (so rows stay invariant), never
    the fp32-dot path's, and explicit knobs win; `bench_invariant_linear.py --apply` writes entries that load."""
    import importlib.util
    import shutil
    import sys

    import trtllm_glm.linear.kernels as kern

    monkeypatch.setitem(kern._TUNED_SHAPES, (N, K), {"split_k": 2, "block_k": 64, "num_warps": 8, "num_stages": 3})
    cfg = kern.launch_config(N, K, 2, False)
    assert cfg == kern.SkinnyConfig(block_k=64, k_per_split=128, split=2, num_warps=8, num_stages=3)
    assert kern.launch_config(N, K, 2, False, tuned=False) != cfg
    assert kern.launch_config(N, K, 2, True) == kern.launch_config(N, K, 2, True, tuned=False)
    assert kern.launch_config(N, K, 2, False, num_warps=4).num_warps == 4
    from benchmarks import bench_invariant_linear as mod

    target = tmp_path / "kernels.py"
    shutil.copy(kern.__file__, target)
    sweep = tmp_path / "sweep.json"
    sweep.write_text('{"tuned": {"24576,4096": {"split_k": 1, "block_k": 256, "num_warps": 8, "num_stages": 4}}}')
    assert mod.apply_tuned(str(sweep), str(target)) == 0
    spec = importlib.util.spec_from_file_location("kern_applied", target)
    applied = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "kern_applied", applied)  # (a dataclass needs its module registered)
    spec.loader.exec_module(applied)
    assert applied._TUNED_SHAPES == {(24576, 4096): {"block_k": 256, "num_stages": 4, "num_warps": 8, "split_k": 1}}
    sweep.write_text('{"tuned": {"24576,4096": {"block_n": 64}}}')
    with pytest.raises(ValueError, match="unknown knobs"):
        mod.apply_tuned(str(sweep), str(target))


def test_fp8_invariant_launch_shape_with_several_k_steps_per_split() -> None:
    """The block-FP8 kernel in the mode at a weight whose splits take several K steps each (70 x 8448, 128-wide
    scale tiles): a row alone (1-row call) and inside a 65-row call (past the 64-row launch tile, where a launch
    shape chosen by M turns to one split) gives the same bits. With one K step per split
    (`test_fp8_invariant_kernel_rows`' K = 96) any split adds the same partials, so a launch shape taken from the
    call's rows instead of the fixed row tile would pass there; here the split count changes the sum."""
    from trtllm_glm.quant import kernels as qk
    from trtllm_glm.quant.ops import INVARIANT_ROWS, fp8_linear_invariant

    n, k = 70, 8448
    g = torch.Generator().manual_seed(7)
    q, s = quantize_block_fp8(torch.randn(n, k, generator=g) * 0.05, 128)
    x = torch.randn(65, k, generator=g)
    # The premise: the fixed launch shape splits K into chunks of several steps, and a launch shape chosen for 65
    # rows would cut K otherwise (another order of adds).
    wide, fixed = qk.launch_config(65, n, k, 128, True), qk.launch_config(INVARIANT_ROWS, n, k, 128, True)
    assert fixed.k_per_split > fixed.block_k and wide.split != fixed.split, (wide, fixed)
    full = fp8_linear_invariant(x, q, s, 128, backend="triton")
    for i in (0, 64):
        assert torch.equal(fp8_linear_invariant(x[i : i + 1], q, s, 128, backend="triton")[0], full[i]), f"row {i}"
