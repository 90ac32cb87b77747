"""CUDA-graph runtime pieces that need no GPU: `CudaGraphConfig`, the padding plan, padded metadata, the
reserved padding slot, the runner bypassed on the CPU, the serve YAML key, and the padded step itself
(emulated: the runner runs it eagerly, with the Triton kernels interpreted) against plain eager runs.

The real capture / replay runs in ``test_cuda_graph_gpu.py``.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.spec_helpers import kpool_writes_through_kernels
from trtllm_glm.cache.manager import Glm5NextCacheManager
from trtllm_glm.config import ConfigError, Glm5NextConfig
from trtllm_glm.errors import StateError
from trtllm_glm.models.glm5_next import Glm5NextForCausalLM
from trtllm_glm.modules.ffn import MoE
from trtllm_glm.runtime.cuda_graph import (
    PADDING_REQUEST_ID,
    CudaGraphConfig,
    CudaGraphRunner,
    accepted_counts,
    default_batch_sizes,
    greedy_and_gap,
    padded_batch_size,
)
from trtllm_glm.runtime.executor import Executor, ExecutorConfig
from trtllm_glm.runtime.lossless import compare_greedy
from trtllm_glm.runtime.sampling import SamplingParams
from trtllm_glm.runtime.scheduler import ScheduledSeq
from trtllm_glm.runtime.speculative_executor import SpeculativeExecutor
from trtllm_glm.speculative.config import MTPDecodingConfig, NGramDecodingConfig

pytestmark = pytest.mark.cpu_only


# ------------------------------------------------------------------------------------------------
# Config and padding plan
def test_config_defaults_and_sizes() -> None:
    c = CudaGraphConfig()
    assert (c.batch_sizes, c.max_batch_size, c.enable_padding) == (None, 0, True)
    assert default_batch_sizes(16) == [1, 2, 4, 8, 16]
    assert default_batch_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert default_batch_sizes(3) == [1, 2, 3]
    # max_batch_size 0 follows the executor; rows beyond max_num_tokens are dropped per width.
    assert c.capture_sizes(16, 512, 1) == [1, 2, 4, 8, 16]
    assert c.capture_sizes(16, 40, 4) == [1, 2, 4, 8]
    assert CudaGraphConfig(max_batch_size=4).capture_sizes(16, 512, 1) == [1, 2, 4]
    s = CudaGraphConfig(batch_sizes=[8, 1, 4, 4], enable_padding=True)
    assert s.batch_sizes == [1, 4, 8] and s.max_batch_size == 8
    assert s.capture_sizes(6, 512, 1) == [1, 4]


@pytest.mark.parametrize(
    "kw",
    [
        {"batch_sizes": []},
        {"batch_sizes": [0, 2]},
        {"batch_sizes": [1.5]},
        {"batch_sizes": [True]},
        {"max_batch_size": -1},
        {"batch_sizes": [1, 2], "max_batch_size": 4},
        {"enable_padding": 1},
    ],
)
def test_config_rejects(kw: dict) -> None:
    with pytest.raises(ValueError):
        CudaGraphConfig(**kw)


def test_config_from_value() -> None:
    assert CudaGraphConfig.from_value(None) is None
    c = CudaGraphConfig(batch_sizes=[2])
    assert CudaGraphConfig.from_value(c) is c
    assert CudaGraphConfig.from_value({"batch_sizes": [1, 2], "enable_padding": True}) == CudaGraphConfig(
        batch_sizes=[1, 2], enable_padding=True
    )
    with pytest.raises(ValueError, match="unknown key 'padding'"):
        CudaGraphConfig.from_value({"padding": True})
    with pytest.raises(TypeError):
        CudaGraphConfig.from_value([1, 2])


def test_padded_batch_size() -> None:
    sizes = [1, 2, 4, 8]
    assert [padded_batch_size(b, sizes, True) for b in (1, 2, 3, 5, 8, 9)] == [1, 2, 4, 8, 8, None]
    assert [padded_batch_size(b, sizes, False) for b in (1, 3, 4, 9)] == [1, None, 4, None]
    assert padded_batch_size(0, sizes, True) is None


def test_serve_yaml_key() -> None:
    from trtllm_glm.serve.config import llm_options_from_dict

    out = llm_options_from_dict({"cuda_graph_config": {"batch_sizes": [1, 2, 4], "enable_padding": True}})
    assert out["cuda_graph_config"] == CudaGraphConfig(batch_sizes=[1, 2, 4], enable_padding=True)
    assert llm_options_from_dict({"cuda_graph_config": None})["cuda_graph_config"] is None
    with pytest.raises(ConfigError, match="cuda_graph_config"):
        llm_options_from_dict({"cuda_graph_config": {"batch_size": [1]}})
    with pytest.raises(ConfigError, match="cuda_graph_config"):
        llm_options_from_dict({"cuda_graph_config": {"batch_sizes": [0]}})


def test_exported() -> None:
    import trtllm_glm

    assert trtllm_glm.CudaGraphConfig is CudaGraphConfig


# ------------------------------------------------------------------------------------------------
# Padded metadata
def _meta(cfg: Glm5NextConfig):
    from trtllm_glm.attention.sparse.glm_kpool.metadata import GlmKpoolMetadata

    mgr = Glm5NextCacheManager(cfg, num_pages=8, tokens_per_block=8, max_num_requests=4)
    meta = GlmKpoolMetadata(kv_cache_manager=mgr, max_num_seqs=4, max_num_tokens=16, max_pages_per_seq=4,
                            select_width=cfg.index_select_width)  # fmt: skip
    return mgr, meta


def test_padded_prepare_and_trim() -> None:
    cfg = Glm5NextConfig.from_pretrained("tiny")
    mgr, meta = _meta(cfg)
    pad_slot = mgr.add_request(PADDING_REQUEST_ID, 0)
    s0, s1 = mgr.add_request(10, 12), mgr.add_request(11, 5)
    addrs = {k: v.data_ptr() for k, v in meta.graph_buffers().items()}
    # Two real verify sequences of width 2 padded to 4 sequences.
    meta.prepare([10, 11, -1, -1], past_lens=[10, 3, 4, 4], q_lens=[2] * 4, num_decode_seqs=4,
                 state_slots=[s0, s1, pad_slot, pad_slot], num_padding_seqs=2)  # fmt: skip
    assert meta.row_seq_t.tolist() == [0, 0, 1, 1, -1, -1, -1, -1]
    assert meta.positions_t.tolist() == [10, 11, 3, 4, 4, 5, 4, 5]
    assert meta.state_slots_t.tolist() == [s0, s1, pad_slot, pad_slot]
    table = meta.slot_table_t.tolist()
    assert table[2] == table[3] == [-1] * 4
    assert table[0][:2] == mgr.get_batch_slot_tables([10])[0]
    meta.set_num_accepted([3, 1])
    acc = meta.spec.num_accepted_t
    assert acc.tolist() == [3, 1, 0, 0] and acc.data_ptr() == meta.graph_buffers()["acc_buf"].data_ptr()
    meta.spec.verify_seqs = [0, 1, 2, 3]
    meta.trim_padding()
    assert (meta.num_seqs, meta.num_tokens, meta.num_padding_seqs) == (2, 4, 0)
    assert meta.state_slots == [s0, s1] and meta.cu_seqlens == [0, 2, 4] and meta.spec.verify_seqs == [0, 1]
    assert meta.state_slots_t.tolist() == [s0, s1] and meta.spec.num_accepted_t.tolist() == [3, 1]
    assert {k: v.data_ptr() for k, v in meta.graph_buffers().items()} == addrs
    with pytest.raises(ValueError, match="explicit state_slots"):
        meta.prepare([10, -1], past_lens=[10, 4], q_lens=[1, 1], num_decode_seqs=2, num_padding_seqs=1)
    # The graph-capture bound on pools covers any sequence the table can hold.
    assert meta.graph_pool_capacity == 4 * 8 // 4
    meta.graph_max_pools = meta.graph_pool_capacity
    assert meta.max_pools == 8


# ------------------------------------------------------------------------------------------------
# Executors
def _model() -> Glm5NextForCausalLM:
    # One KDA and one sparse layer (plus MTP): the interpreted kernels are what costs time here.
    return Glm5NextForCausalLM.from_pretrained("tiny", layers=[0, 3], dtype="float32").eval()


EX_CFG = dict(tokens_per_block=8, max_tokens=1024, max_batch_size=4, max_num_tokens=64, max_seq_len=96)


def test_runner_bypassed_on_cpu() -> None:
    ex = Executor(_model(), ExecutorConfig(**EX_CFG, cuda_graph_config=CudaGraphConfig(enable_padding=True)))
    assert ex.graph_runner is None
    assert ex.manager.max_num_requests == 4 and ex.manager.num_free_slots == 4
    ex.capture_cuda_graphs()  # a no-op


def test_llm_default_on_but_ignored_on_cpu() -> None:
    import inspect

    from trtllm_glm.runtime.llm import LLM

    assert inspect.signature(LLM.__init__).parameters["cuda_graph_config"].default == CudaGraphConfig()
    llm = LLM("tiny", device="cpu", max_batch_size=2, max_seq_len=64)
    assert llm.executor_config.cuda_graph_config is None and llm.executor.graph_runner is None
    out = LLM("tiny", device="cpu", max_batch_size=2, max_seq_len=64, cuda_graph_config=None).generate(
        [1, 2, 3], SamplingParams(max_tokens=3)
    )
    assert len(out.outputs[0].token_ids) == 3


@pytest.fixture
def emulated(monkeypatch):
    """Executors whose runner pads and replays eagerly on the CPU; ``emulated(True)`` switches the k-pool
    cache writes to the Triton kernels (interpreted), the only ones that skip padding rows
    (`spec_helpers.kpool_writes_through_kernels`).

    The interpreter's int32 overflow checks (an int64 recomputation and an assert after every integer add
    and multiply: a quarter of these tests' time) are off here; the kernels' own tests keep them."""
    from triton.runtime.interpreter import interpreter_builder

    monkeypatch.setattr(Executor, "_graphs_supported", lambda self: True)
    opts = dataclasses.replace(interpreter_builder.options, sanitize_overflow=False)
    monkeypatch.setattr(interpreter_builder, "options", opts)

    def use_kernels(on: bool) -> None:
        if on:
            kpool_writes_through_kernels(monkeypatch)
        else:
            monkeypatch.setenv("TRTLLM_GLM_KPOOL_BACKEND", "torch")

    return use_kernels


def _run(ex: Executor, prompts: list[list[int]], max_tokens: list[int], join_after: int | None = None):
    """Greedy run; the last prompt joins after ``join_after`` steps (slots and pages get reused)."""
    reqs = [ex.add_request(p, SamplingParams(max_tokens=m, ignore_eos=True)) for p, m in zip(prompts, max_tokens)]
    late = reqs.pop() if join_after is not None else None
    if late is not None:
        ex.waiting.remove(late)
    steps = 0
    while ex.has_work or late is not None:
        if late is not None and steps == join_after:
            ex.waiting.append(late)
            reqs.append(late)
            late = None
        ex.step()
        steps += 1
    return reqs


PROMPTS = [[5, 9, 2, 7, 5, 9, 2, 7, 5, 9, 2], [3, 1, 4, 1, 5, 9, 2, 6, 5], [8, 8, 1, 2, 3, 8, 8, 1], [7, 1, 7, 1, 7]]


def _assert_same(ref, got) -> None:
    for a, b in zip(ref, got):
        d = compare_greedy(a.output_ids, a.logit_gaps, b.output_ids)
        assert d is None or d.excused, f"request {a.request_id}: {d}"


@pytest.mark.parametrize("mode", ["plain", "ngram", "mtp"])
def test_emulated_padding_matches_eager(emulated, mode: str) -> None:
    """Batches of 3 padded to 4 (and 1 -> 1), requests leaving and one joining: same tokens as eager; the
    padding slot is never a request's, unallocated pages stay untouched."""
    model = _model()

    def make(graphs: bool) -> Executor:
        cfg = ExecutorConfig(**EX_CFG, cuda_graph_config=CudaGraphConfig(batch_sizes=[1, 4], enable_padding=True)
                             if graphs else None)  # fmt: skip
        if mode == "plain":
            return Executor(model, cfg)
        if mode == "ngram":
            return SpeculativeExecutor(model, cfg, NGramDecodingConfig(max_draft_len=2))
        # The separate draft manager: the chained steps' padding also goes through the draft binding.
        spec = MTPDecodingConfig(adaptive=False, num_nextn_predict_layers=2, draft_kv_mode="separate")
        return SpeculativeExecutor(model, cfg, spec)

    max_tokens = [4, 6, 3, 4]
    # The eager reference on the torch ops (fast); the kernels agree with them bit for bit except the
    # scores' rounding, and these short prompts select every complete pool anyway.
    emulated(False)
    ref = _run(make(False), PROMPTS, max_tokens, join_after=2)
    emulated(True)
    ex = make(True)
    assert ex.graph_runner is not None and ex.graph_runner.emulate
    pad = ex._padding_slot
    assert ex.manager.max_num_requests == 5 and ex.manager.get_state_slot(PADDING_REQUEST_ID) == pad
    seen_slots: set[int] = set()
    seen_pages: set[int] = set()
    orig_step = ex.step

    def step():
        for r in ex.running:
            seen_slots.add(ex.manager.get_state_slot(r.request_id))
            seen_pages.update(ex.manager.get_batch_slot_tables([r.request_id])[0])
        return orig_step()

    ex.step = step  # type: ignore[method-assign]
    got = _run(ex, PROMPTS, max_tokens, join_after=2)
    _assert_same(ref, got)
    assert pad not in seen_slots
    assert ex.graph_runner.stats.replays > 0
    # Padding rows write no page: every page no request ever held is still all zeros.
    mgr = ex.manager
    untouched = sorted(set(range(mgr.num_pages)) - seen_pages)
    assert untouched and seen_pages
    for plane in (mgr.latent, mgr.index_scale, mgr.index_k.view(torch.uint8)):
        assert int(plane[:, untouched].float().abs().sum()) == 0
    assert mgr.num_free_slots == mgr.max_num_requests - 1  # the padding slot stays reserved
    if mode == "mtp":
        # The chained MTP steps went through the padded path and drafted exactly what eager drafts.
        chain = ex.drafter.chain_graphs
        assert chain is not None and chain.replays > 0 and chain.catchup_replays > 0
        assert [r.num_accepted_total for r in got] == [r.num_accepted_total for r in ref]


