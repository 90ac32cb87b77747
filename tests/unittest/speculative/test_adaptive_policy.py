"""`AdaptiveDraftPolicy` against the deterministic simulator (`benchmarks/sim_adaptive.py`, issue 43: speculation never
slower than plain): the scenarios calibrated to the H200 rows of 2026-12-07 where K = 3 loses (batch 16 and 64: the
policy must reach 0.97x / 0.965x the better fixed choice, K = 0 there), one where K = 3 pays (batch 1: 0.95x fixed
K = 3), the H100 batch-64 one whose catch-ups are mostly fixed cost, a drafter made slow on purpose, and long intervals
(flushes, unflagged waits) that must not flip the choice. Before the windowed-median costs the policy ran 0.84x / 0.71x
K = 0 in the first two (its exponential average of K = 0's cost followed the long intervals and K = 3 looked
competitive). Then the rules of the cost samples around a change of length, interval by interval: the first `settle`
of a run, the cut last round of a run launched ahead, short and long catch-ups of held rows."""

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


@pytest.mark.parametrize(("name", "bound"), [("b16", 0.97), ("b64", 0.965)])
def test_calibrated_scenarios_where_drafting_loses_reach_plain(name: str, bound: float) -> None:
    r = compare(SCENARIOS[name], seeds=SEEDS)
    # K = 3 loses there (H200: 0.59x / 0.40x plain decoding); the policy pays its first measurement of K = 3 and
    # little else: at least 0.97x the better fixed choice (K = 0, plain steps plus the catch-up flushes). At batch 64
    # 0.965x: since `settle` = 2 that measurement runs five K = 3 rounds of 4.4 ms instead of three (0.970x against
    # 0.973x before, in 256 tokens; 0.987x in 2,048); the simulator does not model the unsteady second rounds it
    # drops, so here it only costs.
    assert r["fixed"]["tokens_per_s"] < 0.8 * r["mtp0"]["tokens_per_s"]
    assert r["ratio_best"] >= bound, r
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
    # The first measurement (`settle` = 2, min_samples = 2 and the cut round launched ahead: 5 rounds) and <= 2
    # re-measurements a run (`probe_rounds` = 5, the round kept after the catch-up and the cut one: 7).
    assert r["adaptive"]["counts"][3] <= 3 * (5 + 2 * 7), r
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
    assert ks[:8] == [3] * 4 + [0] * 4
    # K = 3 only in re-measurements of `probe_rounds` = 5 rounds, at least 300 rounds apart (the margin is wide:
    # `probe_wait`)
    threes = [i for i, k in enumerate(ks) if k and i >= 8]
    starts = [i for i in threes if i - 1 not in threes]
    assert starts and threes == [i + j for i in starts for j in range(5)], threes
    assert len(starts) <= 5 and all(b - a >= 300 for a, b in zip([0] + starts, starts)), starts
    assert pol.costs(16)[0] == pytest.approx(0.70e-3, rel=0.05)
    assert pol.lag_cost(16) < 0.1e-3  # 2 ms every 64 rounds: ~0.03 ms a round


def test_a_re_measurement_replaces_a_moved_cost_but_not_for_one_long_interval() -> None:
    pol = AdaptiveDraftPolicy(3, candidates=(0, 3), clock=FakeClock())

    def run(k: int, xs: list[float], after: int) -> None:
        pol.observe_cost(1, k, 9.9, after=after)  # the first of a run: a change of length, no sample
        pol.observe_cost(1, k, 7.0, after=k)  # the second (`settle` = 2): not steady, no sample either
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
    # The first interval of a run is never a sample (settle >= 1); a catch-up covers at least one held round.
    for bad in (0, -1):
        with pytest.raises(ValueError, match="settle"):
            AdaptiveDraftPolicy(3, settle=bad)
        with pytest.raises(ValueError, match="lag_min_held"):
            AdaptiveDraftPolicy(3, lag_min_held=bad)
    for bad in (0, 64):
        with pytest.raises(ValueError, match="probe_rounds"):
            AdaptiveDraftPolicy(3, probe_rounds=bad, explore_every=64)
    # A probe shorter than settle + min_samples takes few samples but is allowed (the fuzzer's one-round probes).
    pol = AdaptiveDraftPolicy(3, probe_rounds=1, explore_every=2, settle=3, lag_min_held=1)
    assert (pol.probe_rounds, pol.settle, pol.lag_min_held) == (1, 3, 1)
    default = AdaptiveDraftPolicy(3)
    assert (default.settle, default.probe_rounds, default.lag_min_held) == (2, 5, 8)


