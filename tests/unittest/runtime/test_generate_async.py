"""`LLM.generate_async` (TensorRT-LLM's name) on the server's engine: streamed partial outputs grow to the
final one, concurrent calls batch together and equal `generate`, bad input raises at the call."""

from __future__ import annotations

import asyncio

import pytest

from trtllm_glm import LLM, SamplingParams

pytestmark = pytest.mark.cpu_only

PROMPTS = ["Hello", "def f(x):", [5, 6, 7, 8], "a"]


@pytest.fixture(scope="module")
def llm() -> LLM:
    out = LLM(model="tiny", device="cpu", max_seq_len=128, max_batch_size=4)
    yield out
    out.shutdown()


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 60))


def test_streaming_grows_to_the_generate_output(llm) -> None:
    sp = SamplingParams(max_tokens=12, ignore_eos=True, logprobs=1)
    ref = llm.generate("Hello", sp)

    async def main():
        return [o async for o in llm.generate_async("Hello", sp, streaming=True)]

    parts = run(main())
    assert len(parts) >= 3 and parts[-1].finished and not any(p.finished for p in parts[:-1])
    final = parts[-1].outputs[0]
    assert final.token_ids == ref.outputs[0].token_ids and final.text == ref.outputs[0].text
    assert final.finish_reason == "length" and len(final.logprobs) == 12
    for a, b in zip(parts, parts[1:]):  # every partial extends the previous one
        ta, tb = a.outputs[0], b.outputs[0]
        assert tb.token_ids[: len(ta.token_ids)] == ta.token_ids and tb.text.startswith(ta.text)
        assert len(tb.token_ids) > len(ta.token_ids)


def test_concurrent_calls_equal_generate(llm) -> None:
    sps = [SamplingParams(max_tokens=6 + i, ignore_eos=True) for i in range(len(PROMPTS))]
    refs = llm.generate(PROMPTS, sps)

    async def main():
        return await asyncio.gather(*(llm.generate_async(p, s) for p, s in zip(PROMPTS, sps)))

    outs = run(main())
    assert [o.outputs[0].token_ids for o in outs] == [r.outputs[0].token_ids for r in refs]
    assert [o.prompt for o in outs] == ["Hello", "def f(x):", None, "a"]
    # generate() takes the executor back once nothing is in flight.
    assert llm.generate(PROMPTS[0], sps[0]).outputs[0].token_ids == refs[0].outputs[0].token_ids


def test_leaving_a_stream_early_frees_the_request(llm) -> None:
    async def main():
        async for part in llm.generate_async([1, 2, 3], SamplingParams(max_tokens=60, ignore_eos=True), streaming=True):
            if len(part.outputs[0].token_ids) >= 2:
                break
        eng = llm._engine
        for _ in range(500):
            s = eng.stats()
            if s["live"] == 0 and s["pages_used"] == 0:
                return s
            await asyncio.sleep(0.01)
        return eng.stats()

    s = run(main())
    assert s["live"] == 0 and s["pages_used"] == 0


@pytest.mark.parametrize(
    ("args", "exc", "match"),
    [((["a", "b"],), TypeError, "takes one prompt"), (("\ud800",), ValueError, "lone surrogate"),
     (("a", SamplingParams(max_tokens=500)), ValueError, "lower max_tokens to at most"),
     (("a", [SamplingParams()]), TypeError, "one SamplingParams"), (([],), ValueError, "the prompt is empty"),
     (({"a": 1},), TypeError, "prompts must be a string")],
)  # fmt: skip
def test_bad_input_raises_at_the_call(llm, args, exc, match) -> None:
    with pytest.raises(exc, match=match):
        llm.generate_async(*args)
