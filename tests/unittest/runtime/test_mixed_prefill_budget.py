"""A cap on the prefill rows of a step that also decodes (`ExecutorConfig.mixed_prefill_budget`): admissions spread
over steps so that no decoding sequence waits for a wide step; steps with nothing to decode stay uncapped; the
batch-invariant mode's whole-or-deferred chunks never starve; greedy output is unchanged (plain, overlap scheduler
with emulated graphs, MTP); bad values refused."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.spec_helpers import emulate_graphs
from trtllm_glm.models.glm5_next import Glm5NextForCausalLM
from trtllm_glm.numerics import batch_invariant_mode
from trtllm_glm.runtime.cuda_graph import CudaGraphConfig
from trtllm_glm.runtime.executor import Executor, ExecutorConfig
from trtllm_glm.runtime.request import Request
from trtllm_glm.runtime.sampling import SamplingParams
from trtllm_glm.runtime.scheduler import Scheduler
from trtllm_glm.runtime.speculative_executor import SpeculativeExecutor
from trtllm_glm.runtime.step_log import StepLog
from trtllm_glm.speculative.config import MTPDecodingConfig

pytestmark = pytest.mark.cpu_only

CFG = ExecutorConfig(tokens_per_block=8, max_tokens=2048, max_batch_size=6, max_num_tokens=128, max_seq_len=96)


def _req(rid: int, n_prompt: int, computed: int = 0) -> Request:
    r = Request(rid, list(range(1, n_prompt + 1)), SamplingParams(max_tokens=4))
    r.num_computed = computed
    return r


def _decoding(rid: int) -> Request:
    return _req(rid, 6, computed=5)  # one row pending: a decode sequence


def _rows(plan) -> list[tuple[int, int, bool]]:
    return [(s.request.request_id, s.num_rows, s.is_decode) for s in plan]


def test_scheduler_caps_prefill_rows_only_beside_decode_rows() -> None:
    s = Scheduler(max_batch_size=8, max_num_tokens=64, mixed_prefill_budget=10)
    d = [_decoding(0), _decoding(1)]
    # Two decoding, two prompts of 7 and 30 waiting: 10 prefill rows in all, the second prompt cut to what is left.
    assert _rows(s.schedule(d, [_req(2, 7), _req(3, 30)])) == [(0, 1, True), (1, 1, True), (2, 7, False),
                                                              (3, 3, False)]  # fmt: skip
    # The budget spent exactly: the next prompt waits for a later step (no zero-row chunk).
    assert _rows(s.schedule(d, [_req(2, 10), _req(3, 30)]))[2:] == [(2, 10, False)]
    # Nothing decoding: the token budget alone.
    assert _rows(s.schedule([], [_req(2, 7), _req(3, 30)])) == [(2, 7, False), (3, 30, False)]
    # The cap and the token budget together: the smaller wins (64 - 2 decode rows > 10; 4-row token budget < 10).
    tight = Scheduler(max_batch_size=8, max_num_tokens=6, mixed_prefill_budget=10)
    assert _rows(tight.schedule(d, [_req(3, 30)]))[2:] == [(3, 4, False)]
    # prefill_chunk_size still caps each chunk inside the budget.
    both = Scheduler(max_batch_size=8, max_num_tokens=64, prefill_chunk_size=4, mixed_prefill_budget=10)
    assert _rows(both.schedule(d, [_req(2, 7), _req(3, 30), _req(4, 9)]))[2:] == [(2, 4, False), (3, 4, False),
                                                                              (4, 2, False)]  # fmt: skip
    # Without a cap: the whole prompts beside the decode rows (the behaviour before the option).
    assert _rows(Scheduler(8, 64).schedule(d, [_req(2, 7), _req(3, 30)]))[2:] == [(2, 7, False), (3, 30, False)]


def test_invariant_mode_sends_a_whole_first_chunk_wider_than_the_cap() -> None:
    s = Scheduler(max_batch_size=8, max_num_tokens=64, prefill_chunk_size=16, mixed_prefill_budget=10)
    d = [_decoding(0)]
    with batch_invariant_mode(True):
        # Chunks are whole or deferred: the first 16-row chunk goes (else it would never be scheduled while anything
        # decodes), nothing after it.
        assert _rows(s.schedule(d, [_req(2, 40), _req(3, 5)]))[1:] == [(2, 16, False)]
        # Under the cap: chunks go while the cap lasts, a wider one after the first waits.
        assert _rows(s.schedule(d, [_req(2, 3), _req(3, 5), _req(4, 40)]))[1:] == [(2, 3, False), (3, 5, False)]


def run(ex: Executor, arrivals: dict[int, list[list[int]]], max_tokens: int = 16) -> list[list[int]]:
    """Two requests decode from step 0; ``arrivals[step]`` prompts join before that step. Returns output ids."""
    reqs = [ex.add_request(p, SamplingParams(max_tokens=max_tokens, ignore_eos=True)) for p in ([5, 9, 2, 7], [3, 1])]
    step = 0
    while ex.has_work:
        for p in arrivals.get(step, []):
            reqs.append(ex.add_request(p, SamplingParams(max_tokens=max_tokens, ignore_eos=True)))
        ex.step()
        step += 1
    return [r.output_ids for r in reqs]


ARRIVALS = {3: [list(range(2, 30))], 5: [list(range(40, 51)), list(range(60, 83))]}


@pytest.fixture(scope="module")
def model() -> Glm5NextForCausalLM:
    return Glm5NextForCausalLM.from_pretrained("tiny", layers=[0, 3], dtype="float32").eval()


@pytest.mark.parametrize("mode", ["plain", "overlap", "mtp"])
def test_output_unchanged_and_mixed_steps_capped(model, monkeypatch, mode: str) -> None:
    cfg = CFG
    if mode == "overlap":
        emulate_graphs(monkeypatch)
        graphs = CudaGraphConfig(batch_sizes=[1, 2, 4, 8], enable_padding=True)
        cfg = dataclasses.replace(cfg, overlap_scheduler=True, cuda_graph_config=graphs)

    def make(c: ExecutorConfig) -> Executor:
        if mode == "mtp":
            return SpeculativeExecutor(model, c, MTPDecodingConfig(num_nextn_predict_layers=2, adaptive=False))
        return Executor(model, c)

    ref_ex = make(cfg)
    ref_ex.step_log = StepLog()
    ref = run(ref_ex, ARRIVALS)
    ex = make(dataclasses.replace(cfg, mixed_prefill_budget=6))
    ex.step_log = log = StepLog()
    got = run(ex, ARRIVALS)
    assert got == ref
    steps, _ = log.snapshot()
    mixed = [s for s in steps if s.decode_seqs and s.prefill_rows]
    # Every step that decoded carried at most 6 prefill rows, and the 62 prompt tokens took at least 62 / 6 of them.
    assert mixed and max(s.prefill_rows for s in mixed) <= 6 and len(mixed) >= 11
    # Without the cap a prompt went whole into a step that decoded.
    ref_steps, _ = ref_ex.step_log.snapshot()
    assert max(s.prefill_rows for s in ref_steps if s.decode_seqs) > 6
    if mode == "overlap":
        # Each capped step of a prompt was planned and launched before the one before it was read back.
        assert ex.num_chunks_ahead >= 5 and ex.num_chained_eager_steps > ref_ex.num_chained_eager_steps


def _overlap_cfg(monkeypatch, **kw) -> ExecutorConfig:
    emulate_graphs(monkeypatch)
    graphs = CudaGraphConfig(batch_sizes=[1, 2, 4, 8], enable_padding=True)
    return dataclasses.replace(CFG, overlap_scheduler=True, cuda_graph_config=graphs, **kw)


def test_seeded_sampling_unchanged_by_chunks_launched_ahead(model, monkeypatch) -> None:
    # A partial chunk makes no token and draws nothing from its request's generator, launched ahead or not: seeded
    # sampled outputs are those of uncapped synchronous steps.
    def run_sampled(ex: Executor) -> list[list[int]]:
        sp = [
            SamplingParams(max_tokens=14, ignore_eos=True, temperature=0.9, top_p=0.95, seed=40 + i) for i in range(4)
        ]
        reqs = [ex.add_request(p, sp[i]) for i, p in enumerate(([5, 9, 2, 7], [3, 1]))]
        step = 0
        while ex.has_work:
            if step == 3:
                reqs += [ex.add_request(list(range(2, 30)), sp[2]), ex.add_request(list(range(40, 57)), sp[3])]
            ex.step()
            step += 1
        return [r.output_ids for r in reqs]

    ref = run_sampled(Executor(model, CFG))
    ex = Executor(model, _overlap_cfg(monkeypatch, mixed_prefill_budget=5))
    assert run_sampled(ex) == ref and ex.num_chunks_ahead > 0


def test_no_chunk_goes_on_ahead_of_a_checkpoint_it_ends_at(model, monkeypatch) -> None:
    # Prefix caching checkpoints the recurrent state where a chunk ends at an endpoint (here every 8 prompt tokens),
    # at the read-back: the next chunk must not have run by then. Every checkpoint equals, bit for bit, the one
    # synchronous steps take, and a request repeating the prompt resumes from them as a fresh executor answers.
    prompt = list(range(3, 40))
    cfg = _overlap_cfg(monkeypatch, mixed_prefill_budget=6, enable_block_reuse=True, checkpoint_interval=8)
    sync_cfg = dataclasses.replace(cfg, overlap_scheduler=False)

    def serve(ex: Executor) -> list[list[int]]:
        first = run(ex, {3: [prompt]})
        again = ex.add_request(prompt + [7, 7], SamplingParams(max_tokens=8, ignore_eos=True))
        ex.run_until_done()
        return [*first, again.output_ids]

    ex, sync = Executor(model, cfg), Executor(model, sync_cfg)
    got, want = serve(ex), serve(sync)
    assert got == want and ex.num_chunks_ahead > 0 and ex.prefix.stats.reused_tokens >= 32
    keys = list(sync.prefix.store)
    assert sorted(keys) == sorted(ex.prefix.store) and len(keys) >= 4
    for k in keys:
        a, b = ex.prefix.store.get(k).target, sync.prefix.store.get(k).target
        assert a.endpoint == b.endpoint and a.planes.keys() == b.planes.keys()
        for name in a.planes:
            assert torch.equal(a.planes[name], b.planes[name]), (a.endpoint, name)


@pytest.mark.parametrize("bad", [0, -3, 2.5, True, "8"])
def test_bad_values_refused(bad) -> None:
    with pytest.raises(ValueError, match="mixed_prefill_budget"):
        ExecutorConfig(mixed_prefill_budget=bad)
    with pytest.raises(ValueError, match="mixed_prefill_budget"):
        Scheduler(4, 64, mixed_prefill_budget=bad)
