"""The server's engine process (issue 42): ``trtllm-glm serve`` runs the LLM in a process of its own by default.

- Greedy outputs through the real server (CLI, uvicorn, engine process) equal `LLM.generate`'s for each prompt
  alone, at concurrency 1 and 32; responses (logprobs, stop strings, ``n``, chat, token ids) are the in-process
  server's, field for field; ``/metrics`` and the stats come back across the boundary.
- A killed engine process ends in-flight streams with an error event, a non-streamed request with a 503 naming
  the cause, turns ``/health`` 503; the server then exits by itself and leaves no process behind.
- An API process that dies leaves no engine process behind.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.serve_helpers import MODEL, client, make_llm, metric, run, sse
from trtllm_glm import SamplingParams
from trtllm_glm.serve.app import build_app
from trtllm_glm.serve.engine import AsyncEngine
from trtllm_glm.serve.engine_client import EngineClient

pytestmark = pytest.mark.cpu_only

ROOT = Path(__file__).resolve().parents[3]
HOST = "127.0.0.1"
NUM = 32
MAX_TOKENS = 6
PROMPTS = [("abc" * (1 + i % 4)) if i % 3 == 0 else f"request {i}: {'xyz' * (i % 5)}" for i in range(NUM)]
OPTIONS = dict(device="cpu", max_batch_size=NUM, max_seq_len=256)
START_TIMEOUT_S = 120.0


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def children(pid: int) -> list[int]:
    """Process ids whose parent is ``pid``."""
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                stat = (d / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(d.name))
    return out


def alive(pid: int) -> bool:
    """The process exists and is not a zombie."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def start_server(tmp: Path, *extra: str) -> tuple[subprocess.Popen, str]:
    """``trtllm-glm serve tiny`` (default: engine process) on a free loopback port; waits for ``/health``."""
    cfg = tmp / "opts.yaml"
    cfg.write_text("".join(f"{k}: {v}\n" for k, v in OPTIONS.items()))
    port = free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    proc = subprocess.Popen(
        [sys.executable, "-m", "trtllm_glm", "serve", MODEL, "--port", str(port), "--config", str(cfg),
         "--max-queue-size", "8", "--log-level", "warning", "--drain-timeout", "2", *extra],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    base = f"http://{HOST}:{port}"
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
        try:
            if httpx.get(f"{base}/health", timeout=2.0, trust_env=False).status_code == 200:
                return proc, base
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, "server did not come up"
        time.sleep(0.1)


def stop_server(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)


def engine_pid(server_pid: int) -> int:
    (pid,) = [p for p in children(server_pid) if b"spawn_main" in Path(f"/proc/{p}/cmdline").read_bytes()]
    return pid


# Requests whose responses must be the in-process server's, field for field (ids and times aside).
CASES: list[tuple[str, dict[str, Any]]] = [
    ("/v1/completions", {"prompt": "Hello", "max_tokens": 8, "temperature": 0, "logprobs": 2}),
    ("/v1/completions", {"prompt": "Hello", "max_tokens": 8, "temperature": 0, "stop": ["e", "\x00"]}),
    ("/v1/completions", {"prompt": "request 5", "max_tokens": 12, "n": 2, "temperature": 0, "stop": ["z", "\x01"],
                         "logprobs": 1}),
    ("/v1/completions", {"prompt": ["abc", "request 7"], "max_tokens": 5, "n": 2, "temperature": 0.8, "seed": 7,
                         "return_token_ids": True}),
    ("/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 4, "temperature": 0, "stop_token_ids": [9]}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi there"}], "max_tokens": 6,
                              "temperature": 0, "logprobs": True, "top_logprobs": 2}),
    ("/v1/completions", {"prompt": "x" * 300, "max_tokens": 4}),  # a 400 (the prompt does not fit)
    # Structured output (the grammar compiled in both processes) and a forced tool call, parsed from the text.
    ("/v1/completions", {"prompt": "{", "max_tokens": 24, "temperature": 0,
                         "response_format": {"type": "json_object"}}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Time?"}], "max_tokens": 60, "temperature": 0,
                              "tools": [{"type": "function", "function": {"name": "now", "parameters": {}}}],
                              "tool_choice": {"type": "function", "function": {"name": "now"}}}),
]  # fmt: skip


