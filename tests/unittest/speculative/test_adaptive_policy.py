"""`AdaptiveDraftPolicy` against the deterministic simulator (`benchmarks/sim_adaptive.py`, issue 43: speculation never
slower than plain): the scenarios calibrated to the H200 rows of 2026-12-07 where K = 3 loses (batch 16 and 64: the
policy must reach 0.97x the better fixed choice, K = 0 there), one where K = 3 pays (batch 1: 0.95x fixed K = 3), a
drafter made slow on purpose, and long intervals (flushes, unflagged waits) that must not flip the choice. Before the
windowed-median costs the policy ran 0.84x / 0.71x K = 0 in the first two (its exponential average of K = 0's cost
followed the long intervals and K = 3 looked competitive)."""

from __future__ import annotations

import dataclasses

import pytest

from benchmarks.sim_adaptive import SCENARIOS, Scenario, compare, simulate
from trtllm_glm.speculative.adaptive import AdaptiveDraftPolicy

pytestmark = pytest.mark.cpu_only

SEEDS = tuple(range(10))


class FakeClock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


@pytest.mark.parametrize("name", ["b16", "b64"])
def test_calibrated_scenarios_where_drafting_loses_reach_plain(name: str) -> None:
    r = compare(SCENARIOS[name], seeds=SEEDS)
    # K = 3 loses there (H200: 0.59x / 0.40x plain decoding); the policy pays its first measurement of K = 3 and
    # little else: at least 0.97x the better fixed choice (K = 0, plain steps plus the catch-up flushes).
    assert r["fixed"]["tokens_per_s"] < 0.8 * r["mtp0"]["tokens_per_s"]
    assert r["ratio_best"] >= 0.97, r
    assert r["adaptive"]["counts"].get(3, 0) <= 0.03 * sum(r["adaptive"]["counts"].values()), r


def test_scenario_where_drafting_pays_keeps_drafting() -> None:
    """Batch 1: a K = 3 round of 1.6 ms at a = 0.75 (2.73 tokens) against a 0.62 ms plain step: K = 3 is 1.10x. Three
    rounds of a batch of one say little about the acceptance: the policy chooses optimistically by one spread of its
    estimate and re-measures K = 3 every 16 rounds while it may be as good (else it settled on K = 0 for hundreds of
    rounds after an unlucky start, 0.91x fixed K over seeds 5-12)."""
    r = compare(SCENARIOS["b1"], seeds=SEEDS)
    assert r["fixed"]["tokens_per_s"] > 1.05 * r["mtp0"]["tokens_per_s"]
    assert r["ratio_fixed"] >= 0.95, r


def test_slow_drafter_settles_on_zero() -> None:
    """Drafts that cost two steps each (a perfect drafter: every draft accepted): K = 0 after the first measurement,
    re-measured at most every 1024 rounds."""
    sc = Scenario(batch=16, cost_ms={0: 1.0, 3: 7.0}, first_ms={3: 8.0}, acceptance=1.0, outlier_p=0.01,
                  flush_ms=1.0, gen=2048)  # fmt: skip
    r = compare(sc, seeds=(0, 1, 2))
    assert r["ratio_mtp0"] >= 0.98, r
    rounds = sum(r["adaptive"]["counts"].values())
    assert r["adaptive"]["counts"][3] <= 3 * (4 + 2 * 4), r  # the first measurement and <= 2 re-measurements a run
    assert rounds > 3 * 2000


