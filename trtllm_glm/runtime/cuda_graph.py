"""CUDA graphs of the decode and verify forwards (TensorRT-LLM's ``CudaGraphConfig``).

Captured per (padded batch size ``P``, width ``W``): input ids -> final hidden ``[P * W, D]``, FP32 logits
``[P * W, V]`` and the packed ``[P * W, 3]`` rows (greedy token, top-2 gap, accepted count) for one device-to-host
copy. A verify graph also accepts and folds the KDA records on the device. Padding sequences, the reserved padding
state slot (`PADDING_REQUEST_ID`), capture from padding-only batches and the `GraphAddressGuard`: docs/design.md §5.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .. import traffic
from ..attention.graph_check import GraphAddressGuard
from ..attention.metadata import HostStaging
from ..graph_capture import GraphCaptureError, capture_graph, capture_session
from ..logits import greedy_fuse_cast, greedy_pack
from ..transfer import to_device
from .verify_staging import VerifyBuffers, stage_verify_ahead

logger = logging.getLogger(__name__)

__all__ = [
    "CudaGraphConfig",
    "CudaGraphRunner",
    "DeviceRows",
    "GraphOutputs",
    "HostResults",
    "PADDING_REQUEST_ID",
    "PADDING_PAST_LEN",
    "default_batch_sizes",
    "padded_batch_size",
]

# The cache manager's id of the request that holds the padding state slot (executor ids are >= 0).
PADDING_REQUEST_ID = -1
# Cached length the padding sequences claim: > 0 so that the KDA layers take the decode / verify path (a
# zero would mean a fresh prefill). Their rows are skipped by every sparse kernel, so the value is free.
PADDING_PAST_LEN = 4


def default_batch_sizes(max_batch_size: int) -> list[int]:
    """TensorRT-LLM's default capture sizes: 1, 2, 4, then multiples of 8, up to ``max_batch_size``."""
    sizes = [s for s in (1, 2, 4) if s <= max_batch_size]
    sizes += list(range(8, max_batch_size + 1, 8))
    if max_batch_size not in sizes:
        sizes.append(max_batch_size)
    return sorted(set(sizes))