def comparable(r: httpx.Response, stream: bool) -> Any:
    """A response without its ids and times; a stream as its choices' joined text, token ids and endings (chunk
    boundaries depend on timing)."""
    if not stream or r.status_code != 200:
        body = r.json()
        body.pop("id", None), body.pop("created", None)
        for ch in body.get("choices", []):  # tool calls' ids are random
            for call in (ch.get("message") or {}).get("tool_calls") or []:
                call.pop("id")
        return r.status_code, body
    out: dict[int, dict[str, Any]] = {}
    for ev in sse(r.text)[:-1]:
        for ch in ev["choices"]:
            o = out.setdefault(ch["index"], {"text": "", "ids": [], "finish": None, "calls": [], "lp": []})
            delta = ch.get("delta") or {}
            o["text"] += ch.get("text") or delta.get("content") or ""
            o["calls"] += [(c["function"]["name"], c["function"]["arguments"]) for c in delta.get("tool_calls") or []]
            lp = ch.get("logprobs") or {}  # per token, whatever the chunking
            if "content" in lp:
                o["lp"] += lp["content"]
            elif lp:
                o["lp"] += list(zip(*(lp[k] for k in ("tokens", "token_logprobs", "top_logprobs", "text_offset"))))
            o["ids"] += ch.get("token_ids") or []
            o["finish"] = ch["finish_reason"] or o["finish"]
    return r.status_code, out


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """The real server with an engine process, the greedy references and the in-process server's answers."""
    llm = make_llm(max_batch_size=NUM)
    greedy = SamplingParams(max_tokens=MAX_TOKENS)
    refs = [llm.generate(p, greedy).outputs[0] for p in PROMPTS]  # each prompt alone
    eng = AsyncEngine(llm, max_queue_size=8)
    eng.start()
    app = build_app(eng, served_model_name=MODEL, manage_engine=False)

    async def answers() -> list[Any]:
        async with client(app) as c:
            out = []
            for path, body in CASES:
                for stream in (False, True):
                    r = await c.post(path, json={"model": MODEL, **body, "stream": stream})
                    out.append(comparable(r, stream))
            return out

    try:
        expected = run(answers())
        generated = metric(eng, "trtllm:generation_tokens_total")
    finally:
        eng.stop(drain_timeout=0)
    proc, base = start_server(tmp_path_factory.mktemp("served"))
    try:
        yield base, proc, refs, (expected, generated)
    finally:
        stop_server(proc)


def metric_total(base: str, name: str) -> float:
    """The sum of a metric's samples on the server's ``/metrics`` page."""
    page = httpx.get(f"{base}/metrics", timeout=10.0, trust_env=False).text
    return sum(float(line.split()[-1]) for line in page.splitlines() if line.split("{")[0].split(" ")[0] == name)


def test_greedy_outputs_equal_llm_generate_at_concurrency_1_and_32(served) -> None:
    base, proc, refs, _ = served
    assert alive(engine_pid(proc.pid))  # the default: the engine runs in a child process
    finished0 = metric_total(base, "trtllm:request_finished_total")

    async def one(c: httpx.AsyncClient, prompt: str, stream: bool) -> tuple[str, str, int]:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": stream,
                **({"stream_options": {"include_usage": True}} if stream else {})}  # fmt: skip
        r = await c.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        if not stream:
            b = r.json()
            return b["choices"][0]["text"], b["choices"][0]["finish_reason"], b["usage"]["completion_tokens"]
        events = sse(r.text)
        assert events[-1] == "[DONE]"
        chunks = events[:-2]
        text = "".join(ch["choices"][0]["text"] for ch in chunks)
        return text, chunks[-1]["choices"][0]["finish_reason"], events[-2]["usage"]["completion_tokens"]

    async def main() -> tuple[list, list]:
        async with httpx.AsyncClient(base_url=base, timeout=60.0, trust_env=False) as c:
            solo = [await one(c, p, stream=i % 2 == 0) for i, p in enumerate(PROMPTS[:4])]  # concurrency 1
            together = await asyncio.gather(*(one(c, p, stream=True) for p in PROMPTS))  # concurrency 32
            return solo, together

    solo, together = run(main())
    want = [(r.text, r.finish_reason, len(r.token_ids)) for r in refs]
    assert solo == want[:4]
    assert together == want
    # The engine's stats and counters cross the process boundary.
    assert metric_total(base, "trtllm:request_finished_total") - finished0 == 4 + NUM
    page = httpx.get(f"{base}/metrics", timeout=10.0, trust_env=False).text
    pool = [line for line in page.splitlines() if line.startswith("trtllm:kv_cache_pages_total ")]
    assert pool and float(pool[0].split()[-1]) > 0 and "trtllm:kernel_compiles_total 0.0" in page, pool


