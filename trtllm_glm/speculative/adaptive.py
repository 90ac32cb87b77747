"""`AdaptiveDraftPolicy`: the draft length of each round, down to 0, from measured round costs and acceptance.

Picks the ``K`` that maximises ``E(K) / T(b, K)`` with ``E(K) = 1 + a + ... + a^K``; ``T`` is measured online per
batch-size bucket and ``K`` from host-clock stamps the caller takes where it already waits, as the median of the
latest intervals (the first interval of each run of one ``K`` discarded: a round after a change of length pays the
change; MTP catch-ups of held rows charged to ``K = 0``, whose rounds caused them, as an amortised lag cost), ``a`` is
accepted over reached drafts, exponentially averaged. Re-measurements of a length wait in proportion to its margin
below the best (`probe_wait`) and come back soon only while the acceptance is uncertain. Deterministic given the
intervals it is fed (tests inject a clock); memory bounded per (bucket, ``K``). The model, exploration, the simulator
(`benchmarks/sim_adaptive.py`) and measurements: docs/speculation.md, "Adaptive draft length (opt-in)".
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

__all__ = ["AdaptiveDraftPolicy", "expected_tokens", "best_draft_len"]


def expected_tokens(k: int, a: float) -> float:
    """``1 + sum_{i=1..k} a^i``: tokens a round of ``k`` drafts gains per request at acceptance ``a``."""
    return 1.0 + sum(a**i for i in range(1, k + 1))


def best_draft_len(costs: dict[int, float], a: float) -> int:
    """The ``K`` of ``costs`` (``K -> seconds per round``) with the most expected tokens per second; ties go to
    the smaller ``K`` (less work for the same rate)."""
    # E(k) for k = 0 .. max(costs), built up once (the policy calls this every round).
    e, p = [1.0], 1.0
    for _ in range(max(costs)):
        p *= a
        e.append(e[-1] + p)
    return max(sorted(costs), key=lambda k: (e[k] / costs[k], -k))


def _median(xs: deque) -> float:
    """The median of ``xs``; the smaller of two (an interval only ever runs long: one that waited on something would
    be half the mean of two)."""
    v = sorted(xs)
    n = len(v)
    if n <= 2:
        return v[0]
    return v[n // 2] if n % 2 else 0.5 * (v[n // 2 - 1] + v[n // 2])


@dataclass
class _Cost:
    """The recent steady intervals of one (bucket, ``K``): their median is the cost (a window, not an exponential
    average: one long interval, a step that waited on something, moves a median not at all; see `observe_cost`)."""

    window: deque = field(default_factory=deque)  # the latest intervals (at most the policy's `cost_window`)
    seconds: float = 0.0  # their median
    samples: int = 0  # intervals taken (the discarded first of each run not counted)
    seen: int = 0  # intervals received
    last_round: int = -1  # the bucket round it was last measured in
    run: list = field(default_factory=list)  # the samples of the current run of this K (at most `min_samples`)
    base: float | None = None  # the cost when the current run began (None: nothing to compare the run with)
    switch: deque = field(default_factory=deque)  # the latest first intervals' excess over the cost (at most 8)


@dataclass
class AdaptiveDraftPolicy:
    """Chooses each round's draft length (``0 .. max_draft_len``) from measured costs and acceptance.

    Args:
        max_draft_len: the largest ``K``.
        candidates: the ``K`` values it may pick (default every ``0 .. max_draft_len``).
        cost_window: intervals a (bucket, ``K``) keeps; its cost is their median. The H200 rows of 2026-12-07 (batch
            16) had k = 0 rounds of 0.70 ms (median) but steps up to 9.7 ms: an exponential average (weight 0.25)
            put k = 0 at 1.50 ms, K = 3 looked competitive, and 26 % of the rounds drafted where K = 3 lost.
        change_tolerance: a new run of a length whose first ``min_samples`` intervals all lie beyond this fraction
            of its cost, on the same side, replaces the window with them (a re-measurement sees a changed cost at
            once; one long interval in it does not).
        acceptance_weight: weight of a new round in the acceptance averages once they have seen ``1 /
            acceptance_weight`` rounds (before that: plain means, so that a batch of one request, one round per
            choice, does not keep the prior for tens of rounds).
        min_samples: intervals a (bucket, ``K``) needs (after the discarded first) before it is trusted.
        explore_every: a bucket re-measures its least recently tried ``K`` once every this many rounds at first.
        max_explore_every: each re-measurement that leaves the bucket's choice as it was doubles the wait before the
            next, up to this many rounds; a changed choice goes back to ``explore_every``. A re-measurement runs a
            length that is not the best (and, with the MTP catch-up lag, first catches up the held rows), so a
            settled bucket should pay for it rarely.
        probe_rounds: rounds a re-measurement runs its length for. The first round of a run pays the change of
            length (a verify round after width-one steps runs synchronously, no draft launched early) and is not
            measured, so a probe of one round would only ever see that; the rest are its steady cost.
        probe_budget: the share of time re-measurements may lose: a re-measurement of a length whose rate is far
            below the best's waits longer than ``explore_every`` (`probe_wait`, at most ``max_explore_every``).
            At ``a = 0.71`` a K = 3 round of 2.65 ms against a 0.70 ms k = 0 round (H200, batch 16) loses 0.85 ms,
            three of them every 64 rounds 5.7 % of the time (every 729 rounds: 0.5 %).
        prior_acceptance: ``a`` before any draft was verified.
        clock: seconds (``time.perf_counter`` by default); the executor stamps it once per round.

    Attributes:
        chosen: ``K`` of the rounds `choose` returned, oldest first (the latest ``history`` to ``2 * history``
            of them: a server runs for millions of rounds).
        counts: ``K -> rounds`` over every choice.
    """

    max_draft_len: int
    candidates: Sequence[int] | None = None
    cost_window: int = 16
    change_tolerance: float = 0.1
    acceptance_weight: float = 0.05
    min_samples: int = 2
    explore_every: int = 64
    max_explore_every: int = 1024
    probe_rounds: int = 3
    probe_budget: float = 0.005
    prior_acceptance: float = 0.5
    clock: Callable[[], float] | None = None
    history: int = 4096
    chosen: list[int] = field(default_factory=list)
    counts: dict[int, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.max_draft_len < 1:
            raise ValueError(f"max_draft_len must be >= 1, got {self.max_draft_len}")
        cands = sorted(set(range(self.max_draft_len + 1) if self.candidates is None else self.candidates))
        if not cands or cands[0] < 0 or cands[-1] > self.max_draft_len or 0 not in cands:
            raise ValueError(f"candidates must include 0 and lie in [0, {self.max_draft_len}], got {self.candidates}")
        self.candidates = cands
        if not 0 < self.acceptance_weight <= 1:
            raise ValueError("acceptance_weight must be in (0, 1]")
        if self.cost_window < self.min_samples or not 0 < self.change_tolerance < 1:
            raise ValueError("cost_window must be >= min_samples and change_tolerance in (0, 1)")
        if self.min_samples < 1 or self.explore_every < 2 or self.max_explore_every < self.explore_every:
            raise ValueError("min_samples must be >= 1, explore_every >= 2 and max_explore_every >= explore_every")
        if not 0 < self.probe_budget <= 1:
            raise ValueError(f"probe_budget must be in (0, 1], got {self.probe_budget}")
        if not 1 <= self.probe_rounds < self.explore_every:
            raise ValueError(f"probe_rounds must be in [1, explore_every), got {self.probe_rounds}")
        if self.clock is None:
            import time

            self.clock = time.perf_counter
        # Acceptance as running sums of accepted and reached drafts (a = accepted / reached).
        self._accepted = self.prior_acceptance
        self._reached = 1.0
        self._observed = 0  # request rounds averaged into the acceptance so far
        self._costs: dict[tuple[int, int], _Cost] = {}
        self._rounds: dict[int, int] = {}  # bucket -> rounds chosen in it
        # bucket -> [round of its next re-measurement, current wait, best before it, the K re-measured (None: none
        # pending), that K's cost before]
        self._explore: dict[int, list] = {}
        self._probe: dict[int, tuple[int, int]] = {}  # bucket -> (K re-measured, rounds of it still to run)
        self._prev_k: dict[int, int] = {}  # bucket -> K of the last round that ran (measured or not)
        # MTP catch-ups of held rows: bucket -> [the latest catch-ups' seconds beyond their round's cost per K = 0
        # round that held the rows, K = 0 rounds since the last catch-up].
        self._lag: dict[int, list] = {}
        # The open interval: (stamp, bucket, K) of the round now running; whether it holds a catch-up of held rows
        # (`note_flush`), and whether the interval opened next will.
        self._open: tuple[float, int, int] | None = None
        self._open_flush = False
        self._next_flush = False
        self._pending: int | None = None  # the length whose last missing sample is running now (`begin_round`)

    # --------------------------------------------------------------------------------------------
    @staticmethod
    def bucket(batch_size: int) -> int:
        """The cost table's batch-size bucket: the next power of two (1, 2, 4, 8, ...)."""
        return 1 << max(batch_size - 1, 0).bit_length()

    @property
    def acceptance(self) -> float:
        """The running estimate of ``a`` (per-draft acceptance given the drafts before it were accepted)."""
        return self._accepted / self._reached if self._reached > 0 else self.prior_acceptance

    @property
    def acceptance_spread(self) -> float:
        """One standard deviation of `acceptance`: ``sqrt(a (1 - a) / n)`` over the reached drafts ``n`` it averages
        (its request-rounds, at most the exponential average's ``(2 - w) / w``, times the drafts reached a round); 1
        before any draft was verified. After the first three rounds of a batch of one it is ~0.2: a policy that
        trusted ``a`` there settled on k = 0 for hundreds of rounds where K = 3 paid (benchmarks/sim_adaptive.py)."""
        if self._observed == 0:
            return 1.0
        w = self.acceptance_weight
        n = min(self._observed, (2.0 - w) / w) * self._reached
        a = self.acceptance
        return (max(a * (1.0 - a), 1e-4) / max(n, 1e-9)) ** 0.5

    def costs(self, batch_size: int) -> dict[int, float]:
        """``K -> seconds per round`` trusted so far in ``batch_size``'s bucket."""
        b = self.bucket(batch_size)
        out = {}
        for k in self.candidates:  # type: ignore[union-attr]
            c = self._costs.get((b, k))
            if c is not None and c.samples >= self.min_samples:
                out[k] = c.seconds
        return out

    def estimated_costs(self, batch_size: int, got: dict[int, float] | None = None) -> dict[int, float]:
        """``K -> seconds per round`` for every candidate of ``batch_size``'s bucket once ``0`` and the largest
        ``K`` are trusted: the measured cost, else the straight line between those two (drafting costs about
        the same per draft step; the verify grows with its width). Empty before that. ``got``: `costs` of the
        same batch size, when the caller has it."""
        got = self.costs(batch_size) if got is None else got
        kmax = self.candidates[-1]  # type: ignore[index]
        if 0 not in got or kmax not in got:
            return {}
        c0, cm = got[0], got[kmax]
        out = {k: got.get(k, c0 + (cm - c0) * k / kmax) for k in self.candidates}  # type: ignore[union-attr]
        # K = 0 rounds hold the MTP layer's rows for a later catch-up: that forward is their cost too.
        out[0] += self.lag_cost(batch_size)
        return out

    def lag_cost(self, batch_size: int) -> float:
        """Seconds per ``K = 0`` round that the MTP catch-ups of held rows added in ``batch_size``'s bucket: the median
        over the latest catch-ups (`cost_window`) of what each took beyond its round's cost per ``K = 0`` round since
        the one before (0 before one was measured; always 0 for drafters that hold nothing). A running mean took a
        catch-up interval that also waited on something else (2.3 ms beyond its round) as 0.76 ms a round where three
        K = 0 rounds had held the rows, and kept it."""
        lag = self._lag.get(self.bucket(batch_size))
        return _median(lag[0]) if lag is not None and lag[0] else 0.0

    def choose(self, batch_size: int) -> int:
        """The draft length of the next round of a ``batch_size``-request decode batch.

        The largest ``K`` and ``0`` are measured first (in that order); then the ``K`` of the best expected
        rate over `estimated_costs` is chosen, which measures an estimated one when it looks best. Every
        ``explore_every`` rounds the least recently measured of the best's neighbours (and the largest ``K``)
        is re-measured, so a change in cost or acceptance moves the choice step by step.
        """
        b = self.bucket(batch_size)
        n = self._rounds.get(b, 0)
        self._rounds[b] = n + 1
        probe = self._probe.get(b)
        if probe is not None and probe[1] > 0:
            self._probe[b] = (probe[0], probe[1] - 1)
            return self._pick(probe[0])
        cands: list[int] = list(self.candidates)  # type: ignore[arg-type]
        got = self.costs(batch_size)
        for k in (cands[-1], 0):
            if k not in got:
                # The round already running (launched ahead) is the last sample this length needs: choose now what
                # comes after it (else one more round of it runs behind the choice).
                c = self._costs.get((b, k))
                if k != self._pending or c is None or c.samples != self.min_samples - 1 or not c.samples:
                    return self._pick(k)
                got[k] = c.seconds
        est = self.estimated_costs(batch_size, got)
        # Optimistic by one spread while the acceptance rests on fewer request-rounds than its average spans (a batch
        # of one after its first rounds): drafting measures the acceptance, k = 0 does not (it would keep a low early
        # estimate for good).
        w = self.acceptance_weight
        young = 0 < self._observed < (2.0 - w) / w  # (before any verify round: the prior as it is)
        best = best_draft_len(est, min(1.0, self.acceptance + (self.acceptance_spread if young else 0.0)))
        ex = self._explore.setdefault(b, [self.explore_every - 1, self.explore_every, best, None, None])
        if ex[3] is not None and n > ex[0]:
            # The re-measurement is in (its interval was stamped before this call): back off while it changes
            # nothing (the same choice, the K's cost within 10 %), start over when it does.
            was, now = ex[4], got.get(ex[3], ex[4])
            # (a K measured for the first time moved nothing it could be compared with)
            same = best == ex[2] and (was is None or now is None or abs(now - was) <= 0.1 * was)
            # ... and while a longer re-measured K may still be as good within two spreads of the acceptance (a batch
            # of one learns its acceptance from these rounds): no back-off on an uncertain margin.
            if same and ex[3] in est and best in est and ex[3] > best:
                same = self.probe_wait(est, best, ex[3], spreads=2.0) > 0
            ex[1] = min(2 * ex[1], self.max_explore_every) if same else self.explore_every
            ex[0], ex[3] = ex[0] + ex[1], None
        elif best != ex[2] and ex[3] is None:
            ex[0] = min(ex[0], n + self.explore_every)  # the choice moved by itself: look around again soon
            ex[1] = self.explore_every
        if best in got and ex[3] is None:
            i = cands.index(best)
            near = {cands[j] for j in (i - 1, i + 1) if 0 <= j < len(cands)} | {cands[-1]}
            near.discard(best)
            if near:
                k = min(sorted(near), key=lambda k: self._last_round(b, k))
                last = ex[0] - ex[1]  # the round of the last re-measurement (or of the start)
                if k > best and self.probe_wait(est, best, k, spreads=2.0) == 0:
                    # Uncertain: within two spreads of the acceptance the longer ``k`` may be as good, and only its
                    # rounds measure the acceptance: look again soon.
                    due = last + max(self.probe_rounds + 1, self.explore_every // 4)
                else:
                    # A wide margin waits longer: at most `probe_budget` of the time lost to re-measurements.
                    due = last + max(ex[1], min(self.probe_wait(est, best, k, bucket=b), self.max_explore_every))
                if n >= due:
                    ex[0], ex[2], ex[3], ex[4] = n, best, k, got.get(k)
                    self._probe[b] = (k, self.probe_rounds - 1)
                    return self._pick(k)
        ex[2] = best
        return self._pick(best)

    def probe_wait(
        self, est: dict[int, float], best: int, k: int, spreads: float = 1.0, bucket: int | None = None
    ) -> float:
        """Rounds of ``best`` to run before re-measuring ``k`` (costs ``est``) so that the re-measurements lose at most
        `probe_budget` of the time. Its `probe_rounds` of ``k`` lose ``T(k) (1 - rate(k) / rate(best))`` each
        against ``best``'s rate, the rates taken at the acceptance most favourable to ``k`` within ``spreads``
        `acceptance_spread` (an uncertain estimate re-measures sooner), plus the measured costs of the two changes of
        length in ``bucket`` (`switch_cost`). 0 when ``k`` may be as good."""
        d = spreads * self.acceptance_spread
        a = min(1.0, max(0.0, self.acceptance + (d if k > best else -d)))
        rate_best, rate_k = expected_tokens(best, a) / est[best], expected_tokens(k, a) / est[k]
        loss = self.probe_rounds * est[k] * max(0.0, 1.0 - rate_k / rate_best)
        if loss <= 0:
            return 0.0
        # the two changes of length (into k and back), as measured
        loss += sum(self.switch_cost(bucket, j) for j in (k, best)) if bucket is not None else 0.0
        return loss / (self.probe_budget * est[best])

    def switch_cost(self, bucket: int, k: int) -> float:
        """Seconds the first round of a run of ``k`` took beyond ``k``'s cost in ``bucket`` (median of the latest
        eight; 0 before one was measured)."""
        c = self._costs.get((bucket, k))
        return _median(c.switch) if c is not None and c.switch else 0.0

    def _last_round(self, b: int, k: int) -> int:
        c = self._costs.get((b, k))
        return -1 if c is None else c.last_round

    def _pick(self, k: int) -> int:
        self.chosen.append(k)
        if len(self.chosen) > 2 * self.history:
            del self.chosen[: self.history]
        self.counts[k] = self.counts.get(k, 0) + 1
        return k

    # --------------------------------------------------------------------------------------------
    def observe_acceptance(self, proposed: int, accepted: int) -> None:
        """One request's verify round: ``accepted`` of its ``proposed`` drafts (0 <= accepted <= proposed)."""
        if proposed <= 0:
            return
        reached = accepted + (1 if accepted < proposed else 0)
        # A plain mean over the first rounds (the first round replaces the prior), then the exponential average. From
        # the prior at 0.05 a round, a batch of one (one sample a round) still estimated ~0.65 after the first three
        # rounds of K = 3 had accepted 2.9 of 3 drafts each, and the first choices were made on that.
        self._observed += 1
        w = max(self.acceptance_weight, 1.0 / self._observed)
        self._accepted = (1 - w) * self._accepted + w * accepted
        self._reached = (1 - w) * self._reached + w * reached

    def observe_cost(self, batch_size: int, k: int, seconds: float, *, after: int | None = None) -> None:
        """One round of ``k`` drafts over ``batch_size`` requests took ``seconds``; ``after``: the ``K`` of the round
        before it (``None``: unknown). The first round of a length (after another length, or ever) is not a sample:
        it pays the change (a verify round after width-one steps neither overlaps nor has its drafts launched
        early; first-use captures and compiles); the 2026-12-06 H100 runs measured K = 3 only in such rounds, as
        2-3x its steady cost, and chose K = 0 in 327 of 334 rounds at batch 1 where K = 3 was 1.7x faster."""
        b = self.bucket(batch_size)
        c = self._costs.setdefault((b, k), _Cost())
        c.seen += 1
        c.last_round = self._rounds.get(b, 0)
        if c.seen == 1 or after != k:
            # A new run: its samples are compared with the cost as it stands now; what this first interval took
            # beyond that is the change of length's cost (`probe_wait` counts it).
            c.run, c.base = [], (c.seconds if c.samples >= self.min_samples else None)
            if c.base is not None:
                c.switch.append(max(0.0, seconds - c.base))
                if len(c.switch) > 8:
                    c.switch.popleft()
            return
        c.samples += 1
        c.window.append(seconds)
        if len(c.window) > self.cost_window:
            c.window.popleft()
        if c.base is not None and len(c.run) < self.min_samples:
            c.run.append(seconds)
            tol = self.change_tolerance
            if len(c.run) == self.min_samples and (min(c.run) > (1 + tol) * c.base or max(c.run) < (1 - tol) * c.base):
                # The cost moved (every interval of the run beyond the tolerance, on one side): the old ones go.
                c.window = deque(c.run)
        c.seconds = _median(c.window)

    def begin_round(self, steady: bool, batch_size: int, *, k: int | None = None, running: int | None = None) -> int:
        """Stamp the clock and choose the draft length of the round that starts now (once per round, after the
        previous round's results were read back: the stamp adds no device synchronisation).

        The interval since the previous stamp is the previous round's cost (its drafting, its verify, the
        host's work) when ``steady``: it was a decode round of the batch it was opened for (no prefill rows
        joined it, no request arrived); otherwise it is dropped.

        Args:
            steady: see above.
            batch_size: the decode batch of the round that starts now.
            k: the length decided already (a choice the previous call made but no round could run yet); None
                chooses now (`choose`).
            running: the length of the round that really runs until the next stamp when it is not the returned
                one (the overlap scheduler: a width-one step launched ahead, 0); its interval is booked under it.

        Returns:
            The chosen ``K``.
        """
        now = self.clock()  # type: ignore[misc]
        self._close(now, steady)
        if k is None:
            # A round of ``running`` (launched ahead) of the same length as the last one, steady and holding no
            # catch-up, is a sample of its length when it closes.
            b = self.bucket(batch_size)
            same = running is not None and steady and self._prev_k.get(b) == running
            self._pending = running if same and self._open is not None and not self._next_flush else None
            k = self.choose(batch_size)
            self._pending = None
        self._open = (now, batch_size, k if running is None else running)
        self._open_flush, self._next_flush = self._next_flush, False
        return k

    def _close(self, now: float | None, steady: bool) -> None:
        """End the open interval at ``now`` (``None``: dropped unmeasured): a cost sample when ``steady``, else only
        the record of which ``K`` ran. An interval holding a catch-up of held rows books, instead of a sample, what
        it took beyond its ``K``'s cost as the catch-up's cost, per ``K = 0`` round that held the rows (`lag_cost`)."""
        if self._open is None:
            return
        t0, ob, ok = self._open
        b = self.bucket(ob)
        prev = self._prev_k.get(b)
        self._prev_k[b] = ok
        lag = self._lag.setdefault(b, [deque(), 0])
        if ok == 0:
            lag[1] += 1
        if self._open_flush:
            # The catch-up of the rows held since the last one: its cost per K = 0 round that held them.
            held, lag[1] = lag[1], 0
            c = self._costs.get((b, ok))
            if now is not None and steady and held and c is not None and c.samples >= self.min_samples:
                lag[0].append(max(0.0, now - t0 - c.seconds) / held)
                if len(lag[0]) > self.cost_window:
                    lag[0].popleft()
            return
        if now is None or not steady:
            return
        self.observe_cost(ob, ok, now - t0, after=prev)

    def note_flush(self, ahead: bool = False) -> None:
        """The MTP drafter caught held rows up: the open interval holds that forward, or (``ahead``: launched behind
        a step in flight, which the next read-back does not wait for) the interval opened next does."""
        if ahead:
            self._next_flush = True
        else:
            self._open_flush = True

    @property
    def open_batch_size(self) -> int | None:
        """The batch size of the running interval (None: none is open)."""
        return None if self._open is None else self._open[1]

    def reset_interval(self) -> None:
        """Drop the running interval unmeasured (the next `begin_round` only opens one); its ``K`` still counts as
        the last length run."""
        self._close(None, False)
        self._open = None
        self._open_flush = False
