"""GlmKpoolMetadata: persistent buffers refreshed in place, derived positions, width errors."""

from __future__ import annotations

import pytest

from trtllm_glm.attention.sparse.glm_kpool.metadata import GlmKpoolMetadata
from trtllm_glm.cache.manager import Glm5NextCacheManager
from trtllm_glm.config import Glm5NextConfig
from trtllm_glm.errors import TableWidthError

pytestmark = pytest.mark.cpu_only


def setup(max_pages_per_seq=4):
    cfg = Glm5NextConfig.from_pretrained("tiny")
    mgr = Glm5NextCacheManager(cfg, num_pages=16, tokens_per_block=8, max_num_requests=4)
    meta = GlmKpoolMetadata(
        kv_cache_manager=mgr, max_num_seqs=4, max_num_tokens=64, max_pages_per_seq=max_pages_per_seq, select_width=19
    )
    return mgr, meta


def test_prepare_fills_in_place() -> None:
    mgr, meta = setup()
    mgr.add_request(5, 12)  # decode: 11 cached + 1 new
    mgr.add_request(6, 20)  # verify: 17 cached + 3
    mgr.add_request(7, 9)  # prefill chunk 4..8
    addrs = {k: v.data_ptr() for k, v in meta.graph_buffers().items()}
    meta.prepare([5, 6, 7], past_lens=[11, 17, 4], q_lens=[1, 3, 5], num_decode_seqs=2)
    assert meta.num_decode_tokens == 4 and meta.num_tokens == 9
    assert meta.positions_t.tolist() == [11, 17, 18, 19, 4, 5, 6, 7, 8]
    assert meta.row_seq_t.tolist() == [0, 1, 1, 1, 2, 2, 2, 2, 2]
    assert meta.kv_lens_t.tolist() == [12, 20, 9]
    assert meta.cu_seqlens_t.tolist() == [0, 1, 4, 9]
    tables = mgr.get_batch_slot_tables([5, 6, 7])
    for i, row in enumerate(tables):
        assert meta.slot_table_t[i, : len(row)].tolist() == row
        assert (meta.slot_table_t[i, len(row) :] == -1).all()
    assert meta.state_slots_t.tolist() == mgr.get_batch_state_slots([5, 6, 7])
    assert meta.max_pools == 5
    # A second step with other requests reuses the same buffers.
    meta.prepare([7], past_lens=[9], q_lens=[1], num_decode_seqs=1)
    assert {k: v.data_ptr() for k, v in meta.graph_buffers().items()} == addrs
    assert meta.positions_t.tolist() == [9]
    # Rows beyond this step's batch were reset, not left holding an old request's pages.
    assert (meta.slot_table[1:] == -1).all()


def test_selection_buffer_reset() -> None:
    _, meta = setup()
    meta.selection_buf.fill_(123)
    s = meta.selection(5)
    assert s.data_ptr() == meta.selection_buf.data_ptr() and (s == -1).all()


def test_wider_table_raises() -> None:
    mgr, meta = setup(max_pages_per_seq=2)
    mgr.add_request(1, 24)
    with pytest.raises(TableWidthError, match="max_pages_per_seq=2"):
        meta.prepare([1], past_lens=[20], q_lens=[4], num_decode_seqs=0)


def test_unallocated_pages_raise() -> None:
    mgr, meta = setup()
    mgr.add_request(1, 8)
    with pytest.raises(TableWidthError, match="pages allocated"):
        meta.prepare([1], past_lens=[8], q_lens=[1], num_decode_seqs=1)


def test_bad_batches() -> None:
    mgr, meta = setup()
    for r in range(4):
        mgr.add_request(r, 30)
    with pytest.raises(ValueError):
        meta.prepare([0], past_lens=[0], q_lens=[0], num_decode_seqs=0)
    with pytest.raises(TableWidthError, match="max_num_tokens"):
        meta.prepare([0, 1, 2], past_lens=[0, 0, 0], q_lens=[30, 30, 30], num_decode_seqs=0)
    with pytest.raises(ValueError, match="num_decode_seqs"):
        meta.prepare([0], past_lens=[0], q_lens=[1], num_decode_seqs=2)


