"""Build the engine and app for ``trtllm-glm serve`` and run them under uvicorn, with the server's own drain.

Shutdown (SIGINT / SIGTERM): the listening socket stays open while the engine drains, so a new request gets
HTTP 503 with ``Retry-After`` (not a refused connection); in-flight requests get ``drain_timeout`` seconds
to finish, the rest are aborted (a stream ends with ``finish_reason: "abort"`` and ``data: [DONE]``), and
only then does uvicorn close the connections and exit. A second signal exits at once.

HTTP parser and event loop (`choose_http_loop`): httptools and uvloop (C; the serve extra installs them) when they
import, else h11 and asyncio (pure Python; h11 is uvicorn's own dependency); ``http="h11"`` / ``loop="asyncio"`` force
the pure-Python ones (``trtllm-glm serve``: ``--http`` / ``--loop``, or the keys ``http`` / ``loop`` of its ``--config``
file). A start-up line says which pair runs. Under httptools, what h11 refuses and llhttp would take
(over-long heads, a missing or doubled Host, HTTP/0.9) gets the same 400 (`_bounded_httptools_protocol`).
"""

from __future__ import annotations

import functools
import gc
import logging
import os
import signal
import socket
import threading
import time
from types import FrameType
from typing import Any

import uvicorn

from ..runtime.step_log import StepLog
from .app import build_app
from .chat import load_chat_template
from .describe import describe_engine
from .engine import AsyncEngine
from .http_loop import HTTP_CHOICES, LOOP_CHOICES, choose_http_loop
from .reasoning import resolve_reasoning_parser

__all__ = [
    "make_app", "make_server", "run_server", "bind_socket", "describe_engine", "DrainingServer", "choose_http_loop",
    "HTTP_CHOICES", "LOOP_CHOICES",
]  # fmt: skip

log = logging.getLogger("trtllm_glm.serve")

# Seconds the final chunks of aborted streams get to reach their clients once the drain ends.
FLUSH_S = 5.0
# The longest request head (request line and headers) still incomplete after a read that the server waits on: h11's
# default ``max_incomplete_event_size``, which uvicorn's h11 protocol keeps; httptools gets the same bound.
MAX_HEAD_BYTES = 16 * 1024


def make_app(
    model: str | os.PathLike[str],
    llm_options: dict[str, Any] | None = None,
    *,
    served_model_name: str | None = None,
    max_queue_size: int = 64,
    drain_timeout: float = 30.0,
    step_log: str | os.PathLike[str] | None = None,
    reasoning_parser: str | None = "auto",
    engine_process: bool = True,
) -> Any:
    """Build the engine and the app (the engine starts with the app).

    Args:
        model: preset name or checkpoint directory, as ``LLM(model=...)``.
        llm_options: ``LLM`` keyword arguments (`load_llm_options`).
        served_model_name: the name clients use (default: ``model`` as given).
        max_queue_size: generations that may queue beyond the running batch.
        drain_timeout: seconds in-flight requests get at shutdown.
        step_log: a JSON-lines file for the engine's `StepLog` (every step, each request's TTFT parts).
        reasoning_parser: ``"auto"`` (``glm45`` when the chat template writes ``</think>``), ``"none"`` or a
            parser name (`trtllm_glm.serve.reasoning`).
        engine_process: ``True`` (default): the `LLM` and its engine loop run in a process of their own
            (`engine_client.EngineClient`), so that HTTP, JSON and SSE work never holds the engine's GIL;
            ``False``: in this process, on a thread (`AsyncEngine`; for debugging).
    """
    template = load_chat_template(model)  # a broken template fails before the model is built
    parser = resolve_reasoning_parser(reasoning_parser, template.jinja)
    engine: Any
    if engine_process:
        from .engine_client import EngineClient

        engine = EngineClient(model, llm_options, max_queue_size=max_queue_size, step_log=step_log)
        lines = list(engine.start_lines)
    else:
        from ..runtime.llm import LLM

        t0 = time.perf_counter()
        llm = LLM(model=model, **(llm_options or {}))
        log_ = StepLog(step_log) if step_log is not None else None
        engine = AsyncEngine(llm, max_queue_size=max_queue_size, step_log=log_)
        lines = describe_engine(engine, model, time.perf_counter() - t0)
        lines.append("engine process: off (the engine runs on a thread of the API process)")
        if getattr(llm, "warmup_report", None) is not None:
            lines.append(llm.warmup_report.describe())
    lines.append(f"reasoning parser: {parser or 'none'}" + (" (auto)" if reasoning_parser in (None, "auto") else ""))
    for line in lines:
        log.info("%s", line)
    return build_app(
        engine, served_model_name=served_model_name or os.fspath(model), chat_template=template,
        drain_timeout=drain_timeout, reasoning_parser=parser,
    )  # fmt: skip


