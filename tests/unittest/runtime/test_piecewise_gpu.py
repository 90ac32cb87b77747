"""Piecewise CUDA graphs of eager steps on the GPU (`trtllm_glm.runtime.piecewise`): every segment captures (no
host sync, no allocation outside the pool, no data-dependent shape), replays give the eager steps' greedy tokens
(plain and n-gram executors; prefill steps and mixed steps of a prompt joining decoding requests), a step
without padding rows equals the eager step bit for bit, and in the batch-invariant mode every step does. Admission
steps with the KDA cores captured inside the segments (`trtllm_glm.kda.static_step`) equal the eager step bit for
bit, padded or not, at first use (capture) and on replays.

Needs CUDA (tests/conftest.py skips ``gpu`` tests without it). Run with ``-s`` to see capture times and memory.
"""

from __future__ import annotations

import pytest
import torch

from benchmarks.harness.model_harness import ModelHarness
from trtllm_glm import envs
from trtllm_glm.models.glm5_next import Glm5NextForCausalLM
from trtllm_glm.numerics import batch_invariant_mode
from trtllm_glm.runtime.cuda_graph import CudaGraphConfig
from trtllm_glm.runtime.executor import Executor, ExecutorConfig
from trtllm_glm.runtime.lossless import compare_greedy
from trtllm_glm.runtime.piecewise import PIECEWISE_ENV, PiecewiseRunner
from trtllm_glm.runtime.sampling import SamplingParams
from trtllm_glm.runtime.speculative_executor import SpeculativeExecutor
from trtllm_glm.speculative.config import NGramDecodingConfig

pytestmark = pytest.mark.gpu

PROMPTS = [
    list(b"def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n"),
    list(b"import os\nimport sys\n\nclass Reader:\n    def __init__(self, path):\n        self.path = "),
    list(b"for i in range(10):\n    print(i)\nfor j in range(10):\n    print("),
    list(b"    if x is None:\n        return None\n    if y is None:\n        return "),
]
MAX_TOKENS = [24, 32, 16, 20]


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def model(request) -> Glm5NextForCausalLM:
    return Glm5NextForCausalLM.from_pretrained("small", dtype=request.param, device="cuda").eval()


def _run(ex: Executor, join_after: int):
    """Greedy run of `PROMPTS`; the last one joins after ``join_after`` steps (a mixed step)."""
    reqs = [ex.add_request(p, SamplingParams(max_tokens=m, ignore_eos=True)) for p, m in zip(PROMPTS, MAX_TOKENS)]
    late = reqs[-1]
    ex.waiting.remove(late)
    steps = 0
    while ex.has_work or late is not None:
        if late is not None and steps == join_after:
            ex.waiting.append(late)
            late = None
        ex.step()
        steps += 1
    return reqs


@pytest.mark.parametrize("mode", ["plain", "ngram"])
def test_piecewise_executor_matches_eager(model, mode: str, monkeypatch) -> None:
    monkeypatch.delenv(PIECEWISE_ENV, raising=False)

    def make(piecewise: bool) -> Executor:
        cfg = ExecutorConfig(tokens_per_block=16, max_tokens=4096, max_batch_size=4, max_num_tokens=256,
                             max_seq_len=256, cuda_graph_config=CudaGraphConfig(piecewise=piecewise))  # fmt: skip
        if mode == "plain":
            return Executor(model, cfg)
        return SpeculativeExecutor(model, cfg, NGramDecodingConfig(max_draft_len=7))

    ref = _run(make(False), join_after=3)
    ex = make(True)
    pw = ex.piecewise
    assert pw is not None and not pw.emulate
    got = _run(ex, join_after=3)
    for a, b in zip(ref, got):
        d = compare_greedy(a.output_ids, a.logit_gaps, b.output_ids)
        assert d is None or d.excused, f"request {a.request_id}: {d}"
    st = pw.stats
    print(f"\n[{mode}, {next(model.parameters()).dtype}] piecewise: {st.steps} steps, {st.replays} replays, "
          f"{st.captures} captures in {st.capture_s:.2f} s, pool +{st.pool_bytes / 2**20:.0f} MiB, "
          f"carry {st.carry_bytes / 2**20:.1f} MiB, {st.eager_steps} eager steps")  # fmt: skip
    assert st.failed == {}, st.failed  # every segment captured: sync-free, allocation-free, static shapes
    # Steps with verify rows stay eager (n-gram drafts from the first decode step on): the prefill step at least.
    assert st.steps >= (2 if mode == "plain" else 1) and st.eager_segments == 0
    # Each step replays its segments (all pieces, with KDA cores inside the segments cut at the sparse cores, or the
    # whole trunk as one), but the ones captured at first use with cores inside: their warm-up was the step's run.
    kda_only = st.kda_steps - st.trunk_steps
    per_step = (st.steps - st.kda_steps) * pw.num_segments + kda_only * len(pw._fused_segments) + st.trunk_steps
    assert st.replays + st.warm_runs == per_step


