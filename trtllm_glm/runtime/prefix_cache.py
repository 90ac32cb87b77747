"""`PrefixCache`: the executor's block reuse and recurrent-state checkpoints (docs/design.md §6.4).

Per step the executor calls ``match`` (waiting requests against stored checkpoints), ``admit`` (share full pages,
copy the partial page, restore the state slot and the drafter's), ``cut`` (prefill chunks end at checkpoint
endpoints: the stride, the last page boundary, branch points) and ``after_step`` (seal final pages, checkpoint at
endpoints). Only committed positions are checkpointed, matched from the next step on; a drafter with per-position
history (MTP) must have caught up to a page's last row before it is sealed or checkpointed. The steps, branch
points and waiting for a leader: docs/architecture.md, "Prefix caching".
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Protocol

import torch

from ..cache.manager import Glm5NextCacheManager
from ..cache.prefix import Checkpoint, CheckpointStore, PrefixStats, chain_key, checkpoint_key, extend_page_keys
from ..errors import CapacityError, StateError
from ..numerics import batch_invariant
from .request import Request
from .scheduler import ScheduledSeq

__all__ = ["PrefixCache", "PrefixHost", "PrefixMatch", "auto_checkpoint_max_bytes"]

log = logging.getLogger(__name__)


@dataclass
class PrefixMatch:
    """A checkpoint found for a waiting request, with the pages it shares."""

    key: tuple
    checkpoint: Checkpoint
    keys: list[bytes]
    pages: list[int]
    draft_pages: list[int]


class PrefixHost(Protocol):
    """What `PrefixCache` needs from its executor (`Executor` provides it; the speculative executor
    overrides the drafter hooks). A protocol here, so that this module never imports the executor."""

    manager: Glm5NextCacheManager

    @property
    def separate_draft_manager(self) -> Glm5NextCacheManager | None: ...

    @property
    def state_reads_next_token(self) -> bool: ...

    def restore_draft(self, req: Request, ck: Checkpoint, draft_pages: list[int]) -> None: ...

    def checkpoint_draft(self, req: Request, ck: Checkpoint) -> None: ...

    def seal_draft_page(self, req: Request, logical_page: int, key: bytes) -> None: ...


def auto_checkpoint_max_bytes(manager: Glm5NextCacheManager, fraction: float = 0.25, per_slot: int = 2) -> int:
    """The default checkpoint byte budget: ``fraction`` of what ``manager`` holds (all pages and state
    slots), and at least ``per_slot`` checkpoints (a state slot plus a partial page each) per state slot,
    so that a full batch of conversations keeps its turns' checkpoints.

    On GLM-5.3-Flash a checkpoint is ~153 MB (34 KDA layers' recurrent + conv state and 11 tail rings): 8
    slots allow ~2.4 GB of checkpoints; on the 4-layer slice ~13.5 MB each (~0.2 GB); on ``small`` ~0.14 MB.
    """
    total = manager.num_pages * manager.bytes_per_page + manager.max_num_requests * manager.state_bytes_per_request
    one = manager.state_bytes_per_request + manager.bytes_per_page
    return max(int(total * fraction), per_slot * manager.max_num_requests * one)


def _prompt_end_min_tokens(prompt_end: bool | int, tokens_per_block: int) -> int | None:
    """`PrefixCache`'s ``prompt_end`` as the shortest prompt that gets a prompt-end checkpoint (None: none does).

    Never below a page: without the next token in its key a checkpoint inside the first page matches every prompt
    that starts with its tokens (a 1-token prompt's: every prompt with that first token), and saves fewer than a
    page of prefill for a whole state-slot copy.
    """
    if isinstance(prompt_end, bool):
        return tokens_per_block if prompt_end else None
    if not isinstance(prompt_end, int) or prompt_end <= 0:
        raise ValueError(f"prompt_end must be True, False or a positive int (prompt tokens), got {prompt_end!r}")
    return max(prompt_end, tokens_per_block)


class PrefixCache:
    """Block reuse for one executor.

    Args:
        executor: the executor (its managers and drafter hooks).
        checkpoint_interval: prompt tokens between checkpoints (``None``: only the last page boundary
            before the prompt's end).
        last_page: also cut a prompt's last chunk at its last page boundary (a checkpoint there serves the next
            request that repeats the prompt, at the cost of one more prefill step for every prompt; off, a repeat
            finds the pages sealed and checkpoints there as a branch point: the repeats after it resume).
        prompt_end: also checkpoint where a prompt's prefill ends (keyed with the first output token), so
            that a follow-up turn that repeats the prompt and the answer reuses the whole prompt: ``True`` for
            prompts of at least a page, an int ``n`` for prompts of at least ``n`` tokens (and a page), ``False``
            for none (`KvCacheConfig.checkpoint_prompt_end_min_tokens` says why a minimum).
        branch_points: checkpoint at branch points (see the module docstring).
        wait_for_leader: hold a waiting request while a running one prefills the pages they share (`match`).
        request_end: also checkpoint each request where it ends (`at_finish`; the next turn reuses the answer).
        max_checkpoints: checkpoint count budget (LRU).
        max_bytes: checkpoint byte budget (LRU; ``None``: count only; ``"auto"``: `auto_checkpoint_max_bytes`).
    """

    def __init__(
        self,
        executor: PrefixHost,
        *,
        checkpoint_interval: int | None,
        prompt_end: bool | int = False,
        last_page: bool = False,
        branch_points: bool = True,
        wait_for_leader: bool = True,
        request_end: bool = False,
        max_checkpoints: int,
        max_bytes: int | str | None,
    ) -> None:
        if checkpoint_interval is not None and checkpoint_interval <= 0:
            raise ValueError(f"checkpoint_interval must be positive, got {checkpoint_interval}")
        if max_checkpoints <= 0:
            log.warning("prefix caching is on but max_checkpoints=%d: no prefix can ever be reused", max_checkpoints)
        self.ex = executor
        self.tokens_per_block = executor.manager.tokens_per_block
        self.interval = checkpoint_interval
        # The shortest prompt that gets a prompt-end checkpoint (None: none does).
        self.prompt_end_min_tokens = _prompt_end_min_tokens(prompt_end, self.tokens_per_block)
        self.last_page = last_page
        self.branch_points = branch_points
        if max_bytes == "auto":
            max_bytes = auto_checkpoint_max_bytes(executor.manager)
        elif isinstance(max_bytes, str) or (max_bytes is not None and max_bytes <= 0):
            raise ValueError(f"checkpoint max_bytes must be a positive int, None or 'auto', got {max_bytes!r}")
        # Branch point per request (request id -> endpoint), set by `match`, dropped once the request passed it.
        # Kept without ``branch_points`` too, to count the reuse lost (`endpoints` ignores it then).
        self.wait_for_leader = wait_for_leader
        self.request_end = request_end
        # Endpoints given to a leader by the requests waiting for it (request id -> endpoints), the
        # requests held this step.
        self._leads: dict[int, set[int]] = {}
        self._held: set[int] = set()
        # Per running request, its own prompt-end / last-page checkpoints (dropped once its request-end one
        # is taken, unless they served a hit meanwhile).
        self._own: dict[int, list[tuple]] = {}
        self._branch: dict[int, int] = {}
        self.store = CheckpointStore(max_checkpoints=max_checkpoints, max_bytes=max_bytes)
        self.stats = PrefixStats()
        self._warned_short = False
        self._warned_oom = False

    def _keys(self, keys: list[bytes], tokens: list[int], limit: int | None = None) -> list[bytes]:
        """`extend_page_keys` with this executor's page content rule (`PrefixHost.state_reads_next_token`)."""
        return extend_page_keys(keys, tokens, self.tokens_per_block, limit, self.ex.state_reads_next_token)

    @property
    def manager(self) -> Glm5NextCacheManager:
        return self.ex.manager

    @property
    def max_bytes(self) -> int | None:
        """The checkpoint byte budget in force."""
        return self.store.max_bytes

    # --------------------------------------------------------------------------------------------
    # Policy
    def endpoints(self, r: Request) -> list[int]:
        """Checkpoint endpoints of ``r``'s prompt, ascending (each leaves at least one prompt row to compute)."""
        last = len(r.prompt_ids) - 1
        out = set()
        if last >= self.tokens_per_block:
            out.add(last // self.tokens_per_block * self.tokens_per_block)
        if self.interval is not None:
            out.update(range(self.interval, last + 1, self.interval))
        b = self._branch.get(r.request_id) if self.branch_points else None
        if b is not None and b <= last:
            out.add(b)
        out.update(e for e in self._leads.get(r.request_id, ()) if e <= last)
        if not out and not self.prompt_end_at(len(r.prompt_ids)) and not self._warned_short:
            self._warned_short = True
            log.debug(
                "prefix caching: a prompt of %d tokens gets no checkpoint (prompts need more than "
                "tokens_per_block=%d tokens, or set checkpoint_interval; prompt-end checkpoints: %s); a later "
                "request repeating it recomputes it (a next turn may resume at its request-end checkpoint)",
                len(r.prompt_ids), self.tokens_per_block,
                "off" if self.prompt_end_min_tokens is None else f"from {self.prompt_end_min_tokens} tokens",
            )  # fmt: skip
        return sorted(out)

    def prompt_end_at(self, prompt_len: int) -> bool:
        """Whether a prompt of ``prompt_len`` tokens gets a checkpoint where its prefill ends."""
        return self.prompt_end_min_tokens is not None and prompt_len >= self.prompt_end_min_tokens

    @staticmethod
    def eligible(r: Request) -> bool:
        """Whether ``r`` may skip prompt rows (context logits and prompt logprobs need every row computed)."""
        return not (r.params.return_context_logits or r.params.prompt_logprobs is not None)

    # --------------------------------------------------------------------------------------------
    # Lookup and admission
    def match(self, waiting: list[Request], live: Iterable[Request] = ()) -> None:
        """Find a checkpoint for each waiting request that starts from scratch; plan it from there.

        A request whose prompt matches sealed pages further than its checkpoint reaches gets a branch point
        at the last matching page boundary (`endpoints` includes it). With ``wait_for_leader``, a request
        whose prompt shares full pages with a running request still prefilling them (its *leader*) further
        than anything cached reaches waits (`admissible` leaves it out) while the leader checkpoints where
        their prompts part, and restores that checkpoint afterwards (requests sent together reuse too).

        Args:
            waiting: the waiting requests, in arrival order.
            live: the running requests (leaders; branch points of requests that left are forgotten).
        """
        live = list(live)
        keep = {r.request_id for r in waiting} | {r.request_id for r in live}
        if self._branch:
            self._branch = {k: v for k, v in self._branch.items() if k in keep}
        for d in (self._leads, self._own):
            for k in [k for k in d if k not in keep]:
                del d[k]
        self._held.clear()
        ahead = self._inflight_pages(live) if self.wait_for_leader else {}
        P = self.tokens_per_block
        for r in waiting:
            if r.prefix_hit is not None or r.num_computed or not self.eligible(r):
                continue
            m, reach = self._lookup(r)
            start = m.checkpoint.endpoint if m is not None else 0
            last = len(r.prompt_ids) - 1
            if ahead and self._wait(r, ahead, start, last // P * P):
                continue
            if m is not None:
                r.prefix_hit = m
                r.num_computed = start
            # The branch point: the sealed pages' reach, if no checkpoint gets there (a prompt row must remain).
            b = min(reach, last // P * P)
            if b > r.num_computed:
                self._branch[r.request_id] = b  # (counted as lost reuse even when branch points are off)
            else:
                self._branch.pop(r.request_id, None)

    def _inflight_pages(self, live: list[Request]) -> dict[bytes, Request]:
        """Page key -> the running request whose prompt has that page and is still prefilling it (the oldest)."""
        out: dict[bytes, Request] = {}
        for r in live:
            if r.num_computed >= len(r.prompt_ids) - 1 or not self.eligible(r):
                continue
            # The request's own key cache (its prompt's pages have the same keys over its prompt or its tokens).
            n = (len(r.prompt_ids) - int(self.ex.state_reads_next_token)) // self.tokens_per_block
            keys = self._keys(r.page_keys, r.prompt_ids)
            for k in keys[r.num_computed // self.tokens_per_block : n]:
                out.setdefault(k, r)
        return out

    def _wait(self, r: Request, ahead: dict[bytes, Request], have: int, limit: int) -> bool:
        """Hold ``r`` (and give its leader an endpoint) if a leader's prefill will reach past ``have``."""
        keys = self._keys(r.page_keys, r.tokens)
        j = next((j for j in range(len(keys) - 1, -1, -1) if keys[j] in ahead), -1)
        if j < 0:
            return False
        b = min((j + 1) * self.tokens_per_block, limit)
        lead = ahead[keys[j]]
        if b < have + self.tokens_per_block or lead.num_computed >= b:
            return False
        self._held.add(r.request_id)
        self._leads.setdefault(lead.request_id, set()).add(b)
        self.stats.held += 1
        return True

    def admissible(self, waiting: Iterable[Request]) -> list[Request]:
        """The waiting requests that may be admitted this step (in order): those not waiting for a leader."""
        return [r for r in waiting if r.request_id not in self._held]

    def _grid(self) -> int | None:
        """The batch-invariant mode's chunk grid (`Scheduler.invariant_chunk`), ``None`` outside the mode.

        In the mode a checkpoint is resumed, and a chunk cut at an endpoint, only on the grid: there the
        recomputation of the prompt has a chunk boundary too, so a restored state has the bits recomputing gives.
        """
        sched = getattr(self.ex, "scheduler", None)
        return sched.invariant_chunk if batch_invariant() and sched is not None else None

    def _lookup(self, r: Request) -> tuple[PrefixMatch | None, int]:
        """The best usable checkpoint for ``r`` (or None) and how far its sealed pages reach (tokens)."""
        P, toks = self.tokens_per_block, r.tokens
        grid = self._grid()
        keys = self._keys(r.page_keys, toks)
        pages = self.manager.lookup_pages(keys)
        dm = self.ex.separate_draft_manager
        draft_pages = dm.lookup_pages(keys) if dm is not None else None
        k_max = len(pages) if draft_pages is None else min(len(pages), len(draft_pages))
        reach = k_max * P
        nxt = int(self.ex.state_reads_next_token)  # the key's tail holds token E too (`checkpoint_key`)
        for k in range(k_max, -1, -1):
            best: tuple[int, tuple] | None = None
            for key in self.store.candidates(chain_key(keys, k)):
                tail = key[1]
                E = k * P + len(tail) - nxt
                if grid is not None and E % grid:
                    continue
                if len(toks) > E and tuple(toks[k * P : E + nxt]) == tail and (best is None or best[0] < E):
                    best = (E, key)
            if best is None:
                continue
            E, key = best
            ck = self.store.get(key)
            if ck is None or not self._valid(ck, E, keys[:k]):
                self.store.discard(key)
                self.stats.rejected += 1
                continue
            dp = list(draft_pages[:k]) if draft_pages is not None else []
            return PrefixMatch(key, ck, list(keys[:k]), pages[:k], dp), reach
        return None, reach

    def _valid(self, ck: Checkpoint, endpoint: int, keys: list[bytes]) -> bool:
        """Whether ``ck`` restores a request at ``endpoint`` over pages ``keys`` (validated before planning)."""
        if ck.endpoint != endpoint or ck.page_keys != tuple(keys):
            return False
        if (endpoint % self.tokens_per_block != 0) != (ck.target_partial is not None):
            return False
        try:
            self.manager.state.check_snapshot(ck.target, endpoint)
            dm = self.ex.separate_draft_manager
            if (dm is None) != (ck.draft is None):
                return False
            if dm is not None and ck.draft is not None:
                dm.state.check_snapshot(ck.draft, endpoint)
        except StateError:
            return False
        return True

    def admit(self, r: Request, num_tokens: int, fresh: list[int] | None = None) -> None:
        """Add ``r`` to the cache manager for ``num_tokens`` tokens, restoring its match if it has one.

        ``fresh``: without a match, the request's state slot is appended there unzeroed for the caller to zero
        (`Glm5NextCacheManager.reset_state_slots`); None zeroes it now.

        Raises:
            CapacityError: no room, or a page of the match was reclaimed since `match` (nothing is taken
                then; the request waits and is matched again at the next step).
        """
        m: PrefixMatch | None = r.prefix_hit
        mgr = self.manager
        if m is None:
            slot = mgr.add_request(r.request_id, num_tokens, reset=fresh is None)
            if fresh is not None:
                fresh.append(slot)
            return
        # An allocation earlier in this planning round (a running request growing, another admission) may
        # have reclaimed a cached page of the match: then it cannot be admitted from the match now. The
        # caller treats this like a full cache (the request waits; the next step matches it afresh).
        dm = self.ex.separate_draft_manager
        if mgr.lookup_pages(m.keys) != m.pages or (dm is not None and dm.lookup_pages(m.keys) != m.draft_pages):
            raise CapacityError(f"request {r.request_id}: pages of its prefix match were reclaimed")
        ck = m.checkpoint
        mgr.add_request(r.request_id, num_tokens, shared_pages=m.pages)
        try:
            mgr.state.restore(mgr.get_state_slot(r.request_id), ck.target, endpoint=ck.endpoint)
            k = len(m.pages)
            if ck.target_partial is not None:
                mgr.copy_page_in(mgr.get_batch_slot_tables([r.request_id])[0][k], ck.target_partial)
            self.ex.restore_draft(r, ck, m.draft_pages)
        except BaseException:
            mgr.free_request(r.request_id)
            raise

    def admitted(self, r: Request) -> None:
        """Count ``r``'s admission (queries, hits, reused tokens, and the reuse lost at a branch point)."""
        if not self.eligible(r):
            return
        st = self.stats
        st.queries += 1
        start = 0
        if r.prefix_hit is not None:
            start = r.prefix_hit.checkpoint.endpoint
            st.hits += 1
            st.reused_tokens += start
            r.num_cached_tokens = start
        b = self._branch.get(r.request_id)
        if b is not None and b > start:
            # Sealed pages reach ``b`` but no checkpoint does: rows ``start .. b`` are recomputed.
            st.lost_requests += 1
            st.lost_tokens += b - start
        r.prefix_hit = None

    def unmatch(self, r: Request) -> None:
        """Forget a match of a request that was not admitted this step (it starts from scratch again)."""
        self._branch.pop(r.request_id, None)
        if r.prefix_hit is not None:
            r.prefix_hit = None
            r.num_computed = 0

    # --------------------------------------------------------------------------------------------
    # Chunks, seals and checkpoints
    def cut(self, plan: list[ScheduledSeq]) -> list[ScheduledSeq]:
        """End every prefill chunk at the next checkpoint endpoint inside it.

        A chunk that ends the prompt is cut only where another request needs the checkpoint: at the request's
        branch point or where a request waiting for it (`match`) resumes. A stride endpoint (a multiple of
        ``checkpoint_interval``) does not cut it when it is no longer than the stride, and the last page boundary
        does not cut it unless ``last_page`` is set: each cut adds an eager step to the request's time to first
        token (two steps for every prompt longer than a page), while the checkpoint serves only a later request
        that repeats the prompt, which a branch point covers from the second repeat on.
        """
        grid = self._grid()
        for s in plan:
            if s.is_decode:
                continue
            r = s.request
            n0, end = r.num_computed, r.num_computed + s.num_rows
            final = end >= len(r.prompt_ids)
            for e in self.endpoints(r):
                if e <= n0 or e >= end or (grid is not None and e % grid):
                    continue
                if final and self._lazy(r, e, s.num_rows):
                    continue
                s.num_rows = e - n0
                break
        return plan

    def _lazy(self, r: Request, e: int, rows: int) -> bool:
        """Whether endpoint ``e`` of ``r`` may be left out of a ``rows``-row chunk that ends the prompt: it is
        there for the stride (and the chunk is no longer than it) or for the last page (unless ``last_page``)."""
        if e == self._branch.get(r.request_id) or e in self._leads.get(r.request_id, ()):
            return False
        if e == (len(r.prompt_ids) - 1) // self.tokens_per_block * self.tokens_per_block:
            return not self.last_page
        return self.interval is not None and e % self.interval == 0 and rows <= self.interval

    def after_step(self, plan: list[ScheduledSeq], history: Callable[[Request], int]) -> None:
        """Seal pages that became final and take the checkpoints this step reached.

        Args:
            plan: the step's sequences.
            history: per request, how many positions the drafter's per-position cache covers (the
                request's computed length when the drafter keeps none).
        """
        P = self.tokens_per_block
        for s in plan:
            r = s.request
            if r.finished or not self.manager.has_request(r.request_id):
                continue
            done = min(r.num_computed, history(r))
            keys = self._keys(r.page_keys, r.tokens, done // P)
            n_final = min(len(keys), done // P)
            # Only pages that became final since the last step: this runs for every sequence every step.
            for j in range(r.pages_sealed, n_final):
                self.manager.seal_page(r.request_id, j, keys[j])
                self.ex.seal_draft_page(r, j, keys[j])
            r.pages_sealed = max(r.pages_sealed, n_final)
            E = r.num_computed
            # A short prompt gets no prompt-end checkpoint (`prompt_end_at`): a whole state-slot copy and its share
            # of the byte budget for a few tokens of prefill (`KvCacheConfig.checkpoint_prompt_end_min_tokens`).
            at_end = len(r.prompt_ids) == E and self.prompt_end_at(E)
            if s.is_decode or done < E or not (at_end or (len(r.prompt_ids) > E and E in self.endpoints(r))):
                continue
            if n_final < E // P:
                continue  # a full page is not sealable yet (cannot happen: E < len(tokens))
            key = checkpoint_key(keys, r.tokens, E, P, self.ex.state_reads_next_token)
            branch = self.branch_points and self._branch.get(r.request_id) == E
            if branch:
                del self._branch[r.request_id]
            lead = E in self._leads.get(r.request_id, ())  # requests wait for this one: shared, like a branch
            if key in self.store:
                continue
            if self._take(r, key, keys[: E // P], shared=branch or lead):
                self.stats.branch_checkpoints += int(branch)
                last_page = (len(r.prompt_ids) - 1) // P * P
                if self.request_end and not (branch or lead) and (at_end or last_page == E):
                    self._own.setdefault(r.request_id, []).append(key)  # superseded by its request-end one

    def at_finish(self, r: Request, history: Callable[[Request], int]) -> None:
        """Checkpoint a request that just finished at its whole sequence (``request_end``), before it is freed.

        The next turn of a conversation (this prompt + the answer + more) then resumes after the answer.
        The caller guarantees the step is committed and no step launched ahead wrote the slot; a slot that
        is not at the request's committed length (pending records, a drafter behind it: MTP catches up
        after finishing) is skipped, never checkpointed wrongly.
        """
        if not self.request_end or not self.eligible(r) or not self.manager.has_request(r.request_id):
            return
        P, E = self.tokens_per_block, r.num_computed
        if E < P or len(r.tokens) <= E or history(r) < E:
            return  # (a sequence shorter than a page: see `_prompt_end_min_tokens`)
        keys = self._keys(r.page_keys, r.tokens, E // P)
        if len(keys) < E // P:
            return
        for j in range(r.pages_sealed, E // P):
            self.manager.seal_page(r.request_id, j, keys[j])
            self.ex.seal_draft_page(r, j, keys[j])
        r.pages_sealed = max(r.pages_sealed, E // P)
        key = checkpoint_key(keys, r.tokens, E, P, self.ex.state_reads_next_token)
        # Its own prompt-end and last-page checkpoints that nobody used give way to this one: demoted to be
        # evicted first, so that they do not push other conversations' out (the next turn of a conversation
        # resumes here), yet still serve a request that shares the prompt and branches before its end (a
        # second question after the same system prompt) while the budget has room for them.
        for k in self._own.pop(r.request_id, ()):
            if k in self.store and not self.store.is_shared(k):
                self.store.demote(k)
                self.stats.checkpoints_superseded += 1
        if key in self.store:
            return
        try:
            self._take(r, key, keys[: E // P])
        except StateError:
            self.stats.checkpoints_skipped += 1

    def _take(self, r: Request, key: tuple, keys: list[bytes], *, shared: bool = False) -> bool:
        """Checkpoint ``r`` at its computed length under ``key``; returns whether it was stored.

        ``shared``: a branch point's (a prefix two requests already shared: the store keeps it longer)."""
        mgr, P, E = self.manager, self.tokens_per_block, r.num_computed
        if self.store.max_checkpoints <= 0:
            self.stats.checkpoints_skipped += 1  # checkpoints disabled: no copy to make
            return False
        k = E // P
        pages = mgr.get_batch_slot_tables([r.request_id])[0]
        try:
            ck = Checkpoint(
                endpoint=E,
                page_keys=tuple(keys),
                target=mgr.state.snapshot(mgr.get_state_slot(r.request_id), E),
                target_partial=mgr.copy_page_out(pages[k]) if E % P else None,
            )
            self.ex.checkpoint_draft(r, ck)
        except torch.OutOfMemoryError:
            # Checkpoints are an optimisation: without room for one, drop the oldest and serve on.
            self.stats.checkpoints_skipped += 1
            if len(self.store):
                self.store.discard(self.store.victim())
                self.stats.checkpoints_evicted += 1
            if not self._warned_oom:
                self._warned_oom = True
                log.warning(
                    "prefix caching: out of device memory for a checkpoint (%d held, %.1f MB); skipped. Set "
                    "KvCacheConfig.checkpoint_max_bytes to bound them", len(self.store), self.store.nbytes / 1e6,
                )  # fmt: skip
            return False
        if not self.store.fits(ck):
            # Larger than the whole byte budget (or checkpoints disabled): skipped and counted, never an error.
            self.stats.checkpoints_skipped += 1
            return False
        self.stats.checkpoints_evicted += self.store.put(key, ck, shared=shared)
        self.stats.checkpoints_taken += 1
        return True
