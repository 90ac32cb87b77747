"""What the API process's shortcuts must keep as they were: SSE chunks byte for byte, token-id prompt errors word for
word, the event stream's disconnect / cancellation / error handling without Starlette's task group, and the routes
in ``/openapi.json``. No model: a stub engine."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from tests.serve_helpers import client, run
from trtllm_glm.runtime.tokenizer import ByteTokenizer
from trtllm_glm.serve.app import _JSON, _chunk, _chunk_prefix, _EventStream, _Job, _Server, _sse, build_app
from trtllm_glm.serve.metrics import ServeMetrics

pytestmark = pytest.mark.cpu_only

VOCAB = 1000


class _StubEngine:
    """What the app reads of an engine before it submits (a request refused earlier never reaches ``submit``)."""

    def __init__(self) -> None:
        self.tokenizer = ByteTokenizer(VOCAB, 256, 257, 258)
        self.vocab_size, self.max_seq_len, self.capacity = VOCAB, 512, 8
        self.metrics = ServeMetrics()

    def fatal_error(self) -> None:
        return None

    async def submit(self, gens: list[Any], arrival: float | None = None) -> Any:
        raise AssertionError("a refused request must not be submitted")


@pytest.mark.parametrize(
    ("head", "choices", "extra"),
    [
        ({"id": "cmpl-1", "object": "text_completion", "created": 5, "model": "m"},
         [{"index": 0, "text": "h\u00e9\"\n\u2028", "logprobs": None, "finish_reason": None}], {}),
        ({"id": "c", "object": "chat.completion.chunk", "created": 5, "model": "\u00fc"},
         [{"index": 1, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}],
         {"usage": None}),
        ({"id": "c", "object": "text_completion", "created": 5, "model": "m"}, [],
         {"usage": {"prompt_tokens": 3, "completion_tokens": 7, "total_tokens": 10}}),
        ({"id": "c", "object": "text_completion", "created": 5, "model": "m"},
         [{"index": 0, "text": "", "finish_reason": "length", "token_ids": [1, 2],
           "logprobs": {"tokens": ["a"], "token_logprobs": [-0.25], "top_logprobs": [{"a": -1e-5}],
                        "text_offset": [0]}}],
         {"usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}}),
    ],
)  # fmt: skip
def test_chunk_is_the_whole_dict_serialised(head: dict, choices: list, extra: dict) -> None:
    tail = "".join(f",{json.dumps(k)}:{_JSON.encode(v)}" for k, v in extra.items())
    got = _chunk(_chunk_prefix(head), ",".join(_JSON.encode(c) for c in choices), tail)
    whole = {**head, "choices": choices, **extra}
    assert got == _sse(whole) == f"data: {json.dumps(whole, ensure_ascii=False, separators=(',', ':'))}\n\n"


def test_usage_tail_is_the_usage_serialised() -> None:
    job = _Job([], [30, 2], True, True, True, None)
    assert _Server.usage_tail(job, 7) == ',"usage":' + _JSON.encode(_Server.usage(job, 7))


# Today's answers to token-id prompts that are not one (status, message).
BAD_PROMPTS = [
    ([1, 2, VOCAB], f"prompt: token id {VOCAB} is outside the vocabulary [0, {VOCAB})"),
    ([1, -1], f"prompt: token id -1 is outside the vocabulary [0, {VOCAB})"),
    ([[1, 2], [3, VOCAB + 5]], f"prompt.1: token id {VOCAB + 5} is outside the vocabulary [0, {VOCAB})"),
    ([[1], []], "prompt.1: the prompt is empty"),
    ([True, 1], "prompt must be a string, a list of strings, a list of token ids or a list of token-id lists"),
    ([[1], [False]], "prompt must be a string, a list of strings, a list of token ids or a list of token-id lists"),
    ([1.0, 2], "prompt must be a string, a list of strings, a list of token ids or a list of token-id lists"),
    ([], "prompt: must not be empty"),
]


def test_token_id_prompt_errors_are_unchanged() -> None:
    app = build_app(_StubEngine(), served_model_name="m", manage_engine=False)  # type: ignore[arg-type]

    async def main() -> list[Any]:
        async with client(app) as c:
            return [await c.post("/v1/completions", json={"prompt": p, "max_tokens": 2}) for p, _ in BAD_PROMPTS]

    for (prompt, message), r in zip(BAD_PROMPTS, run(main())):
        assert r.status_code == 400, (prompt, r.text)
        assert r.json()["error"]["message"] == message, prompt


def test_generation_routes_stay_in_the_openapi_schema() -> None:
    paths = build_app(_StubEngine(), served_model_name="m", manage_engine=False).openapi()["paths"]  # type: ignore[arg-type]
    assert list(paths) == ["/health", "/health_generate", "/version", "/v1/models", "/metrics", "/v1/completions",
                           "/v1/chat/completions"]  # fmt: skip
    assert set(paths["/v1/completions"]) == {"post"} and set(paths["/v1/chat/completions"]) == {"post"}


# ------------------------------------------------------------------------------------------------
# The event stream (ASGI spec 2.3, as uvicorn speaks it)
class _Body:
    """An endless body (one event per ``step`` seconds) recording how it ended."""

    def __init__(self, fail_at: int | None = None, step: float = 0.001) -> None:
        self.fail_at, self.step = fail_at, step
        self.closed = False

    async def events(self) -> Any:
        try:
            i = 0
            while True:
                if i == self.fail_at:
                    raise RuntimeError("boom")
                yield f"data: {i}\n\n"
                i += 1
                await asyncio.sleep(self.step)
        finally:
            self.closed = True


def _serve(body: _Body, disconnect_after: int | None) -> tuple[Any, list[bytes], list[int]]:
    """An `_EventStream` of ``body``'s events; its ``(__call__ coroutine, body chunks sent, on_close calls)``. The
    client disconnects once it has ``disconnect_after`` chunks (``None``: never)."""
    sent: list[bytes] = []
    closes: list[int] = []
    got = asyncio.Event()

    async def receive() -> dict[str, Any]:
        while disconnect_after is None or len(sent) < disconnect_after:
            got.clear()
            await got.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.body" and message.get("body"):
            sent.append(message["body"])
            got.set()

    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}}
    response = _EventStream(body.events(), lambda: closes.append(1))
    return response(scope, receive, send), sent, closes


def test_event_stream_ends_on_disconnect() -> None:
    body = _Body()
    call, sent, closes = _serve(body, disconnect_after=3)
    run(call, timeout=10)  # returns normally, as Starlette's task group does
    assert len(sent) >= 3 and body.closed and closes == [1]


def test_event_stream_raises_the_body_error() -> None:
    body = _Body(fail_at=2)
    call, sent, closes = _serve(body, disconnect_after=None)
    with pytest.raises(RuntimeError, match="boom"):
        run(call, timeout=10)
    assert len(sent) == 2 and body.closed and closes == [1]


def test_event_stream_cancelled_from_outside_stops_the_body() -> None:
    body = _Body()
    call, sent, closes = _serve(body, disconnect_after=None)

    async def main() -> None:
        task = asyncio.ensure_future(call)
        while len(sent) < 2:
            await asyncio.sleep(0.001)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert body.closed  # the body's own cleanup ran before the cancellation arrived

    run(main(), timeout=10)
    assert closes == [1]


def test_event_stream_ends_whole_before_a_later_disconnect() -> None:
    async def three() -> Any:
        for i in range(3):
            yield f"data: {i}\n\n"

    sent: list[dict[str, Any]] = []
    closes: list[int] = []

    async def receive() -> dict[str, Any]:
        await asyncio.sleep(3600)
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}}
    run(_EventStream(three(), lambda: closes.append(1))(scope, receive, send), timeout=10)
    assert [m["type"] for m in sent] == ["http.response.start"] + ["http.response.body"] * 4
    assert sent[-1] == {"type": "http.response.body", "body": b"", "more_body": False} and closes == [1]