def test_long_intervals_do_not_flip_the_choice() -> None:
    """H200 batch 16 costs (K = 0 0.70 ms, K = 3 2.645 ms at a = 0.71: K = 0 is 1.36x) and every 16th round waits
    9 ms on something unflagged, every 64th k = 0 round holds a flagged catch-up of 2 ms: the choice stays K = 0 and
    its cost the median. An exponential average (weight 0.25) put K = 0 at up to 2.9 ms and chose K = 3 for runs of
    64 rounds and more."""
    clock = FakeClock()
    pol = AdaptiveDraftPolicy(3, candidates=(0, 3), clock=clock)
    ks = []
    zeros = 0
    for i in range(2000):
        k = pol.begin_round(True, 16)
        ks.append(k)
        t = 0.70e-3 if k == 0 else 2.645e-3
        if i % 16 == 15:
            t += 9e-3
        if k == 0:
            zeros += 1
            if zeros % 64 == 0:
                t += 2e-3
                pol.note_flush()
        clock.t += t
        if k:
            for j in range(16):
                acc = (0, 0, 1, 1, 2, 3, 3, 3)[j % 8]  # 13 of 18 drafts reached: 0.72
                pol.observe_acceptance(k, acc)
    assert ks[:6] == [3, 3, 3, 0, 0, 0]
    # K = 3 only in re-measurements of 3 rounds, at least 300 rounds apart (the margin is wide: `probe_wait`)
    threes = [i for i, k in enumerate(ks) if k and i >= 6]
    starts = [i for i in threes if i - 1 not in threes]
    assert threes == [i + j for i in starts for j in range(3)], threes
    assert len(starts) <= 5 and all(b - a >= 300 for a, b in zip([0] + starts, starts)), starts
    assert pol.costs(16)[0] == pytest.approx(0.70e-3, rel=0.05)
    assert pol.lag_cost(16) < 0.1e-3  # 2 ms every 64 rounds: ~0.03 ms a round


def test_a_re_measurement_replaces_a_moved_cost_but_not_for_one_long_interval() -> None:
    pol = AdaptiveDraftPolicy(3, candidates=(0, 3), clock=FakeClock())

    def run(k: int, xs: list[float], after: int) -> None:
        pol.observe_cost(1, k, 9.9, after=after)  # the first of a run: a change of length, no sample
        for x in xs:
            pol.observe_cost(1, k, x, after=k)

    run(3, [1.0] * 10, 0)
    assert pol.costs(1)[3] == pytest.approx(1.0)
    run(3, [1.0, 5.0], 0)  # one long interval in a re-measurement: the cost stays
    assert pol.costs(1)[3] == pytest.approx(1.0)
    run(3, [0.5, 0.52], 0)  # every interval of it 50 % cheaper: the old window goes
    assert pol.costs(1)[3] == pytest.approx(0.5)
    # (the first intervals' excess over the cost is the change of length's cost)
    assert pol.switch_cost(1, 3) == pytest.approx(8.9)


def test_memory_is_bounded_and_runs_are_deterministic() -> None:
    sc = dataclasses.replace(SCENARIOS["b16"], gen=4096)
    pols: list[AdaptiveDraftPolicy] = []

    def make(*args, **kw) -> AdaptiveDraftPolicy:
        pols.append(AdaptiveDraftPolicy(*args, **kw))
        return pols[-1]

    a = simulate(sc, seed=3, policy_factory=make)
    b = simulate(sc, seed=3, policy_factory=make)
    assert (a.tokens, a.seconds, a.counts) == (b.tokens, b.seconds, b.counts)
    pol = pols[0]
    assert all(len(c.window) <= pol.cost_window and len(c.switch) <= 8 and len(c.run) <= pol.min_samples
               for c in pol._costs.values())  # fmt: skip
    assert len(pol.chosen) <= 2 * pol.history


def test_new_config_errors() -> None:
    with pytest.raises(ValueError, match="cost_window"):
        AdaptiveDraftPolicy(3, cost_window=1, min_samples=2)
    with pytest.raises(ValueError, match="change_tolerance"):
        AdaptiveDraftPolicy(3, change_tolerance=0.0)
    with pytest.raises(ValueError, match="probe_budget"):
        AdaptiveDraftPolicy(3, probe_budget=0.0)


def test_simulator_reproduces_the_batch_64_loss_of_fixed_cost_catch_ups() -> None:
    """`b64_h100` (docs/speculation.md): catch-ups of ~1 ms whatever they hold, charged per held K = 0 round after the
    short runs that re-measurements make, put K = 0 near K = 3 and the policy alternates, as on the H100 (0.74x plain
    decoding, K = 3 in 136 of 189 rounds). The simulator shows the same loss against the K = 0 baseline; a policy that
    measures what long runs pay should reach >= 0.97x here (then this test changes with it)."""
    r = compare(SCENARIOS["b64_h100"], seeds=SEEDS[:5], gen=512)
    assert 0.7 < r["ratio_mtp0"] < 0.95, r
    assert r["adaptive"]["counts"][3] > 0.05 * sum(r["adaptive"]["counts"].values()), r
