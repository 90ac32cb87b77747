"""CUDA graphs of decode / verify steps on the GPU: the forward is sync-free and capturable, replays give
the eager tokens (plain, MTP, n-gram; batches padded 3 -> 4, requests leaving and joining, slots reused),
the padding slot is never a request's, and a replayed plain step needs one device-to-host copy.

Needs CUDA (tests/conftest.py skips ``gpu`` tests without it). Run with ``-s`` to see the sync listing of
an eager step, capture times and memory.
"""

from __future__ import annotations

import traceback
import warnings

import pytest
import torch

from trtllm_glm.models.glm5_next import Glm5NextForCausalLM
from trtllm_glm.runtime.cuda_graph import PADDING_REQUEST_ID, CudaGraphConfig
from trtllm_glm.runtime.executor import Executor, ExecutorConfig
from trtllm_glm.runtime.lossless import compare_greedy
from trtllm_glm.runtime.sampling import SamplingParams
from trtllm_glm.runtime.speculative_executor import SpeculativeExecutor
from trtllm_glm.speculative.config import MTPDecodingConfig, NGramDecodingConfig

pytestmark = pytest.mark.gpu

PROMPTS = [
    list(b"def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n"),
    list(b"import os\nimport sys\n\nclass Reader:\n    def __init__(self, path):\n        self.path = "),
    list(b"for i in range(10):\n    print(i)\nfor j in range(10):\n    print("),
    list(b"    if x is None:\n        return None\n    if y is None:\n        return "),
]
MAX_TOKENS = [24, 32, 16, 20]


@pytest.fixture(scope="module")
def model() -> Glm5NextForCausalLM:
    return Glm5NextForCausalLM.from_pretrained("small", dtype="float32", device="cuda").eval()


def _make(model, mode: str, graphs: CudaGraphConfig | None) -> Executor:
    cfg = ExecutorConfig(tokens_per_block=16, max_tokens=4096, max_batch_size=4, max_num_tokens=256,
                         max_seq_len=256, cuda_graph_config=graphs)  # fmt: skip
    if mode == "plain":
        return Executor(model, cfg)
    if mode == "ngram":
        return SpeculativeExecutor(model, cfg, NGramDecodingConfig(max_draft_len=7))
    kv_mode = "separate" if mode == "mtp_separate" else "shared"
    return SpeculativeExecutor(
        model, cfg, MTPDecodingConfig(adaptive=False, num_nextn_predict_layers=3, draft_kv_mode=kv_mode)
    )


def _run(ex: Executor, join_after: int, on_step=None):
    """Greedy run of `PROMPTS`; the last one joins after ``join_after`` steps."""
    reqs = [ex.add_request(p, SamplingParams(max_tokens=m, ignore_eos=True)) for p, m in zip(PROMPTS, MAX_TOKENS)]
    late = reqs[-1]
    ex.waiting.remove(late)
    steps = 0
    while ex.has_work or late is not None:
        if late is not None and steps == join_after:
            ex.waiting.append(late)
            late = None
        if on_step is not None:
            on_step(ex)
        ex.step()
        steps += 1
    return reqs


def _syncs_in_forward(ex: Executor) -> list[str]:
    """Run one step with sync debugging on around the model forward; where each sync happened."""
    found: list[str] = []
    orig = ex.model.forward

    def show(message, category, filename, lineno, file=None, line=None):
        frames = [f for f in traceback.extract_stack() if "trtllm_glm" in f.filename]
        where = f"{frames[-1].filename.split('trtllm_glm/')[-1]}:{frames[-1].lineno}" if frames else filename
        found.append(f"{where}: {str(message)[:80]}")

    def fwd(*a, **k):
        torch.cuda.set_sync_debug_mode("warn")
        old = warnings.showwarning
        warnings.showwarning = show
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("always")
                warnings.showwarning = show
                return orig(*a, **k)
        finally:
            warnings.showwarning = old
            torch.cuda.set_sync_debug_mode(0)

    ex.model.forward = fwd  # type: ignore[method-assign]
    try:
        ex.step()
    finally:
        del ex.model.forward
    return found


