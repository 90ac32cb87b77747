"""What the API process of ``trtllm-glm serve`` costs per request and per streamed chunk, on the CPU, with no model.

The app (`trtllm_glm.serve.app.build_app`) runs over `FakeEngine`, which has what the app calls of an engine: a
submission is acknowledged one event-loop turn later (as `EngineClient` acknowledges it from its receiver thread),
and once ``--concurrency`` generations are live it delivers one token to each of them per step (one callback per
step, as `EngineClient` hands a step's deltas over), ``--step-ms`` apart. The requests are what
``benchmarks/bench_serve.py`` sends: streamed ``/v1/completions`` with ``--prompt-len`` token ids, ``--max-tokens``
tokens, greedy, ``ignore_eos``, ``include_usage`` and ``continuous_usage_stats``.

Three measurements:

- ``stages``: one request at a time through the ASGI app in-process (no sockets), each `_Server` step timed by a
  wrapper (exclusive microseconds, median over ``--reps`` requests; ``other`` is the rest of the way from the app's
  entry to ``submit``: Starlette / FastAPI routing and middleware, the ``Request``), then the request's chunks.
- ``asgi burst``: ``--concurrency`` requests entering the ASGI app at once (in-process): when the last one reaches
  ``submit``, what one request costs the event loop on the way there, and what one SSE chunk costs per step.
- ``http burst``: the same through uvicorn (a child process serving on a loopback port, as `server.make_server`
  builds it) and a raw-socket client that writes the burst's prebuilt requests at once, so that the client's own
  cost stays out of the server's numbers (an httpx client costs more per request than the server does). Server and
  client stamps share ``time.perf_counter`` (CLOCK_MONOTONIC, one clock for every process on Linux). ``--http`` and
  ``--loop`` choose uvicorn's HTTP parser and event loop as `server.run_server` takes them (default ``auto``:
  httptools and uvloop when installed); the line ``server: uvicorn ...`` names the protocol class and loop that
  served the requests.

Run::

    python -m benchmarks.bench_api --concurrency 64 --bursts 20
    python -m benchmarks.bench_api --concurrency 64 --bursts 20 --http h11 --loop asyncio  # the pure-Python pair
"""

from __future__ import annotations

import argparse
import asyncio
import contextvars
import json
import os
import random
import selectors
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.harness.rows import emit, say

HOST = "127.0.0.1"
MODEL = "bench"
REPO = Path(__file__).resolve().parents[1]
# The stamps of the requests under way: set by `Stamped` for each request, read by `FakeEngine.submit`.
_CURRENT: contextvars.ContextVar[Record | None] = contextvars.ContextVar("bench_api_record", default=None)
# The `_Server` methods the stage breakdown times (those missing on a version of the app are left out).
STAGES = ("parse", "check_model", "completion_prompts", "common", "build_job", "submit")


@dataclass
class Record:
    """One request's stamps (``time.perf_counter`` seconds): entering the ASGI app, reaching the engine's
    ``submit``, the response's start and every body message sent (SSE events, then the empty final one)."""

    asgi: float
    submit: float | None = None
    start: float | None = None
    sends: list[float] = field(default_factory=list)


