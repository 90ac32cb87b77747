"""`AsyncEngine`: continuous batching across callers, failure isolation, back-pressure, shutdown."""

from __future__ import annotations

import asyncio

import pytest

from tests.serve_helpers import make_llm, metric, run, wait_idle
from trtllm_glm import SamplingParams
from trtllm_glm.errors import CapacityError
from trtllm_glm.serve.engine import AsyncEngine, Delta, EngineStoppedError, GenerationRequest, QueueFullError

pytestmark = pytest.mark.cpu_only

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


async def collect(engine: AsyncEngine, gens: list[GenerationRequest]) -> list[list[Delta]]:
    stream = await engine.submit(gens)
    out: list[list[Delta]] = [[] for _ in gens]
    async for d in stream:
        out[d.index].append(d)
    return out


def tokens(ds: list[Delta]) -> list[int]:
    return [t for d in ds for t in d.token_ids]


@pytest.fixture(scope="module")
def setup():
    """An LLM, its solo greedy references, and a running engine over it."""
    llm = make_llm(max_batch_size=4)
    prompts = [list(b"hello"), list(b"the engine"), list(b"abcabcabc")]
    refs = [llm.generate(p, GREEDY).outputs[0] for p in prompts]
    eng = AsyncEngine(llm, max_queue_size=4)
    eng.start()
    yield llm, eng, prompts, refs
    eng.stop(drain_timeout=0)


def test_concurrent_callers_get_their_solo_tokens(setup) -> None:
    _, eng, prompts, refs = setup
    steps0 = eng.stats()["num_steps"]

    async def main():
        return await asyncio.gather(*(collect(eng, [GenerationRequest(p, GREEDY)]) for p in prompts))

    outs = run(main())
    for (ds,), ref in zip(outs, refs):
        assert tokens(ds) == ref.token_ids
        assert "".join(d.text for d in ds) == ref.text
        assert ds[-1].finish_reason == "length" and ds[-1].num_output_tokens == len(ref.token_ids)
    # Batched: far fewer steps than one request after another.
    assert eng.stats()["num_steps"] - steps0 < sum(len(r.token_ids) for r in refs)
    wait_idle(eng)


def test_refused_request_fails_alone(setup) -> None:
    _, eng, prompts, refs = setup

    async def main():
        good = asyncio.ensure_future(collect(eng, [GenerationRequest(prompts[0], GREEDY)]))
        with pytest.raises(ValueError, match="outside the vocabulary"):
            await eng.submit([GenerationRequest([1, 9999], GREEDY)])
        with pytest.raises(CapacityError, match="leaves no room"):
            await eng.submit([GenerationRequest([1] * eng.max_seq_len, GREEDY)])
        # All or nothing: the valid first generation of this pair is not left queued.
        with pytest.raises(ValueError):
            await eng.submit([GenerationRequest(prompts[1], GREEDY), GenerationRequest([-1], GREEDY)])
        return await good

    (ds,) = run(main())
    assert tokens(ds) == refs[0].token_ids
    wait_idle(eng)


def test_stop_string_ends_the_request_and_frees_it(setup) -> None:
    _, eng, prompts, refs = setup
    text = refs[2].text
    stop = next(c for c in text[1:] if c.isascii() and c.isprintable())
    cut = text.index(stop, 1)

    async def main():
        return await collect(eng, [GenerationRequest(prompts[2], GREEDY, stop=[stop])])

    (ds,) = run(main())
    assert "".join(d.text for d in ds) == text[:cut]
    assert ds[-1].finish_reason == "stop"
    assert tokens(ds) == refs[2].token_ids[: ds[-1].num_output_tokens]
    wait_idle(eng)


def test_failed_step_fails_its_requests_and_the_loop_keeps_serving() -> None:
    llm = make_llm(max_batch_size=2)
    eng = AsyncEngine(llm, max_queue_size=2)
    ex = eng.executor
    real_forward = ex._forward
    poison = list(b"POISON")

    def forward(plan):
        if any(s.request.prompt_ids == poison for s in plan):
            raise RuntimeError("injected fault")
        return real_forward(plan)

    ex._forward = forward
    eng.start()
    try:

        async def main():
            bad = await collect(eng, [GenerationRequest(poison, GREEDY)])
            good = await collect(eng, [GenerationRequest(list(b"fine"), GREEDY)])
            return bad, good

        (bad,), (good,) = run(main())
        assert bad[-1].finish_reason == "error" and "injected fault" in (bad[-1].error or "")
        assert good[-1].finish_reason == "length" and len(tokens(good)) == GREEDY.max_tokens
        s = wait_idle(eng)
        assert s["step_errors"] >= 1 and s["free_state_slots"] == 2
        assert metric(eng, "trtllm:engine_step_errors_total") >= 1
        assert metric(eng, "trtllm:request_finished_total", {"finished_reason": "error"}) == 1
    finally:
        eng.stop(drain_timeout=0)