@pytest.mark.parametrize("mode", ["plain", "ngram"])
def test_sync_listing_of_eager_steps(model, mode: str) -> None:
    """Lists the host syncs of an eager decode / verify forward (uniform widths, as captured): none."""
    # Graph-ready executor with replay switched off: the eager forward of the captured layout.
    ex = _make(model, mode, CudaGraphConfig())
    ex.graph_runner.enabled = False
    for p in PROMPTS[:3]:
        ex.add_request(p, SamplingParams(max_tokens=40, ignore_eos=True))
    while any(r.num_computed < len(r.prompt_ids) for r in ex.running + list(ex.waiting)):
        ex.step()
    for _ in range(3):  # reach steady decode / verify rounds
        ex.step()
    syncs = _syncs_in_forward(ex)
    print(f"\n[{mode}] host syncs inside one eager model forward: {len(syncs)}")
    for s in syncs:
        print("   ", s)


@pytest.mark.parametrize("mode", ["plain", "ngram", "mtp", "mtp_separate"])
def test_graphs_match_eager(model, mode: str) -> None:
    ref = _run(_make(model, mode, None), join_after=3)
    ex = _make(model, mode, CudaGraphConfig(batch_sizes=[1, 2, 4], enable_padding=True))
    runner = ex.graph_runner
    assert runner is not None and not runner.emulate
    pad = ex._padding_slot
    assert ex.manager.get_state_slot(PADDING_REQUEST_ID) == pad
    slots: set[int] = set()
    got = _run(ex, join_after=3, on_step=lambda e: slots.update(e.manager.get_state_slot(r.request_id)
                                                                  for r in e.running))  # fmt: skip
    assert pad not in slots
    for a, b in zip(ref, got):
        d = compare_greedy(a.output_ids, a.logit_gaps, b.output_ids)
        assert d is None or d.excused, f"{mode} request {a.request_id}: {d}"
        assert len(b.output_ids) == len(a.output_ids)
    st = runner.stats
    print(f"\n[{mode}] replays {st.replays}, eager decode steps {st.eager_steps}, captures {st.captures} in "
          f"{st.capture_s:.2f}s, pool +{st.pool_bytes / 2**20:.1f} MiB; per graph {st.per_graph}")  # fmt: skip
    assert st.replays > 0
    if mode.startswith("mtp"):
        chain = ex.drafter.chain_graphs
        print(f"[{mode}] MTP fused drafts {chain.draft_replays}, catch-up replays {chain.catchup_replays}, "
              f"chained {chain.replays}, failed {chain.failed}")  # fmt: skip
        # Full-width rounds replay the fused draft; budget-cut ones the catch-up and chained graphs.
        assert chain.draft_replays > 0 and chain.replays > 0 and chain.catchup_replays > 0 and not chain.failed
        # Same drafts as eager (up to near ties): the acceptance stays what it was.
        acc_ref = sum(r.num_accepted_total for r in ref) / max(sum(r.num_verify_rounds for r in ref), 1)
        acc = sum(r.num_accepted_total for r in got) / max(sum(r.num_verify_rounds for r in got), 1)
        print(f"[{mode}] mean accepted eager {acc_ref:.3f}, graphs {acc:.3f}")
        assert acc >= acc_ref - 0.1
    assert not st.failed
    if mode == "ngram":
        for r in got:
            assert r.num_verify_rounds > 0


