"""`SamplingParams` fields the server and TensorRT-LLM's API have (issue 45): ``n`` completions per prompt, ``stop``
strings, ``top_k=-1`` as off; `LLM.generate` and `generate_async` honour them as the server does."""

from __future__ import annotations

import asyncio

import pytest

from trtllm_glm import LLM, SamplingParams

pytestmark = pytest.mark.cpu_only


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM("small", device="cpu", max_seq_len=256, max_batch_size=8)


def test_validation() -> None:
    assert SamplingParams(top_k=-1).top_k == 0
    assert SamplingParams(stop="x").stop_strings == ["x"] and SamplingParams().stop_strings == []
    for bad, match in (
        (dict(n=0), "n must be"), (dict(n=129), "n must be"), (dict(stop=""), "stop must"),
        (dict(stop=["a", 3]), "stop"),
        (dict(stop=["a"] * 17), "at most 16"), (dict(stop="\ud800"), "lone surrogate"), (dict(top_k=-2), "top_k"),
    ):  # fmt: skip
        with pytest.raises(ValueError, match=match):
            SamplingParams(**bad)


def test_n_completions_per_prompt(llm: LLM) -> None:
    p = "    def __init__(self"
    outs = llm.generate([p, "import os"], SamplingParams(max_tokens=12, n=3, temperature=0.9, seed=5))
    assert [len(o.outputs) for o in outs] == [3, 3] and [c.index for c in outs[0].outputs] == [0, 1, 2]
    # Choice i draws with seed + i: the same as a single request with that seed.
    for i, c in enumerate(outs[0].outputs):
        alone = llm.generate(p, SamplingParams(max_tokens=12, temperature=0.9, seed=5 + i)).outputs[0]
        assert c.token_ids == alone.token_ids and c.text == alone.text
    assert len({tuple(c.token_ids) for c in outs[0].outputs}) > 1


def test_stop_strings_cut_text_and_end_the_request(llm: LLM) -> None:
    p = "    def __init__(self"
    free = llm.generate(p, SamplingParams(max_tokens=40, temperature=0.0)).outputs[0]
    stop = free.text[5:8]  # appears in the free run's text: generation must end there
    assert stop and stop in free.text
    got = llm.generate(p, SamplingParams(max_tokens=40, temperature=0.0, stop=[stop, "never-seen"])).outputs[0]
    assert got.finish_reason == "stop" and got.text == free.text[: free.text.index(stop)]
    assert got.token_ids == free.token_ids[: len(got.token_ids)] and len(got.token_ids) < len(free.token_ids)
    # generate_async gives the same
    res = asyncio.run(llm.generate_async(p, SamplingParams(max_tokens=40, temperature=0.0, stop=stop)).aresult())
    assert res.outputs[0].text == got.text and res.outputs[0].token_ids == got.token_ids
    assert res.outputs[0].finish_reason == "stop"
    with pytest.raises(ValueError, match="n=2 is for generate"):
        llm.generate_async(p, SamplingParams(n=2))
    # No stop string in the text: the request runs to its length, text as without stop strings.
    nostop = llm.generate(p, SamplingParams(max_tokens=40, temperature=0.0, stop="\x00\x01")).outputs[0]
    assert nostop.text == free.text and nostop.finish_reason == free.finish_reason


def test_temperature_and_top_k_rule(llm: LLM) -> None:
    """`SamplingParams` takes what TensorRT-LLM's takes (any finite temperature >= 0: the server alone caps it at 2,
    as OpenAI does; ``top_k`` -1 or 0 = off); a temperature below 1e-5 is greedy (1e-300 divided the logits by an
    FP32 zero and drew the vocabulary's last id); every refusal names the field."""
    assert SamplingParams(temperature=100.0).temperature == 100.0 and not SamplingParams(temperature=2.5).greedy
    assert SamplingParams(temperature=1e-300).greedy and SamplingParams(temperature=1e-6, top_k=-1).greedy
    for bad, field in ((dict(temperature=float("nan")), "temperature"), (dict(temperature=-0.5), "temperature"),
                       (dict(temperature=float("inf")), "temperature"), (dict(top_k=-2), "top_k"),
                       (dict(top_k=1.5), "top_k"), (dict(top_p=0.0), "top_p")):  # fmt: skip
        with pytest.raises(ValueError, match=f"^{field} must"):
            SamplingParams(**bad)
    ref = llm.generate("def f(x):", SamplingParams(max_tokens=8)).outputs[0].token_ids
    tiny = llm.generate("def f(x):", SamplingParams(max_tokens=8, temperature=1e-300, seed=3)).outputs[0].token_ids
    hot = llm.generate("def f(x):", SamplingParams(max_tokens=8, temperature=5.0, seed=3)).outputs[0].token_ids
    assert tiny == ref and len(hot) == 8 and hot != ref


def test_best_of_keeps_the_n_most_likely(llm: LLM) -> None:
    """``best_of`` (TensorRT-LLM's field): best_of completions drawn (seeds seed + i, as ``n``), the n with the
    highest cumulative logprob returned, best first, without logprobs unless asked for."""
    p, kw = "def f(x):", dict(max_tokens=6, temperature=1.0, seed=4)
    every = llm.generate(p, SamplingParams(n=4, logprobs=0, **kw)).outputs
    score = [sum(d[t].logprob for t, d in zip(c.token_ids, c.logprobs)) for c in every]
    ranked = [every[k].token_ids for k in sorted(range(4), key=lambda k: -score[k])]
    got = llm.generate(p, SamplingParams(n=2, best_of=4, **kw)).outputs
    assert [c.token_ids for c in got] == ranked[:2] and [c.index for c in got] == [0, 1]
    assert all(c.logprobs is None for c in got)
    with pytest.raises(ValueError, match="best_of must be"):
        SamplingParams(n=3, best_of=2)
    with pytest.raises(ValueError, match="best_of"):
        llm.generate_async(p, SamplingParams(best_of=2, **kw))
