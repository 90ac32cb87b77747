"""Serving defaults (issue 42): the token budget and batch sized against memory, graph padding on, and the
start-up warm-up that leaves the executor as it was built."""

from __future__ import annotations

import pytest
import torch

from trtllm_glm import LLM, SamplingParams
from trtllm_glm.config import Glm5NextConfig
from trtllm_glm.errors import CheckpointError
from trtllm_glm.runtime.sizing import (
    DEFAULT_MAX_BATCH_SIZE,
    DEFAULT_MAX_NUM_TOKENS,
    MIN_AUTO_BATCH_SIZE,
    MIN_AUTO_NUM_TOKENS,
    resolve_step_sizes,
)
from trtllm_glm.runtime.step_log import StepLog
from trtllm_glm.runtime.warmup import length_ladder, warm_up

pytestmark = pytest.mark.cpu_only

REAL = Glm5NextConfig.from_pretrained("glm-5.3-flash")


def sizes(free: int | None, **kw):
    args = dict(max_batch_size=None, max_num_tokens=None, max_seq_len=2048, tokens_per_block=64, kv_max_tokens=None,
                dtype=torch.bfloat16)  # fmt: skip
    args.update(kw)
    return resolve_step_sizes(REAL, "cuda", free=free, **args)


def test_defaults_are_serving_sizes_when_memory_allows() -> None:
    s = sizes(1 << 40)
    assert (s.max_batch_size, s.max_num_tokens, s.reduced) == (DEFAULT_MAX_BATCH_SIZE, DEFAULT_MAX_NUM_TOKENS, False)
    assert s.auto == ("max_batch_size", "max_num_tokens")
    # Unknown free memory: the defaults as they are (the executor's own check still runs).
    assert (sizes(None).max_batch_size, sizes(None).max_num_tokens) == (64, 8192)


def test_defaults_shrink_token_budget_first_then_batch() -> None:
    """The real model's 64 state slots and 8K-row chunk need ~14 GiB: with less free, the budget halves first,
    then the batch; the result fits the planned share of memory."""
    full = sizes(1 << 40).estimate_bytes
    s = sizes(int(full / 0.85) - 4096)  # just short of the defaults: one halving of the budget fits
    assert (s.reduced, s.max_batch_size, s.max_num_tokens) == (True, 64, 4096)
    assert s.estimate_bytes <= full
    tight = sizes(6 << 30)
    assert tight.max_num_tokens == MIN_AUTO_NUM_TOKENS and tight.max_batch_size < 64
    assert tight.estimate_bytes <= 0.85 * (6 << 30)
    # Nothing fits: the floor is returned and the executor's check refuses it with the numbers.
    floor = sizes(1 << 20)
    assert (floor.max_batch_size, floor.max_num_tokens) == (MIN_AUTO_BATCH_SIZE, MIN_AUTO_NUM_TOKENS)
    assert "reduced to fit" in floor.describe()


def test_values_given_are_kept() -> None:
    s = sizes(1 << 20, max_batch_size=4, max_num_tokens=100)
    assert (s.max_batch_size, s.max_num_tokens, s.auto, s.reduced) == (4, 100, (), False)
    # Only the automatic one moves.
    s = sizes(6 << 30, max_num_tokens=8192)
    assert s.max_num_tokens == 8192 and s.max_batch_size < 64 and s.auto == ("max_batch_size",)


def test_llm_defaults_and_refusal() -> None:
    llm = LLM("tiny", device="cpu", max_seq_len=256)
    cfg = llm.executor.cfg
    assert (cfg.max_batch_size, cfg.max_num_tokens) == (64, 8192)
    assert "auto" in llm.step_sizes.describe()
    # Two 192-token prompts prefill side by side in one step (512-row steps before: 16 prompts of 512 tokens took
    # 16 steps; and prefix caching cut each prompt at its last page boundary, a second step).
    llm.executor.step_log = log = StepLog()
    llm.generate([[5] * 192, [6] * 192], SamplingParams(max_tokens=1, temperature=0.0))
    steps, _ = log.snapshot()
    assert [(s.rows, s.prefill_seqs) for s in steps] == [(384, 2)]
    # An explicit size that cannot fit is refused at start-up with the estimate.
    with pytest.raises(CheckpointError, match="GiB"):
        LLM("tiny", device="cpu", max_seq_len=256, max_batch_size=2, max_num_tokens=1 << 28)
    with pytest.raises(ValueError, match="max_num_tokens"):
        LLM("tiny", device="cpu", max_num_tokens=0)
    with pytest.raises(TypeError, match="warmup"):
        LLM("tiny", device="cpu", warmup=1)


def test_length_ladder_meets_every_specialisation() -> None:
    """Every next-power-of-two bucket up to the budget holds a count that is a multiple of 16 (from 16 on) and one
    that is not, and 1 is there."""
    lad = length_ladder(100)
    assert lad == [1, 2, 3, 4, 7, 8, 15, 16, 31, 32, 63, 64, 96, 100]
    for n_max in (1, 5, 100, 8192, 5000):
        lad = length_ladder(n_max)
        assert lad[0] == 1 and lad[-1] == n_max and all(1 <= x <= n_max for x in lad)
        buckets: dict[int, set[bool]] = {}
        for x in lad:
            buckets.setdefault(1 << (x - 1).bit_length(), set()).add(x % 16 == 0)
        for b, kinds in buckets.items():
            assert b <= 16 or kinds == {True, False}, (n_max, b, kinds)
    assert length_ladder(0) == []


