"""Piecewise CUDA graphs of eager steps on the GPU (`trtllm_glm.runtime.piecewise`): every segment captures (no
host sync, no allocation outside the pool, no data-dependent shape), replays give the eager steps' greedy tokens
(plain and n-gram executors; prefill steps and mixed steps of a prompt joining decoding requests), a step
without padding rows equals the eager step bit for bit, and in the batch-invariant mode every step does.

Needs CUDA (tests/conftest.py skips ``gpu`` tests without it). Run with ``-s`` to see capture times and memory.
"""

from __future__ import annotations

import pytest
import torch

from benchmarks.harness.model_harness import ModelHarness
from trtllm_glm.models.glm5_next import Glm5NextForCausalLM
from trtllm_glm.numerics import batch_invariant_mode
from trtllm_glm.runtime.cuda_graph import CudaGraphConfig
from trtllm_glm.runtime.executor import Executor, ExecutorConfig
from trtllm_glm.runtime.lossless import compare_greedy
from trtllm_glm.runtime.piecewise import PIECEWISE_ENV, PiecewiseRunner
from trtllm_glm.runtime.sampling import SamplingParams
from trtllm_glm.runtime.speculative_executor import SpeculativeExecutor
from trtllm_glm.speculative.config import NGramDecodingConfig

pytestmark = pytest.mark.gpu

PROMPTS = [
    list(b"def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n"),
    list(b"import os\nimport sys\n\nclass Reader:\n    def __init__(self, path):\n        self.path = "),
    list(b"for i in range(10):\n    print(i)\nfor j in range(10):\n    print("),
    list(b"    if x is None:\n        return None\n    if y is None:\n        return "),
]
MAX_TOKENS = [24, 32, 16, 20]


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def model(request) -> Glm5NextForCausalLM:
    return Glm5NextForCausalLM.from_pretrained("small", dtype=request.param, device="cuda").eval()


def _run(ex: Executor, join_after: int):
    """Greedy run of `PROMPTS`; the last one joins after ``join_after`` steps (a mixed step)."""
    reqs = [ex.add_request(p, SamplingParams(max_tokens=m, ignore_eos=True)) for p, m in zip(PROMPTS, MAX_TOKENS)]
    late = reqs[-1]
    ex.waiting.remove(late)
    steps = 0
    while ex.has_work or late is not None:
        if late is not None and steps == join_after:
            ex.waiting.append(late)
            late = None
        ex.step()
        steps += 1
    return reqs


@pytest.mark.parametrize("mode", ["plain", "ngram"])
def test_piecewise_executor_matches_eager(model, mode: str, monkeypatch) -> None:
    monkeypatch.delenv(PIECEWISE_ENV, raising=False)

    def make(piecewise: bool) -> Executor:
        cfg = ExecutorConfig(tokens_per_block=16, max_tokens=4096, max_batch_size=4, max_num_tokens=256,
                             max_seq_len=256, cuda_graph_config=CudaGraphConfig(piecewise=piecewise))  # fmt: skip
        if mode == "plain":
            return Executor(model, cfg)
        return SpeculativeExecutor(model, cfg, NGramDecodingConfig(max_draft_len=7))

    ref = _run(make(False), join_after=3)
    ex = make(True)
    pw = ex.piecewise
    assert pw is not None and not pw.emulate
    got = _run(ex, join_after=3)
    for a, b in zip(ref, got):
        d = compare_greedy(a.output_ids, a.logit_gaps, b.output_ids)
        assert d is None or d.excused, f"request {a.request_id}: {d}"
    st = pw.stats
    print(f"\n[{mode}, {next(model.parameters()).dtype}] piecewise: {st.steps} steps, {st.replays} replays, "
          f"{st.captures} captures in {st.capture_s:.2f} s, pool +{st.pool_bytes / 2**20:.0f} MiB, "
          f"carry {st.carry_bytes / 2**20:.1f} MiB, {st.eager_steps} eager steps")  # fmt: skip
    assert st.failed == {}, st.failed  # every segment captured: sync-free, allocation-free, static shapes
    # Steps with verify rows stay eager (n-gram drafts from the first decode step on): the prefill step at least.
    assert st.steps >= (2 if mode == "plain" else 1) and st.eager_segments == 0
    assert st.replays == st.steps * pw.num_segments


def _piecewise_step(h: ModelHarness, runner: PiecewiseRunner, rows, num_decode_seqs: int) -> torch.Tensor:
    for rid, toks in rows:
        if rid not in h.lengths:
            h.manager.add_request(rid)
            h.lengths[rid] = 0
        h.manager.ensure_capacity(rid, h.lengths[rid] + len(toks))
    rids = [r for r, _ in rows]
    h.meta.prepare(
        rids, past_lens=[h.lengths[r] for r in rids], q_lens=[len(t) for _, t in rows],
        num_decode_seqs=num_decode_seqs,
    )  # fmt: skip
    assert runner.applies(h.meta)
    with torch.inference_mode():
        hidden = runner.forward([t for _, toks in rows for t in toks], h.meta, h.manager)
    for rid, toks in rows:
        h.lengths[rid] += len(toks)
    return hidden.clone()


