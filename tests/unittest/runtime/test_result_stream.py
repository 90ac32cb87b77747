"""`ResultStream`: a reader that falls behind gets one generation's queued deltas merged, nothing lost or reordered."""

from __future__ import annotations

import asyncio

import pytest

from trtllm_glm.runtime.async_engine import Delta, ResultStream

pytestmark = pytest.mark.cpu_only


class _NoEngine:
    def _post(self, cmd: tuple) -> None:  # abort requests go nowhere here
        pass


def _delta(index: int, tok: int, n: int, finish: str | None = None, error: str | None = None) -> Delta:
    return Delta(index=index, text=f"<{tok}>", token_ids=[tok], logprobs=[{tok: None}], text_offsets=[3 * (n - 1)],
                 finish_reason=finish, error=error, num_prompt_tokens=5, num_output_tokens=n)  # fmt: skip


def test_queued_deltas_of_one_generation_merge_in_order() -> None:
    async def main() -> list[Delta]:
        s = ResultStream(_NoEngine(), asyncio.get_running_loop(), 2)  # type: ignore[arg-type]
        # Two steps' deltas arrive before the reader looks: generation 0 twice, then 1, then 0's last.
        s._deliver([_delta(0, 10, 1), _delta(0, 11, 2), _delta(1, 20, 1), _delta(0, 12, 3, "length")])
        s._deliver([_delta(1, 21, 2, "error", error="boom")])
        return [d async for d in s]

    out = asyncio.run(main())
    assert [(d.index, d.token_ids, d.finish_reason) for d in out] == [
        (0, [10, 11], None), (1, [20], None), (0, [12], "length"), (1, [21], "error"),
    ]  # fmt: skip
    first = out[0]
    assert first.text == "<10><11>" and first.text_offsets == [0, 3] and first.num_output_tokens == 2
    assert first.logprobs == [{10: None}, {11: None}]


def test_final_delta_merges_and_error_stays_apart() -> None:
    async def main() -> list[Delta]:
        s = ResultStream(_NoEngine(), asyncio.get_running_loop(), 1)  # type: ignore[arg-type]
        s._deliver([_delta(0, 1, 1), _delta(0, 2, 2, "stop")])
        return [d async for d in s]

    (only,) = asyncio.run(main())
    assert only.token_ids == [1, 2] and only.finish_reason == "stop" and only.num_output_tokens == 2

    async def failing() -> list[Delta]:
        s = ResultStream(_NoEngine(), asyncio.get_running_loop(), 1)  # type: ignore[arg-type]
        s._deliver([_delta(0, 1, 1), _delta(0, 2, 2, "error", error="rank died")])
        return [d async for d in s]

    a, b = asyncio.run(failing())
    assert a.token_ids == [1] and a.finish_reason is None and b.error == "rank died"


def test_reader_waits_for_late_deltas() -> None:
    async def main() -> list[Delta]:
        loop = asyncio.get_running_loop()
        s = ResultStream(_NoEngine(), loop, 1)  # type: ignore[arg-type]
        loop.call_later(0.01, s._deliver, [_delta(0, 1, 1)])
        loop.call_later(0.02, s._deliver, [_delta(0, 2, 2, "length")])
        return [d async for d in s]

    out = asyncio.run(main())
    assert [d.token_ids for d in out] == [[1], [2]]
