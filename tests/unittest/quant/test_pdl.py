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

from trtllm_glm.pdl import PDL_ENV, has_pdl
from trtllm_glm.quant import kernels as K


def test_launch_config_resolves_pdl_from_the_argument_the_environment_then_off(monkeypatch) -> None:
    monkeypatch.delenv(PDL_ENV, raising=False)
    base = K.launch_config(1, 4096, 8192, 128, False)
    assert (base.pdl, base.prefetch) == (False, 0)  # off until measured
    on = K.launch_config(1, 4096, 8192, 128, False, pdl=True)
    assert on.pdl and on.prefetch == min(K.PDL_PREFETCH_BYTES, on.k_per_split)
    # Nothing else of the launch changes: the same tiles and reduction order, so the same bits.
    assert {**vars(on), "pdl": False, "prefetch": 0} == vars(base)
    monkeypatch.setenv(PDL_ENV, "1")
    env = K.launch_config(1, 4096, 8192, 128, False)
    assert env == on
    assert not K.launch_config(1, 4096, 8192, 128, False, pdl=False).pdl  # the argument wins
    assert K.launch_config(16, 4096, 8192, 128, False, prefetch=1000).prefetch == 992  # rounded down to 16
    small = K.launch_config(4, 300, 256, 128, False, k_chunk=128)
    assert small.pdl and small.prefetch == 128  # capped at the program's chunk
    assert not K.launch_config(256, 4096, 8192, 128, False).pdl  # prefill chunks: never
    monkeypatch.setenv(PDL_ENV, "0")
    assert not K.launch_config(1, 4096, 8192, 128, False).pdl
    monkeypatch.setenv(PDL_ENV, "yes")
    with pytest.raises(ValueError, match="TRTLLM_GLM_PDL must be 0 or 1"):
        K.launch_config(1, 4096, 8192, 128, False)
    monkeypatch.delenv(PDL_ENV)
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
    monkeypatch.setenv(PDL_ENV, "1")
    got = fp8_linear_triton(x, q, s, 32, k_chunk=96)
    assert torch.equal(got, want)


_ACCESS = re.compile(r"\b(ld\.global|st\.global|atom\.|red\.|cp\.async\.(ca|cg)|ldmatrix|cp\.async\.bulk\.tensor)")


def _ptx_order(ptx: str) -> tuple[list[int], list[int], list[int], list[int]]:
    """Line numbers of: launch_dependents, L2 prefetches, waits, and global memory accesses."""
    lines = ptx.splitlines()
    find = lambda pat: [i for i, x in enumerate(lines) if re.search(pat, x)]  # noqa: E731
    return (find(r"griddepcontrol\.launch_dependents"), find(r"cp\.async\.bulk\.prefetch\.L2"),
            find(r"griddepcontrol\.wait"), find(_ACCESS.pattern))  # fmt: skip


def _decode_kernels() -> list:
    """The small decode kernels that launch with PDL (`trtllm_glm.pdl.use_pdl`), as `KernelSpec`s recorded from
    interpreted CPU launches (argument types and constexprs) with ``PDL=True``."""
    import dataclasses

    from tests.triton_compile import recording
    from trtllm_glm import act, mhc, norm
    from trtllm_glm.kda import kernels as kda

    g = torch.Generator().manual_seed(0)
    r = lambda *shape: torch.randn(*shape, generator=g)  # noqa: E731
    cpu = torch.device("cpu")
    with recording() as rec:
        norm.kernel_module(cpu).row_norm(r(2, 64), 1e-6, weight=r(64))
        act.kernel_module(cpu).swiglu(r(2, 64), 7.0)
        streams = r(2, 4, 64)
        x_in, post, comb = mhc.mhc_pre(streams, r(24, 256) * 0.1, r(24) * 0.1, torch.ones(3), norm_eps=1e-6,
                                       hc_eps=1e-6, sinkhorn_iters=3)  # fmt: skip
        mhc.mhc_post(streams, x_in, post, comb)
        kda.kda_gate_beta(r(2, 2 * 16), r(2, 2), r(2), r(2 * 16), -5.0)
        kda.conv_decode(r(2, 3 * 2 * 16), r(4, 3 * 2 * 16, 3), r(3 * 2 * 16, 4), torch.tensor([1, 3]), 2, 16, 16, 1e-6)
    assert not rec.unsupported, rec.unsupported
    names = sorted(sp.kernel for sp in rec.specs.values())
    assert names == sorted(["_row_norm_kernel", "_swiglu_kernel", "_mix_partial_kernel", "_pre_finish_kernel",
                            "_post_kernel", "_gate_beta_kernel", "_conv_decode_kernel"]), names  # fmt: skip
    out = []
    for sp in rec.specs.values():
        assert sp.constexprs["PDL"] is False  # the CPU never launches with PDL
        out.append(dataclasses.replace(sp, constexprs={**sp.constexprs, "PDL": True}))
    return out