def test_request_that_breaks_scheduling_is_failed_and_does_not_wedge_the_loop() -> None:
    llm = make_llm(max_batch_size=2)
    eng = AsyncEngine(llm)
    ex = eng.executor
    real_plan = ex._plan
    poison = list(b"BAD PLAN")

    def plan(*a, **k):
        if any(r.prompt_ids == poison for r in ex.waiting):
            raise RuntimeError("scheduler fault")
        return real_plan(*a, **k)

    ex._plan = plan
    eng.start()
    try:

        async def main():
            bad = await collect(eng, [GenerationRequest(poison, GREEDY)])
            good = await collect(eng, [GenerationRequest(list(b"fine"), GREEDY)])
            return bad, good

        (bad,), (good,) = run(main())
        assert bad[-1].finish_reason == "error" and "scheduler fault" in (bad[-1].error or "")
        assert good[-1].finish_reason == "length"
        assert wait_idle(eng)["free_state_slots"] == 2
    finally:
        eng.stop(drain_timeout=0)


def test_queue_full_then_drain_and_abort_on_shutdown() -> None:
    llm = make_llm(max_batch_size=1)
    eng = AsyncEngine(llm, max_queue_size=1)
    long = SamplingParams(max_tokens=400, ignore_eos=True)
    short = SamplingParams(max_tokens=3, ignore_eos=True)
    eng.start()

    async def main():
        a = await eng.submit([GenerationRequest(list(b"a"), long)])
        b = await eng.submit([GenerationRequest(list(b"b"), short)])
        with pytest.raises(QueueFullError, match="overloaded"):
            await eng.submit([GenerationRequest(list(b"c"), short)])
        # Stop with a drain budget: the short request would finish, the long one cannot; both end.
        stopper = asyncio.ensure_future(asyncio.to_thread(eng.stop, 0.3))
        da = [d async for d in a]
        db = [d async for d in b]
        await stopper
        with pytest.raises(EngineStoppedError):
            await eng.submit([GenerationRequest(list(b"d"), short)])
        return da, db

    da, db = run(main())
    assert da[-1].finish_reason == "abort" and da[-1].num_output_tokens < 400
    assert db[-1].finish_reason in ("length", "abort")
    s = eng.stats()
    assert s["live"] == 0 and s["pages_used"] == 0 and not eng.running


def test_graceful_stop_lets_inflight_requests_finish() -> None:
    llm = make_llm(max_batch_size=2)
    eng = AsyncEngine(llm)
    eng.start()

    async def main():
        st = await eng.submit([GenerationRequest(list(b"x"), SamplingParams(max_tokens=5, ignore_eos=True))])
        stopper = asyncio.ensure_future(asyncio.to_thread(eng.stop, 30.0))
        ds = [d async for d in st]
        await stopper
        return ds

    ds = run(main())
    assert ds[-1].finish_reason == "length" and len(tokens(ds)) == 5


def test_overlap_scheduler_under_the_serving_loop(monkeypatch) -> None:
    """The overlap scheduler (the LLM API's default with CUDA graphs) under the engine thread, graphs
    emulated on the CPU: concurrent callers get their solo tokens (a seeded sampled one included), a stop
    string aborts a request while its next step is already launched, and every page and state slot comes
    back."""
    import dataclasses

    from trtllm_glm.runtime.cuda_graph import CudaGraphConfig
    from trtllm_glm.runtime.executor import Executor

    monkeypatch.setattr(Executor, "_graphs_supported", lambda self: True)
    llm = make_llm(max_batch_size=4)
    long = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    sampled = SamplingParams(max_tokens=12, temperature=0.9, seed=21, ignore_eos=True)
    prompts = [list(b"hello"), list(b"the engine"), list(b"abcabcabc")]
    kinds = [long, sampled, long]  # a seeded sampled request among greedy ones
    refs = [llm.generate(p, sp).outputs[0] for p, sp in zip(prompts, kinds)]
    # Exact sizes 1-4: no padding rows, so the torch k-pool ops are enough here.
    llm.executor_config = dataclasses.replace(
        llm.executor_config, cuda_graph_config=CudaGraphConfig(batch_sizes=[1, 2, 3, 4]), overlap_scheduler=True
    )
    llm.executor = llm._make_executor()
    text = refs[2].text
    stop = next(c for c in text[2:] if c.isascii() and c.isprintable())
    cut = text.index(stop, 2)
    eng = AsyncEngine(llm)
    eng.start()
    try:

        async def main():
            gens = [GenerationRequest(p, sp) for p, sp in zip(prompts[:2], kinds)]
            return await asyncio.gather(
                *(collect(eng, [g]) for g in gens), collect(eng, [GenerationRequest(prompts[2], long, stop=[stop])])
            )

        (a,), (b,), (c,) = run(main())
        for ds, ref in zip((a, b), refs):
            assert tokens(ds) == ref.token_ids and ds[-1].finish_reason == "length"
        assert "".join(d.text for d in c) == text[:cut] and c[-1].finish_reason == "stop"
        s = wait_idle(eng)
        assert s["free_state_slots"] == 4
        assert eng.executor.num_overlapped_steps > 0 and eng.executor.graph_runner.stats.replays > 0
    finally:
        eng.stop(drain_timeout=0)
