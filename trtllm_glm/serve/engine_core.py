"""The engine process of ``trtllm-glm serve``: it owns the `LLM` and steps it; the API process talks to it over
ZeroMQ (`engine_client`, messages in `engine_messages`).

The engine is the runtime's `AsyncEngine` with remote callers (`CoreEngine`: an `AddRequest` enters the inbox with a
`_RemoteStream` standing for the API's `ResultStream`; one `StepOutput` per loop iteration carries every delta,
acknowledgements and changed stats) and the Prometheus registry. It runs with ``detokenize=False``: text and stop
strings are the API process's, which aborts a stopped request here (`AbortRequest`). It ignores SIGINT, exits after a
`StopEngine` drain or when its parent dies (stopping a parallel LLM's ranks first). Why and how: docs/serving.md,
"Processes".
"""

from __future__ import annotations

import gc
import logging
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from ..runtime.async_engine import Delta, GenerationRequest
from ..runtime.grammar import GuidedDecodingParams
from ..runtime.sampling import SamplingParams
from ..runtime.step_log import StepLog
from .describe import describe_engine
from .engine import AsyncEngine
from .engine_messages import (
    AbortRequest,
    Ack,
    AddRequest,
    CountRejected,
    DeltaMsg,
    EngineFailed,
    EngineFatal,
    EngineReady,
    EngineStopped,
    MetricsPage,
    ScrapeMetrics,
    StepOutput,
    StopEngine,
    new_encoder,
    to_engine_decoder,
)

__all__ = ["CoreConfig", "CoreEngine", "run_engine_core"]

log = logging.getLogger("trtllm_glm.serve")

# How often the command loop looks at its parent and the engine thread while no command comes (seconds).
POLL_S = 0.2
# Seconds the engine process gets to stop its ranks once its parent is gone, before it exits regardless.
ORPHAN_EXIT_S = 10.0


@dataclass
class CoreConfig:
    """What the engine process is started with (pickled once, at spawn).

    Attributes:
        model: preset name or checkpoint directory.
        llm_options: ``LLM`` keyword arguments.
        max_queue_size: generations that may queue beyond the running batch.
        step_log: the step log's JSON-lines file, or ``None``.
        cmd_addr: the API's command socket (PUSH, bound; this process connects a PULL).
        out_addr: the API's output socket (PULL, bound; this process connects a PUSH).
        parent_pid: the API process (the engine exits when it is gone).
        log_level: the ``trtllm_glm`` logger's level in the API process.
        log_format: its stderr format.
    """

    model: str
    llm_options: dict[str, Any] = field(default_factory=dict)
    max_queue_size: int = 64
    step_log: str | None = None
    cmd_addr: str = ""
    out_addr: str = ""
    parent_pid: int = 0
    log_level: int = logging.INFO
    log_format: str = "%(levelname)s:     %(message)s"


class _Channel:
    """The PUSH socket to the API process, shared by this process's threads (a ZeroMQ socket is not
    thread-safe: the engine thread sends step outputs, the command loop metric pages and the final message)."""

    def __init__(self, sock: Any) -> None:
        self._sock = sock
        self._lock = threading.Lock()
        self._enc = new_encoder()

    def send(self, msg: Any) -> None:
        with self._lock:
            self._sock.send(self._enc.encode(msg), copy=False)


class _RemoteStream:
    """The engine's stand-in for an API-side `ResultStream` (the engine keys its bookkeeping by this object)."""

    __slots__ = ("key", "request_ids", "requests", "_loop")

    def __init__(self, key: int) -> None:
        self.key = key
        self.request_ids: list[int] = []
        self.requests: list[Any] = []
        self._loop = None


def _delta_msg(key: int, d: Delta) -> DeltaMsg:
    lps = None if d.logprobs is None else [{t: (v.logprob, v.rank) for t, v in m.items()} for m in d.logprobs]
    return DeltaMsg(key, d.index, d.token_ids, lps, d.finish_reason, d.error, d.num_prompt_tokens)


def _generation(prompt_ids: list[int], params: dict[str, Any]) -> GenerationRequest:
    p = dict(params)
    gd = p.get("guided_decoding")
    if gd is not None:
        p["guided_decoding"] = GuidedDecodingParams(**gd)
    return GenerationRequest(prompt_ids, SamplingParams(**p))


