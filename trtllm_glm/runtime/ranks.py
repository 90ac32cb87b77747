"""The ranks of a tensor / expert parallel `LLM` (docs/parallelism.md, "How the ranks run").

Spawned (``LLM(model, tensor_parallel_size=W)``): rank 0 starts ranks ``1 .. W-1`` (`RankGroup`) and mirrors its
executor's ``add_request`` / ``step`` / ``abort_request`` to them (`RankGroup.mirror`, replayed by `worker_main`).
torchrun (``WORLD_SIZE`` / ``RANK`` set): every rank makes the same calls by construction. Either way every rank
checks after each step that all agree on the step's plan and tokens (`install_lockstep`, `LockstepError`); a
worker that raises makes the call raise `WorkerError` naming the rank, and after any failed step the world is torn
down: build a new `LLM`. docs/parallelism.md, "Lockstep and faults".
"""

from __future__ import annotations

import contextlib
import itertools
import multiprocessing as mp
import os
import signal
import threading
import time
import traceback
from typing import Any

from ..distributed.comm import Comm, LockstepError
from ..distributed.mapping import Mapping

__all__ = ["RankGroup", "WorkerError", "install_lockstep", "step_fingerprint", "worker_main"]

READY_TIMEOUT_S = 600.0
"""Seconds rank 0 waits for the workers to finish loading and capturing."""
STOP_TIMEOUT_S = 10.0


class WorkerError(RuntimeError):
    """A rank of a parallel LLM failed (raised, exited or stopped answering); the message names it."""


def step_fingerprint(executor: Any, finished: list[Any]) -> int:
    """What every rank must agree on after a step: the step count, each running request's id, computed and
    token counts and last token, the finished ids, and the waiting count (a 63-bit hash of ints only, so the
    same on every process whatever ``PYTHONHASHSEED``)."""
    rows = tuple(
        (r.request_id, r.num_computed, len(r.tokens), r.tokens[-1] if r.tokens else -1) for r in executor.running
    )
    done = tuple((r.request_id, len(r.tokens), r.tokens[-1] if r.tokens else -1) for r in finished)
    return hash((executor.num_steps, rows, done, len(executor.waiting))) & ((1 << 63) - 1)


def install_lockstep(executor: Any, comm: Comm) -> None:
    """Wrap ``executor.step`` so that every rank compares its `step_fingerprint` after each step."""
    if comm.world_size == 1:
        return
    inner = executor.step

    def step() -> list[Any]:
        finished = inner()
        comm.check_lockstep(f"step {executor.num_steps}", step_fingerprint(executor, finished))
        return finished

    executor.step = step


# ------------------------------------------------------------------------------------------------
# Worker side
# ------------------------------------------------------------------------------------------------
def worker_main(rank: int, port: int, llm_factory: Any, llm_kwargs: dict[str, Any], conn: Any) -> None:
    """Rank ``rank`` of a spawned world: build the same `LLM` (``llm_factory``, the class rank 0 was built with,
    passed in so that this module never imports the LLM API that imports it), joining the world at ``port``,
    report ready, then replay rank 0's executor calls until told to stop (or rank 0's end of the pipe closes)."""
    # Ctrl-C reaches the whole process group: rank 0 decides when the workers stop (its shutdown).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    llm = None
    try:
        llm = llm_factory(**llm_kwargs, _spawned_rank=(rank, port))
        conn.send(("ready", rank))
        ex = llm.executor
        while True:
            try:
                msg = conn.recv()
            except (EOFError, OSError):
                break  # rank 0 is gone
            op = msg[0]
            if op == "stop":
                break
            if op == "add":
                for ids, params, rid, arrival in msg[1]:
                    # Rank 0's counters may have moved past requests it dropped before sending (a batch
                    # refused half-way): take its ids rather than our own.
                    ex._ids = itertools.count(rid)
                    ex._arrivals = itertools.count(arrival)
                    req = ex.add_request(ids, params)
                    if req.request_id != rid:
                        raise LockstepError(f"rank {rank}: request id {req.request_id}, rank 0 has {rid}")
            elif op == "step":
                ex.step()
            elif op == "abort":
                ex.abort_request(msg[1])
            else:
                raise RuntimeError(f"rank {rank}: unknown command {op!r}")
    except BaseException as e:  # noqa: BLE001 - reported to rank 0, then this process ends
        with contextlib.suppress(Exception):
            conn.send(("error", rank, f"{type(e).__name__}: {e}", traceback.format_exc()))
        # Exit without tearing anything down gracefully: the peers' collectives fail at once (closed sockets).
        os._exit(1)
    finally:
        if llm is not None:
            llm.shutdown()
        conn.close()


