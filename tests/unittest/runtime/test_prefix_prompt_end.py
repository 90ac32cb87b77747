"""Prompt-end checkpoints of short prompts (`KvCacheConfig.checkpoint_prompt_end_min_tokens`): a prompt shorter than
the minimum gets none, a longer one does; a conversation whose first turn is short is still reused on its next turn
through the request-end checkpoint, and where none is taken (MTP) the next turn recomputes what the prompt-end one
would have saved: the short prompt (docs/prefix_caching.md, "Short prompts")."""

from __future__ import annotations

import random

import pytest

from trtllm_glm import LLM, KvCacheConfig, MTPDecodingConfig, SamplingParams
from trtllm_glm.config import ConfigError
from trtllm_glm.models.glm5_next import Glm5NextForCausalLM
from trtllm_glm.runtime.executor import Executor, ExecutorConfig
from trtllm_glm.serve.config import llm_options_from_dict

pytestmark = pytest.mark.cpu_only

ANSWER = 12  # tokens of each first turn's answer


@pytest.fixture(scope="module")
def model() -> Glm5NextForCausalLM:
    return Glm5NextForCausalLM.from_pretrained("tiny", seed=0)


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, ignore_eos=True)


def prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 250) for _ in range(n)]


def endpoints(llm: LLM) -> set[int]:
    """Where the stored checkpoints are (prompt tokens restored)."""
    store = llm.executor.prefix.store
    return {store.get(k).endpoint for k in list(store)}


def test_the_default_minimum() -> None:
    assert KvCacheConfig().checkpoint_prompt_end_min_tokens == 64


@pytest.mark.parametrize(
    ("kv", "length", "taken"),
    [
        ({}, 30, False),  # the default minimum, 64 tokens
        ({}, 63, False),
        ({}, 64, True),
        ({}, 200, True),
        ({"checkpoint_prompt_end_min_tokens": 24}, 30, True),
        ({"checkpoint_prompt_end_min_tokens": 24}, 23, False),
        ({"checkpoint_prompt_end_min_tokens": 1}, 15, False),  # never below a page (16)
        ({"checkpoint_prompt_end_min_tokens": 1}, 16, True),
        ({"checkpoint_prompt_end": False}, 200, False),
    ],
)
def test_a_prompt_shorter_than_the_minimum_gets_no_prompt_end_checkpoint(
    model, kv: dict, length: int, taken: bool
) -> None:
    # Without request-end checkpoints, so that the prompt-end one is the only one (a request that ends at its first
    # token gets none: it is taken after that step, for a request still running).
    llm = LLM(model=model, kv_cache_config=KvCacheConfig(checkpoint_request_end=False, **kv))
    llm.generate([prompt(length, length)], greedy(3))
    assert (length in endpoints(llm)) is taken, endpoints(llm)


def test_a_short_first_turn_is_reused_through_its_request_end_checkpoint(model) -> None:
    """Defaults (request-end checkpoints on): a 30-token first turn gets no prompt-end checkpoint, yet the next turn
    resumes after the whole first turn (prompt and answer), as before the minimum, and answers as a cold run."""
    llm = LLM(model=model)
    turn1 = prompt(30, 1)
    a1 = llm.generate([turn1], greedy(ANSWER))[0].outputs[0].token_ids
    assert endpoints(llm) == {len(turn1) + ANSWER - 1}  # the request-end one only
    turn2 = turn1 + a1 + prompt(7, 2)
    o2 = llm.generate([turn2], greedy(6))[0]
    assert o2.num_cached_tokens == len(turn1) + ANSWER - 1
    cold = LLM(model=model, kv_cache_config=KvCacheConfig(enable_block_reuse=False))
    assert o2.outputs[0].token_ids == cold.generate([turn2], greedy(6))[0].outputs[0].token_ids


@pytest.mark.parametrize(("length", "cached"), [(30, 0), (70, 70)])
def test_without_a_request_end_checkpoint_a_short_first_turn_is_recomputed(model, length: int, cached: int) -> None:
    """MTP requests take no request-end checkpoint (their drafter catches up after the end): the next turn resumes
    at the prompt-end checkpoint, which a prompt under the minimum does not get. It recomputes from the start, i.e.
    the short prompt (the answer is recomputed either way)."""
    spec = MTPDecodingConfig(max_draft_len=2, adaptive=False)
    llm = LLM(model=model, speculative_config=spec)
    turn1 = prompt(length, 3)
    a1 = llm.generate([turn1], greedy(ANSWER))[0].outputs[0].token_ids
    turn2 = turn1 + a1 + prompt(7, 4)
    o2 = llm.generate([turn2], greedy(6))[0]
    assert o2.num_cached_tokens == cached
    # Under the old minimum (a page) the short prompt's own checkpoint served it.
    old = LLM(model=model, speculative_config=spec, kv_cache_config=KvCacheConfig(checkpoint_prompt_end_min_tokens=16))
    old.generate([turn1], greedy(ANSWER))
    assert old.generate([turn2], greedy(6))[0].num_cached_tokens == length


@pytest.mark.parametrize("bad", [0, -16, True, 16.0, "64", None])
def test_bad_minimums_are_refused(bad: object) -> None:
    with pytest.raises(ValueError, match=r"checkpoint_prompt_end_min_tokens must be a positive int .*got"):
        KvCacheConfig(checkpoint_prompt_end_min_tokens=bad)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("64", "kv_cache_config.checkpoint_prompt_end_min_tokens: expected an int, got '64'"),
        (0, "checkpoint_prompt_end_min_tokens must be a positive int"),
    ],
)
def test_the_yaml_key(value: object, message: str) -> None:
    opts = llm_options_from_dict({"kv_cache_config": {"checkpoint_prompt_end_min_tokens": 128}})
    assert opts["kv_cache_config"].checkpoint_prompt_end_min_tokens == 128
    with pytest.raises(ConfigError, match=message):
        llm_options_from_dict({"kv_cache_config": {"checkpoint_prompt_end_min_tokens": value}})


@pytest.mark.parametrize("bad", [0, -1, 2.5])
def test_the_executors_prompt_end_takes_a_bool_or_a_positive_int(model, bad: object) -> None:
    cfg = ExecutorConfig(enable_block_reuse=True, checkpoint_prompt_end=bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="prompt_end must be True, False or a positive int"):
        Executor(model, cfg)
