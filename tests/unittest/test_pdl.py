"""Programmatic dependent launch of the FP8 linear (`trtllm_glm.pdl`, `quant.kernels`: split-K and stream-K): how a
launch resolves it, and what the compiled kernels do before they wait (sm_90 PTX, compiled without a GPU).

A PDL-launched kernel may run while the kernel before it still writes; its only safe accesses before
``griddepcontrol.wait`` are reads of constants. The PTX checks below fail if a load, store or atomic of the kernel
moves above the wait, or if the weight prefetch or the early trigger go missing.
"""

from __future__ import annotations

import re

import pytest
import torch

from trtllm_glm.pdl import has_pdl
from trtllm_glm.quant import kernels as K


def test_launch_config_resolves_pdl_from_the_argument_the_environment_then_off(monkeypatch) -> None:
    monkeypatch.delenv(K.PDL_ENV, raising=False)
    base = K.launch_config(1, 4096, 8192, 128, False)
    assert (base.pdl, base.prefetch) == (False, 0)  # off until measured
    on = K.launch_config(1, 4096, 8192, 128, False, pdl=True)
    assert on.pdl and on.prefetch == min(K.PDL_PREFETCH_BYTES, on.k_per_split)
    # Nothing else of the launch changes: the same tiles and reduction order, so the same bits.
    assert {**vars(on), "pdl": False, "prefetch": 0} == vars(base)
    monkeypatch.setenv(K.PDL_ENV, "1")
    env = K.launch_config(1, 4096, 8192, 128, False)
    assert env == on
    assert not K.launch_config(1, 4096, 8192, 128, False, pdl=False).pdl  # the argument wins
    assert K.launch_config(16, 4096, 8192, 128, False, prefetch=1000).prefetch == 992  # rounded down to 16
    small = K.launch_config(4, 300, 256, 128, False, k_chunk=128)
    assert small.pdl and small.prefetch == 128  # capped at the program's chunk
    assert not K.launch_config(256, 4096, 8192, 128, False).pdl  # prefill chunks: never
    monkeypatch.setenv(K.PDL_ENV, "0")
    assert not K.launch_config(1, 4096, 8192, 128, False).pdl
    monkeypatch.setenv(K.PDL_ENV, "yes")
    with pytest.raises(ValueError, match="TRTLLM_GLM_FP8_PDL must be 0 or 1"):
        K.launch_config(1, 4096, 8192, 128, False)
    monkeypatch.delenv(K.PDL_ENV)
    with pytest.raises(ValueError, match="prefetch must be >= 0"):
        K.launch_config(1, 4096, 8192, 128, False, pdl=True, prefetch=-16)


def test_a_pdl_launch_on_the_cpu_is_the_plain_launch(monkeypatch) -> None:
    """The interpreter has no ``griddepcontrol``: with PDL asked for, a CPU launch runs the plain kernel and gives
    the same result, bit for bit, on a split-K shape whose chunks are not multiples of the prefetch."""
    from trtllm_glm.quant import quantize_block_fp8
    from trtllm_glm.quant.ops import fp8_linear_triton

    assert not has_pdl(torch.device("cpu"))
    g = torch.Generator().manual_seed(3)
    q, s = quantize_block_fp8(torch.randn(96, 400, generator=g), 32)
    x = torch.randn(3, 400, generator=g)
    want = fp8_linear_triton(x, q, s, 32, k_chunk=96)
    monkeypatch.setenv(K.PDL_ENV, "1")
    got = fp8_linear_triton(x, q, s, 32, k_chunk=96)
    assert torch.equal(got, want)


_ACCESS = re.compile(r"\b(ld\.global|st\.global|atom\.|red\.|cp\.async\.(ca|cg)|ldmatrix|cp\.async\.bulk\.tensor)")


def _ptx_order(ptx: str) -> tuple[list[int], list[int], list[int], list[int]]:
    """Line numbers of: launch_dependents, L2 prefetches, waits, and global memory accesses."""
    lines = ptx.splitlines()
    find = lambda pat: [i for i, x in enumerate(lines) if re.search(pat, x)]  # noqa: E731
    return (find(r"griddepcontrol\.launch_dependents"), find(r"cp\.async\.bulk\.prefetch\.L2"),
            find(r"griddepcontrol\.wait"), find(_ACCESS.pattern))  # fmt: skip


