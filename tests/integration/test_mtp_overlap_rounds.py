"""MTP drafting rounds under the overlap scheduler (issue 43 item 1): round ``n + 1`` (its fused MTP draft and its
verify) is launched from round ``n``'s outputs on the device before round ``n`` is read back; the host books round
``n`` one round late. Greedy output must be plain greedy's in every case the issue names: steady batches, requests
finishing mid-round, stop tokens inside accepted drafts, ``max_tokens`` reached inside a round, preemption, prefix
hits, slots reused right after a wide round and target / draft slot ids that differ.

CPU, fp32, CUDA graphs emulated (the padded step runs eagerly) and made to overwrite the in-flight round's outputs
as a captured graph does, so that any read of them after the next launch would see the next round's values. The
trained ``small`` preset drafts well (2.6 tokens per K = 3 round on these prompts), so drafts really are accepted,
several at a time, inside rounds launched ahead. ``num_overlapped_rounds`` is checked in the steady cases: a silent
fall-back to synchronous rounds fails them."""

from __future__ import annotations

import dataclasses

import pytest

from tests.spec_helpers import SNIPPETS, Scripted, emulate_graphs
from trtllm_glm.models.glm5_next import Glm5NextForCausalLM
from trtllm_glm.runtime.cuda_graph import CudaGraphConfig
from trtllm_glm.runtime.executor import Executor, ExecutorConfig
from trtllm_glm.runtime.request import FinishReason
from trtllm_glm.runtime.sampling import SamplingParams
from trtllm_glm.runtime.speculative_executor import SpeculativeExecutor
from trtllm_glm.speculative.config import MTPDecodingConfig

pytestmark = pytest.mark.cpu_only

K = 3
W = 1 + K
AHEAD = MTPDecodingConfig(num_nextn_predict_layers=K, adaptive=False, overlap_rounds=True)


def prompt(text: str) -> list[int]:
    return list(text.encode())


@pytest.fixture
def emulated(monkeypatch):
    emulate_graphs(monkeypatch)


@pytest.fixture(scope="module")
def model() -> Glm5NextForCausalLM:
    return Glm5NextForCausalLM.from_pretrained("small", dtype="float32").eval()


def config(overlap: bool, graphs: bool = True, **kw) -> ExecutorConfig:
    base = dict(tokens_per_block=8, max_tokens=2048, max_batch_size=4, max_num_tokens=64, max_seq_len=160)
    base.update(kw)
    sizes = [1, 2, base["max_batch_size"]]
    graph_cfg = CudaGraphConfig(batch_sizes=sizes, enable_padding=True) if graphs else None
    return ExecutorConfig(**base, cuda_graph_config=graph_cfg, overlap_scheduler=overlap)  # type: ignore[arg-type]


def overwrite_like_a_graph(ex: SpeculativeExecutor) -> None:
    """Make the emulated runner's round launched ahead overwrite the in-flight round's outputs, as one captured
    graph's replays do (the emulation returns fresh tensors): the in-flight round must be read from the host copy
    and from what the draft took before the launch, never from the device buffers afterwards."""
    runner = ex.graph_runner
    assert runner is not None
    launch = runner.replay_verify_ahead

    def replay_verify_ahead(key, plan, prev, drafts, bound):  # noqa: ANN001, ANN202
        out = launch(key, plan, prev, drafts, bound)
        for a, b in ((prev.hidden, out.hidden), (prev.logits, out.logits), (prev.packed, out.packed)):
            a.copy_(b)
        return out

    runner.replay_verify_ahead = replay_verify_ahead  # type: ignore[method-assign]


def run(model, prompts, params, *, overlap=True, mode="separate", policy=None, spec=None, cfg=None, trace=None):  # noqa: ANN001, ANN201
    """A speculative run (MTP K = 3, graphs emulated); ``trace`` (a list) gets ``(request, finished with a round in
    flight)`` for every finish."""
    spec = spec or MTPDecodingConfig(
        num_nextn_predict_layers=K, draft_kv_mode=mode, adaptive=policy is not None, overlap_rounds=True
    )
    ex = SpeculativeExecutor(model, cfg or config(overlap), spec, draft_policy=policy)
    overwrite_like_a_graph(ex)
    if trace is not None:
        finish = ex._finish

        def spy(r):  # noqa: ANN001, ANN202
            trace.append((r, ex._inflight is not None and any(s.request is r for s in ex._inflight.plan)))
            finish(r)

        ex._finish = spy  # type: ignore[method-assign]
    reqs = [ex.add_request(p, sp) for p, sp in zip(prompts, params)]
    ex.run_until_done()
    return ex, reqs


