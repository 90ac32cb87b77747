"""Piecewise CUDA graphs of eager steps (`trtllm_glm.runtime.piecewise`) on the CPU: the runner emulated (each
padded segment run eagerly on the carry buffers, twice the first time as a capture's warm-up would) against the
plain eager forward, on ragged mixed batches (decode rows and prompts of uneven lengths, row counts on, just below
and just above bucket edges), with every carry buffer poisoned with NaN before each step (a real row left unwritten,
or a padding row that leaks into a real one, shows); the executor with the switch on and off; the config and the
environment override.

The real capture and replay run in ``test_piecewise_gpu.py``.
"""

from __future__ import annotations

import pytest
import torch

from benchmarks.harness.model_harness import ModelHarness
from trtllm_glm.models.glm5_next import Glm5NextForCausalLM
from trtllm_glm.numerics import batch_invariant_mode
from trtllm_glm.runtime import piecewise as pw_mod
from trtllm_glm.runtime.cuda_graph import CudaGraphConfig
from trtllm_glm.runtime.executor import Executor, ExecutorConfig
from trtllm_glm.runtime.lossless import compare_greedy
from trtllm_glm.runtime.piecewise import (
    PIECEWISE_ENV,
    PiecewiseRunner,
    piecewise_buckets,
    piecewise_enabled,
    piecewise_from_env,
)
from trtllm_glm.runtime.sampling import SamplingParams
from trtllm_glm.runtime.speculative_executor import SpeculativeExecutor
from trtllm_glm.speculative.config import NGramDecodingConfig

pytestmark = pytest.mark.cpu_only


# ------------------------------------------------------------------------------------------------
# Buckets, switch, config
def test_buckets() -> None:
    assert piecewise_buckets(0) == []
    assert piecewise_buckets(1) == [1]
    assert piecewise_buckets(48) == [1, 2, 4, 8, 16, 32, 48]
    assert piecewise_buckets(256) == [1, 2, 4, 8, 16, 32, 64, 128, 256]
    assert piecewise_buckets(1000) == [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 768, 1000]
    assert piecewise_buckets(2048)[-4:] == [1280, 1536, 1792, 2048]


def test_env_override_and_config(monkeypatch) -> None:
    monkeypatch.delenv(PIECEWISE_ENV, raising=False)
    assert piecewise_from_env() is None
    assert CudaGraphConfig().piecewise is None and CudaGraphConfig().piecewise_max_num_tokens == 2048
    # Auto: on with real graphs (CUDA), off where tests emulate them on the CPU.
    assert piecewise_enabled(CudaGraphConfig()) and not piecewise_enabled(CudaGraphConfig(), auto=False)
    assert not piecewise_enabled(None) and not piecewise_enabled(CudaGraphConfig(piecewise=False))
    assert piecewise_enabled(CudaGraphConfig(piecewise=True), auto=False)
    monkeypatch.setenv(PIECEWISE_ENV, "1")
    assert piecewise_enabled(CudaGraphConfig(piecewise=False), auto=False) and not piecewise_enabled(None)
    monkeypatch.setenv(PIECEWISE_ENV, "off")
    assert not piecewise_enabled(CudaGraphConfig(piecewise=True))
    monkeypatch.setenv(PIECEWISE_ENV, "maybe")
    with pytest.raises(ValueError, match=PIECEWISE_ENV):
        piecewise_enabled(CudaGraphConfig())
    bad_values = ({"piecewise": 1}, {"piecewise": "auto"}, {"piecewise_max_num_tokens": -1},
                  {"piecewise_max_num_tokens": True})  # fmt: skip
    for bad in bad_values:
        with pytest.raises(ValueError):
            CudaGraphConfig(**bad)
    assert CudaGraphConfig.from_value({"piecewise": True, "piecewise_max_num_tokens": 0}).piecewise


