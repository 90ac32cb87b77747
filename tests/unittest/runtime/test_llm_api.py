"""The LLM API in TensorRT-LLM's names: token-id prompts, logprobs, context/generation logits, end_id."""

from __future__ import annotations

import pytest
import torch

from trtllm_glm import LLM, KvCacheConfig, SamplingParams
from trtllm_glm.runtime.llm import configure_cpu_threads
from trtllm_glm.runtime.sampling import Logprob, token_logprobs

pytestmark = pytest.mark.cpu_only


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(model="tiny", device="cpu", kv_cache_config=KvCacheConfig(tokens_per_block=8), max_seq_len=256)


@pytest.mark.parametrize(
    "bad, match",
    [([1, 2.5, 3], "float 2.5"), ([1, True], "bool True"), ([[1, 2], ["a"]], "prompt 1: token ids must be ints"),
     ([b"ab"], "prompt 0: expected a string or a list")],
)  # fmt: skip
def test_token_id_prompts_are_not_coerced(llm, bad, match) -> None:
    with pytest.raises(TypeError, match=match):
        llm.generate(bad, SamplingParams(max_tokens=2))
    assert not llm.executor.has_work  # nothing was queued


def test_end_id_stops_greedy(llm) -> None:
    ids = [7, 8, 9, 10, 11]
    free = llm.generate(ids, SamplingParams(max_tokens=12, ignore_eos=True)).outputs[0].token_ids
    stop = free[4]
    first = free.index(stop)
    out = llm.generate(ids, SamplingParams(max_tokens=12, end_id=stop)).outputs[0]
    assert out.token_ids == free[: first + 1] and out.finish_reason == "stop"
    # ignore_eos disables end_id too.
    out = llm.generate(ids, SamplingParams(max_tokens=12, end_id=stop, ignore_eos=True)).outputs[0]
    assert out.token_ids == free and out.finish_reason == "length"


def test_logits_and_logprobs_are_consistent(llm) -> None:
    ids = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5]
    sp = SamplingParams(max_tokens=5, ignore_eos=True, logprobs=3, prompt_logprobs=2,
                        return_context_logits=True, return_generation_logits=True)  # fmt: skip
    # A small chunk size: context logits come from three prefill chunks and must still be in order.
    chunked = LLM(model="tiny", device="cpu", prefill_chunk_size=4, max_seq_len=256)
    for engine in (llm, chunked):
        o = engine.generate(ids, sp)
        c = o.outputs[0]
        assert o.context_logits.shape == (len(ids), 264) and o.context_logits.dtype == torch.float32
        assert c.generation_logits.shape == (5, 264)
        # The last prompt row is the distribution of the first generated token.
        torch.testing.assert_close(o.context_logits[-1], c.generation_logits[0], atol=1e-5, rtol=0)
        lp = torch.log_softmax(c.generation_logits, -1)
        for j, t in enumerate(c.token_ids):
            assert t == int(c.generation_logits[j].argmax())
            d = c.logprobs[j]
            assert next(iter(d)) == t and d[t].rank == 1
            assert d[t].logprob == pytest.approx(float(lp[j, t]), abs=1e-5)
            assert len(d) == 3  # the chosen one is also the top-1
        assert c.prompt_logprobs[0] is None and len(c.prompt_logprobs) == len(ids)
        plp = torch.log_softmax(o.context_logits, -1)
        for i in range(1, len(ids)):
            d = c.prompt_logprobs[i]
            assert d[ids[i]].logprob == pytest.approx(float(plp[i - 1, ids[i]]), abs=1e-5)
            assert d[ids[i]].rank == int((plp[i - 1] > plp[i - 1, ids[i]]).sum()) + 1


def test_outputs_absent_unless_asked(llm) -> None:
    o = llm.generate([1, 2, 3], SamplingParams(max_tokens=2))
    assert o.context_logits is None
    c = o.outputs[0]
    assert c.logprobs is None and c.prompt_logprobs is None and c.generation_logits is None


@pytest.mark.parametrize("field, value", [("logprobs", -1), ("logprobs", 21), ("prompt_logprobs", 1.5),
                                          ("return_context_logits", 1)])  # fmt: skip
def test_bad_logprob_params(field, value) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_token_logprobs_ranks_and_ties() -> None:
    logits = torch.tensor([[0.0, 2.0, 2.0, -1.0]])
    (d,) = token_logprobs(logits, [3], 2)
    assert list(d) == [3, 1, 2] and d[3].rank == 4
    assert d[1] == Logprob(d[1].logprob, 1) and d[2].rank == 2  # equal logprobs list the lower id first


def test_cpu_thread_default(monkeypatch) -> None:
    before = torch.get_num_threads()
    try:
        small = torch.nn.Linear(4, 4)
        monkeypatch.delenv("TRTLLM_GLM_NUM_THREADS", raising=False)
        assert configure_cpu_threads(None, small) == 1
        monkeypatch.setenv("TRTLLM_GLM_NUM_THREADS", "2")
        assert configure_cpu_threads(None, small) == 2
        assert configure_cpu_threads(1, small) == 1
        monkeypatch.setenv("TRTLLM_GLM_NUM_THREADS", "lots")
        with pytest.raises(ValueError, match="TRTLLM_GLM_NUM_THREADS"):
            configure_cpu_threads(None, small)
    finally:
        torch.set_num_threads(before)


def test_cuda_without_cuda_is_a_clear_error() -> None:
    if torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    with pytest.raises(RuntimeError, match="CUDA is not available"):
        LLM(model="tiny", device="cuda")


def test_overlap_scheduler_on_by_default_and_validated(llm) -> None:
    # TensorRT-LLM's default: overlap on unless disable_overlap_scheduler (it only acts with CUDA graphs).
    assert llm.executor_config.overlap_scheduler
    with pytest.raises(TypeError, match="disable_overlap_scheduler must be a bool"):
        LLM("tiny", disable_overlap_scheduler="yes")