@dataclass(frozen=True)
class CudaGraphConfig:
    """Which decode / verify batch sizes run as CUDA graphs (TensorRT-LLM's names and defaults).

    Attributes:
        batch_sizes: batch sizes to capture; ``None``: `default_batch_sizes` of ``max_batch_size``.
        max_batch_size: largest size captured when ``batch_sizes`` is None (0: the executor's
            ``max_batch_size``). With ``batch_sizes`` given it is their maximum.
        enable_padding: pad a batch to the next captured size (otherwise only exact sizes replay). On by default
            (TensorRT-LLM's default is off): a served batch's size moves with every arrival and finish, and a size
            that was not captured runs eagerly, at several times a replay's host time.
        piecewise: run the eager steps (prefill chunks, mixed prefill + decode steps, decode steps no graph above
            covers) as piecewise CUDA graphs: token-wise segments replayed around eager attention cores, an
            admission of short prompts as one graph (`trtllm_glm.runtime.piecewise`, docs/gpu.md). ``None``
            (default, "auto"): on where the graphs are real (a CUDA device, one rank), off where tests emulate
            them on the CPU and for ranks of a parallel model (not yet run there); True / False force it. On a
            GPU it took the server's TTFT p50 at concurrency 16 from 39.9 to 17.3 ms (H200); start-up captures
            ~170 graphs (~8 s warm) into ~2.7 GiB more pool at the real geometry. Off in the batch-invariant
            mode. ``TRTLLM_GLM_PIECEWISE=1`` / ``0`` overrides it.
        piecewise_max_num_tokens: largest padded token count captured piecewise (0: the executor's
            ``max_num_tokens``); larger steps run eagerly. The carry buffers take about this many rows times
            ~200 KB at the real geometry (`PiecewiseStats.carry_bytes`).

    Sizes above the executor's ``max_batch_size``, or whose rows (``size * width``) exceed its
    ``max_num_tokens``, are dropped for that executor. Graphs only run on CUDA; elsewhere the config is
    ignored.
    """

    batch_sizes: list[int] | None = None
    max_batch_size: int = 0
    enable_padding: bool = True
    piecewise: bool | None = None
    piecewise_max_num_tokens: int = 2048

    def __post_init__(self) -> None:
        if self.piecewise is not None and not isinstance(self.piecewise, bool):
            raise ValueError(f"cuda_graph_config.piecewise must be a bool or null (auto), got {self.piecewise!r}")
        pmt = self.piecewise_max_num_tokens
        if isinstance(pmt, bool) or not isinstance(pmt, int) or pmt < 0:
            raise ValueError(f"cuda_graph_config.piecewise_max_num_tokens must be an int >= 0, got {pmt!r}")
        mbs = self.max_batch_size
        if isinstance(mbs, bool) or not isinstance(mbs, int) or mbs < 0:
            raise ValueError(f"cuda_graph_config.max_batch_size must be an int >= 0, got {mbs!r}")
        if not isinstance(self.enable_padding, bool):
            raise ValueError(f"cuda_graph_config.enable_padding must be a bool, got {self.enable_padding!r}")
        if self.batch_sizes is not None:
            sizes = list(self.batch_sizes)
            bad = [s for s in sizes if isinstance(s, bool) or not isinstance(s, int) or s < 1]
            if not sizes or bad:
                raise ValueError(
                    f"cuda_graph_config.batch_sizes must be a non-empty list of ints >= 1, got {self.batch_sizes!r}"
                )
            sizes = sorted(set(sizes))
            if mbs and mbs != sizes[-1]:
                raise ValueError(f"cuda_graph_config.max_batch_size={mbs} disagrees with max(batch_sizes)={sizes[-1]}")
            object.__setattr__(self, "batch_sizes", sizes)
            object.__setattr__(self, "max_batch_size", sizes[-1])

    @classmethod
    def from_value(cls, value: Any) -> CudaGraphConfig | None:
        """A config from a `CudaGraphConfig`, a mapping of its fields (YAML), or None (graphs off).

        Raises:
            ValueError: unknown keys or invalid values.
        """
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, dict):
            known = {f.name for f in dataclasses.fields(cls)}
            unknown = sorted(set(value) - known)
            if unknown:
                raise ValueError(f"cuda_graph_config: unknown key {unknown[0]!r} (known: {', '.join(sorted(known))})")
            return cls(**value)
        raise TypeError(f"cuda_graph_config must be a CudaGraphConfig, a mapping or None, got {type(value).__name__}")

    def capture_sizes(self, executor_max_batch_size: int, max_num_tokens: int, width: int) -> list[int]:
        """The batch sizes captured for rows of ``width`` under an executor's limits (ascending)."""
        top = self.max_batch_size or executor_max_batch_size
        sizes = self.batch_sizes if self.batch_sizes is not None else default_batch_sizes(top)
        return [s for s in sizes if s <= executor_max_batch_size and s * width <= max_num_tokens]


def padded_batch_size(batch: int, sizes: Sequence[int], enable_padding: bool) -> int | None:
    """The captured size a batch of ``batch`` sequences replays at, or None (eager).

    Args:
        batch: real sequences of the step (>= 1).
        sizes: captured sizes, ascending.
        enable_padding: allow a larger captured size (else only ``batch`` itself).
    """
    if batch < 1:
        return None
    if not enable_padding:
        return batch if batch in sizes else None
    for s in sizes:
        if s >= batch:
            return s
    return None


@dataclass
class DeviceRows:
    """Draft rows of a verify replay taken from the device rather than the host ids (drafts the host has
    not read back yet: `speculative.drafters.DeviceDrafts`).

    Attributes:
        values: ``[n, W - 1]`` int64 drafts on the device.
        seqs: ``[m]`` plan index of each sequence whose rows ``1 .. W - 1`` come from ``values``.
        rows: ``[m]`` the row of ``values`` each of them takes.
    """

    values: torch.Tensor
    seqs: list[int]
    rows: list[int]