@pytest.mark.parametrize("mode", ["plain", "mtp"])
def test_prompt_outputs_of_a_last_prompt_row_run_as_a_graph_step(emulated, mode: str) -> None:
    """A prompt whose last chunk is a single row (33 tokens in chunks of 16) has that row scheduled as a decode
    row, replayed through the decode graph: its context logits are recorded as on the eager path (all 33 rows,
    equal to eager's), and so are the prompt logprobs."""
    model = _model()
    emulated(True)

    def run(graphs: bool):  # noqa: ANN202
        graph_cfg = CudaGraphConfig(batch_sizes=[1], enable_padding=True) if graphs else None
        cfg = ExecutorConfig(**{**EX_CFG, "prefill_chunk_size": 16}, cuda_graph_config=graph_cfg)
        spec = MTPDecodingConfig(num_nextn_predict_layers=2, draft_kv_mode="separate")
        ex = Executor(model, cfg) if mode == "plain" else SpeculativeExecutor(model, cfg, spec)
        params = SamplingParams(max_tokens=3, ignore_eos=True, return_context_logits=True, prompt_logprobs=0)
        r = ex.add_request(list(range(1, 34)), params)
        ex.run_until_done()
        if graphs:
            assert ex.graph_runner is not None and ex.graph_runner.stats.replays > 0
        return r

    ref, got = run(False), run(True)
    assert ref.output_ids == got.output_ids
    assert torch.cat(got.context_logits).shape == (33, model.config.vocab_size)
    torch.testing.assert_close(torch.cat(got.context_logits), torch.cat(ref.context_logits), atol=1e-4, rtol=1e-4)
    assert len(got.prompt_logprobs) == 33 and got.prompt_logprobs[0] is None


@pytest.mark.parametrize("mode", ["plain", "mtp"])
def test_emulated_graphs_with_prefix_hits_match_eager(emulated, mode: str) -> None:
    """Prefix caching under (emulated) graph replay: requests restored from checkpoints join padded graph
    batches; tokens equal an eager run without reuse."""
    model = _model()
    stem = [4, 8, 15, 16, 23, 42, 7, 1, 2, 3, 5, 8, 13, 21, 34, 55, 89, 1, 4, 9]  # 20 tokens: 2 full pages
    prompts = [stem + [6, 6], stem + [7], stem[:17] + [9, 9, 9], [3, 3, 3, 1, 2]]
    max_tokens = [5, 4, 6, 5]

    def make(graphs: bool, reuse: bool) -> Executor:
        cfg = ExecutorConfig(**EX_CFG, enable_block_reuse=reuse, checkpoint_interval=8,
                             cuda_graph_config=CudaGraphConfig(batch_sizes=[1, 4], enable_padding=True)
                             if graphs else None)  # fmt: skip
        if mode == "plain":
            return Executor(model, cfg)
        return SpeculativeExecutor(model, cfg, MTPDecodingConfig(adaptive=False, num_nextn_predict_layers=2))

    emulated(False)
    ref = _run(make(False, False), prompts, max_tokens)
    emulated(True)
    ex = make(True, True)
    warm = ex.add_request(stem + [1], SamplingParams(max_tokens=2, ignore_eos=True))
    ex.run_until_done()
    got = _run(ex, prompts, max_tokens, join_after=1)
    _assert_same(ref, got)
    assert warm.output_ids and ex.prefix.stats.hits >= 3 and ex.graph_runner.stats.replays > 0
    assert sum(r.num_cached_tokens for r in got) >= 3 * 16