def test_pdl_kernels_compile_for_sm90_and_wait_before_any_dependent_access() -> None:
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from triton_compile import KernelSpec, compile_sm90

    sig = {"x_ptr": "*bf16", "w_ptr": "*u8", "s_ptr": "*fp32", "y_ptr": "*bf16", "part_ptr": "*fp32",
           "cnt_ptr": "*i32", "M": "i32", "N": "i32", "K": "i32", "stride_xm": "i32", "stride_wn": "i32",
           "stride_sn": "i32", "stride_ym": "i32", "K_PER_SPLIT": "i32", "SPLIT": "i32"}  # fmt: skip

    def linear(x_as_a: bool, split: bool, prefetch: int, block_n: int = 128) -> KernelSpec:
        c = dict(QBLOCK=128, HW_FP8=True, UNROLL=1, X_AS_A=x_as_a, SPLIT_K=split, BLOCK_N=block_n, BLOCK_M=16,
                 BLOCK_K=128, DOT_FP32=False, X_POW2=True, PDL=True, PREFETCH=prefetch)  # fmt: skip
        return KernelSpec("trtllm_glm.quant.kernels", "_fp8_linear_kernel", sig, c, 4)

    norm_sig = {
        "x_ptr": "*bf16",
        "w_ptr": "*bf16",
        "g_ptr": "*bf16",
        "o_ptr": "*bf16",
        "B": "i32",
        "D": "i32",
        "sxa": "i32",
        "sxb": "i32",
        "sga": "i32",
        "sgb": "i32",
        "soa": "i32",
        "sob": "i32",
        "eps": "fp32",
    }
    norm = KernelSpec("trtllm_glm.norm.kernels", "_row_norm_kernel", norm_sig,
                      dict(HAS_W=True, HAS_GATE=False, MEAN=True, BLOCK_D=4096, TRIGGER=True), 8)  # fmt: skip
    act_sig = {"gu_ptr": "*bf16", "out_ptr": "*bf16", "I": "i32", "stride_gu": "i32", "stride_out": "i32",
               "limit": "fp32"}  # fmt: skip
    act = KernelSpec("trtllm_glm.act.kernels", "_swiglu_kernel", act_sig,
                     dict(HAS_LIMIT=True, PRECISE_EXP=True, BLOCK=1024, TRIGGER=True), 4)  # fmt: skip
    sk_sig = {**{k: v for k, v in sig.items() if k not in ("K_PER_SPLIT", "SPLIT")},
              "TILES": "i32", "STEPS": "i32", "PROGRAMS": "i32", "MAX_SEG": "i32"}  # fmt: skip
    sk = KernelSpec("trtllm_glm.quant.kernels", "_fp8_linear_sk_kernel", sk_sig,
                    dict(QBLOCK=128, HW_FP8=True, BLOCK_N=128, BLOCK_M=16, BLOCK_K=128, DOT_FP32=False, X_POW2=True,
                         PDL=True, PREFETCH=512), 4)  # fmt: skip
    specs = [linear(True, True, 512), linear(False, True, 512, 64), linear(True, False, 0), sk, norm, act]
    results = compile_sm90(specs, ptx=True)
    for spec, res in zip(specs, results):
        assert res["ok"], (spec.kernel, spec.constexprs, res.get("error", "")[:2000])
    for spec, res in zip(specs[:4], results[:4]):
        trig, pf, wait, access = _ptx_order(res["ptx"])
        assert len(trig) == 1 and len(wait) == 1 and access, spec.constexprs
        assert trig[0] < wait[0] < min(access), spec.constexprs  # nothing touches memory before the wait
        if spec.constexprs["PREFETCH"]:
            assert len(pf) == 1 and trig[0] < pf[0] < wait[0]  # the weight starts moving before the wait
        else:
            assert not pf
    for spec, res in zip(specs[4:], results[4:]):
        trig, _, wait, access = _ptx_order(res["ptx"])
        # The producers only let the next kernel launch; they never wait themselves (nothing changes for them).
        assert len(trig) == 1 and not wait and trig[0] < min(access), spec.kernel
