"""MTP width-one rounds under the overlap scheduler (issue 43 item 1, first part): when the adaptive policy drafts
nothing, steps are launched before the previous one is read back, and the MTP layer catches up on the in-flight
step on the device (`MTPDrafter.catch_up_ahead`) before the next step overwrites its outputs. Emulated CUDA
graphs on the CPU (tests/unittest/runtime/test_cuda_graph.py's `emulated`), fp32: the output is plain greedy's and the
MTP cache is bit for bit the one of the same rounds run without the overlap scheduler."""

from __future__ import annotations

import pytest
import torch

from tests.spec_helpers import Scripted, emulate_graphs
from trtllm_glm.models.glm5_next import Glm5NextForCausalLM
from trtllm_glm.runtime.cuda_graph import CudaGraphConfig
from trtllm_glm.runtime.executor import Executor, ExecutorConfig
from trtllm_glm.runtime.lossless import compare_greedy
from trtllm_glm.runtime.sampling import SamplingParams
from trtllm_glm.runtime.speculative_executor import SpeculativeExecutor
from trtllm_glm.speculative.config import MTPDecodingConfig

pytestmark = pytest.mark.cpu_only

PROMPTS = [[5, 9, 2, 7, 5, 9, 2, 7, 5, 9, 2], [3, 1, 4, 1, 5, 9, 2, 6, 5], [8, 8, 1, 2, 3, 8, 8, 1]]
MAX_TOKENS = [16, 12, 14]


@pytest.fixture
def emulated(monkeypatch):
    emulate_graphs(monkeypatch)


@pytest.fixture(scope="module")
def model() -> Glm5NextForCausalLM:
    return Glm5NextForCausalLM.from_pretrained("tiny", layers=[0, 3], dtype="float32").eval()


def plain(model):
    ex = Executor(model, ExecutorConfig(tokens_per_block=8, max_tokens=1024, max_batch_size=4, max_num_tokens=64,
                                        max_seq_len=96))  # fmt: skip
    reqs = [ex.add_request(p, SamplingParams(max_tokens=m, ignore_eos=True)) for p, m in zip(PROMPTS, MAX_TOKENS)]
    ex.run_until_done()
    return reqs


def run(model, mode: str, overlap: bool, script, **spec_kw):  # noqa: ANN001
    cfg = ExecutorConfig(tokens_per_block=8, max_tokens=1024, max_batch_size=4, max_num_tokens=64, max_seq_len=96,
                         cuda_graph_config=CudaGraphConfig(batch_sizes=[1, 2, 4], enable_padding=True),
                         overlap_scheduler=overlap)  # fmt: skip
    spec = MTPDecodingConfig(num_nextn_predict_layers=2, draft_kv_mode=mode, **spec_kw)
    ex = SpeculativeExecutor(model, cfg, spec, draft_policy=Scripted(2, script) if script is not None else None)
    chained = ex.graph_runner.replay_chained

    def replay_chained(key, plan, prev):  # noqa: ANN001
        # A captured graph writes every replay's outputs into the same buffers: the step launched ahead
        # overwrites the in-flight step's hidden rows. The emulating runner returns fresh tensors, so the
        # overwrite is made here; a catch-up reading them after the launch would read the next step's rows.
        out = chained(key, plan, prev)
        prev.hidden.copy_(out.hidden)
        return out

    ex.graph_runner.replay_chained = replay_chained
    reqs = [ex.add_request(p, SamplingParams(max_tokens=m, ignore_eos=True)) for p, m in zip(PROMPTS, MAX_TOKENS)]
    disabled = 0
    while ex.has_work:
        ex.step()
        disabled += sum(st.mtp_disabled for st in ex.state.values())
    return ex, reqs, disabled


def assert_lossless(ref, got) -> None:
    for a, b in zip(ref, got):
        assert len(a.output_ids) == len(b.output_ids)
        d = compare_greedy(a.output_ids, a.logit_gaps, b.output_ids)
        assert d is None or d.excused, d