def _piecewise_step(
    h: ModelHarness, runner: PiecewiseRunner, rows, num_decode_seqs: int, accepted: bool = False
) -> torch.Tensor:
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
    if accepted:  # as a speculative executor does (its rings' cross-check reads them)
        h.meta.set_num_accepted([1] * len(rows))
    assert runner.applies(h.meta)
    with torch.inference_mode():
        hidden = runner.forward([t for _, toks in rows for t in toks], h.meta, h.manager)
    for rid, toks in rows:
        h.lengths[rid] += len(toks)
    return hidden.clone()


def _steps(seed: int, edges: bool) -> list:
    g = torch.Generator().manual_seed(seed)
    t = lambda n: torch.randint(0, 256, (n,), generator=g).tolist()  # noqa: E731
    if edges:  # row counts 16, 16, 32, 4, 1, 48, 8: no padding
        return [
            ([(0, t(9)), (1, t(7))], 0),
            ([(0, t(1)), (1, t(1)), (2, t(14))], 2),
            ([(0, t(1)), (1, t(1)), (2, t(1)), (3, t(29))], 3),
            ([(0, t(1)), (1, t(1)), (2, t(1)), (3, t(1))], 4),
            ([(4, t(1))], 0),
            ([(0, t(1)), (1, t(1)), (2, t(1)), (3, t(1)), (4, t(44))], 4),
            ([(0, t(1)), (1, t(1)), (2, t(1)), (3, t(1)), (4, t(1)), (5, t(3))], 5),
        ]
    return [  # 20, 16, 17, 15, 4, 31, 1, 32, 47 rows
        ([(0, t(13)), (1, t(7))], 0),
        ([(0, t(1)), (1, t(1)), (2, t(14))], 2),
        ([(0, t(1)), (1, t(1)), (2, t(1)), (3, t(14))], 3),
        ([(0, t(1)), (1, t(1)), (2, t(1)), (3, t(12))], 3),
        ([(0, t(1)), (1, t(1)), (2, t(1)), (3, t(1))], 4),
        ([(0, t(1)), (1, t(1)), (2, t(1)), (4, t(28))], 3),
        ([(5, t(1))], 0),
        ([(6, t(32))], 0),
        ([(0, t(1)), (4, t(1)), (5, t(9)), (6, t(3)), (7, t(33))], 2),
    ]


def _bits(model: Glm5NextForCausalLM, steps, *, invariant: bool) -> None:
    """Eager and piecewise (real graphs) on twin caches: hidden, and the caches the cores wrote, bit for bit."""
    model.fuse_weights()  # as an executor on CUDA does before capturing
    ref = ModelHarness(model, max_seq_len=64, max_num_requests=8)
    got = ModelHarness(model, max_seq_len=64, max_num_requests=8)
    runner = PiecewiseRunner(model, max_num_tokens=48, allow_batch_invariant=invariant)
    for i, (rows, nd) in enumerate(steps):
        with torch.inference_mode():
            want = ref.step(rows, num_decode_seqs=nd).clone()
        have = _piecewise_step(got, runner, rows, nd)
        assert torch.equal(have, want), f"step {i} ({have.shape[0]} rows): {(have - want).abs().max().item()}"
    assert torch.equal(ref.manager.state.kda_recurrent, got.manager.state.kda_recurrent)
    assert torch.equal(ref.manager.state.kda_conv, got.manager.state.kda_conv)
    assert torch.equal(ref.manager.latent, got.manager.latent)
    assert runner.stats.failed == {} and runner.stats.replays == len(steps) * runner.num_segments


