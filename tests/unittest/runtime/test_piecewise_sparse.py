"""Sparse-MLA cores inside the piecewise graphs too (`trtllm_glm.attention.sparse.glm_kpool.static_step`,
`PiecewiseRunner(sparse_inside=True)`) on the CPU, the runner emulated: an admission step (decoding requests with new
short prompts of uneven lengths) runs its whole trunk as one graph, no eager core, and gives the bits of the runner as
merged (KDA cores inside, sparse cores eager) on the same padded buckets and of the plain eager forward where no step
is padded: tokens, logits, hidden, pages, pools, tail rings and KDA slots; steps that do not qualify (a chunk over the
short-prefill limit, decode rows only) take the merged path in between; the padding rows write nothing (free pages,
free slots and the padding slot's tail ring poisoned with NaN first stay bit for bit, and so do idle requests' pages
and the stepping requests' cached tokens and pools). With a speculative executor's MTP tail rings (the indexer's
decode pass with its rollback and backup, and the prefill pass, both inside) also the rings' backups and
disagreement counters are the merged runner's, and a decode-only step runs as one graph too.

Request ids run past the pools (12 state slots, ids from 40), a finished request's slot and pages are reused by the
next one. The k-pool ops are the torch references, or the cache writes go through the Triton kernels (interpreted;
`spec_helpers.kpool_writes_through_kernels`), as in the decode graphs' emulated tests. The real capture and replay:
``test_piecewise_gpu.py``.
"""

from __future__ import annotations

import pytest
import torch

from benchmarks.harness.model_harness import ModelHarness
from tests.piecewise_helpers import free_requests, harness_step, run_admissions, slice_harness, slice_model
from tests.spec_helpers import kpool_writes_through_kernels
from trtllm_glm import envs
from trtllm_glm.runtime.executor import Executor
from trtllm_glm.runtime.piecewise import PIECEWISE_ENV, PiecewiseRunner

pytestmark = pytest.mark.cpu_only

SHORT = 16  # the short-prefill limit (the CPU default is 0: every prefill chunked)
Step = tuple[list[tuple[int, int]], int, list[int]]  # ([(request, rows)], decode sequences, requests freed before)


@pytest.fixture(autouse=True)
def _env(monkeypatch) -> None:
    monkeypatch.setenv(envs.KDA_SHORT_PREFILL.name, str(SHORT))
    monkeypatch.setenv(envs.KDA_DECODE_RIDE.name, "0")


@pytest.fixture(params=["references", "kernels"])
def backend(request, monkeypatch) -> str:
    """The k-pool ops: the torch references (the CPU's default), or the cache writes through the Triton kernels
    (interpreted), as the decode graphs' emulated tests run them. Both skip padding rows."""
    if request.param == "kernels":
        kpool_writes_through_kernels(monkeypatch)
    else:
        monkeypatch.setenv("TRTLLM_GLM_KPOOL_BACKEND", "torch")
    return request.param


def _admission_steps() -> list[Step]:
    """Rows per step (decode sequences first; request ids past the 12 slots): a pure short prefill (17 rows, bucket
    32), an admission (3 decode rows, prompts of 7 and 12: 22 -> 32), a fallback (a 20-row chunk, over the limit),
    an admission right after request 41 finished (request 50 takes its slot and pages; 11 -> 16), decode rows only
    (the merged path), an admission on a bucket edge (16 rows), a continuing short chunk with a one-token prompt."""
    return [
        ([(40, 5), (41, 9), (42, 3)], 0, []),
        ([(40, 1), (41, 1), (42, 1), (43, 7), (44, 12)], 3, []),
        ([(40, 1), (41, 1), (42, 1), (43, 1), (44, 1), (45, 20)], 5, []),
        ([(40, 1), (42, 1), (43, 1), (44, 1), (45, 1), (50, 4), (46, 2)], 5, [41]),
        ([(40, 1), (42, 1), (43, 1), (44, 1), (45, 1), (50, 1), (46, 1)], 7, []),
        ([(40, 1), (42, 1), (47, 14)], 2, []),
        ([(40, 1), (42, 1), (43, 1), (47, 5), (48, 1)], 3, []),
    ]


TRUNK = [True, True, False, True, False, True, True]  # which steps run the whole trunk as one graph
FALLBACK = 2  # every core eager


def _tokens(steps: list[Step], seed: int) -> dict[int, list[int]]:
    g = torch.Generator().manual_seed(seed)
    return {r: torch.randint(0, 264, (64,), generator=g).tolist() for rows, _, _ in steps for r, _ in rows}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return (
        t.view(torch.uint8)
        if t.element_size() == 1
        else t.view({8: torch.int64, 4: torch.int32, 2: torch.int16}[t.element_size()])
    )


