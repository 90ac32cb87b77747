"""Shutdown under load (issue 33): the server drains itself before uvicorn closes anything. A new request
during the drain gets 503 (not a refused connection); a stream the drain cuts ends with ``finish_reason:
"abort"`` and ``[DONE]``; a stream that finishes within the drain ends normally."""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import threading
import time

import httpx
import pytest

from tests.serve_helpers import MODEL, make_llm
from trtllm_glm.serve.app import build_app
from trtllm_glm.serve.engine import AsyncEngine
from trtllm_glm.serve.engine_client import EngineClient
from trtllm_glm.serve.server import describe_engine, make_server

pytestmark = pytest.mark.cpu_only


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("engine_process", [False, True], ids=["thread", "engine-process"])
def test_drain_ends_every_stream_and_refuses_new_work_with_503(engine_process: bool) -> None:
    """With the engine on a thread and in an engine process (the server's default), which exits after the drain."""
    opts = dict(device="cpu", max_batch_size=4, max_seq_len=2048)
    engine = EngineClient(MODEL, opts) if engine_process else AsyncEngine(make_llm(**opts))
    app = build_app(engine, served_model_name=MODEL, drain_timeout=1.0)
    port = free_port()
    server = make_server(app, host="127.0.0.1", port=port, log_level="warning", drain_timeout=1.0)
    th = threading.Thread(target=server.run, daemon=True)  # not the main thread: uvicorn installs no handlers
    th.start()
    base = f"http://127.0.0.1:{port}"
    for _ in range(500):
        if server.started:
            break
        time.sleep(0.01)
    assert server.started

    async def stream(c: httpx.AsyncClient, max_tokens: int, first: asyncio.Event) -> list:
        body = {"prompt": "x", "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
        events = []
        async with c.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    payload = line[len("data: ") :]
                    events.append(payload if payload == "[DONE]" else json.loads(payload))
                    first.set()
        return events

    async def main():
        async with httpx.AsyncClient(base_url=base, timeout=30) as c:
            started = [asyncio.Event(), asyncio.Event()]
            long = asyncio.ensure_future(stream(c, 1900, started[0]))  # far longer than the drain
            short = asyncio.ensure_future(stream(c, 12, started[1]))  # finishes within it
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 20)
            server.handle_exit(signal.SIGINT, None)  # what uvicorn's signal handler calls
            await asyncio.sleep(0.2)
            during = await c.post("/v1/completions", json={"prompt": "y", "max_tokens": 2})
            health = await c.get("/health")
            return await long, await short, during, health

    long, short, during, health = asyncio.run(asyncio.wait_for(main(), 60))
    th.join(timeout=20)
    assert not th.is_alive()
    assert during.status_code == 503 and during.headers.get("retry-after") == "1", during.text
    assert health.status_code == 503
    for events, reason in ((long, "abort"), (short, "length")):
        assert events[-1] == "[DONE]", events[-3:]
        assert events[-2]["choices"][0]["finish_reason"] == reason, events[-2]
    assert sum(len(e["choices"][0]["text"]) > 0 for e in long[:-1]) > 1  # it was streaming before the cut
    if engine_process:
        assert engine.down_reason is None and engine._proc.exitcode == 0  # stopped, not died


def test_start_up_lines_say_what_was_loaded() -> None:
    engine = AsyncEngine(make_llm(max_batch_size=2, max_seq_len=64))
    lines = describe_engine(engine, "tiny", 1.25)
    text = "\n".join(lines)
    for part in ("model tiny in 1.2 s", "float32", "on cpu", "speculative decoding: off", "CUDA graphs: off",
                 f"KV cache: {engine.executor.manager.num_pages} pages of 16 tokens", "parallelism: one device",
                 "overlap scheduler off (needs CUDA graphs)",
                 "step sizes: max_batch_size 2, max_num_tokens 8192 [auto (max_num_tokens)]"):  # fmt: skip
        assert part in text, text


def test_start_up_lines_of_a_parallel_or_speculative_llm() -> None:
    """What the lines say for a world of ranks and for speculation is read from the LLM, not assumed (issue 45):
    the world's sizes, rank 0's parameter share, and where the overlap scheduler applies."""
    from types import SimpleNamespace

    from trtllm_glm.distributed.mapping import Mapping

    engine = AsyncEngine(make_llm(max_batch_size=2, max_seq_len=64))
    llm = engine.llm
    llm.mapping = Mapping.from_sizes(2, None, None).with_rank(0)
    engine.executor.graph_runner = SimpleNamespace(graphs={(1, 1): None})  # as on CUDA
    text = "\n".join(describe_engine(engine, "tiny"))
    assert "parallelism: 2 ranks: tp 2" in text and "parameters on rank 0" in text and "overlap scheduler on;" in text
    llm.speculative_config = SimpleNamespace(max_concurrency=8)
    text = "\n".join(describe_engine(engine, "tiny"))
    assert "overlap scheduler on for width-one rounds above max_concurrency" in text
    engine.executor.drafts_ahead_supported = True  # an MTP executor with fused draft graphs
    assert "overlap scheduler on (MTP drafting rounds launched ahead" in "\n".join(describe_engine(engine, "tiny"))
    engine.executor.graph_runner = None
