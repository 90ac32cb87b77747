"""`AsyncEngine`: continuous batching across concurrent callers on one background thread.

Both front doors run on it: `LLM.generate_async` and ``trtllm-glm serve`` (which passes its Prometheus
`ServeMetrics`; without one, nothing is recorded). One dedicated thread owns the executor and is the only one that
touches it; callers on an asyncio loop post commands to its inbox (add, abort) and receive per-request deltas through
their own `ResultStream` (``loop.call_soon_threadsafe``). Requests join and leave between steps. Failure isolation,
back-pressure and the drain: docs/serving.md, "The engine loop".
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ..jit_compiles import CompileCounter
from .output import OutputProcessor
from .request import Request
from .sampling import Logprob, SamplingParams
from .step_log import RequestTiming, StepLog, now

__all__ = [
    "AsyncEngine",
    "GenerationRequest",
    "Delta",
    "ResultStream",
    "EngineError",
    "QueueFullError",
    "EngineStoppedError",
]

log = logging.getLogger("trtllm_glm.serve")


class _NoMetrics:
    """Stands in for the server's `ServeMetrics` when nobody reads metrics (every call does nothing)."""

    def __getattr__(self, name: str) -> _NoMetrics:
        return self

    def __call__(self, *args: Any, **kwargs: Any) -> _NoMetrics:
        return self


class EngineError(RuntimeError):
    """The engine cannot take the request now (HTTP 503)."""


class QueueFullError(EngineError):
    """Running batch and queue are full; retry later."""


class EngineStoppedError(EngineError):
    """The engine is shutting down, stopped or dead."""


@dataclass
class GenerationRequest:
    """One sequence to generate.

    Attributes:
        prompt_ids: prompt token ids.
        params: sampling parameters (validated).
        stop: stop strings; the text is cut before the first one and the request ends (finish ``stop``).
    """

    prompt_ids: list[int]
    params: SamplingParams
    stop: Sequence[str] = ()


@dataclass
class Delta:
    """What one generation gained since its previous delta.

    Attributes:
        index: position of the generation in its `submit` call.
        text: newly released text.
        token_ids: new tokens (those after a stop string are dropped).
        logprobs: per new token ``{token_id: Logprob}`` (chosen token first) when asked for, else ``None``.
        text_offsets: per new token, where its text starts in the completion text.
        finish_reason: ``None`` while running; then ``stop``, ``length``, ``abort`` or ``error``.
        error: the message when ``finish_reason == "error"``.
        num_prompt_tokens: prompt length.
        num_output_tokens: tokens generated so far (after this delta).
    """

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] | None = None
    text_offsets: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0


class ResultStream:
    """Async iterator over the `Delta` objects of one `submit` call (its ``n`` generations, interleaved).

    Iteration ends after every generation delivered its final delta. `abort` (thread-safe, idempotent)
    stops the generations that are still running. A reader that falls behind gets the deltas that queued up for
    one generation merged into one (the text, tokens, logprobs and offsets of each, the last one's counts and
    finish reason), so that a loaded server sends fewer, larger chunks instead of falling further behind.
    """

    def __init__(self, engine: AsyncEngine, loop: asyncio.AbstractEventLoop, n: int) -> None:
        self._engine = engine
        self._loop = loop
        self._pending: collections.deque[Delta] = collections.deque()
        self._ready = asyncio.Event()
        self._open = n
        self.n = n
        self.request_ids: list[int] = []
        self.requests: list[Request] = []  # the executor's requests (read them only once finished)
        self.aborted = False

    @property
    def finished(self) -> bool:
        return self._open == 0

    def abort(self, reason: str = "abort") -> None:
        """Abort the generations still running (finish reason ``reason``)."""
        if not self.aborted and not self.finished:
            self.aborted = True
            self._engine._post(("abort", self, reason))

    def _deliver(self, deltas: list[Delta]) -> None:
        self._pending.extend(deltas)
        self._ready.set()

    def __aiter__(self) -> ResultStream:
        return self

    async def __anext__(self) -> Delta:
        if self._open == 0:
            raise StopAsyncIteration
        while not self._pending:
            self._ready.clear()
            await self._ready.wait()
        d = self._pending.popleft()
        while d.finish_reason is None and self._pending and self._pending[0].index == d.index:
            nxt = self._pending[0]
            if nxt.error is not None:
                break
            _merge_into(d, self._pending.popleft())
        if d.finish_reason is not None:
            self._open -= 1
        return d