def test_emulated_budget_cut_rounds_replay_full_width(emulated) -> None:
    """Requests whose budget leaves room for fewer than K drafts (their last rounds) are padded to the full
    verify width, so one of them does not send the batch's step down the eager path; the filler is never
    accepted, so tokens and acceptance counts equal an unpadded eager run (with the fix removed, the
    budget-cut rounds run eagerly and ``eager_steps`` counts them)."""
    from trtllm_glm.speculative.drafters import OracleDrafter

    model = _model()
    max_tokens = [9, 5, 7, 6]
    emulated(False)
    plain = _run(Executor(model, ExecutorConfig(**EX_CFG)), PROMPTS, max_tokens)
    cont = {i: r.output_ids for i, r in enumerate(plain)}

    def make(graphs: bool) -> SpeculativeExecutor:
        cfg = ExecutorConfig(**EX_CFG, cuda_graph_config=CudaGraphConfig(batch_sizes=[1, 2, 4], enable_padding=True)
                             if graphs else None)  # fmt: skip
        # Every third output position corrupted: accepted runs of 0-2 drafts, so requests reach their
        # budgets at different rounds.
        drafter = OracleDrafter(cont, lambda i, j: (i + j) % 3 == 0, vocab_size=model.config.vocab_size)
        return SpeculativeExecutor(model, cfg, NGramDecodingConfig(max_draft_len=3), drafter=drafter)

    ref = _run(make(False), PROMPTS, max_tokens)
    emulated(True)
    ex = make(True)
    # Each verify replay's MoE sees its filler rows (past the proposed drafts) and padding rows as dead.
    moe = next(layer.mlp for layer in model.model.layers if isinstance(layer.mlp, MoE))
    seen: list[list[int]] = []
    want: list[list[int]] = []
    orig_forward, orig_replay = moe.forward, ex.graph_runner.replay

    def forward(x, row_live=None):
        seen.append(row_live.tolist() if row_live is not None else None)
        return orig_forward(x, row_live=row_live)

    def replay(key, plan, ids, proposed=None, **kw):
        P, W = key
        if W > 1:
            want.append([int(j <= proposed[b]) if b < len(plan) else 0 for b in range(P) for j in range(W)])
        else:
            want.append([int(b < len(plan)) for b in range(P)])
        return orig_replay(key, plan, ids, proposed, **kw)

    moe.forward = forward  # type: ignore[method-assign]
    ex.graph_runner.replay = replay  # type: ignore[method-assign]
    seen_in_replays: list[list[int]] = []

    def launch(key, _orig=ex.graph_runner._launch):
        n = len(seen)
        out = _orig(key)
        seen_in_replays.extend(seen[n:])
        return out

    ex.graph_runner._launch = launch  # type: ignore[method-assign]
    got = _run(ex, PROMPTS, max_tokens)
    _assert_same(ref, got)
    assert [r.output_ids for r in got] == [r.output_ids for r in plain]
    assert [r.num_accepted_total for r in got] == [r.num_accepted_total for r in ref]
    assert [r.accepted_per_position for r in got] == [r.accepted_per_position for r in ref]
    st = ex.graph_runner.stats
    assert st.replays > 0 and st.eager_steps == 0, (st.replays, st.eager_steps)
    assert seen_in_replays == want
    assert any(0 in w[: len(w) - w[::-1].index(1)] for w in want if 1 in w)  # filler inside live sequences


def test_catchup_graph_per_width(emulated, monkeypatch) -> None:
    """The MTP catch-up (and the fused draft) replays at (padded size, the round's largest committed count),
    not always K + 1 rows per sequence: a round that accepted nothing catches up on one row."""
    spec = MTPDecodingConfig(adaptive=False, num_nextn_predict_layers=3)
    ex = SpeculativeExecutor(_model(), ExecutorConfig(**EX_CFG, cuda_graph_config=CudaGraphConfig(
        batch_sizes=[1, 2, 4], enable_padding=True)), spec)  # fmt: skip
    chain = ex.drafter.chain_graphs
    assert chain is not None and chain.width == 4 and chain.fused
    assert chain.catchup_key([1]) == ("catchup", 1, 1)
    assert chain.catchup_key([1, 2, 1]) == ("catchup", 4, 2)
    assert chain.catchup_key([4, 1]) == ("catchup", 2, 4)
    assert chain.catchup_key([5]) is None  # more rows than K + 1: eager
    assert chain.draft_key([1, 2, 1]) == ("draft", 4, 2)
    assert chain.draft_key([5]) is None
    assert chain.key(3) == ("chain", 4, 1)
    # K = 1 has no chained steps to fuse; the switch turns the fused draft off.
    for k, env in ((1, "1"), (3, "0")):
        monkeypatch.setenv("TRTLLM_GLM_MTP_FUSED_DRAFT", env)
        ex = SpeculativeExecutor(_model(), ExecutorConfig(**EX_CFG, cuda_graph_config=CudaGraphConfig(
            batch_sizes=[1, 2], enable_padding=True)),
            MTPDecodingConfig(adaptive=False, num_nextn_predict_layers=k))  # fmt: skip
        assert not ex.drafter.chain_graphs.fused and ex.drafter.chain_graphs.draft_key([1]) is None


def test_emulated_fused_mtp_draft_matches_per_step(emulated, monkeypatch) -> None:
    """The fused MTP draft (catch-up + chained steps as one graph, the batch description rewritten on the
    device between them) proposes exactly the per-step graphs' drafts, from the same hidden rows, and leaves
    the MTP plane's tail ring as they do (the chained rows' entries restored), round after round, in a
    padded batch with a request joining late; tokens equal eager decoding. The separate draft manager is
    covered on the GPU (test_cuda_graph_gpu.py); interpreted kernels make this test the slow one."""
    # One sparse layer and the MTP layer: the interpreted kernels are what costs time here.
    model = Glm5NextForCausalLM.from_pretrained("tiny", layers=[3], dtype="float32").eval()
    k, kv_mode, share = 3, "shared", True
    # Budgets that leave two rounds in a row where every request wants K drafts (fused, then a verify that
    # takes the deferred drafts on the device), and budget-cut rounds after them (per-step graphs).
    max_tokens, join_after = [10, 8, 9, 10], 1

    def run(fused: str) -> tuple[list, list, list, list, SpeculativeExecutor]:
        monkeypatch.setenv("TRTLLM_GLM_MTP_FUSED_DRAFT", fused)
        spec = MTPDecodingConfig(
            adaptive=False, num_nextn_predict_layers=k, draft_kv_mode=kv_mode, index_share_for_mtp_iteration=share
        )
        ex = SpeculativeExecutor(model, ExecutorConfig(**EX_CFG, cuda_graph_config=CudaGraphConfig(
            batch_sizes=[1, 2, 4], enable_padding=True)), spec)  # fmt: skip
        # Per round: the drafts, and the hidden rows the last chained step fed the LM head (drafts are
        # argmaxes, which a small error in the MTP forward rarely flips; the hidden rows show it).
        log: list[list[tuple[int, list[int]]]] = []
        heads: list[torch.Tensor | None] = []
        rings: list[torch.Tensor] = []
        fed: list[torch.Tensor] = []
        orig, orig_logits = ex.drafter.draft, model.compute_logits

        def compute_logits(h, *, cast=True):
            fed.append(h.detach().clone())
            return orig_logits(h, cast=cast)

        def draft(seqs, hidden):
            fed.clear()
            orig(seqs, hidden)
            # Deferred drafts are read from the device without resolving the state (the verify must still
            # take them on the device).
            log.append([(s.request_id, _peek_drafts(s.state)) for s in seqs if s.live])
            heads.append(fed[-1][: len(log[-1])] if fed else None)
            rings.append(ex.manager.state.tail_ring[ex.mtp_plane].clone())

        ex.drafter.draft = draft  # type: ignore[method-assign]
        # The input rows of every verify replay (drafts that were rejected leave no other trace).
        runner, body = ex.graph_runner, ex.graph_runner._body
        verify_inputs: list[list[int]] = []

        def run_body(P, W):
            if W > 1:
                verify_inputs.append(runner.input_ids[: P * W].tolist())
            return body(P, W)

        runner._body = run_body
        monkeypatch.setattr(model, "compute_logits", compute_logits)
        out = _run(ex, PROMPTS, max_tokens, join_after=join_after)
        monkeypatch.setattr(model, "compute_logits", orig_logits)
        log.append(verify_inputs)  # type: ignore[arg-type]
        return out, log, heads, rings, ex

    emulated(False)
    cfg = ExecutorConfig(**EX_CFG)
    plain = _run(Executor(model, cfg), PROMPTS, max_tokens, join_after=join_after)
    emulated(True)
    per_step, log_ref, heads_ref, rings_ref, ex_ref = run("0")
    fused, log, heads, rings, ex = run("1")
    chain, chain_ref = ex.drafter.chain_graphs, ex_ref.drafter.chain_graphs
    assert chain.fused and not chain_ref.fused
    assert chain.draft_replays > 0 and chain_ref.draft_replays == 0 and chain_ref.replays > 0
    # Fused drafts were deferred and verify replays took them on the device (a round whose next step is
    # not a replay, such as the late request's prefill, reads them back on the host instead).
    assert ex.drafter.defer and 0 < ex.graph_runner.stats.device_row_replays <= chain.draft_replays
    assert ex_ref.graph_runner.stats.device_row_replays == 0
    # Rounds whose requests all want K drafts went fused; the rest (budget-cut rounds) per step.
    assert chain.replays < chain_ref.replays
    assert log == log_ref  # the drafts of every round and the input rows of every verify replay
    assert len(heads) == len(heads_ref)
    for a, b in zip(heads, heads_ref):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    for a, b in zip(rings, rings_ref):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert any(d for rnd in log for _, d in rnd)
    _assert_same(plain, fused)
    assert [r.output_ids for r in fused] == [r.output_ids for r in per_step]
    assert [r.accepted_per_position for r in fused] == [r.accepted_per_position for r in per_step]


