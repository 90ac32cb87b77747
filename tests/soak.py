"""The randomized differential soak (tests/integration/test_soak.py; docs/architecture.md, "The soak").

A *round* is one seeded random request mix run through one *leg* (an engine configuration: plain, MTP K = 1..5
with shared or separate draft KV, n-gram K up to 7, an oracle drafter with random acceptance, the batch-invariant
mode, a tensor- or expert-parallel world). Every greedy output must equal the same request run alone, plain, with
no reuse (`ReferenceCache`; fp32, a divergence excused only at a near tie, docs/design.md §7), and after the round
the engine must be empty and consistent (`check_engine`): no page or state slot held, no tail-ring rollback that
disagreed with the scheduler, checkpoint eviction in least-recently-used order (`StoreAudit`), byte and hit
counters that add up.

Everything random derives from ``(seed, round)``, so a failure names the two and
``TRTLLM_GLM_SOAK_SEED=<seed> TRTLLM_GLM_SOAK_ROUND=<round>`` replays that round alone.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import random
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from trtllm_glm import LLM
from trtllm_glm.numerics import batch_invariant
from trtllm_glm.runtime.lossless import compare_greedy

SEED_ENV = "TRTLLM_GLM_SOAK_SEED"
ROUND_ENV = "TRTLLM_GLM_SOAK_ROUND"
MINUTES_ENV = "TRTLLM_GLM_SOAK_MINUTES"
DEVICE_ENV = "TRTLLM_GLM_SOAK_DEVICE"
EXPECT_MODE_ENV = "TRTLLM_GLM_SOAK_EXPECT_BATCH_INVARIANT"
DEFAULT_SEED = 47

VOCAB = 256  # prompt and stop tokens: the byte ids (the presets' special ids start at 256)
REF_LEN = 24  # every reference runs this many tokens: one alone run per distinct prompt serves every max_tokens
MAX_SEQ_LEN = 128


def base_seed() -> int:
    """The soak's seed: ``TRTLLM_GLM_SOAK_SEED``, else `DEFAULT_SEED` (CI is reproducible by default)."""
    return int(os.environ.get(SEED_ENV, DEFAULT_SEED))


def long_minutes() -> float | None:
    """``TRTLLM_GLM_SOAK_MINUTES`` (the long soak's length), else None (the CI soak: a fixed list of rounds)."""
    raw = os.environ.get(MINUTES_ENV)
    return float(raw) if raw else None


def round_rng(seed: int, rnd: int, what: str) -> random.Random:
    """The generator of one round's ``what`` (a string seed: stable across processes and Python versions)."""
    return random.Random(f"{seed}:{rnd}:{what}")


def rounds(ci_rounds: int, share: float = 1.0) -> Iterator[int]:
    """Round numbers to run: only ``TRTLLM_GLM_SOAK_ROUND`` when set; the CI soak's ``range(ci_rounds)``; in the
    long soak, rounds until ``share`` of ``TRTLLM_GLM_SOAK_MINUTES`` has passed."""
    if os.environ.get(ROUND_ENV):
        yield int(os.environ[ROUND_ENV])
        return
    minutes = long_minutes()
    if minutes is None:
        yield from range(ci_rounds)
        return
    deadline = time.monotonic() + 60.0 * minutes * share
    for rnd in itertools.count():
        if rnd >= ci_rounds and time.monotonic() > deadline:
            return
        yield rnd