def reference(model, prompts, params, **kw):  # noqa: ANN001, ANN201
    ex = Executor(model, config(False, graphs=False, **kw))
    reqs = [ex.add_request(p, sp) for p, sp in zip(prompts, params)]
    ex.run_until_done()
    return reqs


def assert_same(ref, got) -> None:  # noqa: ANN001
    for a, b in zip(ref, got):
        assert b.output_ids == a.output_ids, (a.request_id, a.output_ids, b.output_ids)
        assert b.finish_reason == a.finish_reason


def greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=n, ignore_eos=True, **kw)


@pytest.fixture(scope="module")
def steady_ref(model):
    prompts = [prompt(t) for t in SNIPPETS[:3]]
    params = [greedy(25), greedy(21), greedy(23)]
    return prompts, params, reference(model, prompts, params)


# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("mode", "stage"), [("shared", "torch"), ("separate", "torch"), ("shared", "triton")])
def test_rounds_launched_ahead_are_lossless(emulated, model, steady_ref, mode: str, stage: str, monkeypatch) -> None:
    """A steady batch: most rounds are launched ahead, drafts are accepted several at a time, and the output is
    plain greedy's; ``max_tokens`` (21, 23, 25) ends every request inside a round, after the launches stop. With a
    separate draft manager the same rounds run synchronously too: the acceptance per position and the number of
    rounds are identical (the drafts made on the device from the in-flight round are the drafts the host makes).
    ``stage``: the verify launched ahead described by the torch reference or the one-launch kernel (interpreted)."""
    monkeypatch.setenv("TRTLLM_GLM_VERIFY_STAGE_BACKEND", stage)
    prompts, params, ref = steady_ref
    ex, got = run(model, prompts, params, mode=mode)
    assert_same(ref, got)
    assert ex.num_overlapped_rounds >= 4, ex.num_overlapped_rounds
    assert sum(r.num_accepted_total for r in got) / sum(r.num_verify_rounds for r in got) > 2.2  # 2.6: drafts accepted
    assert all(r.finish_reason is FinishReason.LENGTH for r in got)
    for m in (ex.manager, ex.draft_manager):  # everything given back
        assert m.num_free_pages == m.num_pages
    for ring in ex.manager.state.decode_tail_rings:  # the device-side rollbacks agreed with the device's counts
        assert ring.num_disagreements == 0
    if mode == "separate":
        sync, got_s = run(model, prompts, params, mode=mode, overlap=False)
        assert sync.num_overlapped_rounds == 0
        assert [r.accepted_per_position for r in got] == [r.accepted_per_position for r in got_s]
        assert [r.num_verify_rounds for r in got] == [r.num_verify_rounds for r in got_s]


def test_stop_tokens_inside_accepted_drafts(emulated, model, steady_ref, monkeypatch) -> None:
    """A stop token accepted as a draft in a round read back late ends its request there: the tokens after it are
    dropped, and so is the round launched ahead after it (computed for a request that no longer runs). The others
    go on launching ahead."""
    prompts, _, free = steady_ref
    # ":" ends the first two requests' signatures (`(self, other):`, `(parts, **kwargs):`), 9 and 17 tokens in: there
    # it is an accepted draft (`:\n` and indentation verified together) of a round read back late. The third request
    # never emits it (length-limited).
    stop = ord(":")
    params = [greedy(25, stop_token_ids=[stop]) for _ in prompts]
    ref = reference(model, prompts, params)
    assert [r.finish_reason for r in ref] == [FinishReason.STOP, FinishReason.STOP, FinishReason.LENGTH]
    assert all(free[i].output_ids.index(stop) >= 8 for i in (0, 1))
    trace: list = []
    emitted: list[tuple[int, list[int]]] = []
    ex = None

    def runner():  # noqa: ANN202
        nonlocal ex
        ex_, got_ = run(model, prompts, params, trace=trace)
        ex = ex_
        return got_

    # Record each emission's tokens to see where a stop sat in its round.
    emit = SpeculativeExecutor._emit

    def spy(self, req, tokens, gaps, logits=None):  # noqa: ANN001, ANN202
        emitted.append((req.request_id, list(tokens)))
        return emit(self, req, tokens, gaps, logits)

    # (monkeypatch, not an assignment: putting the inherited method back by assignment left it as
    # SpeculativeExecutor's own attribute, which hid later patches of Executor._emit from every test after this one.)
    monkeypatch.setattr(SpeculativeExecutor, "_emit", spy)
    got = runner()
    assert_same(ref, got)
    assert ex is not None and ex.num_overlapped_rounds >= 2
    # Some request stopped on a token that was an accepted draft (not its round's last token) ...
    assert any(stop in toks[:-1] for _, toks in emitted), emitted
    # ... and some stopped while the round after its stop was already launched.
    assert any(late for _, late in trace), trace


