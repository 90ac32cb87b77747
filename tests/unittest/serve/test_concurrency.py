"""32 concurrent streaming greedy requests return what `LLM.generate` returns for each prompt alone,
with and without speculative decoding (continuous batching across HTTP requests)."""

from __future__ import annotations

import asyncio

import pytest

from tests.serve_helpers import MODEL, client, make_llm, metric, run, sse, wait_idle
from trtllm_glm import MTPDecodingConfig, NGramDecodingConfig, SamplingParams
from trtllm_glm.serve.app import build_app
from trtllm_glm.serve.engine import AsyncEngine

pytestmark = pytest.mark.cpu_only

NUM = 32
MAX_TOKENS = 6
# Repetitive prompts give the n-gram drafter matches; the rest are varied lengths and bytes.
PROMPTS = [("abc" * (1 + i % 4)) if i % 3 == 0 else f"request {i}: {'xyz' * (i % 5)}" for i in range(NUM)]

SPECS = {
    "plain": None,
    "mtp": lambda: MTPDecodingConfig(num_nextn_predict_layers=2),
    "ngram": lambda: NGramDecodingConfig(max_draft_len=4),
    # 32 streams exceed it: width-one rounds while they share the batch (each prompt alone speculates).
    "ngram-mc": lambda: NGramDecodingConfig(max_draft_len=4, max_concurrency=8),
}


@pytest.fixture(scope="module", params=list(SPECS))
def served(request):
    spec = SPECS[request.param]
    llm = make_llm(max_batch_size=NUM, speculative_config=spec() if spec else None)
    greedy = SamplingParams(max_tokens=MAX_TOKENS)
    refs = [llm.generate(p, greedy).outputs[0] for p in PROMPTS]  # each prompt alone, before serving
    eng = AsyncEngine(llm, max_queue_size=0)
    eng.start()
    yield request.param, build_app(eng, served_model_name=MODEL, manage_engine=False), refs
    eng.stop(drain_timeout=0)


def test_32_concurrent_streams_equal_solo_generate(served) -> None:
    kind, app, refs = served
    eng = app.state.engine
    steps0 = eng.stats()["num_steps"]

    async def one(c, prompt):
        body = {"model": MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True}}  # fmt: skip
        r = await c.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        return sse(r.text)

    wakeups = 0

    async def main():
        nonlocal wakeups
        loop = asyncio.get_running_loop()
        orig = loop.call_soon_threadsafe

        def counted(*a, **k):  # the engine thread's wake-ups of this loop (deliveries, submissions resolved)
            nonlocal wakeups
            wakeups += 1
            return orig(*a, **k)

        loop.call_soon_threadsafe = counted
        async with client(app) as c:
            return await asyncio.gather(*(one(c, p) for p in PROMPTS))

    results = run(main())
    for prompt, events, ref in zip(PROMPTS, results, refs):
        assert events[-1] == "[DONE]"
        chunks, usage = events[:-2], events[-2]["usage"]
        text = "".join(c["choices"][0]["text"] for c in chunks)
        assert text == ref.text, (kind, prompt)
        assert chunks[-1]["choices"][0]["finish_reason"] == ref.finish_reason
        assert usage["completion_tokens"] == len(ref.token_ids)
    s = wait_idle(eng)
    # All 32 shared the batch: about one prefill plus MAX_TOKENS decode steps, not 32 x MAX_TOKENS.
    assert s["num_steps"] - steps0 <= 4 * MAX_TOKENS, s
    # One wake-up per engine flush for all 32 streams (plus one per submission), not one per stream and step: each
    # writes the loop's wake-up socket on the engine thread, between two steps.
    assert wakeups <= (s["num_steps"] - steps0) + NUM + 4, (wakeups, s["num_steps"] - steps0)
    assert s["free_state_slots"] == NUM
    if kind in ("mtp", "ngram"):
        drafts = metric(eng, "trtllm:spec_decode_num_drafts_total")
        proposed = metric(eng, "trtllm:spec_decode_num_draft_tokens_total")
        accepted = metric(eng, "trtllm:spec_decode_num_accepted_tokens_total")
        per_pos = sum(metric(eng, "trtllm:spec_decode_num_accepted_tokens_per_pos_total", {"position": str(i)})
                      for i in range(4))  # fmt: skip
        assert drafts > 0 and proposed >= drafts and 0 <= accepted <= proposed and per_pos == accepted
    elif kind == "plain":
        assert metric(eng, "trtllm:spec_decode_num_drafts_total") == 0
    unspeculated = metric(eng, "trtllm:spec_decode_num_unspeculated_rounds_total")
    assert unspeculated > 0 if kind == "ngram-mc" else unspeculated == 0
