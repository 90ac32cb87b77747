"""`AdaptiveDraftPolicy`: the draft length of each round, down to 0, from measured round costs and acceptance.

Picks the ``K`` that maximises ``E(K) / T(b, K)`` with ``E(K) = 1 + a + ... + a^K``; ``T`` is measured online per
batch-size bucket and ``K`` from host-clock stamps the caller takes where it already waits (the first interval of
each run of one ``K`` discarded: a round after a change of length pays the change; MTP catch-ups of held rows
charged to ``K = 0``, whose rounds caused them), ``a`` is accepted over reached drafts, exponentially averaged.
Deterministic given the intervals it is fed (tests inject a clock). The model, exploration and measurements:
docs/speculation.md, "Adaptive draft length (opt-in)".
"""

from __future__ import annotations

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


@dataclass
class _Cost:
    seconds: float = 0.0
    samples: int = 0  # intervals averaged (the discarded first one not counted)
    seen: int = 0  # intervals received
    last_round: int = -1  # the bucket round it was last measured in


@dataclass
class AdaptiveDraftPolicy:
    """Chooses each round's draft length (``0 .. max_draft_len``) from measured costs and acceptance.

    Args:
        max_draft_len: the largest ``K``.
        candidates: the ``K`` values it may pick (default every ``0 .. max_draft_len``).
        cost_weight: weight of a new interval in a cost's exponential average.
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
        prior_acceptance: ``a`` before any draft was verified.
        clock: seconds (``time.perf_counter`` by default); the executor stamps it once per round.

    Attributes:
        chosen: ``K`` of the rounds `choose` returned, oldest first (the latest ``history`` to ``2 * history``
            of them: a server runs for millions of rounds).
        counts: ``K -> rounds`` over every choice.
    """

    max_draft_len: int
    candidates: Sequence[int] | None = None
    cost_weight: float = 0.25
    acceptance_weight: float = 0.05
    min_samples: int = 2
    explore_every: int = 64
    max_explore_every: int = 1024
    probe_rounds: int = 3
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
        if not 0 < self.cost_weight <= 1 or not 0 < self.acceptance_weight <= 1:
            raise ValueError("cost_weight and acceptance_weight must be in (0, 1]")
        if self.min_samples < 1 or self.explore_every < 2 or self.max_explore_every < self.explore_every:
            raise ValueError("min_samples must be >= 1, explore_every >= 2 and max_explore_every >= explore_every")
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
        # MTP catch-ups of held rows: bucket -> [seconds they added, K = 0 rounds run] (their cost per K = 0 round).
        self._lag: dict[int, list] = {}
        # The open interval: (stamp, bucket, K) of the round now running; whether it holds a catch-up of held rows
        # (`note_flush`), and whether the interval opened next will.
        self._open: tuple[float, int, int] | None = None
        self._open_flush = False
        self._next_flush = False

    # --------------------------------------------------------------------------------------------
    @staticmethod
    def bucket(batch_size: int) -> int:
        """The cost table's batch-size bucket: the next power of two (1, 2, 4, 8, ...)."""
        return 1 << max(batch_size - 1, 0).bit_length()

    @property
    def acceptance(self) -> float:
        """The running estimate of ``a`` (per-draft acceptance given the drafts before it were accepted)."""
        return self._accepted / self._reached if self._reached > 0 else self.prior_acceptance

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
        """Seconds per ``K = 0`` round that the MTP catch-ups of held rows added in ``batch_size``'s bucket (0 before
        one was measured; always 0 for drafters that hold nothing)."""
        s, n = self._lag.get(self.bucket(batch_size), (0.0, 0))
        return s / n if n else 0.0

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
                return self._pick(k)
        best = best_draft_len(self.estimated_costs(batch_size, got), self.acceptance)
        ex = self._explore.setdefault(b, [self.explore_every - 1, self.explore_every, best, None, None])
        if ex[3] is not None and n > ex[0]:
            # The re-measurement is in (its interval was stamped before this call): back off while it changes
            # nothing (the same choice, the K's cost within 10 %), start over when it does.
            was, now = ex[4], got.get(ex[3], ex[4])
            # (a K measured for the first time moved nothing it could be compared with)
            same = best == ex[2] and (was is None or now is None or abs(now - was) <= 0.1 * was)
            ex[1] = min(2 * ex[1], self.max_explore_every) if same else self.explore_every
            ex[0], ex[3] = ex[0] + ex[1], None
        elif best != ex[2] and ex[3] is None:
            ex[0] = min(ex[0], n + self.explore_every)  # the choice moved by itself: look around again soon
            ex[1] = self.explore_every
        if best in got and n >= ex[0] and ex[3] is None:
            i = cands.index(best)
            near = {cands[j] for j in (i - 1, i + 1) if 0 <= j < len(cands)} | {cands[-1]}
            near.discard(best)
            if near:
                k = min(sorted(near), key=lambda k: self._last_round(b, k))
                ex[0], ex[2], ex[3], ex[4] = n, best, k, got.get(k)
                self._probe[b] = (k, self.probe_rounds - 1)
                return self._pick(k)
        ex[2] = best
        return self._pick(best)

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
            return
        w = self.cost_weight if c.samples else 1.0
        c.seconds = (1 - w) * c.seconds + w * seconds
        c.samples += 1

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
            k = self.choose(batch_size)
        self._open = (now, batch_size, k if running is None else running)
        self._open_flush, self._next_flush = self._next_flush, False
        return k

    def _close(self, now: float | None, steady: bool) -> None:
        """End the open interval at ``now`` (``None``: dropped unmeasured): a cost sample when ``steady``, else only
        the record of which ``K`` ran. An interval holding a catch-up of held rows books, instead of a sample, what
        it took beyond its ``K``'s cost as the catch-up's cost, spread over the bucket's ``K = 0`` rounds."""
        if self._open is None:
            return
        t0, ob, ok = self._open
        b = self.bucket(ob)
        prev = self._prev_k.get(b)
        self._prev_k[b] = ok
        lag = self._lag.setdefault(b, [0.0, 0])
        if ok == 0:
            lag[1] += 1
        if now is None or not steady:
            return
        if self._open_flush:
            c = self._costs.get((b, ok))
            if c is not None and c.samples >= self.min_samples:
                lag[0] += max(0.0, now - t0 - c.seconds)
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
