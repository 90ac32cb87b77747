"""Hazardous combinations of the features merged last that the random fuzz (tests/integration/test_spec_fuzz.py)
rarely draws together, each as small randomised scenarios checked with the fuzz's own checks (`check_case`: output
equals plain greedy's, drafts equal the plainest speculative run's, nothing leaks):

- the FP8 latent cache with prefix-cache hits, preemption and MTP drafts (shared and separate draft caches): page
  copies and restores must carry the scales;
- batch waiting with aborts (of held and of running requests) while MTP rounds are launched ahead and drafted early;
- MTP catch-up lag flushes grouped by the catch-up graphs' slices while requests finish mid-round and their slots
  are reused by the next arrivals at once;
- KDA decode rows riding the short prefills' verify grid with state slots that no longer follow request ids and
  requests that finish in the step a prompt is admitted in;
- a full batch with a queue behind it (no batch waiting): rounds drafted early while requests stop, are aborted and
  are replaced from the queue.

Each scenario's checks (`check_case`) are the fuzz's; the scenario also asserts that the hazard happened (a
preemption, a prefix hit, a held admission, a lag flush, a riding decode row, an early draft behind a queue), so
that a change of schedule cannot turn it into a test of nothing. ``TRTLLM_GLM_SPEC_SCENARIO_SEEDS`` (default 1) seeds
per scenario from ``TRTLLM_GLM_SPEC_SCENARIO_SEED`` (default 0).
"""

from __future__ import annotations

import os
import random
from collections.abc import Callable
from typing import Any

import pytest

import tests.integration.test_spec_fuzz as fuzz
from tests.integration.test_spec_fuzz import HEADERS, Case, Req, _prompt, check_case
from trtllm_glm.kda import layer as kda_layer
from trtllm_glm.runtime.cuda_graph import CudaGraphConfig
from trtllm_glm.runtime.executor import ExecutorConfig
from trtllm_glm.runtime.sampling import SamplingParams
from trtllm_glm.speculative.config import MTPDecodingConfig, NGramDecodingConfig

pytestmark = pytest.mark.cpu_only

FIRST = int(os.environ.get("TRTLLM_GLM_SPEC_SCENARIO_SEED", "0"))
SEEDS = list(range(FIRST, FIRST + int(os.environ.get("TRTLLM_GLM_SPEC_SCENARIO_SEEDS", "1"))))


def _graphs(batch: int) -> CudaGraphConfig:
    return CudaGraphConfig(batch_sizes=list(range(1, batch + 1)), enable_padding=True)


def _greedy(max_tokens: int, **kw: Any) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True, **kw)


def _run(monkeypatch: pytest.MonkeyPatch, case: Case, name: str) -> Any:
    """`check_case` on ``case``; returns the speculative executor it ran (for the scenario's own assertions)."""
    made: list[Any] = []
    build = fuzz.build

    def keep(c: Case, refs: Any) -> Any:
        made.append(build(c, refs))
        return made[-1]

    monkeypatch.setattr(fuzz, "build", keep)
    check_case(monkeypatch, case, f"pytest {__file__} -k '{name}'")
    assert len(made) == 1
    return made[0]


