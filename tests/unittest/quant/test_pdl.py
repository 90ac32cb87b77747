"""Programmatic dependent launch (`trtllm_glm.pdl`) of the FP8 linear (`quant.kernels`: split-K and stream-K) and the
other kernels of the PDL chain: how a launch resolves it, where the compiled kernels wait and trigger (sm_90 PTX,
compiled without a GPU), and what the interpreter computes with PDL's instructions recorded instead of run.

A PDL-launched kernel may run while the kernel before it still writes; its only safe accesses before
``griddepcontrol.wait`` are reads of constants. The PTX checks below follow every path of a kernel's control flow:
they fail if a load, store or atomic can run before the wait, if the weight prefetch goes missing, if the trigger
is not where ``TRTLLM_GLM_PDL_TRIGGER`` puts it (``start``: before the wait; ``end``: after the main loop, once on
every path), or runs twice.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Callable

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


def test_late_trigger_reads_its_variable_per_call_and_refuses_a_bad_value(monkeypatch) -> None:
    from trtllm_glm.pdl import PDL_TRIGGER_ENV, late_trigger

    monkeypatch.delenv(PDL_TRIGGER_ENV, raising=False)
    assert not late_trigger(True)  # unset: at the start, as before the variable existed
    monkeypatch.setenv(PDL_TRIGGER_ENV, "end")
    assert late_trigger(True)
    assert not late_trigger(False)  # no PDL: one compiled variant
    monkeypatch.setenv(PDL_TRIGGER_ENV, "start")
    assert not late_trigger(True)
    for bad in ("late", "END", "1", ""):
        monkeypatch.setenv(PDL_TRIGGER_ENV, bad)
        with pytest.raises(ValueError, match=f"TRTLLM_GLM_PDL_TRIGGER must be start or end, got {bad!r}"):
            late_trigger(True)
    assert not late_trigger(False)  # without PDL the variable is not read


_ACCESS = re.compile(r"\b(ld\.global|st\.global|atom\.|red\.|cp\.async\.(ca|cg)|ldmatrix|cp\.async\.bulk\.tensor)")
# What a program's main loop does: its tensor-core MMAs and its loads of x and the weight (every global load but
# the split-K join's ".cg" reads of the partials, which follow the loop).
_MAIN_LOOP = re.compile(r"\b(mma\.sync|wgmma\.|ld\.global(?!\.cg)|cp\.async\.(ca|cg)|ldmatrix|cp\.async\.bulk\.tensor)")
_TRIGGER, _WAIT = r"griddepcontrol\.launch_dependents", r"griddepcontrol\.wait"
_BRANCH = re.compile(r"^(@!?%\w+\s+)?bra(\.uni)?\s+(\S+?);?$")
_EXIT = re.compile(r"^(@!?%\w+\s+)?(ret|exit)\b")


def _ptx_order(ptx: str) -> tuple[list[int], list[int], list[int], list[int]]:
    """Line numbers of: launch_dependents, L2 prefetches, waits, and global memory accesses."""
    lines = ptx.splitlines()
    find = lambda pat: [i for i, x in enumerate(lines) if re.search(pat, x)]  # noqa: E731
    return (find(_TRIGGER), find(r"cp\.async\.bulk\.prefetch\.L2"), find(_WAIT), find(_ACCESS.pattern))  # fmt: skip


class _Flow:
    """The control flow of the one kernel of a PTX module: its instructions in order (``ins``; labels, directives
    and scope braces dropped), each one's successors (``succ``; the index ``len(ins)`` is the exit), and the
    instructions that may run before / after a set of them on some path."""

    def __init__(self, ptx: str) -> None:
        lines = iter(ptx.splitlines())
        for line in lines:  # up to the kernel's opening brace (after its parameters)
            if ".entry" in line:
                break
        for line in lines:
            if line.strip() == "{":
                break
        self.ins: list[str] = []
        labels: dict[str, int] = {}
        depth = 1
        for raw in lines:
            line = raw.split("//", 1)[0].strip()
            if line in ("{", "}"):  # scopes of inline asm; the last one closes the kernel
                depth += 1 if line == "{" else -1
                if depth == 0:
                    break
                continue
            if not line or line.startswith("."):
                continue
            if line.endswith(":"):
                labels[line[:-1]] = len(self.ins)
                continue
            self.ins.append(line)
        assert depth == 0 and self.ins, "no kernel body in the PTX"
        self.end = len(self.ins)
        self.succ: list[list[int]] = []
        for i, x in enumerate(self.ins):
            assert not x.startswith("brx") and " brx." not in x, x  # indirect branches: not modelled
            b, e = _BRANCH.match(x), _EXIT.match(x)
            if b:
                nxt = [labels[b.group(3)]]
                self.succ.append(nxt + [i + 1] if b.group(1) else nxt)
            elif e:
                self.succ.append([self.end] + ([i + 1] if e.group(1) else []))
            else:
                self.succ.append([i + 1])

    def find(self, pat: str | re.Pattern) -> set[int]:
        return {i for i, x in enumerate(self.ins) if re.search(pat, x)}

    def reach(self, starts: list[int], blocked: set[int]) -> set[int]:
        """Every node reachable from ``starts`` without entering ``blocked`` (``self.end``: an exit is reachable)."""
        seen: set[int] = set()
        stack = [s for s in starts if s not in blocked]
        while stack:
            i = stack.pop()
            if i in seen:
                continue
            seen.add(i)
            if i < self.end:
                stack.extend(j for j in self.succ[i] if j not in blocked and j not in seen)
        return seen

    def before(self, at: set[int]) -> set[int]:
        """What may run before any of ``at`` (from the entry, not through them)."""
        return self.reach([0], at)

    def after(self, at: set[int]) -> set[int]:
        """What may run after one of ``at``."""
        return self.reach([j for i in at for j in self.succ[i]], set())


def _check_order(name: str, ptx: str, *, late: bool, waits: bool, tail: str) -> None:
    """The order a PDL kernel's PTX must keep (`trtllm_glm.pdl`; on every path of its control flow).

    Every kernel that ``waits`` (launched with PDL) waits on every path before any global load, store or atomic,
    and at most once. The trigger runs exactly once on every path (an exit without it would be a later, implicit
    one; a trigger inside a loop runs many times): with ``late=False`` before the wait and any access (the text
    order of before); with ``late=True`` after the wait and, ``tail="end"``, after the program's last access (it
    is the last thing a program does), or, ``tail="epilogue"`` (the split-K FP8 linear), after the main loop: no
    MMA and no load of x or the weight may follow it, only the epilogue's stores, atomics and the join's ``.cg``
    reads of the partials.
    """
    f = _Flow(ptx)
    trig, wait, access = f.find(_TRIGGER), f.find(_WAIT), f.find(_ACCESS)
    assert access, name
    assert len(trig) == 1 and not f.ins[min(trig)].startswith("@"), (name, "one unpredicated trigger")
    if waits:
        assert len(wait) == 1 and not f.ins[min(wait)].startswith("@"), (name, "one unpredicated wait")
        pre_wait = f.before(wait)
        assert f.end not in pre_wait and not pre_wait & access, (name, "an access or exit before the wait")
        assert not f.after(wait) & wait, (name, "the wait in a loop")
        assert bool(pre_wait & trig) != late, (name, "the trigger on the wrong side of the wait")
    else:
        assert not wait, name
    assert f.end not in f.before(trig), (name, "a path exits without the trigger")
    post = f.after(trig)
    assert not post & trig, (name, "the trigger can run twice (a loop)")
    if not late:
        assert not f.before(trig) & access, (name, "an access before the early trigger")
        t, _, w, a = _ptx_order(ptx)  # and the text order the start trigger always had
        assert t[0] < min(a) and (not waits or t[0] < w[0] < min(a)), name
    elif tail == "end":
        assert not post & access, (name, [f.ins[i] for i in sorted(post & access)][:3])
    else:
        assert not post & f.find(_MAIN_LOOP), (name, [f.ins[i] for i in sorted(post & f.find(_MAIN_LOOP))][:3])
        assert post & access, (name, "the epilogue's stores follow the trigger")


def _record_pdl_launches() -> list:
    """Every kernel that launches with PDL or triggers a dependent's launch, as `KernelSpec`s recorded from
    interpreted CPU launches (argument types and constexprs): the small decode kernels of the PDL chain
    (`trtllm_glm.pdl.use_pdl`), mHC's fused sites among them, and the pool top-k's chunk and merge passes."""
    from tests.triton_compile import recording
    from trtllm_glm import act, mhc, norm
    from trtllm_glm.attention.sparse.glm_kpool import kernels as kpool
    from trtllm_glm.kda import kernels as kda

    g = torch.Generator().manual_seed(0)
    r = lambda *shape: torch.randn(*shape, generator=g)  # noqa: E731
    cpu = torch.device("cpu")
    kw = dict(norm_eps=1e-6, hc_eps=1e-6, sinkhorn_iters=3)
    with recording() as rec:
        norm.kernel_module(cpu).row_norm(r(2, 64), 1e-6, weight=r(64))
        act.kernel_module(cpu).swiglu(r(2, 64), 7.0)
        streams, fn, base, scale, w = r(2, 4, 64), r(24, 256) * 0.1, r(24) * 0.1, torch.ones(3), r(64)
        x_in, post, comb = mhc.mhc_pre(streams, fn, base, scale, **kw)
        mhc.mhc_post(streams, x_in, post, comb)
        prev = (x_in, post, comb)
        mhc.mhc_pre_norm(streams, fn, base, scale, w, **kw, rms_eps=1e-6, prev=prev)
        mhc.mhc_post_mean_norm(streams, *prev, w, rms_eps=1e-6)
        kda.kda_gate_beta(r(2, 2 * 16), r(2, 2), r(2), r(2 * 16), -5.0)
        kda.conv_decode(r(2, 3 * 2 * 16), r(4, 3 * 2 * 16, 3), r(3 * 2 * 16, 4), torch.tensor([1, 3]), 2, 16, 16, 1e-6)
        _fused_kda_decode(r)
        topk = kpool.kernel_module("topk", cpu).select_topk_pools
        topk(r(2, 256), torch.tensor([1000, 300]), 16, method="chunked", chunk=64, num_warps=1, merge_warps=1)
    assert not rec.unsupported, rec.unsupported
    names = sorted({sp.kernel for sp in rec.specs.values() if "PDL" in sp.constexprs})
    assert names == sorted(["_row_norm_kernel", "_swiglu_kernel", "_mix_partial_kernel", "_pre_finish_kernel",
                            "_post_kernel", "_post_mix_kernel", "_post_mean_norm_kernel", "_gate_beta_kernel",
                            "_conv_decode_kernel", "_decode_fused_kernel", "_chunk_kernel",
                            "_merge_kernel"]), names  # fmt: skip
    specs = [sp for sp in rec.specs.values() if "PDL" in sp.constexprs]
    for sp in specs:
        assert sp.constexprs["PDL"] is False  # the CPU never launches with PDL
        # Every kernel that triggers takes the trigger's place as a constexpr (the merge pass never triggers).
        assert sp.constexprs.get("PDL_LATE", "none") == ("none" if sp.kernel == "_merge_kernel" else False), sp.kernel
    return specs


def _fused_kda_decode(r: Callable[..., torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """The fused KDA decode step (`kda.kernels.kda_decode_fused`) on two rows of a 2-head layer (K = V = R = 16, a
    4-tap conv) in a 4-slot pool; returns the ``o_proj`` input, the recurrent output and both pools."""
    from trtllm_glm.kda import kernels as kda

    H, K, V, R, W = 2, 16, 16, 16, 4
    C = H * (2 * K + V)
    conv, state = r(4, C, W - 1), r(4, H, K, V) * 0.5
    y, o = kda.kda_decode_fused(r(2, C), r(2, R), r(2, H), r(2, R), conv, r(C, W) * 0.5, torch.tensor([3, 1]),
                                r(H * K, R) * 0.4, r(H).abs(), r(H * K) * 0.1, -5.0, state, r(H * V, R) * 0.4,
                                1.0 + 0.2 * r(V), 1e-5, K**-0.5, torch.float32)  # fmt: skip
    return y, o, conv, state


def _linear_specs() -> list:
    """The FP8 linear's PDL launches: split-K (x as the MMA's left or right operand), one chunk, stream-K."""
    from tests.triton_compile import KernelSpec

    sig = {"x_ptr": "*bf16", "w_ptr": "*u8", "s_ptr": "*fp32", "y_ptr": "*bf16", "part_ptr": "*fp32",
           "cnt_ptr": "*i32", "M": "i32", "N": "i32", "K": "i32", "stride_xm": "i32", "stride_wn": "i32",
           "stride_sn": "i32", "stride_ym": "i32", "K_PER_SPLIT": "i32", "SPLIT": "i32"}  # fmt: skip

    def linear(x_as_a: bool, split: bool, prefetch: int, block_n: int = 128) -> KernelSpec:
        c = dict(QBLOCK=128, HW_FP8=True, UNROLL=1, X_AS_A=x_as_a, SPLIT_K=split, BLOCK_N=block_n, BLOCK_M=16,
                 BLOCK_K=128, DOT_FP32=False, X_POW2=True, PDL=True, PREFETCH=prefetch, PDL_LATE=False)  # fmt: skip
        return KernelSpec("trtllm_glm.quant.kernels", "_fp8_linear_kernel", sig, c, 4)

    sk_sig = {**{k: v for k, v in sig.items() if k not in ("K_PER_SPLIT", "SPLIT")},
              "TILES": "i32", "STEPS": "i32", "PROGRAMS": "i32", "MAX_SEG": "i32"}  # fmt: skip
    sk = KernelSpec("trtllm_glm.quant.kernels", "_fp8_linear_sk_kernel", sk_sig,
                    dict(QBLOCK=128, HW_FP8=True, BLOCK_N=128, BLOCK_M=16, BLOCK_K=128, DOT_FP32=False, X_POW2=True,
                         PDL=True, PREFETCH=512, PDL_LATE=False), 4)  # fmt: skip
    return [linear(True, True, 512), linear(False, True, 512, 64), linear(True, False, 0), sk]


@pytest.fixture(scope="module")
def pdl_ptx() -> list[tuple[object, bool, str]]:
    """``(spec, late, ptx)`` of every PDL kernel with the trigger at the start and after the main loop, compiled
    for sm_90 without a GPU (one compile process for all)."""
    import dataclasses

    from tests.triton_compile import compile_sm90

    base = _linear_specs() + [dataclasses.replace(sp, constexprs={**sp.constexprs, "PDL": True})
                              for sp in _record_pdl_launches()]  # fmt: skip
    specs = [(sp, False) for sp in base]
    specs += [(dataclasses.replace(sp, constexprs={**sp.constexprs, "PDL_LATE": True}), True)
              for sp in base if "PDL_LATE" in sp.constexprs]  # fmt: skip
    results = compile_sm90([sp for sp, _ in specs], ptx=True)
    for (spec, _), res in zip(specs, results):
        assert res["ok"], (spec.kernel, spec.constexprs, res.get("error", "")[:2000])
    return [(spec, late, res["ptx"]) for (spec, late), res in zip(specs, results)]


def test_pdl_kernels_compile_for_sm90_and_wait_before_any_dependent_access(pdl_ptx) -> None:
    """The trigger at the start (``TRTLLM_GLM_PDL_TRIGGER`` unset or ``start``): trigger, prefetch, wait, then the
    first load or store, the order of before."""
    for spec, late, ptx in pdl_ptx:
        if late:
            continue
        if spec.kernel == "_merge_kernel":  # launched with PDL, never triggers (its exit does)
            trig, _, wait, access = _ptx_order(ptx)
            assert not trig and len(wait) == 1 and wait[0] < min(access)
            continue
        _check_order(spec.kernel, ptx, late=False, waits=spec.kernel != "_chunk_kernel", tail="end")
        trig, pf, wait, _ = _ptx_order(ptx)
        if spec.constexprs.get("PREFETCH"):
            assert len(pf) == 1 and trig[0] < pf[0] < wait[0]  # the weight starts moving before the wait
        else:
            assert not pf


def test_late_trigger_follows_the_main_loop_on_every_path(pdl_ptx) -> None:
    """``TRTLLM_GLM_PDL_TRIGGER=end`` (``PDL_LATE``): the wait still comes first; the trigger runs once on every
    path after the main loop: the FP8 split-K linear after its last MMA and load of x or the weight (before its
    epilogue: y, or the partial and the join), every other kernel (stream-K included) after its last access.
    The weight prefetch stays before the wait."""
    late = [(spec, ptx) for spec, is_late, ptx in pdl_ptx if is_late]
    # Every kernel that triggers (all but the merge pass), in every variant recorded.
    assert len(late) == sum(not is_late and spec.kernel != "_merge_kernel" for spec, is_late, _ in pdl_ptx)
    for spec, ptx in late:
        tail = "epilogue" if spec.kernel == "_fp8_linear_kernel" else "end"
        _check_order(spec.kernel, ptx, late=True, waits=spec.kernel != "_chunk_kernel", tail=tail)
        _, pf, wait, _ = _ptx_order(ptx)
        if spec.constexprs.get("PREFETCH"):
            assert len(pf) == 1 and pf[0] < wait[0]
        else:
            assert not pf


def _interpreted_cases() -> dict[str, Callable[[], torch.Tensor | tuple[torch.Tensor, ...]]]:
    """Each PDL kernel's op on small random CPU inputs, fresh per call (the conv updates its state in place);
    outputs preallocated by the ops are poisoned by the caller's ``torch.empty``."""
    from trtllm_glm import act, mhc, norm
    from trtllm_glm.attention.sparse.glm_kpool import kernels as kpool
    from trtllm_glm.kda import kernels as kda
    from trtllm_glm.quant import quantize_block_fp8
    from trtllm_glm.quant.ops import fp8_linear_triton

    cpu = torch.device("cpu")
    kw = dict(norm_eps=1e-6, hc_eps=1e-6, sinkhorn_iters=3)

    def gen(seed: int):
        g = torch.Generator().manual_seed(seed)
        return lambda *shape: torch.randn(*shape, generator=g)  # noqa: E731

    def linear(**launch):
        def run():
            r = gen(3)
            q, s = quantize_block_fp8(r(96, 400), 32)
            return fp8_linear_triton(r(3, 400), q, s, 32, **launch)

        return run

    def mhc_sites():
        r = gen(5)
        streams, fn, base, scale, w = r(3, 4, 40), r(24, 160) * 0.1, r(24) * 0.1, 1.0 + 0.1 * r(3), r(40)
        pre = mhc.mhc_pre(streams, fn, base, scale, **kw)
        prev = (r(3, 40), pre[1], pre[2])
        return (*pre, mhc.mhc_post(streams, *prev), *mhc.mhc_pre_norm(streams, fn, base, scale, w, **kw,
                rms_eps=1e-6, prev=prev), mhc.mhc_post_mean_norm(streams, *prev, w, rms_eps=1e-6))  # fmt: skip

    def conv():
        r = gen(7)
        state = r(4, 3 * 2 * 16, 3)
        out = kda.conv_decode(r(2, 3 * 2 * 16), state, r(3 * 2 * 16, 4), torch.tensor([1, 3]), 2, 16, 16, 1e-6)
        return (*out, state)

    def topk():
        r = gen(9)
        return kpool.kernel_module("topk", cpu).select_topk_pools(
            r(3, 256), torch.tensor([1000, 300, 41]), 16, method="chunked", chunk=64, num_warps=1, merge_warps=1
        )

    return {
        "norm": lambda: norm.kernel_module(cpu).row_norm(gen(1)(3, 72), 1e-6, weight=gen(2)(72)),
        "swiglu": lambda: act.kernel_module(cpu).swiglu(gen(4)(3, 2 * 40), 7.0),
        "mhc": mhc_sites,
        # Two programs per row: only the first stores beta (a branch every program must leave with its trigger).
        "kda_gate": lambda: kda.kda_gate_beta(*(lambda r: (r(2, 32), r(2, 2), r(2), r(32)))(gen(6)), -5.0, block=16),
        "kda_conv": conv,
        "kda_decode_fused": lambda: _fused_kda_decode(gen(8)),
        "fp8_split": linear(k_chunk=96, x_as_a=True),
        "fp8_split_x_as_b": linear(k_chunk=96, x_as_a=False),
        "fp8_one_chunk": linear(k_chunk=400),
        "fp8_stream_k": linear(stream_k=5),
        "topk": topk,
    }