def test_responses_equal_the_in_process_servers(served) -> None:
    base, _, _, (expected, generated) = served
    generated0 = metric_total(base, "trtllm:generation_tokens_total")

    async def main() -> list[Any]:
        async with httpx.AsyncClient(base_url=base, timeout=60.0, trust_env=False) as c:
            out = []
            for path, body in CASES:
                for stream in (False, True):
                    r = await c.post(path, json={"model": MODEL, **body, "stream": stream})
                    out.append(comparable(r, stream))
            return out

    got = run(main())
    for (path, body), i in zip(CASES, range(0, len(got), 2)):
        assert got[i] == expected[i], (path, body)
        assert got[i + 1] == expected[i + 1], (path, body, "stream")
    page = httpx.get(f"{base}/metrics", timeout=10.0, trust_env=False).text
    assert 'trtllm:request_rejected_total{reason="invalid"} 2.0' in page  # the API's rejections, counted there
    # Tokens returned to clients (the API process counts them: it applies the stop strings), as in-process.
    assert metric_total(base, "trtllm:generation_tokens_total") - generated0 == generated > 0


def test_a_killed_engine_fails_requests_and_health(tmp_path) -> None:
    """In-process app over an `EngineClient`: streams end with an error event, a non-streamed request gets a 503
    naming the cause, /health turns 503, and the fatal callback fires once."""
    eng = EngineClient(MODEL, dict(OPTIONS, max_seq_len=2048), max_queue_size=8)
    fatal: list[str] = []
    eng.on_fatal = fatal.append
    eng.start()
    app = build_app(eng, served_model_name=MODEL, manage_engine=False)
    long = {"model": MODEL, "prompt": "Hello", "max_tokens": 1500, "ignore_eos": True}

    async def main() -> tuple[list[Any], httpx.Response, httpx.Response]:
        async with client(app) as c:
            streams = [asyncio.ensure_future(c.post("/v1/completions", json={**long, "stream": True}))
                       for _ in range(2)]  # fmt: skip
            whole = asyncio.ensure_future(c.post("/v1/completions", json=long))
            while eng.stats()["running"] < 3:
                await asyncio.sleep(0.02)
            os.kill(eng.pid, signal.SIGKILL)
            done = await asyncio.gather(*streams)
            return [sse(r.text) for r in done], await whole, await c.get("/health")

    try:
        events, whole, health = run(main())
        for ev in events:
            assert ev[-1] == "[DONE]" and "error" in ev[-2], ev[-3:]
            assert "engine process died (killed by SIGKILL)" in ev[-2]["error"]["message"]
        assert whole.status_code == 503 and "engine process died" in whole.json()["error"]["message"]
        assert health.status_code == 503 and "killed by SIGKILL" in health.json()["error"]["message"]
        deadline = time.monotonic() + 5
        while not fatal and time.monotonic() < deadline:  # called on the receiver thread after the deliveries
            time.sleep(0.01)
        assert fatal == ["the engine process died (killed by SIGKILL)"] and eng.stats()["live"] == 0
    finally:
        eng.stop(0)