def test_speculative_fields_live_apart_and_prepare_replaces_them() -> None:
    """Speculative fields are a `SpecMetadata` of their own; ``prepare()`` swaps in an empty one (never
    mutates the old one, so an identity rollback of the metadata's attributes restores them)."""
    from trtllm_glm.state import SpecMetadata

    mgr, meta = setup()
    mgr.add_request(5, 12)
    meta.prepare([5], past_lens=[11], q_lens=[1], num_decode_seqs=1)
    old = meta.spec
    assert isinstance(old, SpecMetadata) and old == SpecMetadata()
    old.verify_seqs = [0]
    assert meta.spec.verify_seqs == [0]
    meta.prepare([5], past_lens=[11], q_lens=[1], num_decode_seqs=1)
    assert meta.spec is not old and meta.spec.verify_seqs == [] and old.verify_seqs == [0]


def test_incremental_table_rows_match_full_writes() -> None:
    """`_TableRows` (rows written only where they changed, per staging set) leaves each set exactly as the
    full write `_write_rows` would: page lists growing, requests freed and re-allocated with lists of the
    same length (new objects), the batch reordered, shrinking and growing; both sets alternate. With the
    identity check dropped (lists compared by length alone), a re-allocated row keeps stale pages."""
    import random

    import numpy as np
    import torch

    from trtllm_glm.attention.metadata import HostStaging
    from trtllm_glm.attention.sparse.glm_kpool.metadata import _TableRows, _write_rows

    rng = random.Random(3)
    R, W = 6, 12
    staging = HostStaging({"table": ((R, W), torch.int32)}, pin_memory=False)
    rows = _TableRows(staging, "table")
    live: dict[int, list[int]] = {}
    next_page = iter(range(10_000))
    for step in range(300):
        for rid in list(live):
            if rng.random() < 0.1:  # freed; a new allocation may take the same id and length
                n = len(live.pop(rid))
                if rng.random() < 0.5:
                    live[rid] = [next(next_page) for _ in range(n)]
            elif rng.random() < 0.3 and len(live[rid]) < W:
                live[rid].append(next(next_page))
        while len(live) < R and rng.random() < 0.5:
            live[rng.randrange(100)] = [next(next_page) for _ in range(rng.randrange(0, 4))]
        batch = rng.sample(sorted(live), k=rng.randrange(0, len(live) + 1))
        if step % 7 == 0:
            batch.sort()  # the same order again: appends only
        tables = [live[r] for r in batch]
        staging.acquire()
        rows.write(tables)
        want = np.zeros((R, W), dtype=np.int32)
        _write_rows(want, tables)
        assert np.array_equal(staging.arrays()["table"], want), step
        staging.release()


def test_score_columns_are_powers_of_two_covering_the_pools() -> None:
    """The indexer's score width (`score_columns`) takes few values over a growing prompt (no new top-k compile per
    chunk) and always covers every complete pool; under graph capture it is the fixed graph bound."""
    _, meta = setup()
    meta.round_score_columns = True  # what CUDA buffers get (the CPU's reference scoring takes the exact count)
    widths = set()
    for kv in range(0, 4 * 70, 3):
        meta.max_kv_len = kv
        c = meta.score_columns
        assert c >= meta.max_pools and (c & (c - 1) == 0 or c == 0)
        assert c < 2 * meta.max_pools or meta.max_pools <= 1
        widths.add(c)
    assert widths == {0, 1, 2, 4, 8, 16, 32, 64, 128}
    meta.graph_max_pools = 24
    assert meta.score_columns == 24
    meta.graph_max_pools = None
    meta.round_score_columns = False
    meta.max_kv_len = 4 * 37 + 2
    assert meta.score_columns == 37


