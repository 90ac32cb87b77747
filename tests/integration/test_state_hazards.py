"""Speculative state hazards end to end, under adversarial geometry (issue 9, "Close these test gaps first").

Each test here turns red when one guard of docs/design.md §6.1-§6.3 is removed, even where the greedy output stays
lossless (speculation then only degrades, or state is corrupted where no token happens to read it):

1. Indexer tail ring on state-slot reuse right after a wide verify round (finish and preemption): the
   indexer's prefill hook (`DecodeTailRing.on_prefill`) and the manager's teardown reset
   (`reset_state_slot` -> `DecodeTailRing.reset`) must each suffice alone; the accepted-count cross-check
   (`DecodeTailRing.num_disagreements`) must never fire.
2. MTP draft forwards with a separate draft manager read the draft manager's slot table, while every target
   page id lies outside the (smaller) draft pool.
3. The MTP tail-ring backup/restore around chained drafts uses draft state slots, which differ from the
   target's.
4. Preemption frees the draft manager's allocation and resets the MTP catch-up length: the resumed request
   speculates again.
5. Width-one rounds run KDA in place: no verify records, ``meta.spec.verify_seqs`` holds only wide sequences.

(The interface's exception-atomicity is in tests/unittest/speculative/test_interface_atomicity.py.)
"""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

from trtllm_glm.kda.layer import KimiDeltaAttention
from trtllm_glm.models.glm5_next import Glm5NextForCausalLM
from trtllm_glm.runtime.executor import Executor, ExecutorConfig
from trtllm_glm.runtime.lossless import compare_greedy
from trtllm_glm.runtime.request import Request, RequestState
from trtllm_glm.runtime.sampling import SamplingParams
from trtllm_glm.runtime.scheduler import ScheduledSeq
from trtllm_glm.runtime.speculative_executor import SpeculativeExecutor
from trtllm_glm.speculative.config import MTPDecodingConfig, NGramDecodingConfig
from trtllm_glm.speculative.drafters import OracleDrafter

pytestmark = pytest.mark.cpu_only


@pytest.fixture(scope="module")
def model() -> Glm5NextForCausalLM:
    return Glm5NextForCausalLM.from_pretrained("tiny", seed=0)


def random_prompts(lengths: list[int], seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(256) for _ in range(n)] for n in lengths]


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True)


def reference(model: Glm5NextForCausalLM, prompts: list[list[int]], max_tokens: list[int]) -> list[Request]:
    """Non-speculative greedy runs with room for everything (no preemption, no slot reuse)."""
    ex = Executor(model, ExecutorConfig(tokens_per_block=8, max_tokens=2048, max_batch_size=8, max_num_tokens=512,
                                        max_seq_len=128))  # fmt: skip
    reqs = [ex.add_request(p, greedy(m)) for p, m in zip(prompts, max_tokens)]
    ex.run_until_done()
    return reqs


def assert_lossless(refs: list[Request], tests: list[Request]) -> None:
    for ref, t in zip(refs, tests):
        d = compare_greedy(ref.output_ids, ref.logit_gaps, t.output_ids)
        assert d is None or d.excused, f"request {t.request_id}: {d}"


def disagreements(ex: SpeculativeExecutor) -> list[int]:
    """The accepted-count cross-check counter of every trunk sparse layer's tail ring."""
    return [ring.num_disagreements for ring in ex.manager.decode_tail_rings]


def spy_plans(ex: SpeculativeExecutor) -> list[tuple[list[ScheduledSeq], list[int]]]:
    """Record every step's plan and ``meta.spec.verify_seqs`` as the model forward sees them (right after the
    executor's own `_before_forward`)."""
    steps: list[tuple[list[ScheduledSeq], list[int]]] = []
    orig = ex._before_forward

    def before_forward(plan: list[ScheduledSeq]) -> None:
        orig(plan)
        steps.append((list(plan), list(ex.meta.spec.verify_seqs)))

    ex._before_forward = before_forward  # type: ignore[method-assign]
    return steps


# --------------------------------------------------------------------------------------------------
# 1. Tail ring on slot reuse right after a wide round

# Two state slots, a page pool too small for both long requests (72 tokens) and an oracle drafter that is always
# right, so rounds are wide up to the end: a request is preempted right after a wide round, others finish in a
# wide round, and each freed slot is handed out again at once (to the resumed request, to long new prompts, to a
# 1-token prompt). Lengths chosen so that both kinds of reuse happen (asserted below).
REUSE_LENS, REUSE_MAX_TOKENS = [22, 26, 24, 19, 1], [30, 30, 20, 16, 10]
REUSE_CFG = dict(tokens_per_block=8, max_tokens=72, max_batch_size=2, max_num_tokens=64, max_seq_len=128)


