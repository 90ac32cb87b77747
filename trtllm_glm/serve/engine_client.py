"""The API process's side of the engine process: `EngineClient`, what the app serves when the engine runs in a
process of its own (`engine_core` is the other side, `engine_messages` the wire).

It has the interface the app uses of an in-process `AsyncEngine`, so the routes do not know where the engine runs.
One receiver thread reads the engine's messages: per `StepOutput` it resolves acknowledged submissions, detokenizes
each generation's new tokens (`OutputProcessor`) and hands every stream its deltas, field for field the in-process
engine's. A failed start-up is re-raised as the engine process's exception (its class when the command line reports
it as one line, else ``RuntimeError``). Processes, the wire and faults: docs/serving.md, "Processes".
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import multiprocessing as mp
import os
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ..config import ConfigError, Glm5NextConfig
from ..errors import CapacityError, CheckpointError
from ..runtime.async_engine import Delta, EngineStoppedError, GenerationRequest, QueueFullError, ResultStream
from ..runtime.grammar import GrammarCompiler
from ..runtime.output import OutputProcessor
from ..runtime.sampling import Logprob
from ..runtime.step_log import now
from ..runtime.tokenizer import load_tokenizer
from .engine_core import CoreConfig, run_engine_core
from .engine_messages import (
    AbortRequest,
    AddRequest,
    CountRejected,
    EngineFailed,
    EngineFatal,
    EngineReady,
    EngineStopped,
    GenSpec,
    MetricsPage,
    ScrapeMetrics,
    StepOutput,
    StopEngine,
    from_engine_decoder,
    new_encoder,
)

__all__ = ["EngineClient"]

log = logging.getLogger("trtllm_glm.serve")

# Exceptions a failed start-up is re-raised as (by class name); anything else becomes a RuntimeError.
_START_ERRORS: dict[str, type[BaseException]] = {
    c.__name__: c
    for c in (ConfigError, CheckpointError, CapacityError, ValueError, TypeError, RuntimeError, OSError,
              FileNotFoundError, NotADirectoryError, IsADirectoryError, PermissionError, ImportError)
}  # fmt: skip
# Exceptions a refused submission is re-raised as (the app answers them with a 400).
_SUBMIT_ERRORS: dict[str, type[BaseException]] = {"CapacityError": CapacityError, "ValueError": ValueError}
# Seconds a /metrics scrape waits for the engine's page before answering with the last one.
SCRAPE_TIMEOUT_S = 10.0
# Seconds the engine process gets to exit after its drain (it stops a parallel LLM's ranks) before it is killed.
EXIT_TIMEOUT_S = 30.0


def describe_exit(code: int | None) -> str:
    """How a process ended, in words (``exitcode`` of a ``multiprocessing`` process)."""
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit status {code}"


class _Metrics:
    """What the app records itself (its rejections); counted in the engine process's registry."""

    def __init__(self, client: EngineClient) -> None:
        self.requests_rejected = _RejectedCounter(client)


class _RejectedCounter:
    def __init__(self, client: EngineClient, reason: str | None = None) -> None:
        self._client, self._reason = client, reason

    def labels(self, *, reason: str) -> _RejectedCounter:
        return _RejectedCounter(self._client, reason)

    def inc(self, amount: int = 1) -> None:
        for _ in range(amount):
            self._client._send(CountRejected(self._reason or ""))


@dataclass
class _Gen:
    """One generation's output processing (receiver thread)."""

    proc: OutputProcessor
    consumed: int = 0  # tokens handed to the stream
    done: bool = False  # its final delta went to the stream (a stop string may end it before the engine does)


@dataclass
class _Open:
    """A submission whose generations are not all finished in the engine (receiver thread and submitters, under
    the lock)."""

    stream: ResultStream
    loop: asyncio.AbstractEventLoop
    prompt_lens: list[int]
    gens: list[_Gen]
    fut: asyncio.Future[None] | None  # until acknowledged
    running: set[int] = field(default_factory=set)  # generation indices the engine has not finished