# ------------------------------------------------------------------------------------------------
# The runner against the eager forward
def _model() -> Glm5NextForCausalLM:
    # KDA + dense FFN, KDA + MoE, KDA + MoE, sparse MLA + MoE: every kind of segment and core.
    return Glm5NextForCausalLM.from_pretrained("tiny", layers=[0, 1, 2, 3], dtype="float32").eval()


def _poison(runner: PiecewiseRunner) -> None:
    for buf in runner._carry.values():
        if buf.is_floating_point():
            buf.fill_(float("nan"))


def _piecewise_step(h: ModelHarness, runner: PiecewiseRunner, rows, num_decode_seqs: int) -> torch.Tensor:
    """`ModelHarness.step` with the trunk run by ``runner``."""
    for rid, toks in rows:
        if rid not in h.lengths:
            h.manager.add_request(rid)
            h.lengths[rid] = 0
        h.manager.ensure_capacity(rid, h.lengths[rid] + len(toks))
    rids = [r for r, _ in rows]
    h.meta.prepare(
        rids, past_lens=[h.lengths[r] for r in rids], q_lens=[len(t) for _, t in rows],
        num_decode_seqs=num_decode_seqs,
    )  # fmt: skip
    assert runner.applies(h.meta)
    ids = [t for _, toks in rows for t in toks]
    with torch.no_grad():
        hidden = runner.forward(ids, h.meta, h.manager)
    for rid, toks in rows:
        h.lengths[rid] += len(toks)
    return hidden.clone()


def _toks(g: torch.Generator, n: int) -> list[int]:
    return torch.randint(0, 264, (n,), generator=g).tolist()


def _ragged_steps(seed: int = 0) -> list[tuple[list[tuple[int, list[int]]], int]]:
    """Ragged steps: (rows, decode sequences). Row counts 20 (bucket 32), 16 (an edge), 17 (just above), 15 (just
    below), 4 decode rows only, 31 (below an edge), 1 (a lone prefill row), 32 (an edge: every row a prompt's),
    48 (the largest bucket: decode rows and three prompts)."""
    g = torch.Generator().manual_seed(seed)
    t = lambda n: _toks(g, n)  # noqa: E731
    return [
        ([(0, t(13)), (1, t(7))], 0),
        ([(0, t(1)), (1, t(1)), (2, t(14))], 2),
        ([(0, t(1)), (1, t(1)), (2, t(1)), (3, t(14))], 3),
        ([(0, t(1)), (1, t(1)), (2, t(1)), (3, t(12))], 3),
        ([(0, t(1)), (1, t(1)), (2, t(1)), (3, t(1))], 4),
        ([(0, t(1)), (1, t(1)), (2, t(1)), (4, t(28))], 3),
        ([(5, t(1))], 0),
        ([(6, t(32))], 0),
        ([(0, t(1)), (4, t(1)), (5, t(9)), (6, t(3)), (7, t(34))], 2),
    ]


def _edge_steps(seed: int = 1) -> list[tuple[list[tuple[int, list[int]]], int]]:
    """Mixed steps whose row counts are buckets (16, 16, 32, 4, 1, 48, 8): no padding row."""
    g = torch.Generator().manual_seed(seed)
    t = lambda n: _toks(g, n)  # noqa: E731
    return [
        ([(0, t(9)), (1, t(7))], 0),
        ([(0, t(1)), (1, t(1)), (2, t(14))], 2),
        ([(0, t(1)), (1, t(1)), (2, t(1)), (3, t(29))], 3),
        ([(0, t(1)), (1, t(1)), (2, t(1)), (3, t(1))], 4),
        ([(4, t(1))], 0),
        ([(0, t(1)), (1, t(1)), (2, t(1)), (3, t(1)), (4, t(44))], 4),
        ([(0, t(1)), (1, t(1)), (2, t(1)), (3, t(1)), (4, t(1)), (5, t(3))], 5),
    ]