@pytest.fixture(scope="module")
def reuse_refs(model) -> list[Request]:
    return reference(model, random_prompts(REUSE_LENS, 0), REUSE_MAX_TOKENS)


def run_slot_reuse(model, refs: list[Request], *, reset: bool, prefill_hook: bool) -> dict[str, Any]:
    """The slot-reuse run with the teardown reset and/or the indexer's prefill hook knocked out (test-side).

    Records while running (``violations``): with the reset active, a slot handed to a request that still
    carries a ring backup; with the prefill hook active, a slot that ran a prefill chunk and still holds one.

    Returns:
        ``reqs``, ``ex``, ``violations`` and ``reuse``: per kind (``finish``, ``preempt``) the requests admitted
        into a slot whose previous occupant left it right after a wide round (its ring backup still held).
    """
    ps = random_prompts(REUSE_LENS, 0)
    drafter = OracleDrafter({i: r.output_ids for i, r in enumerate(refs)})
    ex = SpeculativeExecutor(model, ExecutorConfig(**REUSE_CFG), NGramDecodingConfig(max_draft_len=5),
                             drafter=drafter)  # fmt: skip
    mgr, rings = ex.manager, ex.manager.decode_tail_rings
    assert len(rings) == len(model.config.sparse_layer_ids) >= 2
    for ring in rings:  # instance attributes shadow the methods the manager and the indexer call
        if not reset:
            ring.reset = lambda slot=None: None  # type: ignore[method-assign]
            ring.reset_slots = lambda slots: None  # type: ignore[method-assign]  (a step's admissions at once)
        if not prefill_hook:
            ring.on_prefill = lambda state_slots: None  # type: ignore[method-assign]

    by_id: dict[int, Request] = {}
    left_wide: dict[int, str] = {}  # slot -> why its last occupant left right after a wide round
    reuse: dict[str, list[int]] = {"finish": [], "preempt": []}
    violations: list[str] = []
    free_request, add_request, reset_state_slots = mgr.free_request, mgr.add_request, mgr.reset_state_slots

    def free_spy(rid: int) -> None:
        slot = mgr.get_state_slot(rid)
        left_wide.pop(slot, None)
        if int(rings[0].saved_count[slot]) > 0:
            r = by_id[rid]
            # _finish marks the request finished before freeing; _preempt frees a running request.
            left_wide[slot] = "finish" if r.state is RequestState.FINISHED else "preempt"
        free_request(rid)

    def check_zeroed(rid: int, slot: int) -> None:
        for li, ring in enumerate(rings):
            if int(ring.saved_count[slot]) or mgr.tail_ring[li, slot].any():
                violations.append(f"layer {li}: slot {slot} handed to request {rid} keeps ring state")

    deferred: dict[int, int] = {}  # slot -> request, admitted unzeroed (the executor zeroes a step's at once)

    def add_spy(rid: int, num_tokens: int = 0, shared_pages=(), *, reset: bool = True) -> int:  # noqa: ANN001
        slot = add_request(rid, num_tokens, shared_pages, reset=reset)
        why = left_wide.pop(slot, None)
        if why is not None:
            reuse[why].append(rid)
        if not reset:
            deferred[slot] = rid
        elif guard_reset:
            check_zeroed(rid, slot)
        return slot

    def reset_spy(slots) -> None:  # noqa: ANN001
        reset_state_slots(slots)
        for slot in slots:
            rid = deferred.pop(slot)
            if guard_reset:
                check_zeroed(rid, slot)

    guard_reset = reset
    mgr.free_request, mgr.add_request = free_spy, add_spy  # type: ignore[method-assign]
    mgr.reset_state_slots = reset_spy  # type: ignore[method-assign]
    plans = spy_plans(ex)
    reqs = [ex.add_request(p, greedy(m)) for p, m in zip(ps, REUSE_MAX_TOKENS)]
    for r in reqs:
        by_id[r.request_id] = r
    while ex.has_work:
        ex.step()
        if prefill_hook:
            for s in plans[-1][0]:
                if not s.is_decode and mgr.has_request(s.request.request_id):
                    slot = mgr.get_state_slot(s.request.request_id)
                    for li, ring in enumerate(rings):
                        if int(ring.saved_count[slot]):
                            violations.append(f"layer {li}: slot {slot} prefilled but kept its ring backup")
    return {"reqs": reqs, "ex": ex, "reuse": reuse, "violations": violations}


