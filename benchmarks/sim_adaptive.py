"""A deterministic CPU simulator of the adaptive draft length (`AdaptiveDraftPolicy`; issue 43: never slower than
plain decoding).

No model: each round's interval is drawn from a per-``K`` cost model (the steady median cost of a round of ``K``
drafts, the cost of the first round of a run of ``K`` after another length, a relative jitter, unflagged outliers,
MTP catch-up flushes of the rows held in ``K = 0`` rounds) and fed to the policy through an injected clock, calling
it in the order `SpeculativeExecutor` does under the overlap scheduler with early drafts:

- a read-back while a round launched ahead runs (a ``K = 0`` step launched ahead, or a ``K`` round drafted early)
  stamps ``begin_round(steady, b, running=<its length>)``; a different choice waits for the next read-back
  (``_policy_draft_len`` with a step in flight, ``_book_round_ahead``: the executor's ``_carry_k``);
- otherwise ``begin_round(steady, b, k=<carried length or None>)``;
- a round that drafts after ``K = 0`` rounds first catches the held rows up inside itself (``note_flush()``) and
  keeps its length one more round (``_after_lag_flush``); a ``K = 0`` round whose held rows fill the lag
  (``catchup_lag``) catches them up behind the step in flight (``note_flush(ahead=True)``: the next interval);
- each request's verify round reports ``observe_acceptance(k, accepted)`` (each draft accepted with probability
  ``a`` given the ones before it were).

Baselines in the same cost model, through the same calls: plain decoding (every round the steady ``K = 0`` cost, no
MTP layer, so no flushes), ``K = 0`` (the MTP executor drafting nothing: plain steps plus a catch-up flush every
``catchup_lag`` rounds, the best a policy that never drafts can do) and a fixed ``K``. "Best fixed" is the better of
the last two. The run ends when the batch has generated ``gen`` tokens a request (simulated tokens/s = tokens /
simulated seconds).

Scenarios calibrated to the H200 rows of 2026-12-07 (trained ``small``, bf16, CUDA graphs, overlap scheduler,
``benchmarks/results/spec/spec_adapt_small_h200_2026-12-07.log``): ``b16`` and ``b64`` (K = 3 loses to plain), ``b1``
(K = 3 pays). Usage::

    python -m benchmarks.sim_adaptive                        # every scenario, current policy
    python -m benchmarks.sim_adaptive --scenario b16 --gen 4096 --seeds 0 1 2
    python -m benchmarks.sim_adaptive --batch 8 --cost 0 0.7 --cost 3 1.9 --acceptance 0.7 --outlier-p 0.05
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
from collections.abc import Callable
from dataclasses import dataclass, field

from trtllm_glm.speculative.adaptive import AdaptiveDraftPolicy

__all__ = ["Scenario", "SCENARIOS", "SimResult", "simulate", "compare"]


@dataclass(frozen=True)
class Scenario:
    """A per-``K`` cost model (milliseconds) at one batch size.

    Args:
        batch: decode batch size (requests in lockstep).
        cost_ms: ``K -> `` steady cost of a round of ``K`` drafts (a run of that length; ``0`` is a step launched
            ahead); its keys are the policy's candidates (``0`` and the largest, as under CUDA graphs).
        first_ms: ``K -> `` cost of the first round of a run of ``K`` after another length (a verify round after
            width-one steps runs synchronously, no early draft; the first width-one step after a verify round is not
            launched ahead). Default: the steady cost.
        acceptance: ``a``, each draft accepted with this probability given the ones before it were.
        jitter: each interval times a uniform factor in ``[1 - jitter, 1 + jitter]``.
        outlier_p: probability that a round (any ``K``, every mode) waits on something unflagged. The H200 adaptive
            rows' steps reached 9.7 / 23 ms at batch 16 / 64 where plain's and fixed K = 3's stayed under 1.5 / 7.4
            ms; what the adaptive run waited on is not known, so the baselines pay the same outliers here and the
            ratios measure the policy's choices, not the outliers.
        outlier_ms: (low, high) of such an outlier's extra milliseconds, uniform.
        catchup_lag: held rows (one a ``K = 0`` round) that force a catch-up flush (`MTPDecodingConfig.catchup_lag`).
        flush_ms: a flush's extra milliseconds for ``catchup_lag`` held rows (proportional to the rows held).
        flush_fixed_ms: what every flush costs besides (its replay and host work, however few rows it holds).
        plain_ms: plain decoding's step (default ``cost_ms[0]``): the baseline's steady cost.
        gen: tokens a request generates (the run's length).
    """

    batch: int
    cost_ms: dict[int, float]
    acceptance: float
    first_ms: dict[int, float] = field(default_factory=dict)
    jitter: float = 0.03
    outlier_p: float = 0.0
    outlier_ms: tuple[float, float] = (2.0, 10.0)
    catchup_lag: int = 64
    flush_ms: float = 0.0
    flush_fixed_ms: float = 0.0
    plain_ms: float | None = None
    gen: int = 256
    note: str = ""

    @property
    def max_draft_len(self) -> int:
        return max(self.cost_ms)


# Calibrated to the H200 rows (2026-12-07): plain overlapped 0.619 ms a step at batch 16 (median 0.608), 0.754 ms at
# 64; fixed K = 3 2.645 / 4.401 ms a round (acceptance 0.71 / 0.78); the adaptive run's median step 0.702 ms at 16,
# steps up to 9.7 / 23 ms, 5 / 10 lag flushes (lag_cost 0.021 / 0.41 ms a K = 0 round). A K = 0 round of the adaptive
# run is taken as its median step (0.70 ms: a plain step plus the held row's copy) at 16 and as the plain step at 64.
# The first round of a run: H100 synchronous K = 3 rounds measured 1.3-1.7x a K = 3 round in a run (2.04 / 3.08 ms
# against 1.59 / 1.85 ms at batch 1 / 16), a width-one step not launched ahead ~1.4x an overlapped one.
SCENARIOS: dict[str, Scenario] = {
    "b16": Scenario(
        batch=16,
        cost_ms={0: 0.70, 3: 2.645},
        first_ms={0: 1.0, 3: 3.4},
        acceptance=0.71,
        outlier_p=0.01,
        outlier_ms=(4.0, 10.0),
        flush_ms=1.2,
        note="H200 small bf16 graphs+overlap, batch 16: K = 3 loses (15,097 against 25,683 tok/s)",
    ),
    "b64": Scenario(
        batch=64,
        cost_ms={0: 0.754, 3: 4.401},
        first_ms={0: 1.1, 3: 6.0},
        acceptance=0.78,
        outlier_p=0.01,
        outlier_ms=(5.0, 20.0),
        flush_ms=4.0,
        note="H200 small bf16 graphs+overlap, batch 64: K = 3 loses (32,498 against 82,258 tok/s)",
    ),
    # H100 rows of 2026-12-07 (trained small, bf16, graphs, overlap; spec_adapt_small_h100_2026-12-07_adaptive_default):
    # plain 1.105 ms a step at batch 64, the adaptive run's K = 0 rounds 1.03 ms and K = 3 rounds 4.80 ms, catch-ups
    # after two or three K = 0 rounds ~1.1 ms beyond their round (lag_cost 0.46 ms a held round): mostly a fixed cost.
    "b64_h100": Scenario(
        batch=64,
        cost_ms={0: 1.03, 3: 4.80},
        first_ms={0: 1.4, 3: 5.8},
        acceptance=0.8,
        outlier_p=0.01,
        outlier_ms=(2.0, 8.0),
        flush_ms=3.0,
        flush_fixed_ms=1.0,
        note="H100 small bf16 graphs+overlap, batch 64: K = 3 loses; catch-ups mostly fixed cost",
    ),
    "b1": Scenario(
        batch=1,
        cost_ms={0: 0.62, 3: 1.6},
        first_ms={0: 0.9, 3: 2.1},
        acceptance=0.75,
        outlier_p=0.01,
        outlier_ms=(2.0, 8.0),
        flush_ms=0.3,
        note="batch 1: K = 3 pays (1.6 ms a round at a = 0.75 against a 0.62 ms plain step)",
    ),
}


@dataclass
class SimResult:
    tokens: int
    seconds: float
    rounds: int
    counts: dict[int, int]  # K -> rounds that ran (not only choices)
    flushes: int = 0
    final_costs_ms: dict[int, float] = field(default_factory=dict)
    lag_cost_ms: float = 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


class _Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


class _Fixed:
    """A policy stand-in that always runs one length (the fixed baselines through the same executor calls)."""

    def __init__(self, k: int) -> None:
        self.k = k

    def begin_round(self, steady: bool, batch_size: int, *, k: int | None = None, running: int | None = None) -> int:
        return self.k

    def note_flush(self, ahead: bool = False) -> None:
        pass

    def observe_acceptance(self, proposed: int, accepted: int) -> None:
        pass

    def estimated_costs(self, batch_size: int) -> dict[int, float]:
        return {}

    def lag_cost(self, batch_size: int) -> float:
        return 0.0


def _accepted(rng: random.Random, k: int, a: float) -> int:
    n = 0
    while n < k and rng.random() < a:
        n += 1
    return n


def _interval(rng: random.Random, base: float, sc: Scenario) -> float:
    """Milliseconds of one round of steady cost ``base``, jitter and outliers included. Three draws a round whatever
    happens (common random numbers: round ``i`` of every mode gets the same jitter and outlier)."""
    j, o, x = rng.random(), rng.random(), rng.random()
    t = base * (1.0 + sc.jitter * (2.0 * j - 1.0))
    if o < sc.outlier_p:
        t += sc.outlier_ms[0] + (sc.outlier_ms[1] - sc.outlier_ms[0]) * x
    return t


def simulate(
    sc: Scenario,
    mode: str = "adaptive",
    *,
    seed: int = 0,
    policy_factory: Callable[..., AdaptiveDraftPolicy] | None = None,
    gen: int | None = None,
) -> SimResult:
    """One run of ``sc``: ``mode`` ``adaptive`` (the policy, called as the executor does), ``plain`` (no MTP layer),
    ``mtp0`` (the MTP executor drafting nothing: ``K = 0`` rounds and their catch-up flushes) or ``fixed`` (always
    the largest ``K``). ``policy_factory(max_draft_len, candidates=..., clock=...)`` builds the policy
    (default `AdaptiveDraftPolicy`). Deterministic given ``seed``."""
    gen = sc.gen if gen is None else gen
    rng = random.Random(seed)  # the rounds' costs
    rng_acc = random.Random(seed + 1_000_003)  # the drafts' acceptance
    K = sc.max_draft_len
    b, a = sc.batch, sc.acceptance
    target = b * gen
    tokens, ms, rounds = 0, 0.0, 0
    counts: dict[int, int] = {}
    if mode == "plain":
        # Plain decoding: no MTP layer (nothing held, no flushes), every step the plain one.
        steady = sc.cost_ms[0] if sc.plain_ms is None else sc.plain_ms
        while tokens < target:
            ms += _interval(rng, steady, sc)
            tokens += b
            rounds += 1
        return SimResult(tokens, ms / 1e3, rounds, {0: rounds})
    clock = _Clock()
    if mode == "adaptive":
        make = policy_factory or AdaptiveDraftPolicy
        pol = make(K, candidates=sorted(sc.cost_ms), clock=clock)
    elif mode in ("fixed", "mtp0"):
        pol = _Fixed(K if mode == "fixed" else 0)
    else:
        raise ValueError(f"mode must be adaptive, plain, mtp0 or fixed, got {mode!r}")
    ahead: int | None = None  # length of a round launched ahead of the next read-back (None: synchronous)
    carry: int | None = None  # a length chosen while a round ran ahead, or kept one more round after a flush
    prev_k: int | None = None  # length of the round that ran last
    held = 0  # rows held by K = 0 rounds, not yet caught up
    flush_next = 0.0  # a flush launched behind the step in flight: the next interval pays it
    flushes = 0
    while tokens < target:
        # The read-back: stamp the policy, choose (executor call order, see the module docstring).
        if ahead is not None:
            k_choice = pol.begin_round(True, b, running=ahead)
            run_k = ahead
            carry = k_choice if k_choice != ahead else None
        else:
            k_choice = pol.begin_round(True, b, k=carry)
            carry = None
            run_k = k_choice
        first = prev_k is not None and run_k != prev_k
        base = sc.first_ms.get(run_k, sc.cost_ms[run_k]) if first else sc.cost_ms[run_k]
        t = _interval(rng, base, sc) + flush_next
        flush_next = 0.0
        if run_k > 0 and held:
            # The MTP drafter catches the held rows up before drafting: inside this round.
            t += sc.flush_fixed_ms + sc.flush_ms * held / sc.catchup_lag
            held = 0
            flushes += 1
            pol.note_flush()
            if ahead is None and k_choice:
                carry = k_choice  # `_after_lag_flush`: the drafting length is kept one more round (measured)
        elif run_k == 0:
            held += 1
            if held >= sc.catchup_lag:
                # The lag is full: the catch-up is launched behind the step in flight; the next round waits for it.
                flush_next = sc.flush_fixed_ms + sc.flush_ms
                held = 0
                flushes += 1
                pol.note_flush(ahead=True)
        counts[run_k] = counts.get(run_k, 0) + 1
        rounds += 1
        ms += t
        clock.t += t / 1e3
        if run_k:
            for _ in range(b):
                acc = _accepted(rng_acc, run_k, a)
                pol.observe_acceptance(run_k, acc)
                tokens += 1 + acc
        else:
            tokens += b
        prev_k = run_k
        # The next round is launched ahead when the choice stands: a K = 0 step ahead of the read-back, a K round
        # drafted early (a changed choice or a carried length keeps the next round synchronous).
        ahead = run_k if (carry is None and k_choice == run_k) else None
    est = pol.estimated_costs(b)
    return SimResult(
        tokens, ms / 1e3, rounds, counts, flushes, {k: round(v * 1e3, 4) for k, v in est.items()}, pol.lag_cost(b) * 1e3
    )


def compare(
    sc: Scenario,
    *,
    seeds: tuple[int, ...] = (0,),
    policy_factory: Callable[..., AdaptiveDraftPolicy] | None = None,
    gen: int | None = None,
) -> dict:
    """Adaptive against plain and fixed ``K`` over ``seeds`` (tokens and seconds summed over the seeds)."""
    out = {}
    for mode in ("plain", "mtp0", "fixed", "adaptive"):
        rs = [simulate(sc, mode, seed=s, policy_factory=policy_factory, gen=gen) for s in seeds]
        tok, sec = sum(r.tokens for r in rs), sum(r.seconds for r in rs)
        counts: dict[int, int] = {}
        for r in rs:
            for k, n in r.counts.items():
                counts[k] = counts.get(k, 0) + n
        out[mode] = {"tokens_per_s": tok / sec, "counts": dict(sorted(counts.items()))}
        if mode == "adaptive":
            out[mode].update(flushes=sum(r.flushes for r in rs), final_costs_ms=rs[-1].final_costs_ms,
                             lag_cost_ms=round(rs[-1].lag_cost_ms, 4))  # fmt: skip
    ad = out["adaptive"]["tokens_per_s"]
    best = max(out["mtp0"]["tokens_per_s"], out["fixed"]["tokens_per_s"])
    out["ratio_plain"] = ad / out["plain"]["tokens_per_s"]
    out["ratio_mtp0"] = ad / out["mtp0"]["tokens_per_s"]
    out["ratio_fixed"] = ad / out["fixed"]["tokens_per_s"]
    out["ratio_best"] = ad / best
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description="Simulate the adaptive draft-length policy against plain and fixed K.")
    ap.add_argument("--scenario", nargs="*", default=None, help=f"of {sorted(SCENARIOS)} (default: all)")
    ap.add_argument("--gen", type=int, default=None, help="tokens a request (default: the scenario's, 256)")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    ap.add_argument("--batch", type=int, default=None, help="a custom scenario: batch size")
    ap.add_argument("--cost", nargs=2, action="append", metavar=("K", "MS"), help="custom: steady ms of K")
    ap.add_argument("--first", nargs=2, action="append", metavar=("K", "MS"), help="custom: first-round ms of K")
    ap.add_argument("--acceptance", type=float, default=0.7)
    ap.add_argument("--jitter", type=float, default=0.03)
    ap.add_argument("--outlier-p", type=float, default=0.0)
    ap.add_argument("--outlier-ms", type=float, nargs=2, default=(2.0, 10.0))
    ap.add_argument("--flush-ms", type=float, default=0.0)
    ap.add_argument("--flush-fixed-ms", type=float, default=0.0)
    ap.add_argument("--catchup-lag", type=int, default=64)
    ap.add_argument("--json", action="store_true", help="one JSON row a scenario")
    args = ap.parse_args()
    scs: dict[str, Scenario] = {}
    if args.batch is not None:
        if not args.cost:
            ap.error("--batch needs --cost K MS (at least 0 and the largest K)")
        scs["custom"] = Scenario(
            batch=args.batch, cost_ms={int(k): float(v) for k, v in args.cost}, acceptance=args.acceptance,
            first_ms={int(k): float(v) for k, v in (args.first or [])}, jitter=args.jitter, outlier_p=args.outlier_p,
            outlier_ms=tuple(args.outlier_ms), catchup_lag=args.catchup_lag, flush_ms=args.flush_ms,
            flush_fixed_ms=args.flush_fixed_ms,
        )  # fmt: skip
    else:
        for name in args.scenario or list(SCENARIOS):
            scs[name] = SCENARIOS[name]
    for name, sc in scs.items():
        r = compare(sc, seeds=tuple(args.seeds), gen=args.gen)
        if args.json:
            print(json.dumps({"scenario": name, **dataclasses.asdict(sc), "gen": args.gen or sc.gen, **r}, default=str))
            continue
        print(f"{name}: batch {sc.batch}, costs {sc.cost_ms} ms, a = {sc.acceptance}  ({sc.note})")
        print(
            f"  plain {r['plain']['tokens_per_s']:,.0f} tok/s  K=0 {r['mtp0']['tokens_per_s']:,.0f}  fixed "
            f"K={sc.max_draft_len} {r['fixed']['tokens_per_s']:,.0f}  adaptive {r['adaptive']['tokens_per_s']:,.0f} "
            f"(x{r['ratio_plain']:.3f} plain, x{r['ratio_mtp0']:.3f} K=0, x{r['ratio_fixed']:.3f} K, "
            f"x{r['ratio_best']:.3f} best fixed)"
        )
        ad = r["adaptive"]
        print(f"  adaptive rounds by K {ad['counts']}, flushes {ad['flushes']}, last run's estimates "
              f"{ad['final_costs_ms']} ms, lag_cost {ad['lag_cost_ms']} ms")  # fmt: skip


if __name__ == "__main__":
    main()