def _describe_http_loop(chosen: tuple[str, str], asked: tuple[str, str]) -> str:
    """The start-up line: the parser and loop that run, their versions, and why when not the C ones by default."""
    import importlib.metadata as md

    parts = []
    for kind, name, asked_for, fast in zip(("parser", "event loop"), chosen, asked, ("httptools", "uvloop")):
        try:
            version = " " + md.version(name)
        except md.PackageNotFoundError:  # asyncio: the standard library
            version = ""
        why = " (asked for)" if asked_for != "auto" else "" if name == fast else f" ({fast} not installed)"
        parts.append(f"{kind} {name}{version}{why}")
    return f"HTTP: uvicorn {uvicorn.__version__}, {', '.join(parts)}"


@functools.cache
def _bounded_httptools_protocol(max_head: int) -> type:
    """uvicorn's httptools protocol refusing what uvicorn's h11 protocol refuses (`BoundedHttpToolsProtocol`'s
    docstring); imports httptools."""
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    class BoundedHttpToolsProtocol(HttpToolsProtocol):
        """uvicorn's httptools protocol, refusing with 400 what uvicorn's h11 protocol refuses and llhttp takes.

        - A head still incomplete after a read that brought it past ``max_head`` bytes (h11's
          ``max_incomplete_event_size``, 16 KiB: "Receive buffer too long"): llhttp has no limit and collects a header
          of any length. As with h11, a longer head that arrives whole in one read is taken; a head that begins
          within a read (behind a pipelined request) is counted from the next read. A chunked body's size lines and
          trailers are bounded alike.
        - An HTTP/1.1 request without a Host header, and any with more than one (RFC 9112 3.2; h11 refuses both).
        - A version other than HTTP/1.0 and 1.1: llhttp takes a request line without one as HTTP/0.9.

        The answer is uvicorn's own for a malformed request: 400 "Invalid HTTP request received.", connection
        closed. Other differences stay (docs/serving.md, "HTTP parser and event loop").
        """

        max_head_bytes = max_head

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._head_bytes: int | None = 0  # bytes of the head being read, by the reads before; None: none is
            self._head_began = False  # a head began within the read being parsed

        def data_received(self, data: bytes) -> None:
            counted = self._head_bytes is not None
            self._head_began = False
            super().data_received(data)
            if self._head_bytes is None or self.transport.is_closing():
                return
            if counted and not self._head_began:
                self._head_bytes += len(data)
            if self._head_bytes > self.max_head_bytes:
                msg = "Invalid HTTP request received."
                self.logger.warning(msg)
                self.send_400_response(msg)

        def _head_begins(self) -> None:
            self._head_bytes = 0
            self._head_began = True

        def on_headers_complete(self) -> None:
            version = self.parser.get_http_version()
            if version not in ("1.0", "1.1"):
                raise ValueError("unsupported HTTP version")  # httptools: a parser error, uvicorn: 400
            names = [name for name, _ in self.headers]
            hosts = names.count(b"host")
            if hosts > 1 or (hosts == 0 and version == "1.1"):
                raise ValueError("one Host header (HTTP/1.1: exactly one)")
            if b"transfer-encoding" in names:
                self._head_begins()  # a chunked body: its first size line
            else:
                self._head_bytes = None
            super().on_headers_complete()

        def on_body(self, body: bytes) -> None:
            self._head_bytes = None
            super().on_body(body)

        def on_chunk_header(self) -> None:
            self._head_begins()  # the chunk's data follows, or the trailers after the last one

        def on_chunk_complete(self) -> None:
            self._head_begins()  # the next chunk's size line

        def on_message_complete(self) -> None:
            self._head_begins()  # the next request's
            super().on_message_complete()

    return BoundedHttpToolsProtocol