# ------------------------------------------------------------------------------------------------
# Legs and request mixes
# ------------------------------------------------------------------------------------------------
@dataclass
class Leg:
    """One engine configuration.

    Attributes:
        name: for messages.
        spec: ``plain``, ``mtp``, ``ngram`` or ``oracle`` (n-gram rounds whose drafts an `OracleDrafter` replays).
        k: draft length.
        draft_kv: ``shared`` / ``separate`` (MTP).
        invariant: the batch-invariant mode.
        accept: oracle: probability that a draft token is right.
        adaptive: MTP / n-gram: per-request draft widths that change from round to round (``draft_len_fn``).
        tokens_per_block, pool_tokens, max_batch_size, max_num_tokens, prefill_chunk_size: cache and batch sizes
            (``pool_tokens`` small enough to preempt).
        max_checkpoints, checkpoint_interval: prefix caching (always on).
    """

    name: str
    spec: str = "plain"
    k: int = 0
    draft_kv: str = "shared"
    invariant: bool = False
    accept: float = 0.7
    adaptive: bool = False
    tokens_per_block: int = 8
    pool_tokens: int = 192
    max_batch_size: int = 4
    max_num_tokens: int = 48
    prefill_chunk_size: int | None = None
    max_checkpoints: int = 6
    checkpoint_interval: int | None = 16

    def speculative_config(self) -> Any:
        from trtllm_glm.speculative.config import MTPDecodingConfig, NGramDecodingConfig

        fn = None
        if self.adaptive:
            k = self.k
            fn = lambda r: (r.request_id * 7 + len(r.tokens)) % (k + 2)  # noqa: E731 - widths 0 .. k+1 (clamped)
        if self.spec == "mtp":
            return MTPDecodingConfig(num_nextn_predict_layers=self.k, draft_kv_mode=self.draft_kv, draft_len_fn=fn)
        if self.spec in ("ngram", "oracle"):
            return NGramDecodingConfig(max_draft_len=self.k, draft_len_fn=fn if self.spec == "ngram" else None)
        return None


LEG_KINDS = ["plain", "mtp", "mtp", "mtp", "ngram", "oracle", "oracle"]


def make_leg(rng: random.Random, kind: str, *, invariant: bool = False) -> Leg:
    """A random leg of ``kind`` (sizes drawn so that every round preempts sometimes, chunks its prefills and keeps
    few checkpoints)."""
    k = {"plain": 0, "mtp": rng.randint(1, 5), "ngram": rng.randint(1, 7), "oracle": rng.randint(1, 7)}[kind]
    P = rng.choice([4, 8, 16])
    leg = Leg(
        name="",
        spec=kind,
        k=k,
        draft_kv=rng.choice(["shared", "separate"]),
        invariant=invariant,
        accept=rng.choice([0.3, 0.7, 0.95]),
        adaptive=kind in ("mtp", "ngram") and rng.random() < 0.4,
        tokens_per_block=P,
        # Between one longest request and ~2.5 of them: several requests at once run out of pages.
        pool_tokens=rng.choice([MAX_SEQ_LEN, 160, 224, 320]),
        max_batch_size=rng.choice([3, 4, 6]),
        max_num_tokens=rng.choice([16, 24, 48]),
        prefill_chunk_size=rng.choice([None, 5, 12]),
        max_checkpoints=rng.choice([2, 3, 4, 8]),
        checkpoint_interval=rng.choice([None, P, 2 * P]),
    )
    leg.name = describe(leg)
    return leg


def describe(leg: Leg) -> str:
    s = {"plain": "plain", "mtp": f"mtp{leg.k}-{leg.draft_kv}", "ngram": f"ngram{leg.k}"}.get(leg.spec)
    s = s or f"oracle{leg.k}@{leg.accept}"
    return s + ("-adaptive" if leg.adaptive else "") + ("-invariant" if leg.invariant else "")


@dataclass
class SoakRequest:
    """One request of a mix: prompt, budget, stop tokens and the step at which it arrives."""

    prompt: list[int]
    max_tokens: int
    stop: list[int]
    arrival: int
    expected: list[int] = field(default_factory=list)  # the reference truncated at the stop / budget
    gaps: list[float] = field(default_factory=list)
    expected_reason: str = "length"


ROUNDS_PER_POOL = 100
"""Rounds that draw from one prompt pool: the CI soak uses one (each distinct prompt's reference is computed once);
the long soak moves to a new pool every `ROUNDS_PER_POOL` rounds."""