def _caches(h: ModelHarness) -> list[torch.Tensor]:
    """Every plane a step writes: latent rows, pooled keys and scales, tail rings, KDA states."""
    m, st = h.manager, h.manager.state
    planes = [m.latent, m.index_k, st.tail_ring, st.kda_recurrent, st.kda_conv]
    return planes + ([m.index_scale] if m.index_scale is not None else [])


def _counts(runner: PiecewiseRunner, before: tuple[int, int]) -> tuple[int, int]:
    return runner.stats.trunk_steps - before[0], runner.stats.eager_cores - before[1]


def test_trunk_graph_matches_merged_runner(backend) -> None:
    """Twin caches, the same padded buckets: the whole trunk as one graph against the runner as merged (sparse cores
    eager): hidden, logits, greedy tokens and every cache plane bit for bit after each step; zero eager cores in the
    qualifying steps, the merged path's counts in the others."""
    model = slice_model()
    steps = _admission_steps()
    toks = _tokens(steps, 0)
    (ha, pad_a), (hb, pad_b) = slice_harness(model), slice_harness(model)
    merged = PiecewiseRunner(model, max_num_tokens=48, emulate=True, padding_slot=pad_a, sparse_inside=False)
    trunk = PiecewiseRunner(model, max_num_tokens=48, emulate=True, padding_slot=pad_b)
    for i, (rows, nd, freed) in enumerate(steps):
        if i == 3:  # request 41's slot and pages, which request 50 takes right after it finished
            gone = hb.manager.get_batch_state_slots([41]), set(hb.manager.page_lists([41])[0])
        free_requests(ha, freed)
        free_requests(hb, freed)
        # The same padding rows in both (the CPU MoE computes dead rows too: their values move the real rows'
        # rounding); the trunk's sparse core writes zeros there, as the merged runner's zeroed carry holds.
        for r in (merged, trunk):
            for buf in r._carry.values():
                buf.zero_()
        before = trunk.stats.trunk_steps, trunk.stats.eager_cores
        want = harness_step(ha, merged, rows, nd, toks)
        have = harness_step(hb, trunk, rows, nd, toks)
        assert torch.equal(_bits(have), _bits(want)), f"step {i}: hidden bits differ"
        lw, lh = model.compute_logits(want), model.compute_logits(have)
        assert torch.equal(_bits(lh), _bits(lw)) and torch.equal(lh.argmax(-1), lw.argmax(-1)), f"step {i}: logits"
        for a, b in zip(_caches(ha), _caches(hb)):
            assert torch.equal(_bits(a), _bits(b)), f"step {i}: a cache plane differs"
        expect = (1, 0) if TRUNK[i] else (0, 4 if i == FALLBACK else 1)
        assert _counts(trunk, before) == expect, f"step {i}: (trunk steps, eager cores) {_counts(trunk, before)}"
        if i == 3:
            assert hb.manager.get_batch_state_slots([50]) == gone[0] != [50]
            assert set(hb.manager.page_lists([50])[0]) & gone[1]
    assert hb.manager.get_batch_state_slots([50]) == ha.manager.get_batch_state_slots([50])
    assert trunk.stats.trunk_steps == sum(TRUNK) and merged.stats.trunk_steps == 0


# With MTP tail rings the decode-only step runs as one graph too (the eager indexer's two passes, fixed-shape).
TRUNK_RING = [True, True, False, True, True, True, True]


def _ring_step(h: ModelHarness, runner: PiecewiseRunner, rows, nd: int, toks, poke: int) -> torch.Tensor:
    """`harness_step` as a speculative executor runs it: the accepted counts set after ``prepare``, and the rings'
    backups of the step's sequences poked (seed ``poke``: a snapshot, saved rows, their first position and count), so
    that the decode pass restores a snapshot and replays accepted rows, and the prefill sequences' backups are
    dropped."""
    g = torch.Generator().manual_seed(poke)

    def poke_rings(rids: list[int]) -> None:
        for tr in h.manager.state.decode_tail_rings:
            for s, rid in zip(h.manager.get_batch_state_slots(rids), rids):
                tr.snapshot[s] = torch.randn(tr.snapshot[s].shape, generator=g)
                tr.saved_rows[s] = torch.randn(tr.saved_rows[s].shape, generator=g)
                tr.saved_count[s] = tr.max_rows
                tr.saved_pos[s] = max(h.lengths[rid] - 2, 0)  # two of them accepted
        h.meta.set_num_accepted([2 if i % 2 else 1 for i in range(len(rids))])  # (some disagree: the counter moves)

    return harness_step(h, runner, rows, nd, toks, after_prepare=poke_rings)