def _compare(model: Glm5NextForCausalLM, steps, *, exact: bool, invariant: bool = False) -> PiecewiseRunner:
    """Every step eagerly and piecewise (emulated) on twin caches, the carry buffers poisoned before each step:
    greedy tokens equal, hidden and caches equal to fp32 rounding or (``exact``) bit for bit.

    Bits are compared only where no step is padded (the same ops on the same shapes): with padding rows the
    CPU's elementwise kernels may round a row differently (where a vectorised loop's tail falls), also in the
    batch-invariant mode, whose bits the GPU test checks."""
    ref = ModelHarness(model, max_seq_len=64, max_num_requests=8)
    got = ModelHarness(model, max_seq_len=64, max_num_requests=8)
    runner = PiecewiseRunner(model, max_num_tokens=48, emulate=True, allow_batch_invariant=invariant)
    assert runner.buckets == [1, 2, 4, 8, 16, 32, 48]
    for i, (rows, nd) in enumerate(steps):
        with torch.no_grad():
            want = ref.step(rows, num_decode_seqs=nd).clone()
        _poison(runner)
        have = _piecewise_step(got, runner, rows, nd)
        assert have.shape == want.shape
        assert torch.isfinite(have).all(), f"step {i}: rows left unwritten or padding leaked (NaN)"
        lw, lh = model.compute_logits(want), model.compute_logits(have)
        assert torch.equal(lw.argmax(-1), lh.argmax(-1)), f"step {i}: greedy tokens differ"
        if exact:
            assert torch.equal(have, want), f"step {i}: bits differ ({(have - want).abs().max().item()})"
        else:
            torch.testing.assert_close(have, want, rtol=1e-5, atol=1e-5, msg=f"step {i}")
    # The caches the cores wrote are the eager steps'.
    for a, b in (
        (ref.manager.state.kda_recurrent, got.manager.state.kda_recurrent),
        (ref.manager.state.kda_conv, got.manager.state.kda_conv),
        (ref.manager.latent, got.manager.latent),
    ):
        if exact:
            assert torch.equal(a, b)
        else:
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    return runner


def test_emulated_piecewise_matches_eager() -> None:
    runner = _compare(_model(), _ragged_steps(), exact=False)
    st = runner.stats
    assert st.steps == 9 and st.replays == 0 and st.eager_segments == 9 * 5
    # Buckets met: 32 (20, 17, 31, 32 rows), 16 (16, 15), 4, 1, 48: every segment of each ran twice the first time.
    assert runner._emulated == {(k, T) for k in range(5) for T in (1, 4, 16, 32, 48)}
    assert st.carry_bytes > 0


def test_emulated_piecewise_bits_without_padding() -> None:
    """Row counts on bucket edges: the piecewise step is the eager step bit for bit (cut, carried, re-joined)."""
    _compare(_model(), _edge_steps(), exact=True)


def test_emulated_piecewise_in_batch_invariant_mode() -> None:
    with batch_invariant_mode(True):
        _compare(_model(), _ragged_steps(2), exact=False, invariant=True)
        _compare(_model(), _edge_steps(3), exact=True, invariant=True)


def test_breaking_the_buffer_handling_is_caught(monkeypatch) -> None:
    """The comparison above fails when the carry handling is broken: one buffer for both layer parities (a
    segment then reads what its own warm-up wrote), or a core output that misses a real row."""
    model = _model()
    monkeypatch.setattr(pw_mod, "_BY_PARITY", frozenset())
    with pytest.raises(AssertionError):
        _compare(model, _ragged_steps(), exact=False)
    monkeypatch.undo()
    put = PiecewiseRunner._put

    def short_core(self, layer, name, t):
        put(self, layer, name, t[:-1] if name == "core" and t.shape[0] > 1 else t)

    monkeypatch.setattr(PiecewiseRunner, "_put", short_core)
    with pytest.raises(AssertionError):
        _compare(model, _ragged_steps(), exact=False)