@pytest.mark.parametrize(
    "guards", ["both", "reset_only", "prefill_hook_only"], ids=["both_guards", "reset_alone", "prefill_hook_alone"]
)
def test_slot_reuse_right_after_wide_round(model, reuse_refs, guards) -> None:
    """Slots reused right after a finish and after a preemption that followed a wide round: lossless, and the
    accepted-count cross-check never disagrees. Each guard alone (the other knocked out here) must suffice."""
    out = run_slot_reuse(model, reuse_refs, reset=guards != "prefill_hook_only", prefill_hook=guards != "reset_only")
    ex, reqs, reuse = out["ex"], out["reqs"], out["reuse"]
    # The geometry really is adversarial: both kinds of reuse happened, a long prompt among them.
    assert ex.num_preemptions > 0
    assert reuse["finish"] and reuse["preempt"], reuse
    assert any(len(reqs[rid].prompt_ids) > 16 for rid in reuse["finish"] + reuse["preempt"])
    assert sum(r.num_verify_rounds for r in reqs) > 0
    assert disagreements(ex) == [0] * len(ex.manager.decode_tail_rings)
    assert_lossless(reuse_refs, reqs)
    # Also where no token reads it yet (the other guard masks it in this executor): no stale backup survives.
    assert not out["violations"], out["violations"][:3]


def test_slot_reuse_without_either_guard_is_a_real_hazard(model, reuse_refs) -> None:
    """Sanity for the test above: with both guards knocked out the same run restores a stale backup (the
    cross-check fires) and changes tokens."""
    out = run_slot_reuse(model, reuse_refs, reset=False, prefill_hook=False)
    assert min(disagreements(out["ex"])) > 0
    assert any(r.output_ids != t.output_ids for r, t in zip(reuse_refs, out["reqs"]))


# --------------------------------------------------------------------------------------------------
# 2./3. MTP with a separate draft manager: target page ids beyond the draft pool, differing state slots

MTP_LENS = [9, 30, 14, 3, 25]
MTP_CFG = dict(tokens_per_block=8, max_tokens=1024, max_batch_size=3, max_num_tokens=64, max_seq_len=128,
               prefill_chunk_size=16)  # fmt: skip
DUMMY_PAGES = 40
DRAFT_MAX_TOKENS = 200  # 25 draft pages: below every target page id the requests get


def mtp_run(model, mode: str, each_step=None, setup=None) -> tuple[list[Request], list[dict[int, list[int]]]]:
    """MTP (K = 4) over a batch with one sampled request (it never takes a draft slot, so draft slots drift
    from target slots) after a dummy target allocation that holds target pages ``0 .. 39`` and target slot 0.

    Returns:
        The requests and, per step, the drafts each running request carries into the next round.
    """
    spec = MTPDecodingConfig(adaptive=False, num_nextn_predict_layers=4, draft_kv_mode=mode,
                             draft_max_tokens=DRAFT_MAX_TOKENS if mode == "separate" else None)  # fmt: skip
    ex = SpeculativeExecutor(model, ExecutorConfig(**MTP_CFG), spec)
    # Same dummy in both modes, so that the schedules (and so every forward's numerics) are identical.
    ex.manager.add_request(10**6, DUMMY_PAGES * ex.manager.page_size)
    if setup is not None:
        setup(ex)
    params = [SamplingParams(max_tokens=12, temperature=0.8, seed=1), greedy(14), greedy(10), greedy(12), greedy(9)]
    reqs = [ex.add_request(p, sp) for p, sp in zip(random_prompts(MTP_LENS, 0), params)]
    drafts = []
    while ex.has_work:
        ex.step()
        drafts.append({r.request_id: list(ex.state[r.request_id].drafts) for r in ex.running})
        assert not any(st.mtp_disabled for st in ex.state.values())
        if each_step is not None:
            each_step(ex)
    assert disagreements(ex) == [0] * len(ex.manager.decode_tail_rings)
    return reqs, drafts


@pytest.fixture(scope="module")
def mtp_shared(model) -> tuple[list[Request], list[dict[int, list[int]]]]:
    """Shared draft-KV mode: the MTP plane in the target manager, no draft tables involved."""
    return mtp_run(model, "shared")