def prompt_pool(seed: int, rnd: int = 0, n: int = 14) -> list[list[int]]:
    """The distinct prompts of round ``rnd``'s pool: three shared system prefixes (whole pages and more, so that
    checkpoints and branch points are hit), prompts extending earlier ones (a conversation's next turn) and
    repetitive ones (the n-gram drafter finds matches)."""
    rng = random.Random(f"{seed}:prompts:{rnd // ROUNDS_PER_POOL}")
    systems = [[rng.randrange(VOCAB) for _ in range(rng.randint(12, 40))] for _ in range(3)]
    out: list[list[int]] = []
    for _ in range(n):
        u = rng.random()
        if u < 0.55:
            p = rng.choice(systems) + [rng.randrange(VOCAB) for _ in range(rng.randint(0, 20))]
        elif u < 0.75 and out:
            p = rng.choice(out) + [rng.randrange(VOCAB) for _ in range(rng.randint(1, 16))]
        elif u < 0.9:
            base = [rng.randrange(VOCAB) for _ in range(rng.randint(2, 5))]
            p = (base * 20)[: rng.randint(8, 50)]
        else:
            p = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 6))]
        out.append(p[: MAX_SEQ_LEN - REF_LEN - 1])
    return out


def make_mix(
    rng: random.Random, pool: list[list[int]], reference: Callable[[list[int]], tuple[list[int], list[float]]]
) -> list[SoakRequest]:
    """A random mix: 5-9 requests from ``pool`` (repeats included: whole-prompt hits), budgets 1..`REF_LEN`, half
    with a stop token taken from the reference's own continuation (so that it lands inside accepted drafts),
    arriving over the first steps."""
    out = []
    for _ in range(rng.randint(5, 9)):
        prompt = list(rng.choice(pool))
        max_tokens = rng.randint(1, REF_LEN)
        ref, gaps = reference(prompt)
        stop: list[int] = []
        if rng.random() < 0.5 and max_tokens > 1:
            stop = [ref[rng.randrange(1, max_tokens)]]
        req = SoakRequest(prompt, max_tokens, stop, arrival=rng.choice([0, 0, 0, 1, 2, 5, 9]))
        n = max_tokens
        for i, t in enumerate(ref[:max_tokens]):
            if t in stop:
                n, req.expected_reason = i + 1, "stop"
                break
        req.expected, req.gaps = ref[:n], gaps[:n]
        out.append(req)
    return out


# ------------------------------------------------------------------------------------------------
# The reference: each distinct prompt alone, plain, no reuse
# ------------------------------------------------------------------------------------------------
class ReferenceCache:
    """Greedy `REF_LEN`-token continuations (and top-2 gaps) of prompts, each run alone on a plain executor without
    block reuse, computed once per distinct prompt."""

    def __init__(self, model: Any) -> None:
        from trtllm_glm.runtime.executor import Executor, ExecutorConfig

        cfg = ExecutorConfig(tokens_per_block=16, max_tokens=MAX_SEQ_LEN, max_batch_size=1, max_num_tokens=128,
                             max_seq_len=MAX_SEQ_LEN)  # fmt: skip
        self.ex = Executor(model, cfg)
        self.cache: dict[tuple[int, ...], tuple[list[int], list[float]]] = {}

    def __call__(self, prompt: list[int]) -> tuple[list[int], list[float]]:
        key = tuple(prompt)
        if key not in self.cache:
            from trtllm_glm.runtime.sampling import SamplingParams

            r = self.ex.add_request(list(prompt), SamplingParams(max_tokens=REF_LEN, ignore_eos=True))
            self.ex.run_until_done()
            self.cache[key] = (list(r.output_ids), list(r.logit_gaps))
        return self.cache[key]