def test_applies() -> None:
    model = _model()
    h = ModelHarness(model, max_seq_len=64, max_num_requests=2)
    runner = PiecewiseRunner(model, max_num_tokens=48, max_tokens=16, emulate=True)
    assert runner.buckets == [1, 2, 4, 8, 16]
    h.manager.add_request(0)
    h.manager.ensure_capacity(0, 20)
    h.meta.prepare([0], past_lens=[0], q_lens=[17], num_decode_seqs=0)
    assert not runner.applies(h.meta)  # above the largest bucket
    h.meta.prepare([0], past_lens=[0], q_lens=[16], num_decode_seqs=0)
    assert runner.applies(h.meta)
    h.meta.spec.verify_seqs = [0]
    assert runner.applies(h.meta)  # verify rows too (the KDA cores keep copies for their records)
    h.meta.spec.verify_seqs = []
    with batch_invariant_mode(True):
        assert not runner.applies(h.meta)
    assert runner.stats.eager_steps == 2
    assert PiecewiseRunner(model, max_num_tokens=48, emulate=False).enabled is False  # the CPU: no graphs


# ------------------------------------------------------------------------------------------------
# The executor
EX_CFG = dict(tokens_per_block=8, max_tokens=1024, max_batch_size=4, max_num_tokens=48, max_seq_len=96)
PROMPTS = [[5, 9, 2, 7, 5, 9, 2, 7, 5, 9, 2], [3, 1, 4, 1, 5, 9, 2, 6, 5], [8, 8, 1, 2, 3, 8, 8, 1], [7, 1, 7, 1, 7]]


def _run(ex: Executor, join_after: int = 2):
    reqs = [ex.add_request(p, SamplingParams(max_tokens=m, ignore_eos=True)) for p, m in zip(PROMPTS, [5, 7, 4, 5])]
    late = reqs.pop()
    ex.waiting.remove(late)
    steps = 0
    while ex.has_work or late is not None:
        if late is not None and steps == join_after:
            ex.waiting.append(late)
            reqs.append(late)
            late = None
        ex.step()
        steps += 1
    return reqs


def test_warm_up_also_runs_the_step_shapes_with_eager_cores(monkeypatch) -> None:
    """With piecewise graphs the warm-up's admissions replay graphs; a served step that does not qualify runs its cores
    eagerly at kernel variants no graph compiled (H200: the sparse top-k compiled while serving). So the warm-up runs
    its step shapes a second time without the runner, and hands the runner back."""
    from trtllm_glm.runtime.warmup import warm_up

    monkeypatch.setattr(Executor, "_graphs_supported", lambda self: True)
    monkeypatch.delenv(PIECEWISE_ENV, raising=False)
    cgc = CudaGraphConfig(batch_sizes=[1, 2, 3, 4], piecewise=True)
    ex = Executor(_model(), ExecutorConfig(**EX_CFG, cuda_graph_config=cgc))
    runner = ex.piecewise
    assert runner is not None
    seen: list[tuple[bool, bool]] = []  # (runner present, the step has prefill rows)
    forward = ex._forward

    def spy(plan):  # noqa: ANN001, ANN202
        seen.append((ex.piecewise is not None, any(not s.is_decode for s in plan)))
        return forward(plan)

    ex._forward = spy
    warm_up(ex)
    del ex._forward
    assert ex.piecewise is runner
    assert (True, True) in seen and (False, True) in seen, sorted(set(seen))


