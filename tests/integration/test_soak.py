"""The randomized differential soak (tests/soak.py; docs/architecture.md, "The soak").

Seeded random request mixes (shared system prefixes, next turns, repeats, budgets, stop tokens from the reference's
own continuation, staggered arrivals) through random legs on a random ``tiny``-geometry model in fp32: plain, MTP
K = 1..5 (shared and separate draft KV, fixed and adaptive widths), n-gram K up to 7, an oracle drafter with random
acceptance, the batch-invariant mode; page pools small enough to preempt, chunked prefill, prefix caching with few
checkpoints. Then two spawned gloo worlds: TP = 2 in the batch-invariant mode and EP = 3 (a world of three ranks).
Every output must equal the same request run alone, plain, without reuse; the engine must end empty and
consistent. The CI soak runs a fixed list of rounds (four passes over the legs, ~1.2 minutes on 2 cores);
``TRTLLM_GLM_SOAK_MINUTES=60`` runs rounds for an hour, ``TRTLLM_GLM_SOAK_SEED`` / ``TRTLLM_GLM_SOAK_ROUND`` pick the
seed and replay one round.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest

from tests import soak
from trtllm_glm import KvCacheConfig
from trtllm_glm.config import Glm5NextConfig
from trtllm_glm.models.glm5_next import Glm5NextForCausalLM
from trtllm_glm.numerics import set_batch_invariant
from trtllm_glm.speculative.config import MTPDecodingConfig, NGramDecodingConfig

pytestmark = pytest.mark.cpu_only

# The single-process legs of the CI soak, in order (every kind, both draft-KV modes, the mode); round r runs
# CI_LEGS[r % len(CI_LEGS)] with sizes drawn from (seed, r). The long soak then draws the kind at random too.
CI_LEGS = ["plain", "mtp", "mtp", "mtp", "ngram", "oracle", "oracle", "mtp*", "oracle*"]
CI_ROUNDS = 4 * len(CI_LEGS)


def soak_config() -> Glm5NextConfig:
    """The tiny preset's geometry with 6 routed experts of width 48: shardable over 2 and 3 ranks."""
    return dataclasses.replace(Glm5NextConfig.from_pretrained("tiny"), n_routed_experts=6, moe_intermediate_size=48)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The soak model (random weights from the seed) as a checkpoint: each rank of a parallel world loads its share."""
    d = tmp_path_factory.mktemp("soak") / "model"
    Glm5NextForCausalLM.from_config(soak_config(), seed=soak.base_seed()).save_pretrained(d)
    return str(d)


@pytest.fixture(scope="module")
def model(checkpoint: str) -> Glm5NextForCausalLM:
    return Glm5NextForCausalLM.from_pretrained(checkpoint, device=soak.device())


@pytest.fixture(scope="module")
def refs(model: Glm5NextForCausalLM) -> soak.ReferenceCache:
    return soak.ReferenceCache(model)


def _leg_for(seed: int, rnd: int) -> soak.Leg:
    rng = soak.round_rng(seed, rnd, "leg")
    if rnd < CI_ROUNDS:
        kind = CI_LEGS[rnd % len(CI_LEGS)]
    else:  # the long soak: any kind, one round in four in the mode
        kind = rng.choice(soak.LEG_KINDS) + ("*" if rng.random() < 0.25 else "")
    return soak.make_leg(rng, kind.rstrip("*"), invariant=kind.endswith("*"))


def test_soak_single_process(model: Glm5NextForCausalLM, refs: soak.ReferenceCache) -> None:
    seed = soak.base_seed()
    total = soak.RoundResult()
    for rnd in soak.rounds(CI_ROUNDS, share=0.8):
        leg = _leg_for(seed, rnd)
        res = soak.run_round(model, refs, seed, rnd, leg)
        assert not res.problems, soak.failure_message(seed, rnd, leg.name, res, "single_process")
        total.add(res)
    print(f"soak seed {seed}: {total}")
    if soak.long_minutes() is None and not os.environ.get(soak.ROUND_ENV):
        # The CI rounds reach what they are there for (else the mix generator has drifted).
        assert total.preemptions > 0 and total.prefix_hits > 0 and total.branch_checkpoints > 0, total
        assert total.verify_rounds > 0 and total.stops > 0, total
        # fp32: near ties are rare enough that the CI seed's rounds need no excuse at all.
        assert total.excused == 0, total


# ------------------------------------------------------------------------------------------------
# Parallel legs: spawned worlds (this process is rank 0), driven through rank 0's mirrored executor.
PARALLEL_LEGS = {
    # TP = 2 in the batch-invariant mode (the workers must be built in it too), MTP K = 3 with separate draft KV.
    "tp2_invariant": (
        {"tensor_parallel_size": 2, "batch_invariant": True},
        MTPDecodingConfig(num_nextn_predict_layers=3, draft_kv_mode="separate"),
    ),
    # A world of three: experts split over three ranks (each MoE output is a sum of three partials), n-gram K = 5.
    "ep3": ({"moe_expert_parallel_size": 3}, NGramDecodingConfig(max_draft_len=5)),
}


@pytest.mark.parametrize("name", list(PARALLEL_LEGS))
def test_soak_parallel(
    name: str, checkpoint: str, refs: soak.ReferenceCache, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A parallel world against the single-process references (rounding of the split sums differs: a divergence is
    excused at near ties only). The workers check their mode at start (`soak.ModeCheckedLLM`), and a collective that
    waits for a peer fails after 60 s rather than the default 120 s."""
    parallel, spec = PARALLEL_LEGS[name]
    seed = soak.base_seed()
    monkeypatch.setenv(soak.EXPECT_MODE_ENV, "1" if parallel.get("batch_invariant") else "0")
    monkeypatch.setenv("TRTLLM_GLM_DIST_TIMEOUT", "60")
    kv = KvCacheConfig(tokens_per_block=8, max_tokens=144, checkpoint_interval=16, max_checkpoints=4)
    total = soak.RoundResult()
    try:
        with soak.ModeCheckedLLM(
            checkpoint, device="cpu", kv_cache_config=kv, max_batch_size=5, max_num_tokens=24, prefill_chunk_size=12,
            max_seq_len=soak.MAX_SEQ_LEN, speculative_config=spec, **parallel,
        ) as llm:  # fmt: skip
            for rnd in soak.rounds(4, share=0.1):
                res = soak.run_llm_round(llm, refs, seed, rnd, name)
                assert not res.problems, soak.failure_message(seed, rnd, name, res, name)
                total.add(res)
            assert llm.comm.num_all_reduces > 0 and llm.parallel_error is None
    finally:
        set_batch_invariant(False)  # the mode is process-wide: the next test starts outside it
    print(f"soak {name} seed {seed}: {total}")
    assert total.preemptions > 0 and total.prefix_hits > 0 and total.verify_rounds > 0, total
