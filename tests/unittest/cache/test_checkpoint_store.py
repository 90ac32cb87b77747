"""`CheckpointStore` eviction order on its own (no model): a hit refreshes recency in the fresh segment too.

The executor-level test (tests/integration/test_prefix_branch.py) stores A, B, hits A, stores C with room for two:
the hit makes A *shared*, and the shared segment alone protects it, so that test cannot see whether ``get`` also
moved A to the most recently used end. Here two hits overflow the shared segment (its cap is half the budget), the
older hit turns fresh again, and only its refreshed recency keeps it ahead of B.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from trtllm_glm.cache.prefix import Checkpoint, CheckpointStore

pytestmark = pytest.mark.cpu_only


def _ck() -> Checkpoint:
    # Only `nbytes` of the snapshot is read by the store.
    return Checkpoint(endpoint=16, page_keys=(), target=SimpleNamespace(nbytes=100))  # type: ignore[arg-type]


def test_hit_refreshes_recency_of_a_checkpoint_that_turns_fresh_again() -> None:
    """Room for 3: store A, B, C, hit A, hit C, store D. The shared segment holds one (3 // 2), so the hit on C turns
    A fresh again; A was used after B, so B (least recently used) is evicted, not A."""
    store = CheckpointStore(max_checkpoints=3)
    for k in "ABC":
        store.put((k, ()), _ck())
    assert store.get(("A", ())) is not None and store.get(("C", ())) is not None
    assert store.is_shared(("C", ())) and not store.is_shared(("A", ()))
    assert store.put(("D", ()), _ck()) == 1
    assert [k for k, _ in store] == ["A", "C", "D"], "B (least recently used) must be the one evicted"


def test_byte_budget_evicts_least_recently_used_fresh() -> None:
    """The same order under a byte budget: 3 checkpoints of 100 bytes fit in 300."""
    store = CheckpointStore(max_checkpoints=64, max_bytes=300)
    for k in "ABC":
        store.put((k, ()), _ck())
    store.get(("A", ()))
    store.get(("C", ()))  # the shared half (150 bytes) holds one: A turns fresh again
    store.put(("D", ()), _ck())
    assert ("B", ()) not in store and all((k, ()) in store for k in "ACD")
    assert store.nbytes == 300 and store.shared_nbytes == 100