def _peek_drafts(st) -> list[int]:
    """A request's drafts, read from the device when they are still pending (the state stays pending)."""
    if st.pending is None:
        return list(st.drafts)
    src, j = st.pending
    return src.tensor[j, : len(st.drafts)].tolist()


def test_verify_takes_device_rows_in_any_order(emulated) -> None:
    """`CudaGraphRunner.replay`'s ``device_rows``: each named sequence's rows ``1 .. W - 1`` come from its row
    of the device drafts (any order, any subset), the others keep the host ids, padding stays zero; a
    misshapen or out-of-range description is refused before anything runs."""
    from trtllm_glm.runtime.cuda_graph import DeviceRows

    emulated(True)
    ex = SpeculativeExecutor(_model(), ExecutorConfig(**EX_CFG, cuda_graph_config=CudaGraphConfig(
        batch_sizes=[4], enable_padding=True)), NGramDecodingConfig(max_draft_len=2))  # fmt: skip
    runner = ex.graph_runner
    reqs = [ex.add_request([5 + i, 6, 7], SamplingParams(max_tokens=4)) for i in range(3)]
    ex.step()  # prefill all three
    for r in reqs:
        ex.manager.ensure_capacity(r.request_id, r.num_computed + 3)
    plan = [ScheduledSeq(r, 3, True, past_len=r.num_computed) for r in reqs]
    ids = [100, 101, 102, 200, 201, 202, 250, 251, 252]
    drafts = torch.tensor([[11, 12], [21, 22], [31, 32]])
    seen = []
    orig = runner._body

    def body(P, W):
        seen.append(runner.input_ids[: P * W].view(P, W).clone())
        return orig(P, W)

    runner._body = body
    with torch.inference_mode():
        runner.replay((4, 3), plan, ids, [2, 2, 2], device_rows=DeviceRows(drafts, seqs=[2, 0], rows=[0, 2]))
        assert seen[-1].tolist() == [[100, 31, 32], [200, 201, 202], [250, 11, 12], [0, 0, 0]]
        runner.replay((4, 3), plan, ids, [2, 2, 2], device_rows=DeviceRows(drafts[1:], seqs=[0, 1], rows=[0, 1]))
        assert seen[-1].tolist() == [[100, 21, 22], [200, 31, 32], [250, 251, 252], [0, 0, 0]]
    for bad in (
        DeviceRows(drafts[:, :1], seqs=[0], rows=[0]),  # one draft column where the width holds two
        DeviceRows(drafts, seqs=[3], rows=[0]),  # no such sequence in the step
        DeviceRows(drafts, seqs=[0], rows=[5]),  # no such draft row
        DeviceRows(drafts, seqs=[0, 1], rows=[0]),
    ):
        with pytest.raises(ValueError):
            runner.replay((4, 3), plan, ids, [2, 2, 2], device_rows=bad)
    assert len(seen) == 2  # nothing ran for the refused descriptions
    runner._body = orig
    ex.meta.trim_padding()


def test_pending_drafts_become_device_rows_or_resolve(emulated) -> None:
    """Drafts left on the device (`DraftState.pending`) reach a replayed verify as `DeviceRows` (placeholders
    in the host ids, the right draft row per sequence, sequences with host drafts untouched); a second
    in-flight source is read on the host instead; an eager consumer (`_rows_for`) and `_resolve_drafts` fetch
    the values and clear ``pending``."""
    from trtllm_glm.speculative.drafters import PENDING_DRAFT, DeviceDrafts

    emulated(False)
    ex = SpeculativeExecutor(_model(), ExecutorConfig(**EX_CFG, cuda_graph_config=CudaGraphConfig(
        batch_sizes=[4], enable_padding=True)), NGramDecodingConfig(max_draft_len=2))  # fmt: skip
    reqs = [ex.add_request([5 + i, 6, 7], SamplingParams(max_tokens=6)) for i in range(4)]
    ex.step()  # prefill: each request now has one emitted token to verify from
    src = DeviceDrafts(torch.tensor([[11, 12], [21, 22]]))
    other = DeviceDrafts(torch.tensor([[31, 32]]))
    st = [ex.state[r.request_id] for r in reqs]
    for s, pend in zip(st, [(src, 1), None, (src, 0), (other, 0)]):
        s.drafts, s.pending = ([PENDING_DRAFT] * 2, pend) if pend else ([40, 41], None)
    plan = [ScheduledSeq(r, 3, True) for r in reqs]
    ids, dr = ex._graph_inputs(plan)
    roots = [r.tokens[-1] for r in reqs]
    assert ids == [roots[0], -1, -1, roots[1], 40, 41, roots[2], -1, -1, roots[3], 31, 32]
    assert dr is not None and dr.values is src.tensor and (dr.seqs, dr.rows) == ([0, 2], [1, 0])
    assert st[0].pending is not None and st[2].pending is not None and st[3].pending is None
    assert ex._rows_for(plan[0]) == [roots[0], 21, 22] and st[0].pending is None
    ex._resolve_drafts()
    assert st[2].drafts == [11, 12] and st[2].pending is None and st[1].drafts == [40, 41]


@pytest.mark.parametrize("mc", [None, 3])
def test_startup_capture_skips_sizes_a_speculation_cap_never_reaches(emulated, mc) -> None:
    """With ``max_concurrency``, start-up captures no verify graph, wide MTP catch-up or fused draft above the
    cap's padded size (those rounds never hold more sequences); width-one steps, chained steps, one-row catch-ups
    and the full-width head-free catch-up of lag flushes keep every size. Without a cap every graph is captured."""
    emulated(False)
    graphs = CudaGraphConfig(batch_sizes=[1, 2, 4, 8, 16], enable_padding=True)
    cfg = ExecutorConfig(**{**EX_CFG, "max_batch_size": 16, "max_num_tokens": 128}, cuda_graph_config=graphs)
    ex = SpeculativeExecutor(
        _model(), cfg, MTPDecodingConfig(adaptive=False, num_nextn_predict_layers=3, max_concurrency=mc)
    )
    runner, chain = ex.graph_runner, ex.drafter.chain_graphs
    seen: dict[str, list] = {}
    runner.capture_all = lambda limits=None: seen.setdefault("target", runner.startup_keys(limits))
    chain.capture_all = lambda limit=None, flushes=False: seen.setdefault("mtp", chain.startup_keys(limit, flushes))
    ex.capture_cuda_graphs()
    every, wide = [1, 2, 4, 8, 16], ([1, 2, 4] if mc == 3 else [1, 2, 4, 8, 16])
    assert sorted(seen["target"]) == sorted([(p, 1) for p in every] + [(p, 4) for p in wide])
    want = [("chain", p, 1) for p in every] + [(k, p, 1) for p in every for k in ("catchup", "catchup_only")]
    want += [(k, p, w) for p in wide for w in (2, 3, 4) for k in ("catchup", "catchup_only")]
    want += [("draft", p, w) for p in wide for w in (1, 2, 3, 4)]
    # The default catch-up lag holds rows: its flushes replay the full-width head-free catch-up over the whole
    # batch, so that one is captured at every size (a flush behind a step in flight cannot capture).
    want += [("catchup_only", p, 4) for p in every if p not in wide]
    assert sorted(seen["mtp"]) == sorted(want)