# ------------------------------------------------------------------------------------------------
# Running a round
# ------------------------------------------------------------------------------------------------
class StoreAudit:
    """Shadows a `CheckpointStore`'s recency: stored or hit is most recent, demoted is least; every eviction must
    take the least recently used fresh checkpoint (else, with none fresh, the least recently used one)."""

    def __init__(self, store: Any) -> None:
        self.store = store
        self.tick = itertools.count(1)
        self.last: dict[tuple, int] = {}
        self.violations: list[str] = []
        get, put, demote, victim = store.get, store.put, store.demote, store.victim

        def audited_get(key: tuple) -> Any:
            ck = get(key)
            if ck is not None:
                self.last[key] = next(self.tick)
            return ck

        def audited_put(key: tuple, ck: Any, *, shared: bool = False) -> int:
            self.last[key] = next(self.tick)
            return put(key, ck, shared=shared)

        def audited_demote(key: tuple) -> None:
            if key in store and not store.is_shared(key):
                self.last[key] = -next(self.tick)  # moved to the front: the latest demotion goes first
            demote(key)

        def audited_victim() -> tuple:
            v = victim()
            keys = list(store)
            fresh = [k for k in keys if not store.is_shared(k)] or keys
            want = min(fresh, key=lambda k: self.last.get(k, 0))
            if v != want and len(self.violations) < 5:
                self.violations.append(
                    f"evicted {self._name(v)} (last used at tick {self.last.get(v)}), not {self._name(want)} "
                    f"(tick {self.last.get(want)})"
                )
            return v

        store.get, store.put, store.demote, store.victim = audited_get, audited_put, audited_demote, audited_victim

    def _name(self, key: tuple) -> str:
        """A short name of a checkpoint key: its page chain's first bytes and its endpoint."""
        ck = self.store._items.get(key)
        return f"{key[0][:4].hex()}..@{ck.endpoint if ck is not None else '?'}"


@dataclass
class RoundResult:
    """What a round found (``problems``) and what it exercised."""

    problems: list[str] = field(default_factory=list)
    steps: int = 0
    preemptions: int = 0
    prefix_hits: int = 0
    branch_checkpoints: int = 0
    verify_rounds: int = 0
    stops: int = 0
    excused: int = 0
    seconds: float = 0.0

    def add(self, other: RoundResult) -> None:
        for f in dataclasses.fields(self):
            if f.name != "problems":
                setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))


def executor_config(leg: Leg) -> Any:
    """The leg's `ExecutorConfig`: prefix caching on (prompt-end and request-end checkpoints too), eager steps."""
    from trtllm_glm.runtime.executor import ExecutorConfig

    return ExecutorConfig(
        tokens_per_block=leg.tokens_per_block,
        max_tokens=leg.pool_tokens,
        max_batch_size=leg.max_batch_size,
        max_num_tokens=max(leg.max_num_tokens, 1 + leg.k),
        max_seq_len=MAX_SEQ_LEN,
        prefill_chunk_size=leg.prefill_chunk_size,
        enable_block_reuse=True,
        checkpoint_interval=leg.checkpoint_interval,
        max_checkpoints=leg.max_checkpoints,
        checkpoint_prompt_end=True,
        checkpoint_request_end=True,
    )


def make_executor(model: Any, leg: Leg, continuations: list[list[int]], rng: random.Random) -> Any:
    """The leg's executor (one process); the oracle replays ``continuations`` (each request's whole reference, so
    that it drafts past a stop token too) with random corruptions."""
    from trtllm_glm.runtime.executor import Executor
    from trtllm_glm.runtime.speculative_executor import SpeculativeExecutor
    from trtllm_glm.speculative.drafters import OracleDrafter

    cfg = executor_config(leg)
    if leg.spec == "plain":
        return Executor(model, cfg)
    drafter = None
    if leg.spec == "oracle":
        # The drafter knows requests by submission index: `drive` submits in arrival order.
        cont = dict(enumerate(continuations))
        wrong = {(i, j) for i in range(len(cont)) for j in range(REF_LEN) if rng.random() > leg.accept}
        drafter = OracleDrafter(cont, lambda i, j: (i, j) in wrong, vocab_size=VOCAB)
    return SpeculativeExecutor(model, cfg, leg.speculative_config(), drafter=drafter)