def _merge_into(d: Delta, later: Delta) -> None:
    """``d`` followed by ``later`` (the same generation's next delta) as one delta, in ``d``."""
    d.text += later.text
    d.token_ids.extend(later.token_ids)
    d.text_offsets.extend(later.text_offsets)
    if d.logprobs is not None and later.logprobs is not None:
        d.logprobs.extend(later.logprobs)
    d.finish_reason, d.num_output_tokens = later.finish_reason, later.num_output_tokens


def _deliver_all(batch: list[tuple[ResultStream, list[Delta]]]) -> None:
    """On a caller's event loop: each stream's deltas into its queue (`AsyncEngine._flush`)."""
    for stream, deltas in batch:
        stream._deliver(deltas)


@dataclass
class _Track:
    """Engine-thread bookkeeping of one live generation."""

    req: Request
    stream: ResultStream
    index: int
    proc: OutputProcessor | None  # None: the caller detokenizes (``detokenize=False``)
    arrival: float
    posted: float | None = None  # entered the inbox (`RequestTiming.posted`)
    consumed: int = 0  # output tokens already processed
    first_token_t: float | None = None
    delivered_t: float | None = None  # the first token's flush
    last_token_t: float | None = None
    # Speculative counters already exported to the metrics.
    seen_rounds: int = 0
    seen_proposed: int = 0
    seen_accepted_pos: list[int] = field(default_factory=list)
    done: bool = False


def _prefix_counts(st: Any) -> tuple[int, ...]:
    """The prefix-cache counters `/metrics` exports, in `ServeMetrics` order (zeros without prefix caching)."""
    if st is None:
        return (0,) * 6
    return (st.queries, st.hits, st.reused_tokens, st.lost_requests, st.lost_tokens, st.checkpoints_skipped)


