"""The OpenAI routes in-process (httpx ``ASGITransport``): shapes, streaming, sampling options, errors,
back-pressure, disconnects and metrics."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from tests.serve_helpers import MODEL, client, make_llm, metric, run, sse, wait_idle
from trtllm_glm import SamplingParams
from trtllm_glm.serve.app import build_app
from trtllm_glm.serve.chat import ChatTemplate
from trtllm_glm.serve.engine import AsyncEngine, GenerationRequest

pytestmark = pytest.mark.cpu_only


@pytest.fixture(scope="module")
def refs(llm) -> dict[str, Any]:
    """Greedy outputs of LLM.generate alone, computed before the engine takes the executor."""
    chat_ids = ChatTemplate().encode(llm.tokenizer, [{"role": "user", "content": "Hi there"}])
    return {
        "hello": llm.generate("Hello", SamplingParams(max_tokens=8)).outputs[0],
        "chat": llm.generate(chat_ids, SamplingParams(max_tokens=6)).outputs[0],
        "ids": llm.generate([1, 2, 3], SamplingParams(max_tokens=4)).outputs[0],
    }


@pytest.fixture(scope="module")
def app(refs, engine):  # noqa: D103 - overrides conftest's to order refs before the engine starts
    return build_app(engine, served_model_name=MODEL, manage_engine=False)


def post(app: Any, path: str, body: Any) -> Any:
    async def main():
        async with client(app) as c:
            if isinstance(body, (bytes, str)):
                return await c.post(path, content=body, headers={"content-type": "application/json"})
            return await c.post(path, json=body)

    return run(main())


def test_completion_matches_llm_generate_with_usage(app, refs) -> None:
    r = post(app, "/v1/completions", {"model": MODEL, "prompt": "Hello", "max_tokens": 8, "temperature": 0})
    assert r.status_code == 200
    body = r.json()
    assert body["object"] == "text_completion" and body["model"] == MODEL and body["id"].startswith("cmpl-")
    (ch,) = body["choices"]
    ref = refs["hello"]
    assert ch["text"] == ref.text and ch["finish_reason"] == ref.finish_reason and ch["logprobs"] is None
    assert body["usage"] == {"prompt_tokens": 6, "completion_tokens": len(ref.token_ids),
                             "total_tokens": 6 + len(ref.token_ids)}  # fmt: skip


def test_token_id_prompts_and_multiple_prompts(app, refs) -> None:
    hello_ids = [256, *b"Hello"]  # what the byte tokenizer makes of "Hello": BOS, then the bytes
    r = post(app, "/v1/completions", {"prompt": [[1, 2, 3], hello_ids], "max_tokens": 4, "temperature": 0})
    assert r.status_code == 200
    a, b = r.json()["choices"]
    assert (a["index"], b["index"]) == (0, 1)
    assert a["text"] == refs["ids"].text and b["text"] == refs["hello"].text[: len(b["text"])]
    assert r.json()["usage"]["prompt_tokens"] == 3 + 6


def test_streaming_completion_chunks_done_and_usage(app, refs) -> None:
    body = {"prompt": "Hello", "max_tokens": 8, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    r = post(app, "/v1/completions", body)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = sse(r.text)
    assert events[-1] == "[DONE]"
    usage = events[-2]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == len(refs["hello"].token_ids)
    chunks = events[:-2]
    assert all(c["usage"] is None and c["object"] == "text_completion" for c in chunks)
    assert "".join(c["choices"][0]["text"] for c in chunks) == refs["hello"].text
    assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == refs["hello"].finish_reason
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
    # continuous_usage_stats: a chunk per generated token (one per step here), each with the usage so far.
    body["stream_options"] = {"continuous_usage_stats": True}
    chunks = sse(post(app, "/v1/completions", body).text)[:-1]
    counts = [c["usage"]["completion_tokens"] for c in chunks]
    assert counts == list(range(1, len(refs["hello"].token_ids) + 1))
    assert "".join(c["choices"][0]["text"] for c in chunks) == refs["hello"].text


def test_chat_completion_and_stream(app, refs) -> None:
    msgs = [{"role": "user", "content": "Hi there"}]
    r = post(app, "/v1/chat/completions", {"model": MODEL, "messages": msgs, "max_tokens": 6, "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    (ch,) = body["choices"]
    assert ch["message"] == {"role": "assistant", "content": refs["chat"].text}
    assert ch["finish_reason"] == refs["chat"].finish_reason
    # Content parts give the same prompt; max_completion_tokens is the newer name of max_tokens.
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}]}]
    body = {"messages": parts, "max_completion_tokens": 6, "temperature": 0, "stream": True}
    events = sse(post(app, "/v1/chat/completions", body).text)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(c["object"] == "chat.completion.chunk" and "usage" not in c for c in chunks)
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert text == refs["chat"].text
    assert chunks[-1]["choices"][0]["finish_reason"] == refs["chat"].finish_reason


def test_n_choices_seeds_and_sampling(app) -> None:
    body = {"prompt": "Hello", "max_tokens": 6, "temperature": 1.0, "top_p": 0.9, "top_k": 50, "seed": 7, "n": 3}
    a = post(app, "/v1/completions", body).json()
    b = post(app, "/v1/completions", body).json()
    texts = [c["text"] for c in a["choices"]]
    assert [c["index"] for c in a["choices"]] == [0, 1, 2]
    assert texts == [c["text"] for c in b["choices"]]  # seeded: reproducible
    assert len(set(texts)) > 1  # each choice has its own seed
    assert a["usage"]["prompt_tokens"] == 6  # the prompt counts once whatever n is
    # Streaming n=2 chat: every choice gets its role chunk and a finish.
    body = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 3, "n": 2, "stream": True, "seed": 1}
    events = sse(post(app, "/v1/chat/completions", body).text)[:-1]
    finished = {c["choices"][0]["index"] for c in events if c["choices"][0]["finish_reason"]}
    roles = {c["choices"][0]["index"] for c in events if c["choices"][0]["delta"].get("role")}
    assert finished == roles == {0, 1}


def test_stop_strings_and_stop_token_ids(app, refs) -> None:
    ref = refs["hello"]
    stop = next(c for c in ref.text[1:] if c.isascii() and c.isprintable())
    cut = ref.text.index(stop, 1)
    for stream in (False, True):
        body = {"prompt": "Hello", "max_tokens": 8, "temperature": 0, "stop": [stop, "\x00never"], "stream": stream}
        r = post(app, "/v1/completions", body)
        if stream:
            chunks = sse(r.text)[:-1]
            text = "".join(c["choices"][0]["text"] for c in chunks)
            finish = chunks[-1]["choices"][0]["finish_reason"]
        else:
            text, finish = r.json()["choices"][0]["text"], r.json()["choices"][0]["finish_reason"]
        assert (text, finish) == (ref.text[:cut], "stop")
    # A stop token id ends the request after that token (the token is kept, as in the LLM API).
    tid = ref.token_ids[2]
    r = post(app, "/v1/completions", {"prompt": "Hello", "max_tokens": 8, "temperature": 0, "stop_token_ids": [tid]})
    ch = r.json()["choices"][0]
    first = ref.token_ids.index(tid)
    assert ch["finish_reason"] == "stop" and r.json()["usage"]["completion_tokens"] == first + 1


def test_logprobs_shapes(app, refs) -> None:
    r = post(app, "/v1/completions", {"prompt": "Hello", "max_tokens": 5, "temperature": 0, "logprobs": 2})
    lp = r.json()["choices"][0]["logprobs"]
    n = r.json()["usage"]["completion_tokens"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"]) == n
    assert all(x <= 0 for x in lp["token_logprobs"])
    assert all(1 <= len(t) <= 3 for t in lp["top_logprobs"])
    # Greedy: the chosen token is the most likely one.
    assert all(lp["token_logprobs"][i] == max(lp["top_logprobs"][i].values()) for i in range(n))
    assert lp["text_offset"] == sorted(lp["text_offset"])
    body = {"messages": [{"role": "user", "content": "Hi there"}], "max_tokens": 4, "temperature": 0,
            "logprobs": True, "top_logprobs": 3}  # fmt: skip
    content = post(app, "/v1/chat/completions", body).json()["choices"][0]["logprobs"]["content"]
    assert len(content) == 4
    for e in content:
        assert set(e) == {"token", "logprob", "bytes", "top_logprobs"} and isinstance(e["bytes"], list)
        tops = [t["logprob"] for t in e["top_logprobs"]]
        assert len(tops) == 3 and tops == sorted(tops, reverse=True) and e["logprob"] == tops[0]
    # Streaming carries the logprobs of each chunk's tokens.
    body["stream"] = True
    chunks = sse(post(app, "/v1/chat/completions", body).text)[1:-1]
    assert sum(len(c["choices"][0]["logprobs"]["content"]) for c in chunks if c["choices"][0]["logprobs"]) == 4


BIG = "x" * 300  # more tokens than max_seq_len (256)

MALFORMED: list[tuple[str, Any, int, str | None]] = [
    ("/v1/completions", b"{not json", 400, None),
    ("/v1/completions", b"", 400, None),
    ("/v1/completions", b"[1, 2]", 400, None),
    ("/v1/completions", {"max_tokens": 4}, 400, "prompt"),
    ("/v1/completions", {"prompt": 5}, 400, "prompt"),
    ("/v1/completions", {"prompt": []}, 400, "prompt"),
    ("/v1/completions", {"prompt": [1, "a"]}, 400, "prompt"),
    ("/v1/completions", {"prompt": [[1, 2], "a"]}, 400, "prompt"),
    ("/v1/completions", {"prompt": [1, 99999]}, 400, "prompt"),
    ("/v1/completions", {"prompt": "x", "max_tokens": "5"}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 10**6}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": BIG}, 400, "prompt"),
    ("/v1/completions", {"prompt": "x", "temperature": -1}, 400, "temperature"),
    ("/v1/completions", {"prompt": "x", "temperature": True}, 400, "temperature"),
    ("/v1/completions", {"prompt": "x", "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {"prompt": "x", "top_k": -2}, 400, "top_k"),
    ("/v1/completions", {"prompt": "x", "n": 0}, 400, "n"),
    ("/v1/completions", {"prompt": "x", "n": 100000}, 400, "n"),
    ("/v1/completions", {"prompt": "x", "n": 100}, 400, "n"),
    ("/v1/completions", {"prompt": "x", "logprobs": 21}, 400, "logprobs"),
    ("/v1/completions", {"prompt": "x", "stop": [""]}, 400, "stop"),
    ("/v1/completions", {"prompt": "x", "stop": 3}, 400, "stop"),
    ("/v1/completions", {"prompt": "x", "stop_token_ids": [100000]}, 400, "stop_token_ids"),
    ("/v1/completions", {"prompt": "x", "seed": 2**70}, 400, None),
    ("/v1/completions", {"prompt": "x", "stream": "yes"}, 400, "stream"),
    ("/v1/completions", {"prompt": "x", "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ("/v1/completions", {"prompt": "x", "echo": True}, 400, "echo"),
    ("/v1/completions", {"prompt": "x", "frequency_penalty": 0.5}, 400, "frequency_penalty"),
    ("/v1/completions", {"prompt": "x", "max_token": 5}, 400, "max_token"),
    ("/v1/completions", {"prompt": "x", "model": "gpt-4"}, 404, "model"),
    ("/v1/chat/completions", {"model": "nope", "messages": [{"role": "user", "content": "x"}]}, 404, "model"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": "hi"}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages.0.role"),
    ("/v1/chat/completions", {"messages": [{"content": "x"}]}, 400, "messages.0.role"),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
        400,
        "messages.0.content",
    ),  # fmt: skip
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": BIG}]}, 400, "messages"),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
        400,
        "top_logprobs",
    ),  # fmt: skip
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "logprobs": 1}, 400, "logprobs"),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]},
        400,
        "tools",
    ),  # fmt: skip
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2, "max_completion_tokens": 2},
        400,
        "max_tokens",
    ),  # fmt: skip
]


def test_malformed_requests_get_openai_errors_and_the_server_keeps_serving(app, refs) -> None:
    assert len(MALFORMED) >= 20
    before = metric(app, "trtllm:request_rejected_total", {"reason": "invalid"})

    async def main():
        async with client(app) as c:
            out = []
            for path, body, _, _ in MALFORMED:
                if isinstance(body, bytes):
                    out.append(await c.post(path, content=body, headers={"content-type": "application/json"}))
                else:
                    out.append(await c.post(path, json=body))
            out.append(await c.get("/v1/nope"))
            out.append(await c.get("/v1/completions"))
            return out

    responses = run(main())
    for (_, body, status, param), r in zip(MALFORMED, responses):
        assert r.status_code == status, (body, r.text)
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"], err
        assert err["type"] == "invalid_request_error"
        if param is not None:
            assert err["param"] == param, (body, err)
    assert responses[-2].status_code == 404 and responses[-1].status_code == 405
    assert responses[-1].json()["error"]["code"] == "method_not_allowed"
    assert metric(app, "trtllm:request_rejected_total", {"reason": "invalid"}) - before == len(MALFORMED)
    # Still serving, nothing leaked.
    r = post(app, "/v1/completions", {"prompt": "Hello", "max_tokens": 8, "temperature": 0})
    assert r.json()["choices"][0]["text"] == refs["hello"].text
    wait_idle(app.state.engine)


def test_health_version_models(app) -> None:
    async def main():
        async with client(app) as c:
            return [await c.get(p) for p in ("/health", "/health_generate", "/version", "/v1/models")]

    health, gen, version, models = run(main())
    assert health.status_code == 200 and gen.status_code == 200
    assert version.json() == {"version": __import__("trtllm_glm").__version__}
    (card,) = models.json()["data"]
    assert card["id"] == MODEL and card["object"] == "model" and card["max_model_len"] == 256


def test_overload_is_503_with_retry_after() -> None:
    llm = make_llm(max_batch_size=1)
    eng = AsyncEngine(llm, max_queue_size=1)
    app = build_app(eng, served_model_name=MODEL, manage_engine=False)
    eng.start()
    try:

        async def main():
            long = SamplingParams(max_tokens=400, ignore_eos=True)
            held = [await eng.submit([GenerationRequest([65], long)]) for _ in range(2)]
            async with client(app) as c:
                r = await c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
                health = await c.get("/health")
            for s in held:
                s.abort()
            return r, health

        r, health = run(main())
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        assert r.json()["error"]["code"] == "overloaded" and r.json()["error"]["type"] == "server_error"
        assert health.status_code == 200
        assert metric(eng, "trtllm:request_rejected_total", {"reason": "overloaded"}) == 1
        wait_idle(eng)
    finally:
        eng.stop(drain_timeout=0)
    r = post(app, "/v1/completions", {"prompt": "x", "max_tokens": 2})
    assert r.status_code == 503 and r.json()["error"]["code"] == "unavailable"

    async def health():
        async with client(app) as c:
            return await c.get("/health")

    assert run(health()).status_code == 503


def _scope(path: str) -> dict[str, Any]:
    return {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
        "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
        "headers": [(b"content-type", b"application/json")], "server": ("test", 80), "client": ("127.0.0.1", 5000),
    }  # fmt: skip


async def _call_and_leave(app: Any, path: str, body: dict, leave_after_chunk: bool) -> list[dict]:
    """Drive the ASGI app as a client that disconnects after the first SSE chunk (or after 0.2 s)."""
    sent: list[dict] = []
    gone = asyncio.Event()
    delivered = False

    async def receive() -> dict:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}
        if leave_after_chunk:
            await gone.wait()
        else:
            await asyncio.sleep(0.2)
        return {"type": "http.disconnect"}

    async def send(msg: dict) -> None:
        sent.append(msg)
        if msg["type"] == "http.response.body" and b"data:" in msg.get("body", b""):
            gone.set()

    await app(_scope(path), receive, send)
    return sent


@pytest.mark.parametrize("stream", [True, False])
def test_disconnect_aborts_and_frees_pages(app, stream) -> None:
    eng = app.state.engine
    aborted = metric(app, "trtllm:request_finished_total", {"finished_reason": "abort"})
    body = {"prompt": "Hello", "max_tokens": 200, "ignore_eos": True, "temperature": 0, "stream": stream}
    sent = run(_call_and_leave(app, "/v1/completions", body, leave_after_chunk=stream))
    chunks = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    assert b"[DONE]" not in chunks
    s = wait_idle(eng)
    assert s["pages_used"] == 0 and s["free_state_slots"] == eng.executor.cfg.max_batch_size
    assert metric(app, "trtllm:request_finished_total", {"finished_reason": "abort"}) == aborted + 1


def test_metrics_move_after_requests(app) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    names = ("trtllm:time_to_first_token_seconds_count", "trtllm:e2e_request_latency_seconds_count",
             "trtllm:inter_token_latency_seconds_count", "trtllm:generation_tokens_total",
             "trtllm:prompt_tokens_total", "trtllm:engine_steps_total")  # fmt: skip
    before = {n: metric(app, n) for n in names}
    length = metric(app, "trtllm:request_finished_total", {"finished_reason": "length"})
    stop = metric(app, "trtllm:request_finished_total", {"finished_reason": "stop"})

    async def main():
        async with client(app) as c:
            rs = await asyncio.gather(
                *(c.post("/v1/completions", json={"prompt": f"p{i}", "max_tokens": 5, "ignore_eos": True})
                  for i in range(3)),
                c.post("/v1/completions", json={"prompt": "q", "max_tokens": 5, "stop_token_ids": list(range(264))}),
            )  # fmt: skip
            return rs, await c.get("/metrics")

    rs, m = run(main())
    assert all(r.status_code == 200 for r in rs)
    gen = sum(r.json()["usage"]["completion_tokens"] for r in rs)
    assert metric(app, "trtllm:request_finished_total", {"finished_reason": "length"}) == length + 3
    assert metric(app, "trtllm:request_finished_total", {"finished_reason": "stop"}) == stop + 1
    after = {n: metric(app, n) for n in names}
    assert after["trtllm:time_to_first_token_seconds_count"] - before["trtllm:time_to_first_token_seconds_count"] == 4
    assert after["trtllm:e2e_request_latency_seconds_count"] - before["trtllm:e2e_request_latency_seconds_count"] == 4
    assert after["trtllm:inter_token_latency_seconds_count"] > before["trtllm:inter_token_latency_seconds_count"]
    assert after["trtllm:generation_tokens_total"] - before["trtllm:generation_tokens_total"] == gen == 16
    assert after["trtllm:prompt_tokens_total"] - before["trtllm:prompt_tokens_total"] == 3 * 3 + 2
    assert after["trtllm:engine_steps_total"] > before["trtllm:engine_steps_total"]
    # The exposition parses, and the gauges are back at idle.
    assert m.status_code == 200 and m.headers["content-type"].startswith("text/plain")
    fams = {f.name: f for f in text_string_to_metric_families(m.text)}
    for name in ("trtllm:num_requests_running", "trtllm:num_requests_waiting", "trtllm:kv_cache_pages_used",
                 "trtllm:spec_decode_num_drafts", "trtllm:num_preemptions"):  # fmt: skip
        assert name in fams, name
    assert metric(app, "trtllm:kv_cache_pages_used") == 0 and metric(app, "trtllm:num_requests_running") == 0
    assert metric(app, "trtllm:kv_cache_pages_total") == app.state.engine.executor.manager.num_pages


def test_failed_generation_is_500_or_an_error_event() -> None:
    llm = make_llm(max_batch_size=2)
    eng = AsyncEngine(llm)
    ex = eng.executor
    real_forward = ex._forward

    def forward(plan):
        if any(s.request.prompt_ids[1:] == list(b"POISON") for s in plan):
            raise RuntimeError("injected fault")
        return real_forward(plan)

    ex._forward = forward
    app = build_app(eng, served_model_name=MODEL, manage_engine=False)
    eng.start()
    try:
        r = post(app, "/v1/completions", {"prompt": "POISON", "max_tokens": 3})
        assert r.status_code == 500 and "injected fault" in r.json()["error"]["message"]
        events = sse(post(app, "/v1/completions", {"prompt": "POISON", "max_tokens": 3, "stream": True}).text)
        assert "injected fault" in events[-2]["error"]["message"] and events[-1] == "[DONE]"
        ok = post(app, "/v1/completions", {"prompt": "fine", "max_tokens": 3})
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3
        wait_idle(eng)
    finally:
        eng.stop(drain_timeout=0)


def test_prefix_cache_metrics_count_hits(app) -> None:
    """A repeated long prompt restores a checkpoint: queries, hits and reused tokens move on /metrics (the first
    repeat checkpoints where the prompts part, a branch point; the second restores it)."""
    names = ("trtllm:prefix_cache_queries_total", "trtllm:prefix_cache_hits_total",
             "trtllm:prefix_cache_reused_tokens_total")  # fmt: skip
    before = {n: metric(app, n) for n in names}
    prompt = "def f(x):\n    return x * 2\n" * 3  # 84 byte tokens: checkpoints at page boundaries

    async def main():
        async with client(app) as c:
            for tail in ("a", "b", "c"):
                r = await c.post("/v1/completions", json={"prompt": prompt + tail, "max_tokens": 2})
                assert r.status_code == 200

    run(main())
    after = {n: metric(app, n) for n in names}
    assert after["trtllm:prefix_cache_queries_total"] - before["trtllm:prefix_cache_queries_total"] == 3
    assert after["trtllm:prefix_cache_hits_total"] - before["trtllm:prefix_cache_hits_total"] == 1
    assert after["trtllm:prefix_cache_reused_tokens_total"] - before["trtllm:prefix_cache_reused_tokens_total"] >= 64
    assert app.state.engine.stats()["prefix_cache_hits"] >= 1


def test_one_sampling_rule_at_both_doors(app, refs) -> None:
    """The server refuses only what OpenAI's API refuses (temperature above 2, with a message naming the field and
    the Python API's wider range; NaN / infinity as not finite); what it accepts behaves as `SamplingParams` does:
    ``top_k: -1`` is off, and a temperature below 1e-5 is greedy (1e-300 used to divide the logits by an FP32 zero
    and return the vocabulary's last id)."""
    for body, says in (({"temperature": 2.5}, "at most 2"), ('"temperature": NaN', "finite"),
                       ('"temperature": Infinity', "finite"), ('"top_p": NaN', "finite")):  # fmt: skip
        if isinstance(body, str):
            body = '{"prompt": "Hello", "max_tokens": 2, ' + body + "}"
        else:
            body = {"prompt": "Hello", "max_tokens": 2, **body}
        r = post(app, "/v1/completions", body)
        err = r.json()["error"]
        assert r.status_code == 400 and says in err["message"], r.text
        assert err["param"] in ("temperature", "top_p") and err["param"] in err["message"], err
    for extra in ({"temperature": 1e-300, "seed": 1}, {"temperature": 2, "top_k": 1, "seed": 1},
                  {"temperature": 0, "top_k": -1}):  # fmt: skip
        r = post(app, "/v1/completions", {"prompt": "Hello", "max_tokens": 8, "return_token_ids": True, **extra})
        assert r.status_code == 200 and r.json()["choices"][0]["token_ids"] == refs["hello"].token_ids, (extra, r.text)


def test_best_of_returns_the_n_most_likely_of_best_of(app) -> None:
    """``best_of`` > ``n`` generates best_of completions (seeds seed + i, as ``n`` does) and returns the n with the
    highest cumulative logprob, best first; usage counts every generation; best_of < n and streaming are 400s."""
    base = {"prompt": "Hello", "max_tokens": 6, "temperature": 1.0, "seed": 11}
    every = post(app, "/v1/completions", {**base, "n": 4, "logprobs": 0}).json()
    score = [sum(c["logprobs"]["token_logprobs"]) for c in every["choices"]]
    ranked = [every["choices"][k]["text"] for k in sorted(range(4), key=lambda k: -score[k])]
    r = post(app, "/v1/completions", {**base, "n": 2, "best_of": 4})
    body = r.json()
    assert r.status_code == 200 and [c["text"] for c in body["choices"]] == ranked[:2], (body, ranked)
    assert [c["index"] for c in body["choices"]] == [0, 1] and all(c["logprobs"] is None for c in body["choices"])
    assert body["usage"]["completion_tokens"] == every["usage"]["completion_tokens"]
    for extra, says in (({"n": 3, "best_of": 2}, "must be >= n"), ({"best_of": 2, "stream": True}, "streamed")):
        r = post(app, "/v1/completions", {**base, **extra})
        assert r.status_code == 400 and says in r.json()["error"]["message"], r.text
        assert r.json()["error"]["param"] == "best_of"
