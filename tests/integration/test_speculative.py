"""Speculative decoding end to end on the tiny preset (fp32): lossless against non-speculative greedy in
randomized mixed batches, and exact state after accepted/rejected drafts (docs/design.md §6-§7)."""

from __future__ import annotations

import random

import pytest
import torch

from benchmarks.harness.model_harness import ModelHarness
from trtllm_glm.cli import main as cli_main
from trtllm_glm.models.glm5_next import Glm5NextForCausalLM
from trtllm_glm.runtime.executor import Executor, ExecutorConfig
from trtllm_glm.runtime.lossless import compare_greedy
from trtllm_glm.runtime.sampling import SamplingParams
from trtllm_glm.runtime.speculative_executor import SpeculativeExecutor
from trtllm_glm.speculative.config import MTPDecodingConfig, NGramDecodingConfig
from trtllm_glm.speculative.drafters import OracleDrafter

pytestmark = pytest.mark.cpu_only

MAX_TOKENS = 20


@pytest.fixture(scope="module")
def model() -> Glm5NextForCausalLM:
    return Glm5NextForCausalLM.from_pretrained("tiny", seed=0)


def prompts(n: int, seed: int, repetitive: bool = False) -> list[list[int]]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        if repetitive:  # gives the n-gram drafter something to match
            base = [rng.randrange(256) for _ in range(rng.randrange(2, 6))]
            out.append((base * 20)[: rng.randrange(8, 50)])
        else:
            out.append([rng.randrange(256) for _ in range(rng.randrange(1, 50))])
    return out


def exec_cfg(rng: random.Random, **kw) -> ExecutorConfig:
    d = dict(tokens_per_block=rng.choice([4, 8, 16]), max_tokens=1024, max_batch_size=4, max_num_tokens=40,
             max_seq_len=128, prefill_chunk_size=rng.choice([None, 3, 7, 16]))  # fmt: skip
    d.update(kw)
    return ExecutorConfig(**d)


def reference(model, ps, max_tokens=MAX_TOKENS):
    ex = Executor(model, ExecutorConfig(tokens_per_block=16, max_tokens=2048, max_batch_size=8, max_num_tokens=512,
                                        max_seq_len=128))  # fmt: skip
    reqs = [ex.add_request(p, SamplingParams(max_tokens=max_tokens, ignore_eos=True)) for p in ps]
    ex.run_until_done()
    return reqs


def run_spec(model, ps, cfg, spec, drafter=None, max_tokens=MAX_TOKENS, each_step=None):
    ex = SpeculativeExecutor(model, cfg, spec, drafter=drafter)
    reqs = [ex.add_request(p, SamplingParams(max_tokens=max_tokens, ignore_eos=True)) for p in ps]
    while ex.has_work:
        ex.step()
        if each_step is not None:
            each_step(ex, reqs)
    return reqs, ex


def assert_lossless(refs, tests) -> None:
    for ref, t in zip(refs, tests):
        assert len(t.output_ids) == len(ref.output_ids)
        d = compare_greedy(ref.output_ids, ref.logit_gaps, t.output_ids)
        assert d is None or d.excused, f"request {t.request_id}: {d}"


# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("k", [1, 3, 5])
@pytest.mark.parametrize("mode", ["shared", "separate"])
def test_mtp_lossless_mixed_batches(model, k, mode) -> None:
    seed = 10 * k + (mode == "separate")
    rng = random.Random(seed)
    ps = prompts(5, seed)
    refs = reference(model, ps)
    # Adaptive width: some rounds are width one, others use every draft.
    spec = MTPDecodingConfig(adaptive=False, num_nextn_predict_layers=k, draft_kv_mode=mode,
                             draft_len_fn=lambda r: (r.request_id + len(r.tokens)) % (k + 2))  # fmt: skip
    tests, ex = run_spec(model, ps, exec_cfg(rng), spec)
    assert_lossless(refs, tests)
    assert sum(r.num_verify_rounds for r in tests) > 0


@pytest.mark.parametrize("k", [3, 7])
def test_ngram_lossless_with_preemption(model, k) -> None:
    rng = random.Random(k)
    ps = prompts(5, k, repetitive=True)
    refs = reference(model, ps, max_tokens=24)
    # A small page pool forces preemption and recompute mid-generation.
    tests, ex = run_spec(model, ps, exec_cfg(rng, tokens_per_block=8, max_tokens=160, max_seq_len=80),
                         NGramDecodingConfig(max_draft_len=k), max_tokens=24)  # fmt: skip
    assert ex.num_preemptions > 0
    assert_lossless(refs, tests)
    assert sum(r.num_verify_rounds for r in tests) > 0