# ------------------------------------------------------------------------------------------------
# Rank 0 side
# ------------------------------------------------------------------------------------------------
class RankGroup:
    """Ranks ``1 .. W-1`` of a world whose rank 0 is this process.

    Args:
        mapping: the layout (rank 0's).
        llm_kwargs: the `LLM` keyword arguments every worker builds with.
        llm_factory: the class every worker builds (rank 0's `LLM` class; picklable by reference).
        device_type: ``"cuda"`` starts a monitor thread that aborts the NCCL communicators when a worker dies
            (a GPU collective waiting for a dead peer would otherwise wait for the process-group timeout; gloo's
            sockets report a dead peer at once).
    """

    def __init__(
        self, mapping: Mapping, llm_kwargs: dict[str, Any], device_type: str = "cpu", llm_factory: Any = None
    ) -> None:
        from ..distributed.process_group import free_port

        self.mapping = mapping
        self.port = free_port()
        self.error: str | None = None
        self._lock = threading.Lock()
        self._pending: list[Any] = []
        ctx = mp.get_context("spawn")
        self.procs: list[Any] = []
        self.conns: list[Any] = []
        for r in range(1, mapping.world_size):
            parent, child = ctx.Pipe(duplex=True)
            p = ctx.Process(
                target=worker_main,
                args=(r, self.port, llm_factory, llm_kwargs, child),
                name=f"trtllm-glm-rank{r}",
                daemon=True,
            )
            p.start()
            child.close()
            self.procs.append(p)
            self.conns.append(parent)
        self._stopping = threading.Event()
        if device_type == "cuda" and self.procs:
            threading.Thread(target=self._monitor, name="trtllm-glm-rank-monitor", daemon=True).start()

    def _monitor(self) -> None:
        """Abort the NCCL communicators as soon as a worker process ends unasked (CUDA worlds only)."""
        from multiprocessing.connection import wait

        wait([p.sentinel for p in self.procs])
        if self._stopping.is_set():
            return
        dead = [i + 1 for i, p in enumerate(self.procs) if not p.is_alive()]
        self.error = self.error or f"ranks {dead} exited"
        try:
            from torch.distributed.distributed_c10d import _abort_process_group

            _abort_process_group()  # rank 0's pending collective then fails instead of waiting
        except Exception:  # noqa: BLE001 - best effort: the process-group timeout still applies
            pass

    @property
    def init_method(self) -> str:
        return f"tcp://127.0.0.1:{self.port}"

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    # --------------------------------------------------------------------------------------------
    def wait_ready(self, timeout: float = READY_TIMEOUT_S) -> None:
        """Block until every worker has built its LLM; `WorkerError` if one fails first."""
        deadline = time.monotonic() + timeout
        waiting = set(range(len(self.procs)))
        while waiting:
            for i in list(waiting):
                c, p = self.conns[i], self.procs[i]
                if c.poll(0.05):
                    msg = c.recv()
                    if msg[0] == "ready":
                        waiting.discard(i)
                    else:
                        self._fail(f"rank {i + 1} failed while loading: {msg[2]}\n{msg[3]}")
                elif not p.is_alive():
                    self._fail(f"rank {i + 1} exited with code {p.exitcode} while loading")
            if time.monotonic() > deadline:
                self._fail(f"ranks {sorted(i + 1 for i in waiting)} not ready after {timeout:.0f} s")

    def _send(self, msg: tuple[Any, ...]) -> None:
        for i, c in enumerate(self.conns):
            try:
                c.send(msg)
            except (BrokenPipeError, OSError):
                self._fail(self._collect(f"rank {i + 1} is gone"))

    def _collect(self, fallback: str, wait_s: float = 3.0) -> str:
        """The workers' own account of a failure: errors they sent, exit codes; ``fallback`` if none."""
        deadline = time.monotonic() + wait_s
        found: list[str] = []
        while not found and time.monotonic() < deadline:
            for i, (c, p) in enumerate(zip(self.conns, self.procs)):
                try:
                    while c.poll(0):
                        msg = c.recv()
                        if msg[0] == "error":
                            found.append(f"rank {msg[1]} raised {msg[2]}")
                except (EOFError, OSError):
                    pass
                if not p.is_alive() and not any(s.startswith(f"rank {i + 1} ") for s in found):
                    code = p.exitcode
                    how = f"killed by signal {-code}" if code is not None and code < 0 else f"exit code {code}"
                    found.append(f"rank {i + 1} exited ({how})")
            if not found:
                time.sleep(0.05)
        return "; ".join(found) if found else fallback

    def _fail(self, message: str, cause: BaseException | None = None) -> None:
        self.error = message
        # Not politely: the workers may be waiting in a collective rank 0 will never join.
        self.shutdown(graceful=False)
        if isinstance(cause, LockstepError):
            raise LockstepError(message) from cause
        raise WorkerError(message) from cause

    @property
    def failure(self) -> str | None:
        """Why the world cannot serve (an earlier failure, or a worker process that has ended), else ``None``."""
        if self.error is not None:
            return self.error
        if not self._stopping.is_set():
            dead = [(i + 1, p.exitcode) for i, p in enumerate(self.procs) if not p.is_alive()]
            if dead:
                return "; ".join(f"rank {r} exited (exit code {c})" for r, c in dead)
        return None

    def check(self) -> None:
        if self.error is not None:
            raise WorkerError(f"this parallel LLM failed earlier ({self.error}); create a new LLM")

    # --------------------------------------------------------------------------------------------
    def mirror(self, executor: Any) -> None:
        """Send ``executor``'s ``add_request`` / ``step`` / ``abort_request`` calls to every worker too."""
        add, step, abort = executor.add_request, executor.step, executor.abort_request

        def flush() -> None:
            # Only requests still queued: a batch refused half-way removes the ones it had added.
            live = [r for r in self._pending if any(r is w for w in executor.waiting)]
            self._pending.clear()
            if live:
                self._send(("add", [(list(r.prompt_ids), r.params, r.request_id, r.arrival) for r in live]))

        def add_request(prompt_ids: list[int], params: Any) -> Any:
            self.check()
            req = add(prompt_ids, params)
            self._pending.append(req)
            return req

        def run(what: str, msg: tuple[Any, ...], fn: Any, *args: Any) -> Any:
            with self._lock:
                if self.error is not None and what == "abort_request":
                    return fn(*args)  # the world is gone; rank 0's own bookkeeping still drops the request
                self.check()
                flush()
                self._send(msg)
                try:
                    return fn(*args)
                except BaseException as e:
                    mine = f"rank 0 failed in {what}: {type(e).__name__}: {e}"
                    # The workers' own account first: a dead peer is the cause of rank 0's failed collective.
                    others = self._collect("")
                    self._fail(f"{others} (then {mine})" if others else mine, e)

        executor.step = lambda: run("step", ("step",), step)
        executor.add_request = add_request
        executor.abort_request = lambda rid: run("abort_request", ("abort", rid), abort, rid)

    # --------------------------------------------------------------------------------------------
    def shutdown(self, graceful: bool = True) -> None:
        """Stop every worker (politely unless ``graceful`` is false, then by signal) and leave the world;
        idempotent."""
        from ..distributed.process_group import shutdown_rank

        if self._stopping.is_set():
            return  # already done (a later world of this process must not be torn down by a second call)
        self._stopping.set()
        for c in self.conns if graceful else []:
            with contextlib.suppress(Exception):
                c.send(("stop",))
        deadline = time.monotonic() + (STOP_TIMEOUT_S if graceful else 0.0)
        for p in self.procs:
            p.join(max(0.0, deadline - time.monotonic()))
        for p in self.procs:
            if p.is_alive():
                p.terminate()
                p.join(2.0)
            if p.is_alive() and p.pid is not None:
                os.kill(p.pid, signal.SIGKILL)
                p.join(2.0)
        for c in self.conns:
            c.close()
        self.conns = []
        shutdown_rank()