def test_use_pdl_reads_the_switch_per_call(monkeypatch) -> None:
    from trtllm_glm import pdl

    monkeypatch.delenv(pdl.PDL_ENV, raising=False)
    assert pdl.pdl_from_env() is None and pdl.launch_kwargs(False) == {}
    monkeypatch.setenv(pdl.PDL_ENV, "1")
    assert pdl.pdl_from_env() is True and pdl.launch_kwargs(True) == {"launch_pdl": True}
    assert not pdl.use_pdl(torch.device("cpu"))  # no griddepcontrol off CUDA
    monkeypatch.setenv(pdl.PDL_ENV, "0")
    assert pdl.pdl_from_env() is False


def test_pdl_kernels_compile_for_sm90_and_wait_before_any_dependent_access() -> None:
    from tests.triton_compile import KernelSpec, compile_sm90

    sig = {"x_ptr": "*bf16", "w_ptr": "*u8", "s_ptr": "*fp32", "y_ptr": "*bf16", "part_ptr": "*fp32",
           "cnt_ptr": "*i32", "M": "i32", "N": "i32", "K": "i32", "stride_xm": "i32", "stride_wn": "i32",
           "stride_sn": "i32", "stride_ym": "i32", "K_PER_SPLIT": "i32", "SPLIT": "i32"}  # fmt: skip

    def linear(x_as_a: bool, split: bool, prefetch: int, block_n: int = 128) -> KernelSpec:
        c = dict(QBLOCK=128, HW_FP8=True, UNROLL=1, X_AS_A=x_as_a, SPLIT_K=split, BLOCK_N=block_n, BLOCK_M=16,
                 BLOCK_K=128, DOT_FP32=False, X_POW2=True, PDL=True, PREFETCH=prefetch)  # fmt: skip
        return KernelSpec("trtllm_glm.quant.kernels", "_fp8_linear_kernel", sig, c, 4)

    sk_sig = {**{k: v for k, v in sig.items() if k not in ("K_PER_SPLIT", "SPLIT")},
              "TILES": "i32", "STEPS": "i32", "PROGRAMS": "i32", "MAX_SEG": "i32"}  # fmt: skip
    sk = KernelSpec("trtllm_glm.quant.kernels", "_fp8_linear_sk_kernel", sk_sig,
                    dict(QBLOCK=128, HW_FP8=True, BLOCK_N=128, BLOCK_M=16, BLOCK_K=128, DOT_FP32=False, X_POW2=True,
                         PDL=True, PREFETCH=512), 4)  # fmt: skip
    specs = [linear(True, True, 512), linear(False, True, 512, 64), linear(True, False, 0), sk, *_decode_kernels()]
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
        # The small decode kernels of a PDL chain: trigger, wait, then their first load or store.
        assert len(trig) == 1 and len(wait) == 1 and trig[0] < wait[0] < min(access), spec.kernel


@pytest.mark.gpu
def test_pdl_chain_changes_no_bit_of_a_model(monkeypatch) -> None:
    """A block-FP8 model with every small decode kernel launched with PDL (``TRTLLM_GLM_PDL=1``): context logits
    bit for bit those of the plain launches, and greedy tokens with CUDA graphs (captured under each setting) the
    same. A kernel that read before its wait would race the kernel before it and show here."""
    from trtllm_glm import LLM, SamplingParams
    from trtllm_glm.config import Glm5NextConfig
    from trtllm_glm.models.glm5_next import Glm5NextForCausalLM

    if not has_pdl(torch.device("cuda")):
        pytest.skip("needs sm_90+")
    m = Glm5NextForCausalLM.from_config(Glm5NextConfig.from_pretrained("tiny"), seed=4)
    m.quantize_fp8_()
    m = m.to(device="cuda", dtype=torch.bfloat16)
    m.keep_fp32_params_()
    prompts = [[5, 6, 7, 8, 9, 10, 11], list(range(30, 70))]
    sp = SamplingParams(max_tokens=16, ignore_eos=True)
    ctx = SamplingParams(max_tokens=1, return_context_logits=True)
    runs = {}
    for setting in ("0", "1"):
        monkeypatch.setenv(PDL_ENV, setting)
        logits = LLM(m.eval(), cuda_graph_config=None).generate(prompts[1], ctx).context_logits
        tokens = [o.outputs[0].token_ids for o in LLM(m.eval()).generate(prompts, sp)]
        runs[setting] = (logits, tokens)
    assert torch.equal(runs["0"][0], runs["1"][0])
    assert runs["0"][1] == runs["1"][1]