def test_mtp_lossless_with_preemption(model) -> None:
    ps = prompts(5, 3)
    refs = reference(model, ps, max_tokens=24)
    cfg = ExecutorConfig(tokens_per_block=8, max_tokens=160, max_batch_size=4, max_num_tokens=40, max_seq_len=80)
    spec = MTPDecodingConfig(adaptive=False, num_nextn_predict_layers=3, draft_kv_mode="separate")
    tests, ex = run_spec(model, ps, cfg, spec, max_tokens=24)
    assert ex.num_preemptions > 0
    assert_lossless(refs, tests)


def test_older_request_admitted_late_is_scheduled_first(model) -> None:
    """A request held for a prefix-cache leader is admitted after a newer one; the running batch stays oldest first,
    so the older request's verify round gets the step's row budget first. Otherwise the newer request's row comes
    first, the older one's ``1 + K`` rows never fit the rest of the budget, and once the pool runs out the newer one
    can preempt nobody (the other is older): no step could run (``CapacityError``)."""
    shared = [(7 * i + 3) % 250 for i in range(16)]
    ps = [shared + [1, 2], shared + [3, 4, 5], [9, 8, 7, 6, 5]]  # the leader, the request held for it, a newer one
    budgets = [2, 30, 40]
    pool = 60  # the batch outgrows it: the later rounds cannot get pages for both requests
    ref_ex = Executor(model, ExecutorConfig(tokens_per_block=4, max_tokens=4096, max_batch_size=4, max_num_tokens=64,
                                            max_seq_len=pool))  # fmt: skip
    refs = [ref_ex.add_request(p, SamplingParams(max_tokens=b, ignore_eos=True)) for p, b in zip(ps, budgets)]
    ref_ex.run_until_done()
    # K = 3 fills a step (max_num_tokens 4); the newer request decodes width one while the leader prefills beside it.
    spec = NGramDecodingConfig(
        max_draft_len=3, draft_len_fn=lambda r: 0 if r.request_id == 2 and r.num_output < 12 else 3
    )
    cfg = ExecutorConfig(tokens_per_block=4, max_tokens=pool, max_batch_size=2, max_num_tokens=4, max_seq_len=pool,
                         prefill_chunk_size=2, enable_block_reuse=True)  # fmt: skip
    ex = SpeculativeExecutor(model, cfg, spec, drafter=OracleDrafter({i: r.output_ids for i, r in enumerate(refs)}))
    reqs = [ex.add_request(ps[0], SamplingParams(max_tokens=budgets[0], ignore_eos=True))]
    while ex.has_work:
        ex.step()
        if ex.num_steps == 2:  # the leader is prefilling the shared pages: the first of these waits for it
            reqs += [
                ex.add_request(p, SamplingParams(max_tokens=b, ignore_eos=True)) for p, b in zip(ps[1:], budgets[1:])
            ]
        assert [r.arrival for r in ex.running] == sorted(r.arrival for r in ex.running)
    assert_lossless(refs, reqs)
    assert ex.prefix is not None and ex.prefix.stats.held > 0 and reqs[1].num_cached_tokens == 16
    assert reqs[2].t_admitted < reqs[1].t_admitted  # the newer request was admitted first