class EngineClient:
    """Starts the engine process, waits until it is ready, and serves its engine to asyncio callers.

    Args:
        model: preset name or checkpoint directory, as ``LLM(model=...)``.
        llm_options: ``LLM`` keyword arguments.
        max_queue_size: generations that may queue beyond the running batch.
        step_log: the engine's step log file (written by the engine process).

    Raises:
        The engine process's start-up error (see the module docstring).
    """

    def __init__(
        self,
        model: str | os.PathLike[str],
        llm_options: dict[str, Any] | None = None,
        *,
        max_queue_size: int = 64,
        step_log: str | os.PathLike[str] | None = None,
    ) -> None:
        import zmq

        # A model that is not there is a one-line error now, not after an engine process has started to load it.
        Glm5NextConfig.from_pretrained(model)
        self.max_queue_size = max_queue_size
        self.llm = None  # the LLM lives in the engine process
        self.executor = None
        self.step_log = None
        self.on_fatal: Any = None
        self.down_reason: str | None = None  # why the engine process is gone (it died, or it was stopped)
        self._fatal: str | None = None  # a rank of a parallel LLM failed (the engine's reason)
        self._lock = threading.Lock()  # the bookkeeping below (event loop and receiver thread)
        self._send_lock = threading.Lock()  # the command socket (any thread; a ZeroMQ socket is not thread-safe)
        self._accepting = False
        self._alive = True
        self._stop_sent = False
        self._stopped = threading.Event()
        self._live = 0
        self._open: dict[int, _Open] = {}
        self._keys = itertools.count(1)
        self._scrapes: dict[int, tuple[asyncio.Future[bytes], asyncio.AbstractEventLoop]] = {}
        self._last_page = b""
        self._generated = 0  # tokens returned to clients since the last scrape (the engine's counter adds them)
        self._stats: dict[str, Any] = {}
        self._enc = new_encoder()
        self._dec = from_engine_decoder()
        self._receiver: threading.Thread | None = None
        self._dir = tempfile.mkdtemp(prefix="trtllm-glm-")
        self._ctx = zmq.Context()
        self._cmd = self._ctx.socket(zmq.PUSH)
        self._cmd.setsockopt(zmq.SNDHWM, 0)
        self._cmd.setsockopt(zmq.LINGER, 0)
        self._cmd.bind(f"ipc://{self._dir}/cmd")
        self._out = self._ctx.socket(zmq.PULL)
        self._out.setsockopt(zmq.RCVHWM, 0)
        self._out.setsockopt(zmq.LINGER, 0)
        self._out.bind(f"ipc://{self._dir}/out")
        pkg = logging.getLogger("trtllm_glm")
        fmt = next((h.formatter._fmt for h in pkg.handlers if h.formatter is not None), None)  # type: ignore[union-attr]
        cfg = CoreConfig(
            model=os.fspath(model), llm_options=dict(llm_options or {}), max_queue_size=max_queue_size,
            step_log=os.fspath(step_log) if step_log is not None else None, cmd_addr=f"ipc://{self._dir}/cmd",
            out_addr=f"ipc://{self._dir}/out", parent_pid=os.getpid(), log_level=pkg.getEffectiveLevel(),
            log_format=fmt or "%(levelname)s:     %(message)s",
        )  # fmt: skip
        # spawn: a fresh interpreter (no CUDA state or threads copied from this one), and not a daemon, so that
        # the LLM in it may start the rank processes of a parallel world.
        self._proc = mp.get_context("spawn").Process(
            target=run_engine_core, args=(cfg,), name="trtllm-glm-engine", daemon=False
        )
        try:
            self._proc.start()
            ready = self._wait_ready()
            config = Glm5NextConfig.from_dict(ready.config)
            self.tokenizer = load_tokenizer(model, config)
        except BaseException:
            self.close()
            raise
        self.pid = ready.pid
        self.vocab_size = ready.vocab_size
        self.max_seq_len = ready.max_seq_len
        self.max_batch_size = ready.max_batch_size
        self.capacity = ready.capacity
        self.start_lines = list(ready.lines)
        self._stats = dict(ready.stats)
        self.grammar_compiler = GrammarCompiler(self.tokenizer, self.vocab_size, config.eos_token_ids)
        self.metrics = _Metrics(self)

    # --------------------------------------------------------------------------------------------
    # Lifecycle
    def _wait_ready(self) -> EngineReady:
        import zmq

        poller = zmq.Poller()
        poller.register(self._out, zmq.POLLIN)
        poller.register(self._proc.sentinel, zmq.POLLIN)
        while True:
            events = dict(poller.poll(1000))
            if self._out in events:
                msg = self._dec.decode(self._out.recv())
                if isinstance(msg, EngineReady):
                    return msg
                if isinstance(msg, EngineFailed):
                    raise _START_ERRORS.get(msg.error_type, RuntimeError)(msg.message)
            elif self._proc.sentinel in events:
                self._proc.join(5.0)
                raise RuntimeError(
                    f"the engine process ended while starting ({describe_exit(self._proc.exitcode)}); its log is above"
                )

    def start(self) -> None:
        """Start accepting work (the engine process serves already); idempotent."""
        if self._receiver is not None:
            return
        self._accepting = True
        self._receiver = threading.Thread(target=self._receive, name="trtllm-glm-engine-client", daemon=True)
        self._receiver.start()

    def stop(self, drain_timeout: float = 30.0) -> None:
        """Refuse new work, let the engine drain (live requests get ``drain_timeout`` seconds, the rest are
        aborted and their streams end with ``abort``), then wait for the engine process to exit. Blocking."""
        with self._lock:
            self._accepting = False
            send = not self._stop_sent and self._alive
            self._stop_sent = True
        if send:
            self._send(StopEngine(max(0.0, drain_timeout)))
        if self._receiver is None:  # never started: nobody reads the engine's messages
            self._stopped.set()
        deadline = time.monotonic() + max(0.0, drain_timeout) + EXIT_TIMEOUT_S
        while not self._stopped.is_set() and self._proc.is_alive() and time.monotonic() < deadline:
            self._stopped.wait(0.05)
        self.close()

    def close(self) -> None:
        """End the engine process (if it still runs after `EXIT_TIMEOUT_S`: terminated, then killed) and free
        the sockets. Idempotent."""
        proc = getattr(self, "_proc", None)
        if proc is not None and proc._popen is not None:  # started
            with self._lock:
                send = not self._stop_sent and self._alive
                self._stop_sent = True
            if send:  # never stopped (uvicorn did not run, a failed start-up): no drain, only its own shutdown
                self._send(StopEngine(0.0))
            proc.join(EXIT_TIMEOUT_S)  # it stops a parallel LLM's ranks before it exits
            if proc.is_alive():
                proc.terminate()
                proc.join(5.0)
            if proc.is_alive():
                proc.kill()
                proc.join(5.0)
        with self._lock:
            self._accepting = False
        if self._receiver is not None and self._receiver is not threading.current_thread():
            self._receiver.join(5.0)
        with self._send_lock:
            if self._ctx.closed:
                return
            self._cmd.close(linger=0)
            self._out.close(linger=0)
            self._ctx.term()
            shutil.rmtree(self._dir, ignore_errors=True)

    @property
    def running(self) -> bool:
        """The engine process is alive and this client accepts work."""
        return self._accepting and self._alive and self.down_reason is None

    def stats(self) -> dict[str, Any]:
        """The engine's latest stats (as `AsyncEngine.stats`; sent with its step outputs) with this process's
        count of live generations."""
        with self._lock:
            out = dict(self._stats)
            out["live"] = self._live
            return out

    def fatal_error(self) -> str | None:
        """Why the LLM cannot serve any more (a rank of its parallel world failed), else ``None``."""
        return self._fatal

    async def render_metrics(self) -> bytes:
        """The engine's ``/metrics`` page (its registry holds every counter; the last page once it is gone)."""
        if not self._alive:
            return self._last_page
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[bytes] = loop.create_future()
        token = next(self._keys)
        with self._lock:
            self._scrapes[token] = (fut, loop)
            generated, self._generated = self._generated, 0
        self._send(ScrapeMetrics(token, generated))
        try:
            return await asyncio.wait_for(fut, SCRAPE_TIMEOUT_S)
        except asyncio.TimeoutError:
            return self._last_page
        finally:
            with self._lock:
                self._scrapes.pop(token, None)

    # --------------------------------------------------------------------------------------------
    # Callers (event loop)
    async def submit(self, requests: Sequence[GenerationRequest], arrival: float | None = None) -> ResultStream:
        """Queue generations together (all or none); as `AsyncEngine.submit` (``arrival``: ``perf_counter``, the
        same clock in the engine process)."""
        loop = asyncio.get_running_loop()
        n = len(requests)
        if n == 0:
            raise ValueError("nothing to generate")
        stream = ResultStream(self, loop, n)  # type: ignore[arg-type]
        fut: asyncio.Future[None] = loop.create_future()
        with self._lock:
            if not self.running:
                raise EngineStoppedError(self.down_reason or "the engine is shutting down")
            if n > self.capacity:
                raise ValueError(f"{n} sequences can never fit: the server holds at most {self.capacity} at once")
            if self._live + n > self.capacity:
                raise QueueFullError(
                    f"server overloaded: {self._live} sequences live, capacity {self.capacity} "
                    f"(max_batch_size {self.max_batch_size} + max_queue_size {self.max_queue_size})"
                )
            key = next(self._keys)
            stream.request_ids = [key]
            self._live += n
            self._open[key] = _Open(
                stream, loop, [len(g.prompt_ids) for g in requests],
                [_Gen(OutputProcessor(self.tokenizer, g.stop)) for g in requests], fut, set(range(n)),
            )  # fmt: skip
            gens = [GenSpec(list(g.prompt_ids), _params(g)) for g in requests]
            self._send(AddRequest(key, gens, now() if arrival is None else arrival))
        try:
            await fut
        except asyncio.CancelledError:
            stream.abort()  # the engine handles the add first (one command socket, in order)
            raise
        return stream

    def _post(self, cmd: tuple) -> None:
        """`ResultStream.abort`'s way in: ``("abort", stream, reason)``."""
        _, stream, reason = cmd
        if stream.request_ids:
            self._send(AbortRequest(stream.request_ids[0], reason))

    def _send(self, msg: Any) -> None:
        import zmq

        with self._send_lock:
            if self._ctx.closed:
                return
            with contextlib.suppress(zmq.Again):  # no engine connected any more: nobody to tell
                self._cmd.send(self._enc.encode(msg), zmq.NOBLOCK)

    # --------------------------------------------------------------------------------------------
    # Receiver thread
    def _receive(self) -> None:
        import zmq

        poller = zmq.Poller()
        poller.register(self._out, zmq.POLLIN)
        poller.register(self._proc.sentinel, zmq.POLLIN)
        try:
            while True:
                events = dict(poller.poll(500))
                if self._out in events:
                    self._drain_messages()
                if self._proc.sentinel in events:
                    self._drain_messages()  # what it sent before it ended
                    self._engine_gone()
                    return
                if self._ctx.closed:
                    return
        except zmq.ZMQError:  # the sockets were closed under us (close() after the process ended)
            return

    def _drain_messages(self) -> None:
        import zmq

        while True:
            try:
                raw = self._out.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            self._handle(self._dec.decode(raw.buffer))

    def _handle(self, msg: Any) -> None:
        if isinstance(msg, StepOutput):
            self._deliver(msg)
        elif isinstance(msg, MetricsPage):
            self._last_page = msg.body
            with self._lock:
                entry = self._scrapes.pop(msg.token, None)
            if entry is not None:
                fut, loop = entry
                with contextlib.suppress(RuntimeError):
                    loop.call_soon_threadsafe(_set_result, fut, msg.body)
        elif isinstance(msg, EngineFatal):
            if msg.kind == "rank":
                self._fatal = msg.reason
            else:
                self.down_reason = msg.reason
            log.error("%s: the server shuts down", msg.reason)
            if self.on_fatal is not None:
                self.on_fatal(msg.reason)
        elif isinstance(msg, EngineStopped):
            self._stopped.set()

    def _deliver(self, msg: StepOutput) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, tuple[list, list]] = {}
        stops: list[AbortRequest] = []
        with self._lock:
            for ack in msg.acks:
                o = self._open.get(ack.key)
                if o is None or o.fut is None:
                    continue
                exc = None
                if ack.error_type is not None:
                    exc = _SUBMIT_ERRORS.get(ack.error_type, RuntimeError)(ack.message)
                    del self._open[ack.key]
                    self._live -= len(o.prompt_lens)
                by_loop.setdefault(o.loop, ([], []))[0].append((o.fut, exc))
                o.fut = None
            for dm in msg.deltas:
                o = self._open.get(dm.key)
                if o is None:
                    continue
                ended = dm.finish_reason is not None  # in the engine
                if ended and dm.index in o.running:
                    o.running.discard(dm.index)
                    self._live -= 1
                    if not o.running:
                        del self._open[dm.key]
                g = o.gens[dm.index]
                if g.done:  # a stop string ended it here: what the engine made since is dropped
                    continue
                d = self._output(g, dm)
                if d is None:
                    continue
                if d.finish_reason == "stop" and not ended:  # a stop string: the engine still runs it
                    stops.append(AbortRequest(dm.key, "stop", dm.index))
                batch = by_loop.setdefault(o.loop, ([], []))[1]
                if batch and batch[-1][0] is o.stream:
                    batch[-1][1].append(d)
                else:
                    batch.append((o.stream, [d]))
            if msg.stats is not None:
                self._stats = msg.stats
        for loop, (acks, batch) in by_loop.items():
            with contextlib.suppress(RuntimeError):  # the caller's loop is closed: nobody is listening
                loop.call_soon_threadsafe(_deliver_step, acks, batch)
        for stop in stops:
            self._send(stop)

    def _output(self, g: _Gen, dm: Any) -> Delta | None:
        """The in-process engine's delta (`AsyncEngine._collect_one`, its finish included) from a generation's new
        tokens; ``None`` when there is nothing to send."""
        proc = g.proc
        lps = dm.logprobs
        d = Delta(dm.index, num_prompt_tokens=dm.num_prompt_tokens, logprobs=None if lps is None else [])
        for j, tok in enumerate(dm.token_ids):
            if proc.stopped:
                break
            d.text_offsets.append(proc.decoded_len)
            d.text += proc.add(tok)
            d.token_ids.append(tok)
            if d.logprobs is not None and j < len(lps):
                d.logprobs.append({t: Logprob(lp, rank) for t, (lp, rank) in lps[j].items()})
            g.consumed += 1
        self._generated += len(d.token_ids)
        if proc.stopped:
            d.finish_reason = "stop"
        elif dm.finish_reason is not None:
            # A generation that ended by itself (a stop token, EOS, its length) releases the text held back; one
            # aborted or failed does not (as in-process: `AsyncEngine._abort_track`, `_fail_track`).
            if dm.error is None and dm.finish_reason in ("stop", "length"):
                d.text += proc.finish()
            d.finish_reason, d.error = dm.finish_reason, dm.error
        elif not d.token_ids:
            return None
        d.num_output_tokens = g.consumed
        g.done = d.finish_reason is not None
        return d

    def _engine_gone(self) -> None:
        """The engine process exited: fail what is live; if nobody asked it to stop, the server must exit."""
        self._proc.join(1.0)
        how = describe_exit(self._proc.exitcode)
        asked = self._stop_sent and self._stopped.is_set()
        reason = "the engine stopped" if asked else f"the engine process died ({how})"
        with self._lock:
            self._alive = False
            if not asked and self.down_reason is None:
                self.down_reason = reason
            opened, self._open = self._open, {}
            scrapes, self._scrapes = self._scrapes, {}
            self._live = 0
        by_loop: dict[asyncio.AbstractEventLoop, tuple[list, list]] = {}
        for o in opened.values():
            acks, batch = by_loop.setdefault(o.loop, ([], []))
            if o.fut is not None:
                acks.append((o.fut, EngineStoppedError(reason)))
            deltas = [Delta(i, num_prompt_tokens=o.prompt_lens[i], finish_reason="error", error=reason)
                      for i in sorted(o.running) if not o.gens[i].done]  # fmt: skip
            if deltas:
                batch.append((o.stream, deltas))
        for loop, (acks, batch) in by_loop.items():
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(_deliver_step, acks, batch)
        for fut, loop in scrapes.values():
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(_set_result, fut, self._last_page)
        self._stopped.set()
        if not asked:
            log.error("%s: in-flight requests failed; the server shuts down", reason)
            if self.on_fatal is not None:
                self.on_fatal(reason)


def _params(g: GenerationRequest) -> dict[str, Any]:
    """A `SamplingParams` as a mapping of its fields (the guided-decoding spec as one too)."""
    import dataclasses

    p = {f.name: getattr(g.params, f.name) for f in dataclasses.fields(g.params) if f.init}
    gd = p.get("guided_decoding")
    if gd is not None:
        p["guided_decoding"] = {f.name: getattr(gd, f.name) for f in dataclasses.fields(gd) if f.init}
    return p


def _set_result(fut: asyncio.Future, value: Any) -> None:
    if not fut.done():
        fut.set_result(value)


def _deliver_step(
    acks: list[tuple[asyncio.Future, BaseException | None]], batch: list[tuple[ResultStream, list]]
) -> None:
    """On a caller's event loop: resolve the acknowledged submissions, then hand each stream its deltas."""
    for fut, exc in acks:
        if fut.done():
            continue
        if exc is None:
            fut.set_result(None)
        else:
            fut.set_exception(exc)
    for stream, deltas in batch:
        stream._deliver(deltas)