class AsyncEngine:
    """Serves an `LLM`'s executor to asyncio callers from one background thread.

    Args:
        llm: a built `trtllm_glm.LLM` (its ``executor`` and ``tokenizer`` are used; do not call
            ``llm.generate`` while the engine runs).
        max_queue_size: generations that may wait beyond the running batch before `submit` refuses.
        metrics: where to record: the server's `ServeMetrics` (default: nothing is recorded).
        step_log: a `StepLog` to attach to the executor (every step, and each request's time to its first
            token split into queue, prefill and delivery; runtime/step_log.py). ``None``: none.

    Times are ``time.perf_counter`` seconds (the step log's clock).
    """

    def __init__(
        self,
        llm: Any,
        *,
        max_queue_size: int = 64,
        metrics: Any | None = None,
        step_log: StepLog | None = None,
        detokenize: bool = True,
    ) -> None:
        if not isinstance(max_queue_size, int) or max_queue_size < 0:
            raise ValueError(f"max_queue_size must be an int >= 0, got {max_queue_size!r}")
        self.llm = llm
        self.executor = llm.executor
        self.tokenizer = llm.tokenizer
        self.metrics = metrics if metrics is not None else _NoMetrics()
        self.max_queue_size = max_queue_size
        self.step_log = step_log
        # False: deltas carry token ids and logprobs only, and the caller turns them into text, applies the stop
        # strings (aborting a generation a stop string ended) and counts the generated tokens it returns (the
        # engine process: its API process does that work, off the engine loop).
        self.detokenize = detokenize
        if step_log is not None:
            self.executor.step_log = step_log
            step_log.delivered_by_engine = True
        # Called once (from the engine thread) when the LLM's world of ranks failed: the server exits on it (a
        # supervisor restarts it) instead of lingering with a dead world.
        self.on_fatal: Any = None
        self._fatal_reported = False
        # Kernels compiled after `start` (each stalled a served step): a `CompileCounter` open while serving.
        self._compiles: CompileCounter | None = None
        self._compiles_seen = 0
        self._first_delivered: list[_Track] = []  # tracks whose first token is in the outbox
        self._retired: list[_Track] = []  # finished tracks whose timing the step log records at the flush
        self.capacity = self.executor.cfg.max_batch_size + max_queue_size
        self.max_seq_len: int = self.executor.max_seq_len
        self.vocab_size: int = self.executor.config.vocab_size
        self._cv = threading.Condition()
        self._inbox: list[tuple] = []
        self._live = 0  # generations submitted and not finished (guarded by _cv)
        self._accepting = False
        self._stop_now = False
        self._thread: threading.Thread | None = None
        self._dead: BaseException | None = None
        self._tracks: dict[int, _Track] = {}
        self._streams: dict[int, list[_Track]] = {}  # id(stream) -> its tracks
        self._outbox: dict[int, tuple[ResultStream, list[Delta]]] = {}
        self._last_preemptions = self.executor.num_preemptions
        self._last_unspeculated = getattr(self.executor, "num_unspeculated_rounds", 0)
        # Counters export what the engine's own requests did: whatever the executor counted before it (say
        # `LLM.generate` calls) is the starting point, as for steps and preemptions.
        st = self.executor.prefix.stats if self.executor.prefix is not None else None
        self._last_prefix = _prefix_counts(st)
        self._last_steps = self.executor.num_steps
        self._step_errors = 0
        self._stats: dict[str, Any] = {}
        # The gauges (page pool size above all) are right from the first scrape, not from the first request.
        self._export_gauges()

    # --------------------------------------------------------------------------------------------
    # Lifecycle (any thread)
    def start(self) -> None:
        """Capture the executor's CUDA graphs (if any) and start the engine thread (idempotent)."""
        if self._thread is not None:
            return
        # Capture every CUDA graph before serving (no-op without graphs, e.g. on the CPU): lazily captured
        # graphs would stall the first requests of each batch size.
        self.executor.capture_cuda_graphs()
        self._accepting = True
        # Kernels compiled from here on stalled a served step (the start-up warm-up should leave none): counted
        # in `/metrics` (kernel_compiles_total) and logged.
        self._compiles = CompileCounter().__enter__()
        self._thread = threading.Thread(target=self._run, name="trtllm-glm-engine", daemon=True)
        self._thread.start()

    def stop(self, drain_timeout: float = 30.0) -> None:
        """Refuse new work, let live requests finish for up to ``drain_timeout`` seconds, abort the rest,
        and join the engine thread. Blocking: from a coroutine use ``await asyncio.to_thread(engine.stop)``
        so that the event loop keeps delivering the final deltas."""
        with self._cv:
            self._accepting = False
            deadline = time.monotonic() + max(0.0, drain_timeout)
            while self._live > 0 and self._thread is not None and self._thread.is_alive():
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cv.wait(timeout=min(left, 0.05))
            self._stop_now = True
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=60.0)

    @property
    def running(self) -> bool:
        """The thread is alive and accepting work."""
        return self._accepting and self._dead is None and self._thread is not None and self._thread.is_alive()

    def stats(self) -> dict[str, Any]:
        """A snapshot taken by the engine thread after its latest iteration.

        Keys: ``live`` (generations submitted, not finished), ``running``, ``waiting`` (executor queue plus
        inbox), ``pages_used``, ``pages_total``, ``free_state_slots``, ``draft_pages_used``, ``num_steps``,
        ``num_preemptions``, ``step_errors``, ``prefix_cache_hits``, ``prefix_cache_reused_tokens``,
        ``prefix_cache_lost_tokens``.
        """
        with self._cv:
            out = dict(self._stats)
            out["live"] = self._live
            return out

    # --------------------------------------------------------------------------------------------
    # Callers (event loop)
    async def submit(self, requests: Sequence[GenerationRequest], arrival: float | None = None) -> ResultStream:
        """Queue generations together (all or none). ``arrival``: when the caller received them (``perf_counter``;
        default now), where their TTFT and queue time start.

        Returns:
            A `ResultStream` of their deltas.

        Raises:
            QueueFullError: no room in the running batch plus queue.
            EngineStoppedError: the engine is not running.
            ValueError / CapacityError: the executor refused a request (bad token id, prompt too long).
        """
        loop = asyncio.get_running_loop()
        n = len(requests)
        if n == 0:
            raise ValueError("nothing to generate")
        stream = ResultStream(self, loop, n)
        fut: asyncio.Future[None] = loop.create_future()
        with self._cv:
            if not self.running:
                raise EngineStoppedError("the engine is shutting down" if self._thread else "the engine is not running")
            if n > self.capacity:
                raise ValueError(f"{n} sequences can never fit: the server holds at most {self.capacity} at once")
            if self._live + n > self.capacity:
                raise QueueFullError(
                    f"server overloaded: {self._live} sequences live, capacity {self.capacity} "
                    f"(max_batch_size {self.executor.cfg.max_batch_size} + max_queue_size {self.max_queue_size})"
                )
            self._live += n
            t = now()
            self._inbox.append(("add", stream, list(requests), fut, t if arrival is None else arrival, t))
            self._cv.notify_all()
        try:
            await fut
        except asyncio.CancelledError:
            stream.abort()  # the caller went away before the add was handled; FIFO inbox: add runs first
            raise
        return stream

    def _post(self, cmd: tuple) -> None:
        with self._cv:
            self._inbox.append(cmd)
            self._cv.notify_all()

    # --------------------------------------------------------------------------------------------
    # Engine thread
    def _run(self) -> None:
        try:
            while True:
                if self.step_log is not None and not self.executor.has_work:
                    self.step_log.flush()  # idle: the last steps' GPU times are known now
                self._check_fatal()
                with self._cv:
                    t_idle = now()
                    waited = False
                    while not self._inbox and not self.executor.has_work and not self._stop_now:
                        waited = True
                        # Woken at least each second while idle: a rank that died meanwhile is noticed.
                        if not self._cv.wait(timeout=1.0):
                            break
                    if waited and self.step_log is not None:
                        self.step_log.add_idle(now() - t_idle)
                    cmds, self._inbox = self._inbox, []
                    stop_now = self._stop_now
                for cmd in cmds:
                    self._handle(cmd)
                if stop_now:
                    for t in list(self._tracks.values()):
                        self._abort_track(t, "abort")
                    self._export_gauges()
                    self._flush()
                    break
                if self.executor.has_work:
                    self._step()
                self._collect()
                self._flush()
        except BaseException as e:  # noqa: BLE001 - the loop must never die silently
            log.exception("engine loop died")
            self._dead = e
            for t in list(self._tracks.values()):
                self._fail_track(t, f"engine loop died: {e!r}")
            self._flush()
        finally:
            if self._compiles is not None:
                self._compiles.__exit__(None, None, None)
            with self._cv:
                self._accepting = False
                self._cv.notify_all()

    def _handle(self, cmd: tuple) -> None:
        kind = cmd[0]
        if kind == "add":
            _, stream, reqs, fut, arrival, posted = cmd
            self._add(stream, reqs, fut, arrival, posted)
        elif kind == "abort":
            _, stream, reason = cmd
            for t in self._streams.get(id(stream), []):
                if not t.done:
                    self._abort_track(t, reason)

    def _add(
        self, stream: ResultStream, reqs: list[GenerationRequest], fut: asyncio.Future, arrival: float, posted: float
    ) -> None:
        ex = self.executor
        added: list[Request] = []
        try:
            procs = [OutputProcessor(self.tokenizer, g.stop) if self.detokenize else None for g in reqs]
            for g in reqs:
                added.append(ex.add_request(list(g.prompt_ids), g.params))
        except Exception as e:  # noqa: BLE001 - the caller gets it; nothing else is touched
            for r in added:
                ex.abort_request(r.request_id)
            with self._cv:
                self._live -= len(reqs)
                self._cv.notify_all()
            self._resolve(fut, e)
            return
        tracks = []
        for i, (r, p) in enumerate(zip(added, procs)):
            t = _Track(req=r, stream=stream, index=i, proc=p, arrival=arrival, posted=posted)
            self._tracks[r.request_id] = t
            tracks.append(t)
            self.metrics.prompt_tokens.inc(len(r.prompt_ids))
        self._streams[id(stream)] = tracks
        stream.request_ids = [r.request_id for r in added]
        stream.requests = added
        self._resolve(fut, None)

    def _resolve(self, fut: asyncio.Future, exc: BaseException | None) -> None:
        def done() -> None:
            if fut.done():
                return
            if exc is None:
                fut.set_result(None)
            else:
                fut.set_exception(exc)

        with contextlib.suppress(RuntimeError):  # RuntimeError: the caller's loop is closed
            fut.get_loop().call_soon_threadsafe(done)

    def _step(self) -> None:
        ex = self.executor
        try:
            ex.step()
        except Exception as e:  # noqa: BLE001 - fail this step's requests, keep serving
            log.exception("executor step failed; failing the requests of the running batch")
            self.metrics.step_errors.inc()
            failed = self.fatal_error()
            if failed is not None:  # the requests' callers get the plain reason, not the collective's internals
                msg = f"a model rank failed: {failed}"
            else:
                msg = f"internal error while generating: {type(e).__name__}: {e}"
            # The step's requests: the running batch, plus waiting ones that were being admitted (they
            # hold pages). With none of those, the failure came from scheduling the queue's head: fail
            # it, so that every failed step retires at least one request and a bad one cannot wedge the
            # loop. (The executor does not say which requests a failed step had scheduled.)
            victims = list(ex.running) + [r for r in ex.waiting if ex.manager.has_request(r.request_id)]
            if not victims and ex.waiting:
                victims = [ex.waiting[0]]
            for r in victims:
                t = self._tracks.get(r.request_id)
                if t is not None:
                    self._fail_track(t, msg)
                elif not r.finished:
                    ex.abort_request(r.request_id)
                if ex.manager.has_request(r.request_id):  # an admission cut short keeps its pages
                    ex.manager.free_request(r.request_id)
            self._step_errors += 1

    @property
    def grammar_compiler(self) -> Any:
        """The executor's `GrammarCompiler` (structured output), or ``None``."""
        return getattr(self.executor, "grammar_compiler", None)

    def fatal_error(self) -> str | None:
        """Why the LLM cannot serve any more (a rank of its parallel world failed), else ``None``."""
        return getattr(self.llm, "parallel_error", None)

    def _check_fatal(self) -> None:
        if self._fatal_reported or self.on_fatal is None:
            return
        failed = self.fatal_error()
        if failed is not None:
            self._fatal_reported = True
            log.error("a model rank failed (%s): the server shuts down", failed)
            self.on_fatal(failed)

    def _collect(self) -> None:
        """Turn every live request's new tokens into deltas; retire the finished ones."""
        t_now = now()
        for t in list(self._tracks.values()):
            try:
                self._collect_one(t, t_now)
            except Exception as e:  # noqa: BLE001 - one bad request must not stop the others
                log.exception("output processing failed for request %d", t.req.request_id)
                self._fail_track(t, f"output processing failed: {type(e).__name__}: {e}")
        self._export_gauges()

    def _collect_one(self, t: _Track, now: float) -> None:
        r = t.req
        # Indexed in place: `output_ids` copies every output token, per request and step.
        toks, base = r.tokens, len(r.prompt_ids)
        want_lp = r.params.logprobs is not None
        d = Delta(index=t.index, num_prompt_tokens=base, logprobs=[] if want_lp else None)
        proc = t.proc
        if proc is None:  # token ids (and logprobs) only: the caller detokenizes
            end = len(toks) - base
            if end > t.consumed:
                d.token_ids = toks[base + t.consumed : base + end]
                if want_lp:
                    d.logprobs = r.logprobs[t.consumed : end]
                t.consumed = end
        while proc is not None and t.consumed < len(toks) - base and not proc.stopped:
            tok = toks[base + t.consumed]
            d.text_offsets.append(proc.decoded_len)
            d.text += proc.add(tok)
            d.token_ids.append(tok)
            if want_lp and t.consumed < len(r.logprobs):
                d.logprobs.append(r.logprobs[t.consumed])  # type: ignore[union-attr]
            t.consumed += 1
        self._export_spec(t)
        if d.token_ids:
            if t.first_token_t is None:
                t.first_token_t = now
                self._first_delivered.append(t)
            elif t.last_token_t is not None:
                self.metrics.itl.observe(now - t.last_token_t)
            t.last_token_t = now
            if proc is not None:
                self.metrics.generation_tokens.inc(len(d.token_ids))
        if proc is not None and proc.stopped:
            if not r.finished:
                self.executor.abort_request(r.request_id)
            self._finish(t, d, "stop", now)
        elif r.finished:
            if proc is not None:
                d.text += proc.finish()
            self._finish(t, d, r.finish_reason.value if r.finish_reason else "stop", now)
        elif d.token_ids:
            d.num_output_tokens = t.consumed
            self._emit(t, d)

    def _export_spec(self, t: _Track) -> None:
        r = t.req
        if r.num_verify_rounds == t.seen_rounds:
            return
        m = self.metrics
        m.spec_num_drafts.inc(r.num_verify_rounds - t.seen_rounds)
        proposed = sum(r.proposed_per_position)
        m.spec_num_draft_tokens.inc(proposed - t.seen_proposed)
        acc = list(r.accepted_per_position)
        prev = t.seen_accepted_pos + [0] * (len(acc) - len(t.seen_accepted_pos))
        gained = [a - b for a, b in zip(acc, prev)]
        m.spec_num_accepted_tokens.inc(sum(gained))
        for pos, g in enumerate(gained):
            if g:
                m.spec_accepted_per_pos.labels(position=str(pos)).inc(g)
        t.seen_rounds, t.seen_proposed, t.seen_accepted_pos = r.num_verify_rounds, proposed, acc

    def _abort_track(self, t: _Track, reason: str) -> None:
        """Abort a live generation (client gone, shutdown, stop string); frees its pages now."""
        if t.done:
            return
        if not t.req.finished:
            self.executor.abort_request(t.req.request_id)
        self._finish(t, Delta(index=t.index, num_prompt_tokens=len(t.req.prompt_ids)), reason, now())

    def _fail_track(self, t: _Track, message: str) -> None:
        if t.done:
            return
        if not t.req.finished:
            try:
                self.executor.abort_request(t.req.request_id)
            except Exception:  # noqa: BLE001 - the executor may be inconsistent after the failure
                log.exception("abort after a failure raised for request %d", t.req.request_id)
        d = Delta(index=t.index, num_prompt_tokens=len(t.req.prompt_ids), error=message)
        self._finish(t, d, "error", now())

    def _finish(self, t: _Track, d: Delta, reason: str, now: float) -> None:
        t.done = True
        d.finish_reason = reason
        d.num_output_tokens = t.consumed
        self._emit(t, d)
        del self._tracks[t.req.request_id]
        tracks = self._streams.get(id(t.stream), [])
        if all(x.done for x in tracks):
            self._streams.pop(id(t.stream), None)
        self.metrics.requests_finished.labels(finished_reason=reason).inc()
        self.metrics.e2e.observe(now - t.arrival)
        if t.first_token_t is not None:
            self.metrics.decode_time.observe(now - t.first_token_t)
        if self.step_log is not None:
            self._retired.append(t)  # recorded at the flush that delivers its last delta
        with self._cv:
            self._live -= 1
            self._cv.notify_all()

    def _emit(self, t: _Track, d: Delta) -> None:
        key = id(t.stream)
        if key not in self._outbox:
            self._outbox[key] = (t.stream, [])
        self._outbox[key][1].append(d)

    def _flush(self) -> None:
        """Hand the collected deltas to their streams' event loops: one callback per loop and flush, which
        delivers every stream's deltas (each `call_soon_threadsafe` writes the loop's wake-up socket: one per
        stream cost ~4 ms a step at 48 streams on a busy CPU, on the engine thread between two steps)."""
        box, self._outbox = self._outbox, {}
        self._hand_over(list(box.values()))
        if self._first_delivered:
            # TTFT ends here (the token is on its caller's loop); its parts: queue (arrival to admission),
            # prefill (admission to the step that produced it being read back), delivery (to this flush).
            t_now = now()
            m = self.metrics
            for t in self._first_delivered:
                t.delivered_t = t_now
                m.ttft.observe(t_now - t.arrival)
                r = t.req
                if r.t_admitted is not None:
                    m.queue_time.observe(max(0.0, r.t_admitted - t.arrival))
                    if r.t_first_token is not None:
                        m.prefill_time.observe(r.t_first_token - r.t_admitted)
                if r.t_first_token is not None:
                    m.delivery_time.observe(t_now - r.t_first_token)
            self._first_delivered = []
        if self._retired:
            assert self.step_log is not None
            for t in self._retired:
                self.step_log.add_request(
                    RequestTiming.of(t.req, arrival=t.arrival, delivered=t.delivered_t, posted=t.posted)
                )
            self._retired = []

    def _hand_over(self, batch: list[tuple[ResultStream, list[Delta]]]) -> None:
        """Deliver one flush's deltas to their streams (the engine process overrides this: one IPC message)."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[ResultStream, list[Delta]]]] = {}
        for stream, deltas in batch:
            by_loop.setdefault(stream._loop, []).append((stream, deltas))
        for loop, part in by_loop.items():
            with contextlib.suppress(RuntimeError):  # the caller's loop is closed: nobody is listening
                loop.call_soon_threadsafe(_deliver_all, part)

    def _export_gauges(self) -> None:
        ex = self.executor
        m = self.metrics
        cc = self._compiles
        if cc is not None and cc.count > self._compiles_seen:
            new = cc.names[self._compiles_seen : cc.count]
            self._compiles_seen += len(new)
            m.kernel_compiles.inc(len(new))
            log.warning("compiled %d kernel(s) while serving: %s", len(new), "; ".join(new[:4]))
        steps = ex.num_steps - self._last_steps
        if steps > 0:
            m.engine_steps.inc(steps)
        self._last_steps = ex.num_steps
        pre = ex.num_preemptions - self._last_preemptions
        if pre > 0:
            m.preemptions.inc(pre)
        self._last_preemptions = ex.num_preemptions
        unspec = getattr(ex, "num_unspeculated_rounds", 0)
        if unspec > self._last_unspeculated:
            m.spec_unspeculated_rounds.inc(unspec - self._last_unspeculated)
        self._last_unspeculated = unspec
        if ex.prefix is not None:
            now, last = _prefix_counts(ex.prefix.stats), self._last_prefix
            counters = (m.prefix_queries, m.prefix_hits, m.prefix_reused_tokens, m.prefix_lost_requests,
                        m.prefix_lost_tokens, m.prefix_checkpoints_skipped)  # fmt: skip
            for c, a, b in zip(counters, now, last):
                c.inc(a - b)
            self._last_prefix = now
            m.prefix_checkpoint_bytes.set(ex.prefix.store.nbytes)
        self._publish_stats()
        s = self._stats
        m.running.set(s["running"])
        m.waiting.set(s["waiting"])
        m.kv_pages_used.set(s["pages_used"])
        m.kv_pages_total.set(s["pages_total"])
        m.kv_usage.set(s["pages_used"] / s["pages_total"] if s["pages_total"] else 0.0)
        m.draft_kv_pages_used.set(s["draft_pages_used"])

    def _publish_stats(self) -> None:
        ex = self.executor
        mgr = ex.manager
        dm = getattr(ex, "draft_manager", None)
        draft_used = dm.num_pages - dm.num_free_pages if dm is not None and dm is not mgr else 0
        with self._cv:
            pending_adds = sum(len(c[2]) for c in self._inbox if c[0] == "add")
            self._stats = {
                "running": len(ex.running),
                "waiting": len(ex.waiting) + pending_adds,
                "pages_used": mgr.num_pages - mgr.num_free_pages,
                "pages_total": mgr.num_pages,
                "free_state_slots": mgr.num_free_slots,
                "draft_pages_used": draft_used,
                "num_steps": ex.num_steps,
                "num_preemptions": ex.num_preemptions,
                "step_errors": self._step_errors,
                "prefix_cache_hits": ex.prefix.stats.hits if ex.prefix is not None else 0,
                "prefix_cache_reused_tokens": ex.prefix.stats.reused_tokens if ex.prefix is not None else 0,
                "prefix_cache_lost_tokens": ex.prefix.stats.lost_tokens if ex.prefix is not None else 0,
            }