@pytest.mark.parametrize("mode", ["shared", "separate"])
def test_idle_mtp_rounds_overlap_and_catch_up_on_the_device(emulated, model, mode: str) -> None:
    ref = plain(model)
    # K = 0 every round: with the overlap scheduler each step but the last few of a request is launched ahead.
    # Catching up every step (no lag: held rows would leave the MTP cache unwritten until drafting resumes).
    ex_o, got_o, dis_o = run(model, mode, True, lambda i: 0, catchup_lag=0)
    ex_s, got_s, dis_s = run(model, mode, False, lambda i: 0, catchup_lag=0)
    assert_lossless(ref, got_o)
    assert [r.output_ids for r in got_o] == [r.output_ids for r in got_s]
    assert ex_o.num_overlapped_steps > 5 and ex_o.num_catchups_ahead > 5 and ex_s.num_overlapped_steps == 0
    assert dis_o == dis_s == 0  # the MTP history never has a gap
    # The MTP cache the device catch-ups wrote is the one the synchronous rounds write, bit for bit.
    for name in ("latent", "index_k"):
        a = getattr(ex_o.draft_manager, name)[ex_o.mtp_plane]
        b = getattr(ex_s.draft_manager, name)[ex_s.mtp_plane]
        assert a.float().abs().sum() > 0 and torch.equal(a.view(torch.uint8), b.view(torch.uint8)), name


@pytest.mark.parametrize("mode", ["shared", "separate"])
def test_drafting_resumes_after_overlapped_stretches(emulated, model, mode: str) -> None:
    """Stretches of K = 0 (launched ahead) and K = 2 (synchronous verify rounds) alternate; a K chosen while a
    step launched ahead runs waits for the next read-back. Output stays plain greedy's."""
    ref = plain(model)
    ex, got, disabled = run(model, mode, True, lambda i: 2 if i % 7 in (0, 1) else 0)
    assert_lossless(ref, got)
    assert ex.num_overlapped_steps > 0 and ex.num_catchups_ahead > 0 and disabled == 0
    assert sum(r.num_verify_rounds for r in got) >= 4  # drafting resumed after every stretch
    assert 2 in ex.draft_policy.chosen and 0 in ex.draft_policy.chosen
    assert ex.drafter.num_lag_flushes > 0  # the K = 0 stretches held their rows (the default catch-up lag)