def _steps(seed: int, edges: bool) -> list:
    g = torch.Generator().manual_seed(seed)
    t = lambda n: torch.randint(0, 256, (n,), generator=g).tolist()  # noqa: E731
    if edges:  # row counts 16, 16, 32, 4, 1, 48, 8: no padding
        return [
            ([(0, t(9)), (1, t(7))], 0),
            ([(0, t(1)), (1, t(1)), (2, t(14))], 2),
            ([(0, t(1)), (1, t(1)), (2, t(1)), (3, t(29))], 3),
            ([(0, t(1)), (1, t(1)), (2, t(1)), (3, t(1))], 4),
            ([(4, t(1))], 0),
            ([(0, t(1)), (1, t(1)), (2, t(1)), (3, t(1)), (4, t(44))], 4),
            ([(0, t(1)), (1, t(1)), (2, t(1)), (3, t(1)), (4, t(1)), (5, t(3))], 5),
        ]
    return [  # 20, 16, 17, 15, 4, 31, 1, 32, 47 rows
        ([(0, t(13)), (1, t(7))], 0),
        ([(0, t(1)), (1, t(1)), (2, t(14))], 2),
        ([(0, t(1)), (1, t(1)), (2, t(1)), (3, t(14))], 3),
        ([(0, t(1)), (1, t(1)), (2, t(1)), (3, t(12))], 3),
        ([(0, t(1)), (1, t(1)), (2, t(1)), (3, t(1))], 4),
        ([(0, t(1)), (1, t(1)), (2, t(1)), (4, t(28))], 3),
        ([(5, t(1))], 0),
        ([(6, t(32))], 0),
        ([(0, t(1)), (4, t(1)), (5, t(9)), (6, t(3)), (7, t(33))], 2),
    ]


def _bits(model: Glm5NextForCausalLM, steps, *, invariant: bool) -> None:
    """Eager and piecewise (real graphs) on twin caches: hidden, and the caches the cores wrote, bit for bit."""
    model.fuse_weights()  # as an executor on CUDA does before capturing
    ref = ModelHarness(model, max_seq_len=64, max_num_requests=8)
    got = ModelHarness(model, max_seq_len=64, max_num_requests=8)
    runner = PiecewiseRunner(model, max_num_tokens=48, allow_batch_invariant=invariant)
    for i, (rows, nd) in enumerate(steps):
        with torch.inference_mode():
            want = ref.step(rows, num_decode_seqs=nd).clone()
        have = _piecewise_step(got, runner, rows, nd)
        assert torch.equal(have, want), f"step {i} ({have.shape[0]} rows): {(have - want).abs().max().item()}"
    assert torch.equal(ref.manager.state.kda_recurrent, got.manager.state.kda_recurrent)
    assert torch.equal(ref.manager.state.kda_conv, got.manager.state.kda_conv)
    assert torch.equal(ref.manager.latent, got.manager.latent)
    assert runner.stats.failed == {} and runner.stats.replays == len(steps) * runner.num_segments


def test_piecewise_bits_without_padding(model) -> None:
    """Row counts on bucket edges: the same ops on the same shapes, cut into graphs and eager cores."""
    _bits(model, _steps(1, edges=True), invariant=False)


def test_piecewise_bits_in_batch_invariant_mode(model) -> None:
    """Padded steps too: no launch depends on the row count in the mode. Passing this is what allows
    ``allow_batch_invariant=True`` as the executor's default (it is False until then)."""
    with batch_invariant_mode(True):
        _bits(model, _steps(2, edges=False), invariant=True)


def test_capture_all_memory(model) -> None:
    """Start-up capture of every bucket of a 256-token budget: how long and how much memory (printed)."""
    cfg = ExecutorConfig(tokens_per_block=16, max_tokens=4096, max_batch_size=4, max_num_tokens=256,
                         max_seq_len=256, cuda_graph_config=CudaGraphConfig(piecewise=True))  # fmt: skip
    ex = Executor(model, cfg)
    assert ex.piecewise is not None
    ex.capture_cuda_graphs()
    st = ex.piecewise.stats
    print(f"\n[{next(model.parameters()).dtype}] {len(ex.piecewise.buckets)} buckets x {ex.piecewise.num_segments} "
          f"segments: {st.captures} captures in {st.capture_s:.2f} s, pool +{st.pool_bytes / 2**20:.0f} MiB, "
          f"carry {st.carry_bytes / 2**20:.1f} MiB")  # fmt: skip
    assert st.failed == {} and st.captures == len(ex.piecewise.buckets) * ex.piecewise.num_segments