def test_set_decode_rows_matches_prepare() -> None:
    """`AttentionMetadata.set_decode_rows` writes what `prepare` writes for one decode row per sequence."""
    from trtllm_glm.attention.metadata import AttentionMetadata

    a = AttentionMetadata(max_num_seqs=6, max_num_tokens=32)
    b = AttentionMetadata(max_num_seqs=6, max_num_tokens=32)
    a.prepare([1, 2, 3, 4], past_lens=[5, 0, 9, 4], q_lens=[3, 2, 4, 1], state_slots=[7, 1, 2, 0], num_decode_seqs=0,
              num_padding_seqs=1, valid_q_lens=[2, 2, 3, 0])  # fmt: skip
    past = [7, 2, 12, 4]
    a.set_decode_rows(torch.tensor(past), torch.tensor([True, True, True, False]), past)
    b.prepare([1, 2, 3, 4], past_lens=past, q_lens=[1] * 4, state_slots=[7, 1, 2, 0], num_decode_seqs=4,
              num_padding_seqs=1)  # fmt: skip
    for name in ("positions_t", "row_seq_t", "row_live_t", "state_slots_t", "past_lens_t", "q_lens_t", "kv_lens_t",
                 "cu_seqlens_t"):  # fmt: skip
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    assert a.row_live_t.tolist() == [1, 1, 1, 0]
    for name in ("q_lens", "past_lens", "cu_seqlens", "num_decode_seqs", "num_decode_tokens", "num_tokens",
                 "max_kv_len", "valid_q_lens", "num_padding_seqs"):  # fmt: skip
        assert getattr(a, name) == getattr(b, name), name
    with pytest.raises(ValueError, match="4 lengths"):
        a.set_decode_rows(torch.tensor(past[:3]), torch.ones(3, dtype=torch.bool), past[:3])


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_staged_valid_rows_match_prepare(backend: str) -> None:
    """A draft's staging from a verify on the device (`speculative.mtp.staging`: valid rows = the accepted counts) makes
    the rows past each count what `prepare`'s host ``valid_q_lens`` makes them, in the same persistent buffers, and
    leaves the rest of the description alone."""
    from trtllm_glm.attention.metadata import AttentionMetadata
    from trtllm_glm.speculative.mtp.staging import StageBuffers, stage_draft_ahead

    a = AttentionMetadata(max_num_seqs=6, max_num_tokens=32)
    b = AttentionMetadata(max_num_seqs=6, max_num_tokens=32)
    kw = dict(past_lens=[5, 9, 4, 4], q_lens=[4] * 4, state_slots=[7, 1, 2, 0], num_decode_seqs=0, num_padding_seqs=1)
    a.prepare([1, 2, 3, 4], **kw, valid_q_lens=[4] * 4)  # type: ignore[arg-type]
    ptr = a.row_seq_t.data_ptr()
    n, P, W, D = 3, 4, 4, 8
    out = StageBuffers(torch.zeros(P, dtype=torch.int64), torch.zeros(P * W, dtype=torch.int64),
                       torch.zeros(P * W, D), a.row_seq_t, a.row_live_t, torch.zeros(n, dtype=torch.int64))  # fmt: skip
    a.device_rewritten()
    stage_draft_ahead(torch.arange(n * W).double(), torch.randn(n * W, D), torch.tensor([2.0, 4.0, 1.0]), W, P, out,
                      backend=backend)  # fmt: skip
    b.prepare([1, 2, 3, 4], **kw, valid_q_lens=[2, 4, 1, 0])  # type: ignore[arg-type]
    for name in ("positions_t", "row_seq_t", "row_live_t", "past_lens_t", "q_lens_t", "kv_lens_t", "cu_seqlens_t"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    assert a.row_seq_t.data_ptr() == ptr
    assert out.valid.tolist() == [2, 4, 1, 0] and out.last_rows.tolist() == [1, 7, 8]


def test_row_live_marks_padding_and_filler() -> None:
    """``row_live_t``: 0 on padding rows (sequences and widths) and on the verify filler ``live_q_lens`` names,
    which keep their ``row_seq`` (computed like any row); refreshed in place by the next `prepare`."""
    from trtllm_glm.attention.metadata import AttentionMetadata

    a = AttentionMetadata(max_num_seqs=6, max_num_tokens=32)
    a.prepare([1, 2, 3, 4], past_lens=[5, 0, 9, 4], q_lens=[3, 3, 3, 3], state_slots=[7, 1, 2, 0], num_decode_seqs=4,
              num_padding_seqs=1, live_q_lens=[3, 1, 2, 0])  # fmt: skip
    assert a.row_seq_t.tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2, -1, -1, -1]
    assert a.row_live_t.tolist() == [1, 1, 1, 1, 0, 0, 1, 1, 0, 0, 0, 0]
    ptr = a.row_live_t.data_ptr()
    a.prepare([1, 2], past_lens=[5, 0], q_lens=[2, 3], state_slots=[7, 1], num_decode_seqs=0,
              valid_q_lens=[2, 1])  # fmt: skip
    assert a.row_live_t.tolist() == [1, 1, 1, 0, 0] and a.row_live_t.data_ptr() == ptr
    with pytest.raises(ValueError, match="live_q_lens"):
        a.prepare([1], past_lens=[5], q_lens=[2], state_slots=[7], num_decode_seqs=1, live_q_lens=[3])


def test_accepted_counts_on_device() -> None:
    """The verify graph's acceptance: the longest confirmed prefix plus the root, never past the real drafts
    (filler that happens to equal the target's argmax is still rejected), padding sequences accept one row."""
    #                  root, drafts...          the target's argmax after each row
    ids = torch.tensor([[5, 7, 8, 9], [5, 7, 8, 9], [5, 7, 7, 7], [1, 2, 3, 4], [0, 0, 0, 0]])
    greedy = torch.tensor([[7, 8, 9, 4], [7, 6, 9, 4], [7, 7, 7, 7], [2, 3, 4, 0], [0, 0, 0, 0]])
    proposed = torch.tensor([3, 3, 1, 0, 0])
    # all three drafts / the second draft fails / filler 7s equal the argmax / nothing proposed / padding
    assert accepted_counts(ids, greedy, proposed).tolist() == [4, 2, 2, 1, 1]
    assert accepted_counts(ids, greedy, torch.tensor([3, 3, 3, 3, 3])).tolist() == [4, 2, 4, 4, 4]
    logits = torch.randn(5, 11)
    packed = greedy_and_gap(logits, torch.tensor([1, 2, 3, 4, 5]))
    assert packed[:, 0].tolist() == logits.argmax(-1).tolist() and packed[:, 2].tolist() == [1, 2, 3, 4, 5]
    assert greedy_and_gap(logits)[:, 2].tolist() == [1.0] * 5


def test_emulated_verify_graph_commit_disagreement_raises(emulated, monkeypatch) -> None:
    """The verify graph folds the KDA records with its own counts; if the host's acceptance ever differed,
    the state would no longer match the output, so the step raises instead of going on."""
    import trtllm_glm.runtime.cuda_graph as cg
    from trtllm_glm.speculative.drafters import OracleDrafter

    emulated(True)
    model = _model()
    cfg = ExecutorConfig(**EX_CFG, cuda_graph_config=CudaGraphConfig(batch_sizes=[1, 2], enable_padding=True))
    plain = _run(Executor(model, ExecutorConfig(**EX_CFG)), PROMPTS[:1], [12])
    # Every draft wrong: the host accepts one row per round, the forged counts say all of them.
    drafter = OracleDrafter({0: plain[0].output_ids}, lambda i, j: True, vocab_size=model.config.vocab_size)
    ex = SpeculativeExecutor(model, cfg, NGramDecodingConfig(max_draft_len=2), drafter=drafter)
    monkeypatch.setattr(cg, "accepted_counts", lambda ids, greedy, proposed: proposed + 1)
    ex.add_request(PROMPTS[0], SamplingParams(max_tokens=12, ignore_eos=True))
    with pytest.raises(StateError, match="verify graph accepted"):
        for _ in range(12):
            ex.step()


def _overlap_cfg(overlap: bool, sizes: tuple[int, ...] = (1, 2, 4), base: dict | None = None, **kw) -> ExecutorConfig:
    """`EX_CFG` (or ``base``) with padded graphs of ``sizes`` and the overlap scheduler on or off."""
    graphs = CudaGraphConfig(batch_sizes=list(sizes), enable_padding=True)
    return ExecutorConfig(**(base or EX_CFG), cuda_graph_config=graphs, overlap_scheduler=overlap, **kw)


