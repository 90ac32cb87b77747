"""`DecodeTailRing` (docs/design.md §6.2): rejected draft keys never reach the indexer tail ring or a visible pool.

Every test runs the torch reference ops and the Triton kernels (interpreted on the CPU) through
``update_decode_pools(..., tail_ring=...)``, each with both `DecodeTailRing.prepare_step` backends (the torch
reference and the one-launch Triton kernel, ``TRTLLM_GLM_TAIL_RING_BACKEND``), and compares, bit for bit,
against a reference run of the same backend that only ever received the accepted rows, fed one row per call
without a tail ring. Caches start poisoned (garbage e4m3 bytes, NaN scales, random rings) so a missed or stray
write shows. Section (f) compares the kernel with the reference directly on adversarial step sequences.
"""

from __future__ import annotations

from types import ModuleType

import pytest
import torch

from trtllm_glm.attention.sparse.glm_kpool import kernels as K
from trtllm_glm.attention.sparse.glm_kpool import ops as R
from trtllm_glm.cache.manager import KpoolLayerCache
from trtllm_glm.state.tail_ring import TAIL_RING_BACKEND_ENV, DecodeTailRing

pytest.importorskip("triton")

pytestmark = pytest.mark.cpu_only

D = 128
BACKENDS = pytest.mark.parametrize("be", [R, K], ids=["torch", "triton"])