class CoreEngine(AsyncEngine):
    """The server's `AsyncEngine` serving remote callers: requests come from `post_add` / `post_abort` (the
    command loop's thread), each loop iteration's output leaves as one `StepOutput` on ``channel``."""

    def __init__(self, llm: Any, *, channel: _Channel, max_queue_size: int = 64, step_log: Any = None) -> None:
        super().__init__(llm, max_queue_size=max_queue_size, step_log=step_log, detokenize=False)
        self._channel = channel
        self._by_key: dict[int, _RemoteStream] = {}  # engine thread only
        self._acks: list[Ack] = []  # engine thread only: sent with the iteration's deltas
        self._sent_stats: dict[str, Any] | None = None

    # Command loop's thread
    def post_add(self, msg: AddRequest) -> None:
        """Queue an `AddRequest` (the API process checked capacity and parameters already)."""
        gens = [_generation(g.prompt_ids, g.params) for g in msg.gens]
        with self._cv:
            self._live += len(gens)
            self._inbox.append(("add", _RemoteStream(msg.key), gens, msg.key, msg.arrival, time.perf_counter()))
            self._cv.notify_all()

    def post_abort(self, key: int, reason: str, index: int = -1) -> None:
        """Abort request ``key``'s generations (``index >= 0``: that one only)."""
        self._post(("abort_key", key, reason, index))

    # Engine thread
    def _handle(self, cmd: tuple) -> None:
        if cmd[0] == "add":
            self._by_key[cmd[1].key] = cmd[1]
        elif cmd[0] == "abort_key":
            _, key, reason, index = cmd
            stream = self._by_key.get(key)
            if stream is None:  # finished, refused or never added: nothing to abort
                return
            if index >= 0:
                for t in self._streams.get(id(stream), []):
                    if t.index == index and not t.done:
                        self._abort_track(t, reason)
                return
            cmd = ("abort", stream, reason)
        super()._handle(cmd)

    def _resolve(self, fut: Any, exc: BaseException | None) -> None:
        # ``fut`` is the request's key: its acknowledgement goes out with this iteration's output.
        if exc is None:
            self._acks.append(Ack(fut))
        else:
            self._by_key.pop(fut, None)
            self._acks.append(Ack(fut, type(exc).__name__, str(exc)))

    def _finish(self, t: Any, d: Delta, reason: str, now: float) -> None:
        super()._finish(t, d, reason, now)
        if id(t.stream) not in self._streams:  # every generation of the request is done
            self._by_key.pop(t.stream.key, None)

    def _hand_over(self, batch: list[tuple[Any, list[Delta]]]) -> None:
        stats = self._stats
        changed = stats != self._sent_stats
        if not batch and not self._acks and not changed:
            return
        deltas = [_delta_msg(stream.key, d) for stream, ds in batch for d in ds]
        acks, self._acks = self._acks, []
        self._channel.send(StepOutput(acks, deltas, dict(stats) if changed else None))
        self._sent_stats = dict(stats)


def _setup_logging(cfg: CoreConfig) -> None:
    pkg = logging.getLogger("trtllm_glm")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(cfg.log_format))
    pkg.addHandler(handler)
    pkg.setLevel(cfg.log_level)


def _start_lines(engine: AsyncEngine, llm: Any, model: str, load_s: float) -> list[str]:
    lines = describe_engine(engine, model, load_s)
    lines.append(f"engine process: pid {os.getpid()}")
    if getattr(llm, "warmup_report", None) is not None:
        lines.append(llm.warmup_report.describe())
    return lines


def run_engine_core(cfg: CoreConfig) -> None:
    """The engine process's body (a ``multiprocessing`` spawn target): build the `LLM`, say `EngineReady` (or
    `EngineFailed`), then serve commands until `StopEngine` or the parent's death."""
    import zmq

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the API process drains on Ctrl-C; it stops this one
    _setup_logging(cfg)
    ctx = zmq.Context()
    out = ctx.socket(zmq.PUSH)
    out.setsockopt(zmq.SNDHWM, 0)  # never block the engine thread: the API process reads as fast as it can
    out.setsockopt(zmq.LINGER, 5000)  # the last messages (EngineStopped) reach the API before the exit
    out.connect(cfg.out_addr)
    cmd = ctx.socket(zmq.PULL)
    cmd.setsockopt(zmq.RCVHWM, 0)
    cmd.setsockopt(zmq.LINGER, 0)
    cmd.connect(cfg.cmd_addr)
    channel = _Channel(out)
    llm = None
    started = _watch_parent_while_starting(cfg.parent_pid)
    try:
        from ..runtime.llm import LLM

        t0 = time.perf_counter()
        llm = LLM(model=cfg.model, **cfg.llm_options)
        step_log = StepLog(cfg.step_log) if cfg.step_log is not None else None
        engine = CoreEngine(llm, channel=channel, max_queue_size=cfg.max_queue_size, step_log=step_log)
        lines = _start_lines(engine, llm, cfg.model, time.perf_counter() - t0)
        engine.on_fatal = lambda reason: channel.send(EngineFatal("rank", str(reason)))
        # What start-up made (the model's modules and tensors, the tokenizer, compiled kernels' wrappers) moves to the
        # collector's permanent generation: a full collection otherwise walks all of it on the engine thread, a
        # stall of one step (the API process does the same, `server.run_server`).
        gc.collect()
        gc.freeze()
        engine.start()
        channel.send(EngineReady(
            os.getpid(), llm.config.to_dict(), engine.vocab_size, engine.max_seq_len,
            engine.executor.cfg.max_batch_size, engine.capacity, lines, dict(engine.stats()),
        ))  # fmt: skip
        started.set()  # the command loop watches the parent from here (`_orphaned`)
    except BaseException as e:  # noqa: BLE001 - the API process re-raises it as one line
        channel.send(EngineFailed(type(e).__name__, str(e)))
        if llm is not None:
            llm.shutdown()
        out.close()
        cmd.close(linger=0)
        ctx.term()
        sys.exit(1)
    try:
        _serve_commands(cfg, engine, channel, cmd)
    finally:
        llm.shutdown()  # the rank processes of a parallel LLM
        out.close()
        cmd.close()
        ctx.term()


