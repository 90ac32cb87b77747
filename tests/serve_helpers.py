"""Helpers of the server tests: tiny-preset LLMs, an in-process HTTP client, SSE parsing, engine stats."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import httpx

from trtllm_glm import LLM
from trtllm_glm.serve.engine import AsyncEngine

MODEL = "tiny"
# Every in-process test finishes well within this (the tiny model runs ~50 tokens/s per request).
TIMEOUT_S = 60.0


def make_llm(**kw: Any) -> LLM:
    opts: dict[str, Any] = dict(device="cpu", max_batch_size=8, max_seq_len=256)
    opts.update(kw)
    return LLM(model=MODEL, **opts)


def run(coro: Any, timeout: float = TIMEOUT_S) -> Any:
    """Run a coroutine on a fresh event loop, bounded in time."""
    return asyncio.run(asyncio.wait_for(coro, timeout))


def client(app: Any) -> httpx.AsyncClient:
    """An in-process client (httpx ``ASGITransport``; responses, streams included, arrive whole)."""
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test", timeout=TIMEOUT_S)


def sse(text: str) -> list[Any]:
    """The ``data:`` payloads of a server-sent-event body: parsed JSON, or the string ``[DONE]``."""
    out: list[Any] = []
    for block in text.split("\n\n"):
        block = block.strip()
        if not block:
            continue
        assert block.startswith("data: "), block
        payload = block[len("data: ") :]
        out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out


def wait_idle(engine: AsyncEngine, timeout: float = 20.0) -> dict[str, Any]:
    """Wait until the engine holds no request and no page; returns its stats."""
    deadline = time.monotonic() + timeout
    while True:
        s = engine.stats()
        if s["live"] == 0 and s["pages_used"] == 0 and s["running"] == 0:
            return s
        if time.monotonic() > deadline:
            raise AssertionError(f"engine not idle after {timeout} s: {s}")
        time.sleep(0.01)


def metric(app_or_engine: Any, name: str, labels: dict[str, str] | None = None) -> float:
    """One sample of the engine's registry (0 when absent)."""
    engine = getattr(getattr(app_or_engine, "state", None), "engine", app_or_engine)
    v = engine.metrics.registry.get_sample_value(name, labels or {})
    return 0.0 if v is None else v