def test_trunk_graph_with_tail_rings(backend) -> None:
    """A speculative executor's manager (MTP tail rings) on twin caches: the whole trunk as one graph, the decode
    pass's rollback and backup and the prefill pass fixed-shape, against the runner as merged: hidden, logits, every
    cache plane and the rings' backups and disagreement counters bit for bit after each step."""
    model = slice_model()
    steps = _admission_steps()
    toks = _tokens(steps, 3)
    (ha, pad_a), (hb, pad_b) = slice_harness(model), slice_harness(model)
    for h in (ha, hb):
        h.manager.enable_decode_tail_rings(4)
    merged = PiecewiseRunner(model, max_num_tokens=48, emulate=True, padding_slot=pad_a, sparse_inside=False)
    trunk = PiecewiseRunner(model, max_num_tokens=48, emulate=True, padding_slot=pad_b)
    for i, (rows, nd, freed) in enumerate(steps):
        free_requests(ha, freed)
        free_requests(hb, freed)
        for r in (merged, trunk):
            for buf in r._carry.values():
                buf.zero_()
        before = trunk.stats.trunk_steps, trunk.stats.eager_cores
        want = _ring_step(ha, merged, rows, nd, toks, poke=i)
        have = _ring_step(hb, trunk, rows, nd, toks, poke=i)
        assert torch.equal(_bits(have), _bits(want)), f"step {i}: hidden bits differ"
        assert torch.equal(_bits(model.compute_logits(have)), _bits(model.compute_logits(want))), f"step {i}: logits"
        for a, b in zip(_caches(ha), _caches(hb)):
            assert torch.equal(_bits(a), _bits(b)), f"step {i}: a cache plane differs"
        for ta, tb in zip(ha.manager.state.decode_tail_rings, hb.manager.state.decode_tail_rings):
            for name in ("snapshot", "saved_rows", "saved_pos", "_saved_count", "num_disagreements_t"):
                assert torch.equal(getattr(ta, name), getattr(tb, name)), f"step {i}: the ring's {name} differs"
        expect = (1, 0) if TRUNK_RING[i] else (0, 4)
        assert _counts(trunk, before) == expect, f"step {i}: (trunk steps, eager cores) {_counts(trunk, before)}"
    assert ha.manager.state.decode_tail_rings[0].num_disagreements > 0  # (the cross-check ran)


def test_trunk_graph_bits_without_padding() -> None:
    """Buckets on every step's row count (no padding row), the torch references throughout (no padding row needs
    skipping): every step is the plain eager forward's bit for bit, the qualifying ones as one graph."""
    model = slice_model()
    steps = _admission_steps()
    toks = _tokens(steps, 1)
    (ha, _), (hb, pad) = slice_harness(model), slice_harness(model)
    assert pad == 0
    sizes = sorted({sum(n for _, n in rows) for rows, _, _ in steps})
    runner = PiecewiseRunner(model, max_num_tokens=48, buckets=sizes, emulate=True, padding_slot=pad)
    got = []
    for i, (rows, nd, freed) in enumerate(steps):
        free_requests(ha, freed)
        free_requests(hb, freed)
        before = runner.stats.trunk_steps, runner.stats.eager_cores
        want = harness_step(ha, None, rows, nd, toks)
        have = harness_step(hb, runner, rows, nd, toks)
        assert torch.equal(_bits(model.compute_logits(have)), _bits(model.compute_logits(want))), f"step {i}: logits"
        assert torch.equal(_bits(have), _bits(want)), f"step {i}: hidden bits differ"
        got.append(_counts(runner, before))
        for j, (a, b) in enumerate(zip(_caches(ha), _caches(hb))):
            if j in (3, 4):  # KDA states but the padding slot's (0: the padding entries step it in the runner only)
                a, b = a[:, 1:], b[:, 1:]
            assert torch.equal(_bits(a), _bits(b)), f"step {i}: a cache plane differs"
    # Step 0 falls back to every core eager here (three prompts up to 9 rows in the 17-row bucket need the 16-wide
    # class, whose grid holds two sequences), step 4 (decode rows only) to the merged path.
    assert got == [(0, 4), (1, 0), (0, 4), (1, 0), (0, 1), (1, 0), (1, 0)]