@pytest.mark.parametrize("mode", ["plain", "ngram"])
def test_executor_piecewise_matches_eager(monkeypatch, mode: str) -> None:
    """Prefill steps and a mixed step (a prompt joining three decoding requests) run piecewise; decode steps
    replay the (emulated) full graphs; greedy tokens equal the eager executor's."""
    monkeypatch.setattr(Executor, "_graphs_supported", lambda self: True)
    monkeypatch.delenv(PIECEWISE_ENV, raising=False)
    model = _model()

    def make(piecewise: bool) -> Executor:
        # Exact decode sizes: the torch k-pool ops (the CPU default) refuse padding sequences.
        cgc = CudaGraphConfig(batch_sizes=[1, 2, 3, 4], piecewise=piecewise)
        cfg = ExecutorConfig(**EX_CFG, cuda_graph_config=cgc)
        if mode == "plain":
            return Executor(model, cfg)
        return SpeculativeExecutor(model, cfg, NGramDecodingConfig(max_draft_len=2))

    ref = _run(make(False))
    ex = make(True)
    assert ex.piecewise is not None and ex.piecewise.emulate
    got = _run(ex)
    for a, b in zip(ref, got):
        d = compare_greedy(a.output_ids, a.logit_gaps, b.output_ids)
        assert d is None or d.excused, f"request {a.request_id}: {d}"
    assert ex.piecewise.stats.steps >= 2  # the first prefill and the late prompt's mixed step
    monkeypatch.setenv(PIECEWISE_ENV, "0")
    assert make(True).piecewise is None
    monkeypatch.setenv(PIECEWISE_ENV, "1")
    assert make(False).piecewise is not None
    monkeypatch.delenv(PIECEWISE_ENV, raising=False)
    # The default (auto) leaves emulated graphs without piecewise; the batch-invariant mode, where no step would
    # replay a segment, builds no runner even when asked for (no captures, no pool for nothing).
    cfg = ExecutorConfig(**EX_CFG, cuda_graph_config=CudaGraphConfig(batch_sizes=[1, 2, 3, 4]))
    assert Executor(model, cfg).piecewise is None
    with batch_invariant_mode(True):
        assert make(True).piecewise is None


@pytest.mark.parametrize("mode", ["plain", "ngram", "mtp"])
def test_capture_cuda_graphs_captures_every_piecewise_bucket(monkeypatch, mode: str) -> None:
    """`capture_cuda_graphs` (what `LLM`, the server and the benchmarks call at start-up) captures the piecewise
    buckets with the target cache and metadata, for the speculative executors too: theirs were left to first use,
    so that the first prefill of each bucket captured it (233-302 ms against 14-20 ms for a 480-token prompt, H100,
    trained `small`, 2026-12-07)."""
    from trtllm_glm.speculative.config import MTPDecodingConfig

    monkeypatch.setattr(Executor, "_graphs_supported", lambda self: True)
    monkeypatch.delenv(PIECEWISE_ENV, raising=False)
    calls: list[tuple] = []
    monkeypatch.setattr(PiecewiseRunner, "capture_all", lambda self, buckets=None, manager=None, meta=None:
                        calls.append((self, buckets, manager, meta)))  # fmt: skip
    model = _model()
    cfg = ExecutorConfig(**EX_CFG, cuda_graph_config=CudaGraphConfig(batch_sizes=[1, 2, 3, 4], piecewise=True))
    if mode == "plain":
        ex = Executor(model, cfg)
    elif mode == "ngram":
        ex = SpeculativeExecutor(model, cfg, NGramDecodingConfig(max_draft_len=2))
    else:
        ex = SpeculativeExecutor(model, cfg, MTPDecodingConfig(max_draft_len=2, adaptive=False))
    assert ex.piecewise is not None
    ex.capture_cuda_graphs()
    assert calls == [(ex.piecewise, None, ex.manager, ex.meta)]