@pytest.mark.parametrize("reuse", [False, True])
def test_emulated_overlap_scheduler_matches_plain_steps(emulated, reuse: bool) -> None:
    """The overlap scheduler (each steady decode step launched before the previous one is read back)
    gives every request the tokens and finish reason of ordinary steps, with requests that stop on a stop
    token nobody could foresee (the step launched after it is dropped), budgets that end at different
    steps, a request joining mid-run (no launch-ahead while it waits) and one aborted while a step is in
    flight; afterwards every slot and page is free again. With prefix caching on (pages sealed while the
    next step is in flight, the late joiner restoring a checkpoint of a shared prompt) as well as off."""
    model = _model()
    stem = [5, 9, 2, 7, 5, 9, 2, 7, 4, 4, 6, 1, 3, 3, 8, 2, 9]  # two full pages of 8 and one more token
    prompts = [stem + [6], [3, 1, 4, 1, 5], [8, 8, 1, 2, 3, 8, 8, 1, 2], stem + [1, 2]]
    max_tokens = [12, 9, 14, 10]

    def make(overlap: bool) -> Executor:
        cfg = _overlap_cfg(overlap, enable_block_reuse=reuse, checkpoint_interval=8)
        return Executor(model, cfg)

    emulated(True)  # every run pads through the kernels (the torch ops do not skip padding rows)
    free = _run(make(False), prompts, max_tokens)
    # Request 0 stops on the token it emits 4th, request 2 on its 6th: stop tokens met mid-run.
    stops = {0: free[0].output_ids[3], 2: free[2].output_ids[5]}

    def run(overlap: bool, abort_at: int | None):
        ex = make(overlap)
        reqs = []
        for i, (p, m) in enumerate(zip(prompts, max_tokens)):
            sp = SamplingParams(max_tokens=m, ignore_eos=True, stop_token_ids=[stops[i]] if i in stops else None)
            reqs.append(ex.add_request(p, sp))
        late = reqs.pop()
        ex.waiting.remove(late)
        steps = 0
        while ex.has_work or late is not None:
            if late is not None and steps == 5:
                ex.waiting.append(late)
                reqs.append(late)
                late = None
            if abort_at is not None and steps == abort_at:
                ex.abort_request(reqs[1].request_id)
            ex.step()
            steps += 1
        return ex, reqs

    _, ref = run(False, None)
    ex, got = run(True, None)
    print("overlapped", ex.num_overlapped_steps, "of", ex.num_steps)
    assert ex.num_overlapped_steps >= 5, ex.num_overlapped_steps
    assert [r.output_ids for r in got] == [r.output_ids for r in ref]
    assert [r.finish_reason for r in got] == [r.finish_reason for r in ref]
    assert ref[0].finish_reason.value == "stop" and len(ref[0].output_ids) == 4
    mgr = ex.manager
    assert mgr.num_free_slots == mgr.max_num_requests - 1 and mgr.num_free_pages == mgr.num_pages
    if reuse:
        assert ex.prefix.stats.hits >= 1 and got[-1].num_cached_tokens >= 16
    # An abort while a step is in flight: the others are unaffected, the aborted one holds a prefix.
    ex, got = run(True, 8)
    assert ex.num_overlapped_steps > 0 and got[1].finish_reason.value == "abort"
    assert got[1].output_ids == ref[1].output_ids[: len(got[1].output_ids)]
    assert [r.output_ids for i, r in enumerate(got) if i != 1] == [r.output_ids for i, r in enumerate(ref) if i != 1]
    assert ex.manager.num_free_pages == ex.manager.num_pages
    assert ex.manager.num_free_slots == ex.manager.max_num_requests - 1
    # Speculative rounds need their tokens before drafting: the flag leaves them alone, width-one rounds
    # included (a drafter with nothing to propose and no padding of short rounds: every round is width one
    # and would otherwise qualify).
    from trtllm_glm.speculative.drafters import OracleDrafter

    cfg = _overlap_cfg(True)
    silent = OracleDrafter({}, lambda i, j: False, vocab_size=model.config.vocab_size)
    spec = SpeculativeExecutor(model, cfg, NGramDecodingConfig(max_draft_len=2), drafter=silent)
    spec._padded_len = lambda r, k: 0  # type: ignore[method-assign]
    for a, b in zip(free[1:3], _run(spec, prompts[1:3], [6, 6])):
        d = compare_greedy(a.output_ids[:6], a.logit_gaps[:6], b.output_ids)
        assert d is None or d.excused, d
    assert spec.num_overlapped_steps == 0 and spec.graph_runner.stats.replays > 0


def _assert_same_checkpoints(ref_ex: Executor, ex: Executor) -> None:
    """Every prefix checkpoint of ``ex`` is one of ``ref_ex``'s (ordinary steps), its state planes byte for byte
    (``ex`` may hold fewer: a request-end checkpoint is skipped when a step launched ahead wrote the slot)."""
    keys = list(ex.prefix.store)
    assert set(map(repr, keys)) <= set(map(repr, ref_ex.prefix.store))
    for key in keys:
        a, b = ref_ex.prefix.store.get(key), ex.prefix.store.get(key)
        assert a.endpoint == b.endpoint and a.target.planes.keys() == b.target.planes.keys()
        for name, t in a.target.planes.items():
            assert torch.equal(t, b.target.planes[name]), (a.endpoint, name)


@pytest.mark.parametrize("prompt_end", [None, 4])
def test_emulated_admissions_stay_in_flight(emulated, prompt_end: int | None) -> None:
    """An admission step (prompts beside decode rows, eager) is left in flight and the next decode step replays from
    its tokens on the device (`Executor._may_chain_eager_step`): tokens and finish reasons equal ordinary steps', with
    prompts admitted while others decode, a sampled request, a prompt whose first token is its stop token (the step
    launched after it is dropped), ``max_tokens`` of 1 and 2, and every slot and page free afterwards. With prefix
    caching's prompt-end checkpoints (``prompt_end``: prompts of a page and more take one, at the read-back) an
    admission of such a prompt does not chain (the checkpoint would copy the state after the step launched after
    it); a repeat of that prompt restores the checkpoint and must continue as the original did."""
    model = _model()
    long = [9, 4, 9, 4, 9, 1, 3, 3, 5, 2]  # a page and more: a prompt-end checkpoint with ``prompt_end``
    prompts = [[5, 9, 2, 7, 5, 9, 2], [3, 1, 4, 1, 5], [8, 8, 1, 2, 3, 8, 8, 1, 2], [7, 1, 7, 1, 7], [2, 6, 2, 6],
               long, long + [1, 1, 1, 4]]  # fmt: skip
    params = [SamplingParams(max_tokens=24, ignore_eos=True),
              SamplingParams(max_tokens=22, temperature=0.9, seed=7, ignore_eos=True),
              SamplingParams(max_tokens=11, ignore_eos=True),
              SamplingParams(max_tokens=1, ignore_eos=True),
              SamplingParams(max_tokens=2, ignore_eos=True),
              SamplingParams(max_tokens=6, ignore_eos=True),
              SamplingParams(max_tokens=5, ignore_eos=True)]  # fmt: skip
    # The step at which each request arrives.
    arrive = [0, 0, 3, 5, 6, 9, 18]

    def run(overlap: bool, stop: dict[int, int] | None = None):
        cfg = _overlap_cfg(
            overlap, enable_block_reuse=prompt_end is not None, checkpoint_prompt_end=prompt_end or False
        )
        ex = Executor(model, cfg)
        reqs: list = [None] * len(prompts)
        steps = 0
        while steps <= max(arrive) or ex.has_work:
            for i, t in enumerate(arrive):
                if t == steps:
                    sp = params[i]
                    if stop and i in stop:
                        sp = dataclasses.replace(sp, stop_token_ids=[stop[i]])
                    reqs[i] = ex.add_request(prompts[i], sp)
            if ex.has_work:
                ex.step()
            steps += 1
        return ex, reqs

    emulated(True)
    _, ref = run(False)
    stop = {2: ref[2].output_ids[0]}  # request 2's first token stops it (sampled right after its admission)
    # The last request is the next turn of the one before (it arrives after that one ended): its prompt and answer,
    # then a new token: it resumes from the prompt-end checkpoint (keyed with the first answer token).
    prompts[6] = long + ref[5].output_ids[:3] + [4]
    ref_ex, ref = run(False, stop)
    ex, got = run(True, stop)
    assert [r.output_ids for r in got] == [r.output_ids for r in ref]
    assert [r.finish_reason for r in got] == [r.finish_reason for r in ref]
    assert len(ref[2].output_ids) == 1 and ref[2].finish_reason.value == "stop" and len(ref[3].output_ids) == 1
    assert ex.manager.num_free_pages == ex.manager.num_pages
    assert ex.manager.num_free_slots == ex.manager.max_num_requests - 1
    print("admissions ahead", ex.num_admissions_ahead, "chained", ex.num_chained_eager_steps, "of", ex.num_steps)
    assert ex.num_admissions_ahead >= 2, ex.num_admissions_ahead
    if prompt_end is None:
        assert ex.num_chained_eager_steps >= 2, ex.num_chained_eager_steps
    else:
        assert ex.num_chained_eager_steps >= 1 and got[6].num_cached_tokens >= len(long)
        # Every checkpoint holds the state ordinary steps left at its endpoint, byte for byte (one taken after a
        # chained admission held the state of the step launched after it).
        assert len(ref_ex.prefix.store) > 0
        _assert_same_checkpoints(ref_ex, ex)


