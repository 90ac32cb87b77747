"""Prefix caching with recurrent-state checkpoints (issue 9, docs/design.md §6.4).

What must hold, and what each test pins:

1. A restore is byte-exact: right after admission from a checkpoint at ``E`` the request's state slot
   (KDA recurrent + conv state, every tail ring and its rollback planes, the draft's last hidden, the
   committed length) and every valid cache row of its pages (target and draft planes) equal those of a
   cold run of the same prompt at ``E`` — at endpoints 1, 2, 4, P-1, P, P+1, P+2, 2P-1, 2P, 2P+1, for a small
   P and P = 256, with the MTP plane shared with the target manager and in a separate draft manager.
2. Greedy tokens are identical cold vs hit, for plain decoding, MTP K = 1..5 (both draft modes) and
   n-gram, also with preemption in a small pool; MTP drafts after a hit equal those of a cold run.
3. A -> B -> A: B restoring A's checkpoint and running on never changes the checkpoint or the shared pages.
4. A page's draft rows depend on the token after the page; a request with the same page tokens but a
   different next token must not be served the first request's page (drafts would change; tokens not).
5. Validation: a checkpoint that disagrees with its endpoint is discarded and counted, and the request
   recomputes. Budgets: LRU over checkpoints apart from pages; evicted cached pages make a checkpoint
   unusable, never wrong.
"""

from __future__ import annotations

import logging
import random

import pytest
import torch

from trtllm_glm import LLM, KvCacheConfig, SamplingParams
from trtllm_glm.cache.manager import Glm5NextCacheManager
from trtllm_glm.errors import CapacityError
from trtllm_glm.models.glm5_next import Glm5NextForCausalLM
from trtllm_glm.runtime.executor import Executor, ExecutorConfig
from trtllm_glm.runtime.request import Request
from trtllm_glm.runtime.speculative_executor import SpeculativeExecutor
from trtllm_glm.speculative.config import MTPDecodingConfig, NGramDecodingConfig

pytestmark = pytest.mark.cpu_only


@pytest.fixture(scope="module")
def model() -> Glm5NextForCausalLM:
    return Glm5NextForCausalLM.from_pretrained("tiny", seed=0)


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, ignore_eos=True)


def make(model, mode: str, *, reuse: bool = True, P: int = 8, max_tokens: int = 4096, batch: int = 4,
         interval: int | None = None, **kw) -> Executor:  # fmt: skip
    """``mode``: ``plain``, ``mtpK`` (shared MTP plane), ``mtpK-sep`` (separate draft manager), ``ngramK``."""
    cfg = ExecutorConfig(tokens_per_block=P, max_tokens=max_tokens, max_batch_size=batch, max_num_tokens=2048,
                         max_seq_len=2048, enable_block_reuse=reuse, checkpoint_interval=interval, **kw)  # fmt: skip
    if mode == "plain":
        return Executor(model, cfg)
    if mode.startswith("mtp"):
        k, _, sep = mode[3:].partition("-")
        spec = MTPDecodingConfig(
            adaptive=False, num_nextn_predict_layers=int(k), draft_kv_mode="separate" if sep else "shared"
        )
        return SpeculativeExecutor(model, cfg, spec)
    return SpeculativeExecutor(model, cfg, NGramDecodingConfig(max_draft_len=int(mode[5:])))


def fix_endpoints(ex: Executor, endpoints: list[int]) -> None:
    """Checkpoint (and cut chunks) at exactly these endpoints, whatever the prompt."""
    assert ex.prefix is not None
    ex.prefix.endpoints = lambda r: [e for e in endpoints if e < len(r.prompt_ids)]  # type: ignore[method-assign]


