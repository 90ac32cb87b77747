"""The real server: uvicorn on 127.0.0.1 and a free port, driven by the official ``openai`` client."""

from __future__ import annotations

import socket
import threading
import time

import httpx
import openai
import pytest
import uvicorn

from tests.serve_helpers import MODEL, make_llm, wait_idle
from trtllm_glm import SamplingParams
from trtllm_glm.serve.app import build_app
from trtllm_glm.serve.chat import ChatTemplate
from trtllm_glm.serve.engine import AsyncEngine

pytestmark = pytest.mark.cpu_only

HOST = "127.0.0.1"  # loopback only
START_TIMEOUT_S = 30.0


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server():
    """A live server (the app's lifespan starts and drains the engine) and greedy references."""
    llm = make_llm()
    chat_ids = ChatTemplate().encode(llm.tokenizer, [{"role": "user", "content": "Say hi"}])
    refs = {
        "completion": llm.generate("Hello", SamplingParams(max_tokens=6)).outputs[0],
        "chat": llm.generate(chat_ids, SamplingParams(max_tokens=5)).outputs[0],
    }
    engine = AsyncEngine(llm, max_queue_size=4)
    app = build_app(engine, served_model_name=MODEL, drain_timeout=5.0)
    port = free_port()
    srv = uvicorn.Server(uvicorn.Config(app, host=HOST, port=port, log_level="warning", lifespan="on",
                                        timeout_graceful_shutdown=5))  # fmt: skip
    th = threading.Thread(target=srv.run, name="uvicorn-test", daemon=True)
    th.start()
    deadline = time.monotonic() + START_TIMEOUT_S
    while not srv.started:
        assert th.is_alive() and time.monotonic() < deadline, "server did not start"
        time.sleep(0.02)
    base = f"http://{HOST}:{port}"
    yield base, engine, refs
    srv.should_exit = True
    th.join(timeout=30.0)
    assert not th.is_alive(), "server did not shut down"
    assert not engine.running and engine.stats()["live"] == 0


@pytest.fixture(scope="module")
def oai(server):
    base, _, _ = server
    # max_retries=0: a failure shows at once instead of being retried; trust_env off: no proxy for loopback.
    with openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=60.0,
                       http_client=openai.DefaultHttpxClient(trust_env=False)) as c:  # fmt: skip
        yield c


def test_completions_and_streaming(oai, server) -> None:
    _, _, refs = server
    ref = refs["completion"]
    r = oai.completions.create(model=MODEL, prompt="Hello", max_tokens=6, temperature=0)
    assert r.choices[0].text == ref.text and r.choices[0].finish_reason == ref.finish_reason
    assert r.usage.completion_tokens == len(ref.token_ids) and r.usage.prompt_tokens == 6
    chunks = list(oai.completions.create(model=MODEL, prompt="Hello", max_tokens=6, temperature=0, stream=True,
                                         stream_options={"include_usage": True}))  # fmt: skip
    assert "".join(c.choices[0].text for c in chunks if c.choices) == ref.text
    assert chunks[-1].usage.completion_tokens == len(ref.token_ids)


def test_completion_logprobs(oai) -> None:
    r = oai.completions.create(model=MODEL, prompt="Hello", max_tokens=4, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert all(len(t) in (2, 3) for t in lp.top_logprobs)


def test_chat_logprobs_and_streaming(oai, server) -> None:
    _, _, refs = server
    ref = refs["chat"]
    msgs = [{"role": "user", "content": "Say hi"}]
    r = oai.chat.completions.create(model=MODEL, messages=msgs, max_tokens=5, temperature=0, logprobs=True,
                                    top_logprobs=2)  # fmt: skip
    ch = r.choices[0]
    assert ch.message.role == "assistant" and ch.message.content == ref.text
    assert len(ch.logprobs.content) == r.usage.completion_tokens == len(ref.token_ids)
    assert all(len(e.top_logprobs) == 2 and e.top_logprobs[0].logprob >= e.top_logprobs[1].logprob
               for e in ch.logprobs.content)  # fmt: skip
    stream = oai.chat.completions.create(model=MODEL, messages=msgs, max_tokens=5, temperature=0, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == ref.text


def test_models_and_errors(oai) -> None:
    assert [m.id for m in oai.models.list()] == [MODEL]
    with pytest.raises(openai.NotFoundError) as e:
        oai.completions.create(model="gpt-4", prompt="x", max_tokens=2)
    assert e.value.status_code == 404
    with pytest.raises(openai.BadRequestError, match="temperature"):
        oai.completions.create(model=MODEL, prompt="x", max_tokens=2, temperature=5)
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x" * 400}])


def test_client_disconnect_mid_stream_frees_pages(server) -> None:
    base, engine, _ = server
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 200, "ignore_eos": True, "stream": True}
    with httpx.Client(trust_env=False, timeout=30.0) as c, c.stream("POST", f"{base}/v1/completions", json=body) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data:"):
                break  # leave after the first event: closing the connection is the disconnect
    s = wait_idle(engine)
    assert s["pages_used"] == 0 and s["running"] == 0
    with httpx.Client(trust_env=False, timeout=30.0) as c:
        m = c.get(f"{base}/metrics").text
    assert 'trtllm:request_finished_total{finished_reason="abort"} 1.0' in m