def test_the_server_exits_when_its_engine_dies_and_leaves_no_process(tmp_path) -> None:
    proc, base = start_server(tmp_path)
    try:
        child = engine_pid(proc.pid)

        async def main() -> list[Any]:
            async with httpx.AsyncClient(base_url=base, timeout=60.0, trust_env=False) as c:
                body = {"model": MODEL, "prompt": "Hi", "max_tokens": 200, "ignore_eos": True, "stream": True}
                async with c.stream("POST", "/v1/completions", json=body) as r:
                    lines = []
                    async for line in r.aiter_lines():
                        if line.startswith("data: ") and not lines:
                            os.kill(child, signal.SIGKILL)  # the first chunk is out: the request is in flight
                        if line.startswith("data: "):
                            lines.append(line[6:])
                    return lines

        lines = run(main())
        assert lines[-1] == "[DONE]" and "engine process died" in json.loads(lines[-2])["error"]["message"]
        proc.wait(30)  # by itself: nothing signalled the server
        assert proc.returncode != 0
        assert not alive(child) and not [p for p in children(proc.pid) if alive(p)]
    finally:
        stop_server(proc)


def test_a_start_up_error_in_the_engine_process_is_one_line(tmp_path, capsys) -> None:
    """The LLM refuses its options in the engine process: ``trtllm-glm serve`` prints the usual one line and exits 2
    (no hang, no traceback), and the engine process is gone."""
    WHY = "a prompt token and a generated one"
    from trtllm_glm.cli import main

    cfg = tmp_path / "opts.yaml"
    cfg.write_text("device: cpu\nmax_seq_len: 1\n")  # the YAML allows it; LLM needs 2
    rc = main(["serve", MODEL, "--config", str(cfg), "--port", str(free_port())])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and err == [f"trtllm-glm: error: max_seq_len must be >= 2 ({WHY}), got 1"]
    assert not [
        p for p in children(os.getpid()) if alive(p) and b"spawn_main" in Path(f"/proc/{p}/cmdline").read_bytes()
    ]


def test_an_engine_process_outlives_no_api_process(tmp_path) -> None:
    """SIGKILL the API process (nothing of its own runs then): its engine process notices and exits."""
    script = tmp_path / "api.py"
    script.write_text(
        textwrap.dedent(f"""
        import time
        from trtllm_glm.serve.engine_client import EngineClient

        if __name__ == "__main__":
            eng = EngineClient({MODEL!r}, {dict(OPTIONS)!r})
            print(eng.pid, flush=True)
            time.sleep(600)
    """)
    )
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    api = subprocess.Popen([sys.executable, str(script)], env=env, stdout=subprocess.PIPE, text=True)
    try:
        line = api.stdout.readline() if api.stdout else ""
        assert line.strip().isdigit(), line
        child = int(line)
        assert alive(child)
        api.kill()
        api.wait(10)
        deadline = time.monotonic() + 15
        while alive(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not alive(child), "the engine process outlived its API process"
    finally:
        if api.poll() is None:
            api.kill()


def test_an_engine_process_starting_up_outlives_no_api_process(tmp_path) -> None:
    """SIGKILL the API process while its engine process is still starting (here: opening its step log, a FIFO nobody
    reads, so that start-up never ends; on a GPU, minutes of warm-up compiles): the engine process exits instead of
    starting up for nobody while it holds the GPU's memory."""
    fifo = tmp_path / "steps.jsonl"
    os.mkfifo(fifo)
    script = tmp_path / "api.py"
    script.write_text(
        textwrap.dedent(f"""
        from trtllm_glm.serve.engine_client import EngineClient

        if __name__ == "__main__":
            EngineClient({MODEL!r}, {dict(OPTIONS)!r}, step_log={str(fifo)!r})
    """)
    )
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    api = subprocess.Popen([sys.executable, str(script)], env=env)
    engine: list[int] = []
    try:
        deadline = time.monotonic() + 60
        while not engine and time.monotonic() < deadline:
            engine = [p for p in children(api.pid) if b"spawn_main" in Path(f"/proc/{p}/cmdline").read_bytes()]
            time.sleep(0.05)
        assert engine, "no engine process started"

        # Until the engine process blocks opening the FIFO (the kernel's wait for a reader), once its model is built.
        def blocked() -> bool:
            return Path(f"/proc/{engine[0]}/wchan").read_text() == "wait_for_partner"

        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not blocked():
            time.sleep(0.1)
        assert blocked() and api.poll() is None
        api.kill()
        api.wait(10)
        deadline = time.monotonic() + 10
        while alive(engine[0]) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not alive(engine[0]), "the engine process outlived its API process during start-up"
    finally:
        if api.poll() is None:
            api.kill()
        for p in engine:
            if alive(p):
                os.kill(p, signal.SIGKILL)