def drive(ex: Any, mix: list[SoakRequest], max_steps: int = 5000) -> tuple[list[Any], int]:
    """Submit the mix at its arrival steps and step until done; returns the requests (mix order) and the steps."""
    from trtllm_glm.runtime.sampling import SamplingParams

    order = sorted(range(len(mix)), key=lambda i: mix[i].arrival)
    reqs: list[Any] = [None] * len(mix)
    step = 0
    nxt = 0
    while nxt < len(order) or ex.has_work:
        while nxt < len(order) and mix[order[nxt]].arrival <= step:
            i = order[nxt]
            sp = SamplingParams(max_tokens=mix[i].max_tokens, ignore_eos=True, stop_token_ids=mix[i].stop or None)
            reqs[i] = ex.add_request(list(mix[i].prompt), sp)
            nxt += 1
        if ex.has_work:
            ex.step()
        step += 1
        if step > max_steps:
            raise AssertionError(
                f"no end after {max_steps} steps ({len(ex.running)} running, {len(ex.waiting)} waiting)"
            )
    return reqs, step


def check_outputs(mix: list[SoakRequest], reqs: list[Any], res: RoundResult) -> None:
    """Every output equals its reference (a divergence excused only at a near tie, and counted)."""
    for i, (m, r) in enumerate(zip(mix, reqs)):
        d = compare_greedy(m.expected, m.gaps, list(r.output_ids))
        if d is not None and d.excused:
            res.excused += 1
            continue
        if d is not None:
            res.problems.append(f"request {i} (prompt {len(m.prompt)} tokens, max_tokens {m.max_tokens}, stop "
                                f"{m.stop}): {d}; got {list(r.output_ids)}, want {m.expected}")  # fmt: skip
        elif str(r.finish_reason.value if hasattr(r.finish_reason, "value") else r.finish_reason) != m.expected_reason:
            res.problems.append(f"request {i}: finish reason {r.finish_reason}, want {m.expected_reason}")
        res.stops += m.expected_reason == "stop"


def check_engine(ex: Any, reqs: list[Any], audit: StoreAudit | None, res: RoundResult) -> None:
    """The engine after a round: nothing running or held, tail rings never disagreed, checkpoint counters add up."""
    p = res.problems
    if ex.running or ex.waiting:
        p.append(f"{len(ex.running)} running / {len(ex.waiting)} waiting after the round")
    managers = [ex.manager]
    dm = getattr(ex, "separate_draft_manager", None)
    if dm is not None:
        managers.append(dm)
    for name, m in zip(("target", "draft"), managers):
        if m.num_free_pages != m.num_pages:
            p.append(f"{name} manager: {m.num_pages - m.num_free_pages} of {m.num_pages} pages leaked")
        if m.num_free_slots != m.max_num_requests:
            p.append(f"{name} manager: {m.max_num_requests - m.num_free_slots} state slots leaked")
        bad = sum(ring.num_disagreements for ring in m.decode_tail_rings)
        if bad:
            p.append(f"{name} manager: {bad} tail-ring rollbacks disagreed with the scheduler's accepted counts")
    pc = getattr(ex, "prefix", None)
    if pc is not None:
        st, store = pc.stats, pc.store
        items = {k: store._items[k] for k in store}
        if store.nbytes != sum(ck.nbytes for ck in items.values()):
            p.append(f"checkpoint bytes {store.nbytes} != the sum over the store")
        shared = [k for k in items if store.is_shared(k)]
        if store.shared_nbytes != sum(items[k].nbytes for k in shared):
            p.append(f"shared checkpoint bytes {store.shared_nbytes} != the sum over the shared ones")
        if len(items) > store.max_checkpoints or len(items) > st.checkpoints_taken - st.checkpoints_evicted:
            p.append(f"{len(items)} checkpoints held, {st.checkpoints_taken} taken, {st.checkpoints_evicted} evicted")
        if st.hits > st.queries or st.rejected:
            p.append(f"prefix stats inconsistent: {st}")
        if sum(r.num_cached_tokens for r in reqs) > st.reused_tokens:
            p.append(f"requests report more cached tokens than the stats ({st.reused_tokens})")
        if audit is not None and audit.violations:
            p.append("checkpoint eviction not in LRU order: " + "; ".join(audit.violations))
        res.prefix_hits += st.hits
        res.branch_checkpoints += st.branch_checkpoints
    res.preemptions += ex.num_preemptions
    res.verify_rounds += sum(getattr(r, "num_verify_rounds", 0) for r in reqs)