@pytest.mark.parametrize("trigger", ["start", "end"])
def test_pdl_kernels_interpreted_with_their_trigger_give_the_plain_bits(trigger: str, monkeypatch) -> None:
    """Every PDL kernel run by the interpreter with ``PDL`` on (its trigger and wait recorded instead of executed)
    and the trigger at its start or end gives the plain launch's bits, into outputs poisoned with NaN (or -7). Per
    program, in the order the interpreter ran them: the wait before any load or store; the trigger exactly once,
    before the wait (``start``), or (``end``) after every load but the split-K join's ``.cg`` reads of the partials
    (the FP8 linear) or after everything (the rest)."""
    from triton.runtime import interpreter
    from triton.runtime.interpreter import InterpretedFunction

    from trtllm_glm import pdl

    real_empty, real_empty_like = torch.empty, torch.empty_like

    def poison(t: torch.Tensor) -> torch.Tensor:
        if t.is_floating_point():
            return t.fill_(float("nan"))
        return t if t.dtype == torch.bool else t.fill_(-7)

    monkeypatch.setattr(torch, "empty", lambda *a, **k: poison(real_empty(*a, **k)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: poison(real_empty_like(*a, **k)))
    cases = _interpreted_cases()
    want = {name: case() for name, case in cases.items()}  # plain launches (the CPU never uses PDL)

    builder = interpreter.interpreter_builder
    events: dict[tuple[int, str, tuple[int, ...]], list[str]] = {}
    grids: list[tuple[str, tuple[int, int, int], bool]] = []
    original_run = InterpretedFunction.run

    def log(kind: str):
        def note(*args, **kwargs):
            events.setdefault((len(grids) - 1, grids[-1][0], tuple(builder.grid_idx)), []).append(kind)

        return note

    def run(self, *args, grid, warmup, **kwargs):
        if "PDL" in kwargs:
            kwargs = {**kwargs, "PDL": True}
            if "PDL_LATE" in kwargs:
                kwargs["PDL_LATE"] = trigger == "end"
            dims = tuple(grid) + (1,) * (3 - len(grid))
            grids.append((self.fn.__name__, dims, "PDL_LATE" in kwargs))
        else:
            grids.append(("", (0, 0, 0), False))
        return original_run(self, *args, grid=grid, warmup=warmup, **kwargs)

    def wrap(name: str, kind: str):
        inner = getattr(builder, name)

        def call(*args):
            if grids and grids[-1][0]:
                cache = args[3] if name == "create_masked_load" else None
                log(kind + (".cg" if "CG" in str(cache) else ""))()
            return inner(*args)

        monkeypatch.setattr(builder, name, call)

    monkeypatch.setattr(InterpretedFunction, "run", run)
    monkeypatch.setattr(pdl, "gdc_launch_dependents", log("trigger"))
    monkeypatch.setattr(pdl, "gdc_wait", log("wait"))
    wrap("create_masked_load", "load")
    wrap("create_masked_store", "store")
    wrap("create_atomic_rmw", "atomic")
    wrap("create_atomic_cas", "atomic")
    for name, case in cases.items():
        got = case()
        got, ref = (got, want[name]) if isinstance(got, tuple) else ((got,), (want[name],))
        for i, (a, b) in enumerate(zip(got, ref)):
            assert not (a.isnan().any() if a.is_floating_point() else (a == -7).any()), (name, i, "unwritten")
            assert torch.equal(a, b), (name, i)
    launched = {k for k, _, _ in grids if k}
    assert launched == {"_row_norm_kernel", "_swiglu_kernel", "_mix_partial_kernel", "_pre_finish_kernel",
                        "_post_kernel", "_post_mix_kernel", "_post_mean_norm_kernel", "_gate_beta_kernel",
                        "_conv_decode_kernel", "_decode_fused_kernel", "_fp8_linear_kernel", "_fp8_linear_sk_kernel",
                        "_chunk_kernel", "_merge_kernel"}, launched  # fmt: skip
    for launch, (kernel, dims, triggers) in enumerate(grids):
        if not kernel:
            continue
        waits = kernel != "_chunk_kernel"
        for idx in itertools.product(*(range(d) for d in dims)):
            seq = events.get((launch, kernel, idx), [])
            assert seq.count("wait") == waits and seq.count("trigger") == triggers, (kernel, idx, seq)
            if waits:  # nothing is read or written before the wait
                assert set(seq[: seq.index("wait")]) <= {"trigger"}, (kernel, idx, seq)
            if not triggers:
                continue
            at = seq.index("trigger")
            if trigger == "start":
                assert at == 0, (kernel, idx, seq)
            elif kernel == "_fp8_linear_kernel":
                assert {"trigger", "load"}.isdisjoint(seq[at + 1 :]) and "load" in seq[:at], (kernel, idx, seq)
            else:
                assert at == len(seq) - 1, (kernel, idx, seq)


@pytest.mark.gpu
@pytest.mark.parametrize("trigger", ["start", "end"])
def test_pdl_chain_changes_no_bit_of_a_model(trigger: str, monkeypatch) -> None:
    """A block-FP8 model with every small decode kernel launched with PDL (``TRTLLM_GLM_PDL=1``), each triggering
    the next launch at its start or after its main loop (``TRTLLM_GLM_PDL_TRIGGER``): context logits bit for bit
    those of the plain launches, and greedy tokens with CUDA graphs (captured under each setting) the same. A
    kernel that read before its wait would race the kernel before it and show here."""
    from trtllm_glm import LLM, SamplingParams
    from trtllm_glm.config import Glm5NextConfig
    from trtllm_glm.models.glm5_next import Glm5NextForCausalLM
    from trtllm_glm.pdl import PDL_TRIGGER_ENV

    if not has_pdl(torch.device("cuda")):
        pytest.skip("needs sm_90+")
    monkeypatch.setenv(PDL_TRIGGER_ENV, trigger)  # both runs: the "0" run's pool top-k triggers where it says too
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
