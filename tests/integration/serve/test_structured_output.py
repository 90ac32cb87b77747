"""Structured output through the real server (issue 45): ``trtllm-glm serve small`` (uvicorn in-process) driven by
the official ``openai`` client, plain and with MTP and n-gram speculation. ``response_format`` json_schema output
parses and validates for several schemas (nested objects, enums, arrays, required fields) with identical greedy
output under speculation; json_object on chat and completions; a named function and ``required`` in
``tool_choice`` return ``tool_calls`` whose arguments validate, streamed and not; invalid schemas are 400s that
name the problem; a grammar the model cannot finish ends with ``finish_reason: "length"``."""

from __future__ import annotations

import json
import socket
import threading
import time
from typing import Any

import openai
import pytest
import uvicorn

from trtllm_glm import LLM, MTPDecodingConfig, NGramDecodingConfig
from trtllm_glm.runtime.grammar import GrammarCompiler
from trtllm_glm.serve.app import build_app
from trtllm_glm.serve.chat import ChatTemplate
from trtllm_glm.serve.engine import AsyncEngine

pytestmark = pytest.mark.cpu_only

HOST = "127.0.0.1"
MODEL = "small"
USER = [{"role": "user", "content": "Describe a person as JSON."}]

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "address": {"type": "object", "properties": {"zip": {"type": "integer", "minimum": 0, "maximum": 99999},
                    "country": {"enum": ["NO", "SE", "DK"]}}, "required": ["zip", "country"],
                    "additionalProperties": False},
    },
    "required": ["name", "age", "role", "address"],
    "additionalProperties": False,
}  # fmt: skip
INVENTORY = {
    "type": "object",
    "properties": {
        "items": {"type": "array", "minItems": 1, "maxItems": 3, "items": {"type": "object", "properties": {
            "sku": {"type": "string", "maxLength": 4}, "qty": {"type": "integer", "minimum": 1, "maximum": 9}},
            "required": ["sku", "qty"], "additionalProperties": False}},
        "open": {"type": "boolean"},
    },
    "required": ["items", "open"],
    "additionalProperties": False,
}  # fmt: skip
ENUMS = {"type": "array", "minItems": 2, "maxItems": 4, "items": {"enum": ["red", "green", "blue", 7, None]}}
SCHEMAS = {"person": PERSON, "inventory": INVENTORY, "enums": ENUMS}

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "weather in a city", "parameters": {
        "type": "object", "properties": {
            "city": {"enum": ["Oslo", "Paris", "Lima"]}, "days": {"type": "integer", "minimum": 1, "maximum": 14},
            "units": {"type": "object", "properties": {"temp": {"enum": ["C", "F"]}}, "required": ["temp"],
                      "additionalProperties": False},
            "code": {"type": "string", "pattern": "^[A-Z]{3}$"}},
        "required": ["city", "days", "code"]}}},
    {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}}}},
]  # fmt: skip


def valid(v: Any, s: dict) -> bool:
    """The JSON-schema keywords these tests use (type, properties, required, additionalProperties, enum, items,
    minItems / maxItems, minimum / maximum, maxLength, pattern)."""
    import re

    if "enum" in s and not any(v == e and type(v) is type(e) for e in s["enum"]):
        return False
    t = s.get("type")
    if t == "object":
        props = s.get("properties", {})
        return (isinstance(v, dict) and all(k in v for k in s.get("required", ()))
                and (s.get("additionalProperties", True) is not False or set(v) <= set(props))
                and all(valid(x, props[k]) for k, x in v.items() if k in props))  # fmt: skip
    if t == "array":
        return (isinstance(v, list) and s.get("minItems", 0) <= len(v) <= s.get("maxItems", 1 << 30)
                and all(valid(x, s["items"]) for x in v))  # fmt: skip
    if t == "string":
        return (isinstance(v, str) and len(v) <= s.get("maxLength", 1 << 30)
                and (re.fullmatch(s["pattern"].strip("^$"), v) is not None if "pattern" in s else True))  # fmt: skip
    if t == "integer":
        return isinstance(v, int) and not isinstance(v, bool) and s.get("minimum", -(1 << 62)) <= v <= s.get(
            "maximum", 1 << 62)  # fmt: skip
    if t == "boolean":
        return isinstance(v, bool)
    return True


