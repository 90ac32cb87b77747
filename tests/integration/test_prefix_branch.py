"""Prefix reuse at default settings (issue 34): branch-point checkpoints, lost-reuse counters, budgets.

What must hold, and what each test pins:

1. The three serving workloads (a shared system prompt with different questions, multi-turn chats, one
   document asked different questions) give the same greedy tokens with and without reuse, for plain
   decoding, MTP (shared and separate draft KV) and n-gram, also all at once in a pool small enough to
   preempt; and no step ever writes a row into a sealed page.
2. A branch-point checkpoint restores byte for byte like any other (state slot and cache rows equal a
   cold run's at the branch point).
3. At the LLM API's defaults the third request of workload (a) reuses at least the shared prefix rounded
   down to a page; the lost-reuse counter moves when reuse is impossible and stays 0 when it works.
4. Hand-made bugs that once slipped through: (a) sealing / checkpointing before the MTP drafter caught up,
   (b) cached pages reclaimed newest-first, (c) the checkpoint store degenerating to FIFO, (d) a write into
   a sealed page.
"""

from __future__ import annotations

import random

import pytest
import torch

from trtllm_glm import LLM, KvCacheConfig, SamplingParams
from trtllm_glm.cache.prefix import Checkpoint, CheckpointStore
from trtllm_glm.errors import StateError
from trtllm_glm.models.glm5_next import Glm5NextForCausalLM
from trtllm_glm.runtime.executor import Executor
from trtllm_glm.runtime.request import Request

from .test_prefix_cache import (
    assert_bytes_equal,
    assert_preempted_hits_equal_and_released,
    fix_endpoints,
    greedy,
    make,
    managers,
    rows_of,
    run_until,
    slot_bytes,
    spy_drafts,
)

pytestmark = pytest.mark.cpu_only

P = 8


@pytest.fixture(scope="module")
def model() -> Glm5NextForCausalLM:
    return Glm5NextForCausalLM.from_pretrained("tiny", seed=0)


def defaults(**kw) -> dict:
    """The LLM API's prefix settings at the tests' page size (a stride of 2P stands for the chunk)."""
    out = dict(interval=2 * P, checkpoint_prompt_end=True, checkpoint_branch_points=True, checkpoint_max_bytes="auto",
               checkpoint_request_end=True)  # fmt: skip
    out.update(kw)
    return out


