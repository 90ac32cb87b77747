"""`LLM.generate` from several threads, and beside `generate_async` (issue 45): callers take turns on the one
executor, so every output is what the same call gives alone; a `generate` while `generate_async` requests are in
flight is refused with a clear error and corrupts nothing."""

from __future__ import annotations

import asyncio
import threading

import pytest

from trtllm_glm import LLM, SamplingParams

pytestmark = pytest.mark.cpu_only

P = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM("tiny", device="cpu", max_seq_len=128, max_batch_size=4)


def test_generate_from_threads_takes_turns(llm: LLM) -> None:
    prompts = [[3 + i, 7, 1 + i, 9] * (1 + i % 3) for i in range(6)]
    alone = [llm.generate(p, P).outputs[0].token_ids for p in prompts]
    got: dict[int, list[int]] = {}
    errors: list[BaseException] = []
    barrier = threading.Barrier(len(prompts))

    def worker(i: int) -> None:
        try:
            barrier.wait()
            got[i] = llm.generate([prompts[i]], P)[0].outputs[0].token_ids
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    assert [got[i] for i in range(len(prompts))] == alone
    assert not llm.executor.has_work and llm.executor.manager.num_free_slots == 4


def test_generate_beside_generate_async(llm: LLM) -> None:
    """While a streamed generate_async request runs on the engine thread, a generate from another thread is
    refused with a clear error (it would step the same executor); afterwards both paths give the solo tokens."""
    prompt = [5, 6, 7, 8, 9]
    want = llm.generate(prompt, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)).outputs[0].token_ids
    started = threading.Event()
    refused: list[str] = []

    async def stream() -> list[int]:
        out = llm.generate_async(prompt, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True),
                                 streaming=True)  # fmt: skip
        toks: list[int] = []
        async for part in out:
            toks = list(part.outputs[0].token_ids)
            if not started.is_set():
                started.set()
                await asyncio.to_thread(_try_generate, refused)
        return toks

    assert asyncio.run(stream()) == want
    assert refused and "generate_async" in refused[0]
    assert llm.generate(prompt, P).outputs[0].token_ids == want[:8]


def _try_generate(refused: list[str]) -> None:
    try:
        _LLM_REF[0].generate([1, 2, 3], P)
    except RuntimeError as e:
        refused.append(str(e))


_LLM_REF: list[LLM] = []


@pytest.fixture(autouse=True)
def _ref(llm: LLM):
    _LLM_REF[:] = [llm]
    yield


def test_unknown_device_is_one_line() -> None:
    with pytest.raises(
        ValueError, match=r"^device must be 'cpu', 'cuda' or 'cuda:N' \(a device torch knows\), got 'tpu'$"
    ):
        LLM("tiny", device="tpu")