def spy_drafts(ex: Executor) -> dict[int, list[list[int]]]:
    """Record the drafts proposed for each request, round by round."""
    out: dict[int, list[list[int]]] = {}
    if not isinstance(ex, SpeculativeExecutor):
        return out
    orig = ex.drafter.draft

    def draft(seqs, hidden):
        orig(seqs, hidden)
        for s in seqs:
            if s.live and s.state.drafts:
                out.setdefault(s.request_id, []).append(list(s.state.drafts))

    ex.drafter.draft = draft  # type: ignore[method-assign]
    return out


def rows_of(mgr: Glm5NextCacheManager, rid: int, n: int) -> dict[str, torch.Tensor]:
    """Every valid cache row of a request's first ``n`` positions, per plane, as bytes ``[L, ...]``."""
    pages = mgr.get_batch_slot_tables([rid])[0]
    P = mgr.page_size
    lat = torch.stack([mgr.latent[:, pages[p // P], p % P] for p in range(n)], 1) if n else None
    npool = n // 4  # complete pools only (the open pool lives in the tail ring)
    ik = [mgr.index_k[:, pages[(4 * i) // P], (4 * i % P) // 4].view(torch.uint8) for i in range(npool)]
    sc = [mgr.index_scale[:, pages[(4 * i) // P], (4 * i % P) // 4] for i in range(npool)]
    out = {}
    if lat is not None:
        out["latent"] = lat.contiguous().view(torch.uint8)
    if npool:
        out["index_k"] = torch.stack(ik, 1)
        out["index_scale"] = torch.stack(sc, 1).contiguous().view(torch.uint8)
    return out


def slot_bytes(mgr: Glm5NextCacheManager, rid: int, endpoint: int) -> dict[str, torch.Tensor]:
    snap = mgr.state.snapshot(mgr.get_state_slot(rid), endpoint)
    out = {k: v.contiguous().view(torch.uint8) for k, v in snap.planes.items()}
    if snap.draft_hidden is not None:
        out["draft_hidden"] = snap.draft_hidden.contiguous().view(torch.uint8)
    return out


def assert_bytes_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], what: str) -> None:
    assert a.keys() == b.keys(), what
    for k in a:
        assert torch.equal(a[k], b[k]), f"{what}: plane {k} differs"


def managers(ex: Executor) -> list[Glm5NextCacheManager]:
    dm = ex.separate_draft_manager
    return [ex.manager] + ([dm] if dm is not None else [])


def assert_preempted_hits_equal_and_released(hot: Executor, refs: list, outs: list) -> None:
    """After a run with reuse under pressure: it preempted and hit, every output equals its cold reference, and
    every page and state slot is free again."""
    assert hot.num_preemptions > 0, "the pool must be small enough to preempt"
    assert hot.prefix.stats.hits > 0
    for r, o in zip(refs, outs):
        assert o.output_ids == r.output_ids, f"request {o.request_id}"
    for m in managers(hot):
        assert m.num_free_pages == m.num_pages and m.num_free_slots == m.max_num_requests


# --------------------------------------------------------------------------------------------------
# 1. Byte-exact restores at adversarial endpoints


def run_until(ex: Executor, req: Request, n: int) -> None:
    while req.num_computed < n:
        ex.step()


@pytest.mark.parametrize("P", [8, 256])
@pytest.mark.parametrize("mode", ["mtp2", "mtp2-sep"])
def test_restore_is_byte_exact_at_every_endpoint(model, P: int, mode: str) -> None:
    ends = sorted({1, 2, 4, P - 1, P, P + 1, P + 2, 2 * P - 1, 2 * P, 2 * P + 1})
    rng = random.Random(P)
    prompt_a = [rng.randrange(256) for _ in range(2 * P + 4)]
    hot = make(model, mode, P=P)
    fix_endpoints(hot, ends)
    hot.add_request(prompt_a, greedy(2))
    hot.run_until_done()
    assert hot.prefix.stats.checkpoints_taken == len(ends)
    drafts_hot = spy_drafts(hot)
    for E in ends:
        # B shares tokens 0..E with A, then differs: it can restore exactly the checkpoint at E.
        prompt_b = prompt_a[: E + 1] + [(prompt_a[E + 1] + 1) % 256, 7, 9]
        cold = make(model, mode, P=P)
        fix_endpoints(cold, ends)
        rc = cold.add_request(prompt_b, greedy(3))
        run_until(cold, rc, E)
        want_slot = [slot_bytes(m, rc.request_id, E) for m in managers(cold)]
        want_rows = [rows_of(m, rc.request_id, E) for m in managers(cold)]
        cold.run_until_done()

        rb = hot.add_request(prompt_b, greedy(3))
        hot._plan()  # admission restores the checkpoint; nothing is computed yet
        assert rb.num_computed == E and rb.num_cached_tokens == E
        for m, ws, wr in zip(managers(hot), want_slot, want_rows):
            assert_bytes_equal(slot_bytes(m, rb.request_id, E), ws, f"E={E} state slot")
            assert_bytes_equal(rows_of(m, rb.request_id, E), wr, f"E={E} cache rows")
        hot.run_until_done()
        assert rb.output_ids == rc.output_ids, f"E={E}"
        assert drafts_hot.get(rb.request_id), "MTP must draft after a hit"


# --------------------------------------------------------------------------------------------------
# 2. Cold vs hit, end to end


def shared_prefix_prompts(seed: int, n: int, P: int) -> list[list[int]]:
    """Prompts over a few shared stems of different lengths (multi-turn / system-prompt shapes)."""
    rng = random.Random(seed)
    stems = [[rng.randrange(256) for _ in range(L)] for L in (3 * P + 3, 2 * P, 5 * P + 1)]
    out = []
    for i in range(n):
        s = stems[i % len(stems)]
        cut = rng.randrange(len(s) // 2, len(s) + 1)
        out.append(s[:cut] + [rng.randrange(256) for _ in range(rng.randrange(1, 2 * P))])
    return out


@pytest.mark.parametrize("mode", ["plain", "mtp1", "mtp3", "mtp5", "mtp2-sep", "mtp4-sep", "ngram4"])
def test_greedy_tokens_and_drafts_identical_cold_vs_hit(model, mode: str) -> None:
    P = 8
    prompts = shared_prefix_prompts(1, 9, P)
    gen = [random.Random(i).randrange(4, 14) for i in range(len(prompts))]
    refs, cold_drafts = [], {}
    for p, g in zip(prompts, gen):
        # Cold: an empty cache, chunks cut at the same endpoints (chunking changes rounding, and a random
        # model's drafts sit at near ties often enough to tell).
        cold = make(model, mode, P=P, interval=2 * P)
        spied = spy_drafts(cold)
        refs.append(cold.add_request(p, greedy(g)))
        cold.run_until_done()
        assert cold.prefix.stats.hits == 0
        cold_drafts[id(refs[-1])] = spied.get(refs[-1].request_id)
    hot = make(model, mode, P=P, interval=2 * P)
    hot_drafts = spy_drafts(hot)
    outs = []
    for p, g in zip(prompts, gen):
        outs.append(hot.add_request(p, greedy(g)))
        hot.run_until_done()
    st = hot.prefix.stats
    assert st.hits >= 4 and st.reused_tokens > 0, st
    assert sum(r.num_cached_tokens for r in outs) == st.reused_tokens
    for ref, out in zip(refs, outs):
        assert out.output_ids == ref.output_ids, f"request {out.request_id} (cached {out.num_cached_tokens})"
        assert hot_drafts.get(out.request_id) == cold_drafts[id(ref)], "drafts after a hit differ"


@pytest.mark.parametrize("mode", ["plain", "mtp3", "mtp3-sep", "ngram5"])
def test_mixed_batches_with_preemption_are_lossless(model, mode: str) -> None:
    """All requests at once in a small pool: hits, preemption (and re-hits of the resumed requests)."""
    P = 8
    prompts = shared_prefix_prompts(2, 10, P)
    gen = [12] * len(prompts)
    ref = make(model, "plain", P=P, reuse=False)
    refs = [ref.add_request(p, greedy(g)) for p, g in zip(prompts, gen)]
    ref.run_until_done()
    warm = prompts[:3]
    hot = make(model, mode, P=P, max_tokens=14 * P, batch=4, interval=P)
    for p in warm:  # seed the cache with the stems
        hot.add_request(p, greedy(1))
    hot.run_until_done()
    outs = [hot.add_request(p, greedy(g)) for p, g in zip(prompts, gen)]
    hot.run_until_done()
    assert_preempted_hits_equal_and_released(hot, refs, outs)


# --------------------------------------------------------------------------------------------------
# 3. A -> B -> A


@pytest.mark.parametrize("mode", ["mtp2", "mtp2-sep"])
def test_checkpoint_and_shared_pages_survive_a_sharer(model, mode: str) -> None:
    P = 8
    rng = random.Random(3)
    a = [rng.randrange(256) for _ in range(4 * P + 3)]
    hot = make(model, mode, P=P, interval=P)
    ra = hot.add_request(a, greedy(6))
    hot.run_until_done()
    store = hot.prefix.store
    saved = {k: (ck.target.planes, ck.target_partial, ck.draft.planes if ck.draft else None) for k, ck in
             ((k, store.get(k)) for k in store)}  # fmt: skip
    saved = {k: [{n: t.clone() for n, t in d.items()} if d else None for d in v] for k, v in saved.items()}
    sealed = {m: {p: m.copy_page_out(p) for p in range(m.num_pages) if m.is_sealed(p)} for m in managers(hot)}
    assert all(sealed.values())
    b = a[: 3 * P + 2] + [1, 2, 3, 4, 5]  # restores A's checkpoint at 3P + 1... and writes its own rows
    rb = hot.add_request(b, greedy(8))
    hot.run_until_done()
    assert rb.num_cached_tokens == 3 * P
    for k, (tp, part, dp) in saved.items():
        ck = store.get(k)
        if ck is None:
            continue
        for n, t in tp.items():
            assert torch.equal(ck.target.planes[n], t), f"checkpoint {k[1]} plane {n} changed"
        for n, t in (part or {}).items():
            assert torch.equal(ck.target_partial[n], t)
        for n, t in (dp or {}).items():
            assert torch.equal(ck.draft.planes[n], t)
    for m, pages in sealed.items():
        for p, data in pages.items():
            now = m.copy_page_out(p)
            assert all(torch.equal(now[n], data[n]) for n in data), f"sealed page {p} was written"
    ra2 = hot.add_request(a, greedy(6))
    hot.run_until_done()
    assert ra2.num_cached_tokens > 0 and ra2.output_ids == ra.output_ids


# --------------------------------------------------------------------------------------------------
# 4. The token after a page


def test_page_with_same_tokens_but_another_next_token_is_not_shared(model) -> None:
    """A and C share 2P tokens and differ at 2P. C's checkpoint at 2P must resolve to C's own pages: A's page 1
    holds the MTP row of position 2P - 1 computed with A's token 2P. D = C's prompt again must then draft
    exactly like a cold C."""
    P = 8
    rng = random.Random(4)
    stem = [rng.randrange(256) for _ in range(2 * P)]
    a = stem + [10] + [rng.randrange(256) for _ in range(5)]
    c = stem + [11] + [rng.randrange(256) for _ in range(5)]
    cold = make(model, "mtp3", P=P, interval=P)  # an empty cache, the same chunking
    cold_drafts = spy_drafts(cold)
    rc = cold.add_request(c, greedy(10))
    cold.run_until_done()
    hot = make(model, "mtp3", P=P, interval=P)
    hot_drafts = spy_drafts(hot)
    for p in (a, c):
        hot.add_request(p, greedy(10))
        hot.run_until_done()
    rd = hot.add_request(c, greedy(10))
    hot.run_until_done()
    assert rd.num_cached_tokens == 2 * P
    assert rd.output_ids == rc.output_ids
    assert hot_drafts[rd.request_id] == cold_drafts[rc.request_id]


# --------------------------------------------------------------------------------------------------
# 5. Validation, budgets, observability


def test_a_checkpoint_that_disagrees_with_its_endpoint_is_discarded(model) -> None:
    P = 8
    rng = random.Random(5)
    a = [rng.randrange(256) for _ in range(3 * P + 2)]
    hot = make(model, "mtp2", P=P, interval=P)
    ra = hot.add_request(a, greedy(5))
    hot.run_until_done()
    for k in hot.prefix.store:
        hot.prefix.store.get(k).target.endpoint += 1  # corrupt every checkpoint
    rb = hot.add_request(a, greedy(5))
    hot.run_until_done()
    assert rb.num_cached_tokens == 0 and hot.prefix.stats.rejected >= 1
    assert rb.output_ids == ra.output_ids


def test_checkpoint_budget_is_lru_and_apart_from_pages(model) -> None:
    P = 8
    rng = random.Random(6)
    prompts = [[rng.randrange(256) for _ in range(3 * P + 1)] for _ in range(4)]
    hot = make(model, "plain", P=P, max_checkpoints=2)
    for p in prompts:
        hot.add_request(p, greedy(2))
        hot.run_until_done()
    st = hot.prefix.stats
    assert len(hot.prefix.store) == 2 and st.checkpoints_evicted == st.checkpoints_taken - 2
    # The oldest prompt's checkpoint is gone (its rerun evicts prompt 2's); the most recent one still hits.
    r0 = hot.add_request(prompts[0], greedy(2))
    hot.run_until_done()
    r3 = hot.add_request(prompts[3], greedy(2))
    hot.run_until_done()
    assert r0.num_cached_tokens == 0 and r3.num_cached_tokens == 3 * P and st.hits == 1
    # Byte budget: a budget below one checkpoint keeps none.
    tiny = make(model, "plain", P=P, checkpoint_max_bytes=16)
    tiny.add_request(prompts[0], greedy(2))
    tiny.run_until_done()
    assert len(tiny.prefix.store) == 0


def test_evicted_pages_make_a_checkpoint_unusable_never_wrong(model) -> None:
    P = 8
    rng = random.Random(7)
    a = [rng.randrange(256) for _ in range(4 * P + 1)]
    hot = make(model, "mtp2", P=P, interval=P, max_tokens=8 * P)
    ra = hot.add_request(a, greedy(3))
    hot.run_until_done()
    assert hot.manager.num_cached_pages > 0
    # Fill the pool with unrelated requests: the cached pages are evicted (live pages never are).
    for _ in range(2):
        hot.add_request([rng.randrange(256) for _ in range(6 * P)], greedy(2))
        hot.run_until_done()
    assert hot.manager.num_evicted_pages > 0
    rb = hot.add_request(a, greedy(3))
    hot.run_until_done()
    assert rb.output_ids == ra.output_ids
    assert rb.num_cached_tokens < 4 * P


def test_llm_api_reports_cached_tokens_and_notes_short_prompts(model, caplog) -> None:
    # Without prompt- and request-end checkpoints (with them, the default, a short prompt is checkpointed at its
    # end, and a request's own last-page checkpoint gives way to its request-end one when it finishes).
    # The last-page checkpoint asked for (the default leaves it to a branch point: the next test).
    kv = KvCacheConfig(
        tokens_per_block=8, checkpoint_prompt_end=False, checkpoint_request_end=False, checkpoint_last_page=True
    )
    llm = LLM(model=model, kv_cache_config=kv)
    stem = list(range(10, 40))
    o1 = llm.generate([stem + [1, 2]], greedy(4))[0]
    o2 = llm.generate([stem + [3, 4]], greedy(4))[0]
    assert o1.num_cached_tokens == 0 and o2.num_cached_tokens == 24
    assert llm.executor.prefix.stats.hits == 1
    # Context logits need every prompt row: such a request never skips rows.
    o3 = llm.generate([stem + [3, 4]], SamplingParams(max_tokens=2, return_context_logits=True))[0]
    assert o3.num_cached_tokens == 0 and o3.context_logits.shape[0] == 32
    with caplog.at_level(logging.DEBUG, logger="trtllm_glm.runtime.prefix_cache"):
        llm.generate([[5, 6, 7]], greedy(2))
    assert any("gets no checkpoint" in r.message for r in caplog.records)
    off = LLM(model=model, kv_cache_config=KvCacheConfig(tokens_per_block=8, enable_block_reuse=False))
    assert off.executor.prefix is None
    with pytest.raises(ValueError, match="checkpoint_interval"):
        KvCacheConfig(checkpoint_interval=0)


def test_default_prefills_a_prompt_in_one_step_and_a_branch_point_serves_repeats(model) -> None:
    """At the serving defaults a prompt longer than a page is not cut at its last page boundary (that cut costs
    every prompt one more eager step before its first token); the first request sharing its pages checkpoints
    there as a branch point, and the requests after it resume there, with the outputs recomputing gives."""
    kv = KvCacheConfig(tokens_per_block=8, checkpoint_prompt_end=False, checkpoint_request_end=False)
    llm = LLM(model=model, kv_cache_config=kv)
    stem = list(range(10, 40))
    ex = llm.executor
    reqs = []
    for t in (1, 3, 5):
        reqs.append(ex.add_request(stem + [t, t + 1], greedy(4)))
        ex.run_until_done()
    # The first prompt (32 tokens, four pages) in one prefill step; the second recomputes to its branch point
    # (24) and from there; the third resumes at 24 (one step: its last chunk is not cut either).
    assert [r.num_prefill_steps for r in reqs] == [1, 2, 1]
    assert [r.num_cached_tokens for r in reqs] == [0, 0, 24]
    assert ex.prefix.stats.hits == 1
    cold = LLM(model=model, kv_cache_config=KvCacheConfig(tokens_per_block=8, enable_block_reuse=False))
    for r, t in zip(reqs, (1, 3, 5)):
        assert r.output_ids == cold.generate([stem + [t, t + 1]], greedy(4))[0].outputs[0].token_ids


def test_page_copies_are_strided_by_each_planes_page_bytes() -> None:
    """Planes have different bytes per page; a page copy must move exactly one page of each, nothing around it."""
    from trtllm_glm.config import Glm5NextConfig

    cfg = Glm5NextConfig.from_pretrained("tiny")
    m = Glm5NextCacheManager(cfg, num_pages=5, tokens_per_block=8, max_num_requests=2)
    g = torch.Generator().manual_seed(0)
    for t in (m.latent, m.index_scale):
        t.copy_(torch.randn(t.shape, generator=g))
    m.index_k.view(torch.uint8).copy_(torch.randint(0, 120, m.index_k.shape, generator=g, dtype=torch.uint8))
    sizes = {k: v.shape[2] for k, v in m.page_planes().items()}
    assert len(set(sizes.values())) == 3, sizes  # the planes really differ
    data = m.copy_page_out(2)
    before = {k: v.clone() for k, v in m.page_planes().items()}
    m.copy_page_in(4, data)
    for k, v in m.page_planes().items():
        assert torch.equal(v[:, 4], before[k][:, 2]), k
        for p in (0, 1, 2, 3):
            assert torch.equal(v[:, p], before[k][:, p]), f"{k}: page {p} overwritten"


def test_a_match_whose_pages_were_reclaimed_waits_and_recomputes(model) -> None:
    """Between `match` and admission an allocation can reclaim a cached page of the match (a running request
    growing in the same planning round): admission must refuse it without taking anything, and the request
    is planned afresh at the next step."""
    P = 8
    rng = random.Random(8)
    a = [rng.randrange(256) for _ in range(3 * P + 2)]
    hot = make(model, "mtp2", P=P, max_tokens=6 * P)
    ra = hot.add_request(a, greedy(2))
    hot.run_until_done()
    assert hot.manager.num_cached_pages >= 3
    rb = hot.add_request(a, greedy(2))
    hot.prefix.match(list(hot.waiting))
    assert rb.prefix_hit is not None
    # Another holder takes every free and cached page: the match's pages are reclaimed.
    hot.manager.add_request(999, hot.manager.num_free_pages * P)
    free_before = hot.manager.num_free_pages
    with pytest.raises(CapacityError, match="reclaimed"):
        hot.prefix.admit(rb, rb.num_computed + 2)
    assert not hot.manager.has_request(rb.request_id) and hot.manager.num_free_pages == free_before
    hot.manager.free_request(999)
    hot.prefix.unmatch(rb)
    hot.run_until_done()
    assert rb.num_cached_tokens == 0 and rb.output_ids == ra.output_ids


@pytest.mark.parametrize("mode", ["plain", "mtp3", "mtp2-sep"])
def test_prompt_end_checkpoint_serves_the_next_turn(model, mode: str) -> None:
    """Multi-turn: turn 2 = turn 1's prompt + its answer + more. With prompt-end checkpoints turn 2 reuses all
    of turn 1's prompt (the key includes the first answer token), and answers exactly like a cold run."""
    P = 8
    rng = random.Random(9)
    turn1 = [rng.randrange(256) for _ in range(3 * P + 5)]
    hot = make(model, mode, P=P, checkpoint_prompt_end=True)
    r1 = hot.add_request(turn1, greedy(6))
    hot.run_until_done()
    turn2 = turn1 + r1.output_ids + [rng.randrange(256) for _ in range(7)]
    r2 = hot.add_request(turn2, greedy(6))
    hot.run_until_done()
    cold = make(model, mode, P=P, checkpoint_prompt_end=True)  # empty cache, same chunking
    c2 = cold.add_request(turn2, greedy(6))
    cold.run_until_done()
    assert r2.num_cached_tokens == len(turn1)
    assert r2.output_ids == c2.output_ids
    # Without prompt-end checkpoints turn 2 reuses only up to turn 1's last page boundary.
    off = make(model, mode, P=P)
    off.add_request(turn1, greedy(6))
    off.run_until_done()
    o2 = off.add_request(turn2, greedy(6))
    off.run_until_done()
    assert o2.num_cached_tokens == (len(turn1) - 1) // P * P


def test_no_memory_for_a_checkpoint_skips_it_and_serves_on(model, caplog) -> None:
    P = 8
    rng = random.Random(10)
    a = [rng.randrange(256) for _ in range(3 * P + 2)]
    hot = make(model, "mtp2", P=P, interval=P)
    real = hot.manager.state.snapshot
    calls = {"n": 0}

    def snapshot(slot, endpoint):
        calls["n"] += 1
        if calls["n"] == 2:
            raise torch.OutOfMemoryError("no room (test)")
        return real(slot, endpoint)

    hot.manager.state.snapshot = snapshot  # type: ignore[method-assign]
    with caplog.at_level(logging.WARNING, logger="trtllm_glm.runtime.prefix_cache"):
        ra = hot.add_request(a, greedy(5))
        hot.run_until_done()
    st = hot.prefix.stats
    # Endpoints 8, 16, 24: the second fails (and makes room by dropping the first), the third is taken.
    assert st.checkpoints_skipped == 1 and st.checkpoints_taken == 2 and st.checkpoints_evicted == 1
    assert any("out of device memory" in r.message for r in caplog.records)
    rb = hot.add_request(a, greedy(5))
    hot.run_until_done()
    assert rb.output_ids == ra.output_ids and rb.num_cached_tokens == 3 * P
