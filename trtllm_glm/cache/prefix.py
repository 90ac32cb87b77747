"""Prefix caching: content keys of sealed pages and recurrent-state checkpoints (docs/design.md §6.4).

Sealed pages (`Glm5NextCacheManager.seal_page`) are shared read-only under a content key; a `Checkpoint` at
``E = kP + r`` holds the byte copy of the request's state slot, its partial page ``k`` (``r != 0``) and the keys of
its ``k`` full pages. The key of page ``j`` hashes tokens ``0 .. (j + 1) P`` (chained; one token past the page, since
the MTP row at ``i`` pairs hidden ``i`` with token ``i + 1``) and a checkpoint's key tokens ``0 .. E``, so every
draft row of a shared page is valid for every sharer; why, and the design reference's layout: docs/design.md §6.4.
"""

from __future__ import annotations

import array
import hashlib
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch

from ..state import StateSnapshot, held_bytes

__all__ = [
    "Checkpoint",
    "CheckpointStore",
    "PrefixStats",
    "chain_key",
    "checkpoint_key",
    "extend_page_keys",
    "page_keys",
]

_ROOT = b"trtllm_glm.prefix.v1"


def _digest(prev: bytes, tokens: Sequence[int]) -> bytes:
    h = hashlib.blake2b(prev, digest_size=16)
    # int64 in native byte order, as a torch int64 tensor's bytes would be (~10x cheaper: thousands of pages a step).
    h.update(array.array("q", tokens).tobytes())
    return h.digest()


def page_keys(
    tokens: Sequence[int], tokens_per_block: int, limit: int | None = None, next_token: bool = True
) -> list[bytes]:
    """Chained content keys of the sealable pages of ``tokens``.

    Page ``j``'s key hashes the previous key and tokens ``jP .. (j + 1) P`` (one past the page: an MTP drafter's
    row of the page's last position reads the next token's embedding), so a page has a key only when token
    ``(j + 1) P`` exists; with ``next_token=False`` (no such drafter) tokens ``jP .. (j + 1) P - 1`` alone.

    Args:
        tokens: the sequence.
        tokens_per_block: ``P``.
        limit: at most this many keys.
        next_token: whether a page's content depends on the token after it.

    Returns:
        ``[k]`` keys of pages ``0 .. k - 1``.
    """
    return extend_page_keys([], tokens, tokens_per_block, limit, next_token)


def extend_page_keys(
    keys: list[bytes], tokens: Sequence[int], tokens_per_block: int, limit: int | None = None, next_token: bool = True
) -> list[bytes]:
    """Extend ``keys`` (the keys of ``tokens``' first pages) in place, up to ``limit`` keys; returns it (the same
    ``next_token`` as the keys were made with: see `page_keys`)."""
    nxt = int(next_token)
    n = (len(tokens) - nxt) // tokens_per_block if tokens else 0
    if limit is not None:
        n = min(n, limit)
    prev = keys[-1] if keys else _ROOT
    for j in range(len(keys), n):
        prev = _digest(prev, tokens[j * tokens_per_block : (j + 1) * tokens_per_block + nxt])
        keys.append(prev)
    return keys


def chain_key(keys: Sequence[bytes], k: int) -> bytes:
    """The key that stands for pages ``0 .. k - 1`` (the last one's chained key; a root for ``k = 0``)."""
    return keys[k - 1] if k else _ROOT


def checkpoint_key(
    keys: Sequence[bytes], tokens: Sequence[int], endpoint: int, tokens_per_block: int, next_token: bool = True
) -> tuple:
    """The key of a checkpoint at ``endpoint``: its full pages' last key and tokens ``kP .. endpoint`` (with
    ``next_token``: the state there depends on token ``endpoint`` too, as an MTP drafter's row ``endpoint - 1``
    reads its embedding) or ``kP .. endpoint - 1`` (without: the state is a function of the tokens before the
    endpoint alone, so a checkpoint at a page boundary serves every prompt that shares the full pages)."""
    k = endpoint // tokens_per_block
    return (chain_key(keys, k), tuple(tokens[k * tokens_per_block : endpoint + int(next_token)]))


@dataclass
class Checkpoint:
    """What restoring a request at ``endpoint`` needs beyond its shared pages.

    Attributes:
        endpoint: committed length ``E = kP + r``.
        page_keys: keys of the ``k`` full pages the request shares.
        target: the target slot's state copy.
        target_partial: copy of target page ``k`` (plane -> ``[L, bytes_per_page]``) when ``r != 0``.
        draft: the separate draft manager's slot copy (None in shared mode and without MTP).
        draft_partial: copy of draft page ``k`` when ``r != 0`` (separate mode).
    """

    endpoint: int
    page_keys: tuple[bytes, ...]
    target: StateSnapshot
    target_partial: dict[str, torch.Tensor] | None = None
    draft: StateSnapshot | None = None
    draft_partial: dict[str, torch.Tensor] | None = None

    @property
    def nbytes(self) -> int:
        """Device bytes the checkpoint holds."""
        n = self.target.nbytes + (self.draft.nbytes if self.draft is not None else 0)
        for part in (self.target_partial, self.draft_partial):
            if part is not None:
                n += held_bytes(list(part.values()))
        return n


