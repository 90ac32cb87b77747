"""A served run on the GPU compiles no kernel after start-up (issue 42): the LLM's warm-up ran every step shape
(prefill widths, mixed steps, full batches, contexts, sampling), so requests of new prompt lengths, batch mixes
and sampling settings meet only kernels compiled already. And the served greedy tokens equal `LLM.generate`'s.
Both with the engine on a thread of this process and in an engine process (the server's default; its compiles
come back in its ``/metrics`` page).

Needs CUDA (tests/conftest.py skips ``gpu`` tests without it).
"""

from __future__ import annotations

import asyncio
import random

import pytest

from tests.serve_helpers import run, wait_idle
from trtllm_glm import LLM, SamplingParams
from trtllm_glm.jit_compiles import CompileCounter
from trtllm_glm.serve.engine import AsyncEngine, GenerationRequest
from trtllm_glm.serve.engine_client import EngineClient

pytestmark = pytest.mark.gpu


GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def served_prompts(vocab: int) -> list[list[int]]:
    rng = random.Random(0)
    lens = [rng.choice([1, 2, 5, 16, 17, 31, 64, 100, 129, 300, 480]) for _ in range(40)]
    return [[rng.randrange(1, vocab) for _ in range(n)] for n in lens]


async def serve_all(eng, prompts: list[list[int]]) -> list[list[int]]:
    """Every prompt through ``eng`` (an `AsyncEngine` or an `EngineClient`), greedy or sampled, staggered."""

    async def one(i: int, p: list[int]) -> list[int]:
        params = GREEDY if i < 8 or i % 3 else SamplingParams(max_tokens=7, temperature=0.8, top_p=0.9, seed=i)
        await asyncio.sleep(0.002 * (i % 7))  # staggered arrivals: mixed prefill + decode steps of many widths
        out: list[int] = []
        async for d in await eng.submit([GenerationRequest(p, params)]):
            out += d.token_ids
        return out

    return await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))


def test_served_run_compiles_nothing_after_startup() -> None:
    llm = LLM("tiny", device="cuda", max_seq_len=512)
    rep = llm.warmup_report
    assert rep is not None and rep.requests > 0 and not rep.skipped
    print(rep.describe())
    prompts = served_prompts(llm.config.vocab_size)
    greedy = GREEDY
    refs = [o.outputs[0].token_ids for o in llm.generate(prompts[:8], greedy)]
    eng = AsyncEngine(llm, max_queue_size=64)
    eng.start()

    async def main():
        return await serve_all(eng, prompts)

    try:
        with CompileCounter() as cc:
            outs = run(main(), timeout=300)
            wait_idle(eng)
    finally:
        eng.stop(drain_timeout=0)
    assert outs[:8] == refs
    assert cc.available and cc.count == 0, f"compiled while serving: {cc.names[:10]}"


def test_engine_process_compiles_nothing_after_startup() -> None:
    """The server's default layout: the engine process counts the kernels it compiles after its start-up and
    reports them in ``trtllm:kernel_compiles_total``."""
    llm = LLM("tiny", device="cuda", max_seq_len=512)
    prompts = served_prompts(llm.config.vocab_size)
    refs = [o.outputs[0].token_ids for o in llm.generate(prompts[:8], GREEDY)]
    llm.shutdown()
    eng = EngineClient("tiny", {"device": "cuda", "max_seq_len": 512}, max_queue_size=64)
    eng.start()

    async def main() -> tuple[list[list[int]], str]:
        outs = await serve_all(eng, prompts)
        return outs, (await eng.render_metrics()).decode()

    try:
        print("\n".join(eng.start_lines))
        outs, page = run(main(), timeout=300)
        wait_idle(eng)
    finally:
        eng.stop(drain_timeout=0)
    assert outs[:8] == refs
    compiles = [line for line in page.splitlines() if line.startswith("trtllm:kernel_compiles_total ")]
    assert compiles == ["trtllm:kernel_compiles_total 0.0"], compiles
