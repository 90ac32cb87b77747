"""The step log (runtime/step_log.py): every step recorded, each request's TTFT split into parts that add up."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from tests.serve_helpers import make_llm, metric, run, wait_idle
from trtllm_glm import SamplingParams
from trtllm_glm.runtime.step_log import StepLog, summarize
from trtllm_glm.serve.engine import AsyncEngine, GenerationRequest

pytestmark = pytest.mark.cpu_only


def test_served_requests_ttft_parts_add_up(tmp_path) -> None:
    """Concurrent requests with a small token budget (some wait, prefill in chunks, mix with decodes): each
    request's queue + prefill + delivery equals its TTFT, the steps cover every row fed, and the file holds
    what memory holds."""
    path = tmp_path / "steps.jsonl"
    log = StepLog(path)
    # 2 sequences per step and 24 rows: the third and fourth request wait; 40-token prompts take 2+ chunks.
    llm = make_llm(max_batch_size=2, max_num_tokens=24)
    eng = AsyncEngine(llm, max_queue_size=8, step_log=log)
    eng.start()
    # Distinct first tokens: no prefix is shared, so every prompt row is computed.
    prompts = [[3 + i] + list(range(50, 50 + n - 1)) for i, n in enumerate((40, 9, 33, 5))]
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)

    async def one(p: list[int]) -> tuple[float, int]:
        stream = await eng.submit([GenerationRequest(p, params)])
        n = 0
        async for d in stream:
            n += len(d.token_ids)
        return 0.0, n

    async def main():
        return await asyncio.gather(*(one(p) for p in prompts))

    try:
        outs = run(main())
        wait_idle(eng)
    finally:
        eng.stop(drain_timeout=0)
    assert [n for _, n in outs] == [5] * 4
    steps, reqs = log.snapshot()
    log.close()
    assert len(reqs) == 4
    for t in reqs:
        parts = t.parts()
        assert None not in parts.values(), parts
        assert parts["queue_s"] + parts["prefill_s"] + parts["delivery_s"] == pytest.approx(parts["ttft_s"], abs=1e-9)
        assert parts["inbox_s"] + parts["schedule_s"] == pytest.approx(parts["queue_s"], abs=1e-9)
        # The inbox wait: to the engine's inbox (here: submit itself), then until the engine thread took it.
        assert parts["transport_s"] + parts["loop_wait_s"] == pytest.approx(parts["inbox_s"], abs=1e-9)
        assert min(parts.values()) >= 0.0
        assert t.prefill_steps >= -(-t.prompt_tokens // 24)  # at least one step per budget-sized chunk
        assert t.output_tokens == 5 and t.cached_tokens == 0
    # The request queued behind two others waited at least a step for a free slot.
    assert max(t.schedule_s for t in reqs) > 0.0
    # Every row fed is in some step: prompts and one row per generated token after the first.
    fed = sum(len(p) + 4 for p in prompts)
    s = summarize(steps)
    assert s.rows == fed
    assert s.steps == len(steps) and set(s.by_kind) <= {"decode", "prefill", "mixed"}
    assert all(r.rows <= 24 and r.num_seqs <= 2 and r.host_s >= 0 and r.gpu_s is None for r in steps)
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    assert sum("step" in x for x in lines) == len(steps) and sum("request" in x for x in lines) == 4
    assert {x["request"]["request_id"] for x in lines if "request" in x} == {t.request_id for t in reqs}
    # The same parts reach /metrics' histograms.


def test_server_metrics_split_ttft() -> None:
    """The server's engine observes queue, prefill and delivery for every first token; their sums add up to
    the TTFT histogram's sum."""
    llm = make_llm(max_batch_size=2, max_num_tokens=16)
    eng = AsyncEngine(llm, max_queue_size=8, metrics=_serve_metrics())
    eng.start()
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)

    async def one(p: list[int]) -> None:
        async for _ in await eng.submit([GenerationRequest(p, params)]):
            pass

    async def main():
        await asyncio.gather(*(one(list(range(5, 5 + n))) for n in (20, 3, 17)))

    try:
        run(main())
        wait_idle(eng)
    finally:
        eng.stop(drain_timeout=0)
    n = metric(eng, "trtllm:time_to_first_token_seconds_count")
    assert n == 3
    for name in ("request_queue_time", "request_prefill_time", "request_first_token_delivery"):
        assert metric(eng, f"trtllm:{name}_seconds_count") == n
    parts = sum(
        metric(eng, f"trtllm:{x}_seconds_sum")
        for x in ("request_queue_time", "request_prefill_time", "request_first_token_delivery")
    )
    assert parts == pytest.approx(metric(eng, "trtllm:time_to_first_token_seconds_sum"), abs=1e-6)
    assert metric(eng, "trtllm:request_decode_time_seconds_count") == 3


def test_executor_callers_record_timings() -> None:
    """`LLM.generate` through an executor with a log: steps and per-request timings (delivered = read back)."""
    llm = make_llm(max_batch_size=4, max_num_tokens=16)
    log = StepLog()
    llm.executor.step_log = log
    outs = llm.generate([[7] * 30, [9] * 3], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    assert all(len(o.outputs[0].token_ids) == 4 for o in outs)
    steps, reqs = log.snapshot()
    assert len(reqs) == 2 and all(t.delivery_s == 0.0 and t.prefill_s >= 0 for t in reqs)
    assert sorted(t.prefill_steps for t in reqs) == [1, 2]  # 30 rows in chunks of <= 16: two steps
    assert summarize(steps).rows == 30 + 3 + 2 * 3


def _serve_metrics():
    from trtllm_glm.serve.metrics import ServeMetrics

    return ServeMetrics()


def test_idle_wait_is_told_apart_from_the_loops_own_work() -> None:
    """A step after the engine sat idle has that wait in ``idle_s`` (part of its ``gap_s``); steps of a busy loop
    have none, so ``gap_s - idle_s`` is the loop's own work between steps."""
    log = StepLog()
    eng = AsyncEngine(make_llm(max_batch_size=2), max_queue_size=4, step_log=log)
    eng.start()
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)

    async def one(p: list[int]) -> None:
        stream = await eng.submit([GenerationRequest(p, params)])
        async for _ in stream:
            pass

    try:
        run(one([5, 6, 7]))
        wait_idle(eng)
        n_before = len(log.snapshot()[0])
        time.sleep(0.3)  # the engine waits with nothing to run
        run(one([8, 9, 10]))
        wait_idle(eng)
    finally:
        eng.stop(drain_timeout=0)
    steps, _ = log.snapshot()
    first, rest = steps[n_before], steps[n_before + 1 :]
    assert first.gap_s >= 0.29 and 0.25 <= first.idle_s <= first.gap_s
    assert rest and all(r.idle_s <= r.gap_s for r in rest)
    assert summarize(steps).idle_s >= first.idle_s