@pytest.mark.parametrize("mode", ["separate"])
def test_slots_reused_right_after_wide_rounds(emulated, model, mode: str) -> None:
    """More requests than slots, each ending at a different point (some inside a round): a finished request's slot
    and pages go to a waiting one right after rounds launched ahead wrote them; with a separate draft manager the
    target's state slots (its first slot is the graphs' padding slot) differ from the draft's for the same request.
    Output stays plain greedy's."""
    prompts = [prompt(t) for t in SNIPPETS[:5]]
    params = [greedy(n) for n in (22, 13, 24, 16, 19)]
    ref = reference(model, prompts, params, max_batch_size=3)
    slots_differ = []
    spec = MTPDecodingConfig(num_nextn_predict_layers=K, draft_kv_mode=mode, adaptive=False, overlap_rounds=True)
    ex = SpeculativeExecutor(model, config(True, max_batch_size=3), spec)
    overwrite_like_a_graph(ex)
    got = [ex.add_request(p, sp) for p, sp in zip(prompts, params)]
    while ex.has_work:
        ex.step()
        if mode == "separate":
            for r in ex.running:
                if ex.draft_manager.has_request(r.request_id):
                    t = ex.manager.get_state_slot(r.request_id)
                    slots_differ.append(t != ex.draft_manager.get_state_slot(r.request_id))
    assert_same(ref, got)
    assert ex.num_overlapped_rounds >= 2, ex.num_overlapped_rounds
    assert max(r.arrival for r in got if r.t_admitted is not None) == 4  # the waiting ones got freed slots
    if mode == "separate":
        assert any(slots_differ)


def test_preemption_between_rounds_launched_ahead(emulated, model, steady_ref) -> None:
    """A page pool too small for the batch: a round that cannot reserve its worst case is not launched ahead, the
    next synchronous step preempts the newest request, which recomputes and resumes (MTP history rebuilt). Output
    stays plain greedy's; rounds are launched ahead before and after."""
    prompts, params, ref = steady_ref
    cfg = config(True, max_tokens=136)
    ex, got = run(model, prompts, params, cfg=cfg)
    assert_same(ref, got)
    assert ex.num_preemptions > 0 and ex.num_overlapped_rounds > 0


def test_prefix_hits_with_rounds_launched_ahead(emulated, model) -> None:
    """Prefix caching: later requests restore a cached prefix (target pages and state, the MTP history from the
    checkpoint's draft part) and then run rounds launched ahead; pages sealed after a round read back late hold
    committed tokens only."""
    shared = prompt("import os\nimport sys\nimport json\n\n\nclass Config:\n")
    prompts = [shared + prompt(t) for t in ("    def __init__(self", "    def load(self", "    name = ")]
    params = [greedy(22), greedy(19), greedy(21)]
    ref = reference(model, prompts, params)
    cfg = config(True, enable_block_reuse=True, checkpoint_interval=8)
    ex = SpeculativeExecutor(
        model, cfg, MTPDecodingConfig(num_nextn_predict_layers=K, adaptive=False, overlap_rounds=True)
    )
    overwrite_like_a_graph(ex)
    got = [ex.add_request(prompts[0], params[0])]
    ex.run_until_done()
    got += [ex.add_request(p, sp) for p, sp in zip(prompts[1:], params[1:])]
    ex.run_until_done()
    assert_same(ref, got)
    assert ex.prefix is not None and ex.prefix.stats.hits >= 2 and got[1].num_cached_tokens >= 32
    assert ex.num_overlapped_rounds >= 6