@pytest.mark.parametrize("kv_mode", ["shared", "separate"])
def test_fused_mtp_draft_matches_per_step_graphs(model, monkeypatch, kv_mode: str) -> None:
    """The fused MTP draft graph (catch-up and chained steps in one capture, the batch rewritten on the device
    between them) drafts what the per-step graphs draft, round after round; tokens stay the eager ones."""

    def run(fused: str):
        monkeypatch.setenv("TRTLLM_GLM_MTP_FUSED_DRAFT", fused)
        cfg = ExecutorConfig(tokens_per_block=16, max_tokens=4096, max_batch_size=4, max_num_tokens=256,
                             max_seq_len=256, cuda_graph_config=CudaGraphConfig(batch_sizes=[1, 2, 4]))  # fmt: skip
        ex = SpeculativeExecutor(
            model, cfg, MTPDecodingConfig(adaptive=False, num_nextn_predict_layers=3, draft_kv_mode=kv_mode)
        )
        log: list[list[tuple[int, list[int]]]] = []
        orig = ex.drafter.draft

        def draft(seqs, hidden):
            orig(seqs, hidden)
            log.append([(s.request_id, list(s.state.drafts)) for s in seqs if s.live])

        ex.drafter.draft = draft  # type: ignore[method-assign]
        return _run(ex, join_after=3), log, ex.drafter.chain_graphs

    ref = _run(_make(model, "mtp", None), join_after=3)
    per_step, log_ref, chain_ref = run("0")
    fused, log, chain = run("1")
    assert chain.draft_replays > 0 and chain_ref.draft_replays == 0 and not chain.failed
    same = sum(a == b for a, b in zip(log, log_ref))
    print(f"\n[{kv_mode}] fused drafts {chain.draft_replays}; rounds drafted as the per-step graphs: {same} of "
          f"{len(log_ref)}")  # fmt: skip
    for a, b in zip(ref, fused):
        d = compare_greedy(a.output_ids, a.logit_gaps, b.output_ids)
        assert d is None or d.excused, f"request {a.request_id}: {d}"
    # Equal drafts give equal acceptance; the rounds line up until a near tie of the MTP logits parts them
    # (the fused catch-up runs the LM head on each sequence's last row only: another GEMM shape).
    assert same > 0
    acc = [
        sum(r.num_accepted_total for r in rs) / max(sum(r.num_verify_rounds for r in rs), 1) for rs in (per_step, fused)
    ]
    print(f"[{kv_mode}] mean accepted per step {acc[0]:.3f}, fused {acc[1]:.3f}")
    assert abs(acc[0] - acc[1]) <= 0.1


def test_one_device_to_host_copy_per_plain_step(model) -> None:
    from torch.profiler import ProfilerActivity, profile

    ex = _make(model, "plain", CudaGraphConfig(batch_sizes=[4], enable_padding=True))
    for p in PROMPTS[:3]:
        ex.add_request(p, SamplingParams(max_tokens=30, ignore_eos=True))
    for _ in range(4):
        ex.step()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        ex.step()
    names = [e.name for e in prof.events()]
    launches = sum(
        n in ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx") for n in names
    )
    graphs = names.count("cudaGraphLaunch")
    d2h = sum(1 for e in prof.events() if e.name == "cudaMemcpyAsync" and "DtoH" in str(e))
    syncs = names.count("cudaStreamSynchronize") + names.count("cudaDeviceSynchronize")
    print(f"\nplain replayed step: {graphs} graph launch, {launches} kernel launches, {syncs} syncs, {d2h} D2H")
    assert graphs == 1
    assert ex.graph_runner.stats.replays >= 1


def test_overlap_scheduler_matches_graph_steps(model) -> None:
    """The overlap scheduler on the GPU (each steady step launched before the previous one's tokens are
    read back, its inputs taken from that step's output on the device): the tokens of ordinary graph steps,
    exactly (the same graphs run on the same data), with a request joining mid-run and budgets ending at
    different steps. The joining request is admitted by a step planned before the decode step in flight was read
    back (`Executor._admit_ahead`), which is itself left in flight (`_may_chain_eager_step`)."""
    graphs = CudaGraphConfig(batch_sizes=[1, 2, 4], enable_padding=True)
    ref = _run(_make(model, "plain", graphs), join_after=3)
    ex = _make(model, "plain", graphs)
    ex.cfg.overlap_scheduler = True
    got = _run(ex, join_after=3)
    ahead, chained = ex.num_admissions_ahead, ex.num_chained_eager_steps
    print(
        f"\noverlap: {ex.num_overlapped_steps} of {ex.num_steps} steps launched ahead, {ahead} admissions planned "
        f"ahead, {chained} left in flight"
    )
    assert ex.num_overlapped_steps > 0 and ahead > 0
    assert [r.output_ids for r in got] == [r.output_ids for r in ref]
    assert ex.manager.num_free_pages == ex.manager.num_pages