def test_mtp_separate_draft_forward_never_reads_target_page_ids(model, mtp_shared) -> None:
    """Every target page id is outside the draft pool, so a draft forward bound to the target's table would
    index the draft cache out of range; the draft forward must bind the draft manager's own table and
    propose exactly the drafts the shared mode proposes."""
    seen = {"target": 0, "draft": 0}

    def check(ex: SpeculativeExecutor) -> None:
        dm = ex.draft_manager
        assert dm is not None and dm is not ex.manager
        for r in ex.running:
            target_ids = ex.manager.get_batch_slot_tables([r.request_id])[0]
            assert min(target_ids) >= dm.num_pages  # adversarial: no target id is a valid draft id
            seen["target"] += 1
            if dm.has_request(r.request_id):
                assert all(0 <= p < dm.num_pages for p in dm.get_batch_slot_tables([r.request_id])[0])
                seen["draft"] += 1

    reqs, drafts = mtp_run(model, "separate", each_step=check)
    assert seen["target"] > 0 and seen["draft"] > 0
    assert [r.output_ids for r in reqs] == [r.output_ids for r in mtp_shared[0]]
    assert drafts == mtp_shared[1]
    assert sum(r.num_verify_rounds for r in reqs) > 0


def test_mtp_ring_backup_uses_draft_state_slots(model, mtp_shared) -> None:
    """Chained MTP rows are speculative: after drafting, the MTP ring of every request's *draft* slot equals
    what the catch-up left, also when that slot differs from the request's target slot. A backup/restore
    through target slots leaves the chained rows in the ring and changes the next rounds' drafts."""
    checked = {"differing_slots": 0}

    def setup(ex: SpeculativeExecutor) -> None:
        dm = ex.draft_manager
        assert dm is not None
        after_catch_up: dict[int, torch.Tensor] = {}
        mtp_step, mtp_draft = ex.drafter._mtp_step, ex.drafter.draft

        def step_spy(reqs, past, q, nxt, prev, *, decode, **kw):
            out = mtp_step(reqs, past, q, nxt, prev, decode=decode, **kw)
            if not decode:  # the catch-up: real rows only
                ring = dm.tail_ring[ex.mtp_plane]
                after_catch_up.clear()
                for r in reqs:
                    after_catch_up[r.request_id] = ring[dm.get_state_slot(r.request_id)].clone()
            return out

        def draft_spy(*a, **kw):
            after_catch_up.clear()
            mtp_draft(*a, **kw)
            ring = dm.tail_ring[ex.mtp_plane]
            for rid, want in after_catch_up.items():
                slot = dm.get_state_slot(rid)
                assert torch.equal(ring[slot], want), f"request {rid}: chained rows left in draft slot {slot}"
                if len(ex.state[rid].drafts) >= 2 and slot != ex.manager.get_state_slot(rid):
                    checked["differing_slots"] += 1

        ex.drafter._mtp_step, ex.drafter.draft = step_spy, draft_spy  # type: ignore[method-assign]

    reqs, drafts = mtp_run(model, "separate", setup=setup)
    assert checked["differing_slots"] > 0  # chains really ran in draft slots that differ from target slots
    assert drafts == mtp_shared[1]
    assert [r.output_ids for r in reqs] == [r.output_ids for r in mtp_shared[0]]


# --------------------------------------------------------------------------------------------------
# 4. Preemption with a separate draft manager

PREEMPT_LENS_SEED = 0
PREEMPT_CFG = dict(tokens_per_block=8, max_tokens=120, max_batch_size=3, max_num_tokens=64, max_seq_len=128)


def test_mtp_preemption_frees_draft_state_and_speculation_resumes(model) -> None:
    """A request preempted after verify rounds leaves nothing in the draft manager and restarts its MTP
    catch-up from zero: once resumed it speculates again at full width (never degraded to width one), and no
    other request loses speculation for want of a draft slot or page."""
    rng = random.Random(PREEMPT_LENS_SEED)
    lens = [rng.randrange(5, 30) for _ in range(4)]
    ps = random_prompts(lens, 1)
    refs = reference(model, ps, [24] * 4)
    K = 3
    ex = SpeculativeExecutor(model, ExecutorConfig(**PREEMPT_CFG),
                             MTPDecodingConfig(adaptive=False, num_nextn_predict_layers=K,
                                               draft_kv_mode="separate"))  # fmt: skip
    dm = ex.draft_manager
    assert dm is not None and dm is not ex.manager
    reqs = [ex.add_request(p, greedy(24)) for p in ps]
    at_preemption: dict[int, tuple[int, int]] = {}  # rid -> (verify rounds, full-width proposals) when preempted
    while ex.has_work:
        preempted_before = {r.request_id: r.num_preemptions for r in reqs}
        ex.step()
        live = {r.request_id for r in ex.running}
        for r in reqs:
            rid = r.request_id
            # The draft manager holds exactly the running requests that have drafted (no stale allocation).
            if rid not in live:
                assert not dm.has_request(rid), f"request {rid} ({r.state.value}) still holds draft state"
            st = ex.state.get(rid)
            if st is not None:
                assert not st.mtp_disabled, f"request {rid} lost speculation"
            if r.num_preemptions > preempted_before[rid]:
                assert st is not None and (st.mtp_len, st.drafts, st.last_accepted) == (0, [], 0)
                full = r.proposed_per_position[K - 1] if len(r.proposed_per_position) >= K else 0
                at_preemption[rid] = (r.num_verify_rounds, full)
    assert dm.num_free_pages == dm.num_pages and dm.num_free_slots == dm.max_num_requests
    assert ex.num_preemptions > 0 and at_preemption
    for rid, (rounds, full) in at_preemption.items():
        r = reqs[rid]
        assert rounds > 0, "the victim should have been speculating when it was preempted"
        assert r.num_verify_rounds > rounds, f"request {rid} never verified drafts again after its resume"
        assert r.proposed_per_position[K - 1] > full, f"request {rid} never drafted at full width after its resume"
    assert disagreements(ex) == [0] * len(ex.manager.decode_tail_rings)
    assert_lossless(refs, reqs)