def run_round(model: Any, refs: ReferenceCache, seed: int, rnd: int, leg: Leg) -> RoundResult:
    """One round of ``leg`` in this process."""
    from trtllm_glm.numerics import batch_invariant_mode

    t0 = time.perf_counter()
    pool = prompt_pool(seed, rnd)
    mix = make_mix(round_rng(seed, rnd, "mix"), pool, refs)
    arrival_order = sorted(mix, key=lambda m: m.arrival)  # stable: `drive`'s submission order
    res = RoundResult()
    with batch_invariant_mode(leg.invariant):
        ex = make_executor(model, leg, [refs(m.prompt)[0] for m in arrival_order], round_rng(seed, rnd, "oracle"))
        audit = StoreAudit(ex.prefix.store) if ex.prefix is not None else None
        reqs, res.steps = drive(ex, mix)
    check_outputs(mix, reqs, res)
    check_engine(ex, reqs, audit, res)
    res.seconds = time.perf_counter() - t0
    return res


def run_llm_round(llm: LLM, refs: ReferenceCache, seed: int, rnd: int, name: str) -> RoundResult:
    """Round ``rnd`` of leg ``name`` through a parallel LLM's executor (rank 0's; its calls are mirrored to the
    workers)."""
    t0 = time.perf_counter()
    mix = make_mix(round_rng(seed, rnd, f"{name}:mix"), prompt_pool(seed, rnd), refs)
    res = RoundResult()
    ex = llm.executor
    reqs, res.steps = drive(ex, mix)
    check_outputs(mix, reqs, res)
    check_engine(ex, reqs, None, res)
    res.seconds = time.perf_counter() - t0
    return res


def failure_message(seed: int, rnd: int, leg: str, res: RoundResult, test: str) -> str:
    return (
        f"soak {test}: seed {seed} round {rnd} leg {leg} failed:\n  " + "\n  ".join(res.problems) + "\n"
        f"reproduce: {SEED_ENV}={seed} {ROUND_ENV}={rnd} pytest tests/integration/test_soak.py -k {test}"
    )


# ------------------------------------------------------------------------------------------------
# Parallel legs
# ------------------------------------------------------------------------------------------------
class ModeCheckedLLM(LLM):
    """An `LLM` whose spawned workers refuse to start unless their process-wide batch-invariant mode is the one
    the test expects (``TRTLLM_GLM_SOAK_EXPECT_BATCH_INVARIANT``, inherited by the spawned processes): a worker
    built in another mode would issue other collectives than rank 0 and hang until the process-group timeout."""

    def __init__(self, model: Any, **kwargs: Any) -> None:
        super().__init__(model, **kwargs)
        want = os.environ.get(EXPECT_MODE_ENV)
        if kwargs.get("_spawned_rank") is not None and want is not None and batch_invariant() != (want == "1"):
            rank = kwargs["_spawned_rank"][0]
            raise RuntimeError(
                f"rank {rank} built in batch-invariant mode {batch_invariant()}, rank 0 in {want == '1'}"
            )


def device() -> str:
    """Where the single-process legs run: ``TRTLLM_GLM_SOAK_DEVICE`` (e.g. ``cuda`` for the long soak on a GPU),
    else the CPU. The parallel legs stay on gloo / the CPU."""
    return os.environ.get(DEVICE_ENV) or "cpu"