def test_warm_up_leaves_the_executor_as_built() -> None:
    """After the warm-up: no request, page or slot held, counters as before, prefix cache untouched, and the next
    requests generate exactly what a fresh executor generates."""
    kw = dict(device="cpu", max_seq_len=96, max_batch_size=4, max_num_tokens=40)
    llm = LLM("tiny", **kw)
    fresh = LLM("tiny", **kw)
    ex = llm.executor
    free_pages, free_slots = ex.manager.num_free_pages, ex.manager.num_free_slots
    mixes = set()  # (decode sequences, prefill sequences) of each step
    cut = set()  # decode sequences of the steps that continue a prompt the budget cut (a chunk starting past 0)
    forward = ex._forward

    def spy(plan):  # noqa: ANN001, ANN202
        mixes.add((sum(s.is_decode for s in plan), sum(not s.is_decode for s in plan)))
        if any(not s.is_decode and s.start > 0 for s in plan):
            cut.add(sum(s.is_decode for s in plan))
        return forward(plan)

    ex._forward = spy
    rep = warm_up(ex)
    del ex._forward
    assert rep.requests > 20 and rep.steps > rep.requests and not rep.skipped and rep.compiles == 0
    # Several decoding requests admitting several prompts at once (a served batch taking arrivals), not only one.
    assert any(d >= 2 and p >= 2 for d, p in mixes), sorted(mixes)
    # ... and long prompts the step budget cut, continued beside several decoding requests.
    assert max(cut, default=0) >= 2, sorted(cut)
    assert not ex.has_work and ex.num_steps == 0 and ex.num_preemptions == 0
    assert (ex.manager.num_free_pages, ex.manager.num_free_slots) == (free_pages, free_slots)
    assert ex.prefix is not None and ex.prefix.stats.queries == 0 and len(ex.prefix.store) == 0
    prompts = [[9, 8, 7, 6, 5] * 7, [3, 1, 4, 1, 5, 9, 2, 6]]
    p = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, p)] == [
        o.outputs[0].token_ids for o in fresh.generate(prompts, p)
    ]
    with pytest.raises(RuntimeError, match="idle"):
        ex.add_request([1, 2], p)
        warm_up(ex)


def test_warm_up_of_a_speculative_executor_with_a_separate_draft_pool() -> None:
    """MTP with its own draft pages: the warm-up's sealed draft pages go back too, and speculative outputs after
    it equal a fresh executor's."""
    from trtllm_glm.speculative.config import MTPDecodingConfig

    kw = dict(device="cpu", max_seq_len=80, max_batch_size=3, max_num_tokens=32, dtype="float32")

    def make() -> LLM:
        spec = MTPDecodingConfig(num_nextn_predict_layers=2, draft_kv_mode="separate", adaptive=True)
        return LLM("tiny", speculative_config=spec, **kw)

    llm, fresh = make(), make()
    ex = llm.executor
    dm = ex.separate_draft_manager
    assert dm is not None
    free = (ex.manager.num_free_pages, dm.num_free_pages, ex.manager.num_free_slots)
    policy = ex.draft_policy
    assert policy is not None  # adaptive asked for
    rep = warm_up(ex)
    assert rep.requests > 10 and not ex.has_work
    # A fresh adaptive policy: nothing the synthetic rounds measured carries over.
    assert ex.draft_policy is not policy and not ex.draft_policy.counts and policy.counts
    assert ex.draft_policy.costs(1) == {} and ex.draft_policy.acceptance == ex.draft_policy.prior_acceptance
    assert (ex.manager.num_free_pages, dm.num_free_pages, ex.manager.num_free_slots) == free
    assert dm.num_cached_pages == 0 and ex.manager.num_cached_pages == 0
    prompts = [[9, 8, 7, 6, 5] * 5, [3, 1, 4, 1, 5, 9, 2, 6] * 3]
    p = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, p)] == [
        o.outputs[0].token_ids for o in fresh.generate(prompts, p)
    ]


def test_checkpoint_interval_below_a_page_is_refused() -> None:
    """A stride of 1 or 3 cut every prefill chunk into a few rows (4.5-6x slower prefill) and was accepted
    silently (issue 45); below a page it is refused, naming the minimum."""
    from trtllm_glm import KvCacheConfig

    for bad in (1, 3, 15):
        with pytest.raises(ValueError, match=r"at least tokens_per_block \(16\)"):
            KvCacheConfig(checkpoint_interval=bad)
    assert KvCacheConfig(checkpoint_interval=16).checkpoint_interval == 16
    assert KvCacheConfig(tokens_per_block=8, checkpoint_interval=8).checkpoint_interval == 8