def test_piecewise_bits_without_padding(model) -> None:
    """Row counts on bucket edges: the same ops on the same shapes, cut into graphs and eager cores."""
    _bits(model, _steps(1, edges=True), invariant=False)


def test_piecewise_bits_in_batch_invariant_mode(model) -> None:
    """Padded steps too: no launch depends on the row count in the mode. Passing this is what allows
    ``allow_batch_invariant=True`` as the executor's default (it is False until then)."""
    with batch_invariant_mode(True):
        _bits(model, _steps(2, edges=False), invariant=True)


def test_capture_all_memory(model) -> None:
    """Start-up capture of every bucket of a 256-token budget: how long and how much memory (printed)."""
    cfg = ExecutorConfig(tokens_per_block=16, max_tokens=4096, max_batch_size=4, max_num_tokens=256,
                         max_seq_len=256, cuda_graph_config=CudaGraphConfig(piecewise=True))  # fmt: skip
    ex = Executor(model, cfg)
    assert ex.piecewise is not None
    ex.capture_cuda_graphs()
    st = ex.piecewise.stats
    print(f"\n[{next(model.parameters()).dtype}] {len(ex.piecewise.buckets)} buckets x {ex.piecewise.num_segments} "
          f"segments: {st.captures} captures in {st.capture_s:.2f} s, pool +{st.pool_bytes / 2**20:.0f} MiB, "
          f"carry {st.carry_bytes / 2**20:.1f} MiB")  # fmt: skip
    pw = ex.piecewise
    # The pure segments of every bucket, and the segments with KDA cores inside and the whole trunk of every (bucket,
    # width class).
    classes = sum(len(v) for v in pw._kda_steps.values())
    want = len(pw.buckets) * pw.num_segments + classes * (len(pw._fused_segments) + 1)
    assert st.failed == {} and st.captures == want
    # Their warm-ups stepped the padding slot only: every other slot is still zero, and no page or ring was written
    # (the whole trunk's warm-ups: padding rows only).
    real = [s for s in range(ex.manager.state.kda_recurrent.shape[1]) if s != ex._padding_slot]
    assert not ex.manager.state.kda_recurrent[:, real].any() and not ex.manager.state.kda_conv[:, real].any()
    assert not ex.manager.latent.view(torch.uint8).any() and not ex.manager.state.tail_ring.any()


def _admission(seed: int) -> list:
    """Admission steps on fixed request ids (rows as token lists; decode rows first): short prompts of uneven lengths
    joining decoding requests, a finished request's slot reused, a chunk over the short-prefill limit (falls back),
    a continuing short chunk and a one-token prompt. Row counts: 32 / 16 / 48 (edges) and padded ones."""
    g = torch.Generator().manual_seed(seed)
    t = lambda n: torch.randint(0, 256, (n,), generator=g).tolist()  # noqa: E731
    d = lambda *rids: [(r, t(1)) for r in rids]  # noqa: E731
    return [
        ([(0, t(10)), (1, t(13)), (2, t(9))], 0, []),  # 32: a pure short prefill
        (d(0, 1, 2) + [(3, t(6)), (4, t(7))], 3, []),  # 16: an admission
        (d(0, 1, 2, 3, 4) + [(5, t(11))], 5, []),  # 16 again: replays
        (d(0, 2, 3, 4, 5) + [(9, t(4)), (6, t(2))], 5, [1]),  # 11 -> 16, request 9 in request 1's slot
        (d(0, 2, 3, 4, 5, 9, 6), 7, []),  # 7 -> 8: decode rows only
        (d(0, 2) + [(7, t(44))], 2, []),  # 46 -> 48: a 44-row chunk with the limit at 40 falls back
        (d(0, 2, 3) + [(7, t(5)), (8, t(1))], 3, []),  # 9 -> 16: a continuing chunk and a one-token prompt
        (d(0, 2, 3, 4, 5) + [(10, t(5)), (11, t(6))], 5, []),  # 16: replays
    ]