def test_an_unchanged_description_is_not_copied_again() -> None:
    """A description equal to the one the device buffers hold (the MTP catch-up described right after the verify it
    follows) is not copied again; one that differs, or any after a device-side rewrite, is."""

    from trtllm_glm import traffic

    mgr, meta = setup()
    mgr.add_request(5, 12)
    mgr.add_request(6, 20)

    def prepare(**kw) -> traffic.Traffic:  # noqa: ANN003
        with traffic.recording() as rec:
            meta.prepare([5, 6], past_lens=[8, 16], q_lens=[4, 4], state_slots=[0, 1], **kw)
        return rec

    def device() -> list:
        return [meta.positions_t.tolist(), meta.row_seq_t.tolist(), meta.row_live_t.tolist(),
                meta.kv_lens_t.tolist(), meta.slot_table_t.tolist(), meta.state_slots_t.tolist()]  # fmt: skip

    assert prepare(num_decode_seqs=2).num_puts == 3  # lengths, rows, table
    want = device()
    # Described again as a catch-up (prefill rows, every row valid): the same buffers, nothing copied; the host
    # fields are a full description's.
    assert prepare(num_decode_seqs=0, valid_q_lens=[4, 4]).num_puts == 0
    assert device() == want and meta.num_decode_seqs == 0 and meta.valid_q_lens == [4, 4]
    _, fresh = setup()
    fresh.kv_cache_manager = mgr
    fresh.prepare([5, 6], past_lens=[8, 16], q_lens=[4, 4], state_slots=[0, 1], num_decode_seqs=0, valid_q_lens=[4, 4])
    host = ("request_ids", "q_lens", "past_lens", "cu_seqlens", "state_slots", "num_seqs", "num_decode_seqs",
            "num_decode_tokens", "num_tokens", "max_kv_len", "num_padding_seqs", "valid_q_lens")  # fmt: skip
    assert {k: getattr(meta, k) for k in host} == {k: getattr(fresh, k) for k in host}
    # A rewrite on the device (as a draft's staging marks rows past an accepted count): the same description is copied
    # again (the table is not: nothing rewrites it).
    meta.row_seq_t[2:4] = -1
    meta.device_rewritten()
    assert meta.row_seq_t.tolist() != want[1]
    assert prepare(num_decode_seqs=2).num_puts == 2 and device() == want
    # Other rows (fewer valid ones): copied.
    rec = prepare(num_decode_seqs=0, valid_q_lens=[4, 3])
    assert rec.num_puts == 2 and meta.row_seq_t.tolist() == [0] * 4 + [1, 1, 1, -1]
    # A page more for one request: the table is copied, the same lengths and rows are not.
    mgr.ensure_capacity(6, 25)
    assert prepare(num_decode_seqs=0, valid_q_lens=[4, 3]).puts.total() == 1
    assert meta.slot_table_t[1, :4].tolist() == mgr.get_batch_slot_tables([6])[0][:4]


def test_unchanged_accepted_counts_are_not_copied_again() -> None:
    """Width-one rounds set the same (zero) accepted counts every step: copied once; new counts, or any after the
    device wrote the buffer (`accepted_written_on_device`), are copied, and the buffer always holds the counts last
    set."""
    import torch

    from trtllm_glm import traffic

    mgr, meta = setup()
    mgr.add_request(5, 12)
    mgr.add_request(6, 20)
    meta.prepare([5, 6], past_lens=[11, 19], q_lens=[1, 1], num_decode_seqs=2)

    def accept(counts: list[int]) -> int:
        with traffic.recording() as rec:
            meta.set_num_accepted(counts)
        assert meta.spec.num_accepted_t.tolist() == counts + [0] * (2 - len(counts))
        return rec.num_puts

    assert accept([0, 0]) == 1
    assert accept([0, 0]) == 0 and accept([0, 0]) == 0
    assert accept([2, 0]) == 1 and accept([2, 0]) == 0
    meta.accepted_buffer[:2].copy_(torch.tensor([3, 1]))  # as `runtime.verify_staging` writes it
    meta.accepted_written_on_device()
    assert meta.spec.num_accepted_t.tolist() == [3, 1]
    assert accept([2, 0]) == 1  # the device rewrote the buffer: the same counts are copied again
    assert accept([2]) == 1  # a shorter list is other counts (its padding entry is written 0)