@pytest.mark.parametrize("overlap", [False, True])
def test_early_drafts_follow_the_adaptive_choice(emulated, model, overlap: bool) -> None:
    """``early_draft`` (the default) under the adaptive policy: a round's draft is launched before its read-back
    while the policy's last choice was K; a choice of 0 made at a read-back applies from the round after (drafted
    already), and drafting resumes at the next choice of K. Output stays plain greedy's."""
    ref = plain(model)
    ex, got, disabled = run(model, "shared", overlap, lambda i: 2 if (i // 5) % 2 == 0 else 0)
    assert_lossless(ref, got)
    assert ex.num_early_drafts >= 3 and disabled == 0
    assert 2 in ex.draft_policy.chosen and 0 in ex.draft_policy.chosen
    assert sum(r.num_verify_rounds for r in got) > ex.num_early_drafts  # rounds drafted after a read-back too


@pytest.mark.parametrize("overlap", [False, True])
def test_lag_flushes_stay_aligned_when_requests_join_apart(emulated, model, overlap: bool) -> None:
    """Requests join one step apart and nobody drafts (K = 0) for ten rounds, lag 3: when one request's ring is
    full, every request's held rows are caught up with it, so the batch flushes about once per lag's length, not
    once per request (each flush replaying the catch-up graph over a few rows). Then drafting resumes; output plain
    greedy's and the MTP history has no gap."""
    ref = plain(model)
    cfg = ExecutorConfig(tokens_per_block=8, max_tokens=1024, max_batch_size=4, max_num_tokens=64, max_seq_len=96,
                         cuda_graph_config=CudaGraphConfig(batch_sizes=[1, 2, 4], enable_padding=True),
                         overlap_scheduler=overlap)  # fmt: skip
    spec = MTPDecodingConfig(num_nextn_predict_layers=2, draft_kv_mode="shared", catchup_lag=3)
    ex = SpeculativeExecutor(model, cfg, spec, draft_policy=Scripted(2, lambda i: 0 if i < 10 else 2))
    reqs = []
    for p, m in zip(PROMPTS, MAX_TOKENS):
        reqs.append(ex.add_request(p, SamplingParams(max_tokens=m, ignore_eos=True)))
        ex.step()
    steps = 0
    while ex.has_work:
        ex.step()
        steps += 1
        assert not any(st.mtp_disabled for st in ex.state.values())
    assert_lossless(ref, reqs)
    assert sum(r.num_verify_rounds for r in reqs) > 0  # drafting resumed
    # Ten rounds with all three holding, lag 3: three or four aligned flushes (unaligned: seven or eight).
    assert 1 <= ex.drafter.num_lag_flushes <= 4, (ex.drafter.num_lag_flushes, steps)


@pytest.mark.parametrize("overlap", [False, True])
def test_a_lag_flush_through_the_graphs_is_one_group_when_its_slices_fit(emulated, model, overlap: bool) -> None:
    """Four requests hold 8 rows each (32 rows) and the metadata takes 16 rows a forward: through the catch-up
    graphs a flush replays slices of at most W = 3 rows per request (12 rows), so the whole batch is one group (3
    slices), not the eager forward's groups of at most 16 held rows (2 groups, 6 slices). Output plain greedy's and
    drafting resumes from a caught-up history (what a flush writes: `test_adaptive_draft.py`'s
    `test_held_rows_fill_the_mtp_cache_as_per_step_catch_ups`)."""
    from trtllm_glm.speculative.mtp.drafter import MTPDrafter

    prompts = PROMPTS + [[2, 7, 1, 8, 2, 8]]
    cfg = ExecutorConfig(tokens_per_block=8, max_tokens=1024, max_batch_size=4, max_num_tokens=16, max_seq_len=96,
                         cuda_graph_config=CudaGraphConfig(batch_sizes=[1, 2, 4], enable_padding=True),
                         overlap_scheduler=overlap)  # fmt: skip
    ref_ex = Executor(model, ExecutorConfig(tokens_per_block=8, max_tokens=1024, max_batch_size=4, max_num_tokens=64,
                                            max_seq_len=96))  # fmt: skip
    ref = [ref_ex.add_request(p, SamplingParams(max_tokens=20, ignore_eos=True)) for p in prompts]
    ref_ex.run_until_done()
    slices: list[int] = []
    flushes: list[int] = []

    def run(lag: int):
        spec = MTPDecodingConfig(num_nextn_predict_layers=2, draft_kv_mode="shared", catchup_lag=lag)
        ex = SpeculativeExecutor(model, cfg, spec, draft_policy=Scripted(2, lambda i: 0 if i < 12 else 2))
        through = ex.drafter._flush_through_graphs

        def counted(group, slots, starts, lags, flat, capture):  # noqa: ANN001
            ok = through(group, slots, starts, lags, flat, capture)
            slices.append(-(-max(lags) // ex.drafter.chain_graphs.width) if ok else 0)
            return ok

        ex.drafter._flush_through_graphs = counted
        flush = ex.drafter._flush_lag
        ex.drafter._flush_lag = lambda seqs, capture=True: (flushes.append(len(seqs)), flush(seqs, capture))[1]
        reqs = [ex.add_request(p, SamplingParams(max_tokens=20, ignore_eos=True)) for p in prompts]
        ex.run_until_done()
        assert not any(st.mtp_disabled for st in ex.state.values())
        return ex, reqs

    ex, got = run(8)
    assert isinstance(ex.drafter, MTPDrafter) and ex.drafter.chain_graphs.width == 3
    assert_lossless(ref, got)
    # Every flush of the whole batch is one group through the graphs (8 held rows a request in slices of 3; the last
    # flush, when drafting resumes, may hold fewer).
    assert 4 in flushes and ex.drafter.num_lag_flushes == len(slices) == len(flushes), (flushes, slices)
    assert all(0 < n <= 3 for n in slices), slices
    assert sum(r.num_verify_rounds for r in got) > 0  # drafting resumed from a caught-up history


def test_idle_rounds_launched_ahead_hold_rows_and_flush_a_full_lag(emulated, model) -> None:
    """K = 0 every round with a lag of 3 rows: the steps launched ahead hold their rows on the device, and a full
    lag is caught up before the next row is held (its tokens are on the host by then). The MTP history never has
    a gap and the output is plain greedy's."""
    ref = plain(model)
    ex, got, disabled = run(model, "separate", True, lambda i: 0, catchup_lag=3)
    assert_lossless(ref, got)
    assert ex.num_overlapped_steps > 5 and ex.num_catchups_ahead > 5 and disabled == 0
    assert ex.drafter.num_lag_flushes >= 3
    # The rows a step launched ahead held leave the drafter nothing to do at its read-back: no `DraftSeq` list.
    assert ex.num_idle_draft_calls_skipped > 5


def test_rounds_above_max_concurrency_overlap_too(emulated, model) -> None:
    """Without the adaptive policy, the rounds above ``max_concurrency`` (width one) launch ahead the same way;
    once the batch shrinks to the cap, drafting resumes."""
    ref = plain(model)
    ex, got, disabled = run(model, "shared", True, None, adaptive=False, max_concurrency=2)
    assert_lossless(ref, got)
    assert ex.draft_policy is None and ex.num_overlapped_steps > 0 and ex.num_catchups_ahead > 0 and disabled == 0
    assert ex.num_unspeculated_rounds > 0 and sum(r.num_verify_rounds for r in got) > 0
    assert ex.num_idle_draft_calls_skipped > 0


@pytest.mark.parametrize(("mode", "stage"), [("shared", "torch"), ("separate", "torch"), ("shared", "triton")])
def test_early_draft_launched_before_the_read_back_drafts_as_after_it(
    emulated, mode: str, stage: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``early_draft``: each round's MTP draft is launched from its verify's outputs on the device before the host
    reads the round back, and booked after. The trained model accepts drafts, so a draft made from the wrong rows
    (or caught up on the wrong count) would change what is accepted: the drafts accepted at every position, the
    MTP cache and the output equal the synchronous rounds', including a request that stops on a token mid-run
    (its early draft is dropped) and one that joins late. Emulated graphs (the verify's outputs stay in their
    buffers, as a replay's do). ``stage``: the draft's inputs staged by the torch ops or by the one-launch kernel
    (`speculative.mtp.staging`, interpreted here; what CUDA runs)."""
    monkeypatch.setenv("TRTLLM_GLM_MTP_STAGE_BACKEND", stage)
    m = Glm5NextForCausalLM.from_pretrained("small", dtype="float32").eval()
    prompts = [list(t.encode()) for t in ("import os\nimport sys\n", "class A:\n    def f(self", "for i in range(")]

    def go(early: bool):  # noqa: ANN202
        cfg = ExecutorConfig(tokens_per_block=8, max_tokens=2048, max_batch_size=3, max_num_tokens=64,
                             max_seq_len=160, cuda_graph_config=CudaGraphConfig(batch_sizes=[1, 2, 4],
                                                                                enable_padding=True))  # fmt: skip
        spec = MTPDecodingConfig(num_nextn_predict_layers=3, draft_kv_mode=mode, early_draft=early)
        ex = SpeculativeExecutor(m, cfg, spec)
        draft_ahead = ex.drafter.draft_ahead

        def spy(*a, **kw):  # noqa: ANN002, ANN003, ANN202
            # The verify's read-back must be queued before its early draft (else the host waits for both).
            copies.append(ex._step_out._copy is not None and ex._step_out._host is None)
            return draft_ahead(*a, **kw)

        copies: list[bool] = []
        ex.drafter.draft_ahead = spy
        params = [SamplingParams(max_tokens=48, ignore_eos=True),
                  SamplingParams(max_tokens=48, ignore_eos=True, stop_token_ids=[10]),  # stops at a newline
                  SamplingParams(max_tokens=40, ignore_eos=True)]  # fmt: skip
        reqs = [ex.add_request(p, sp) for p, sp in zip(prompts[:2], params[:2])]
        for _ in range(6):
            ex.step()
        reqs.append(ex.add_request(prompts[2], params[2]))  # joins late: a round with a prefill is not early
        ex.run_until_done()
        dm = ex.draft_manager
        assert dm.num_free_pages == dm.num_pages and ex.manager.num_free_pages == ex.manager.num_pages
        assert len(copies) == ex.num_early_drafts and all(copies)
        return ex, reqs

    ex_s, sync = go(False)
    ex_e, early = go(True)
    assert ex_s.num_early_drafts == 0 and ex_e.num_early_drafts > 5
    assert [r.output_ids for r in early] == [r.output_ids for r in sync]
    assert [r.accepted_per_position for r in early] == [r.accepted_per_position for r in sync]
    assert sum(r.num_accepted_total - r.num_verify_rounds for r in sync) > 10  # drafts were accepted
    assert early[1].output_ids[-1] == 10 and len(early[1].output_ids) < 48  # stopped on its token


def test_adaptive_default_is_off_on_emulated_graphs(emulated, model) -> None:
    """``adaptive=None`` (the default) runs the policy only where rounds replay CUDA graphs on a GPU: graphs emulated
    on the CPU keep fixed K (their timings are not the GPU's), and an explicit choice holds (the GPU side:
    test_cuda_graph_gpu.py's `test_adaptive_policy_on_by_default_on_cuda_graphs`)."""
    cfg = ExecutorConfig(tokens_per_block=8, max_tokens=1024, max_batch_size=4, max_num_tokens=64, max_seq_len=96,
                         cuda_graph_config=CudaGraphConfig(batch_sizes=[1, 2, 4], enable_padding=True))  # fmt: skip
    assert SpeculativeExecutor(model, cfg, MTPDecodingConfig(num_nextn_predict_layers=2)).draft_policy is None
    on = SpeculativeExecutor(model, cfg, MTPDecodingConfig(num_nextn_predict_layers=2, adaptive=True))
    assert on.draft_policy is not None and list(on.draft_policy.candidates) == [0, 2]