def guard_sealed_writes(ex: Executor) -> None:
    """Fail the step if any row it computes lands in a sealed page of the target pool."""
    orig = ex._before_forward

    def check(plan):
        mgr = ex.manager
        for s in plan:
            pages = mgr.get_batch_slot_tables([s.request.request_id])[0]
            for pos in range(s.start, s.start + s.num_rows):
                assert not mgr.is_sealed(pages[pos // P]), (
                    f"request {s.request.request_id} writes row {pos} of a sealed page"
                )
        orig(plan)

    ex._before_forward = check  # type: ignore[method-assign]


def rand(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(256) for _ in range(n)]


def system_prompt_prompts(rng: random.Random) -> list[list[int]]:
    """(a): one system prompt (not a page multiple) + different questions."""
    sysp = rand(rng, 5 * P + 3)
    return [sysp + rand(rng, rng.randrange(2, 2 * P)) for _ in range(4)]


def document_prompts(rng: random.Random) -> list[list[int]]:
    """(c): one document several strides long, then different questions (one repeated)."""
    doc = rand(rng, 7 * P + 5)
    qs = [rand(rng, rng.randrange(3, P)) for _ in range(3)]
    return [doc + q for q in qs + qs[:1]]


def chat_turns(ex: Executor, rng: random.Random, turns: int, gen: int) -> list[Request]:
    """(b): each turn = the previous turn's prompt + its answer + a new message (run one after another)."""
    prompt = rand(rng, 3 * P + 1)
    out = []
    for _ in range(turns):
        prompt = prompt + rand(rng, rng.randrange(3, 2 * P))
        r = ex.add_request(prompt, greedy(gen))
        ex.run_until_done()
        out.append(r)
        prompt = prompt + r.output_ids
    return out


# --------------------------------------------------------------------------------------------------
# 1. Workloads: greedy tokens with and without reuse


@pytest.mark.parametrize("mode", ["plain", "mtp2", "mtp2-sep", "ngram3"])
def test_workloads_greedy_identical_with_and_without_reuse(model, mode: str) -> None:
    ref = make(model, mode, reuse=False)
    hot = make(model, mode, P=P, **defaults())
    guard_sealed_writes(hot)
    for seed, build in ((1, system_prompt_prompts), (2, document_prompts)):
        prompts = build(random.Random(seed))
        for p in prompts:
            want = ref.add_request(p, greedy(6))
            ref.run_until_done()
            got = hot.add_request(p, greedy(6))
            hot.run_until_done()
            assert got.output_ids == want.output_ids, f"{build.__name__}: request {got.request_id}"
    want_chat = chat_turns(ref, random.Random(3), 3, 5)
    got_chat = chat_turns(hot, random.Random(3), 3, 5)
    for w, g in zip(want_chat, got_chat):
        assert g.prompt_ids == w.prompt_ids and g.output_ids == w.output_ids
    st = hot.prefix.stats
    # Every follow-up reuses: 3 + 3 questions, 2 chat turns: all the turn before computed (its request-end
    # checkpoint) or, with MTP (whose drafter catches up after a request's end), its prompt.
    assert st.hits >= 7 and st.branch_checkpoints >= 1, st  # (of 8: a budget of ~5 checkpoints churns)
    for w, g in zip(got_chat, got_chat[1:]):
        want = len(w.prompt_ids) if mode.startswith("mtp") else len(w.tokens) - 1
        assert g.num_cached_tokens == want, f"chat turn {g.request_id}: {g.num_cached_tokens} != {want}"


@pytest.mark.parametrize("mode", ["plain", "mtp3", "mtp2-sep", "ngram4"])
def test_workloads_all_at_once_with_preemption_are_lossless(model, mode: str) -> None:
    rng = random.Random(4)
    prompts = system_prompt_prompts(rng) + document_prompts(rng)
    ref = make(model, "plain", reuse=False)
    refs = [ref.add_request(p, greedy(10)) for p in prompts]
    ref.run_until_done()
    hot = make(model, mode, P=P, max_tokens=16 * P, batch=4, **defaults())
    guard_sealed_writes(hot)
    hot.add_request(prompts[0], greedy(1))  # seed: the system prompt's pages and checkpoints
    hot.add_request(prompts[4], greedy(1))
    hot.run_until_done()
    outs = [hot.add_request(p, greedy(10)) for p in prompts]
    hot.run_until_done()
    assert_preempted_hits_equal_and_released(hot, refs, outs)


# --------------------------------------------------------------------------------------------------
# 2. Branch points restore byte for byte


@pytest.mark.parametrize("mode", ["mtp2", "mtp2-sep"])
def test_branch_point_checkpoint_is_byte_exact(model, mode: str) -> None:
    rng = random.Random(5)
    stem = rand(rng, 4 * P + 3)
    a = stem + rand(rng, 5)  # checkpointed at its last page boundary 4P only
    b = stem[: 3 * P + 5] + rand(rng, 6)  # pages 0..2 match A's; no checkpoint at 3P: branch point 3P
    c = stem[: 3 * P + 2] + rand(rng, 4)  # restores B's branch checkpoint at 3P
    E = 3 * P
    # Chunks of at most E rows everywhere: A's rows 0 .. E - 1 come from a chunk 0 .. E like B's and the cold
    # run's (rows computed in chunks of other lengths may differ in the last bit).
    cold = make(model, mode, P=P, prefill_chunk_size=E)
    fix_endpoints(cold, [E])
    rc = cold.add_request(c, greedy(4))
    run_until(cold, rc, E)
    want_slot = [slot_bytes(m, rc.request_id, E) for m in managers(cold)]
    want_rows = [rows_of(m, rc.request_id, E) for m in managers(cold)]
    cold.run_until_done()

    hot = make(model, mode, P=P, prefill_chunk_size=E)
    drafts = spy_drafts(hot)
    for p in (a, b):
        hot.add_request(p, greedy(3))
        hot.run_until_done()
    st = hot.prefix.stats
    assert st.branch_checkpoints == 1 and st.lost_requests == 1 and st.lost_tokens == E, st
    rcc = hot.add_request(c, greedy(4))
    hot._plan()  # admission restores the branch checkpoint; nothing computed yet
    assert rcc.num_computed == E and rcc.num_cached_tokens == E
    for m, ws, wr in zip(managers(hot), want_slot, want_rows):
        assert_bytes_equal(slot_bytes(m, rcc.request_id, E), ws, "state slot")
        assert_bytes_equal(rows_of(m, rcc.request_id, E), wr, "cache rows")
    hot.run_until_done()
    assert rcc.output_ids == rc.output_ids and drafts.get(rcc.request_id)
    assert st.lost_requests == 1, "the third request must not lose reuse"


# --------------------------------------------------------------------------------------------------
# 3. Defaults and counters


def test_third_request_reuses_the_shared_prefix_at_default_settings(model) -> None:
    llm = LLM(model=model, max_seq_len=1024)
    kv = KvCacheConfig()
    assert (
        kv.enable_block_reuse and kv.checkpoint_branch_points and kv.checkpoint_prompt_end and kv.checkpoint_request_end
    )
    # The stride follows the default chunk (8,192 rows, a page multiple): checkpoints where long prompts' chunks end.
    assert llm.executor_config.checkpoint_interval == llm.executor_config.max_num_tokens == 8192
    assert llm.executor.prefix.max_bytes > 0
    rng = random.Random(6)
    S, page = 300, kv.tokens_per_block
    sysp = rand(rng, S)
    outs = [llm.generate([sysp + rand(rng, 20 + i)], greedy(3))[0] for i in range(4)]
    assert outs[0].num_cached_tokens == 0
    for o in outs[2:]:
        assert o.num_cached_tokens >= S // page * page, [x.num_cached_tokens for x in outs]
    st = llm.executor.prefix.stats
    assert st.lost_requests == 1, st  # only the second request recomputed cached pages (and left a checkpoint)
    assert llm.executor.prefix.store.nbytes <= llm.executor.prefix.max_bytes


@pytest.mark.parametrize("mode", ["plain", "ngram3", "mtp2", "mtp2-sep"])
def test_a_shared_prefix_of_whole_pages_is_reused_whole_without_an_mtp_drafter(model, mode: str) -> None:
    """A system prompt of exactly 5 pages: its followers resume at its end (5P) where no drafter reads the token
    after a page; with MTP, whose row of a page's last position reads the next page's first token (a question's,
    different per request), one page less. Greedy tokens equal a cold run's either way."""
    rng = random.Random(12)
    sysp = rand(rng, 5 * P)
    prompts = [sysp + rand(rng, rng.randrange(2, 2 * P)) for _ in range(4)]
    cold = make(model, mode, P=P, reuse=False)
    ex = make(model, mode, P=P, **defaults())
    cached = []
    for p in prompts:
        want = cold.add_request(p, greedy(4))
        cold.run_until_done()
        got = ex.add_request(p, greedy(4))
        ex.run_until_done()
        assert got.output_ids == want.output_ids
        cached.append(got.num_cached_tokens)
    expect = 4 * P if mode.startswith("mtp") else 5 * P
    assert cached[2:] == [expect, expect], (mode, cached)


def test_lost_reuse_counter_moves_without_checkpoints_and_stays_zero_when_reuse_works(model) -> None:
    rng = random.Random(7)
    prompts = system_prompt_prompts(rng)
    off = make(model, "plain", P=P, max_checkpoints=0)
    for p in prompts:
        off.add_request(p, greedy(2))
        off.run_until_done()
    st = off.prefix.stats
    assert st.hits == 0 and st.lost_requests == len(prompts) - 1
    assert st.lost_tokens == (len(prompts) - 1) * (5 * P), st  # the system prompt's full pages, each time
    # Followers of a checkpointed prefix lose nothing: only the second request recomputes cached pages.
    on = make(model, "plain", P=P, **defaults())
    for p in prompts[:2]:
        on.add_request(p, greedy(2))
        on.run_until_done()
    assert on.prefix.stats.lost_requests == 1 and on.prefix.stats.branch_checkpoints == 1
    lost = on.prefix.stats.lost_tokens
    for p in prompts[2:]:
        r = on.add_request(p, greedy(2))
        on.run_until_done()
        assert r.num_cached_tokens == 5 * P
    assert on.prefix.stats.lost_tokens == lost and on.prefix.stats.lost_requests == 1


def test_a_checkpoint_over_the_byte_budget_is_skipped_and_counted(model) -> None:
    rng = random.Random(8)
    ex = make(model, "plain", P=P, checkpoint_max_bytes=1024)
    p = rand(rng, 3 * P + 1)
    r1 = ex.add_request(p, greedy(3))
    ex.run_until_done()
    r2 = ex.add_request(p, greedy(3))
    ex.run_until_done()
    st = ex.prefix.stats
    assert st.checkpoints_taken == 0 and st.checkpoints_skipped >= 1 and r2.output_ids == r1.output_ids
    with pytest.raises(ValueError, match="checkpoint_max_bytes"):
        KvCacheConfig(checkpoint_max_bytes=0)
    with pytest.raises(ValueError, match="checkpoint_interval"):
        KvCacheConfig(checkpoint_interval="often")


# --------------------------------------------------------------------------------------------------
# 4. Hand-made bugs


@pytest.mark.parametrize("mode", ["mtp3", "mtp3-sep"])
def test_sampled_mtp_request_never_checkpoints_ahead_of_its_drafter(model, mode: str) -> None:
    """The drafter keeps no history for a sampled request: its pages must not be sealed nor its state
    checkpointed as if it had (a greedy follower would draft from rows never written)."""
    rng = random.Random(9)
    a = rand(rng, 4 * P + 3)
    b = a[: 3 * P + 2] + rand(rng, 5)
    cold = make(model, mode, P=P, interval=P)
    cold_drafts = spy_drafts(cold)
    rc = cold.add_request(b, greedy(8))
    cold.run_until_done()
    hot = make(model, mode, P=P, interval=P)
    hot_drafts = spy_drafts(hot)
    hot.add_request(a, SamplingParams(max_tokens=6, temperature=0.9, seed=1, ignore_eos=True))
    hot.run_until_done()
    rb = hot.add_request(b, greedy(8))
    hot.run_until_done()
    assert rb.output_ids == rc.output_ids
    assert hot_drafts[rb.request_id] == cold_drafts[rc.request_id]


def test_partial_page_eviction_keeps_the_rest_of_the_prefix(model) -> None:
    """Cached pages are reclaimed least recently released first, and a request releases its last page first:
    evicting two pages leaves the prefix's first pages (and the checkpoints over them) usable."""
    rng = random.Random(10)
    a = rand(rng, 6 * P + 3)
    hot = make(model, "plain", P=P, interval=P, max_tokens=10 * P)
    ra = hot.add_request(a, greedy(2))
    hot.run_until_done()
    mgr = hot.manager
    assert mgr.num_cached_pages == 6
    x = hot.add_request(rand(rng, 5 * P + 3), greedy(2))  # 6 pages: the 4 free ones and 2 cached ones
    hot.run_until_done()
    assert mgr.num_evicted_pages == 2 and x.finished
    b = a[: 4 * P + 2] + rand(rng, 5)
    rb = hot.add_request(b, greedy(2))
    hot.run_until_done()
    assert rb.num_cached_tokens == 4 * P, (rb.num_cached_tokens, ra.num_cached_tokens)


def test_checkpoint_hit_refreshes_recency(model) -> None:
    """A, B, A-hit, C with room for two: C evicts B (least recently used), so A hits again."""
    rng = random.Random(11)
    a, b, c = (rand(rng, 3 * P + 1) for _ in range(3))
    ex = make(model, "plain", P=P, max_checkpoints=2)
    got = []
    for p in (a, b, a, c, a):
        got.append(ex.add_request(p, greedy(2)))
        ex.run_until_done()
    assert [r.num_cached_tokens for r in got] == [0, 0, 3 * P, 0, 3 * P]
    # The store itself, without an executor.
    snap = ex.prefix.store.get(next(iter(ex.prefix.store))).target
    store = CheckpointStore(max_checkpoints=2)
    ck = Checkpoint(endpoint=snap.endpoint, page_keys=(), target=snap)
    for k in ("A", "B"):
        store.put((k, ()), ck)
    assert store.get(("A", ())) is ck
    store.put(("C", ()), ck)
    assert ("A", ()) in store and ("B", ()) not in store


def test_a_write_into_a_sealed_page_raises(model) -> None:
    rng = random.Random(12)
    ex = make(model, "plain", P=P)
    r = ex.add_request(rand(rng, 3 * P + 2), greedy(3))
    run_until(ex, r, 3 * P + 2)
    mgr = ex.manager
    pages = mgr.get_batch_slot_tables([r.request_id])[0]
    assert mgr.is_sealed(pages[0]) and not mgr.is_sealed(pages[-1])
    data = mgr.copy_page_out(pages[-1])
    before = mgr.copy_page_out(pages[0])
    with pytest.raises(StateError, match="sealed"):
        mgr.copy_page_in(pages[0], data)
    assert all(torch.equal(before[k], v) for k, v in mgr.copy_page_out(pages[0]).items())
    mgr.copy_page_in(pages[-1], data)  # a private page takes it
    ex.run_until_done()


@pytest.mark.parametrize("mode", ["plain", "mtp2-sep"])
def test_requests_sent_together_wait_for_their_leader(model, mode: str) -> None:
    """Followers sent while the first request still prefills the system prompt wait for it (it checkpoints
    where their prompts part) instead of recomputing the prompt beside it."""
    rng = random.Random(13)
    prompts = system_prompt_prompts(rng)
    ref = make(model, "plain", reuse=False)
    refs = [ref.add_request(p, greedy(4)) for p in prompts]
    ref.run_until_done()
    hot = make(model, mode, P=P, prefill_chunk_size=P, **defaults())
    guard_sealed_writes(hot)
    lead = hot.add_request(prompts[0], greedy(4))
    hot.step()  # the leader is running, one page in
    outs = [lead] + [hot.add_request(p, greedy(4)) for p in prompts[1:]]
    hot.run_until_done()
    st = hot.prefix.stats
    assert [o.num_cached_tokens for o in outs[1:]] == [5 * P] * (len(prompts) - 1), st
    assert st.held > 0 and st.lost_requests == 0, st
    for r, o in zip(refs, outs):
        assert o.output_ids == r.output_ids


def test_the_stride_never_adds_a_step_to_a_resumed_prompts_last_chunk(model) -> None:
    """A question restored after its system prompt finishes its prompt in two steps (to its last page
    boundary, then the rest), not three: the stride point between them cuts nothing."""
    rng = random.Random(14)
    sysp = rand(rng, 5 * P + 3)
    ex = make(model, "plain", P=P, interval=6 * P)
    for _ in range(2):
        ex.add_request(sysp + rand(rng, 16), greedy(1))
        ex.run_until_done()
    c = ex.add_request(sysp + rand(rng, 16), greedy(1))
    steps = 0
    while not c.output_ids:
        ex.step()
        steps += 1
    assert c.num_cached_tokens == 5 * P and steps == 2
    assert 6 * P in ex.prefix.endpoints(c)  # (a stride point it crossed)


def test_interleaved_chats_keep_their_turns_within_a_small_budget(model) -> None:
    """Three conversations take turns with room for six checkpoints: each request's own prompt-end and
    last-page checkpoints give way to its request-end one, so every second turn resumes after its answer."""
    rng = random.Random(15)
    ex = make(model, "plain", P=P, **defaults(interval=None, max_checkpoints=6, checkpoint_max_bytes=None))
    convs = [rand(rng, 2 * P + 3) for _ in range(3)]
    firsts = []
    for c in convs:
        firsts.append(ex.add_request(c, greedy(5)))
        ex.run_until_done()
    for r in firsts:
        r2 = ex.add_request(r.tokens + rand(rng, 4), greedy(3))
        ex.run_until_done()
        assert r2.num_cached_tokens == len(r.tokens) - 1
    assert ex.prefix.stats.checkpoints_superseded >= 6