def _admit(
    h: ModelHarness, runner: PiecewiseRunner | None, rows, nd: int, freed, accepted: bool = False
) -> torch.Tensor:
    for rid in freed:
        h.manager.free_request(rid)
        del h.lengths[rid]
    if runner is None:
        with torch.inference_mode():
            return h.step(rows, num_decode_seqs=nd).clone()
    return _piecewise_step(h, runner, rows, nd, accepted)


@pytest.mark.parametrize("against", ["eager_forward", "kda_eager_runner"])
def test_kda_inside_segments_bits(model, against: str, monkeypatch) -> None:
    """Real graphs with the KDA cores inside: every admission step's hidden, logits and real slots are the reference's
    bit for bit: the plain eager forward on buckets equal to the row counts (no padding), or the same runner with
    every core eager (padded buckets); the fallback step runs its cores eagerly between the segments."""
    monkeypatch.setenv(envs.KDA_SHORT_PREFILL.name, "40")
    monkeypatch.setenv(envs.KDA_FUSED_DECODE.name, "0")  # (the eager forward's pure decode step: `_decode` too)
    model.fuse_weights()
    steps = _admission(4)
    # (The sparse cores eager: the merged path. The whole trunk as one graph: `test_trunk_graph_bits`.)
    ha = ModelHarness(model, max_seq_len=96, max_num_requests=14)
    hb = ModelHarness(model, max_seq_len=96, max_num_requests=14)
    pad = hb.manager.add_request(-1, 0)
    ha.manager.add_request(-1, 0)
    sizes = sorted({sum(len(x) for _, x in rows) for rows, _, _ in steps}) if against == "eager_forward" else None
    ref = None if against == "eager_forward" else PiecewiseRunner(model, max_num_tokens=48)
    runner = PiecewiseRunner(
        model, max_num_tokens=48, buckets=sizes, padding_slot=pad, max_num_seqs=14, sparse_inside=False
    )
    for i, (rows, nd, freed) in enumerate(steps):
        for r in (x for x in (ref, runner) if x is not None):  # the same padding rows in both (eager cores: stale)
            for buf in r._carry.values():
                buf.zero_()
        want = _admit(ha, ref, rows, nd, freed)
        have = _admit(hb, runner, rows, nd, freed)
        assert torch.equal(have, want), f"step {i} ({have.shape[0]} rows): {(have - want).abs().max().item()}"
        with torch.inference_mode():
            assert torch.equal(model.compute_logits(have), model.compute_logits(want)), f"step {i}: logits"
    real = [s for s in range(hb.manager.state.kda_recurrent.shape[1]) if s != pad]
    assert torch.equal(ha.manager.state.kda_recurrent[:, real], hb.manager.state.kda_recurrent[:, real])
    assert torch.equal(ha.manager.state.kda_conv[:, real], hb.manager.state.kda_conv[:, real])
    st = runner.stats
    print(f"\n[{next(model.parameters()).dtype}, {against}] {st.kda_steps} of {st.steps} steps with KDA inside, "
          f"{st.replays} replays, {st.warm_runs} first captures, pool +{st.pool_bytes / 2**20:.0f} MiB")  # fmt: skip
    assert st.failed == {}, st.failed  # captured: sync-free, allocation-free, static shapes
    assert st.eager_segments == 0 and st.kda_steps == len(steps) - 1 and st.replays > 0


# Which `_admission` steps run the whole trunk as one graph: not the decode-only one (4; with MTP tail rings it does)
# nor the 44-row chunk (5).
_TRUNK = [True, True, True, True, False, False, True, True]