def _serve_commands(cfg: CoreConfig, engine: CoreEngine, channel: _Channel, cmd: Any) -> None:
    """The command loop (this process's main thread) until the drain is over or the parent is gone."""
    import zmq

    dec = to_engine_decoder()
    poller = zmq.Poller()
    poller.register(cmd, zmq.POLLIN)
    stopper: threading.Thread | None = None
    loop_death_sent = False
    while True:
        if os.getppid() != cfg.parent_pid:
            _orphaned(engine)
        if stopper is not None and not stopper.is_alive():
            return
        thread = engine._thread
        if stopper is None and not loop_death_sent and thread is not None and not thread.is_alive():
            loop_death_sent = True  # the loop died (its requests got their error deltas): the server exits
            channel.send(EngineFatal("loop", f"the engine loop died: {engine._dead!r}"))
        if not poller.poll(POLL_S * 1000):
            continue
        while True:
            try:
                raw = cmd.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                break
            msg = dec.decode(raw.buffer)
            if isinstance(msg, AddRequest):
                engine.post_add(msg)
            elif isinstance(msg, AbortRequest):
                engine.post_abort(msg.key, msg.reason, msg.index)
            elif isinstance(msg, CountRejected):
                engine.metrics.requests_rejected.labels(reason=msg.reason).inc()
            elif isinstance(msg, ScrapeMetrics):
                if msg.generated:
                    engine.metrics.generation_tokens.inc(msg.generated)
                channel.send(MetricsPage(msg.token, engine.metrics.render()))
            elif isinstance(msg, StopEngine) and stopper is None:
                # Off this thread: the drain takes up to drain_timeout, and aborts (clients leaving) and scrapes
                # must still be answered meanwhile.
                def drain(timeout: float = msg.drain_timeout) -> None:
                    engine.stop(timeout)
                    channel.send(EngineStopped())

                stopper = threading.Thread(target=drain, name="trtllm-glm-engine-drain", daemon=True)
                stopper.start()


def _watch_parent_while_starting(parent_pid: int) -> threading.Event:
    """Exit this process if the API process dies before start-up is over; returns the event that ends the watch.

    Start-up (building the LLM, its warm-up: minutes on a cold Triton cache) runs on the main thread, before the
    command loop that notices a dead parent (`_serve_commands`). An API process killed meanwhile (a SIGTERM with
    no handler yet, a SIGKILL) left this one warming up for minutes, holding the GPU's memory: the next server on
    the card could not load its model (an H100 run of 2026-12-07). Nothing made so far needs saving: the rank
    processes of a parallel LLM started so far are terminated, then the process exits."""
    started = threading.Event()

    def watch() -> None:
        while not started.wait(POLL_S):
            if os.getppid() != parent_pid:
                log.warning("the API process is gone during start-up; the engine process exits")
                import multiprocessing as mp

                for child in mp.active_children():
                    child.terminate()
                os._exit(1)

    threading.Thread(target=watch, name="trtllm-glm-engine-start-watch", daemon=True).start()
    return started


def _orphaned(engine: CoreEngine) -> None:
    """The API process is gone: nobody can read what this process makes. Stop the engine and the LLM's rank
    processes, and exit (within `ORPHAN_EXIT_S` whatever happens)."""
    log.warning("the API process is gone; the engine process exits")
    threading.Timer(ORPHAN_EXIT_S, os._exit, args=(1,)).start()
    try:
        engine.stop(0.0)
        engine.llm.shutdown()
    finally:
        os._exit(1)
