"""Admissions held back while a batch decodes (`ExecutorConfig.batch_wait_timeout_iters`,
`batch_wait_max_tokens_ratio`): arrivals a few steps apart are admitted by one step instead of one step each, never
later than the timeout, at once when nothing decodes, the batch's free slots are filled or the token ratio is
reached; greedy output is unchanged; held steps are launched ahead under the overlap scheduler; bad values refused."""

from __future__ import annotations

import dataclasses

import pytest

from tests.spec_helpers import emulate_graphs
from trtllm_glm.models.glm5_next import Glm5NextForCausalLM
from trtllm_glm.runtime.cuda_graph import CudaGraphConfig
from trtllm_glm.runtime.executor import Executor, ExecutorConfig
from trtllm_glm.runtime.sampling import SamplingParams
from trtllm_glm.runtime.speculative_executor import SpeculativeExecutor
from trtllm_glm.speculative.config import MTPDecodingConfig

pytestmark = pytest.mark.cpu_only

CFG = ExecutorConfig(tokens_per_block=8, max_tokens=1024, max_batch_size=6, max_num_tokens=128, max_seq_len=96)
PROMPTS = [[5, 9, 2, 7, 5, 9], [3, 1, 4, 1, 5, 9, 2, 6], [8, 8, 1, 2], [7, 7, 7, 1, 2, 3, 4], [2, 4, 6, 8, 10]]


@pytest.fixture(scope="module")
def model() -> Glm5NextForCausalLM:
    return Glm5NextForCausalLM.from_pretrained("tiny", layers=[0, 3], dtype="float32").eval()


def run(ex: Executor, arrivals: dict[int, list[int]], max_tokens: int = 20):
    """Two requests decode from step 0; ``arrivals[step]`` prompt indices join before that step. Returns the
    requests (in prompt order) and, per step, how many requests it admitted."""
    reqs: dict[int, object] = {}
    for i in (0, 1):
        reqs[i] = ex.add_request(PROMPTS[i], SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    admitted, step = [], 0
    while ex.has_work:
        for i in arrivals.get(step, []):
            reqs[i] = ex.add_request(PROMPTS[i], SamplingParams(max_tokens=max_tokens, ignore_eos=True))
        before = len(ex.waiting)
        ex.step()
        admitted.append(before - len(ex.waiting))
        step += 1
    return [reqs[i] for i in sorted(reqs)], admitted


def test_arrivals_are_admitted_together_and_output_is_unchanged(model) -> None:
    arrivals = {4: [2], 6: [3], 7: [4]}
    ref, adm_ref = run(Executor(model, CFG), arrivals)
    ex = Executor(model, dataclasses.replace(CFG, batch_wait_timeout_iters=5))
    got, adm = run(ex, arrivals)
    assert [r.output_ids for r in got] == [r.output_ids for r in ref]
    # Without holding each arrival has its own admission step (4, 6, 7); held, the first waits its 5 steps (4..8)
    # and the three join at step 9, the timeout counted from the first arrival.
    assert [i for i, n in enumerate(adm_ref) if n and i > 0] == [4, 6, 7]
    assert [i for i, n in enumerate(adm) if n and i > 0] == [9] and adm[9] == 3
    assert ex.num_held_steps == 5 and ex._hold_since is None


def test_holding_ends_early(model) -> None:
    # Nothing decoding: a request arriving at an idle executor is admitted by the next step.
    ex = Executor(model, dataclasses.replace(CFG, batch_wait_timeout_iters=50))
    r = ex.add_request(PROMPTS[0], SamplingParams(max_tokens=4, ignore_eos=True))
    ex.step()
    assert r.num_computed > 0 and ex.num_held_steps == 0
    # The waiting requests fill the batch's free slots: admitted at once (nothing more could join).
    small = dataclasses.replace(CFG, max_batch_size=4, batch_wait_timeout_iters=50)
    _, adm = run(Executor(model, small), {3: [2, 3]})
    assert adm[3] == 2
    # The waiting prompts reach the token ratio: 4 + 7 tokens >= 0.08 * 128 once the second arrives.
    ratio = dataclasses.replace(CFG, batch_wait_timeout_iters=50, batch_wait_max_tokens_ratio=0.08)
    _, adm = run(Executor(model, ratio), {3: [2], 5: [3]})
    assert [i for i, n in enumerate(adm) if n and i > 0] == [5] and adm[5] == 2
    # A running request still prefilling (chunks of 4 rows): its step is mixed anyway, the arrival joins it.
    chunked = dataclasses.replace(CFG, batch_wait_timeout_iters=50, prefill_chunk_size=4, max_num_tokens=8)
    ex = Executor(model, chunked)
    a = ex.add_request(list(range(1, 40)), SamplingParams(max_tokens=4, ignore_eos=True))
    ex.step()
    b = ex.add_request(PROMPTS[2], SamplingParams(max_tokens=4, ignore_eos=True))
    ex.step()
    assert not a.is_decode and b.num_computed > 0 and ex.num_held_steps == 0


def test_held_steps_launch_ahead_under_the_overlap_scheduler(model, monkeypatch) -> None:
    emulate_graphs(monkeypatch)
    graphs = dataclasses.replace(CFG, cuda_graph_config=CudaGraphConfig(batch_sizes=[1, 2, 4, 8], enable_padding=True),
                                 overlap_scheduler=True)  # fmt: skip
    arrivals = {6: [2], 8: [3]}
    plain = Executor(model, graphs)
    ref, _ = run(plain, arrivals, max_tokens=24)
    ex = Executor(model, dataclasses.replace(graphs, batch_wait_timeout_iters=6))
    got, adm = run(ex, arrivals, max_tokens=24)
    assert [r.output_ids for r in got] == [r.output_ids for r in ref]
    # The first held step is planned (a hold starts at a read-back: the step in flight when the request arrived, and
    # the one after it, run as before); the rest are launched ahead (a waiting request that could be admitted stops
    # that), and the arrivals join one step, the timeout after the hold began.
    assert ex.num_held_steps >= 1 and ex.num_overlapped_steps > plain.num_overlapped_steps
    (at,) = [i for i, n in enumerate(adm) if n and i > 0]
    assert adm[at] == 2 and 6 + 6 <= at <= 6 + 6 + 2


def test_speculative_rounds_while_held(model) -> None:
    arrivals = {3: [2], 5: [3]}
    spec = MTPDecodingConfig(num_nextn_predict_layers=2, adaptive=False)
    ref, _ = run(Executor(model, CFG), arrivals)
    ex = SpeculativeExecutor(model, dataclasses.replace(CFG, batch_wait_timeout_iters=4), spec)
    got, adm = run(ex, arrivals)
    assert [r.output_ids for r in got] == [r.output_ids for r in ref]
    assert ex.num_held_steps > 0 and sum(1 for n in adm[1:] if n) == 1


@pytest.mark.parametrize(
    ("field", "bad"),
    [("batch_wait_timeout_iters", -1), ("batch_wait_timeout_iters", 2.0), ("batch_wait_timeout_iters", True),
     ("batch_wait_max_tokens_ratio", 1.5), ("batch_wait_max_tokens_ratio", -0.1), ("batch_wait_max_tokens_ratio", "0")],
)  # fmt: skip
def test_bad_values_refused(field: str, bad) -> None:
    with pytest.raises(ValueError, match=field):
        ExecutorConfig(**{field: bad})