def test_adaptive_choices_stop_and_resume_launching_ahead(emulated, model, steady_ref) -> None:
    """With the adaptive policy, rounds are launched ahead only while its choice is K: a smaller choice made at a
    late read-back waits for the round launched ahead to be read back, then runs synchronously (k = 0 ones are
    width-one steps launched ahead the width-one way), and launching ahead resumes when K is chosen again."""
    prompts, params, ref = steady_ref
    policy = Scripted(K, lambda i: K if i % 9 < 6 else (0, 1, 2)[i % 3])
    ex, got = run(model, prompts, params, policy=policy)
    assert_same(ref, got)
    assert ex.num_overlapped_rounds >= 4 and {0, 1, 2, K} <= set(policy.chosen)


def test_eligibility_is_one_predicate(emulated, model) -> None:
    """`_round_may_launch_ahead` is the one gate (the synchronous run of the steady test has it refuse everything):
    it refuses sampled requests, requests reading logits, grammar requests and budgets that could end inside the
    next two rounds."""
    prompts = [prompt(t) for t in SNIPPETS[:1]]
    ex = SpeculativeExecutor(
        model, config(True), MTPDecodingConfig(num_nextn_predict_layers=K, adaptive=False, overlap_rounds=True)
    )
    r = ex.add_request(prompts[0], greedy(40))
    ex.cfg.overlap_scheduler = False  # synchronous rounds up to the check (nothing left in flight)
    while not (r.is_decode and ex.state[r.request_id].drafts and r.num_output >= 4):
        ex.step()
    ex.cfg.overlap_scheduler = True
    plan = ex._plan(ex._decode_widths())
    assert [s.num_rows for s in plan] == [W] and ex._round_may_launch_ahead(plan)
    for change in (dict(logprobs=1), dict(temperature=0.8, seed=1)):
        r.params = dataclasses.replace(greedy(40), **change)
        assert not ex._round_may_launch_ahead(plan), change
    r.params = greedy(r.num_output + 2 * W)  # could end inside the round launched ahead
    assert not ex._round_may_launch_ahead(plan)
    r.params = greedy(r.num_output + 2 * W + 1)
    assert ex._round_may_launch_ahead(plan)
    r.grammar = object()  # a grammar request: its verify rows are masked on the host from its drafts
    assert not ex._round_may_launch_ahead(plan)
    r.grammar = None
    assert ex._round_may_launch_ahead(plan)


def test_verify_described_from_device_lengths_matches_host(emulated, model) -> None:
    """`CudaGraphRunner.replay_verify_ahead` describes each round launched ahead from device values only; once the
    round before it is read back, the host's own view agrees: every sequence's rows start at its committed length,
    its root token is the bonus token just emitted, and the tail ring's cross-check count is the accepted count."""
    prompts = [prompt(t) for t in SNIPPETS[:2]]
    ex = SpeculativeExecutor(
        model, config(True), MTPDecodingConfig(num_nextn_predict_layers=K, adaptive=False, overlap_rounds=True)
    )
    runner = ex.graph_runner
    launches, books = [], []
    replay, launch, book = runner.replay_verify_ahead, runner._launch, ex._book_round_ahead
    ahead = [False]

    def replay_spy(*a):  # noqa: ANN002, ANN202
        ahead[0] = True
        try:
            return replay(*a)
        finally:
            ahead[0] = False

    def launch_spy(key):  # noqa: ANN001, ANN202
        if ahead[0]:
            m = ex.meta
            launches.append((m.positions_t.clone(), m.row_seq_t.clone(), m.kv_lens_t.clone(),
                             runner.input_ids[: m.num_tokens].clone(), m.spec.num_accepted_t.clone()))  # fmt: skip
        return launch(key)

    def book_spy(live, plan, committed, drafted):  # noqa: ANN001, ANN202
        books.append({i: (s.request.num_computed, s.request.tokens[-1], committed[i]) for i, s in live})
        return book(live, plan, committed, drafted)

    runner.replay_verify_ahead, runner._launch, ex._book_round_ahead = replay_spy, launch_spy, book_spy
    for p in prompts:
        ex.add_request(p, greedy(30))
    ex.run_until_done()
    assert len(launches) == len(books) >= 5
    for (pos, row_seq, kv, ids, acc), host in zip(launches, books):
        for i, (n_computed, bonus, committed) in host.items():
            assert pos[i * W : (i + 1) * W].tolist() == list(range(n_computed, n_computed + W))
            assert row_seq[i * W : (i + 1) * W].tolist() == [i] * W
            assert int(kv[i]) == n_computed + W and int(ids[i * W]) == bonus and int(acc[i]) == committed