class Stamped:
    """The ASGI app with each ``/v1/completions`` request's stamps recorded (`Record`, in ``records``)."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.state = app.state  # what `server.make_server` reads (the engine)
        self.records: list[Record] = []
        self.protocol: str | None = None  # the uvicorn protocol class that served the first request, once seen

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http" or scope["path"] != "/v1/completions":
            await self.app(scope, receive, send)
            return
        rec = Record(time.perf_counter())
        self.records.append(rec)
        _CURRENT.set(rec)
        if self.protocol is None:  # uvicorn's ``receive`` is a method of its request cycle, which holds the transport
            transport = getattr(getattr(receive, "__self__", None), "transport", None)
            self.protocol = type(transport.get_protocol()).__name__ if transport is not None else "none (in-process)"

        async def stamped(message: dict) -> None:
            await send(message)
            if message["type"] == "http.response.start":
                rec.start = time.perf_counter()
            elif message.get("body"):
                rec.sends.append(time.perf_counter())

        await self.app(scope, receive, stamped)


class FakeEngine:
    """What the app calls of an engine (`EngineClient`'s interface), with no model.

    ``submit`` stamps the request's `Record`, returns after one event-loop turn (the acknowledgement); once
    ``batch`` generations are live, ``prefill_s`` later the first step gives each one token, then one step every
    ``step_s`` until every generation has its ``max_tokens`` (the last delta finishes it with ``length``).
    ``steps`` holds each step's ``(perf_counter, deltas)``.
    """

    def __init__(self, batch: int, prefill_s: float, step_s: float, vocab_size: int = 151552) -> None:
        from trtllm_glm.runtime.tokenizer import ByteTokenizer
        from trtllm_glm.serve.metrics import ServeMetrics

        self.tokenizer = ByteTokenizer(vocab_size, vocab_size - 3, vocab_size - 2, vocab_size - 1)
        self.vocab_size = vocab_size
        self.max_seq_len = 4096
        self.max_batch_size = batch
        self.capacity = 4 * batch
        self.grammar_compiler = None
        self.down_reason: str | None = None
        self.metrics = ServeMetrics()
        self.running = True
        self.batch = batch
        self.prefill_s = prefill_s
        self.step_s = step_s
        self.steps: list[tuple[float, int]] = []
        self._live: list[list[Any]] = []  # [stream, tokens left, tokens made, prompt length]
        self._stepping = False

    def start(self) -> None:
        self.running = True

    def stop(self, drain_timeout: float = 0.0) -> None:
        self.running = False

    def fatal_error(self) -> str | None:
        return None

    def stats(self) -> dict[str, Any]:
        return {"live": len(self._live)}

    def _post(self, cmd: tuple) -> None:
        """`ResultStream.abort`'s way in: nothing to stop (a finished stream never gets here)."""

    async def submit(self, gens: list[Any], arrival: float | None = None) -> Any:
        from trtllm_glm.serve.engine import ResultStream

        rec = _CURRENT.get()
        if rec is not None:
            rec.submit = time.perf_counter()
        loop = asyncio.get_running_loop()
        stream = ResultStream(self, loop, len(gens))  # type: ignore[arg-type]
        for g in gens:
            self._live.append([stream, g.params.max_tokens, 0, len(g.prompt_ids)])
        if len(self._live) >= self.batch and not self._stepping:
            self._stepping = True
            loop.call_later(self.prefill_s, self._step, loop)
        ack = loop.create_future()
        loop.call_soon(ack.set_result, None)
        await ack
        return stream

    def _step(self, loop: asyncio.AbstractEventLoop) -> None:
        """One token to every live generation (one delta each, delivered in this one callback)."""
        from trtllm_glm.serve.engine import Delta

        self.steps.append((time.perf_counter(), len(self._live)))
        for g in self._live:
            stream, left, made, plen = g
            d = Delta(0, text=" tok", token_ids=[1000 + made], text_offsets=[4 * made], num_prompt_tokens=plen,
                      num_output_tokens=made + 1, finish_reason="length" if left == 1 else None)  # fmt: skip
            stream._deliver([d])
            g[1], g[2] = left - 1, made + 1
        self._live = [g for g in self._live if g[1] > 0]
        if self._live:
            loop.call_later(self.step_s, self._step, loop)
        else:
            self._stepping = False


def make_app(batch: int, prefill_s: float, step_s: float) -> Stamped:
    """The server's app over a `FakeEngine`, stamped."""
    from trtllm_glm.serve.app import build_app

    engine = FakeEngine(batch, prefill_s, step_s)
    return Stamped(build_app(engine, served_model_name=MODEL, manage_engine=False))


def request_bodies(n: int, prompt_len: int, max_tokens: int, seed: int = 0) -> list[bytes]:
    """``n`` request bodies as bench_serve sends them (distinct seeded token-id prompts)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        body = {
            "model": MODEL, "prompt": [rng.randrange(1000, 100000) for _ in range(prompt_len)],
            "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        }  # fmt: skip
        out.append(json.dumps(body).encode())
    return out


# ------------------------------------------------------------------------------------------------
# In-process (ASGI)
def _scope(body: bytes) -> dict[str, Any]:
    """The scope uvicorn's h11 protocol gives a POST (ASGI spec 2.3)."""
    headers = [(b"host", b"127.0.0.1"), (b"content-type", b"application/json"),
               (b"content-length", str(len(body)).encode())]  # fmt: skip
    return {
        "type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
        "method": "POST", "scheme": "http", "path": "/v1/completions", "raw_path": b"/v1/completions",
        "query_string": b"", "root_path": "", "headers": headers, "client": (HOST, 50000), "server": (HOST, 8000),
        "state": {},
    }  # fmt: skip


async def asgi_request(app: Stamped, body: bytes) -> bytes:
    """One request through the ASGI app; the response body."""
    done = asyncio.Event()
    sent = [False]
    out: list[bytes] = []

    async def receive() -> dict[str, Any]:
        if not sent[0]:
            sent[0] = True
            return {"type": "http.request", "body": body, "more_body": False}
        await done.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start" and message["status"] != 200:
            out.append(f"HTTP {message['status']} ".encode())
        if message["type"] == "http.response.body":
            out.append(message.get("body", b""))
            if not message.get("more_body"):
                done.set()

    await app(_scope(body), receive, send)
    return b"".join(out)


class StageTimer:
    """Exclusive perf_counter time of named methods of one object (wrappers installed on the instance)."""

    def __init__(self, obj: Any, names: tuple[str, ...]) -> None:
        self.totals: dict[str, float] = {}
        self._stack: list[float] = []
        for name in names:
            fn = getattr(obj, name, None)
            if fn is None:
                continue
            self.totals[name] = 0.0
            wrap = self._wrap_async if asyncio.iscoroutinefunction(fn) else self._wrap_sync
            setattr(obj, name, wrap(name, fn))

    def take(self) -> dict[str, float]:
        """The totals since the last call (seconds), reset."""
        out = dict(self.totals)
        for k in self.totals:
            self.totals[k] = 0.0
        return out

    def _enter(self) -> float:
        self._stack.append(0.0)
        return time.perf_counter()

    def _leave(self, name: str, t0: float) -> None:
        dt = time.perf_counter() - t0
        self.totals[name] += dt - self._stack.pop()
        if self._stack:
            self._stack[-1] += dt

    def _wrap_sync(self, name: str, fn: Callable) -> Callable:
        def timed(*a: Any, **k: Any) -> Any:
            t0 = self._enter()
            try:
                return fn(*a, **k)
            finally:
                self._leave(name, t0)

        return timed

    def _wrap_async(self, name: str, fn: Callable) -> Callable:
        async def timed(*a: Any, **k: Any) -> Any:
            t0 = self._enter()
            try:
                return await fn(*a, **k)
            finally:
                self._leave(name, t0)

        return timed


async def run_stages(reps: int, prompt_len: int, max_tokens: int) -> dict[str, float]:
    """Median microseconds per request of each stage, one request at a time (`STAGES`, ``other``, ``to_submit``:
    app entry to submit; ``to_start``: submit to the response's start, its acknowledgement's loop turn included;
    ``chunk``: a delivered token to its SSE event sent, one stream alone, the loop's wake-up included)."""
    app = make_app(1, 0.0, 0.0)  # a step per loop turn: each chunk is sent before the next step
    timer = StageTimer(app.app.state.server, STAGES)
    bodies = request_bodies(reps + 20, prompt_len, max_tokens, seed=1)
    per: dict[str, list[float]] = {}
    for i, body in enumerate(bodies):
        timer.take()
        await asgi_request(app, body)
        rec, stages = app.records[-1], timer.take()
        if i < 20:  # warm-up
            continue
        assert rec.submit is not None and rec.start is not None and rec.sends, "the request did not stream"
        to_submit = rec.submit - rec.asgi
        # submit's own time runs past the stamp to the acknowledgement: only its part before the stamp is here.
        stages.pop("submit", None)
        stages["other"] = to_submit - sum(stages.values())
        stages["to_submit"] = to_submit
        stages["to_start"] = rec.start - rec.submit
        steps = app.app.state.engine.steps[-max_tokens:]
        stages["chunk"] = statistics.median(s - t for (t, _), s in zip(steps[:-1], rec.sends))
        for k, v in stages.items():
            per.setdefault(k, []).append(v * 1e6)
    return {k: statistics.median(v) for k, v in per.items()}


async def run_asgi_bursts(n: int, bursts: int, prompt_len: int, max_tokens: int, step_s: float) -> list[dict]:
    """``bursts`` bursts of ``n`` requests entering the app at once; each burst's `analyse` row."""
    app = make_app(n, step_s, step_s)
    rows = []
    for b in range(bursts + 1):
        bodies = request_bodies(n, prompt_len, max_tokens, seed=100 + b)
        first = len(app.records)
        steps0 = len(app.app.state.engine.steps)
        t0 = time.perf_counter()
        await asyncio.gather(*(asgi_request(app, body) for body in bodies))
        if b:  # the first burst warms up
            rows.append(analyse(app.records[first:], app.app.state.engine.steps[steps0:], t0))
    return rows


# ------------------------------------------------------------------------------------------------
# Through uvicorn
def serve_child(n: int, step_s: float, log_level: str, port_file: str, http: str = "auto", loop: str = "auto") -> None:
    """The stamped app served as ``trtllm-glm serve`` serves it (`server.bind_socket`, `server.run_server` with
    ``http`` / ``loop``, uvicorn's logging at ``log_level``: ``info`` writes an access-log line per request) on a free
    loopback port (written to ``port_file``), until SIGTERM. ``GET /bench/stamps`` answers the records and steps so
    far, the HTTP protocol class and event loop that served them, and the garbage collector's pauses."""
    import gc

    from trtllm_glm.serve.server import bind_socket, run_server

    app = make_app(n, step_s, step_s)
    pauses: list[tuple[int, float]] = []  # (generation, seconds) of every collection
    began = [0.0]

    def on_gc(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            began[0] = time.perf_counter()
        elif app.records:  # serving (run_server's own collection at start-up is not a pause of the loop's)
            pauses.append((info["generation"], time.perf_counter() - began[0]))

    gc.callbacks.append(on_gc)

    @app.app.get("/bench/stamps")
    async def stamps() -> dict[str, Any]:
        recs = [[r.asgi, r.submit, r.start, r.sends] for r in app.records]
        ev = type(asyncio.get_running_loop())
        return {"records": recs, "steps": app.app.state.engine.steps, "gc": pauses,
                "http": app.protocol, "loop": f"{ev.__module__}.{ev.__name__}"}  # fmt: skip

    sock = bind_socket(HOST, 0)
    with open(port_file + ".tmp", "w") as f:
        f.write(str(sock.getsockname()[1]))
    os.replace(port_file + ".tmp", port_file)
    run_server(app, host=HOST, port=0, log_level=log_level, sock=sock, http=http, loop=loop)


def _http_request(port: int, body: bytes, path: str = "/v1/completions", method: str = "POST") -> bytes:
    """The request's bytes, with the headers httpx sends."""
    head = (f"{method} {path} HTTP/1.1\r\nHost: {HOST}:{port}\r\nAccept: */*\r\nAccept-Encoding: gzip, deflate\r\n"
            f"Connection: keep-alive\r\nUser-Agent: python-httpx/0.28.1\r\n")  # fmt: skip
    if method == "POST":
        head += f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
    return head.encode() + b"\r\n" + body


def _connect(port: int, timeout: float = 60.0) -> socket.socket:
    """A connection to the server child (which listens once its start-up is done)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            s = socket.create_connection((HOST, port))
        except ConnectionRefusedError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
            continue
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return s


def _fetch_json(port: int, path: str) -> Any:
    with socket.create_connection((HOST, port)) as s:
        s.sendall(_http_request(port, b"", path, "GET").replace(b"keep-alive", b"close"))
        data = b""
        while chunk := s.recv(1 << 20):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), head[:200]
    return json.loads(body)


def _burst(socks: list[socket.socket], requests: list[bytes]) -> tuple[float, list[float]]:
    """Write every request on its connection at once, then read each streamed response to its end; the send
    start and each response's first ``data:`` arrival (perf_counter)."""
    sel = selectors.DefaultSelector()
    bufs = [b""] * len(socks)
    first = [0.0] * len(socks)
    t0 = time.perf_counter()
    for s, r in zip(socks, requests):
        s.sendall(r)
    for i, s in enumerate(socks):
        sel.register(s, selectors.EVENT_READ, i)
    open_ = len(socks)
    while open_:
        for key, _ in sel.select(30.0):
            i = key.data
            chunk = key.fileobj.recv(1 << 16)  # type: ignore[union-attr]
            if not chunk:
                raise RuntimeError("the server closed a connection")
            bufs[i] += chunk
            if not first[i] and b"data: " in bufs[i]:
                first[i] = time.perf_counter()
            if bufs[i].endswith(b"\r\n0\r\n\r\n"):  # the chunked body's end
                if not bufs[i].startswith(b"HTTP/1.1 200") or b"data: [DONE]" not in bufs[i]:
                    raise RuntimeError(f"bad response: {bufs[i][:300]!r}")
                sel.unregister(key.fileobj)
                open_ -= 1
    sel.close()
    return t0, first


def run_http_bursts(
    n: int, bursts: int, prompt_len: int, max_tokens: int, step_s: float, log_level: str, http: str = "auto",
    loop: str = "auto",
) -> tuple[list[dict], str, str]:  # fmt: skip
    """``bursts`` bursts of ``n`` streamed requests through uvicorn (child process, its log in a temporary file;
    ``http`` / ``loop`` as `server.run_server` takes them): each burst's `analyse` row with the client's TTFT, a
    line on the server (its HTTP protocol and loop, its garbage collections) and its protocol class and loop."""
    with tempfile.TemporaryDirectory(prefix="bench-api-") as tmp:
        port_file, log_path = os.path.join(tmp, "port"), os.path.join(tmp, "server.log")
        cmd = [sys.executable, "-m", "benchmarks.bench_api", "--serve-child", port_file, "--concurrency", str(n),
               "--step-ms", str(step_s * 1e3), "--log-level", log_level, "--http", http, "--loop", loop]  # fmt: skip
        with open(log_path, "w") as log:
            child = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)  # -m finds benchmarks/
        try:
            port = _wait_port(port_file, child, log_path)
            stamps, sent = _drive(port, n, bursts, prompt_len, max_tokens)
        finally:
            child.terminate()
            child.wait(30)
    return _http_rows(stamps, sent, n, bursts)


def _wait_port(port_file: str, child: subprocess.Popen, log_path: str, timeout: float = 120.0) -> int:
    """The server child's port, once it has bound it."""
    deadline = time.monotonic() + timeout
    while not os.path.exists(port_file):
        if child.poll() is not None or time.monotonic() > deadline:
            with open(log_path) as f:
                raise RuntimeError(f"the server child did not start:\n{f.read()[-3000:]}")
        time.sleep(0.05)
    with open(port_file) as f:
        return int(f.read())


def _drive(port: int, n: int, bursts: int, prompt_len: int, max_tokens: int) -> tuple[dict, list]:
    """``bursts + 1`` bursts (the first warms up) over ``n`` connections: the server's stamps and each burst's
    `_burst` times."""
    socks = [_connect(port) for _ in range(n)]
    sent = []
    for b in range(bursts + 1):
        requests = [_http_request(port, body) for body in request_bodies(n, prompt_len, max_tokens, 100 + b)]
        sent.append(_burst(socks, requests))
    stamps = _fetch_json(port, "/bench/stamps")
    for s in socks:
        s.close()
    return stamps, sent


def _http_rows(stamps: dict, sent: list, n: int, bursts: int) -> tuple[list[dict], str, str]:
    """`run_http_bursts`' rows, server line and server from the server's stamps and the client's burst times."""
    recs = [Record(a, s, st, sends) for a, s, st, sends in stamps["records"]]
    steps = [tuple(x) for x in stamps["steps"]]
    full = [p for g, p in stamps["gc"] if g == 2]
    info = (f"  server: uvicorn {stamps['http']}, {stamps['loop']}; garbage collections {len(stamps['gc'])}, of them "
        f"{len(full)} full (max {max(full, default=0) * 1e3:.1f} ms); the longest pause of any "
        f"{max((p for _, p in stamps['gc']), default=0) * 1e3:.1f} ms")  # fmt: skip
    rows = []
    for b in range(1, bursts + 1):  # the first burst warms up
        t0, first = sent[b]
        burst = recs[b * n : (b + 1) * n]
        t_end = sent[b + 1][0] if b + 1 <= bursts else float("inf")
        row = analyse(burst, [s for s in steps if t0 <= s[0] < t_end], t0)
        ttft = sorted(f - t0 for f in first)
        row["client_ttft_p50_ms"] = ttft[len(ttft) // 2] * 1e3
        row["client_ttft_max_ms"] = ttft[-1] * 1e3
        rows.append(row)
    return rows, info, f"{stamps['http']}, {stamps['loop']}"


# ------------------------------------------------------------------------------------------------
def analyse(recs: list[Record], steps: list[tuple[float, int]], t0: float) -> dict[str, float]:
    """One burst's numbers from its requests' stamps and its steps (t0: the burst's start).

    ``last_submit_ms``: the burst's start to its last request's ``submit``; ``to_submit_per_req_us``: that over the
    burst's size (the loop's cost per request up to submit, the HTTP layer's in the http burst); ``first_chunk_us``
    and ``chunk_us``: per chunk, a step to its last chunk sent over the step's chunks (the first step, then the
    middle ones); ``server_ttft_p50_ms``: submit to the first chunk sent; ``server_first_chunk_p50_ms``: the burst's
    start to the first chunk sent (the client's TTFT less its way to the client).
    """
    n = len(recs)
    subs = sorted(r.submit for r in recs if r.submit is not None)
    if len(subs) != n:
        raise RuntimeError("a request of the burst never reached submit")
    times = [t for t, _ in steps] + [float("inf")]
    per_step: list[list[float]] = [[] for _ in steps]
    for r in recs:
        for s in r.sends:
            k = next(i for i in range(len(steps)) if times[i] <= s < times[i + 1])
            per_step[k].append(s)
    spans = [(max(ss) - t) / c for (t, c), ss in zip(steps, per_step) if ss]
    ttft = sorted(r.sends[0] - r.submit for r in recs if r.sends and r.submit is not None)
    return {
        "last_submit_ms": (subs[-1] - t0) * 1e3,
        "first_submit_ms": (subs[0] - t0) * 1e3,
        "last_asgi_ms": (max(r.asgi for r in recs) - t0) * 1e3,
        "to_submit_per_req_us": (subs[-1] - t0) / n * 1e6,
        "first_chunk_us": spans[0] * 1e6,
        "chunk_us": statistics.mean(spans[1:-1]) * 1e6 if len(spans) > 2 else float("nan"),
        "last_first_chunk_ms": (max(r.sends[0] for r in recs) - steps[0][0]) * 1e3,
        "server_ttft_p50_ms": ttft[len(ttft) // 2] * 1e3,
        "server_first_chunk_p50_ms": statistics.median(r.sends[0] - t0 for r in recs) * 1e3,
    }


def summarise(rows: list[dict]) -> dict[str, float]:
    """Median of each field over the bursts."""
    return {k: statistics.median(r[k] for r in rows) for k in rows[0]}


def profile(reps: int, prompt_len: int, max_tokens: int, top: int) -> None:
    """cProfile of ``reps`` sequential in-process requests: the ``top`` functions by own time."""
    import cProfile
    import pstats

    prof = cProfile.Profile()

    async def go() -> None:
        app = make_app(1, 0.0, 0.0)
        bodies = request_bodies(reps, prompt_len, max_tokens, seed=3)
        for body in bodies[:20]:
            await asgi_request(app, body)
        prof.enable()
        for body in bodies[20:]:
            await asgi_request(app, body)
        prof.disable()

    asyncio.run(go())
    pstats.Stats(prof).sort_stats("tottime").print_stats(top)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--concurrency", type=int, default=64, help="requests per burst")
    ap.add_argument("--bursts", type=int, default=20, help="bursts per burst measurement (after one warm-up)")
    ap.add_argument("--reps", type=int, default=500, help="sequential requests of the stage breakdown")
    ap.add_argument("--prompt-len", type=int, default=30)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--step-ms", type=float, default=20.0, help="between the fake engine's steps")
    ap.add_argument("--no-http", action="store_true", help="skip the uvicorn measurement")
    ap.add_argument("--log-level", default="info", help="the server's (trtllm-glm serve's default: info)")
    ap.add_argument("--http", default="auto", choices=["auto", "httptools", "h11"],
                    help="uvicorn's HTTP parser (server.run_server's http; auto: httptools if installed)")  # fmt: skip
    ap.add_argument("--loop", default="auto", choices=["auto", "uvloop", "asyncio"],
                    help="uvicorn's event loop (server.run_server's loop; auto: uvloop if installed)")  # fmt: skip
    ap.add_argument("--profile", type=int, default=0, metavar="TOP", help="print a cProfile of the stage run")
    ap.add_argument("--serve-child", metavar="PORT_FILE", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    step_s = args.step_ms / 1e3
    if args.serve_child:
        serve_child(args.concurrency, step_s, args.log_level, args.serve_child, args.http, args.loop)
        return {}
    if args.profile:
        profile(args.reps, args.prompt_len, args.max_tokens, args.profile)
    say(f"API overhead: streamed /v1/completions, {args.prompt_len}-token prompts, max_tokens {args.max_tokens}, "
        f"bursts of {args.concurrency}, server log level {args.log_level}, --http {args.http} --loop {args.loop}; "
        f"python {sys.version.split()[0]}, {os.cpu_count()} CPUs")  # fmt: skip
    row: dict[str, Any] = {"concurrency": args.concurrency, "prompt_len": args.prompt_len,
                           "max_tokens": args.max_tokens, "http": args.http, "loop": args.loop}  # fmt: skip
    stages = asyncio.run(run_stages(args.reps, args.prompt_len, args.max_tokens))
    say(f"per request, one at a time (median us over {args.reps}):")
    for k, v in stages.items():
        say(f"  {k:<20} {v:8.1f}")
    row.update({f"stage_{k}_us": v for k, v in stages.items()})
    asgi = summarise(asyncio.run(run_asgi_bursts(args.concurrency, args.bursts, args.prompt_len, args.max_tokens,
                                                 step_s)))  # fmt: skip
    say(_burst_line("asgi", args.concurrency, asgi))
    row.update({f"asgi_{k}": v for k, v in asgi.items()})
    if not args.no_http:
        rows, info, served = run_http_bursts(args.concurrency, args.bursts, args.prompt_len, args.max_tokens, step_s,
                                             args.log_level, args.http, args.loop)  # fmt: skip
        http = summarise(rows)
        say(_burst_line("http", args.concurrency, http))
        say(f"  client TTFT p50 {http['client_ttft_p50_ms']:.2f} ms, max {http['client_ttft_max_ms']:.2f} ms; the "
            f"server sent the first chunk at p50 {http['server_first_chunk_p50_ms']:.2f} ms (the fake engine's first "
            f"step comes {args.step_ms:g} ms after the last submit)")  # fmt: skip
        say(info)
        row.update({f"http_{k}": v for k, v in http.items()}, http_server=served)
    emit(row)
    return row


def _burst_line(kind: str, n: int, s: dict[str, float]) -> str:
    return (f"{kind} burst of {n} (median over bursts): request {n} submitted at {s['last_submit_ms']:.2f} ms "
            f"(first {s['first_submit_ms']:.2f} ms), {s['to_submit_per_req_us']:.1f} us per request to submit; "
            f"per chunk {s['first_chunk_us']:.1f} us (first step), {s['chunk_us']:.1f} us (later steps); "
            f"server TTFT p50 {s['server_ttft_p50_ms']:.2f} ms")  # fmt: skip


if __name__ == "__main__":
    main()