# --------------------------------------------------------------------------------------------------
def _state_check(model):
    """After each step: every running request's committed state equals a from-scratch prefill of its
    committed tokens (rings and KDA state to fp32 rounding; FP8 pools up to isolated 1-ulp flips)."""

    def check(ex: SpeculativeExecutor, reqs) -> None:
        for r in ex.running:
            n = r.num_computed
            if n < 2 or r.num_pending != 1:
                continue
            h = ModelHarness(model, max_seq_len=128, tokens_per_block=ex.manager.page_size, max_num_requests=1)
            h.step([(0, r.tokens[:n])])
            slot, slot_ref = ex.manager.get_state_slot(r.request_id), h.manager.get_state_slot(0)
            open_pos = list(range(4 * (n // 4), n))
            for li in range(len(model.config.sparse_layer_ids)):
                got, ref = ex.manager.kpool_layer_cache(li), h.manager.kpool_layer_cache(li)
                # The live ring still holds rejected rows until the next step rolls it back (§6.2).
                ring = got.decode_tail_ring.committed_ring(got.tail_ring, slot, n)
                for p in open_pos:
                    torch.testing.assert_close(ring[:, p % 4], ref.tail_ring[slot_ref, :, p % 4],
                                               atol=1e-4, rtol=1e-4, msg=f"ring layer {li} pos {p}")  # fmt: skip
                pg = ex.manager.get_batch_slot_tables([r.request_id])[0]
                pr = h.manager.get_batch_slot_tables([0])[0]
                P = ex.manager.page_size
                for pool in range(n // 4):
                    ia, ib = (pg[4 * pool // P], pool % (P // 4)), (pr[4 * pool // P], pool % (P // 4))
                    sa, sb = float(got.index_scale[ia]), float(ref.index_scale[ib])
                    da, db = got.index_k[ia].float() * sa, ref.index_k[ib].float() * sb
                    # Verify and prefill shapes round differently. One bf16 flip before the Hadamard rotation
                    # shifts every output by ~ulp/sqrt(128), which can move a few values by an FP8 step (or
                    # a tiny one by several); a pool built from other members moves most of its 128 values.
                    amax = float(torch.maximum(da.abs(), db.abs()).max())
                    tol = 0.13 * torch.maximum(da.abs(), db.abs()) + 2**-6 * amax
                    assert int(((da - db).abs() > tol).sum()) == 0, f"pool {pool} layer {li}"
                    assert int((da != db).sum()) <= 16, f"pool {pool} layer {li}"
            for ki in range(len(model.config.kda_layer_ids)):
                got, ref = ex.manager.kda_layer_state(ki), h.manager.kda_layer_state(ki)
                torch.testing.assert_close(got.recurrent[slot], ref.recurrent[slot_ref], atol=1e-4, rtol=1e-4)
                torch.testing.assert_close(got.conv[slot], ref.conv[slot_ref], atol=1e-5, rtol=1e-5)

    return check


@pytest.mark.parametrize("policy", ["accept_all", "reject_all", "random"])
def test_oracle_drafts_leave_exact_state(model, policy) -> None:
    ps = prompts(3, 21)
    refs = reference(model, ps)
    cont = {i: r.output_ids for i, r in enumerate(refs)}
    rng = random.Random(5)
    bad = {(i, j) for i in range(3) for j in range(MAX_TOKENS) if rng.random() < 0.4}
    corrupt = {
        "accept_all": lambda i, j: False,
        "reject_all": lambda i, j: True,
        "random": lambda i, j: (i, j) in bad,
    }[policy]
    drafter = OracleDrafter(cont, corrupt, vocab_size=256)
    cfg = ExecutorConfig(tokens_per_block=8, max_tokens=1024, max_batch_size=4, max_num_tokens=64, max_seq_len=128)
    tests, ex = run_spec(model, ps, cfg, NGramDecodingConfig(max_draft_len=7), drafter=drafter,
                         each_step=_state_check(model))  # fmt: skip
    assert_lossless(refs, tests)
    rounds = sum(r.num_verify_rounds for r in tests)
    emitted = sum(r.num_accepted_total for r in tests)
    if policy == "accept_all":
        assert emitted / rounds > 4  # up to 8 tokens a round (budget-truncated at the end)
    if policy == "reject_all":
        assert emitted == rounds  # only the bonus token each round


def test_width_one_and_wide_rounds_interleave(model) -> None:
    ps = prompts(3, 31)
    refs = reference(model, ps)
    cont = {i: r.output_ids for i, r in enumerate(refs)}
    spec = NGramDecodingConfig(max_draft_len=5, draft_len_fn=lambda r: [0, 5, 1, 0, 3][len(r.output_ids) % 5])
    cfg = ExecutorConfig(tokens_per_block=4, max_tokens=1024, max_batch_size=4, max_num_tokens=64, max_seq_len=128)
    tests, ex = run_spec(model, ps, cfg, spec, drafter=OracleDrafter(cont, lambda i, j: j % 3 == 2),
                         each_step=_state_check(model))  # fmt: skip
    assert_lossless(refs, tests)


def _speculation_tracker(mc: int):
    """An ``each_step`` hook checking `max_concurrency`: a round drafted while more than ``mc`` requests ran
    verifies nothing; returns the hook and the per-step log ``(running after the step, verify rounds)``."""
    log: list[tuple[int, int]] = []

    def hook(ex, reqs) -> None:
        verified = sum(r.num_verify_rounds for r in reqs)
        if log and log[-1][0] > mc:
            assert verified == log[-1][1], "a round verified drafts above max_concurrency"
        log.append((len(ex.running), verified))

    return hook, log


@pytest.mark.parametrize("spec_kind", ["oracle", "mtp-shared", "mtp-separate"])
def test_max_concurrency_speculates_only_in_small_batches(model, spec_kind) -> None:
    """Above ``max_concurrency`` running requests, rounds are width one; once requests finish and the batch
    shrinks, speculation resumes (the MTP layer kept catching up meanwhile, so it drafts again rather than
    giving up on a gap in its history), and the output stays the plain greedy one."""
    ps = prompts(4, 57)
    budgets = [6, 9, 14, 30]  # requests finish one by one: the batch shrinks 4 -> 3 -> 2 -> 1
    ref_ex = Executor(model, ExecutorConfig(tokens_per_block=16, max_tokens=2048, max_batch_size=8,
                                            max_num_tokens=512, max_seq_len=128))  # fmt: skip
    refs = [ref_ex.add_request(p, SamplingParams(max_tokens=b, ignore_eos=True)) for p, b in zip(ps, budgets)]
    ref_ex.run_until_done()
    mc = 2
    drafter = None
    if spec_kind == "oracle":
        spec = NGramDecodingConfig(max_draft_len=3, max_concurrency=mc)
        drafter = OracleDrafter({i: r.output_ids for i, r in enumerate(refs)}, lambda i, j: False)
    else:
        spec = MTPDecodingConfig(
            adaptive=False, num_nextn_predict_layers=2, draft_kv_mode=spec_kind[4:], max_concurrency=mc
        )
    cfg = ExecutorConfig(tokens_per_block=4, max_tokens=1024, max_batch_size=4, max_num_tokens=64, max_seq_len=128)
    ex = SpeculativeExecutor(model, cfg, spec, drafter=drafter)
    hook, log = _speculation_tracker(mc)
    reqs = [ex.add_request(p, SamplingParams(max_tokens=b, ignore_eos=True)) for p, b in zip(ps, budgets)]
    while ex.has_work:
        ex.step()
        hook(ex, reqs)
        assert not any(ex.state[r.request_id].mtp_disabled for r in ex.running)
    assert_lossless(refs, reqs)
    assert [len(r.output_ids) for r in reqs] == budgets
    assert ex.num_unspeculated_rounds > 0
    # Speculation resumed for the requests that outlived the large batch.
    assert reqs[2].num_verify_rounds > 0 and reqs[3].num_verify_rounds > 0
    assert reqs[0].num_verify_rounds == 0  # it finished while four requests ran
    if spec_kind == "oracle":
        assert reqs[3].num_accepted_total > reqs[3].num_verify_rounds  # perfect drafts were accepted


def test_separate_draft_pool_smaller_and_shifted(model) -> None:
    ps = prompts(4, 41)
    refs = reference(model, ps)
    cfg = ExecutorConfig(tokens_per_block=8, max_tokens=1024, max_batch_size=4, max_num_tokens=64, max_seq_len=128)
    shared, _ = run_spec(model, ps, cfg, MTPDecodingConfig(adaptive=False, num_nextn_predict_layers=3))
    ex = SpeculativeExecutor(model, cfg, MTPDecodingConfig(adaptive=False, num_nextn_predict_layers=3,
                                                           draft_kv_mode="separate", draft_max_tokens=400))  # fmt: skip
    assert ex.draft_manager is not ex.manager and ex.draft_manager.num_pages < ex.manager.num_pages
    ex.draft_manager.add_request(10**6, num_tokens=64)  # shifts every draft page id away from the target's
    reqs = [ex.add_request(p, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)) for p in ps]
    seen = []
    while ex.has_work:
        ex.step()
        for r in ex.running:
            if ex.draft_manager.has_request(r.request_id):
                row = ex.draft_manager.get_batch_slot_tables([r.request_id])[0]
                assert all(0 <= p < ex.draft_manager.num_pages for p in row)
                seen.append((row, ex.manager.get_batch_slot_tables([r.request_id])[0]))
    assert any(a[: len(b)] != b[: len(a)] for a, b in seen)  # the two id spaces really differ
    assert [r.output_ids for r in reqs] == [r.output_ids for r in shared]
    assert_lossless(refs, reqs)


def test_acceptance_statistics_and_cli(capsys) -> None:
    rc = cli_main(["generate", "--prompt", "abcabcabcabc", "--max-tokens", "12", "--ignore-eos",
                   "--speculative", "ngram", "--draft-len", "4", "--check-lossless"])  # fmt: skip
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "mean accepted length" in out and "lossless" in out
    rc = cli_main(["generate", "--prompt", "hi", "--max-tokens", "8", "--ignore-eos", "--speculative", "mtp",
                   "--draft-len", "2", "--draft-kv-mode", "separate", "--check-lossless"])  # fmt: skip
    assert rc == 0


def test_bad_speculative_configs(model) -> None:
    # MTP's old name for max_draft_len is checked as max_draft_len.
    with pytest.raises(ValueError, match=r"max_draft_len must be in \[1, 5\], got 6"):
        MTPDecodingConfig(adaptive=False, num_nextn_predict_layers=6)
    with pytest.raises(ValueError, match="max_draft_len"):
        NGramDecodingConfig(max_draft_len=8)
    with pytest.raises(ValueError, match="draft_kv_mode"):
        MTPDecodingConfig(adaptive=False, draft_kv_mode="both")
    for bad in (0, -1, 2.0, True):
        with pytest.raises(ValueError, match="max_concurrency"):
            NGramDecodingConfig(max_concurrency=bad)
        with pytest.raises(ValueError, match="max_concurrency"):
            MTPDecodingConfig(adaptive=False, max_concurrency=bad)


@pytest.mark.parametrize("mode", ["shared", "separate"])
def test_mtp_tail_ring_restored_after_chained_drafts(model, monkeypatch, mode) -> None:
    """Chained MTP rows are speculative: after drafting, the MTP plane's ring equals what the catch-up
    (real pairs only) left, in both draft KV modes."""
    cfg = ExecutorConfig(tokens_per_block=8, max_tokens=1024, max_batch_size=4, max_num_tokens=64, max_seq_len=128)
    ex = SpeculativeExecutor(
        model, cfg, MTPDecodingConfig(adaptive=False, num_nextn_predict_layers=4, draft_kv_mode=mode)
    )
    after_catch_up = {}
    orig = ex.drafter._mtp_step
    checked = []

    def spy(reqs, past, q, nxt, prev, *, decode, _orig=orig, _ex=ex, **kw):
        out = _orig(reqs, past, q, nxt, prev, decode=decode, **kw)
        if not decode:
            ring = _ex.draft_manager.tail_ring[_ex.mtp_plane]
            after_catch_up.clear()
            for r in reqs:
                after_catch_up[r.request_id] = ring[_ex.draft_manager.get_state_slot(r.request_id)].clone()
        return out

    orig_draft = ex.drafter.draft

    def draft_and_check(*a, _ex=ex, **k):
        orig_draft(*a, **k)
        ring = _ex.draft_manager.tail_ring[_ex.mtp_plane]
        for rid, want in after_catch_up.items():
            if _ex.draft_manager.has_request(rid):
                assert torch.equal(ring[_ex.draft_manager.get_state_slot(rid)], want)
                checked.append(len(_ex.state[rid].drafts))

    monkeypatch.setattr(ex.drafter, "_mtp_step", spy)
    monkeypatch.setattr(ex.drafter, "draft", draft_and_check)
    for p in prompts(3, 51):
        ex.add_request(p, SamplingParams(max_tokens=12, ignore_eos=True))
    ex.run_until_done()
    assert max(checked) == 4  # chains of 3 speculative MTP rows really ran


def test_stop_tokens_truncate_accepted_drafts(model) -> None:
    ps = prompts(3, 61)
    refs = reference(model, ps, max_tokens=30)
    stops = [r.output_ids[7] for r in refs]
    ex_ref = Executor(model, ExecutorConfig(tokens_per_block=8, max_tokens=1024, max_batch_size=4, max_seq_len=128))
    want = [
        ex_ref.add_request(p, SamplingParams(max_tokens=30, stop_token_ids=[s], ignore_eos=True))
        for p, s in zip(ps, stops)
    ]
    ex_ref.run_until_done()
    cont = {i: r.output_ids for i, r in enumerate(refs)}
    ex = SpeculativeExecutor(model, ExecutorConfig(tokens_per_block=8, max_tokens=1024, max_batch_size=4,
                                                   max_seq_len=128), NGramDecodingConfig(max_draft_len=7),
                             drafter=OracleDrafter(cont))  # fmt: skip
    got = [
        ex.add_request(p, SamplingParams(max_tokens=30, stop_token_ids=[s], ignore_eos=True)) for p, s in zip(ps, stops)
    ]
    ex.run_until_done()
    for w, g in zip(want, got):
        assert g.output_ids == w.output_ids and g.finish_reason == w.finish_reason
        assert g.output_ids[-1] in stops
