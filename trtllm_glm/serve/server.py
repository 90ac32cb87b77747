"""Build the engine and app for ``trtllm-glm serve`` and run them under uvicorn, with the server's own drain.

Shutdown (SIGINT / SIGTERM): the listening socket stays open while the engine drains, so a new request gets
HTTP 503 with ``Retry-After`` (not a refused connection); in-flight requests get ``drain_timeout`` seconds
to finish, the rest are aborted (a stream ends with ``finish_reason: "abort"`` and ``data: [DONE]``), and
only then does uvicorn close the connections and exit. A second signal exits at once.
"""

from __future__ import annotations

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
from .reasoning import resolve_reasoning_parser

__all__ = ["make_app", "make_server", "run_server", "bind_socket", "describe_engine", "DrainingServer"]

log = logging.getLogger("trtllm_glm.serve")

# Seconds the final chunks of aborted streams get to reach their clients once the drain ends.
FLUSH_S = 5.0


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
    app: Any, *, host: str, port: int, log_level: str = "info", drain_timeout: float = 30.0
) -> DrainingServer:
    """The uvicorn server of ``app`` with the engine's drain on the first exit signal (`DrainingServer`)."""
    # uvicorn's own grace period only covers connections the drain left (it has already ended every stream).
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=FLUSH_S)
    server = DrainingServer(config, app.state.engine, drain_timeout)
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
) -> None:
    """Serve ``app`` until SIGINT / SIGTERM; in-flight requests get ``drain_timeout`` seconds to finish. ``sock``: an
    address bound already (`bind_socket`), else ``host:port`` is bound now."""
    server = make_server(app, host=host, port=port, log_level=log_level, drain_timeout=drain_timeout)
    # What start-up made (modules, the tokenizer, the app: ~200k objects) moves to the garbage collector's permanent
    # generation: a full collection otherwise walks all of it, a 50-70 ms stall of the event loop (bench_api, a
    # 2-core CPU) every few hundred requests.
    gc.collect()
    gc.freeze()
    server.run(sockets=[sock] if sock is not None else None)