# --------------------------------------------------------------------------------------------------
# 5. Width-one rounds decode KDA in place


def test_width_one_rounds_take_the_in_place_kda_path(model, monkeypatch) -> None:
    """In a step mixing wide verify rounds, width-one rounds and prefill chunks, only the wide sequences are
    in ``meta.spec.verify_seqs`` and only they build KDA verify records; width-one decodes update their state in
    place; a step without wide rounds builds no records at all."""
    ps = random_prompts([12, 30, 7, 21], 71)
    refs = reference(model, ps, [20] * 4)
    cont = {i: r.output_ids for i, r in enumerate(refs)}
    # Widths cycle through 0 (a width-one round), 3 and 1 drafts, per request and length, so that steps mix.
    spec = NGramDecodingConfig(max_draft_len=3, draft_len_fn=lambda r: [0, 3, 0, 1][(len(r.tokens) + r.request_id) % 4])
    cfg = ExecutorConfig(tokens_per_block=8, max_tokens=1024, max_batch_size=4, max_num_tokens=40, max_seq_len=128,
                         prefill_chunk_size=9)  # fmt: skip
    ex = SpeculativeExecutor(model, cfg, spec, drafter=OracleDrafter(cont, lambda i, j: j % 3 == 2))
    n_kda = len(model.config.kda_layer_ids)
    calls: dict[str, list[list[int]]] = {"verify": [], "in_place": []}
    verify_o, decode = KimiDeltaAttention._verify_o, KimiDeltaAttention._decode

    def verify_spy(self, hidden, batch, state, inputs):
        calls["verify"].append([b for b in range(batch.num_seqs) if batch.q_lens[b] > 0])
        return verify_o(self, hidden, batch, state, inputs)

    def decode_spy(self, x, g, beta, o, batch, seqs, state, weight):
        calls["in_place"].append(list(seqs))
        return decode(self, x, g, beta, o, batch, seqs, state, weight)

    monkeypatch.setattr(KimiDeltaAttention, "_verify_o", verify_spy)
    monkeypatch.setattr(KimiDeltaAttention, "_decode", decode_spy)
    plans = spy_plans(ex)
    reqs = [ex.add_request(p, greedy(20)) for p in ps]
    kinds = {"mixed": 0, "narrow_only": 0, "wide_only": 0}
    while ex.has_work:
        calls["verify"].clear()
        calls["in_place"].clear()
        ex.step()
        plan, verify_seqs = plans[-1]
        wide = [b for b, s in enumerate(plan) if s.is_decode and s.num_rows > 1]
        narrow = [b for b, s in enumerate(plan) if s.is_decode and s.num_rows == 1]
        assert verify_seqs == wide, f"meta.spec.verify_seqs {verify_seqs} but the wide sequences are {wide}"
        if wide:
            assert calls["verify"] == [wide] * n_kda, calls["verify"]
        else:
            assert calls["verify"] == [], "a step without wide rounds built KDA verify records"
        if narrow:
            # Every KDA layer decodes the width-one sequences in place (plus 1-row prefill chunks, if any).
            assert len(calls["in_place"]) == n_kda
            assert all(set(narrow) <= set(c) and not set(c) & set(wide) for c in calls["in_place"])
        if wide or narrow:
            kinds["mixed" if wide and narrow else "wide_only" if wide else "narrow_only"] += 1
    assert kinds["mixed"] and kinds["narrow_only"], kinds
    assert disagreements(ex) == [0] * len(ex.manager.decode_tail_rings)
    assert_lossless(refs, reqs)
