"""Shared by the piecewise tests: a step of a `ModelHarness` through a runner (or eagerly), and a small executor run
where two prompts prefill, then two more join them while they decode (an admission step)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from benchmarks.harness.model_harness import ModelHarness
from trtllm_glm.models.glm5_next import Glm5NextForCausalLM
from trtllm_glm.runtime.cuda_graph import PADDING_REQUEST_ID, CudaGraphConfig
from trtllm_glm.runtime.executor import Executor, ExecutorConfig
from trtllm_glm.runtime.piecewise import PiecewiseRunner
from trtllm_glm.runtime.request import Request
from trtllm_glm.runtime.sampling import SamplingParams

__all__ = ["ADMISSION_PROMPTS", "free_requests", "harness_step", "run_admissions", "slice_harness", "slice_model"]

ADMISSION_PROMPTS = [
    [5, 9, 2, 7, 5, 9, 2, 7, 5, 9, 2],
    [3, 1, 4, 1, 5, 9, 2, 6, 5],
    [8, 8, 1, 2, 3, 8, 8, 1],
    [7, 1, 7],
]


def run_admissions(model: Glm5NextForCausalLM, piecewise: bool) -> tuple[Executor, list[Request]]:
    """Run `ADMISSION_PROMPTS` greedily through an executor of ``model`` (graphs emulated on the CPU: the caller
    patches ``Executor._graphs_supported``), the last two joining after two steps. Returns the executor and its
    requests."""
    cgc = CudaGraphConfig(batch_sizes=[1, 2, 3, 4], piecewise=piecewise)
    cfg = ExecutorConfig(tokens_per_block=8, max_tokens=1024, max_batch_size=4, max_num_tokens=48, max_seq_len=96,
                         cuda_graph_config=cgc)  # fmt: skip
    ex = Executor(model, cfg)
    reqs = [
        ex.add_request(p, SamplingParams(max_tokens=m, ignore_eos=True))
        for p, m in zip(ADMISSION_PROMPTS, [5, 7, 4, 5])
    ]
    late = reqs[2:]
    for r in late:
        ex.waiting.remove(r)
    steps = 0
    while ex.has_work or late:
        if late and steps == 2:  # two prompts join two decoding requests: an admission step
            ex.waiting.extend(late)
            late = []
        ex.step()
        steps += 1
    return ex, reqs


def free_requests(h: ModelHarness, freed: list[int]) -> None:
    """Free ``freed``'s requests on ``h`` (those it holds)."""
    for rid in freed:
        if rid in h.lengths:
            h.manager.free_request(rid)
            del h.lengths[rid]


def slice_model() -> Glm5NextForCausalLM:
    """``tiny`` cut to the real slice's schedule in fp32: three KDA layers (dense FFN, MoE, MoE), then sparse MLA +
    MoE (piecewise: one segment with three KDA cores inside, then the sparse core)."""
    return Glm5NextForCausalLM.from_pretrained("tiny", layers=[0, 1, 2, 3], dtype="float32").eval()


def slice_harness(model: Glm5NextForCausalLM) -> tuple[ModelHarness, int]:
    """A harness of 12 requests with the padding request added first (every later request's slot then differs from
    its id); returns it and the padding slot."""
    h = ModelHarness(model, max_seq_len=64, max_num_requests=12)
    return h, h.manager.add_request(PADDING_REQUEST_ID, 0)


def harness_step(
    h: ModelHarness,
    runner: PiecewiseRunner | None,
    rows: list[tuple[int, int]],
    nd: int,
    toks: dict[int, list[int]],
    after_prepare: Callable[[list[int]], None] | None = None,
) -> torch.Tensor:
    """One step of ``rows`` (request id, rows this step; the first ``nd`` decode) on ``h`` through ``runner``
    (``None``: the plain eager forward), tokens from ``toks``; ``after_prepare(request ids)`` runs once the step's
    pages and metadata are ready (a runner only). Returns a copy of the final hidden ``[n, D]``."""
    if runner is None:
        with torch.no_grad():
            return h.step([(r, toks[r][:n]) for r, n in rows], num_decode_seqs=nd).clone()
    for rid, n in rows:
        if rid not in h.lengths:
            h.manager.add_request(rid)
            h.lengths[rid] = 0
        h.manager.ensure_capacity(rid, h.lengths[rid] + n)
    rids = [r for r, _ in rows]
    h.meta.prepare(rids, past_lens=[h.lengths[r] for r in rids], q_lens=[n for _, n in rows], num_decode_seqs=nd)
    if after_prepare is not None:
        after_prepare(rids)
    assert runner.applies(h.meta)
    with torch.no_grad():
        out = runner.forward([t for r, n in rows for t in toks[r][:n]], h.meta, h.manager).clone()
    for rid, n in rows:
        h.lengths[rid] += n
    return out
