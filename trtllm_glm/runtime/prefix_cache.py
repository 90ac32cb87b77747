"""`PrefixCache`: the executor's block reuse and recurrent-state checkpoints (docs/design.md §6.4).

Per step the executor asks it to

1. ``match`` waiting requests against stored checkpoints (the longest endpoint ``E <= len(tokens) - 1``
   whose tokens ``0..E`` match and whose full pages are all still cached), so the scheduler plans their
   rows from ``E``;
2. ``admit`` a matched request: share its full pages, copy its partial page, restore its state slot
   (and the drafter's) byte for byte;
3. ``cut`` prefill chunks so that they end at checkpoint endpoints (every ``checkpoint_interval`` prompt
   tokens, and the last page boundary before the prompt's end);
4. ``after_step``: seal pages whose content became final, and take a checkpoint where a prefill chunk
   ended at an endpoint.

Only committed positions are checkpointed (a step's end, records folded); a checkpoint taken in a step
is matched from the next step on. A drafter that keeps per-position history (MTP) must have caught up
to a page's last row before the page is sealed or a checkpoint is taken there.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ..cache.manager import Glm5NextCacheManager
from ..cache.prefix import Checkpoint, CheckpointStore, PrefixStats, chain_key, checkpoint_key, extend_page_keys
from ..errors import CapacityError, StateError
from .request import Request
from .scheduler import ScheduledSeq

if TYPE_CHECKING:
    from .executor import Executor

__all__ = ["PrefixCache", "PrefixMatch"]

log = logging.getLogger(__name__)


@dataclass
class PrefixMatch:
    """A checkpoint found for a waiting request, with the pages it shares."""

    key: tuple
    checkpoint: Checkpoint
    keys: list[bytes]
    pages: list[int]
    draft_pages: list[int]


class PrefixCache:
    """Block reuse for one executor.

    Args:
        executor: the executor (its managers, requests and drafter hooks).
        checkpoint_interval: prompt tokens between checkpoints (``None``: only the last page boundary
            before the prompt's end).
        prompt_end: also checkpoint where a prompt's prefill ends (keyed with the first output token), so
            that a follow-up turn that repeats the prompt and the answer reuses the whole prompt.
        max_checkpoints: checkpoint count budget (LRU).
        max_bytes: checkpoint byte budget (LRU; ``None``: count only).
    """

    def __init__(
        self,
        executor: Executor,
        *,
        checkpoint_interval: int | None,
        prompt_end: bool = False,
        max_checkpoints: int,
        max_bytes: int | None,
    ) -> None:
        if checkpoint_interval is not None and checkpoint_interval <= 0:
            raise ValueError(f"checkpoint_interval must be positive, got {checkpoint_interval}")
        if max_checkpoints <= 0:
            log.warning("prefix caching is on but max_checkpoints=%d: no prefix can ever be reused", max_checkpoints)
        self.ex = executor
        self.page_size = executor.manager.page_size
        self.interval = checkpoint_interval
        self.prompt_end = prompt_end
        self.store = CheckpointStore(max_checkpoints=max_checkpoints, max_bytes=max_bytes)
        self.stats = PrefixStats()
        self._warned_short = False
        self._warned_oom = False

    @property
    def manager(self) -> Glm5NextCacheManager:
        return self.ex.manager

    # --------------------------------------------------------------------------------------------
    # Policy
    def endpoints(self, r: Request) -> list[int]:
        """Checkpoint endpoints of ``r``'s prompt, ascending (each leaves at least one prompt row to compute)."""
        last = len(r.prompt_ids) - 1
        out = set()
        if last >= self.page_size:
            out.add(last // self.page_size * self.page_size)
        if self.interval is not None:
            out.update(range(self.interval, last + 1, self.interval))
        if not out and not self.prompt_end and not self._warned_short:
            self._warned_short = True
            log.debug(
                "prefix caching: a prompt of %d tokens gets no checkpoint (prompts need more than "
                "tokens_per_block=%d tokens, or set checkpoint_interval); such prompts are never reused",
                len(r.prompt_ids), self.page_size,
            )  # fmt: skip
        return sorted(out)

    @staticmethod
    def eligible(r: Request) -> bool:
        """Whether ``r`` may skip prompt rows (context logits and prompt logprobs need every row computed)."""
        return not (r.params.return_context_logits or r.params.prompt_logprobs is not None)

    # --------------------------------------------------------------------------------------------
    # Lookup and admission
    def match(self, waiting: list[Request]) -> None:
        """Find a checkpoint for each waiting request that starts from scratch; plan it from there."""
        for r in waiting:
            if r.prefix_hit is not None or r.num_computed or not self.eligible(r):
                continue
            m = self._lookup(r)
            if m is not None:
                r.prefix_hit = m
                r.num_computed = m.checkpoint.endpoint

    def _lookup(self, r: Request) -> PrefixMatch | None:
        P, toks = self.page_size, r.tokens
        keys = extend_page_keys(r.page_keys, toks, P)
        pages = self.manager.lookup_pages(keys)
        dm = self.ex.separate_draft_manager
        draft_pages = dm.lookup_pages(keys) if dm is not None else None
        k_max = len(pages) if draft_pages is None else min(len(pages), len(draft_pages))
        for k in range(k_max, -1, -1):
            best: tuple[int, tuple] | None = None
            for key in self.store.candidates(chain_key(keys, k)):
                tail = key[1]
                E = k * P + len(tail) - 1
                if len(toks) > E and tuple(toks[k * P : E + 1]) == tail and (best is None or best[0] < E):
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
            return PrefixMatch(key, ck, list(keys[:k]), pages[:k], dp)
        return None

    def _valid(self, ck: Checkpoint, endpoint: int, keys: list[bytes]) -> bool:
        """Whether ``ck`` restores a request at ``endpoint`` over pages ``keys`` (validated before planning)."""
        if ck.endpoint != endpoint or ck.page_keys != tuple(keys):
            return False
        if (endpoint % self.page_size != 0) != (ck.target_partial is not None):
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

    def admit(self, r: Request, num_tokens: int) -> None:
        """Add ``r`` to the cache manager for ``num_tokens`` tokens, restoring its match if it has one.

        Raises:
            CapacityError: no room, or a page of the match was reclaimed since `match` (nothing is taken
                then; the request waits and is matched again at the next step).
        """
        m: PrefixMatch | None = r.prefix_hit
        mgr = self.manager
        if m is None:
            mgr.add_request(r.request_id, num_tokens)
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
        """Count ``r``'s admission (queries, hits, reused tokens)."""
        if not self.eligible(r):
            return
        self.stats.queries += 1
        if r.prefix_hit is not None:
            self.stats.hits += 1
            self.stats.reused_tokens += r.prefix_hit.checkpoint.endpoint
            r.num_cached_tokens = r.prefix_hit.checkpoint.endpoint
        r.prefix_hit = None

    def unmatch(self, r: Request) -> None:
        """Forget a match of a request that was not admitted this step (it starts from scratch again)."""
        if r.prefix_hit is not None:
            r.prefix_hit = None
            r.num_computed = 0

    # --------------------------------------------------------------------------------------------
    # Chunks, seals and checkpoints
    def cut(self, plan: list[ScheduledSeq]) -> list[ScheduledSeq]:
        """End every prefill chunk at the next checkpoint endpoint inside it."""
        for s in plan:
            if s.is_decode:
                continue
            n0 = s.request.num_computed
            nxt = next((e for e in self.endpoints(s.request) if e > n0), None)
            if nxt is not None and n0 + s.num_rows > nxt:
                s.num_rows = nxt - n0
        return plan

    def after_step(self, plan: list[ScheduledSeq], history: Callable[[Request], int]) -> None:
        """Seal pages that became final and take the checkpoints this step reached.

        Args:
            plan: the step's sequences.
            history: per request, how many positions the drafter's per-position cache covers (the
                request's computed length when the drafter keeps none).
        """
        P = self.page_size
        for s in plan:
            r = s.request
            if r.finished or not self.manager.has_request(r.request_id):
                continue
            done = min(r.num_computed, history(r))
            keys = extend_page_keys(r.page_keys, r.tokens, P, done // P)
            n_final = min(len(keys), done // P)
            # Only pages that became final since the last step: this runs for every sequence every step.
            for j in range(r.pages_sealed, n_final):
                self.manager.seal_page(r.request_id, j, keys[j])
                self.ex.seal_draft_page(r, j, keys[j])
            r.pages_sealed = max(r.pages_sealed, n_final)
            E = r.num_computed
            at_end = self.prompt_end and len(r.prompt_ids) == E  # the first output token is in the key
            if s.is_decode or done < E or not (at_end or (len(r.prompt_ids) > E and E in self.endpoints(r))):
                continue
            if n_final < E // P:
                continue  # a full page is not sealable yet (cannot happen: E < len(tokens))
            key = checkpoint_key(keys, r.tokens, E, P)
            if key in self.store:
                continue
            self._take(r, key, keys[: E // P])

    def _take(self, r: Request, key: tuple, keys: list[bytes]) -> None:
        mgr, P, E = self.manager, self.page_size, r.num_computed
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
                self.store.discard(next(iter(self.store)))
                self.stats.checkpoints_evicted += 1
            if not self._warned_oom:
                self._warned_oom = True
                log.warning(
                    "prefix caching: out of device memory for a checkpoint (%d held, %.1f MB); skipped. Set "
                    "KvCacheConfig.checkpoint_max_bytes to bound them", len(self.store), self.store.nbytes / 1e6,
                )  # fmt: skip
            return
        self.stats.checkpoints_evicted += self.store.put(key, ck)
        self.stats.checkpoints_taken += 1