@pytest.mark.parametrize("rings", [False, True], ids=["plain", "tail_rings"])
def test_padding_rows_write_nothing(backend, rings: bool) -> None:
    """Before each step every page no live request holds, every free slot's and the padding slot's tail ring are
    poisoned with NaN, and the idle requests' pages and rings and the stepping requests' cached tokens and complete
    pools saved: after it, all of them hold the same bits (the padding rows wrote no latent row, pool or ring entry),
    and the real rows are finite. With MTP tail rings also the backups of every slot outside the step, the padding
    slot's included (the rollback visits the state-slot entries past the batch: they name the padding slot)."""
    model = slice_model()
    steps = _admission_steps()
    toks = _tokens(steps, 2)
    h, pad = slice_harness(model)
    if rings:
        h.manager.enable_decode_tail_rings(4)
    runner = PiecewiseRunner(model, max_num_tokens=48, emulate=True, padding_slot=pad)
    m, ring = h.manager, h.manager.state.tail_ring
    backups = [getattr(tr, n) for tr in m.state.decode_tail_rings for n in ("snapshot", "saved_rows", "saved_pos")]
    planes = [m.latent, m.index_k] + ([m.index_scale] if m.index_scale is not None else [])
    S = ring.shape[1]
    for i, (rows, nd, freed) in enumerate(steps):
        free_requests(h, freed)
        stepping = [r for r, _ in rows]
        for rid, n in rows:  # (allocated first, so that only pages nobody holds are poisoned)
            if rid not in h.lengths:
                m.add_request(rid)
                h.lengths[rid] = 0
            m.ensure_capacity(rid, h.lengths[rid] + n)
        held = {p for rid in h.lengths for p in m.page_lists([rid])[0]}
        mine = {p for rid in stepping for p in m.page_lists([rid])[0]}
        free_pages = [p for p in range(m.num_pages) if p not in held]
        live_slots = set(m.get_batch_state_slots(list(h.lengths)))
        free_slots = [s for s in range(S) if s not in live_slots]  # the padding slot among them
        assert pad in free_slots and free_pages
        for t in planes:
            t.view(torch.uint8)[:, free_pages] = (
                0x7F  # (planes: [sparse layers, pages, ...])  # NaN in fp32 / bf16 / e4m3 byte patterns alike
            )
        ring[:, free_slots] = float("nan")
        others = [p for p in range(m.num_pages) if p not in mine]
        idle = [s for s in range(S) if s not in set(m.get_batch_state_slots(stepping))]
        # The stepping requests' cached tokens and complete pools (written by earlier steps) too.
        P = m.tokens_per_block
        cached = [(pg[t // P], t % P) for rid in stepping for pg in m.page_lists([rid]) for t in range(h.lengths[rid])]
        pools = [(pg[t // P], t % P // 4) for rid in stepping for pg in m.page_lists([rid])
                 for t in range(3, h.lengths[rid], 4)]  # fmt: skip
        c_pg, c_tok = (torch.tensor(x, dtype=torch.int64) for x in zip(*cached)) if cached else (None, None)
        p_pg, p_in = (torch.tensor(x, dtype=torch.int64) for x in zip(*pools)) if pools else (None, None)

        def own(c_pg=c_pg, c_tok=c_tok, p_pg=p_pg, p_in=p_in) -> list[torch.Tensor]:  # noqa: ANN001
            out = [] if c_pg is None else [_bits(m.latent)[:, c_pg, c_tok].clone()]
            if p_pg is not None:
                out += [_bits(t)[:, p_pg, p_in].clone() for t in planes[1:]]
            return out

        for t in backups:  # (slot-major)
            if t.is_floating_point():
                t[free_slots] = float("nan")
        saved = [_bits(t)[:, others].clone() for t in planes] + [_bits(ring)[:, idle].clone()] + own()
        saved += [_bits(t)[idle].clone() for t in backups]
        before = runner.stats.trunk_steps
        out = _ring_step(h, runner, rows, nd, toks, poke=i) if rings else harness_step(h, runner, rows, nd, toks)
        assert torch.isfinite(out).all(), f"step {i}: a real row read padding"
        assert runner.stats.trunk_steps - before == int((TRUNK_RING if rings else TRUNK)[i])
        now = [_bits(t)[:, others] for t in planes] + [_bits(ring)[:, idle]] + own()
        now += [_bits(t)[idle] for t in backups]
        assert len(now) == len(saved)
        for j, (a, b) in enumerate(zip(now, saved)):
            assert torch.equal(a, b), f"step {i}: plane {j} changed outside the step's new tokens / slots"


def test_executor_admissions_as_one_graph(monkeypatch) -> None:
    """The executor (piecewise on): prompts admitted into decoding requests run as whole-trunk graphs, and every
    request's greedy tokens are the eager executor's."""
    monkeypatch.setattr(Executor, "_graphs_supported", lambda self: True)
    monkeypatch.delenv(PIECEWISE_ENV, raising=False)
    model = slice_model()
    _, ref = run_admissions(model, False)
    ex, got = run_admissions(model, True)
    for a, b in zip(ref, got):
        assert a.output_ids == b.output_ids, f"request {a.request_id}"
    assert ex.piecewise is not None and ex.piecewise.stats.trunk_steps >= 2  # the first prompts' step, the admission