def test_simulator_b64_h100_keeps_k0_where_catch_ups_are_mostly_fixed_cost() -> None:
    """`b64_h100` (docs/speculation.md): catch-ups of ~1 ms whatever they hold. On the H100 the policy alternated
    there (0.74x plain decoding, K = 3 in 136 of 189 rounds), and the policy before `settle` did in the simulator too:
    0.91x the K = 0 baseline, K = 3 in 8 % of the rounds. Here that came from a lone first sample: its last missing
    K = 0 sample was the round running ahead (the 'pending' rule), and an outlier there made K = 0 look dear; K = 3 was
    chosen, and the catch-up after that short K = 0 run, charged per held round, kept it. Now: >= 0.97x the K = 0
    baseline (0.985x; plain decoding, which has no MTP layer and no catch-ups, 0.94x), K = 3 only in its measurements.
    Which rule makes the difference in the simulator: trusting one first sample (``min_samples=1, settle=1``, what the
    pending rule amounted to) loses again; ``lag_min_held=1`` or ``settle=1`` alone do not (0.985x / 0.988x: the
    simulator has no unsteady second rounds, and its short K = 0 runs, five rounds and more now, are not dear enough
    per held round to flip the choice; `test_a_short_catch_up_is_no_lag_sample_a_long_one_is` holds that rule)."""
    r = compare(SCENARIOS["b64_h100"], seeds=SEEDS[:5], gen=512)
    assert r["ratio_mtp0"] >= 0.97, r
    assert r["adaptive"]["counts"][3] <= 0.015 * sum(r["adaptive"]["counts"].values()), r
    lone = lambda *a, **kw: AdaptiveDraftPolicy(*a, min_samples=1, settle=1, **kw)  # noqa: E731
    r = compare(SCENARIOS["b64_h100"], seeds=SEEDS[:5], gen=512, policy_factory=lone)
    assert r["ratio_mtp0"] < 0.95 and r["adaptive"]["counts"][3] > 0.05 * sum(r["adaptive"]["counts"].values()), r


def _stamp(
    pol: AdaptiveDraftPolicy,
    clock: FakeClock,
    k: int,
    seconds: float,
    *,
    running: int | None = None,
    flush: bool = False,
) -> None:
    """One round of ``k`` decided already (``running``: the length of a round launched ahead that runs instead, the
    executor's call when the choice changes at its read-back), holding a catch-up when ``flush``, that takes
    ``seconds`` (closed at the next stamp)."""
    assert pol.begin_round(True, 1, k=k, running=running) == k
    if flush:
        pol.note_flush()
    clock.t += seconds


def test_the_first_settle_intervals_of_a_run_are_no_samples() -> None:
    """The rounds right after a change of length are not steady (H100, batch 1: the second and third intervals of
    K = 3's runs put it at 2.36 ms against 1.10 steady): the first `settle` = 2 of every run are no samples, counted
    from the change, also when the run begins with a catch-up of held rows (the executor's drafting run after K = 0
    rounds; counted from the interval after it, the second of the run was a sample)."""
    clock = FakeClock()
    pol = AdaptiveDraftPolicy(3, candidates=(0, 3), clock=clock)
    for x in (9.0, 5.0, 1.0):
        _stamp(pol, clock, 3, x)
    _stamp(pol, clock, 3, 1.0)  # closes the third interval: one sample, not yet trusted (min_samples = 2)
    assert 3 not in pol.costs(1)
    _stamp(pol, clock, 0, 4.0)  # closes the fourth: K = 3 trusted at 1.0, the first two not taken
    assert pol.costs(1) == {3: pytest.approx(1.0)}
    for x in (3.0, 0.5, 0.5):
        _stamp(pol, clock, 0, x)
    # A re-measurement of K = 3 (no catch-up): its second interval, short, is no sample; both samples of the run are
    # 2.0, beyond the tolerance on one side, so they replace the window (one of 0.2 among them would not).
    for x in (9.0, 0.2, 2.0, 2.0):
        _stamp(pol, clock, 3, x)
    _stamp(pol, clock, 0, 4.0)
    assert pol.costs(1) == {0: pytest.approx(0.5), 3: pytest.approx(2.0)}
    for x in (3.0, 0.5, 0.5):
        _stamp(pol, clock, 0, x)
    # The same after K = 0 rounds, the run beginning with the held rows' catch-up (booked as such, no sample): its
    # second interval is still the run's second, and the run is compared with the cost as a new one.
    _stamp(pol, clock, 3, 9.0, flush=True)
    for x in (0.2, 3.0, 3.0):
        _stamp(pol, clock, 3, x)
    _stamp(pol, clock, 0, 4.0)
    assert pol.costs(1) == {0: pytest.approx(0.5), 3: pytest.approx(3.0)}


