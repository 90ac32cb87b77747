"""Request-end checkpoints under the overlap scheduler (emulated CUDA graphs on the CPU, issue 34).

A request that stops on a stop token nobody foresaw had the next decode step launched ahead: that step
already wrote its state slot one row past its end, so it must not be checkpointed; a request that ends
on its length budget is never launched past its end and is checkpointed. Either way the next turn
(the whole sequence + a message) answers exactly like a run without reuse.
"""

from __future__ import annotations

import pytest

from trtllm_glm.runtime.cuda_graph import CudaGraphConfig
from trtllm_glm.runtime.executor import Executor, ExecutorConfig
from trtllm_glm.runtime.sampling import SamplingParams

from .test_cuda_graph import EX_CFG, _model, emulated  # noqa: F401 - the fixture

pytestmark = pytest.mark.cpu_only


def test_request_end_checkpoints_skip_slots_a_launched_ahead_step_wrote(emulated) -> None:  # noqa: F811
    model = _model()
    prompts = [[5, 9, 2, 7, 5, 9, 2, 7, 4, 4, 6, 1, 3, 3, 8, 2, 9, 6], [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7]]

    def make(overlap: bool, reuse: bool) -> Executor:
        cfg = ExecutorConfig(**EX_CFG, cuda_graph_config=CudaGraphConfig(batch_sizes=[1, 2, 4], enable_padding=True),
                             overlap_scheduler=overlap, enable_block_reuse=reuse,
                             checkpoint_request_end=True)  # fmt: skip
        return Executor(model, cfg)

    emulated(True)
    free = make(False, False)
    probe = [free.add_request(p, SamplingParams(max_tokens=10, ignore_eos=True)) for p in prompts]
    free.run_until_done()
    stop = probe[0].output_ids[5]  # request 0 stops on its 6th token; request 1 runs out of budget at 10
    params = [SamplingParams(max_tokens=10, ignore_eos=True, stop_token_ids=[stop]), SamplingParams(max_tokens=10)]

    def turns(ex: Executor):
        first = [ex.add_request(p, sp) for p, sp in zip(prompts, params)]
        ex.run_until_done()
        second = [ex.add_request(r.tokens + [7, 7, 1], SamplingParams(max_tokens=6, ignore_eos=True)) for r in first]
        ex.run_until_done()
        return first, second

    _, want = turns(make(False, False))
    hot = make(True, True)
    first, got = turns(hot)
    assert hot.num_overlapped_steps > 0 and first[0].finish_reason.value == "stop"
    assert [r.output_ids for r in got] == [r.output_ids for r in want]
    assert got[1].num_cached_tokens == len(first[1].tokens) - 1  # ended on its budget: checkpointed at its end
    assert got[0].num_cached_tokens < len(first[0].tokens) - 1  # a step was launched past its end: not


def test_full_batch_overlaps_while_requests_wait(emulated) -> None:  # noqa: F811
    """A batch at max_batch_size with requests waiting keeps launching steps ahead (none could be admitted until
    one finishes; a served batch at capacity runs like this), admits the waiting ones once a slot frees, and
    generates exactly what the plain loop generates."""
    model = _model()
    prompts = [[5, 9, 2, 7, 5], [3, 1, 4, 1, 5, 9], [2, 7, 1, 8], [6, 6, 2, 1, 9, 9, 3], [4, 4, 4]]
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (9, 6, 8, 5, 7)]

    def run(overlap: bool) -> tuple[Executor, list[list[int]]]:
        cfg = dict(EX_CFG, max_batch_size=2)
        ex = Executor(model, ExecutorConfig(**cfg, cuda_graph_config=CudaGraphConfig(batch_sizes=[1, 2]),
                                            overlap_scheduler=overlap, enable_block_reuse=True))  # fmt: skip
        reqs = [ex.add_request(p, sp) for p, sp in zip(prompts, params)]
        waited = 0
        while ex.has_work:
            before = ex.num_overlapped_steps
            ex.step()
            if ex.num_overlapped_steps > before and ex.waiting:
                waited += 1
        ex.waited_overlaps = waited  # type: ignore[attr-defined]
        return ex, [r.output_ids for r in reqs]

    emulated(True)
    _, want = run(False)
    ex, got = run(True)
    assert got == want
    assert ex.waited_overlaps > 3  # type: ignore[attr-defined]