class DrainingServer(uvicorn.Server):
    """A ``uvicorn.Server`` whose first exit signal drains the engine before uvicorn shuts down.

    Args:
        config: the ``uvicorn.Config``.
        engine: the app's engine.
        drain_timeout: seconds in-flight requests get to finish.
    """

    def __init__(self, config: uvicorn.Config, engine: AsyncEngine, drain_timeout: float) -> None:
        super().__init__(config)
        self.engine = engine
        self.drain_timeout = drain_timeout
        self.drain_thread: threading.Thread | None = None
        self.http_loop: tuple[str, str] | None = None  # (parser, event loop), set by `make_server`

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.drain_thread is not None or self.should_exit:
            log.warning("second exit signal: closing now")
            self.force_exit = True
            super().handle_exit(sig, frame)
            return
        if hasattr(self, "_captured_signals"):
            self._captured_signals.append(sig)  # uvicorn re-raises it once stopped (the exit status)
        self.drain_thread = threading.Thread(target=self._drain, name="trtllm-glm-drain", daemon=True)
        self.drain_thread.start()

    def _drain(self) -> None:
        live = self.engine.stats()["live"]
        log.info("shutting down: new requests get 503; %d in flight get up to %.1f s", live, self.drain_timeout)
        self.engine.stop(self.drain_timeout)  # what is left is aborted: its streams end with "abort" and [DONE]
        deadline = time.monotonic() + FLUSH_S
        while self.server_state.tasks and time.monotonic() < deadline:
            time.sleep(0.02)
        log.info("drained; closing the server")
        self.should_exit = True


def make_server(
    app: Any,
    *,
    host: str,
    port: int,
    log_level: str = "info",
    drain_timeout: float = 30.0,
    http: str = "auto",
    loop: str = "auto",
) -> DrainingServer:
    """The uvicorn server of ``app`` with the engine's drain on the first exit signal (`DrainingServer`).

    ``http`` / ``loop``: `HTTP_CHOICES` / `LOOP_CHOICES` (`choose_http_loop`); the server's ``http_loop`` holds the
    pair chosen, and a line of the log says it.
    """
    chosen = choose_http_loop(http, loop)
    protocol = _bounded_httptools_protocol(MAX_HEAD_BYTES) if chosen[0] == "httptools" else "h11"
    # uvicorn's own grace period only covers connections the drain left (it has already ended every stream).
    config = uvicorn.Config(
        app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=FLUSH_S, http=protocol,
        loop=chosen[1],
    )  # fmt: skip
    server = DrainingServer(config, app.state.engine, drain_timeout)
    server.http_loop = chosen
    log.info("%s", _describe_http_loop(chosen, (http, loop)))
    # A rank of a parallel world that fails leaves nothing to serve: drain and exit (non-zero), so that a
    # supervisor restarts the server rather than it lingering with a dead world.
    app.state.engine.on_fatal = lambda reason: server.handle_exit(signal.SIGTERM, None)
    return server


def bind_socket(host: str, port: int) -> socket.socket:
    """The server's listening address, taken before the model loads: a port in use is an error in a second, not
    after minutes of loading, and nothing started meanwhile (a parallel LLM's rendezvous port, say) can take it.

    Raises:
        OSError: the address cannot be bound (in use, not this machine's, no permission).
    """
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    family, kind, proto, _, addr = infos[0]
    # The protocol number (IPPROTO_TCP, not 0) matters: asyncio turns Nagle's algorithm off (TCP_NODELAY) only on the
    # connections of a socket that says it is TCP. With Nagle on, an SSE chunk written while the previous write is
    # unacknowledged waits for the client's delayed ACK (up to 40 ms on Linux): +25 ms of TTFT (bench_api).
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
    except OSError:
        sock.close()
        raise
    return sock


def run_server(
    app: Any,
    *,
    host: str,
    port: int,
    log_level: str = "info",
    drain_timeout: float = 30.0,
    sock: socket.socket | None = None,
    http: str = "auto",
    loop: str = "auto",
) -> None:
    """Serve ``app`` until SIGINT / SIGTERM; in-flight requests get ``drain_timeout`` seconds to finish. ``sock``: an
    address bound already (`bind_socket`), else ``host:port`` is bound now. ``http`` / ``loop``: uvicorn's HTTP parser
    and event loop (`make_server`; default: httptools and uvloop when installed)."""
    server = make_server(app, host=host, port=port, log_level=log_level, drain_timeout=drain_timeout, http=http,
                         loop=loop)  # fmt: skip
    # What start-up made (modules, the tokenizer, the app: ~200k objects) moves to the garbage collector's permanent
    # generation: a full collection otherwise walks all of it, a 50-70 ms stall of the event loop (bench_api, a
    # 2-core CPU) every few hundred requests.
    gc.collect()
    gc.freeze()
    server.run(sockets=[sock] if sock is not None else None)