@pytest.mark.parametrize("against", ["eager_forward", "merged_runner", "merged_runner_rings"])
def test_trunk_graph_bits(model, against: str, monkeypatch) -> None:
    """Real graphs with every core inside (the whole trunk one graph per (bucket, width class)): against the plain
    eager forward on buckets equal to the row counts (no padding) every step's hidden, logits, caches and real slots
    are its bits, at first use (capture) and on replays. Against the runner as merged (sparse cores eager) on padded
    buckets, also with MTP tail rings (a speculative executor's manager: the indexer's two passes inside): the same
    greedy tokens; bits where the sparse core's GEMMs give a row the same bits in ``n`` and ``T`` rows (cuBLAS picks
    by the row count: reported, not asserted)."""
    monkeypatch.setenv(envs.KDA_SHORT_PREFILL.name, "40")
    monkeypatch.setenv(envs.KDA_FUSED_DECODE.name, "0")
    model.fuse_weights()
    steps = _admission(5)
    ha = ModelHarness(model, max_seq_len=96, max_num_requests=14)
    hb = ModelHarness(model, max_seq_len=96, max_num_requests=14)
    pad_a, pad = ha.manager.add_request(-1, 0), hb.manager.add_request(-1, 0)
    rings = against == "merged_runner_rings"
    if rings:
        for h in (ha, hb):
            h.manager.enable_decode_tail_rings(4)
    trunk_steps = [t or (rings and i == 4) for i, t in enumerate(_TRUNK)]
    exact = against == "eager_forward"
    sizes = sorted({sum(len(x) for _, x in rows) for rows, _, _ in steps}) if exact else None
    ref = None if exact else PiecewiseRunner(model, max_num_tokens=48, padding_slot=pad_a, max_num_seqs=14,
                                             sparse_inside=False)  # fmt: skip
    runner = PiecewiseRunner(model, max_num_tokens=48, buckets=sizes, padding_slot=pad, max_num_seqs=14)
    worst = 0.0
    for i, (rows, nd, freed) in enumerate(steps):
        for r in (x for x in (ref, runner) if x is not None):
            for buf in r._carry.values():
                buf.zero_()
        t0 = runner.stats.trunk_steps, runner.stats.eager_cores
        want = _admit(ha, ref, rows, nd, freed, accepted=rings)
        have = _admit(hb, runner, rows, nd, freed, accepted=rings)
        assert (runner.stats.trunk_steps - t0[0] == 1) == trunk_steps[i], f"step {i}: trunk steps"
        if trunk_steps[i]:
            assert runner.stats.eager_cores == t0[1], f"step {i}: an eager core in a whole-trunk step"
        with torch.inference_mode():
            lw, lh = model.compute_logits(want), model.compute_logits(have)
        assert torch.equal(lh.argmax(-1), lw.argmax(-1)), f"step {i}: greedy tokens differ"
        if exact:
            assert torch.equal(have, want), f"step {i} ({have.shape[0]} rows): {(have - want).abs().max().item()}"
            assert torch.equal(lh, lw), f"step {i}: logits"
        worst = max(worst, (have.float() - want.float()).abs().max().item())
    if exact:
        assert torch.equal(ha.manager.latent, hb.manager.latent)
        assert torch.equal(ha.manager.index_k.view(torch.uint8), hb.manager.index_k.view(torch.uint8))
        assert torch.equal(ha.manager.state.tail_ring, hb.manager.state.tail_ring)
        real = [s for s in range(hb.manager.state.kda_recurrent.shape[1]) if s != pad]
        assert torch.equal(ha.manager.state.kda_recurrent[:, real], hb.manager.state.kda_recurrent[:, real])
    st = runner.stats
    print(f"\n[{next(model.parameters()).dtype}, {against}] {st.trunk_steps} of {st.steps} steps as one graph, "
          f"{st.replays} replays, {st.warm_runs} first captures, pool +{st.pool_bytes / 2**20:.0f} MiB, "
          f"max |diff| {worst:.3g}")  # fmt: skip
    assert st.failed == {}, st.failed  # captured: sync-free, allocation-free, static shapes
    assert st.eager_segments == 0 and st.trunk_steps == sum(trunk_steps) and st.replays > 0