def _captures_on_first_use(monkeypatch) -> None:
    """Emulated graphs captured on first use, as a GPU runner without start-up captures does: the first `key` of a
    batch describes the capture's padded batch in the shared metadata (`CudaGraphRunner.capture`'s ``_prepare``), and
    ``key(..., capture=False)`` finds no graph until then."""
    real = CudaGraphRunner.key

    def key(self, widths, capture: bool = True):  # noqa: ANN001, ANN202
        k = real(self, widths, capture)
        done = self.__dict__.setdefault("_emulated_captures", set())
        if k is not None and k not in done:
            if not capture:
                return None
            self._prepare([], *k)
            done.add(k)
        return k

    monkeypatch.setattr(CudaGraphRunner, "key", key)


def _overlapped_matches_ordinary(emulated, run) -> Executor:
    """``run(overlap)`` -> ``(executor, requests)``, ordinary steps then the overlap scheduler, padded steps through the
    kernels: the overlapped run's tokens are the ordinary run's. Returns the overlapped run's executor."""
    emulated(True)
    _, ref = run(False)
    ex, got = run(True)
    assert [r.output_ids for r in got] == [r.output_ids for r in ref]
    return ex


def test_emulated_admission_chains_only_into_a_graph_captured_already(emulated, monkeypatch) -> None:
    """Graphs captured on first use (`_captures_on_first_use`): the first step, three prompts, asks whether it may stay
    in flight before any decode graph exists; asking must not capture one, whose padded description (4 sequences)
    would replace the step's own before it is read back (an H100 run committed the 3 prompts' rows to 4 padding
    slots and failed). Tokens equal ordinary steps', and later admissions still chain into captured graphs."""
    _captures_on_first_use(monkeypatch)
    model = _model()
    prompts = [[5, 9, 2, 7, 5], [3, 1, 4], [8, 8, 1, 2, 3, 8], [7, 1, 7]]

    def run(overlap: bool):
        ex = Executor(model, _overlap_cfg(overlap))
        reqs = [ex.add_request(p, SamplingParams(max_tokens=8, ignore_eos=True)) for p in prompts[:3]]
        for _ in range(4):
            ex.step()
        reqs.append(ex.add_request(prompts[3], SamplingParams(max_tokens=8, ignore_eos=True)))
        ex.run_until_done()
        return ex, reqs

    ex = _overlapped_matches_ordinary(emulated, run)
    assert ex.num_chained_eager_steps >= 1 and ex.num_overlapped_steps >= 5
    assert ex.manager.num_free_slots == ex.manager.max_num_requests - 1


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_emulated_admissions_ahead_random_arrivals(emulated, seed: int) -> None:
    """Random arrivals into a decoding batch (admission steps planned while a decode step is in flight,
    `Executor._admit_ahead`), stop tokens drawn from the ordinary run's outputs (a request stops in the step read back
    while the admission step holds its next row), sampled requests, a batch cap that keeps some waiting: tokens and
    finish reasons equal ordinary steps', every slot and page free afterwards."""
    import random

    rng = random.Random(seed)
    model = _model()
    n = 7
    prompts = [[rng.randrange(1, 60) for _ in range(rng.randint(2, 13))] for _ in range(n)]
    params = [SamplingParams(max_tokens=rng.randint(2, 14), ignore_eos=True,
                             **({"temperature": 0.8, "seed": 100 + i} if rng.random() < 0.3 else {}))
              for i in range(n)]  # fmt: skip
    arrive = sorted(rng.randint(0, 10) for _ in range(n))  # dense: admissions on consecutive steps too

    def run(overlap: bool, stop: dict[int, int]):
        cfg = _overlap_cfg(overlap)
        ex = Executor(model, cfg)
        reqs: list = [None] * n
        steps = 0
        while steps <= max(arrive) or ex.has_work:
            for i, t in enumerate(arrive):
                if t == steps:
                    sp = dataclasses.replace(params[i], stop_token_ids=[stop[i]]) if i in stop else params[i]
                    reqs[i] = ex.add_request(prompts[i], sp)
            if ex.has_work:
                ex.step()
            steps += 1
        return ex, reqs

    emulated(True)  # padded steps through the kernels (the torch ops do not skip padding rows)
    _, ref = run(False, {})
    stop = {i: r.output_ids[rng.randrange(len(r.output_ids))] for i, r in enumerate(ref) if rng.random() < 0.5}
    _, ref = run(False, stop)
    ex, got = run(True, stop)
    assert [r.output_ids for r in got] == [r.output_ids for r in ref]
    assert [r.finish_reason for r in got] == [r.finish_reason for r in ref]
    assert ex.num_admissions_ahead >= 1, (ex.num_admissions_ahead, arrive)
    assert ex.manager.num_free_pages == ex.manager.num_pages
    assert ex.manager.num_free_slots == ex.manager.max_num_requests - 1


def test_emulated_admissions_on_consecutive_steps(emulated) -> None:
    """A request arriving at every step: each admission is planned while the previous admission (left in flight, its
    prompts' first tokens still on the device) runs, so those prompts' rows are decode rows one past their prompt."""
    model = _model()

    def run(overlap: bool):
        cfg = _overlap_cfg(overlap)
        ex = Executor(model, cfg)
        reqs = [ex.add_request([7, 1, 7, 1, 7, 2], SamplingParams(max_tokens=16, ignore_eos=True))]
        for step in range(1, 5):
            ex.step()
            prompt = [3 + step, 1, 4, 1, 5, 9, 2, 6][: 3 + step]
            reqs.append(ex.add_request(prompt, SamplingParams(max_tokens=10, ignore_eos=True)))
        ex.run_until_done()
        return ex, reqs

    ex = _overlapped_matches_ordinary(emulated, run)
    assert ex.num_admissions_ahead >= 2 and ex.num_chained_eager_steps >= 2, (
        ex.num_admissions_ahead, ex.num_chained_eager_steps)  # fmt: skip
    assert ex.manager.num_free_pages == ex.manager.num_pages


def test_emulated_admission_chains_only_into_a_captured_batch(emulated, monkeypatch) -> None:
    """An admission step is left in flight only when the decode step after it has a captured graph (its results'
    pinned buffers hold that many rows): with graphs of 1 and 2 sequences, admissions into 3 or 4 are read back."""
    model = _model()
    sizes: list[int] = []
    real = Executor._eager_outputs

    def record(self, plan, hidden):  # noqa: ANN001
        sizes.append(len(plan))
        return real(self, plan, hidden)

    monkeypatch.setattr(Executor, "_eager_outputs", record)

    def run(overlap: bool):
        cfg = _overlap_cfg(overlap, sizes=(1, 2))
        ex = Executor(model, cfg)
        reqs = []
        for step in range(14):
            if step in (0, 3, 6, 9):
                reqs.append(ex.add_request([5, 9, 2, 7, step + 1], SamplingParams(max_tokens=12, ignore_eos=True)))
            ex.step()
        ex.run_until_done()
        return reqs

    emulated(True)
    ref = run(False)
    got = run(True)
    assert [r.output_ids for r in got] == [r.output_ids for r in ref]
    assert sizes and max(sizes) <= 2, sizes


def test_emulated_admission_ahead_without_pages_tries_once(emulated) -> None:
    """A waiting prompt the cache cannot hold yet (its pages are held by the running requests): the admission planned
    ahead admits nobody, runs that step's decode rows eagerly once, and is not tried again while the request waits
    (the steps stay synchronous: every one would otherwise run eagerly what a graph replays); an ordinary step admits
    it once a request finished, with the tokens of ordinary steps."""
    model = _model()
    cfg_kw = dict(EX_CFG, max_tokens=96)  # 12 pages of 8

    def run(overlap: bool):
        cfg = _overlap_cfg(overlap, base=cfg_kw)
        ex = Executor(model, cfg)
        reqs = [ex.add_request([3 + i, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3], SamplingParams(max_tokens=m,
                               ignore_eos=True)) for i, m in enumerate((14, 22))]  # fmt: skip
        for _ in range(4):
            ex.step()
        reqs.append(ex.add_request(list(range(1, 57)), SamplingParams(max_tokens=4, ignore_eos=True)))  # 7 pages
        ex.run_until_done()
        return ex, reqs

    emulated(True)
    _, ref = run(False)
    ex, got = run(True)
    assert [r.output_ids for r in got] == [r.output_ids for r in ref]
    assert ex.num_admissions_ahead == 1, ex.num_admissions_ahead
    assert got[2].t_admitted is not None and ex.manager.num_free_pages == ex.manager.num_pages