@dataclass
class GraphOutputs:
    """What one replay (or eager step) leaves for sampling.

    Attributes:
        hidden: ``[n, D]`` final hidden of the real rows (a view of the graph's output buffer).
        logits: ``[n, V]`` FP32 logits of the real rows (a view; overwritten by the next replay).
        packed: ``[n, 3]`` float64 (greedy token id, top-2 logit gap, the row's sequence's accepted count)
            per real row, on the device.
        width: rows per sequence ``W``; with ``W > 1`` the verify records were committed in the graph.
        chosen: ``packed``'s first column holds each row's chosen token (sampled rows drawn on the device
            already, by the overlap scheduler) rather than the greedy one.
        masked: grammar rows' tokens and gaps in ``packed`` were chosen under their masks already (the overlap
            scheduler: `Executor._choose_under_grammar`).
    """

    hidden: torch.Tensor
    logits: torch.Tensor
    packed: torch.Tensor
    width: int = 1
    chosen: bool = False
    masked: bool = False
    # The step rows ``packed`` holds (one per sequence: an eager step's last rows, `Executor._chain_eager_step`);
    # None: every row of the step.
    rows: list[int] | None = None
    _host: list[list[float]] | None = None
    # A copy of ``packed`` started already (`start_host_copy`): the read-back waits for it alone, not for work
    # queued on the stream after it.
    _copy: HostResults | None = None

    def host_rows(self) -> list[list[float]]:
        """``packed`` on the host (the step's one device-to-host copy; cached)."""
        if self._host is None:
            if self._copy is not None:
                self._host = self._copy.wait()
            else:
                traffic.read()
                self._host = self.packed.tolist()
            self._copy = None
        return self._host

    def start_host_copy(self, runner: CudaGraphRunner) -> None:
        """Start ``packed``'s copy to the host now (`CudaGraphRunner.results_to_host`), before more work is queued
        behind this step: `host_rows` then returns once the step itself is done."""
        if self._host is None and self._copy is None:
            self._copy = runner.results_to_host(self)

    @property
    def committed_on_device(self) -> bool:
        """Whether the step's KDA verify records were already folded (a verify graph)."""
        return self.width > 1

    def accepted_counts(self) -> list[int]:
        """``[B]`` accepted rows per real sequence, as the device counted them (1 for width-one steps)."""
        rows = self.host_rows()
        return [int(rows[i][2]) for i in range(0, len(rows), self.width)]


def greedy_and_gap(logits: torch.Tensor, accepted: torch.Tensor | None = None) -> torch.Tensor:
    """``[n, V]`` logits -> ``[n, 3]`` float64 (argmax id, top-2 gap, accepted): one tensor, one host copy.

    The argmax is `Sampler`'s greedy choice (``torch.argmax``: the first maximum) and the gap is
    `sampling.top2_gap`'s; token ids and counts are exact in float64. Two launches on CUDA
    (`trtllm_glm.logits.greedy_pack`).

    Args:
        logits: ``[n, V]``.
        accepted: optional ``[n]`` the accepted count of each row's sequence (default 1: no drafts).
    """
    return greedy_pack(logits, accepted)[1]


def accepted_counts(ids: torch.Tensor, greedy: torch.Tensor, proposed: torch.Tensor) -> torch.Tensor:
    """Greedy acceptance of ``P`` verify sequences of ``W`` rows, on the device (no host sync).

    Row 0 of a sequence is its last committed token and rows ``1 ..`` its drafts; draft ``j`` is accepted
    when it equals the target's argmax after row ``j - 1`` and every earlier draft was accepted. Drafts
    at or past ``proposed`` (filler, `DraftState.num_proposed`) are never accepted.

    Args:
        ids: ``[P, W]`` int64 input tokens.
        greedy: ``[P, W]`` int64 target argmax of each row.
        proposed: ``[P]`` int64 real drafts per sequence (``0 .. W - 1``).

    Returns:
        ``[P]`` int64 accepted rows (root + accepted drafts, ``1 .. W``).
    """
    W = ids.shape[1]
    ok = ids[:, 1:] == greedy[:, :-1]
    ok = ok & (torch.arange(W - 1, device=ids.device).view(1, -1) < proposed.view(-1, 1))
    return 1 + ok.to(torch.int64).cumprod(dim=1).sum(dim=1)


