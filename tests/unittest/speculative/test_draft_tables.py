"""Hazard §6.1: draft forwards with a separate draft KV manager use the draft manager's own slot tables.

The target and draft managers allocate pages and state slots independently. The fixtures below shift the
target's ids well past the (smaller) draft pool, so a draft forward that kept the target's table would
index the draft cache out of bounds. Covered: slot selection, buffer reuse across steps, replay after the
draft ids change, failure recovery (prepare raises -> every field and target buffer exactly as before),
oversized rows, restore, shared mode, draft lengths, the strict graph-address check, and an end-to-end
run of a real sparse layer (same outputs through either manager; only the draft cache is written).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from trtllm_glm.attention.graph_check import GraphAddressError, GraphAddressGuard
from trtllm_glm.attention.sparse.glm_kpool.layer import GlmKpoolSparseMLA
from trtllm_glm.attention.sparse.glm_kpool.metadata import GlmKpoolMetadata
from trtllm_glm.cache.manager import Glm5NextCacheManager, KpoolLayerCache
from trtllm_glm.config import Glm5NextConfig
from trtllm_glm.errors import StateError, TableWidthError
from trtllm_glm.speculative import interface
from trtllm_glm.speculative.interface import (
    draft_replay,
    prepare_attn_metadata_for_draft_replay,
    restore_attn_metadata_after_draft_replay,
)

pytestmark = pytest.mark.cpu_only

CFG = Glm5NextConfig.from_pretrained("tiny")
P = 8
TARGET_PAGES, DRAFT_PAGES = 32, 12
MAX_PAGES, MAX_DRAFT_PAGES = 4, 3
A, B, C = 1, 2, 3  # request ids
DUMMY_T, DUMMY_D1, DUMMY_D2 = 100, 100, 101


def make_managers() -> tuple[Glm5NextCacheManager, Glm5NextCacheManager]:
    """Target and (smaller) draft manager whose page ids and state slots for the same requests differ."""
    kw: dict[str, Any] = dict(tokens_per_block=P, max_num_requests=6, num_sparse_layers=1, num_kda_layers=0)
    tgt = Glm5NextCacheManager(CFG, num_pages=TARGET_PAGES, **kw)
    drf = Glm5NextCacheManager(CFG, num_pages=DRAFT_PAGES, **kw)
    # Target ids of real requests start at 12 (>= DRAFT_PAGES), draft ids at 2; draft state slots are one
    # higher than the target's.
    tgt.add_request(DUMMY_T, 12 * P)
    drf.add_request(DUMMY_D1, 2 * P)
    drf.add_request(DUMMY_D2)
    return tgt, drf


def add(rid: int, n: int, *mgrs: Glm5NextCacheManager) -> None:
    for m in mgrs:
        if not m.has_request(rid):
            m.add_request(rid)
        m.ensure_capacity(rid, n)


def make_meta(tgt: Glm5NextCacheManager, device: str = "cpu") -> GlmKpoolMetadata:
    return GlmKpoolMetadata(
        kv_cache_manager=tgt,
        max_num_seqs=4,
        max_num_tokens=64,
        max_pages_per_seq=MAX_PAGES,
        select_width=CFG.index_select_width,
        device=device,
        max_draft_pages_per_seq=MAX_DRAFT_PAGES,
    )


@pytest.fixture
def setup() -> Iterator[tuple[Glm5NextCacheManager, Glm5NextCacheManager, GlmKpoolMetadata]]:
    tgt, drf = make_managers()
    add(A, 13, tgt, drf)
    add(B, 6, tgt, drf)
    meta = make_meta(tgt)
    # A decodes one row after 12 cached tokens, B verifies 3 rows after 3.
    meta.prepare([A, B], past_lens=[12, 3], q_lens=[1, 3], num_decode_seqs=2)
    yield tgt, drf, meta


def padded(rows: list[list[int]], width: int) -> list[list[int]]:
    return [r + [-1] * (width - len(r)) for r in rows]


def buffer_contents(meta: GlmKpoolMetadata) -> dict[str, torch.Tensor]:
    """Copies of every buffer the target path reads (not the draft buffers, which a draft prepare may fill)."""
    return {
        "seq_buf": meta._seq_buf.clone(),
        "tok_buf": meta._tok_buf.clone(),
        "target_slot_table": meta.target_slot_table.clone(),
        "selection_buf": meta.selection_buf.clone(),
    }


def assert_exactly_as_before(meta: GlmKpoolMetadata, attrs: dict[str, Any], contents: dict[str, torch.Tensor]) -> None:
    now = vars(meta)
    assert now.keys() == attrs.keys()
    changed = [k for k in attrs if now[k] is not attrs[k]]
    assert not changed, f"attributes no longer the same object: {changed}"
    assert meta.slot_table is meta.target_slot_table and meta.state_slots_buf is meta.target_state_slots
    for name, t in buffer_contents(meta).items():
        assert torch.equal(t, contents[name]), name


# ------------------------------------------------------------------------------------------------
# Slot selection, restore


def test_draft_forward_binds_draft_tables(setup) -> None:
    tgt, drf, meta = setup
    target_rows = tgt.get_batch_slot_tables([A, B])
    draft_rows = drf.get_batch_slot_tables([A, B])
    # The hazard is live in this fixture: some target ids do not exist in the draft pool.
    assert max(max(r) for r in target_rows) >= DRAFT_PAGES
    assert all(set(t).isdisjoint(d) for t, d in zip(target_rows, draft_rows))
    target_ptr = meta.target_slot_table.data_ptr()
    target_before = meta.target_slot_table.clone()

    saved = meta.prepare_for_draft_forward(drf)

    assert meta.slot_table is meta.draft_slot_table and meta.draft_binding_active
    assert meta.slot_table_t.tolist() == padded(draft_rows, MAX_DRAFT_PAGES)
    ids = meta.slot_table_t[meta.slot_table_t >= 0]
    assert ids.numel() == sum(len(r) for r in draft_rows)
    assert int(ids.max()) < drf.num_pages, "an active slot id is outside the draft pool"
    assert meta.state_slots_t.tolist() == drf.get_batch_state_slots([A, B]) != tgt.get_batch_state_slots([A, B])
    assert meta.kv_cache_manager is drf and meta.page_size == drf.page_size
    assert meta.graph_buffers()["slot_table"].data_ptr() == meta.draft_slot_table.data_ptr()
    # The target buffer was never written and never moved.
    assert meta.target_slot_table.data_ptr() == target_ptr and torch.equal(meta.target_slot_table, target_before)
    assert meta.target_slot_table[:2].tolist() == padded(target_rows, MAX_PAGES)

    meta.restore_after_draft_forward(saved)
    assert meta.slot_table is meta.target_slot_table and not meta.draft_binding_active
    assert meta.kv_cache_manager is tgt and meta.page_size == P
    assert meta.slot_table_t.tolist() == padded(target_rows, MAX_PAGES)
    assert meta.state_slots_t.tolist() == tgt.get_batch_state_slots([A, B])
    assert meta.graph_buffers()["slot_table"].data_ptr() == target_ptr


def test_interface_prepare_and_restore(setup) -> None:
    tgt, drf, meta = setup
    saved = prepare_attn_metadata_for_draft_replay(meta, drf)
    assert meta.slot_table is meta.draft_slot_table and meta.kv_cache_manager is drf
    restore_attn_metadata_after_draft_replay(meta, saved)
    assert meta.slot_table is meta.target_slot_table and meta.kv_cache_manager is tgt
    # The context manager restores in `finally`, also when the draft forward raises.
    with pytest.raises(KeyError), draft_replay(meta, drf) as m:
        assert m.slot_table is m.draft_slot_table
        raise KeyError("draft forward failed")
    assert meta.slot_table is meta.target_slot_table and meta.kv_cache_manager is tgt


def test_prepare_while_draft_bound_is_refused(setup) -> None:
    tgt, drf, meta = setup
    saved = meta.prepare_for_draft_forward(drf)
    # Filling now would write the draft manager's ids into the target table.
    with pytest.raises(StateError, match="draft binding is active"):
        meta.prepare([A], past_lens=[13], q_lens=[1], num_decode_seqs=1)
    meta.restore_after_draft_forward(saved)
    add(A, 14, tgt)
    meta.prepare([A], past_lens=[13], q_lens=[1], num_decode_seqs=1)


def test_shared_mode_is_a_noop(setup) -> None:
    tgt, _, meta = setup
    attrs, contents = dict(vars(meta)), buffer_contents(meta)
    draft_before = meta.draft_slot_table.clone()
    for mgr in (None, tgt):
        saved = meta.prepare_for_draft_forward(mgr)
        assert saved.shared and saved.host_batch is None
        assert_exactly_as_before(meta, attrs, contents)
        meta.restore_after_draft_forward(saved)
        assert_exactly_as_before(meta, attrs, contents)
        with draft_replay(meta, mgr):
            assert_exactly_as_before(meta, attrs, contents)
        assert_exactly_as_before(meta, attrs, contents)
    assert torch.equal(meta.draft_slot_table, draft_before)


def test_page_size_must_match(setup) -> None:
    _, _, meta = setup
    other = Glm5NextCacheManager(
        CFG, num_pages=8, tokens_per_block=2 * P, max_num_requests=4, num_sparse_layers=1, num_kda_layers=0
    )
    attrs, contents = dict(vars(meta)), buffer_contents(meta)
    with pytest.raises(ValueError, match="tokens_per_block"):
        prepare_attn_metadata_for_draft_replay(meta, other)
    assert_exactly_as_before(meta, attrs, contents)


# ------------------------------------------------------------------------------------------------
# Buffer reuse and replay after the draft ids change


def test_draft_buffer_reused_across_steps(setup) -> None:
    tgt, drf, meta = setup
    draft_ptr = meta.draft_slot_table.data_ptr()
    add(C, 20, tgt, drf)
    steps = [([A, B], [12, 3], [1, 3], 2), ([B], [6], [1], 1), ([C, A], [0, 12], [20, 1], 0)]
    for rids, past, q, nd in steps:
        meta.prepare(rids, past_lens=past, q_lens=q, num_decode_seqs=nd)
        with draft_replay(meta, drf):
            assert meta.slot_table.data_ptr() == draft_ptr
            assert meta.slot_table_t.tolist() == padded(drf.get_batch_slot_tables(rids), MAX_DRAFT_PAGES)
            # Rows past this step's batch were reset, not left holding an earlier request's pages.
            assert (meta.draft_slot_table[len(rids) :] == -1).all()
            assert meta.state_slots_t.tolist() == drf.get_batch_state_slots(rids)
        assert meta.slot_table_t.tolist() == padded(tgt.get_batch_slot_tables(rids), MAX_PAGES)


def test_replay_after_draft_ids_change(setup) -> None:
    tgt, drf, meta = setup
    guard = GraphAddressGuard()
    saved = meta.prepare_for_draft_forward(drf)
    guard.capture(meta)  # as if a draft graph were captured here
    old_rows = drf.get_batch_slot_tables([A, B])
    old_slots = drf.get_batch_state_slots([A, B])
    meta.restore_after_draft_forward(saved)

    # The draft manager frees and re-admits the requests: new page ids and state slots.
    drf.free_request(A)
    drf.free_request(B)
    drf.add_request(200, 3 * P)  # takes the freed low ids
    add(B, 6, drf)
    add(A, 13, drf)
    new_rows = drf.get_batch_slot_tables([A, B])
    assert all(set(o).isdisjoint(n) for o, n in zip(old_rows, new_rows))
    assert drf.get_batch_state_slots([A, B]) != old_slots

    meta.prepare([A, B], past_lens=[12, 3], q_lens=[1, 3], num_decode_seqs=2)
    saved = meta.prepare_for_draft_forward(drf)  # the pre-replay prepare
    guard.check(meta)  # every address as captured: the graph would read the refreshed buffers
    assert meta.draft_slot_table[:2].tolist() == padded(new_rows, MAX_DRAFT_PAGES)
    assert meta.draft_state_slots[:2].tolist() == drf.get_batch_state_slots([A, B])
    assert int(meta.slot_table_t.max()) < drf.num_pages
    meta.restore_after_draft_forward(saved)


# ------------------------------------------------------------------------------------------------
# Failure recovery and oversized rows


def _raise(*args: Any, **kwargs: Any) -> Any:
    raise RuntimeError("injected failure")


FAILURES = ["get_tables_raises", "row_too_wide", "page_missing", "after_hook", "after_hook_with_lengths"]


@pytest.mark.parametrize("failure", FAILURES)
def test_failed_prepare_leaves_target_binding_intact(setup, monkeypatch, failure: str) -> None:
    tgt, drf, meta = setup
    # Something for the identity check to catch if the per-step fields were reset and not restored.
    meta.spec.verify_seqs = [1]
    lengths: dict[str, Any] = {}
    if failure == "get_tables_raises":
        monkeypatch.setattr(drf, "page_lists", _raise)
        expected: type[Exception] = RuntimeError
    elif failure == "row_too_wide":
        drf.ensure_capacity(A, (MAX_DRAFT_PAGES + 1) * P)
        expected = TableWidthError
    elif failure == "page_missing":
        lengths = {"past_lens": [12, 3], "q_lens": [5, 3]}  # A would need a third draft page
        expected = TableWidthError
    else:
        monkeypatch.setattr(interface, "_after_backend_hook", _raise)
        expected = RuntimeError
        if failure == "after_hook_with_lengths":
            # The hook rewrites the batch buffers in place; the rollback must refill the target's.
            add(A, 16, drf)
            lengths = {"past_lens": [11, 2], "q_lens": [2, 4], "num_decode_seqs": 2}
    attrs, contents = dict(vars(meta)), buffer_contents(meta)
    draft_before = meta.draft_slot_table.clone()

    with pytest.raises(expected):
        prepare_attn_metadata_for_draft_replay(meta, drf, **lengths)

    assert_exactly_as_before(meta, attrs, contents)
    assert meta.kv_cache_manager is tgt and meta.page_size == P
    if not failure.startswith("after_hook"):
        # Every check ran before the first write: the draft buffer was not touched either.
        assert torch.equal(meta.draft_slot_table, draft_before)
    # The metadata still works for the target step and for a later, valid draft forward.
    monkeypatch.undo()
    meta.prepare([A, B], past_lens=[12, 3], q_lens=[1, 3], num_decode_seqs=2)


def test_oversized_draft_row_is_rejected_not_truncated(setup) -> None:
    _, drf, meta = setup
    drf.ensure_capacity(B, (MAX_DRAFT_PAGES + 1) * P)
    with pytest.raises(TableWidthError, match=f"{MAX_DRAFT_PAGES + 1} pages .* max_draft_pages_per_seq=3"):
        meta.prepare_for_draft_forward(drf)
    assert meta.slot_table is meta.target_slot_table and (meta.draft_slot_table == -1).all()
    # A wider draft table takes the same row whole.
    wide = GlmKpoolMetadata(
        kv_cache_manager=meta.target_kv_cache_manager,
        max_num_seqs=4,
        max_num_tokens=64,
        max_pages_per_seq=MAX_PAGES,
        select_width=CFG.index_select_width,
        max_draft_pages_per_seq=MAX_DRAFT_PAGES + 1,
    )
    wide.prepare([A, B], past_lens=[12, 3], q_lens=[1, 3], num_decode_seqs=2)
    with draft_replay(wide, drf):
        assert wide.slot_table_t[1].tolist() == drf.get_batch_slot_tables([B])[0]


# ------------------------------------------------------------------------------------------------
# Draft lengths


def test_draft_lengths_swap_and_restore(setup) -> None:
    tgt, drf, meta = setup
    positions, kv_lens = meta.positions_t.tolist(), meta.kv_lens_t.tolist()
    lists = (meta.request_ids, meta.past_lens, meta.q_lens, meta.cu_seqlens)
    # The drafter lags the target by one token: one more row per sequence, starting one position earlier.
    with draft_replay(meta, drf, past_lens=[11, 2], q_lens=[2, 4]):
        assert meta.positions_t.tolist() == [11, 12, 2, 3, 4, 5]
        assert meta.kv_lens_t.tolist() == [13, 6] and meta.num_tokens == 6
        assert meta.state_slots_t.tolist() == drf.get_batch_state_slots([A, B])
        assert meta.slot_table_t.tolist() == padded(drf.get_batch_slot_tables([A, B]), MAX_DRAFT_PAGES)
    assert meta.positions_t.tolist() == positions and meta.kv_lens_t.tolist() == kv_lens
    assert all(x is y for x, y in zip(lists, (meta.request_ids, meta.past_lens, meta.q_lens, meta.cu_seqlens)))
    assert meta.state_slots_t.tolist() == tgt.get_batch_state_slots([A, B])
    # Shared mode with lengths swaps only the lengths.
    with draft_replay(meta, None, past_lens=[11, 2], q_lens=[2, 4]):
        assert meta.slot_table is meta.target_slot_table and meta.positions_t.tolist() == [11, 12, 2, 3, 4, 5]
    assert meta.positions_t.tolist() == positions


# ------------------------------------------------------------------------------------------------
# Strict graph-address check


def test_graph_address_guard(setup) -> None:
    _, drf, meta = setup
    guard = GraphAddressGuard()
    guard.capture(meta)  # target graph captured with the target binding
    guard.check(meta)
    with draft_replay(meta, drf):
        with pytest.raises(GraphAddressError, match="slot_table: moved .* without a declared swap"):
            guard.check(meta)
        guard.check(meta, declared_swaps=meta.draft_swap_addresses())
        guard.check(
            meta,
            declared_swaps={
                "slot_table": {meta.target_slot_table, meta.draft_slot_table},
                "state_slots": {meta.target_state_slots.data_ptr(), meta.draft_state_slots.data_ptr()},
            },
        )
        # Declaring only the table leaves the state-slot rebind undeclared.
        with pytest.raises(GraphAddressError, match="state_slots"):
            guard.check(meta, declared_swaps={"slot_table": {meta.draft_slot_table}})
    guard.check(meta)

    # An undeclared rebind: a fresh tensor with the same contents is still a different address.
    declared = meta.draft_swap_addresses()
    meta.slot_table = meta.target_slot_table.clone()
    with pytest.raises(GraphAddressError, match="slot_table: moved .* to an undeclared address"):
        guard.check(meta, declared_swaps=declared)
    meta.slot_table = meta.target_slot_table
    meta.selection_buf = meta.selection_buf.clone()
    with pytest.raises(GraphAddressError, match="selection_buf"):
        guard.check(meta, declared_swaps=declared)
    with pytest.raises(RuntimeError, match="before capture"):
        GraphAddressGuard().check(meta)


# ------------------------------------------------------------------------------------------------
# End to end through a real sparse layer


def _clone(c: KpoolLayerCache) -> KpoolLayerCache:
    return KpoolLayerCache(c.latent.clone(), c.index_k.clone(), c.index_scale.clone(), c.tail_ring.clone(), c.page_size)


def _planes(c: KpoolLayerCache) -> dict[str, torch.Tensor]:
    return {
        "latent": c.latent,
        "index_k": c.index_k.view(torch.uint8),
        "index_scale": c.index_scale,
        "tail_ring": c.tail_ring,
    }


def _assert_planes_equal(a: KpoolLayerCache, b: KpoolLayerCache) -> None:
    pa, pb = _planes(a), _planes(b)
    for k in pa:
        assert torch.equal(pa[k], pb[k]), k


@torch.no_grad()
def test_sparse_layer_same_outputs_through_draft_manager() -> None:
    tgt, drf = make_managers()
    layer = GlmKpoolSparseMLA(CFG)
    layer.reset_parameters(torch.Generator().manual_seed(0), 0.05)
    meta = make_meta(tgt)
    g = torch.Generator().manual_seed(1)
    # Step 1: two prefills. Step 2: A decodes, B verifies 3 rows, C prefills (mixed batch).
    steps = [
        ([A, B], [0, 0], [13, 6], 0),
        ([A, B, C], [13, 6, 0], [1, 3, 9], 2),
        ([A, B, C], [14, 9, 9], [1, 2, 1], 3),
    ]
    tcache, dcache = tgt.kpool_layer_cache(0), drf.kpool_layer_cache(0)
    for rids, past, q, nd in steps:
        for rid, p, n in zip(rids, past, q):
            add(rid, p + n, tgt, drf)
        h = torch.randn(sum(q), CFG.hidden_size, generator=g)
        meta.prepare(rids, past_lens=past, q_lens=q, num_decode_seqs=nd)

        d_before = _clone(dcache)
        out_t = layer(h, meta, meta.kv_cache_manager.kpool_layer_cache(0))
        _assert_planes_equal(dcache, d_before)  # the target forward wrote only the target cache

        t_before = _clone(tcache)
        with draft_replay(meta, drf) as m:
            assert int(m.slot_table_t.max()) < drf.num_pages
            out_d = layer(h, m, m.kv_cache_manager.kpool_layer_cache(0))
        _assert_planes_equal(tcache, t_before)  # the draft forward wrote only the draft cache
        assert torch.equal(out_t, out_d)
        assert meta.kv_cache_manager is tgt

    # The draft cache holds, at the draft's own pages and state slots, what the target holds at its own.
    tplanes, dplanes = _planes(tcache), _planes(dcache)
    written = torch.zeros(DRAFT_PAGES, dtype=torch.bool)
    for rid in (A, B, C):
        n = tgt.num_tokens(rid)
        for tp, dp in zip(tgt.get_batch_slot_tables([rid])[0], drf.get_batch_slot_tables([rid])[0]):
            for name in ("latent", "index_k", "index_scale"):
                assert torch.equal(tplanes[name][tp], dplanes[name][dp]), (rid, name)
            written[dp] = True
        assert n > 0
        ts, ds = tgt.get_state_slot(rid), drf.get_state_slot(rid)
        assert torch.equal(tcache.tail_ring[ts], dcache.tail_ring[ds]) and tcache.tail_ring[ts].abs().sum() > 0
    # Pages and state slots of other draft requests, and free pages, were never written.
    assert (dcache.latent[~written] == 0).all() and (dcache.index_scale[~written] == 0).all()
    for rid in (DUMMY_D1, DUMMY_D2):
        assert (dcache.tail_ring[drf.get_state_slot(rid)] == 0).all()
