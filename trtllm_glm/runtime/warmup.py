"""Start-up warm-up: run every kind of step a served batch can take, so that no kernel compiles while serving.

Triton compiles on each new specialisation; CUDA graphs cover the captured decode / verify steps and `warm_up` the
rest through the executor itself: prefill widths on a length ladder (`length_ladder`), the same beside a decoding
request, sequence counts up to ``max_batch_size``, prompts the step budget cuts beside decoding requests, contexts up
to ``max_seq_len``, sampling and logprobs, the greedy kernels with and without a grammar mask (`warm_up_greedy`);
piecewise segment graphs first. Prefix caching stays on
(its chunk cuts and restores are served steps: on an H100 the KDA conv's continued-chunk kernels compiled while
serving without them); afterwards the prefix cache starts empty and the step counters are restored.
`WarmupReport.compiles` counts compilations (0 on the CPU). docs/serving.md, "Defaults that fit serving".
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from ..jit_compiles import CompileCounter
from ..logits import warm_up_greedy
from .sampling import SamplingParams

if TYPE_CHECKING:
    from .executor import Executor

__all__ = ["WarmupReport", "warm_up", "length_ladder"]

log = logging.getLogger("trtllm_glm")


def length_ladder(n_max: int) -> list[int]:
    """Row counts that meet every specialisation a kernel can take from a count up to ``n_max``. Triton specialises
    an integer argument on being 1 and on being a multiple of 16, and kernels choose block sizes from
    ``next_power_of_2``: each power of two ``p`` (a multiple of 16 from 16 on) and ``p - 1`` (not one) share that
    bucket, so the pairs ``(p - 1, p)`` with 1 and ``n_max`` cover them all."""
    if n_max < 1:
        return []
    out = {1, n_max}
    p = 2
    while p <= n_max:
        out.update((p - 1, p))
        p *= 2
    if p // 2 < n_max:
        out.add(n_max)  # the last bucket (n_max itself is in it; add a multiple of 16 below it too)
        out.add(max(1, n_max // 16 * 16))
    return sorted(out)


@dataclass
class WarmupReport:
    """What the warm-up ran.

    Attributes:
        requests: synthetic requests run.
        steps: executor steps.
        seconds: wall time.
        compiles: Triton kernels compiled during it (one per new specialisation).
        kernels: their names (qualified, with the specialisation), in order.
        skipped: phases left out for the time limit.
    """

    requests: int = 0
    steps: int = 0
    seconds: float = 0.0
    compiles: int = 0
    kernels: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)

    def describe(self) -> str:
        """One start-up log line."""
        s = (
            f"warm-up: {self.requests} requests, {self.steps} steps in {self.seconds:.1f} s, "
            f"{self.compiles} kernels compiled"
        )
        return s + (f" (skipped for time: {', '.join(self.skipped)})" if self.skipped else "")


def warm_up(ex: Executor, *, time_limit_s: float = 600.0, seed: int = 0) -> WarmupReport:
    """Run the synthetic workload of the module docstring through ``ex`` and restore its counters.

    Args:
        ex: an idle executor (no request waiting or running).
        time_limit_s: phases not started by then are skipped (and named in the report).
        seed: seed of the synthetic prompts and samples.

    Returns:
        The `WarmupReport`.

    Raises:
        RuntimeError: ``ex`` has requests.
    """
    if ex.has_work:
        raise RuntimeError("warm_up needs an idle executor (requests are waiting or running)")
    rep = WarmupReport()
    t0 = time.perf_counter()
    gen = torch.Generator().manual_seed(seed)
    vocab = ex.config.vocab_size
    N, B, S = ex.cfg.max_num_tokens, ex.cfg.max_batch_size, ex.max_seq_len
    counters = {k: getattr(ex, k) for k in ("num_steps", "num_preemptions", "num_overlapped_steps")}
    spec_counters = {k: getattr(ex, k) for k in ("num_unspeculated_rounds",) if hasattr(ex, k)}
    runner = ex.graph_runner
    eager0 = runner.stats.eager_steps if runner is not None else 0
    replays0 = runner.stats.replays if runner is not None else 0
    pw_fields = (
        "steps", "eager_steps", "replays", "eager_segments", "kda_steps", "trunk_steps", "eager_cores", "warm_runs"
    )  # fmt: skip
    pw0 = {k: getattr(ex.piecewise.stats, k) for k in pw_fields} if ex.piecewise is not None else {}

    def prompt(n: int) -> list[int]:
        return torch.randint(0, vocab, (n,), generator=gen).tolist()

    def greedy(n: int) -> SamplingParams:
        return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)

    def run() -> None:
        while ex.has_work:
            ex.step()
            rep.steps += 1

    def add(n: int, params: SamplingParams) -> None:
        ex.add_request(prompt(n), params)
        rep.requests += 1

    def phase_alone() -> None:
        for n in length_ladder(min(N, S - 2)):
            add(n, greedy(2))
            run()

    def phase_mixed() -> None:
        lens = length_ladder(min(N - 1, S - 2))
        if not lens:
            return
        add(1, greedy(min(len(lens) * 3 + 2, S - 2)))  # decodes beside every chunk below
        ex.step()
        rep.steps += 1
        for n in lens:
            add(n, greedy(1))
            ex.step()  # the decode row and the new prompt's chunk in one step
            rep.steps += 1
        run()

    def counts_prompts(n: int, aligned: bool) -> list[int]:
        """``n`` short prompt lengths whose total is a multiple of 16 (``aligned``) or not (kernels specialise on
        the step's row count and sequence count together: each count bucket meets both kinds of total)."""
        lens = [1 + i % 8 for i in range(n)]
        r = sum(lens) % 16
        if aligned and r:
            lens[-1] += 16 - r
        elif not aligned and not r:
            lens[-1] += 1
        return [min(x, S - 2) for x in lens]

    def phase_batch() -> None:
        # Steps of every sequence count (kernels take block sizes from it, e.g. the KDA conv's log2 of the count):
        # n short prompts prefilled together and decoded together, for n on the ladder up to the batch, with row
        # totals that are and are not multiples of 16.
        for n in length_ladder(B):
            for aligned in (True, False):
                for m in counts_prompts(n, aligned):
                    add(m, greedy(3))
                run()
        # Full-budget steps split over n sequences (block sizes chosen from the rows and the count together).
        for n in length_ladder(min(B, N)):
            per = max(1, min(N // n, S - 2))
            for i in range(n):
                add(per - (i == n - 1 and per > 1), greedy(2))
            run()
        # ... and beside a decoding request (mixed steps of n + 1 sequences).
        lens = length_ladder(B - 1)
        if lens:
            add(1, greedy(min(len(lens) * 6 + 2, S - 2)))
            ex.step()
            rep.steps += 1
            for n in lens:
                for aligned in (True, False):
                    for m in counts_prompts(n, not aligned):  # + the decode row: the other parity of the total
                        add(m, greedy(1))
                    ex.step()
                    rep.steps += 1
            run()

    def beside_decoders(d: int, waves: list[list[int]]) -> None:
        """``d`` decoding requests; each wave's prompts (their lengths) admitted beside them until every one of
        them has its first token, then aborted; then the decoders."""
        decoders = [ex.add_request(prompt(2), greedy(max(1, S - 4))) for _ in range(d)]
        rep.requests += d
        while any(r.num_output == 0 for r in decoders):
            ex.step()
            rep.steps += 1
        for lens in waves:
            new = [ex.add_request(prompt(m), greedy(2)) for m in lens]
            rep.requests += len(lens)
            while any(r.num_output == 0 for r in new):
                ex.step()
                rep.steps += 1
            for r in new:
                ex.abort_request(r.request_id)
        for r in decoders:
            ex.abort_request(r.request_id)
        run()

    def phase_mixed_counts() -> None:
        # A served batch admits arrivals beside many decoding requests: kernels specialise on the decode and the
        # prefill sequence counts (and the row total) together, which the phases above meet beside one decoding
        # request only (H100: a kernel compiled at concurrency 64 after the phases above, a 7 s stall).
        for d in length_ladder(B - 1):
            beside_decoders(d, [counts_prompts(p, aligned=p % 2 == 0) for p in (1, 2, 15, 16) if d + p <= B])

    def phase_budget_cuts() -> None:
        # Long prompts arriving beside decoding requests overflow the step's budget: it cuts the last one, whose
        # continued chunk runs in the next step beside the decoders and the next fresh prompts. Kernels specialise
        # on fresh and continued sequences together with the decode and prefill counts (H100: 1K-token prompts at
        # concurrency 16 compiled the KDA conv's prefill and the MoE's kernels while serving after the phases above).
        for d in length_ladder(B - 1):
            room = min(B - d, N - d)
            # 1.5 budgets over p prompts: one is always cut.
            waves = [[min(S - 2, -(-3 * (N - d) // (2 * p)))] * p for p in sorted({1, 2, room}) if 1 <= p <= room]
            if waves:
                beside_decoders(d, waves)

    def phase_contexts() -> None:
        p = 1 << max(N, 1).bit_length()
        while p + 1 <= S - 2:
            add(p + 1, greedy(2))
            run()
            p *= 2
        if S - 2 > N:
            add(S - 2, greedy(1))
            run()

    def phase_sampling() -> None:
        for i, extra in enumerate(({"top_p": 0.9}, {"top_k": 8}, {"logprobs": 2}, {})):
            add(3 + i, SamplingParams(max_tokens=3, temperature=0.7, seed=seed + i, ignore_eos=True, **extra))
        run()

    def phase_greedy_rows() -> None:
        # The greedy kernels at every row count's variant, with and without a grammar's mask: a grammar step picks
        # among its masked rows (any count up to a step's rows) outside the graphs.
        warm_up_greedy(ex.model.config.vocab_size, ex.cfg.max_num_tokens, ex.device)

    phases = [("prefill widths", phase_alone), ("mixed steps", phase_mixed), ("full batch", phase_batch),
              ("decoding batch admits", phase_mixed_counts), ("budget cuts", phase_budget_cuts),
              ("contexts", phase_contexts),
              ("sampling", phase_sampling), ("greedy rows", phase_greedy_rows)]  # fmt: skip
    if ex.piecewise is not None:
        # Every bucket a served eager step can take (a lazy capture would stall the step that first needs it).
        ex.piecewise.capture_all(manager=ex.manager, meta=ex.meta)
    try:
        # No inference_mode here: buffers the executor allocates lazily in its first steps (pinned read-back
        # buffers) would become inference tensors that later steps, outside the mode, cannot write.
        with CompileCounter() as cc:
            for name, fn in phases:
                if time.perf_counter() - t0 > time_limit_s:
                    rep.skipped.append(name)
                    continue
                fn()
            if ex.piecewise is not None:
                # With piecewise graphs, the phases' admissions replay trunk graphs, but a served step that does not
                # qualify (a chunk over the short-prefill limit, a bucket over the KDA cap) runs its cores eagerly,
                # at kernel variants those graphs never compiled (H200: the sparse top-k compiled at concurrency 64
                # while serving). The step shapes again with the eager cores.
                pw, ex.piecewise = ex.piecewise, None
                try:
                    for name, fn in phases[:5]:
                        if time.perf_counter() - t0 > time_limit_s:
                            rep.skipped.append(f"{name} (eager cores)")
                            continue
                        fn()
                finally:
                    ex.piecewise = pw
        rep.compiles, rep.kernels = cc.count, list(cc.names)
    finally:
        # Whatever happened, hand the executor back idle and as it was built.
        for r in list(ex.waiting) + list(ex.running):
            ex.abort_request(r.request_id)
        if ex.prefix is not None:
            # The synthetic prompts' pages and checkpoints go: a fresh cache, sealed pages back to the free lists.
            ex.prefix = ex.new_prefix_cache()
            ex.manager.drop_cached_pages()
            if ex.separate_draft_manager is not None:
                ex.separate_draft_manager.drop_cached_pages()
        for k, v in {**counters, **spec_counters}.items():
            setattr(ex, k, v)
        if runner is not None:
            runner.stats.eager_steps, runner.stats.replays = eager0, replays0
        if ex.piecewise is not None:  # (its captures, capture time and memory stay counted)
            for k, v in pw0.items():
                setattr(ex.piecewise.stats, k, v)
        policy = getattr(ex, "draft_policy", None)
        if policy is not None:
            # The adaptive draft length starts afresh: the warm-up's rounds were timed with compiles in them and
            # accepted random prompts' drafts, neither of which says anything about served requests.
            ex.draft_policy = dataclasses.replace(policy, chosen=[], counts={})
            ex._next_k = ex._carry_k = None
    rep.seconds = time.perf_counter() - t0
    log.info("%s", rep.describe())
    return rep