@dataclass
class _Graph:
    graph: Any
    hidden: torch.Tensor
    logits: torch.Tensor
    packed: torch.Tensor
    guard: GraphAddressGuard
    capture_s: float
    pool_bytes: int
    replays: int = 0


@dataclass
class GraphStats:
    """Counters of a `CudaGraphRunner` (for logs and the benchmark).

    Attributes:
        replays: steps that ran as a graph replay.
        eager_steps: decode / verify steps that ran eagerly (no captured size or width fits).
        captures: graphs captured.
        capture_s: wall seconds spent warming up and capturing.
        pool_bytes: device bytes reserved by the graphs' shared memory pool (growth over captures).
        per_graph: (size, width) -> capture seconds and pool growth of that capture (MTP graphs: their
            `speculative.mtp.graphs.MtpChainGraphs` key, ``(kind, size, width)``).
        failed: (size, width) whose capture raised, with the error; those steps run eagerly (logged).
        device_row_replays: verify replays that took drafts still on the device (`DeviceRows`).
    """

    replays: int = 0
    eager_steps: int = 0
    captures: int = 0
    capture_s: float = 0.0
    pool_bytes: int = 0
    per_graph: dict[tuple[Any, ...], dict[str, float]] = field(default_factory=dict)
    failed: dict[tuple[int, int], str] = field(default_factory=dict)
    device_row_replays: int = 0