@pytest.mark.parametrize(("short", "drafts"), [(0, "oracle"), (16, "oracle"), (16, "mtp")])
def test_a_step_with_verify_rows_runs_piecewise_and_commits_from_copies(monkeypatch, short: int, drafts: str) -> None:
    """A prompt joining requests that verify drafts: that step runs piecewise (it ran eagerly before 2026-12-08),
    its KDA cores as `mix_spec` on copies of the carry rows, since the next layers overwrite those rows (layers 0 and
    2 share them here) before the commit reads its records. Tokens and the KDA state of every request's slot after
    each step equal the eager executor's; the drafts replay the plain run's tokens with every third one corrupted
    (accepted runs of 0-2). ``short``: the short-prefill limit (the CPU's default 0; 16 as on a GPU, where a step of
    short rows runs its KDA cores inside the graphs from a static description, which would step a verify sequence's
    state in place: such a step must keep its cores eager). ``drafts``: the oracle's, or the MTP layer's (K = 3, its
    tail rings in the sparse layers' caches)."""
    from tests.spec_helpers import emulate_graphs
    from trtllm_glm import envs
    from trtllm_glm.speculative.config import MTPDecodingConfig
    from trtllm_glm.speculative.drafters import OracleDrafter

    emulate_graphs(monkeypatch)  # (the k-pool's writes through its kernels: padded MTP graph steps)
    monkeypatch.delenv(PIECEWISE_ENV, raising=False)
    monkeypatch.setenv(envs.KDA_SHORT_PREFILL.name, str(short))
    monkeypatch.setenv(envs.KDA_DECODE_RIDE.name, "0")
    model = _model()
    prompts = [*PROMPTS[:3], [7, 1, 7, 2, 6, 1, 6, 2, 7, 1, 7, 2, 6, 1]]
    plain = Executor(model, ExecutorConfig(**EX_CFG))
    cont = {i: plain.add_request(p, SamplingParams(max_tokens=12, ignore_eos=True)) for i, p in enumerate(prompts)}
    plain.run_until_done()

    def run(piecewise: bool):  # noqa: ANN202
        cgc = CudaGraphConfig(batch_sizes=[1, 2, 3, 4], piecewise=piecewise)
        cfg = ExecutorConfig(**EX_CFG, cuda_graph_config=cgc)
        if drafts == "mtp":
            ex = SpeculativeExecutor(model, cfg, MTPDecodingConfig(max_draft_len=3, adaptive=False))
        else:
            drafter = OracleDrafter({i: r.output_ids for i, r in cont.items()}, lambda i, j: (i + j) % 3 == 0,
                                    vocab_size=model.config.vocab_size)  # fmt: skip
            ex = SpeculativeExecutor(model, cfg, NGramDecodingConfig(max_draft_len=3), drafter=drafter)
        verify_steps: list[int] = []
        if piecewise:
            forward = ex.piecewise.forward

            def counted(ids, meta, manager):  # noqa: ANN001, ANN202
                verify_steps.append(len(meta.spec.verify_seqs))
                return forward(ids, meta, manager)

            monkeypatch.setattr(ex.piecewise, "forward", counted)
        reqs = [ex.add_request(p, SamplingParams(max_tokens=12, ignore_eos=True)) for p in prompts[:3]]
        states = []
        for step in range(60):
            if step == 3:  # joins three requests that verify drafts
                reqs.append(ex.add_request(prompts[3], SamplingParams(max_tokens=12, ignore_eos=True)))
            if not ex.has_work:
                break
            ex.step()
            snap = {}
            for r in ex.running:
                slot = ex.manager.get_state_slot(r.request_id)
                for i in range(ex.manager.num_kda_layers):
                    st = ex.manager.kda_layer_state(i)
                    snap[(r.request_id, i)] = (st.conv[slot].clone(), st.recurrent[slot].clone())
            states.append(snap)
        return reqs, states, verify_steps

    ref, ref_states, _ = run(False)
    got, got_states, verify_steps = run(True)
    assert any(verify_steps), verify_steps  # the mixed verify step went piecewise
    assert sum(r.num_verify_rounds for r in got) > 0
    for a, b, c in zip(ref, got, cont.values()):
        assert a.output_ids == b.output_ids == c.output_ids, (a.request_id, a.output_ids, b.output_ids)
    for step, (sa, sb) in enumerate(zip(ref_states, got_states)):
        assert sa.keys() == sb.keys()
        for key in sa:
            for x, y in zip(sa[key], sb[key]):
                torch.testing.assert_close(y, x, rtol=1e-5, atol=1e-5, msg=f"step {step}, {key}")