def test_the_cut_last_round_of_a_run_launched_ahead_is_no_sample() -> None:
    """A round launched ahead whose length is not the one chosen at its read-back ends its run: nothing is launched
    behind it and its read-back comes early (0.2-0.8 ms against 24-78 ms on the CPU). Taken as K = 0's missing sample
    (a window of two keeps the smaller) it made K = 0 look nearly free; a round launched ahead of the chosen length
    is a sample."""
    clock = FakeClock()
    pol = AdaptiveDraftPolicy(3, candidates=(0, 3), clock=clock)
    for x in (9.0, 5.0, 1.0, 1.0):
        _stamp(pol, clock, 3, x)
    for x in (4.0, 3.0, 0.5):
        _stamp(pol, clock, 0, x)
    _stamp(pol, clock, 0, 0.01, running=0)  # K = 0 launched ahead and K = 0 chosen: its interval is a sample
    _stamp(pol, clock, 3, 0.02, running=0)  # K = 0 launched ahead, K = 3 chosen: cut short, no sample
    _stamp(pol, clock, 3, 9.0)
    assert pol.costs(1) == {0: pytest.approx(0.01), 3: pytest.approx(1.0)}  # (0.5 and 0.01: the smaller of two)
    # A first measurement of K = 0 that ends with the cut round: one sample, not yet trusted.
    pol = AdaptiveDraftPolicy(3, candidates=(0, 3), clock=clock)
    for x in (9.0, 5.0, 1.0, 1.0):
        _stamp(pol, clock, 3, x)
    for x in (4.0, 3.0):
        _stamp(pol, clock, 0, x)
    _stamp(pol, clock, 0, 0.5, running=0)
    _stamp(pol, clock, 3, 0.02, running=0)
    _stamp(pol, clock, 3, 9.0)
    assert 0 not in pol.costs(1)


def test_a_short_catch_up_is_no_lag_sample_a_long_one_is() -> None:
    """A catch-up of held rows after fewer than `lag_min_held` = 8 K = 0 rounds is mostly fixed cost (a replay, its
    host work): charged per held round it made K = 0 dearer than K = 3 at batch 64 on an H100. It is the next
    length's change cost (`switch_cost`) instead; one after a long run is the lag per held round, at most the short
    ones' rate."""
    clock = FakeClock()
    pol = AdaptiveDraftPolicy(3, candidates=(0, 3), clock=clock)
    for x in (9.0, 5.0, 1.0, 1.0):
        _stamp(pol, clock, 3, x)
    for x in (4.0, 3.0, 0.5, 0.5, 0.5):
        _stamp(pol, clock, 0, x)
    # Five K = 0 rounds held rows; K = 3's first round catches them up: 2.0 fixed + 0.1 a held round beyond its cost.
    _stamp(pol, clock, 3, 1.0 + 2.5, flush=True)
    _stamp(pol, clock, 3, 1.0)
    assert pol.lag_cost(1) == 0.0 and pol.switch_cost(1, 3) == pytest.approx(2.5)
    assert pol.estimated_costs(1)[0] == pytest.approx(0.5)
    # Ten K = 0 rounds, the catch-up inside the tenth (its lag full): 2.0 + 0.1 a held round beyond a K = 0 round.
    for _ in range(9):
        _stamp(pol, clock, 0, 0.5)
    _stamp(pol, clock, 0, 0.5 + 3.0, flush=True)
    _stamp(pol, clock, 0, 0.5)
    assert pol.lag_cost(1) == pytest.approx(0.3) and pol.estimated_costs(1)[0] == pytest.approx(0.8)
    # A long catch-up that also waited on something (3.0 a held round) is bounded by the short ones' rate (0.5).
    pol = AdaptiveDraftPolicy(3, candidates=(0, 3), clock=clock)
    for x in (9.0, 5.0, 1.0, 1.0):
        _stamp(pol, clock, 3, x)
    for x in (4.0, 3.0, 0.5, 0.5, 0.5):
        _stamp(pol, clock, 0, x)
    _stamp(pol, clock, 3, 1.0 + 2.5, flush=True)
    for _ in range(9):
        _stamp(pol, clock, 0, 0.5)
    _stamp(pol, clock, 0, 0.5 + 30.0, flush=True)
    _stamp(pol, clock, 0, 0.5)
    assert pol.lag_cost(1) == pytest.approx(0.5)