@dataclass
class PrefixStats:
    """Prefix-cache counters of one executor.

    Attributes:
        queries: admissions that looked for a prefix.
        hits: admissions that restored a checkpoint.
        reused_tokens: prompt tokens not computed thanks to hits.
        checkpoints_taken: checkpoints stored.
        checkpoints_evicted: checkpoints dropped by the budget (LRU).
        rejected: checkpoints discarded at restore because they failed validation (the request recomputed).
        checkpoints_skipped: checkpoints not taken: no device memory, or larger than the byte budget.
        branch_checkpoints: checkpoints taken at branch points (where a prompt stopped matching sealed
            pages that no checkpoint reached).
        lost_requests: admissions whose prompt matched sealed pages beyond the checkpoint they could use.
        lost_tokens: prompt tokens those admissions recomputed although their pages were cached (a
            checkpoint at the branch point would have saved them; the request takes one there).
        held: times a waiting request was held for a step while a running one prefilled their shared pages.
        checkpoints_superseded: a request's own prompt-end / last-page checkpoints demoted unused (evicted
            first) when its request-end checkpoint was taken.
    """

    queries: int = 0
    hits: int = 0
    reused_tokens: int = 0
    checkpoints_taken: int = 0
    checkpoints_evicted: int = 0
    rejected: int = 0
    checkpoints_skipped: int = 0
    branch_checkpoints: int = 0
    lost_requests: int = 0
    lost_tokens: int = 0
    held: int = 0
    checkpoints_superseded: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


@dataclass
class CheckpointStore:
    """Checkpoints by key, with their own budget and eviction (pages are never evicted for them).

    Eviction is a segmented LRU: a checkpoint that served a hit, or was taken at a branch point (a prefix
    two requests already shared), is *shared* and outlives the fresh ones, which are evicted first (least
    recently used first). Without it the checkpoints every request takes near its own end (its last page
    boundary, its prompt's end), which rarely serve anyone, would push a system prompt's checkpoint out.
    Shared ones are kept to half the budget (the least recently used of them turn fresh again beyond it).

    Args:
        max_checkpoints: at most this many (``0`` disables checkpoints).
        max_bytes: at most this many device bytes over all checkpoints (``None``: no byte limit).
    """

    max_checkpoints: int = 64
    max_bytes: int | None = None
    _items: OrderedDict = field(default_factory=OrderedDict)
    _shared: OrderedDict = field(default_factory=OrderedDict)
    _by_chain: dict = field(default_factory=dict)
    nbytes: int = 0
    shared_nbytes: int = 0

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, key: tuple) -> bool:
        return key in self._items

    def __iter__(self) -> Iterator[tuple]:
        """Keys, least recently used first (a copy: safe to discard while iterating)."""
        return iter(list(self._items))

    def is_shared(self, key: tuple) -> bool:
        """Whether the checkpoint under ``key`` is in the shared segment (evicted after the fresh ones)."""
        return key in self._shared

    def get(self, key: tuple) -> Checkpoint | None:
        """The checkpoint under ``key`` (marked most recently used and shared: a hit), or None."""
        ck = self._items.get(key)
        if ck is not None:
            self._items.move_to_end(key)
            self._share(key, ck)
        return ck

    def fits(self, ck: Checkpoint) -> bool:
        """Whether ``ck`` can be stored at all (checkpoints enabled, and not above the whole byte budget)."""
        return self.max_checkpoints > 0 and (self.max_bytes is None or ck.nbytes <= self.max_bytes)

    def put(self, key: tuple, ck: Checkpoint, *, shared: bool = False) -> int:
        """Store ``ck`` under ``key`` (in the shared segment when ``shared``) and evict over budget; returns
        how many were evicted. A checkpoint larger than the whole byte budget is not stored.
        """
        if not self.fits(ck):
            return 0
        self.discard(key)
        self._items[key] = ck
        self._by_chain.setdefault(key[0], set()).add(key)
        self.nbytes += ck.nbytes
        if shared:
            self._share(key, ck)
        evicted = 0
        while len(self._items) > self.max_checkpoints or (self.max_bytes is not None and self.nbytes > self.max_bytes):
            self.discard(self.victim())
            evicted += 1
        return evicted

    def victim(self) -> tuple:
        """The key eviction takes next: the least recently used fresh checkpoint, else shared one."""
        return next((k for k in self._items if k not in self._shared), next(iter(self._items)))

    def _share(self, key: tuple, ck: Checkpoint) -> None:
        if key not in self._shared:
            self.shared_nbytes += ck.nbytes
        self._shared[key] = None
        self._shared.move_to_end(key)
        # Half the budget at most: the least recently used shared ones turn fresh again.
        cap_n = max(1, self.max_checkpoints // 2)
        cap_b = None if self.max_bytes is None else self.max_bytes // 2
        while len(self._shared) > 1 and (
            len(self._shared) > cap_n or (cap_b is not None and self.shared_nbytes > cap_b)
        ):
            old = next(iter(self._shared))
            del self._shared[old]
            self.shared_nbytes -= self._items[old].nbytes

    def demote(self, key: tuple) -> None:
        """Make the checkpoint under ``key`` (if any, and fresh) the next to be evicted: kept while the budget
        allows, the first to go when it does not."""
        if key in self._items and key not in self._shared:
            self._items.move_to_end(key, last=False)

    def discard(self, key: tuple) -> None:
        """Drop the checkpoint under ``key`` if any."""
        old = self._items.pop(key, None)
        if old is not None:
            self.nbytes -= old.nbytes
            if self._shared.pop(key, 0) is None:
                self.shared_nbytes -= old.nbytes
            group = self._by_chain[key[0]]
            group.discard(key)
            if not group:
                del self._by_chain[key[0]]

    def candidates(self, chain: bytes) -> list[tuple]:
        """Keys of the checkpoints whose full pages are the pages ``chain`` stands for."""
        return list(self._by_chain.get(chain, ()))
