"""Tool calling in GLM's format (issue 45): the parser on whole and streamed text (a block split at every point),
and the chat route end to end over a scripted engine: ``tools`` reach the template, calls come back as OpenAI
``tool_calls`` (streamed and not) with ``finish_reason: "tool_calls"``, assistant calls and ``tool`` answers are
rendered back, ``tool_choice`` is checked."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import pytest

from tests.serve_helpers import client, run, sse
from trtllm_glm.serve.app import build_app
from trtllm_glm.serve.engine import Delta
from trtllm_glm.serve.metrics import ServeMetrics
from trtllm_glm.serve.tool_calls import ToolCallParser, check_tools, parse_tool_calls

pytestmark = pytest.mark.cpu_only

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "weather in a city", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                         "units": {"type": "object"}}, "required": ["city"]}}},
    {"type": "function", "function": {"name": "now"}},
]  # fmt: skip
SCHEMAS = check_tools(TOOLS)

ANSWER = (
    "Let me check.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>São Paulo</arg_value>\n"
    '<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n<arg_key>units</arg_key>\n<arg_value>{"t": "C"}'
    "</arg_value>\n</tool_call>\n<tool_call>now</tool_call>"
)
WANT_CALLS = [("get_weather", {"city": "São Paulo", "days": 3, "units": {"t": "C"}}), ("now", {})]


def test_parser_whole_and_every_split() -> None:
    content, calls = parse_tool_calls(ANSWER, SCHEMAS)
    assert content == "Let me check.\n"
    assert [(c.name, json.loads(c.arguments)) for c in calls] == WANT_CALLS
    for i in range(len(ANSWER) + 1):
        p = ToolCallParser(SCHEMAS)
        c1, k1 = p.feed(ANSWER[:i])
        c2, k2 = p.feed(ANSWER[i:])
        assert c1 + c2 + p.finish() == content, i
        assert [(c.name, json.loads(c.arguments)) for c in k1 + k2] == WANT_CALLS, i
    # An unknown function or an unclosed block stays text; a value that is no JSON stays a string.
    assert parse_tool_calls("a <tool_call>rm -rf</tool_call>", SCHEMAS) == ("a <tool_call>rm -rf</tool_call>", [])
    assert parse_tool_calls("<tool_call>now<arg_key>x", SCHEMAS) == ("<tool_call>now<arg_key>x", [])
    _, (c,) = parse_tool_calls(
        "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Oslo</arg_value><arg_key>days</arg_key>"
        "<arg_value>soon</arg_value></tool_call>", SCHEMAS)  # fmt: skip
    assert json.loads(c.arguments) == {"city": "Oslo", "days": "soon"}


@pytest.mark.parametrize(
    ("tools", "match"),
    [([], "non-empty"), ([{"type": "function"}], "tools.0"), ([{"type": "function", "function": {"name": "a b"}}],
     "name"), (TOOLS + TOOLS[:1], "twice")],
)  # fmt: skip
def test_tools_are_checked(tools: Any, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        check_tools(tools)


class _Tok:
    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        return [ord(c) % 250 for c in text]

    def decode(self, ids: list[int], **kw: Any) -> str:
        return ""


class _Stream:
    def __init__(self, text: str, n: int) -> None:
        self.n, self.request_ids, self.requests = n, list(range(n)), []
        self._deltas = [Delta(index=i, text=text[j : j + 7], token_ids=[1], num_output_tokens=j + 1)
                        for i in range(n) for j in range(0, len(text), 7)]  # fmt: skip
        self._deltas += [Delta(index=i, finish_reason="stop", num_output_tokens=len(text)) for i in range(n)]

    def abort(self) -> None:
        pass

    def __aiter__(self):
        return self._gen()

    async def _gen(self):
        for d in self._deltas:
            await asyncio.sleep(0)
            yield d


class _Engine:
    """The engine surface the app uses, answering every request with a scripted text."""

    def __init__(self, text: str) -> None:
        self.text, self.prompts, self.arrivals = text, [], []
        self.capacity, self.max_seq_len, self.vocab_size = 8, 100_000, 256
        self.metrics, self.tokenizer, self.llm, self.running = ServeMetrics(), _Tok(), object(), True

    def fatal_error(self) -> None:
        return None

    async def submit(self, gens: list, arrival: float | None = None) -> _Stream:
        self.prompts.append(gens[0].prompt_ids)
        self.arrivals.append((arrival, time.perf_counter()))
        return _Stream(self.text, len(gens))


def _post(app, body: dict):
    async def main():
        async with client(app) as c:
            return await c.post("/v1/chat/completions", json=body)

    return run(main())


def test_submit_carries_when_the_request_entered_the_app() -> None:
    """The server's TTFT account starts when the request entered the app (body parsing, validation and templating
    included), not when it reached the engine: ``submit`` gets that ``perf_counter`` time."""
    eng = _Engine(ANSWER)
    app = build_app(eng, served_model_name="m", manage_engine=False)  # type: ignore[arg-type]
    t0 = time.perf_counter()
    assert _post(app, {"messages": [{"role": "user", "content": "weather?"}], "tools": TOOLS}).status_code == 200
    ((arrival, at_submit),) = eng.arrivals
    assert arrival is not None and t0 <= arrival < at_submit <= time.perf_counter()


def test_chat_returns_tool_calls_streamed_and_not() -> None:
    eng = _Engine(ANSWER)
    app = build_app(eng, served_model_name="m", manage_engine=False)  # type: ignore[arg-type]
    body = {"messages": [{"role": "user", "content": "weather?"}], "tools": TOOLS}
    r = _post(app, body)
    assert r.status_code == 200, r.text
    ch = r.json()["choices"][0]
    assert ch["finish_reason"] == "tool_calls" and ch["message"]["content"] == "Let me check.\n"
    calls = ch["message"]["tool_calls"]
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == WANT_CALLS
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in calls)
    # The tools reached the prompt (the preset template: a system message in front).
    assert bytes(eng.prompts[-1]).decode("latin-1").count("get_weather") >= 1
    # Streamed: each call whole in its own delta, indexed; the same content.
    s = _post(app, {**body, "stream": True})
    chunks = [e["choices"][0] for e in sse(s.text) if e != "[DONE]" and e["choices"]]
    got = [tc for c in chunks for tc in c["delta"].get("tool_calls", [])]
    assert [(t["index"], t["function"]["name"]) for t in got] == [(0, "get_weather"), (1, "now")]
    assert "".join(c["delta"].get("content", "") for c in chunks) == "Let me check.\n"
    assert chunks[-1]["finish_reason"] == "tool_calls"
    # parallel_tool_calls false: the first call only; tool_choice none: all text.
    one = _post(app, {**body, "parallel_tool_calls": False}).json()["choices"][0]["message"]["tool_calls"]
    assert [c["function"]["name"] for c in one] == ["get_weather"]
    none = _post(app, {**body, "tool_choice": "none"}).json()["choices"][0]
    assert none["message"]["content"] == ANSWER and "tool_calls" not in none["message"]


def test_tool_messages_round_trip_and_tool_choice_checks() -> None:
    eng = _Engine("It is sunny.")
    app = build_app(eng, served_model_name="m", manage_engine=False)  # type: ignore[arg-type]
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
    msgs = [{"role": "user", "content": "weather?"}, {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 20C"}]  # fmt: skip
    r = _post(app, {"messages": msgs, "tools": TOOLS})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "It is sunny.", r.text
    assert r.json()["choices"][0]["finish_reason"] == "stop"
    prompt = "".join(chr(c) for c in eng.prompts[-1])
    assert "<arg_value>Oslo</arg_value>" in prompt and "sunny, 20C" in prompt
    # required / a named function are enforced by a grammar (tests/integration/serve/test_structured_output.py);
    # this scripted engine has no vocabulary to compile one against, and says so. Bad choices are refused by name.
    for choice, status, says in (
        ("required", 400, "not available"), ({"type": "function", "function": {"name": "now"}}, 400, "not available"),
        ({"type": "function", "function": {"name": "nope"}}, 400, "'nope', which is not in tools"),
        ({"type": "function", "name": "now"}, 400, "tool_choice must be"), ("sometimes", 400, "tool_choice must be"),
        ("auto", 200, ""),
    ):  # fmt: skip
        r = _post(app, {"messages": msgs[:1], "tools": TOOLS, "tool_choice": choice})
        assert r.status_code == status, r.text
        if status == 400:
            assert r.json()["error"]["param"] == "tool_choice" and says in r.json()["error"]["message"], r.text
    r = _post(app, {"messages": msgs[:1], "tools": TOOLS, "tool_choice": "required",
                    "response_format": {"type": "json_object"}})  # fmt: skip
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format", r.text
    bad = _post(app, {"messages": [{"role": "user", "content": "x", "tool_calls": [call]}]})
    assert bad.status_code == 400 and "assistant" in bad.json()["error"]["message"]


# Adversarial answer for the reasoning + tool-call parsers together: a call and a partial closing tag inside the
# thinking (reasoning text, never parsed), a look-alike tag, a closing-tag look-alike and non-ASCII inside an
# argument, an unknown function and an unclosed block (both text), the thinking closed by the first full tag.
ADVERSARIAL = (
    "<think>I could call <tool_call>now</tool_call> or write </thi, <think> again</think>\n\nSure: <tool_callx> is "
    "text; <tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Zürich </tool_call? 🌧</arg_value>\n"
    "</tool_call> then <tool_call>now</tool_call><tool_call>rm</tool_call> and <tool_call>now<arg_key>"
)


class _ChunkedEngine(_Engine):
    """`_Engine` streaming its text in chunks of ``size`` characters."""

    def __init__(self, text: str, size: int) -> None:
        super().__init__(text)
        self.size = size

    async def submit(self, gens: list, arrival: float | None = None) -> _Stream:
        s = _Stream(self.text, len(gens))
        t, k = self.text, self.size
        s._deltas = [Delta(index=0, text=t[j : j + k], token_ids=[1], num_output_tokens=j + 1)
                     for j in range(0, len(t), k)]  # fmt: skip
        s._deltas.append(Delta(index=0, finish_reason="stop", num_output_tokens=len(t)))
        return s


def test_reasoning_and_tool_parsers_on_adversarial_chunks() -> None:
    """Streamed in chunks of every size from 1 to 12 characters (each tag split at every point somewhere), the
    deltas add up to the whole answer's parse: the same reasoning, content and calls."""
    body = {"messages": [{"role": "user", "content": "weather?"}], "tools": TOOLS}
    whole = _post(build_app(_ChunkedEngine(ADVERSARIAL, 10**6), served_model_name="m", manage_engine=False,
                            reasoning_parser="glm45"), body).json()["choices"][0]  # fmt: skip
    msg = whole["message"]
    assert msg["reasoning_content"] == "I could call <tool_call>now</tool_call> or write </thi, <think> again"
    calls = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in msg["tool_calls"]]
    assert calls == [("get_weather", {"city": "Zürich </tool_call? 🌧"}), ("now", {})], calls
    assert msg["content"].startswith("Sure: <tool_callx> is text; ") and "<tool_call>rm</tool_call>" in msg["content"]
    assert msg["content"].endswith("<tool_call>now<arg_key>") and whole["finish_reason"] == "tool_calls"
    for size in range(1, 13):
        app = build_app(_ChunkedEngine(ADVERSARIAL, size), served_model_name="m", manage_engine=False,
                        reasoning_parser="glm45")  # fmt: skip
        chunks = [e["choices"][0] for e in sse(_post(app, {**body, "stream": True}).text) if e != "[DONE]"]
        deltas = [c["delta"] for c in chunks]
        got = [(t["function"]["name"], json.loads(t["function"]["arguments"])) for d in deltas
               for t in d.get("tool_calls", [])]  # fmt: skip
        assert "".join(d.get("reasoning_content", "") for d in deltas) == msg["reasoning_content"], size
        assert "".join(d.get("content", "") for d in deltas) == msg["content"], size
        assert got == calls and chunks[-1]["finish_reason"] == "tool_calls", size