def test_emulated_overlap_scheduler_with_sampled_requests(emulated) -> None:
    """Sampled requests under the overlap scheduler: each step's draws are made on the device right after
    its replay (the launched-ahead step takes them as input ids), in the order an ordinary step's read-back
    makes them, so seeded outputs equal ordinary graph steps', a sampled stop token included; steps still
    launch ahead with sampled requests in the batch. Without the draws (the greedy tokens fed ahead), the
    sampled requests' outputs differ."""
    model = _model()
    prompts = [[5, 9, 2, 7, 5, 9, 2], [3, 1, 4, 1, 5], [8, 8, 1, 2, 3, 8, 8, 1, 2], [7, 1, 7, 1, 7]]
    params = [SamplingParams(max_tokens=12, temperature=0.9, seed=7, ignore_eos=True),
              SamplingParams(max_tokens=10, ignore_eos=True),
              SamplingParams(max_tokens=14, temperature=1.1, top_p=0.8, seed=8, ignore_eos=True),
              SamplingParams(max_tokens=9, temperature=0.7, top_k=6, seed=9, ignore_eos=True)]  # fmt: skip

    def run(overlap: bool, stop: dict[int, int] | None = None):
        cfg = _overlap_cfg(overlap)
        ex = Executor(model, cfg)
        reqs = []
        for i, (p, sp) in enumerate(zip(prompts, params)):
            if stop and i in stop:
                sp = dataclasses.replace(sp, stop_token_ids=[stop[i]])
            reqs.append(ex.add_request(p, sp))
        ex.run_until_done()
        return ex, reqs

    emulated(True)
    _, ref = run(False)
    stop = {0: ref[0].output_ids[5]}  # a sampled token ends request 0 mid-run
    _, ref = run(False, stop)
    ex, got = run(True, stop)
    assert ex.num_overlapped_steps >= 5, ex.num_overlapped_steps
    assert [r.output_ids for r in got] == [r.output_ids for r in ref]
    assert [r.finish_reason for r in got] == [r.finish_reason for r in ref]
    assert ref[0].finish_reason.value == "stop" and len(set(ref[2].output_ids)) > 1
    assert ex.manager.num_free_pages == ex.manager.num_pages


def test_emulated_overlap_while_max_concurrency_keeps_speculation_off(emulated) -> None:
    """With ``max_concurrency`` exceeded, a drafter without model state runs plain width-one rounds, and the
    overlap scheduler launches them ahead like plain decoding (also right after verify rounds, whose
    accepted counts the first launched-ahead step inherits unread); as requests finish and the batch shrinks to
    ``max_concurrency``, launching ahead stops and speculation resumes. Tokens equal the same run without the
    overlap scheduler (greedy and seeded sampled requests alike: the sampled draws are made once, on the
    device, not again at the read-back), and the greedy ones the plain greedy tokens; every slot and page is
    free afterwards. The MTP drafter launches ahead as well (its catch-up on the device, before the launch)."""
    from trtllm_glm.speculative.drafters import OracleDrafter

    model = _model()
    prompts = [[5, 9, 2, 7, 5, 9, 2], [3, 1, 4, 1, 5], [8, 8, 1, 2, 3, 8, 8, 1, 2], [7, 1, 7, 1, 7]]
    params = [SamplingParams(max_tokens=6, ignore_eos=True),
              SamplingParams(max_tokens=9, temperature=0.9, seed=5, ignore_eos=True),
              SamplingParams(max_tokens=10, ignore_eos=True),
              SamplingParams(max_tokens=18, ignore_eos=True)]  # fmt: skip
    emulated(True)
    plain = Executor(model, ExecutorConfig(**EX_CFG))
    ref = [plain.add_request(p, sp) for p, sp in zip(prompts, params)]
    plain.run_until_done()
    cont = {i: r.output_ids for i, r in enumerate(ref)}

    def run(overlap: bool, spec_cfg=None):
        cfg = _overlap_cfg(overlap)
        oracle = spec_cfg is None
        if oracle:
            spec_cfg = NGramDecodingConfig(max_draft_len=2, max_concurrency=2)
            ex = SpeculativeExecutor(model, cfg, spec_cfg, drafter=OracleDrafter(cont, lambda i, j: False))
        else:
            ex = SpeculativeExecutor(model, cfg, spec_cfg)
        reqs = [ex.add_request(p, sp) for p, sp in zip(prompts, params)]
        # Requests 0 and 2 join late: the first rounds speculate (two requests), then the batch grows past
        # max_concurrency right after verify rounds (accepted counts in the metadata), then shrinks again.
        late = [reqs[0], reqs[2]]
        for r in late:
            ex.waiting.remove(r)
        overlapped_with, steps, early = [], 0, 0
        while ex.has_work or late:
            if steps == 4:
                early = reqs[3].num_verify_rounds
                ex.waiting.extend(late)
                late = []
            before = ex.num_overlapped_steps
            n = len(ex.running)
            ex.step()
            steps += 1
            if ex.num_overlapped_steps > before:
                overlapped_with.append(n)
        assert early > 0 or not oracle  # request 3 speculated before the late joiners came
        return ex, reqs, overlapped_with

    _, base, _ = run(False)
    ex, got, overlapped_with = run(True)
    assert ex.num_overlapped_steps >= 3, ex.num_overlapped_steps
    assert min(overlapped_with) > 2  # only while the batch exceeded max_concurrency
    assert [r.output_ids for r in got] == [r.output_ids for r in base]
    assert got[3].num_verify_rounds > 0 and got[3].num_accepted_total > got[3].num_verify_rounds  # resumed
    for i in (0, 2, 3):
        d = compare_greedy(ref[i].output_ids, ref[i].logit_gaps, got[i].output_ids)
        assert d is None or d.excused, (i, d)
    assert ex.manager.num_free_pages == ex.manager.num_pages
    assert ex.manager.num_free_slots == ex.manager.max_num_requests - 1
    # The MTP drafter launches ahead too, its catch-up on the in-flight step made on the device before each
    # launch (tests/integration/test_mtp_overlap.py checks its cache bit for bit).
    spec = MTPDecodingConfig(adaptive=False, num_nextn_predict_layers=2, max_concurrency=1)
    _, mtp_base, _ = run(False, spec)
    mtp, mtp_got, _ = run(True, spec)
    assert mtp.num_overlapped_steps > 0 and mtp.num_catchups_ahead > 0 and mtp.num_unspeculated_rounds > 0
    assert [r.output_ids for r in mtp_got] == [r.output_ids for r in mtp_base]


def test_emulated_sampled_requests_ride_the_verify_graph(emulated) -> None:
    """Sampled requests (never drafted for) in a batch with drafting greedy ones are padded to the verify
    width with filler and sample from their first row, so the batch's rounds replay instead of running
    eagerly; tokens equal an eager speculative run (greedy: the near-tie rule; sampled: the same seeded
    draws), and rounds where nobody drafts stay width one. With sampled requests left unpadded, the mixed
    rounds run eagerly (``eager_steps``)."""
    model = _model()
    params = [SamplingParams(max_tokens=8, ignore_eos=True),
              SamplingParams(max_tokens=14, temperature=0.9, seed=11, ignore_eos=True),
              SamplingParams(max_tokens=9, ignore_eos=True),
              SamplingParams(max_tokens=6, temperature=0.7, top_k=5, seed=3, ignore_eos=True)]  # fmt: skip

    from trtllm_glm.speculative.drafters import OracleDrafter

    emulated(False)
    plain = _run(Executor(model, ExecutorConfig(**EX_CFG)), PROMPTS, [sp.max_tokens for sp in params])
    cont = {i: r.output_ids for i, r in enumerate(plain)}

    def run(graphs: bool) -> tuple[SpeculativeExecutor, list]:
        cfg = ExecutorConfig(**EX_CFG, cuda_graph_config=CudaGraphConfig(batch_sizes=[1, 2, 4], enable_padding=True)
                             if graphs else None)  # fmt: skip
        # The greedy requests' drafts replay their plain continuations, every third position corrupted.
        drafter = OracleDrafter(cont, lambda i, j: (i + j) % 3 == 0, vocab_size=model.config.vocab_size)
        ex = SpeculativeExecutor(model, cfg, NGramDecodingConfig(max_draft_len=2), drafter=drafter)
        if graphs:
            replay = ex.graph_runner.replay

            def record(key, plan, *args, **kwargs):
                keys.append((key, sum(r.params.greedy for r in ex.running)))
                return replay(key, plan, *args, **kwargs)

            ex.graph_runner.replay = record
        reqs = [ex.add_request(p, sp) for p, sp in zip(PROMPTS, params)]
        ex.run_until_done()
        return ex, reqs

    keys: list = []

    _, ref = run(False)
    emulated(True)
    ex, got = run(True)
    for a, b, sp in zip(ref, got, params):
        if sp.greedy:
            _assert_same([a], [b])
        else:
            assert a.output_ids == b.output_ids and len(b.output_ids) == sp.max_tokens
    assert sum(r.num_verify_rounds for r in got if r.params.greedy) > 0
    st = ex.graph_runner.stats
    assert st.replays > 0 and st.eager_steps == 0, (st.replays, st.eager_steps)
    # Verify-width rounds while greedy requests draft; width one once only the sampled request is left.
    assert any(w == 3 for (_, w), _ in keys) and keys[-1][1] == 0
    assert all(w == 1 for (_, w), n_greedy in keys if n_greedy == 0)