def test_llm_api_overlaps_by_default(model) -> None:
    """The LLM API launches steady decode steps ahead by default (TensorRT-LLM's default) and gives the
    tokens of ``disable_overlap_scheduler=True``, with a seeded sampled request in the batch (drawn on the
    device before the next step is launched) as well."""
    from trtllm_glm import LLM

    SP = SamplingParams

    greedy = [SP(max_tokens=m, ignore_eos=True) for m in MAX_TOKENS]
    mixed = [*greedy[:3], SP(max_tokens=12, temperature=0.8, seed=5, ignore_eos=True)]
    outs = {}
    for disable in (False, True):
        llm = LLM(model, max_batch_size=4, max_seq_len=256, disable_overlap_scheduler=disable,
                  cuda_graph_config=CudaGraphConfig(batch_sizes=[1, 2, 4]), warmup=False)  # fmt: skip
        outs[disable] = [[o.outputs[0].token_ids for o in llm.generate(PROMPTS, p)] for p in (greedy, mixed)]
        launched = llm.executor.num_overlapped_steps
        assert (launched > 0) != disable, launched
    assert outs[False] == outs[True]


def test_adaptive_policy_on_by_default_on_cuda_graphs(model) -> None:
    """``MTPDecodingConfig.adaptive`` unset: the policy runs with CUDA graphs on the GPU (0 or K a round), not eagerly,
    and ``adaptive=False`` keeps fixed K (the CPU side: test_mtp_overlap.py's emulated-graph test)."""
    spec = MTPDecodingConfig(num_nextn_predict_layers=3)
    on = _make_spec(model, spec, CudaGraphConfig(batch_sizes=[1, 2, 4]))
    assert on.draft_policy is not None and list(on.draft_policy.candidates) == [0, 3]
    assert _make_spec(model, spec, None).draft_policy is None
    fixed = MTPDecodingConfig(num_nextn_predict_layers=3, adaptive=False)
    assert _make_spec(model, fixed, CudaGraphConfig(batch_sizes=[1, 2, 4])).draft_policy is None


def _make_spec(model, spec: MTPDecodingConfig, graphs: CudaGraphConfig | None) -> SpeculativeExecutor:
    cfg = ExecutorConfig(tokens_per_block=16, max_tokens=4096, max_batch_size=4, max_num_tokens=256,
                         max_seq_len=256, cuda_graph_config=graphs)  # fmt: skip
    return SpeculativeExecutor(model, cfg, spec)


@pytest.mark.parametrize("kv_mode", ["shared", "separate"])
def test_idle_mtp_rounds_launch_ahead(model, kv_mode: str) -> None:
    """Issue 43: width-one MTP rounds (the adaptive policy's K = 0) under the overlap scheduler, the MTP catch-up
    on the in-flight step made on the device before the next step's replay overwrites its outputs. With K = 0
    every round, the MTP cache equals the synchronous run's bit for bit; with drafting stretches between, the
    tokens are plain greedy's and the drafts after each overlapped stretch accept as the trained MTP layer does
    (a catch-up that read overwritten rows would leave a wrong MTP cache: drafts rejected)."""
    from trtllm_glm.speculative.adaptive import AdaptiveDraftPolicy

    class Scripted(AdaptiveDraftPolicy):
        def __init__(self, script) -> None:  # noqa: ANN001
            super().__init__(3, clock=lambda: 0.0)
            self.script, self.i = script, 0

        def choose(self, batch_size: int) -> int:
            self.i += 1
            return self._pick(self.script(self.i - 1))

    def run(overlap: bool, script):  # noqa: ANN001
        cfg = ExecutorConfig(tokens_per_block=16, max_tokens=4096, max_batch_size=4, max_num_tokens=256,
                             max_seq_len=256, cuda_graph_config=CudaGraphConfig(batch_sizes=[1, 2, 4]),
                             overlap_scheduler=overlap)  # fmt: skip
        spec = MTPDecodingConfig(num_nextn_predict_layers=3, draft_kv_mode=kv_mode)
        ex = SpeculativeExecutor(model, cfg, spec, draft_policy=Scripted(script))
        ex.capture_cuda_graphs()
        reqs = [ex.add_request(p, SamplingParams(max_tokens=m, ignore_eos=True)) for p, m in zip(PROMPTS, MAX_TOKENS)]
        ex.run_until_done()
        return ex, reqs

    plain = _make(model, "plain", None)
    ref = [plain.add_request(p, SamplingParams(max_tokens=m, ignore_eos=True)) for p, m in zip(PROMPTS, MAX_TOKENS)]
    plain.run_until_done()
    ex_o, got_o = run(True, lambda i: 0)
    ex_s, got_s = run(False, lambda i: 0)
    assert ex_o.num_overlapped_steps > 10 and ex_o.num_catchups_ahead > 10 and ex_s.num_overlapped_steps == 0
    assert [r.output_ids for r in got_o] == [r.output_ids for r in got_s]
    for name in ("latent", "index_k"):
        a = getattr(ex_o.draft_manager, name)[ex_o.mtp_plane]
        b = getattr(ex_s.draft_manager, name)[ex_s.mtp_plane]
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), name
    ex, got = run(True, lambda i: 3 if i % 6 < 2 else 0)
    for a, b in zip(ref, got):
        d = compare_greedy(a.output_ids, a.logit_gaps, b.output_ids)
        assert d is None or d.excused, d
    rounds = sum(r.num_verify_rounds for r in got)
    per_round = sum(r.num_accepted_total for r in got) / max(rounds, 1)
    print(f"\n[{kv_mode}] launched ahead {ex.num_overlapped_steps}, catch-ups ahead {ex.num_catchups_ahead}, "
          f"{rounds} verify rounds, {per_round:.2f} tokens each")  # fmt: skip
    assert ex.num_catchups_ahead > 0 and rounds > 0
    assert per_round > 2.0  # the trained layer: ~2.9 at K = 3