@pytest.fixture(params=["torch", "triton"], ids=["ring-torch", "ring-triton"])
def ring_backend(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """`DecodeTailRing.prepare_step`'s backend for the test (the Triton one interpreted on the CPU)."""
    monkeypatch.setenv(TAIL_RING_BACKEND_ENV, request.param)
    return request.param


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({1: torch.uint8, 4: torch.int32, 8: torch.int64}[t.element_size()])


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(_bits(a), _bits(b))


def _cache(num_pages: int, page_size: int, num_slots: int, g: torch.Generator) -> KpoolLayerCache:
    index_k = torch.randint(0, 256, (num_pages, page_size // 4, D), generator=g, dtype=torch.uint8)
    index_scale = torch.full((num_pages, page_size // 4), float("nan"))
    ring = torch.randn(num_slots, 2, 4, D, generator=g) * 3
    latent = torch.zeros(num_pages, page_size, 1)
    return KpoolLayerCache(latent, index_k.view(torch.float8_e4m3fn), index_scale, ring, page_size)


def _clone(c: KpoolLayerCache) -> KpoolLayerCache:
    return KpoolLayerCache(c.latent.clone(), c.index_k.clone(), c.index_scale.clone(), c.tail_ring.clone(), c.page_size)


def _rows(n: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(n, D, generator=g), torch.randn(n, D, generator=g) * 2


def _pool_mask(table: torch.Tensor, committed: list[int], num_pages: int, page_size: int) -> torch.Tensor:
    """``[num_pages, P // 4]`` True where a pool a committed row can see lives (``4p + 3 <= last committed``)."""
    mask = torch.zeros(num_pages, page_size // 4, dtype=torch.bool)
    for b, last in enumerate(committed):
        for p in range((last + 1) // 4):
            mask[int(table[b, 4 * p // page_size]), p % (page_size // 4)] = True
    return mask


def _assert_pools(got: KpoolLayerCache, ref: KpoolLayerCache, mask: torch.Tensor, what: str) -> None:
    assert mask.any(), f"{what}: no pool to compare"
    bad = (_bits(got.index_k)[mask] != _bits(ref.index_k)[mask]).sum().item()
    assert bad == 0, f"{what}: {bad} index_k bytes of committed pools differ"
    bad = (_bits(got.index_scale)[mask] != _bits(ref.index_scale)[mask]).sum().item()
    assert bad == 0, f"{what}: {bad} scales of committed pools differ"


def _feed(be: ModuleType, cache: KpoolLayerCache, key, gate, ape, positions, row_seq, table, slots) -> None:
    """Reference: rows one at a time, no tail ring (each row is its own width-one decode step)."""
    for n in range(positions.numel()):
        s = slice(n, n + 1)
        be.update_decode_pools(cache, key[s], gate[s], ape, positions[s], row_seq[s], table, slots)


# ------------------------------------------------------------------------------------------------
# (a) The docs/design.md §6.2 counterexample
def _counterexample(be: ModuleType, use_ring: bool, next_width: int, num_accepted: int | None = None):
    """Positions 0-1 committed, verify 2..9 with only 2 accepted, next step from 3 (width ``next_width``).

    Returns ``(spec_cache, ref_cache, ring_or_None, truth_rows, ref_ring_at_3, mask)``.
    """
    g = _gen(100 + next_width)
    P, num_pages, S, slot = 8, 4, 3, 1
    spec = _cache(num_pages, P, S, g)
    ref = _clone(spec)
    ape = torch.randn(4, D, generator=g)
    table = torch.tensor([[2, 0]], dtype=torch.int32)
    slots = torch.tensor([slot])
    tk, tg = _rows(3 + next_width, g)  # truth rows of positions 0 .. 2 + next_width
    dk, dg = _rows(7, g)  # rejected drafts at positions 3 .. 9
    tr = DecodeTailRing(S, 8, "cpu") if use_ring else None
    kw = {"tail_ring": tr}

    def step(key, gate, p0):
        n = key.shape[0]
        pos, rs = torch.arange(p0, p0 + n), torch.zeros(n, dtype=torch.int64)
        extra = {} if num_accepted is None else {"num_accepted_tokens": torch.tensor([num_accepted])}
        be.update_decode_pools(spec, key, gate, ape, pos, rs, table, slots, **kw, **extra)

    step(tk[0:1], tg[0:1], 0)
    step(tk[1:2], tg[1:2], 1)
    step(torch.cat([tk[2:3], dk]), torch.cat([tg[2:3], dg]), 2)  # verify 2..9, only 2 accepted
    step(tk[3:], tg[3:], 3)

    n = 3 + next_width
    _feed(be, ref, tk[:3], tg[:3], ape, torch.arange(3), torch.zeros(3, dtype=torch.int64), table, slots)
    ring_at_3 = ref.tail_ring[slot].clone()
    _feed(be, ref, tk[3:], tg[3:], ape, torch.arange(3, n), torch.zeros(n - 3, dtype=torch.int64), table, slots)
    mask = _pool_mask(table, [n - 1], num_pages, P)
    return spec, ref, tr, (tk, tg), ring_at_3, mask


@BACKENDS
@pytest.mark.parametrize("next_width", [1, 6])
def test_design_counterexample_matches_accepted_only_run(be: ModuleType, next_width: int, ring_backend: str) -> None:
    spec, ref, tr, (tk, tg), ring_at_3, mask = _counterexample(be, True, next_width)
    assert _same(spec.tail_ring, ref.tail_ring), "ring differs from the accepted-only run"
    _assert_pools(spec, ref, mask, "with DecodeTailRing")
    slot = 1
    if next_width == 1:
        assert int(tr.saved_count[slot]) == 0  # a width-one round keeps no backup
    else:
        assert int(tr.saved_count[slot]) == next_width and int(tr.saved_pos[slot]) == 3
        assert _same(tr.snapshot[slot], ring_at_3), "snapshot is not the accepted-only ring at position 3"
        saved = torch.stack((tk[3:], tg[3:]), dim=1)
        assert _same(tr.saved_rows[slot, :next_width], saved)
    assert tr.num_disagreements == 0


@BACKENDS
@pytest.mark.parametrize("next_width", [1, 6])
def test_design_counterexample_is_a_real_hazard_without_the_ring(be: ModuleType, next_width: int) -> None:
    """Without the fix, pool 0 is built from the keys of (8, 9, 6, 3): the test above guards a real bug."""
    spec, ref, _, _, _, _ = _counterexample(be, False, next_width)
    assert not _same(spec.index_k[2, 0], ref.index_k[2, 0]) or not _same(spec.index_scale[2, 0], ref.index_scale[2, 0])
    if next_width == 1:  # a wide next step (3..8) rewrites every entry; width one leaves 8, 9, 6 behind
        assert not _same(spec.tail_ring[1], ref.tail_ring[1])


# ------------------------------------------------------------------------------------------------
# (b) Randomised token streams
@BACKENDS
def test_random_streams_match_accepted_only_run(be: ModuleType, ring_backend: str) -> None:
    g = _gen(7)
    P, S, max_rows, steps = 8, 7, 8, 10
    starts = [0, 1, 2, 3, 6]  # every ring alignment, two page offsets
    B = len(starts)
    max_len = max(starts) + steps * max_rows + 1
    pages_per_seq = -(-max_len // P)
    num_pages = B * pages_per_seq + 3
    spec = _cache(num_pages, P, S, g)
    ref = _clone(spec)
    ape = torch.randn(4, D, generator=g)
    table = torch.randperm(num_pages, generator=g)[: B * pages_per_seq].view(B, pages_per_seq).to(torch.int32)
    slots = torch.randperm(S, generator=g)[:B]
    truth = [_rows(max_len, g) for _ in range(B)]
    tr = DecodeTailRing(S, max_rows, "cpu")
    # Prompts: one prefill chunk per sequence (both runs), which also drops any backup of the slot.
    pre = [b for b in range(B) if starts[b] > 0]
    ppos = torch.cat([torch.arange(starts[b]) for b in pre])
    prs = torch.cat([torch.full((starts[b],), i) for i, b in enumerate(pre)])
    pk = torch.cat([truth[b][0][: starts[b]] for b in pre])
    pg = torch.cat([truth[b][1][: starts[b]] for b in pre])
    for c in (spec, ref):
        be.update_prefill(c, pk, pg, ape, ppos, prs, table[pre], slots[pre])
    tr.on_prefill(slots[pre])

    p0 = list(starts)
    prev_accepted, prev_width = [1] * B, [1] * B
    rejections = narrow_after_wide = 0
    for step in range(steps):
        # Some sequences sit a step out; widths include width-one rounds between wide ones.
        active = [b for b in range(B) if step == 0 or torch.rand((), generator=g) < 0.85]
        width = {
            b: 1 if torch.rand((), generator=g) < 0.3 else int(torch.randint(2, max_rows + 1, (), generator=g))
            for b in active
        }
        acc = {b: int(torch.randint(1, width[b] + 1, (), generator=g)) for b in active}
        keys, gates, pos, rs = [], [], [], []
        for i, b in enumerate(active):
            w, a = width[b], acc[b]
            dk, dg = _rows(w - a, g)  # rejected drafts: not the tokens that end up at those positions
            keys += [truth[b][0][p0[b] : p0[b] + a], dk]
            gates += [truth[b][1][p0[b] : p0[b] + a], dg]
            pos.append(torch.arange(p0[b], p0[b] + w))
            rs.append(torch.full((w,), i))
        key, gate, pos, rs = torch.cat(keys), torch.cat(gates), torch.cat(pos), torch.cat(rs)
        st_table, st_slots = table[active], slots[active]
        ring_before, ring_spec_before = ref.tail_ring.clone(), spec.tail_ring.clone()
        nat = torch.tensor([prev_accepted[b] for b in active])
        be.update_decode_pools(spec, key, gate, ape, pos, rs, st_table, st_slots, tail_ring=tr, num_accepted_tokens=nat)

        # The ring = accepted-only ring + this step's rows; the backup = accepted-only ring + the rows.
        expect = _clone(ref)
        be.update_decode_pools(expect, key, gate, ape, pos, rs, st_table, st_slots)
        # Sequences sitting out keep their (possibly not yet rolled back) rings: only their own step restores.
        assert _same(spec.tail_ring[st_slots], expect.tail_ring[st_slots]), f"step {step}: ring"
        idle = [int(slots[b]) for b in range(B) if b not in active]
        assert _same(spec.tail_ring[idle], ring_spec_before[idle]), f"step {step}: idle rings"
        first = 0
        for b in active:
            s, w = int(slots[b]), width[b]
            if w == 1:
                assert int(tr.saved_count[s]) == 0, f"step {step}: width-one round kept a backup"
            else:
                assert int(tr.saved_count[s]) == w and int(tr.saved_pos[s]) == p0[b]
                assert _same(tr.snapshot[s], ring_before[s]), f"step {step}, seq {b}: snapshot"
                rows = torch.stack((key[first : first + w], gate[first : first + w]), dim=1)
                assert _same(tr.saved_rows[s, :w], rows), f"step {step}, seq {b}: saved rows"
            first += w

        # Commit: the reference receives the accepted rows one by one.
        for b in active:
            a = acc[b]
            rs1 = torch.zeros(a, dtype=torch.int64)
            tk, tg = truth[b][0][p0[b] : p0[b] + a], truth[b][1][p0[b] : p0[b] + a]
            _feed(be, ref, tk, tg, ape, torch.arange(p0[b], p0[b] + a), rs1, table[b : b + 1], slots[b : b + 1])
            p0[b] += a
            rejections += a < width[b]
            narrow_after_wide += width[b] == 1 and prev_width[b] > 1
            prev_accepted[b], prev_width[b] = a, width[b]
        mask = _pool_mask(table, [p - 1 for p in p0], num_pages, P)
        _assert_pools(spec, ref, mask, f"step {step}")

    # A last width-one round for everyone restores every ring to the accepted-only one.
    pos = torch.tensor(p0)
    rs = torch.arange(B)
    key = torch.stack([truth[b][0][p0[b]] for b in range(B)])
    gate = torch.stack([truth[b][1][p0[b]] for b in range(B)])
    be.update_decode_pools(spec, key, gate, ape, pos, rs, table, slots, tail_ring=tr)
    be.update_decode_pools(ref, key, gate, ape, pos, rs, table, slots)
    assert _same(spec.tail_ring, ref.tail_ring)
    _assert_pools(spec, ref, _pool_mask(table, p0, num_pages, P), "final")
    assert tr.num_disagreements == 0
    assert int(tr.saved_count.sum()) == 0
    # The stream really exercised roll-backs and width transitions (guards against a degenerate seed).
    assert rejections >= 15 and narrow_after_wide >= 3, (rejections, narrow_after_wide)


# ------------------------------------------------------------------------------------------------
# (c) Scheduler count cross-check
@BACKENDS
def test_scheduler_count_is_a_cross_check_only(be: ModuleType, ring_backend: str) -> None:
    right, ref, tr_right, _, _, _ = _counterexample(be, True, 6, num_accepted=1)
    assert tr_right.num_disagreements == 0
    # Wrong count: 3 on the step after the verify (the other steps have no backup to check against).
    wrong, _, tr_wrong, _, _, _ = _counterexample(be, True, 6, num_accepted=3)
    assert tr_wrong.num_disagreements == 1
    for name in ("index_k", "index_scale", "tail_ring"):
        assert _same(getattr(wrong, name), getattr(right, name)), f"{name}: the wrong count changed the result"
    for name in ("snapshot", "saved_rows", "saved_pos", "saved_count"):
        assert _same(getattr(tr_wrong, name), getattr(tr_right, name)), name
    assert _same(right.tail_ring, ref.tail_ring)


@BACKENDS
def test_out_of_range_accepted_length_and_overwide_step_are_counted(be: ModuleType, ring_backend: str) -> None:
    g = _gen(5)
    S, slot = 2, 0
    cache = _cache(4, 8, S, g)
    ape = torch.randn(4, D, generator=g)
    table, slots = torch.tensor([[1, 2]], dtype=torch.int32), torch.tensor([slot])
    tr = DecodeTailRing(S, 4, "cpu")

    def step(p0: int, w: int) -> None:
        k, gt = _rows(w, g)
        rs = torch.zeros(w, dtype=torch.int64)
        be.update_decode_pools(cache, k, gt, ape, torch.arange(p0, p0 + w), rs, table, slots, tail_ring=tr)

    step(0, 3)
    after = cache.tail_ring.clone()
    step(5, 1)  # 5 rows past a 3-row backup: every saved row replayed (ring kept), clamped and counted
    assert tr.num_disagreements == 1
    assert _same(cache.tail_ring[slot, :, [0, 2, 3]], after[slot, :, [0, 2, 3]])  # entry 1 now holds 5
    step(6, 5)  # wider than max_rows: no backup, counted
    assert tr.num_disagreements == 2 and int(tr.saved_count[slot]) == 0


# ------------------------------------------------------------------------------------------------
# (d) Prefill drops the backup
@BACKENDS
@pytest.mark.parametrize("mode", ["fresh", "resume"])
def test_prefill_drops_a_stale_backup(be: ModuleType, mode: str, ring_backend: str) -> None:
    """A slot whose last decode step was wide gets a prefill of 0..6, then a decode step at 7.

    ``fresh``: the slot was freed by another request after a verify of 2..9 (no teardown reset) and is now
    reused. ``resume``: the same request verified 2..9, accepted 2, 3, 4, was preempted and is re-prefilled
    from scratch. Either way the decode step at 7 derives ``a = 7 - 2 = 5`` from the stale backup:
    restoring would put the old rows of 2..6 (rejected drafts at 5 and 6) back over the prefill's keys and
    build pool 1 (positions 4..7) from them.
    """
    g = _gen(11)
    P, S, slot = 8, 2, 1
    table, slots = torch.tensor([[3, 1]], dtype=torch.int32), torch.tensor([slot])
    base = _cache(4, P, S, g)
    ape = torch.randn(4, D, generator=g)
    tk, tg = _rows(8, g)
    hk, hg = _rows(10, g)  # history: another request's rows, or (resume) the truth with drafts from 5 on
    if mode == "resume":
        hk[:5], hg[:5] = tk[:5], tg[:5]
    seq0 = torch.zeros(8, dtype=torch.int64)

    def run(call_on_prefill: bool) -> KpoolLayerCache:
        c = _clone(base)
        tr = DecodeTailRing(S, 8, "cpu")
        for p in range(2):
            be.update_decode_pools(
                c, hk[p : p + 1], hg[p : p + 1], ape, torch.tensor([p]), seq0[:1], table, slots, tail_ring=tr
            )
        be.update_decode_pools(c, hk[2:], hg[2:], ape, torch.arange(2, 10), seq0, table, slots, tail_ring=tr)
        c.tail_ring[slot].zero_()  # the manager zeroes the state slot of a new or resumed request
        be.update_prefill(c, tk[:7], tg[:7], ape, torch.arange(7), seq0[:7], table, slots)
        if call_on_prefill:
            tr.on_prefill(slots)
        be.update_decode_pools(c, tk[7:], tg[7:], ape, torch.tensor([7]), seq0[:1], table, slots, tail_ring=tr)
        assert tr.num_disagreements == 0
        return c

    ref = _clone(base)
    ref.tail_ring[slot].zero_()
    _feed(be, ref, tk, tg, ape, torch.arange(8), seq0, table, slots)
    mask = _pool_mask(table, [7], 4, P)
    good = run(True)
    assert _same(good.tail_ring, ref.tail_ring)
    _assert_pools(good, ref, mask, "with on_prefill")
    stale = run(False)  # sanity: the case really corrupts when the backup survives the prefill
    assert not _same(stale.index_k[3, 1], ref.index_k[3, 1]) or not _same(
        stale.index_scale[3, 1], ref.index_scale[3, 1]
    )


# ------------------------------------------------------------------------------------------------
# (e) Slots outside the step
@BACKENDS
def test_slots_outside_the_step_are_untouched(be: ModuleType, ring_backend: str) -> None:
    g = _gen(13)
    P, S, R_ = 8, 6, 5
    cache = _cache(16, P, S, g)
    ape = torch.randn(4, D, generator=g)
    tr = DecodeTailRing(S, R_, "cpu")
    # Poisoned backups everywhere, with live counts: touching a slot by mistake would restore garbage.
    tr.snapshot.copy_(torch.randn(tr.snapshot.shape, generator=g))
    tr.snapshot[3, 0, 1] = float("nan")
    tr.saved_rows.copy_(torch.randn(tr.saved_rows.shape, generator=g))
    tr.saved_pos.copy_(torch.randint(0, 40, (S,), generator=g))
    tr.saved_count.copy_(torch.randint(1, R_ + 1, (S,), generator=g))
    tr.saved_pos[0], tr.saved_count[0] = 10, 3
    tr.saved_pos[5], tr.saved_count[5] = 20, 2
    cache.tail_ring[4, 1, 2] = float("nan")
    cache.tail_ring[3, 0, 0] = float("nan")  # rewritten in place (slot 3 is named), so its bits must survive
    # Sequences 0 and 2 have rows (slots 0 and 5); sequence 1 (slot 3) and 3 (a stale copy of slot 0) none.
    table = torch.arange(16, dtype=torch.int32).view(4, 4)
    slots = torch.tensor([0, 3, 5, 0])
    pos = torch.tensor([11, 12, 13, 22])
    rs = torch.tensor([0, 0, 0, 2])
    key, gate = _rows(4, g)
    ring0, state0 = (
        cache.tail_ring.clone(),
        [t.clone() for t in (tr.snapshot, tr.saved_rows, tr.saved_pos, tr.saved_count)],
    )
    be.update_decode_pools(cache, key, gate, ape, pos, rs, table, slots, tail_ring=tr)
    others = [1, 2, 3, 4]
    assert _same(cache.tail_ring[others], ring0[others])
    for now, before in zip((tr.snapshot, tr.saved_rows, tr.saved_pos, tr.saved_count), state0):
        assert _same(now[others], before[others])

    # The stale duplicate entry changes nothing against a batch without it.
    cache2 = _cache(16, P, S, _gen(13))
    tr2 = DecodeTailRing(S, R_, "cpu")
    for dst, src in zip((tr2.snapshot, tr2.saved_rows, tr2.saved_pos, tr2.saved_count), state0):
        dst.copy_(src)
    cache2.tail_ring.copy_(ring0)
    be.update_decode_pools(cache2, key, gate, ape, pos, rs, table[:3], slots[:3], tail_ring=tr2)
    assert _same(cache2.tail_ring, cache.tail_ring)
    for a, b in zip(
        (tr.snapshot, tr.saved_rows, tr.saved_pos, tr.saved_count),
        (tr2.snapshot, tr2.saved_rows, tr2.saved_pos, tr2.saved_count),
    ):
        assert _same(a, b)


def test_prepare_step_ignores_padding_rows_and_bad_slots(ring_backend: str) -> None:
    g = _gen(17)
    S = 4
    tr = DecodeTailRing(S, 4, "cpu")
    ring = torch.randn(S, 2, 4, D, generator=g)
    key, gate = _rows(5, g)
    pos = torch.tensor([8, 9, 3, 4, 5])
    rs = torch.tensor([0, 0, -1, 1, 1])  # a padding row, and sequence 1 names slot -1
    ring0 = ring.clone()
    tr.prepare_step(ring, key, gate, pos, rs, torch.tensor([2, -1]))
    assert _same(ring, ring0)  # nothing to restore anywhere; slot -1's rows touch no ring
    assert tr.saved_count.tolist() == [0, 0, 2, 0] and int(tr.saved_pos[2]) == 8
    assert _same(tr.saved_rows[2, :2], torch.stack((key[:2], gate[:2]), dim=1))
    assert tr.num_disagreements == 0


def test_on_prefill_and_reset() -> None:
    tr = DecodeTailRing(4, 3, "cpu")
    tr.saved_count.fill_(2)
    tr.on_prefill(torch.tensor([1, 1, -1, 7]))  # duplicates and padding ids are fine
    assert tr.saved_count.tolist() == [2, 0, 2, 2]
    tr.on_prefill([3])
    tr.reset(0)
    assert tr.saved_count.tolist() == [0, 0, 2, 0]
    with pytest.raises(IndexError):
        tr.reset(4)
    tr.reset()
    assert int(tr.saved_count.sum()) == 0


# ------------------------------------------------------------------------------------------------
# (f) The Triton kernel against the torch reference, on adversarial step sequences
_PLANES = ("snapshot", "saved_rows", "saved_pos", "_saved_count", "num_disagreements_t")


def _poisoned_ring_state(S: int, R: int, g: torch.Generator) -> tuple[torch.Tensor, DecodeTailRing]:
    """A random ring and a `DecodeTailRing` with random live backups (no zeros anywhere), some NaN payloads."""
    ring = torch.randn(S, 2, 4, D, generator=g) * 3 + 0.5
    tr = DecodeTailRing(S, R, "cpu")
    tr.snapshot.copy_(torch.randn(tr.snapshot.shape, generator=g) - 2)
    tr.saved_rows.copy_(torch.randn(tr.saved_rows.shape, generator=g) + 2)
    tr.saved_pos.copy_(torch.randint(0, 30, (S,), generator=g))
    tr.saved_count.copy_(torch.randint(0, R + 1, (S,), generator=g))
    tr.saved_count[S // 2] = R + 2  # corrupt: more rows than a backup holds (replays clamp to the last one)
    tr.num_disagreements_t.fill_(5)
    # NaNs with distinct payloads: a copy that goes through arithmetic or a different value shows in the bits.
    for t in (ring, tr.snapshot, tr.saved_rows):
        flat = t.view(-1).view(torch.int32)
        idx = torch.randint(0, flat.numel(), (8,), generator=g)
        flat[idx] = 0x7FC00000 + torch.arange(1, 9, dtype=torch.int32)
    return ring, tr


def _clone_ring_state(tr: DecodeTailRing) -> DecodeTailRing:
    out = DecodeTailRing(tr.num_state_slots, tr.max_rows, "cpu")
    for name in _PLANES:
        getattr(out, name).copy_(getattr(tr, name))
    return out


def _assert_same_state(
    got: DecodeTailRing, want: DecodeTailRing, ring: torch.Tensor, ring_ref: torch.Tensor, what: str
):
    assert _same(ring, ring_ref), f"{what}: ring"
    for name in _PLANES:
        assert _same(getattr(got, name), getattr(want, name)), f"{what}: {name}"


def _adversarial_step(S: int, R: int, g: torch.Generator, saved_pos: torch.Tensor, garbage: bool):
    """One step's inputs: sequences with rows (widths 1, wide, wider than ``R``) whose first positions fall
    inside, before and past the slot's backup; sequences without rows naming free slots, slots of other
    sequences (stale duplicates) or out-of-range ids; sequences with rows but an out-of-range slot; padding
    rows (``row_seq`` -1 or ``>= B``) between sequences. ``garbage``: also two sequences with rows on one slot
    and rows out of order (no valid batch has those; the kernel must still agree with the reference)."""

    def rint(lo: int, hi: int) -> int:
        return int(torch.randint(lo, hi, (), generator=g))

    def chance(p: float) -> bool:
        return bool(torch.rand((), generator=g) < p)

    num_real = rint(1, min(S, 6) + 1)
    real_slots = torch.randperm(S, generator=g)[:num_real].tolist()
    seqs: list[tuple[int, int]] = []  # (slot id, width); width 0: no rows
    for s in real_slots:
        w = 1 if chance(0.3) else rint(2, R + 1) if chance(0.75) else rint(R + 1, R + 4)
        seqs.append((s, w))
    for _ in range(rint(0, 5)):
        kind = rint(0, 4)
        if kind == 0:  # a stale duplicate of a slot with rows
            seqs.append((real_slots[rint(0, num_real)], 0))
        elif kind == 1:  # an id outside [0, S), with or without rows
            seqs.append(([-1, -7, S, S + 3][rint(0, 4)], rint(0, 3)))
        elif kind == 2:  # a free slot, named by a sequence without rows (prefill / padding entry)
            seqs.append((rint(0, S), 0))
        elif garbage:  # a second sequence with rows on a slot that already has rows
            seqs.append((real_slots[rint(0, num_real)], rint(1, 3)))
    order = torch.randperm(len(seqs), generator=g).tolist()
    seqs = [seqs[i] for i in order]
    B = len(seqs)
    pos, rs = [], []
    for b, (s, w) in enumerate(seqs):
        if chance(0.3):  # padding rows between sequences
            n = rint(1, 3)
            pos += [rint(0, 50) for _ in range(n)]
            rs += [-1 if chance(0.7) else B + rint(0, 3) for _ in range(n)]
        if w == 0:
            continue
        base = int(saved_pos[s]) if 0 <= s < S else 10
        p0 = max(base + rint(-2, R + 3), 0)  # a inside, below and past the backup
        pos += list(range(p0, p0 + w))
        rs += [b] * w
    N = len(pos)
    pos_t, rs_t = torch.tensor(pos, dtype=torch.int64), torch.tensor(rs, dtype=torch.int64)
    if garbage and N > 1 and chance(0.5):
        perm = torch.randperm(N, generator=g)
        pos_t, rs_t = pos_t[perm], rs_t[perm]
    slots = torch.tensor([s for s, _ in seqs], dtype=torch.int64)
    nat = torch.randint(0, R + 2, (B,), generator=g) if chance(0.7) else None
    return pos_t, rs_t, slots, nat


@pytest.mark.parametrize("max_rows", [4, 5])
@pytest.mark.parametrize("key_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("garbage", [False, True], ids=["valid", "garbage"])
def test_kernel_matches_reference_on_adversarial_steps(
    max_rows: int, key_dtype: torch.dtype, index_dtype: torch.dtype, garbage: bool
) -> None:
    """Eight consecutive steps on one pool, kernel vs reference, every plane and the counter bit for bit."""
    g = _gen(1000 + 7 * max_rows + (key_dtype == torch.float16) + 2 * (index_dtype == torch.int32) + 4 * garbage)
    S, R_ = 11, max_rows
    ring_ref, ref = _poisoned_ring_state(S, R_, g)
    ring, tr = ring_ref.clone(), _clone_ring_state(ref)
    restores = backups = clamped = 0
    for step in range(8):
        pos, rs, slots, nat = _adversarial_step(S, R_, g, ref.saved_pos, garbage)
        N = pos.numel()
        key = (torch.randn(N, D, generator=g) * 2).to(key_dtype)
        gate = (torch.randn(N, D, generator=g) + 1).to(key_dtype)
        pos, rs, slots = pos.to(index_dtype), rs.to(index_dtype), slots.to(index_dtype)
        nat = None if nat is None else nat.to(index_dtype)
        count_before = ref.saved_count.clone()
        ring_before, state_before = ring.clone(), _clone_ring_state(tr)
        ref.prepare_step(ring_ref, key, gate, pos, rs, slots, nat, backend="torch")
        tr.prepare_step(ring, key, gate, pos, rs, slots, nat, backend="triton")
        _assert_same_state(tr, ref, ring, ring_ref, f"step {step}")

        # Slots without (valid) rows keep every bit, whoever names them.
        b_ok = (rs >= 0) & (rs < slots.numel())
        row_slot = slots.to(torch.int64)[rs.to(torch.int64).clamp(0, slots.numel() - 1)]
        has_rows = torch.zeros(S, dtype=torch.bool)
        has_rows[row_slot[b_ok & (row_slot >= 0) & (row_slot < S)]] = True
        idle = (~has_rows).nonzero().flatten()
        assert _same(ring[idle], ring_before[idle]), f"step {step}: idle rings"
        for name in _PLANES[:4]:
            now, before = getattr(tr, name), getattr(state_before, name)
            assert _same(now[idle], before[idle]), f"step {step}: idle {name}"
        restores += int((has_rows & (count_before > 0)).sum())
        backups += int((tr.saved_count > 0).logical_and(has_rows).sum())
        clamped = int(tr.num_disagreements_t)

        # The layer then writes the step's rows: new, random ring contents for touched slots (never zeros).
        touched = has_rows.nonzero().flatten()
        fresh = torch.randn(touched.numel(), 2, 4, D, generator=g) - 1
        ring[touched], ring_ref[touched] = fresh, fresh
    # The sequence exercised restores, backups and counted disagreements (guards against a degenerate seed).
    assert restores >= 8 and backups >= 8 and clamped > 5, (restores, backups, clamped)


def test_kernel_reads_strided_inputs() -> None:
    """Non-contiguous key / gate rows and strided index vectors (views of wider step tensors)."""
    g = _gen(23)
    S, R_ = 5, 4
    ring_ref, ref = _poisoned_ring_state(S, R_, g)
    ring, tr = ring_ref.clone(), _clone_ring_state(ref)
    fused = torch.randn(6, 3 * D, generator=g)
    key, gate = fused[:, :D], fused[:, 2 * D :]
    idx = torch.tensor([[5, 0], [6, 0], [7, 0], [20, 0], [21, 0], [2, 0]])[:, 0]
    pos = torch.stack((idx, idx), dim=1)[:, 1]
    rs = torch.tensor([[0, 9], [0, 9], [0, 9], [1, 9], [1, 9], [-1, 9]])[:, 0]
    slots = torch.tensor([[3, 0], [1, 0]])[:, 0]
    nat = torch.tensor([[2, 0], [1, 0]])[:, 0]
    assert not (key.is_contiguous() or pos.is_contiguous() or rs.is_contiguous() or slots.is_contiguous())
    ref.saved_pos[3], ref.saved_count[3] = 3, 4
    tr.saved_pos[3], tr.saved_count[3] = 3, 4
    ref.prepare_step(ring_ref, key, gate, pos, rs, slots, nat, backend="torch")
    tr.prepare_step(ring, key, gate, pos, rs, slots, nat, backend="triton")
    _assert_same_state(tr, ref, ring, ring_ref, "strided")
    assert int(tr.saved_count[3]) == 3 and int(tr.saved_count[1]) == 2


def test_backend_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    """``auto`` keeps CPU tensors on the reference; an unknown name is refused; empty steps do nothing."""
    from trtllm_glm.state import kernels as SK

    calls: list[int] = []
    monkeypatch.setattr(SK, "tail_ring_prepare_step", lambda *a, **k: calls.append(1))
    tr = DecodeTailRing(3, 2, "cpu")
    ring = torch.randn(3, 2, 4, D)
    key = torch.randn(2, D)
    args = (ring, key, key, torch.tensor([4, 5]), torch.tensor([0, 0]), torch.tensor([1]))
    tr.prepare_step(*args)
    assert calls == [] and int(tr.saved_count[1]) == 2
    monkeypatch.setenv(TAIL_RING_BACKEND_ENV, "triton")
    tr.prepare_step(*args)
    assert calls == [1]
    tr.prepare_step(ring, key[:0], key[:0], torch.tensor([], dtype=torch.int64), torch.tensor([], dtype=torch.int64),
                    torch.tensor([1]))  # fmt: skip
    assert calls == [1]
    monkeypatch.setenv(TAIL_RING_BACKEND_ENV, "bogus")
    with pytest.raises(ValueError, match="backend"):
        tr.prepare_step(*args)