class CudaGraphRunner:
    """Captures and replays the model forward of uniform-width decode / verify steps.

    Args:
        model: the target model.
        meta: the executor's metadata (its persistent buffers are what the graphs read).
        manager: the target cache manager (its state owner holds the KDA verify records).
        config: which sizes to capture.
        widths: row widths to capture (1, and ``1 + K`` for a speculative executor).
        prepare: ``prepare(plan, P, W)`` describes a step padded to ``P`` sequences of width ``W`` in
            ``meta`` (``plan`` empty: padding only) and sets its speculative fields; the executor's.
        emulate: run the padded step eagerly instead of capturing (tests of the padding on the CPU, where
            the Triton kernels run interpreted); every other part of a replay is the same.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        meta: Any,
        manager: Any,
        config: CudaGraphConfig,
        widths: Sequence[int],
        prepare: Callable[[Sequence[Any], int, int], None],
        *,
        emulate: bool = False,
    ) -> None:
        self.model = model
        self.meta = meta
        self.manager = manager
        self.config = config
        self.device = meta.device
        self.sizes = {w: config.capture_sizes(meta.max_num_seqs, meta.max_num_tokens, w) for w in sorted(set(widths))}
        self._prepare = prepare
        # One persistent input buffer, refreshed by one host-to-device copy per replay: each sequence's
        # proposed draft count (verify acceptance), then the input ids.
        S = meta.max_num_seqs
        self._inputs = torch.zeros(S + meta.max_num_tokens, dtype=torch.int64, device=self.device)
        self.num_proposed = self._inputs[:S]
        self.input_ids = self._inputs[S:]
        self._staging = HostStaging({"in": (self._inputs.shape, torch.int64)}, pin_memory=self.device.type == "cuda")
        self.graphs: dict[tuple[int, int], _Graph] = {}
        self.pool: Any = None
        self.stats = GraphStats()
        # Benchmarks set a list here: each replay then appends (host seconds in replay(), start event, end
        # event) so the GPU time of real steps can be read after a run (events cost a few µs; off by default).
        self.timing: list[tuple[float, Any, Any]] | None = None
        self._result_bufs: list[torch.Tensor] | None = None
        self._result_turn = 0
        self.emulate = emulate
        self.enabled = emulate or (self.device.type == "cuda" and torch.cuda.is_available())

    # The padding rules, for the drafters' graphs that pad like these (`speculative.context.TargetGraphRunner`).
    padding_request_id = PADDING_REQUEST_ID
    padding_past_len = PADDING_PAST_LEN

    def padded_size(self, batch: int, sizes: Sequence[int]) -> int | None:
        """`padded_batch_size` under this runner's ``enable_padding``."""
        return padded_batch_size(batch, sizes, self.config.enable_padding)

    # --------------------------------------------------------------------------------------------
    def key(self, widths: Sequence[int], capture: bool = True) -> tuple[int, int] | None:
        """The (padded size, width) a step of decode sequences with these row counts replays, or None.

        A key not captured yet is captured now, unless ``capture`` is False (then None): a capture describes its
        padded batch in the shared metadata, so a caller holding a step that is still to be read back from the
        metadata's description must not capture."""
        if not self.enabled or not widths:
            return None
        W = widths[0]
        if W not in self.sizes or any(w != W for w in widths):
            return None
        P = padded_batch_size(len(widths), self.sizes[W], self.config.enable_padding)
        if P is None or (P, W) in self.stats.failed:
            return None
        if (P, W) not in self.graphs and not self.emulate and not (capture and self._try_capture((P, W))):
            return None
        return (P, W)

    def _try_capture(self, key: tuple[int, int]) -> bool:
        """Capture ``key``; on failure log it, remember it (eager from now on) and return False."""
        try:
            self.capture(key)
        except Exception as e:  # noqa: BLE001 - any capture failure must leave the step runnable eagerly
            self.stats.failed[key] = f"{type(e).__name__}: {e}"
            self.manager.state.discard_pending()
            self.drop_pool_after(e)
            logger.warning("CUDA graph capture of (batch %d, width %d) failed, running it eagerly: %s", *key, e)
            return False
        return True

    def capture_pool(self) -> Any:
        """The memory pool the graphs share (made on first use, and again after a capture failed in it)."""
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        return self.pool

    def drop_pool_after(self, error: BaseException) -> None:
        """After a failed capture: a `GraphCaptureError` means the pool takes no further capture, so the next
        one gets a fresh pool (the graphs captured into the old one keep it alive)."""
        if isinstance(error, GraphCaptureError):
            self.pool = None

    def startup_keys(self, max_size: dict[int, int] | None = None) -> list[tuple[int, int]]:
        """The ``(size, width)`` keys `capture_all` captures: every captured size of every width, except sizes
        above ``max_size[width]`` (sizes a step of that width never reaches; they are captured on first use)."""
        limits = max_size or {}
        return [(size, w) for w, sizes in self.sizes.items() for size in sizes if size <= limits.get(w, size)]

    def capture_all(self, max_size: dict[int, int] | None = None) -> None:
        """Capture `startup_keys` now (start-up), rather than on first use (emulation: nothing to do)."""
        if self.emulate:
            return
        with capture_session():
            for key in self.startup_keys(max_size):
                if key not in self.graphs and key not in self.stats.failed:
                    self._try_capture(key)

    def _body(self, P: int, W: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The step's forward, logits, greedy choice and, for a verify step, acceptance and KDA commit."""
        ids = self.input_ids[: P * W]
        hidden = self.model(ids, self.meta, self.manager)
        if W == 1 and greedy_fuse_cast():
            # The greedy kernel writes the FP32 logits as it reads the LM head's output (one launch less a step).
            raw = self.model.compute_logits(hidden, cast=False)
            if raw.dtype != torch.float32:
                logits = torch.empty(raw.shape, dtype=torch.float32, device=raw.device)
                return hidden, logits, greedy_pack(raw, f32_out=logits)[1]
            return hidden, raw, greedy_and_gap(raw)
        logits = self.model.compute_logits(hidden)
        if W == 1:
            return hidden, logits, greedy_and_gap(logits)
        greedy, packed = greedy_pack(logits)
        acc = accepted_counts(ids.view(P, W), greedy.view(P, W), self.num_proposed[:P])
        # Folded here so the commit runs inside the graph; the host advances the lengths afterwards.
        self.manager.state.fold_pending(acc)
        packed[:, 2] = acc.repeat_interleave(W)
        return hidden, logits, packed

    def capture(self, key: tuple[int, int]) -> None:
        """Warm up and capture the graph of ``key`` on a batch made only of padding sequences."""
        P, W = key
        meta, state = self.meta, self.manager.state
        t0 = time.perf_counter()
        torch.cuda.synchronize(self.device)
        # Cached blocks would make the growth look smaller (capture itself empties the cache).
        torch.cuda.empty_cache()
        pool_before = torch.cuda.memory_reserved(self.device)
        self._inputs.zero_()
        pool = self.capture_pool()
        meta.graph_max_pools = meta.graph_pool_capacity
        try:
            self._prepare([], P, W)
            stream = torch.cuda.Stream(self.device)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream), torch.inference_mode():
                # Warm-up: Triton compilation / autotuning and cuBLAS set-up happen outside the capture.
                # Padding rows only: the padding slot is the only state written.
                self._body(P, W)
            torch.cuda.current_stream(self.device).wait_stream(stream)
            torch.cuda.synchronize(self.device)
            state.discard_pending()
            graph = torch.cuda.CUDAGraph()
            with torch.inference_mode(), capture_graph(graph, pool=pool):
                hidden, logits, packed = self._body(P, W)
            state.discard_pending()
        finally:
            meta.graph_max_pools = None
        guard = GraphAddressGuard()
        guard.capture(meta)
        torch.cuda.synchronize(self.device)
        dt = time.perf_counter() - t0
        grown = torch.cuda.memory_reserved(self.device) - pool_before
        self.graphs[key] = _Graph(graph, hidden, logits, packed, guard, dt, grown)
        self.stats.captures += 1
        self.stats.capture_s += dt
        self.stats.pool_bytes += grown
        self.stats.per_graph[key] = {"capture_s": dt, "bytes": float(grown)}

    def replay(
        self,
        key: tuple[int, int],
        plan: Sequence[Any],
        ids: Sequence[int],
        proposed: Sequence[int] | None = None,
        *,
        device_rows: DeviceRows | None = None,
    ) -> GraphOutputs:
        """Run the step ``plan`` (``ids``: its ``B * W`` input tokens) through the graph of ``key``.

        Prepares the padded metadata, refreshes the inputs in place, replays and trims the padding off the
        host metadata. A verify step (``W > 1``) leaves its KDA records folded with the device's accepted
        counts; the caller advances the committed lengths (`RequestStateOwner.commit_verified`).

        Args:
            key: ``(P, W)`` from `key`.
            plan: the ``B`` scheduled decode sequences.
            ids: ``[B * W]`` input tokens (root, then drafts, per sequence).
            proposed: ``[B]`` real drafts per sequence (the rest of its ``W - 1`` are filler); required
                when ``W > 1``.
            device_rows: drafts still on the device: they overwrite those sequences' rows ``1 .. W - 1``
                of ``ids`` on the stream, after the host ids are copied (no host sync).

        Returns:
            The real rows' hidden, logits and packed (greedy, gap, accepted), views of the graph's buffers.
        """
        P, W = key
        B, N = len(plan), P * W
        n = len(ids)
        if W > 1 and (proposed is None or len(proposed) != B or any(not 0 <= k < W for k in proposed)):
            raise ValueError(f"a verify replay needs {B} proposed-draft counts in [0, {W - 1}], got {proposed}")
        if device_rows is not None:
            self._check_device_rows(device_rows, B, W)
        self._prepare(plan, P, W)
        S = self.num_proposed.numel()
        host = self._staging.acquire()["in"]
        arr = self._staging.arrays()["in"]
        arr[:P] = 0
        if W > 1:
            arr[:B] = proposed
        arr[S : S + n] = ids
        arr[S + n : S + N] = 0
        # One copy: the counts and ids sit at both ends of it (the rows between are not read).
        self._inputs[: S + N].copy_(host[: S + N], non_blocking=True)
        traffic.put()
        self._staging.release()
        if device_rows is not None:
            self._take_device_rows(device_rows, P, W)
            self.stats.device_row_replays += 1
        hidden, logits, packed = self._launch(key)
        return GraphOutputs(hidden=hidden[:n], logits=logits[:n], packed=packed[:n], width=W)

    @staticmethod
    def _check_device_rows(dr: DeviceRows, B: int, W: int) -> None:
        m = len(dr.seqs)
        if dr.values.dim() != 2 or dr.values.shape[1] != W - 1 or len(dr.rows) != m or m > B:
            raise ValueError(
                f"device rows {tuple(dr.values.shape)} for {m} sequences do not fit {B} sequences of width {W}"
            )
        if not all(0 <= b < B for b in dr.seqs) or not all(0 <= j < dr.values.shape[0] for j in dr.rows):
            raise ValueError(f"device rows address sequences {dr.seqs} / draft rows {dr.rows} out of range")

    def _take_device_rows(self, dr: DeviceRows, P: int, W: int) -> None:
        """Write ``dr``'s drafts into the verify rows of the input buffer (stream-ordered, no sync)."""
        m = len(dr.seqs)
        grid = self.input_ids[: P * W].view(P, W)
        if dr.seqs == dr.rows == list(range(m)):  # the usual round: the same sequences in the same order
            grid[:m, 1:].copy_(dr.values[:m])
        else:
            grid[to_device(dr.seqs, self.device), 1:] = dr.values[to_device(dr.rows, self.device)]

    def _launch(self, key: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Replay ``key`` on the prepared metadata and inputs (eagerly when emulating); full-size outputs."""
        g = self.graphs.get(key)  # captured by `key` (None only when emulating)
        self.manager.state.discard_pending()
        if g is None:  # emulation: the padded step, eagerly
            out = self._body(*key)
        else:
            g.guard.check(self.meta)
            if self.timing is None:
                g.graph.replay()
            else:
                ev0, ev1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                ev0.record()
                t0 = time.perf_counter()
                g.graph.replay()
                launch = time.perf_counter() - t0
                ev1.record()
                self.timing.append((launch, ev0, ev1))
            g.replays += 1
            out = (g.hidden, g.logits, g.packed)
        self.meta.trim_padding()
        self.stats.replays += 1
        return out

    def replay_chained(self, key: tuple[int, int], plan: Sequence[Any], prev: GraphOutputs) -> GraphOutputs:
        """Replay a width-one step whose input tokens are ``prev``'s greedy tokens, still on the device.

        The overlap scheduler launches step ``N + 1`` before the host has read step ``N``: the metadata
        and the tokens are written on the stream after ``N``'s replay (which has read its own by then), so
        nothing waits for the host. ``prev`` must hold one row per sequence of ``plan``, in order.

        Args:
            key: ``(P, 1)`` from `key`.
            plan: the ``B`` decode sequences (each ``ScheduledSeq.past_len`` set to its length after ``N``).
            prev: step ``N``'s outputs (``B`` rows).

        Returns:
            As `replay`.
        """
        P, W = key
        B = len(plan)
        if W != 1 or prev.width != 1 or prev.packed.shape[0] != B:
            raise ValueError(f"a chained replay needs width one and {B} previous rows, got {key} and {prev.width}")
        self._prepare(plan, P, W)
        # Float64 token ids are exact; the cast copy is ordered after the previous replay that wrote them.
        self.input_ids[:B].copy_(prev.packed[:, 0])
        self.input_ids[B:P].zero_()
        hidden, logits, packed = self._launch(key)
        return GraphOutputs(hidden=hidden[:B], logits=logits[:B], packed=packed[:B], width=W)

    def replay_verify_ahead(
        self,
        key: tuple[int, int],
        plan: Sequence[Any],
        prev: GraphOutputs,
        drafts: torch.Tensor,
        host_past_bound: Sequence[int],
    ) -> GraphOutputs:
        """Replay verify round ``n + 1`` before round ``n`` (``prev``) was read back: its lengths, root tokens and
        the previous round's accepted counts are taken from ``prev`` on the device (no host sync).

        The plan is described at the host-known lengths (each sequence's start of round ``n``, ``ScheduledSeq.start``);
        then, on the stream, each sequence's rows move to ``start + accepted_n`` (`runtime.verify_staging`),
        its root token becomes round ``n``'s bonus token (the target's argmax after its last accepted row) and its
        drafts ``drafts`` (the MTP draft made from round ``n``'s outputs). Every sequence verifies ``W - 1`` real
        drafts; ``spec.num_accepted_t`` (the tail-ring cross-check) gets round ``n``'s counts.

        Args:
            key: ``(P, W)`` from `key`, ``W > 1``; ``prev`` has the same width and sequences, in order.
            plan: the ``B`` verify sequences (``start``: round ``n``'s first position).
            prev: round ``n``'s outputs (``[B * W]`` rows, packed with each sequence's accepted count).
            drafts: ``[B, W - 1]`` int64 drafts on the device.
            host_past_bound: ``[B]`` an upper bound of each sequence's length before round ``n + 1`` (``start + W``):
                it sizes the host description (``max_kv_len``, the indexer's score width), never a position.

        Returns:
            As `replay`.
        """
        P, W = key
        B = len(plan)
        if W < 2 or prev.width != W or prev.packed.shape[0] != B * W or drafts.shape != (B, W - 1):
            raise ValueError(f"a verify launched ahead needs {B} sequences of width {W} before and drafts [B, W - 1]")
        if len(host_past_bound) != B:
            raise ValueError(f"host_past_bound needs {B} entries, got {len(host_past_bound)}")
        self._prepare(plan, P, W)
        S = self.num_proposed.numel()
        host = self._staging.acquire()["in"]
        arr = self._staging.arrays()["in"]
        arr[:P] = 0
        arr[:B] = W - 1
        arr[S : S + P * W] = 0
        self._inputs[: S + P * W].copy_(host[: S + P * W], non_blocking=True)
        traffic.put()
        self._staging.release()
        # Round n's results, on the device: each sequence's rows move past its accepted count, its root token is the
        # bonus token, and the counts go where the tail ring's cross-check reads them (one launch on CUDA).
        meta = self.meta
        meta.describe_verify_rows(W, list(host_past_bound) + list(meta.past_lens[B:]))
        seq, tok = meta.row_buffers
        stage_verify_ahead(prev.packed, drafts, W, P, VerifyBuffers(seq, tok, self.input_ids, meta.accepted_buffer))
        meta.accepted_written_on_device()
        self.stats.device_row_replays += 1
        hidden, logits, packed = self._launch(key)
        return GraphOutputs(hidden=hidden[: B * W], logits=logits[: B * W], packed=packed[: B * W], width=W)

    def results_to_host(self, out: GraphOutputs) -> HostResults:
        """Start copying ``out.packed`` to the host without waiting (`HostResults.wait` collects it).

        Two pinned buffers alternate: at most one step's results wait to be read while the next is copied.
        """
        n = out.packed.shape[0]
        if self.device.type != "cuda":
            return HostResults(out.packed.clone(), None)
        if self._result_bufs is None:
            shape = (self.input_ids.numel(), out.packed.shape[1])
            self._result_bufs = [torch.empty(shape, dtype=out.packed.dtype, pin_memory=True) for _ in range(2)]
        buf = self._result_bufs[self._result_turn][:n]
        self._result_turn ^= 1
        buf.copy_(out.packed, non_blocking=True)
        ev = torch.cuda.Event()
        ev.record()
        return HostResults(buf, ev)


@dataclass
class HostResults:
    """A step's packed results on their way to the host (`CudaGraphRunner.results_to_host`)."""

    buf: torch.Tensor
    event: Any

    def wait(self) -> list[list[float]]:
        """Block until the copy is done; the rows as lists (greedy id, gap, accepted)."""
        traffic.read("runtime/cuda_graph.py HostResults.wait")
        if self.event is not None:
            self.event.synchronize()
        return self.buf.tolist()


# The step's one read-back: counted by its own site, its tensor read is of a host buffer (`traffic`).
traffic.HOST_BUFFER_READERS.update({HostResults.wait.__code__, GraphOutputs.host_rows.__code__})