@pytest.mark.parametrize("how", ["ahead", "early"])
@pytest.mark.parametrize("kv_mode", ["shared", "separate"])
def test_mtp_drafting_rounds_launch_ahead(model, kv_mode: str, how: str) -> None:
    """Issue 43: MTP drafts (K = 3) made from a verify round's outputs on the device, on real graphs. ``ahead``
    (``overlap_rounds``, under the overlap scheduler): round n + 1's fused draft and verify are replayed before round
    n is read back (the replays overwrite round n's buffers for real here). ``early`` (``early_draft``): only the
    draft, right behind its verify, before the read-back. In batch-invariant mode the tokens, the acceptance per
    position and the number of rounds equal the synchronous rounds' bit for bit (the same drafts), and the output
    is plain greedy's; drafts were made on the device (a silent fall-back fails the count)."""
    from trtllm_glm.numerics import batch_invariant_mode

    def run(device_side: bool):  # noqa: ANN202
        overlap = device_side and how == "ahead"
        cfg = ExecutorConfig(tokens_per_block=16, max_tokens=4096, max_batch_size=4, max_num_tokens=256,
                             max_seq_len=256, cuda_graph_config=CudaGraphConfig(batch_sizes=[1, 2, 4]),
                             overlap_scheduler=overlap)  # fmt: skip
        spec = MTPDecodingConfig(num_nextn_predict_layers=3, draft_kv_mode=kv_mode, adaptive=False,
                                 overlap_rounds=True, early_draft=device_side and how == "early")  # fmt: skip
        ex = SpeculativeExecutor(model, cfg, spec)
        ex.capture_cuda_graphs()
        reqs = [
            ex.add_request(p, SamplingParams(max_tokens=2 * m, ignore_eos=True)) for p, m in zip(PROMPTS, MAX_TOKENS)
        ]
        ex.run_until_done()
        return ex, reqs

    with batch_invariant_mode(True):
        plain = _make(model, "plain", None)
        ref = [
            plain.add_request(p, SamplingParams(max_tokens=2 * m, ignore_eos=True)) for p, m in zip(PROMPTS, MAX_TOKENS)
        ]
        plain.run_until_done()
        ex_o, got_o = run(True)
        ex_s, got_s = run(False)
    rounds = sum(r.num_verify_rounds for r in got_o)
    per_round = sum(r.num_accepted_total for r in got_o) / max(rounds, 1)
    made = ex_o.num_overlapped_rounds if how == "ahead" else ex_o.num_early_drafts
    print(f"\n[{kv_mode}, {how}] drafts made on the device {made} of {rounds} rounds, {per_round:.2f} tokens each")
    assert made > 10 and ex_s.num_overlapped_rounds == 0 and ex_s.num_early_drafts == 0
    assert [r.output_ids for r in got_o] == [r.output_ids for r in got_s] == [r.output_ids for r in ref]
    assert [r.accepted_per_position for r in got_o] == [r.accepted_per_position for r in got_s]
    assert [r.num_verify_rounds for r in got_o] == [r.num_verify_rounds for r in got_s]
    assert per_round > 2.0  # the trained layer: ~2.9 at K = 3
    for ring in ex_o.manager.state.decode_tail_rings:
        assert ring.num_disagreements == 0