# A GLM-style template that thinks: the generation prompt opens the thinking unless enable_thinking is false.
THINKING_TEMPLATE = (
    "{% for m in messages %}<|{{ m.role }}|>\n{{ m.content }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% if enable_thinking is defined and not enable_thinking %}"
    "<think></think>{% else %}<think>{% endif %}{% endif %}"
)


def _serve(llm: LLM | AsyncEngine, **app_kw: Any) -> tuple[uvicorn.Server, threading.Thread, str]:
    """A live server of ``llm`` (or a second app over an engine already served: ``app_kw`` then gives its chat
    template and reasoning parser)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        port = s.getsockname()[1]
    engine = llm if isinstance(llm, AsyncEngine) else AsyncEngine(llm, max_queue_size=4)
    app = build_app(engine, served_model_name=MODEL, drain_timeout=5.0, manage_engine=engine is not llm, **app_kw)
    srv = uvicorn.Server(uvicorn.Config(app, host=HOST, port=port, log_level="warning", lifespan="on",
                                        timeout_graceful_shutdown=5))  # fmt: skip
    th = threading.Thread(target=srv.run, name="uvicorn-structured", daemon=True)
    th.start()
    deadline = time.monotonic() + 30.0
    while not srv.started:
        assert th.is_alive() and time.monotonic() < deadline, "server did not start"
        time.sleep(0.02)
    return srv, th, f"http://{HOST}:{port}/v1"


@pytest.fixture(scope="module")
def clients() -> Any:
    """Three live servers of the small preset (plain, MTP, n-gram) and an OpenAI client of each; ``<name>-think``:
    a second app over the same engine whose chat template thinks (reasoning parser glm45)."""
    kw: dict[str, Any] = dict(device="cpu", max_batch_size=4, max_seq_len=1536)
    specs = {"plain": None, "mtp": MTPDecodingConfig(num_nextn_predict_layers=3), "ngram": NGramDecodingConfig()}
    running, out = [], {}

    def connect(name: str, base: str) -> None:
        out[name] = openai.OpenAI(base_url=base, api_key="unused", max_retries=0, timeout=120.0,
                                  http_client=openai.DefaultHttpxClient(trust_env=False))  # fmt: skip

    try:
        for name, spec in specs.items():
            srv, th, base = _serve(LLM(MODEL, speculative_config=spec, **kw))
            running.append((srv, th))
            connect(name, base)
            srv2, th2, base2 = _serve(srv.config.app.state.engine, chat_template=ChatTemplate(jinja=THINKING_TEMPLATE),
                                      reasoning_parser="glm45")  # fmt: skip
            running.insert(0, (srv2, th2))  # stopped before the app that owns the engine
            connect(f"{name}-think", base2)
        yield out
    finally:
        for c in out.values():
            c.close()
        for srv, th in running:
            srv.should_exit = True
            th.join(timeout=30.0)


def _plain(clients: dict) -> dict:
    return {k: c for k, c in clients.items() if not k.endswith("-think")}


def _nested(depth: int) -> dict:
    s: dict = {"type": "integer"}
    for _ in range(depth):
        s = {"type": "object", "properties": {"a": s}, "required": ["a"]}
    return s


def _schema_format(name: str) -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": SCHEMAS[name], "strict": True}}


def test_json_schema_output_validates_and_is_identical_with_speculation(clients) -> None:
    for name, schema in SCHEMAS.items():
        texts = {}
        for kind, c in _plain(clients).items():
            r = c.chat.completions.create(model=MODEL, messages=USER, max_tokens=150, temperature=0,
                                          response_format=_schema_format(name))  # fmt: skip
            ch = r.choices[0]
            assert ch.finish_reason == "stop", (kind, name, ch.message.content)
            assert valid(json.loads(ch.message.content), schema), (kind, name, ch.message.content)
            texts[kind] = ch.message.content
        assert texts["mtp"] == texts["plain"] and texts["ngram"] == texts["plain"], (name, texts)
    # Streamed: the same text in pieces.
    chunks = list(clients["ngram"].chat.completions.create(
        model=MODEL, messages=USER, max_tokens=150, temperature=0, response_format=_schema_format("person"),
        stream=True))  # fmt: skip
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert valid(json.loads(streamed), PERSON) and chunks[-1].choices[0].finish_reason == "stop"


def test_json_object_on_chat_and_completions(clients) -> None:
    c = clients["plain"]
    r = c.chat.completions.create(model=MODEL, messages=USER, max_tokens=120, temperature=0,
                                  response_format={"type": "json_object"})  # fmt: skip
    # A JSON object or, where the model runs out of tokens, the start of one (length).
    text = r.choices[0].message.content
    assert text.startswith("{") and (r.choices[0].finish_reason == "length" or isinstance(json.loads(text), dict))
    r = c.completions.create(model=MODEL, prompt='{"', max_tokens=40, temperature=0,
                             extra_body={"response_format": _schema_format("enums")})  # fmt: skip
    assert r.choices[0].finish_reason == "stop" and valid(json.loads(r.choices[0].text), ENUMS)


def _args(call: Any) -> tuple[str, dict]:
    return call.function.name, json.loads(call.function.arguments)


def test_named_and_required_tool_choice_return_valid_calls(clients) -> None:
    c = clients["plain"]
    params = TOOLS[0]["function"]["parameters"]
    named = {"type": "function", "function": {"name": "get_weather"}}
    msgs = [{"role": "user", "content": "Weather in Oslo for 3 days?"}]
    r = c.chat.completions.create(model=MODEL, messages=msgs, tools=TOOLS, tool_choice=named, max_tokens=400,
                                  temperature=0)  # fmt: skip
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls" and len(ch.message.tool_calls) == 1, ch
    name, args = _args(ch.message.tool_calls[0])
    assert name == "get_weather" and valid(args, params), args
    # Streamed, under n-gram speculation: the same call (greedy), whole in one delta.
    chunks = list(clients["ngram"].chat.completions.create(model=MODEL, messages=msgs, tools=TOOLS, tool_choice=named,
                                            max_tokens=400, temperature=0, stream=True))  # fmt: skip
    calls = [tc for k in chunks if k.choices for tc in (k.choices[0].delta.tool_calls or [])]
    assert [(tc.function.name, json.loads(tc.function.arguments)) for tc in calls] == [(name, args)]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    # The other function named: a call of it (no arguments), whatever the model prefers.
    r = c.chat.completions.create(model=MODEL, messages=msgs, tools=TOOLS, max_tokens=60, temperature=0,
                                  tool_choice={"type": "function", "function": {"name": "now"}})  # fmt: skip
    assert [_args(t) for t in r.choices[0].message.tool_calls] == [("now", {})]
    # required (under MTP): one call (parallel_tool_calls false) of one of the tools, valid.
    r = clients["mtp"].chat.completions.create(model=MODEL, messages=msgs, tools=TOOLS, tool_choice="required",
                                               max_tokens=400, temperature=0, parallel_tool_calls=False)  # fmt: skip
    (call,) = r.choices[0].message.tool_calls
    name, args = _args(call)
    assert name in ("get_weather", "now") and valid(args, TOOLS[name == "now"]["function"]["parameters"])


def test_invalid_schemas_are_400s_naming_the_problem(clients) -> None:
    c = clients["plain"]
    bad = [
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}}, "objectx"),
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "string", "pattern": "[a-"}}},
         "regex"),
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/defs/a"}}}, "'/defs/a' does not"),
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "integer", "minimum": 5,
                                                                         "maximum": 1}}}, "Unsatisfiable"),
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": False}}, "matches no output"),
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": _nested(400)}}, "recursion limit"),
        ({"type": "json_schema", "json_schema": {"schema": {"type": "object"}}}, "json_schema.name"),
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}}, "json_schema.schema"),
        ({"type": "json_schema"}, "json_schema is required"),
        ({"type": "regex", "regex": "a+"}, "response_format.type"),
        ({"type": "json_object", "schema": {}}, "unsupported key"),
    ]  # fmt: skip
    for fmt, says in bad:
        with pytest.raises(openai.BadRequestError) as e:
            c.chat.completions.create(model=MODEL, messages=USER, max_tokens=4, response_format=fmt)
        assert says in e.value.message and e.value.body["param"].startswith("response_format"), (fmt, e.value.body)
    with pytest.raises(openai.BadRequestError, match="not in tools"):
        c.chat.completions.create(model=MODEL, messages=USER, max_tokens=4, tools=TOOLS,
                                  tool_choice={"type": "function", "function": {"name": "rm"}})  # fmt: skip


def test_a_grammar_the_model_cannot_finish_ends_with_length(clients) -> None:
    free = {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}
    r = clients["mtp"].chat.completions.create(
        model=MODEL, messages=USER, max_tokens=16, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "free", "schema": free}},
    )  # fmt: skip
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 16
    assert r.choices[0].message.content.startswith('{"text": "')


@pytest.fixture
def think_cap(monkeypatch: pytest.MonkeyPatch) -> None:
    """The small preset's random weights never close their thinking on their own: each request's thinking is
    capped at 6 tokens (`GuidedDecodingParams.max_reasoning_tokens`), after which only ``</think>`` may follow."""
    made = GrammarCompiler.matcher

    def matcher(self, params, stop_ids):  # noqa: ANN001, ANN202
        if params.reasoning is not None:
            params = __import__("dataclasses").replace(params, max_reasoning_tokens=6)
        return made(self, params, stop_ids)

    monkeypatch.setattr(GrammarCompiler, "matcher", matcher)


def test_thinking_before_a_constrained_answer(clients, think_cap) -> None:
    """With a template that opens the thinking, the model thinks freely and the grammar applies after ``</think>``:
    the thinking arrives in ``reasoning_content``, the answer validates, identical with MTP and n-gram, streamed
    and not; with enable_thinking false the grammar applies from the first token (no reasoning)."""
    texts = {}
    for kind in ("plain", "mtp", "ngram"):
        r = clients[f"{kind}-think"].chat.completions.create(
            model=MODEL, messages=USER, max_tokens=200, temperature=0, response_format=_schema_format("person")
        )
        msg = r.choices[0].message
        reasoning = msg.model_extra.get("reasoning_content")
        assert r.choices[0].finish_reason == "stop" and reasoning, (kind, msg)
        assert not reasoning.startswith("{"), reasoning  # free text, not the grammar's first token
        assert valid(json.loads(msg.content), PERSON), (kind, msg.content)
        texts[kind] = (reasoning, msg.content)
    assert texts["mtp"] == texts["plain"] and texts["ngram"] == texts["plain"], texts
    chunks = list(clients["ngram-think"].chat.completions.create(
        model=MODEL, messages=USER, max_tokens=200, temperature=0, response_format=_schema_format("person"),
        stream=True))  # fmt: skip
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    streamed = ("".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas),
                "".join(d.content or "" for d in deltas))  # fmt: skip
    assert streamed == texts["plain"]
    # Thinking disabled by the template: constrained from the first token, no reasoning part.
    r = clients["plain-think"].chat.completions.create(
        model=MODEL, messages=USER, max_tokens=200, temperature=0, response_format=_schema_format("person"),
        extra_body={"chat_template_kwargs": {"enable_thinking": False}})  # fmt: skip
    msg = r.choices[0].message
    assert "reasoning_content" not in (msg.model_extra or {}) and valid(json.loads(msg.content), PERSON), msg
    # A named function after thinking: the call parses and validates.
    r = clients["mtp-think"].chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Weather in Oslo for 3 days?"}],
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=400,
        temperature=0,
    )
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls" and ch.message.model_extra.get("reasoning_content"), ch
    name, args = _args(ch.message.tool_calls[0])
    assert name == "get_weather" and valid(args, TOOLS[0]["function"]["parameters"]), args