# --------------------------------------------------------------------------------------------------
def fp8_prefix_preempt_case(seed: int, mode: str) -> Case:
    """FP8 latent rows, prefix caching over one header (and repeated prompts), a pool that holds about two
    requests, MTP drafts in a ``mode`` draft cache; requests arrive in waves so later ones hit the cache while
    earlier ones are preempted."""
    rng = random.Random(seed)
    K, P = rng.choice([2, 3]), 8
    header = list(rng.choice(HEADERS).encode())
    reqs: list[Req] = []
    for i in range(5):
        if i >= 2 and rng.random() < 0.5:
            prompt = list(reqs[rng.randrange(i)].prompt)  # the same prompt again: a hit up to its last checkpoint
        else:
            prompt = _prompt(rng, "small", header[: rng.randrange(2 * P, len(header) + 1)])
        reqs.append(Req(prompt, _greedy(rng.randint(14, 30)), arrive=[0, 0, 3, 6, 9][i]))
    longest = max(len(r.prompt) + r.params.max_tokens for r in reqs)
    total = sum(len(r.prompt) + r.params.max_tokens + K + 1 for r in reqs)
    cfg = ExecutorConfig(
        tokens_per_block=P, max_tokens=max(longest + K + 1 + P, total // 4), max_batch_size=4, max_num_tokens=64,
        max_seq_len=fuzz.REF_MAX_SEQ_LEN, enable_block_reuse=True, checkpoint_interval=P, checkpoint_prompt_end=True,
        checkpoint_request_end=True, latent_dtype="fp8", cuda_graph_config=_graphs(4) if seed % 2 else None,
    )  # fmt: skip
    spec = MTPDecodingConfig(max_draft_len=K, draft_kv_mode=mode, catchup_lag=rng.choice([0, 2]))
    return Case(seed, "harsh", "small", "mtp", spec, cfg, seed % 2 == 1, None, 1000, reqs)


@pytest.mark.parametrize("mode", ["shared", "separate"])
@pytest.mark.parametrize("seed", SEEDS)
def test_fp8_latent_prefix_hits_preemption_and_mtp(monkeypatch: pytest.MonkeyPatch, seed: int, mode: str) -> None:
    ex = _run(monkeypatch, fp8_prefix_preempt_case(seed, mode), f"fp8 and {seed} and {mode}")
    assert ex.manager.latent_dtype == fuzz.torch.float8_e4m3fn
    assert ex.num_preemptions > 0 and ex.prefix.stats.hits > 0, (ex.num_preemptions, ex.prefix.stats)


# --------------------------------------------------------------------------------------------------
def batch_wait_aborts_case(seed: int) -> Case:
    """Two requests decode with MTP rounds launched ahead and drafted early; arrivals are held
    (``batch_wait_timeout_iters``); some are aborted while held, a running one is aborted while others are held."""
    rng = random.Random(seed)
    K = rng.choice([2, 3])
    # (the first request outlives the arrivals: 40+ tokens at up to K + 1 a round, and no stop token drawn for it,
    # which ended both first requests before any arrival in case seed 101: nothing decoded, nothing held)
    reqs = [Req(_prompt(rng, "small", None), _greedy(rng.randint(40, 50))) for _ in range(2)]
    reqs[0].no_stop = True
    for arrive in sorted(rng.sample(range(2, 9), 4)):
        # (short prompts: two waiting stay under the token ratio, which would end the hold at once)
        r = Req(_prompt(rng, "small", None)[:24], _greedy(rng.randint(6, 20)), arrive=arrive)
        if rng.random() < 0.5:
            r.abort_at = arrive + rng.randint(0, 3)  # usually while held
        reqs.append(r)
    reqs[1].abort_at = rng.randint(4, 9)
    cfg = ExecutorConfig(
        tokens_per_block=8, max_tokens=2048, max_batch_size=8, max_num_tokens=64, max_seq_len=fuzz.REF_MAX_SEQ_LEN,
        cuda_graph_config=_graphs(8), overlap_scheduler=True, batch_wait_timeout_iters=rng.choice([2, 4, 8]),
        batch_wait_max_tokens_ratio=rng.choice([0.0, 1.0]),
    )  # fmt: skip
    spec = MTPDecodingConfig(max_draft_len=K, overlap_rounds=True, early_draft=True, catchup_lag=rng.choice([0, 5]))
    return Case(seed, "harsh", "small", "mtp", spec, cfg, True, None, 1000, reqs)


@pytest.mark.parametrize("seed", SEEDS)
def test_batch_wait_with_aborts_and_rounds_launched_ahead(monkeypatch: pytest.MonkeyPatch, seed: int) -> None:
    ex = _run(monkeypatch, batch_wait_aborts_case(seed), f"batch_wait and {seed}")
    assert ex.num_held_steps > 0 and (ex.num_overlapped_rounds > 0 or ex.num_early_drafts > 0)


# --------------------------------------------------------------------------------------------------
def lag_flush_slots_case(seed: int, mode: str) -> Case:
    """A catch-up lag under a scripted policy (mostly K = 0 rounds: rows held; K rounds flush them through the
    catch-up graphs in slices, grouped by a small step budget), requests that stop mid-round, and arrivals right
    behind them that take the freed slots."""
    rng = random.Random(seed)
    K = rng.choice([2, 3])
    reqs = [Req(_prompt(rng, "small", None)[:32], _greedy(rng.randint(8, 20))) for _ in range(3)]
    for arrive in sorted(rng.sample(range(3, 12), 3)):
        reqs.append(Req(_prompt(rng, "small", None)[:32], _greedy(rng.randint(6, 16)), arrive=arrive))
    cfg = ExecutorConfig(
        tokens_per_block=8, max_tokens=2048, max_batch_size=4, max_num_tokens=rng.choice([2 * (K + 1), 16]),
        max_seq_len=fuzz.REF_MAX_SEQ_LEN, cuda_graph_config=_graphs(4), overlap_scheduler=True,
    )  # fmt: skip
    spec = MTPDecodingConfig(max_draft_len=K, draft_kv_mode=mode, catchup_lag=rng.choice([2, 3, 5]), adaptive=True,
                             overlap_rounds=True)  # fmt: skip
    # K = 0 stretches long enough to fill the ring behind steps launched ahead (those flushes may not capture).
    policy = [0] * rng.choice([7, 12]) + [K] + [0] * 5 + [K, K]
    case = Case(seed, "harsh", "small", "mtp", spec, cfg, True, policy, 1000, reqs)
    case.capture = seed % 2 == 0  # without the start-up capture a flush behind a step in flight runs eagerly
    return case


@pytest.mark.parametrize("mode", ["shared", "separate"])
@pytest.mark.parametrize("seed", SEEDS)
def test_lag_flushes_with_finishes_and_reused_slots(monkeypatch: pytest.MonkeyPatch, seed: int, mode: str) -> None:
    # (from case seed 3: its full rings behind steps in flight find no graph captured and flush eagerly)
    ex = _run(monkeypatch, lag_flush_slots_case(seed + 3, mode), f"lag_flushes and {seed} and {mode}")
    assert ex.drafter.num_lag_flushes > 0


# --------------------------------------------------------------------------------------------------
def _count_rides(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Count the KDA steps where decode rows ride a short prefill's grid."""
    rides = [0]
    build: Callable = kda_layer._StepPlan.build.__func__  # type: ignore[attr-defined]

    def counted(cls: Any, batch: Any, N: int, dev: Any) -> Any:
        plan = build(cls, batch, N, dev)
        if any(batch.q_lens[b] == 1 and batch.past_lens[b] > 0 for b in plan.short):
            rides[0] += 1
        return plan

    monkeypatch.setattr(kda_layer._StepPlan, "build", classmethod(counted))
    return rides


def ride_case(seed: int, drafter: str) -> Case:
    """Short KDA prefills with decode rows riding them, width-one rounds (n-gram drafts that often find nothing, or
    the MTP drafter under a policy of mostly K = 0), short requests finishing while prompts arrive (their slots
    reused, so slots stop following request ids), sampled requests among them."""
    rng = random.Random(seed)
    K = rng.choice([2, 3])
    reqs = [Req(_prompt(rng, "small", None), _greedy(rng.choice([2, 3, 20, 30]))) for _ in range(3)]
    for arrive in sorted(rng.sample(range(1, 12), 5)):
        p = _greedy(rng.randint(2, 16))
        if rng.random() < 0.25:
            p = SamplingParams(max_tokens=p.max_tokens, temperature=0.8, seed=rng.randrange(1000))
        reqs.append(Req(_prompt(rng, "small", None)[: rng.randint(1, 40)], p, arrive=arrive))
    cfg = ExecutorConfig(
        tokens_per_block=8, max_tokens=2048, max_batch_size=4, max_num_tokens=rng.choice([16, 64]),
        max_seq_len=fuzz.REF_MAX_SEQ_LEN, prefill_chunk_size=rng.choice([None, 7]),
    )  # fmt: skip
    policy = None
    if drafter == "mtp":
        spec: Any = MTPDecodingConfig(max_draft_len=K, adaptive=True, catchup_lag=rng.choice([0, 3]))
        policy = [0, 0, 0, K, 0, 0, K]
    else:
        spec = NGramDecodingConfig(max_draft_len=K)
    case = Case(seed, "harsh", "small", drafter, spec, cfg, False, policy, 1000, reqs)
    case.env = {"TRTLLM_GLM_KDA_SHORT_PREFILL": "64", "TRTLLM_GLM_KDA_DECODE_RIDE": "512"}
    return case


@pytest.mark.parametrize("drafter", ["mtp", "ngram"])
@pytest.mark.parametrize("seed", SEEDS)
def test_decode_rows_ride_with_reused_slots_and_finishes(
    monkeypatch: pytest.MonkeyPatch, seed: int, drafter: str
) -> None:
    rides = _count_rides(monkeypatch)
    _run(monkeypatch, ride_case(seed, drafter), f"ride and {seed} and {drafter}")
    assert rides[0] > 0


# --------------------------------------------------------------------------------------------------
def full_batch_queue_case(seed: int) -> Case:
    """A full batch with a queue behind it and no batch waiting: requests stop mid-round (drawn stop tokens) or are
    aborted, each freeing a slot that the next step fills from the queue, while the batch's MTP rounds are drafted
    early (the queue cannot be admitted while the batch is full, so it must not keep the rounds synchronous)."""
    rng = random.Random(seed)
    K = rng.choice([2, 3])
    B = rng.choice([2, 3])
    reqs = [Req(_prompt(rng, "small", None)[:32], _greedy(rng.randint(24, 40))) for _ in range(B + 4)]
    for r in rng.sample(reqs[1:], 2):
        r.abort_at = rng.randint(3, 12)
    cfg = ExecutorConfig(
        tokens_per_block=8, max_tokens=2048, max_batch_size=B, max_num_tokens=64, max_seq_len=fuzz.REF_MAX_SEQ_LEN,
        cuda_graph_config=_graphs(B), overlap_scheduler=rng.random() < 0.75,
    )  # fmt: skip
    # (rounds launched ahead, `overlap_rounds`, already ran behind a queue: the early drafts are the hazard here)
    spec = MTPDecodingConfig(max_draft_len=K, early_draft=True, catchup_lag=rng.choice([0, 5]))
    case = Case(seed, "harsh", "small", "mtp", spec, cfg, True, None, 1000, reqs)
    case.capture = seed % 2 == 0
    return case


@pytest.mark.parametrize("seed", SEEDS)
def test_early_drafts_on_a_full_batch_with_a_queue(monkeypatch: pytest.MonkeyPatch, seed: int) -> None:
    from trtllm_glm.runtime.speculative_executor import SpeculativeExecutor

    queued = [0]
    early = SpeculativeExecutor._early_draft

    def counted(self: Any, plan: Any) -> Any:
        drafts = early(self, plan)
        if drafts is not None and self.waiting:
            queued[0] += 1
        return drafts

    monkeypatch.setattr(SpeculativeExecutor, "_early_draft", counted)
    _run(monkeypatch, full_batch_queue_case(seed), f"full_batch and {seed}")
    assert queued[0] > 0  # rounds drafted early while requests queued behind the full batch
