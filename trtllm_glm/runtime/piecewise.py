"""Piecewise CUDA graphs of the eager steps (issue 42 item 2): prefill chunks, mixed steps, uncovered decode steps.

The forward is cut at the attention cores (vLLM's scheme): segment ``k`` is layer ``k-1``'s attention output side and
FFN block plus layer ``k``'s attention input side, captured per (segment, padded token count); the cores run eagerly
between the replays. A segment never writes a carry buffer it reads (read-back values alternate between two buffers
by layer parity), so it may run twice in the step that first needs it. A step with speculative verify sequences (a
prompt joining verifying requests) runs its cores eagerly, the KDA ones as `KimiDeltaAttention.mix_spec` on copies of
the carry rows its commit records keep. Not covered: steps above the largest bucket, the LM head.

A step of KDA decode rows and short prefills only (`trtllm_glm.kda.static_step`) also runs its KDA cores inside the
graphs, from a device-side description refreshed by the step's one host-to-device copy: the forward is then cut at
the sparse-MLA cores only, consecutive KDA layers (cores included) making one segment per (segment, bucket, width
class). Those segments step the KDA state, so each runs once a step (a first-use capture's warm-up is the step's
run). When such a step also has a prefill row, or the sparse layers have MTP tail rings, its sparse-MLA cores run
inside too (`PiecewiseRunner._sparse_qualifies`), from a fixed-shape description of their rows
(`trtllm_glm.attention.sparse.glm_kpool.static_step`) refreshed by the same copy: the whole trunk is then one graph
per (bucket, width class), with no eager core. Design, buckets, memory and numerics: docs/gpu.md, "Piecewise CUDA
graphs of eager steps".
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .. import envs
from ..attention.metadata import HostStaging
from ..attention.sparse.glm_kpool.layer import GlmKpoolSparseMLA
from ..attention.sparse.glm_kpool.metadata import GlmKpoolMetadata
from ..attention.sparse.glm_kpool.static_step import StaticSparseStep, describe_sparse_rows, sparse_rows_size
from ..graph_capture import GraphCaptureError, capture_graph, capture_session
from ..kda.layer import short_prefill_rows
from ..kda.static_step import (
    StaticKdaCaps,
    StaticKdaStep,
    describe_padding_step,
    describe_static_step,
    width_classes,
)
from ..numerics import batch_invariant

logger = logging.getLogger(__name__)

__all__ = [
    "PIECEWISE_ENV",
    "PiecewiseRunner",
    "PiecewiseStats",
    "piecewise_buckets",
    "piecewise_enabled",
    "piecewise_from_env",
]

PIECEWISE_ENV = envs.PIECEWISE.name
# Values of a layer's output side read back by the next segment: two buffers each, by layer parity (module doc).
_BY_PARITY = frozenset({"h", "x", "post", "comb", "ga"})


def piecewise_from_env() -> bool | None:
    """``TRTLLM_GLM_PIECEWISE``: ``1`` / ``0`` (on / off, true / false, yes / no) overrides
    `CudaGraphConfig.piecewise`; unset or empty: ``None`` (the config decides).

    Raises:
        ValueError: any other value.
    """
    return envs.PIECEWISE.get()


def piecewise_enabled(config: Any, auto: bool = True) -> bool:
    """Whether an executor with CUDA-graph config ``config`` (None: graphs off) runs eager steps piecewise:
    `piecewise_from_env` when set, else ``config.piecewise``, whose ``None`` (auto) is ``auto`` (the executor's:
    real CUDA graphs on one GPU; not a CPU emulating graphs in tests, not ranks of a parallel model)."""
    if config is None:
        return False
    env = piecewise_from_env()
    if env is not None:
        return env
    return auto if config.piecewise is None else bool(config.piecewise)


def piecewise_buckets(max_tokens: int) -> list[int]:
    """Padded token counts captured up to ``max_tokens``: 1, 2, 4 .. 256, then multiples of 256, and
    ``max_tokens`` itself (every count up to it has a bucket; padding wastes under half the rows up to 256
    and under 256 rows above, where a step's GPU time is large anyway)."""
    if max_tokens < 1:
        return []
    out = []
    p = 1
    while p <= min(256, max_tokens):
        out.append(p)
        p *= 2
    out += list(range(512, max_tokens + 1, 256))
    if out[-1] != max_tokens:
        out.append(max_tokens)
    return out


@dataclass
class PiecewiseStats:
    """Counters of a `PiecewiseRunner`.

    Attributes:
        steps: forwards run piecewise.
        eager_steps: forwards the executor ran whole and eagerly instead (no bucket, or the batch-invariant mode).
        replays: segment graph replays.
        eager_segments: segments run eagerly (emulation, or a capture that failed).
        captures: segment graphs captured.
        capture_s: wall seconds spent warming up and capturing them.
        pool_bytes: growth of the device memory reserved while capturing (the graphs' shared pool and the
            warm-ups' cached blocks: an upper bound of what the graphs hold).
        carry_bytes: bytes of the carry buffers (input ids, row flags, what crosses segment boundaries, the KDA
            step descriptions).
        kda_steps: piecewise steps whose KDA cores ran inside the segments (cut at the sparse-MLA cores only).
        trunk_steps: ``kda_steps`` whose sparse-MLA cores ran inside too: the whole trunk as one graph, no eager core.
        eager_cores: attention cores run eagerly between segments (per step: none in a ``trunk_steps`` step, the
            sparse layers in another ``kda_steps`` step, every layer in another).
        warm_runs: segments with KDA cores inside captured at first use: the capture's warm-up was the step's run
            (no replay that step).
        failed: segment key (``(segment, bucket)``, ``("kda", first piece, bucket, width class)`` for a segment
            with KDA cores inside, ``("trunk", bucket, width class, tail rings)`` for the whole trunk) whose capture
            raised, with the error; that segment runs eagerly.
    """

    steps: int = 0
    eager_steps: int = 0
    replays: int = 0
    eager_segments: int = 0
    captures: int = 0
    capture_s: float = 0.0
    pool_bytes: int = 0
    carry_bytes: int = 0
    kda_steps: int = 0
    trunk_steps: int = 0
    eager_cores: int = 0
    warm_runs: int = 0
    failed: dict[tuple[Any, ...], str] = field(default_factory=dict)


class PiecewiseRunner:
    """Runs the trunk forward as token-wise segment graphs around eager attention cores (module docstring).

    Args:
        model: the target model (`Glm5NextForCausalLM`; every trunk layer mHC-wrapped).
        max_num_tokens: the executor's flat rows per step; the largest bucket is ``min(max_num_tokens,
            max_tokens)``.
        max_tokens: cap on the buckets (0: ``max_num_tokens``); larger steps run eagerly.
        buckets: explicit bucket sizes (ascending after sorting; default `piecewise_buckets`).
        emulate: run each padded segment eagerly on the carry buffers instead of capturing (tests on the CPU),
            twice the first time (a capture's warm-up runs it once before, in the middle of the step); everything
            else is as on the GPU.
        allow_batch_invariant: run piecewise in the batch-invariant mode too (module docstring).
        padding_slot: the target manager's reserved padding state slot; ``None``: KDA cores always run eagerly.
            With it, a step of decode rows and short prefills only runs its KDA cores inside the segments
            (`trtllm_glm.kda.static_step`; the padding decode entries step this slot).
        max_num_seqs: sequences a step may hold (the executor's ``max_batch_size``; 0: the bucket), a cap of the
            KDA step descriptions.
        kda_max_tokens: largest bucket whose segments take the KDA cores inside (the captured verify grid's memory
            grows with the bucket); larger steps run them eagerly.
        sparse_inside: let the sparse-MLA cores of a qualifying KDA-inside step run inside too (`_sparse_qualifies`:
            the whole trunk one graph); False: they always run eagerly between the segments.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        max_num_tokens: int,
        max_tokens: int = 0,
        buckets: Sequence[int] | None = None,
        emulate: bool = False,
        allow_batch_invariant: bool = False,
        padding_slot: int | None = None,
        max_num_seqs: int = 0,
        kda_max_tokens: int = 512,
        sparse_inside: bool = True,
    ) -> None:
        self.model = model
        self.layers = list(model.model.layers)  # type: ignore[union-attr]
        if any(not layer.use_mhc for layer in self.layers):
            raise ValueError("piecewise graphs need mHC-wrapped trunk layers")
        self.device = next(model.parameters()).device
        top = min(max_num_tokens, max_tokens) if max_tokens > 0 else max_num_tokens
        sizes = sorted(set(buckets)) if buckets is not None else piecewise_buckets(top)
        if not sizes or sizes[0] < 1 or sizes[-1] > max_num_tokens:
            raise ValueError(f"piecewise buckets must lie in [1, {max_num_tokens}], got {sizes}")
        self.buckets = sizes
        self.max_tokens = sizes[-1]
        self.emulate = emulate
        self.allow_batch_invariant = allow_batch_invariant
        self.enabled = emulate or (self.device.type == "cuda" and torch.cuda.is_available())
        self.stats = PiecewiseStats()
        self.graphs: dict[tuple[int, int], Any] = {}
        self.pool: Any = None
        # Carry buffers by (name, parity or -1, row shape, dtype), and which one each (layer, value) uses.
        self._carry: dict[tuple[Any, ...], torch.Tensor] = {}
        self._where: dict[tuple[int, str], tuple[Any, ...]] = {}
        self._capturing = False
        self._emulated: set[tuple[int, int]] = set()
        cuda = self.device.type == "cuda"
        # KDA cores inside the segments: the caps of each bucket's step description (`StaticKdaCaps`). The segments
        # are then cut at the sparse-MLA cores only: pieces ``p .. q`` with layers ``p .. q-1`` all KDA.
        self.padding_slot = padding_slot
        caps: list[StaticKdaCaps] = []
        if padding_slot is not None and any(not lay.is_sparse for lay in self.layers):
            limit = short_prefill_rows(self.device)
            for rows in sizes:
                if rows <= kda_max_tokens:
                    caps += [
                        StaticKdaCaps.for_bucket(rows, max_num_seqs or rows, w) for w in width_classes(rows, limit)
                    ]
        cuts = [k for k, lay in enumerate(self.layers) if lay.is_sparse] + [len(self.layers)]
        self._fused_segments = [(p, q) for p, q in zip([0] + [c + 1 for c in cuts[:-1]], cuts)]
        # Sparse-MLA cores inside too (the whole trunk one graph): only k-pool layers have a fixed-shape description.
        # (Without sparse layers the one segment with KDA cores inside is the whole trunk already.)
        sparse = [lay for lay in self.layers if lay.is_sparse]
        self._sparse_inside = (
            sparse_inside
            and bool(caps)
            and bool(sparse)
            and all(isinstance(lay.self_attn, GlmKpoolSparseMLA) for lay in sparse)
        )
        # One int64 buffer: the input ids (rows ``:max_tokens``), then the KDA step description (every class's views
        # start there: one a step), then the sparse cores' rows (`sparse_rows_size`: positions and owners, with tail
        # rings also the two passes' owners and the prefill slots), so a step is one host-to-device copy.
        self._kda_off = off = self.max_tokens
        desc = max((c.size for c in caps), default=0)
        self._sparse_off = off + desc
        rows_desc = sparse_rows_size(max((c.rows for c in caps), default=0), True) if self._sparse_inside else 0
        desc += rows_desc
        with torch.inference_mode(False):
            self._step_buf = torch.zeros(self.max_tokens + desc, dtype=torch.int64, device=self.device)
            self._live = torch.zeros(self.max_tokens, dtype=torch.int64, device=self.device)
        self._ids = self._step_buf[: self.max_tokens]
        # Each bucket's descriptions, narrowest width class first.
        self._kda_steps: dict[int, list[StaticKdaStep]] = {}
        for c in caps:
            self._kda_steps.setdefault(c.rows, []).append(StaticKdaStep(c, self._step_buf[off : off + c.size]))
        # Each bucket's sparse rows, made at first use on the metadata's persistent buffers (`_sparse_step`), and
        # those buffers' addresses: a captured graph reads the first metadata's.
        self._sparse_steps: dict[tuple[int, bool], StaticSparseStep] = {}
        self._sparse_bound: tuple[int, ...] | None = None
        self.stats.carry_bytes = (2 * self.max_tokens + desc) * 8
        self._staging = HostStaging({"step": ((self.max_tokens + desc,), torch.int64)}, pin_memory=cuda)

    # --------------------------------------------------------------------------------------------
    @property
    def num_segments(self) -> int:
        return len(self.layers) + 1

    def bucket(self, n: int) -> int | None:
        """The padded token count of a step of ``n`` rows, or None (too large: eager)."""
        for b in self.buckets:
            if b >= n:
                return b
        return None

    def applies(self, meta: Any) -> bool:
        """Whether the prepared step ``meta`` runs piecewise (counts the ones that do not in ``eager_steps``)."""
        ok = (
            self.enabled
            and meta.num_tokens > 0
            and self.bucket(meta.num_tokens) is not None
            and (self.allow_batch_invariant or not batch_invariant())
        )
        if not ok:
            self.stats.eager_steps += 1
        return ok

    # --------------------------------------------------------------------------------------------
    # Carry buffers
    def _put(self, layer: int, name: str, t: torch.Tensor) -> None:
        """Copy ``t [m, ...]`` into rows ``:m`` of ``(layer, name)``'s carry buffer (made at first sight)."""
        key = (name, layer % 2 if name in _BY_PARITY else -1, tuple(t.shape[1:]), t.dtype)
        seen = self._where.get((layer, name))
        if seen is None:
            self._where[(layer, name)] = key
        elif seen != key:
            # A graph captured earlier reads the buffer recorded first: a new one would go unseen.
            raise RuntimeError(f"piecewise: layer {layer}'s {name} changed from {seen[2:]} to {key[2:]}")
        self._slot(key)[: t.shape[0]].copy_(t)

    def _slot(self, key: tuple[Any, ...]) -> torch.Tensor:
        buf = self._carry.get(key)
        if buf is None:
            if self._capturing:  # (a warm-up run always precedes a capture: never reached)
                raise RuntimeError(f"piecewise: carry buffer {key[:2]} first seen inside a capture")
            with torch.inference_mode(False):  # normal tensors: written in place by every later step
                buf = torch.zeros((self.max_tokens, *key[2]), dtype=key[3], device=self.device)
            self._carry[key] = buf
            self.stats.carry_bytes += buf.numel() * buf.element_size()
        return buf

    def _take(self, layer: int, name: str, rows: int) -> torch.Tensor | None:
        """Rows ``:rows`` of ``(layer, name)``'s carry buffer; None if that value was never written."""
        key = self._where.get((layer, name))
        return None if key is None else self._slot(key)[:rows]

    def _expect_core(self, layer: int) -> None:
        """Record the buffer layer ``layer``'s core writes before any core ran (start-up capture): KDA's ``o [H,
        V]`` fp32, sparse MLA's output in its input's dtype (checked by `_put` when a real core writes it)."""
        if (layer, "core") in self._where:
            return
        lay = self.layers[layer]
        x = self._where[(layer, "x")]
        if lay.is_sparse:
            key = ("core", -1, x[2], x[3])
        else:
            key = ("core", -1, (lay.self_attn.num_heads, lay.self_attn.head_v_dim), torch.float32)
        self._where[(layer, "core")] = key

    # --------------------------------------------------------------------------------------------
    # The pieces
    def _segment(self, k: int, T: int) -> None:
        """Segment ``k`` on ``T`` rows of the carry buffers (token-wise only: graph-safe)."""
        L = len(self.layers)
        if k == 0:
            e = self.model.model.embed_tokens(self._ids[:T])  # type: ignore[union-attr]
            h = e.unsqueeze(1).expand(-1, self.model.config.hc_mult, -1).contiguous()  # type: ignore[union-attr]
        else:
            lay, j = self.layers[k - 1], k - 1
            h, x, post, comb = (self._take(j, n, T) for n in ("h", "x", "post", "comb"))
            a = lay.attn_out(x, self._take(j, "core", T), self._take(j, "ga", T))
            h = lay.ffn_block(lay.attn_post(h, a, post, comb), self._live[:T])
        if k == L:
            self._put(k, "out", self.model.model.norm(h.mean(dim=1)))  # type: ignore[union-attr]
            return
        lay = self.layers[k]
        x_in, post, comb = lay.attn_pre(h)
        x, inputs = lay.attn_in(x_in)
        for name, t in (("h", h), ("x", x), ("post", post), ("comb", comb)):
            self._put(k, name, t)
        if inputs:
            kx, g, beta, ga = inputs
            for name, t in (("kx", kx), ("kg", g), ("kbeta", beta), ("ga", ga)):
                if t is not None:
                    self._put(k, name, t)

    def _core(self, k: int, n: int, meta: Any, manager: Any) -> None:
        """Layer ``k``'s attention core on the ``n`` real rows, eagerly; its output into the carry."""
        lay = self.layers[k]
        x = self._take(k, "x", n)
        inputs: tuple = ()
        if not lay.is_sparse:
            inputs = tuple(self._take(k, name, n) for name in ("kx", "kg", "kbeta", "ga"))
        self._put(k, "core", lay.attn_core(x, inputs, meta, manager))
        self.stats.eager_cores += 1

    def _kda_core(self, k: int, T: int, step: StaticKdaStep, manager: Any) -> None:
        """KDA layer ``k``'s core on the bucket's ``T`` rows from the device-side step description (graph-safe)."""
        inputs = tuple(self._take(k, name, T) for name in ("kx", "kg", "kbeta", "ga"))
        self._put(k, "core", self.layers[k].attn_core_static(inputs, step, manager))

    def _sparse_core(self, k: int, T: int, sparse: StaticSparseStep, manager: Any) -> None:
        """Sparse-MLA layer ``k``'s core on the bucket's ``T`` rows from their fixed-shape description (graph-safe:
        the padding rows have ``row_seq = -1``, which every k-pool kernel skips; their output rows are zeros)."""
        x = self._take(k, "x", T)
        self._put(k, "core", self.layers[k].attn_core(x, (), sparse, manager))

    def _fused(
        self, p: int, q: int, T: int, step: StaticKdaStep, manager: Any, sparse: StaticSparseStep | None = None
    ) -> None:
        """Pieces ``p .. q`` with the cores of layers ``p .. q-1`` between them, on ``T`` rows: KDA ones from
        ``step``, sparse-MLA ones from ``sparse`` (the whole trunk). Not pure (the cores step their slots, write
        their caches): it must run once a step (`_run_fused`)."""
        for k in range(p, q + 1):
            self._segment(k, T)
            if k < q:
                if self.layers[k].is_sparse:
                    assert sparse is not None  # (segments with KDA cores only end at a sparse layer)
                    self._sparse_core(k, T, sparse, manager)
                else:
                    self._kda_core(k, T, step, manager)

    def _run_segment(self, k: int, T: int) -> None:
        key = (k, T)
        g = self.graphs.get(key)
        if g is None and not self.emulate and key not in self.stats.failed and self._try_capture(key):
            g = self.graphs[key]
        if g is None:
            if self.emulate and key not in self._emulated:
                # What a capture runs first (its warm-up): the segment twice on the same buffers, as on the GPU.
                self._emulated.add(key)
                self._segment(k, T)
            self._segment(k, T)
            self.stats.eager_segments += 1
        else:
            g.replay()
            self.stats.replays += 1

    def _run_fused(
        self, p: int, q: int, T: int, step: StaticKdaStep, manager: Any, sparse: StaticSparseStep | None = None
    ) -> None:
        """The segment of pieces ``p .. q`` with cores inside (``sparse``: the whole trunk, every core), once: a
        replay, or (first use) its capture, whose warm-up is this step's run (a capture records without running; a
        warm-up then a replay would step the slots twice), or eagerly (emulation, a failed capture)."""
        key = self._fused_key(p, T, step, sparse)
        g = self.graphs.get(key)
        if g is not None:
            g.replay()
            self.stats.replays += 1
            return
        run = functools.partial(self._fused, p, q, T, step, manager, sparse)
        if self.emulate or key in self.stats.failed:
            run()
            self.stats.eager_segments += 1
        else:
            self._try_capture(key, run, warm_is_run=True)
            self.stats.warm_runs += 1

    @staticmethod
    def _fused_key(p: int, T: int, step: StaticKdaStep, sparse: StaticSparseStep | None) -> tuple[Any, ...]:
        if sparse is not None:  # (with or without tail rings: other kernels inside)
            return ("trunk", T, step.caps.width, sparse.pool_rows is not None)
        return ("kda", p, T, step.caps.width)

    # --------------------------------------------------------------------------------------------
    def forward(self, input_ids: Sequence[int] | torch.Tensor, meta: Any, manager: Any) -> torch.Tensor:
        """The trunk forward of the prepared step ``meta`` (as ``model(input_ids, meta, manager)``), piecewise.

        A step of decode rows and short prefills only (`describe_static_step`) runs its KDA cores inside the
        segments, which are then cut at the sparse-MLA cores only, or, when its sparse cores qualify too
        (`_sparse_qualifies`), runs the whole trunk as one graph; any other step runs every core eagerly between
        the token-wise segments. Either way the same kernels compute the same rows.

        Args:
            input_ids: ``[n]`` token ids (a host list: copied with the padding in one transfer; or a tensor).
            meta: the step's metadata (`applies` true), ``n = meta.num_tokens`` rows.
            manager: the target cache manager.

        Returns:
            Final hidden ``[n, D]``: a view of a carry buffer, valid until the next piecewise step.
        """
        n = meta.num_tokens
        T = self.bucket(n)
        if T is None or len(input_ids) != n:
            raise ValueError(f"piecewise step of {len(input_ids)} ids for {n} rows (buckets up to {self.max_tokens})")
        manager.state.discard_pending()  # as the model's forward: a step that raised must not be committed
        self.model.check_comm()  # type: ignore[union-attr]
        step, sparse = self._fill(input_ids, n, T, meta, manager)
        L = len(self.layers)
        if step is not None:
            segs = [(0, L)] if sparse is not None else self._fused_segments
            keys: list[tuple[Any, ...]] = [self._fused_key(p, T, step, sparse) for p, _ in segs]
        else:
            keys = [(k, T) for k in range(L + 1)]
        missing = not self.emulate and any(key not in self.graphs for key in keys)
        with capture_session() if missing else contextlib.nullcontext():
            if sparse is not None:
                self._run_fused(0, L, T, step, manager, sparse)  # type: ignore[arg-type]
                self.stats.kda_steps += 1
                self.stats.trunk_steps += 1
                # What an eager step leaves there (the latest full indexer's pools), its real rows.
                if sparse.spec.last_pool_ids is not None:
                    meta.spec.last_pool_ids = sparse.spec.last_pool_ids[:n]
            elif step is not None:
                for p, q in self._fused_segments:
                    self._run_fused(p, q, T, step, manager)
                    if q < L:
                        self._core(q, n, meta, manager)
                self.stats.kda_steps += 1
            else:
                for k in range(L + 1):
                    self._run_segment(k, T)
                    if k < L:
                        self._core(k, n, meta, manager)
        self.stats.steps += 1
        out = self._take(L, "out", n)
        assert out is not None
        return out

    def _fill(
        self, input_ids: Sequence[int] | torch.Tensor, n: int, T: int, meta: Any, manager: Any
    ) -> tuple[StaticKdaStep | None, StaticSparseStep | None]:
        """Input ids (padding 0), the KDA step description when the step qualifies, the sparse cores' rows when they
        qualify too (one host-to-device copy for all) and row flags (padding 0: dead for the MoE) into rows ``:T``.
        Returns the KDA description, or None (KDA cores eager), and the sparse one, or None (sparse cores eager)."""
        host = self._staging.acquire()["step"]
        arr = self._staging.arrays()["step"]
        o = self._kda_off
        step = None
        # The narrowest class the step fits. Not a step with verify rows: the static description would step their
        # KDA state in place, where a verify keeps records and leaves the state to the commit (eager cores).
        for cand in self._kda_steps.get(T, ()) if not meta.spec.verify_seqs else ():
            assert self.padding_slot is not None  # (descriptions exist only with one)
            if describe_static_step(meta, n, cand.caps, self.padding_slot, arr[o : o + cand.caps.size], self.device):
                step = cand
                break
        end = o + step.caps.size if step is not None else T
        ring = self._has_ring(manager)
        sparse = None
        if step is not None and self._sparse_qualifies(meta, n, T, manager):
            sparse = self._sparse_step(T, meta, ring)
        if sparse is not None:
            end = self._sparse_off + sparse_rows_size(T, ring)
            assert self.padding_slot is not None  # (KDA descriptions exist only with one)
            describe_sparse_rows(meta, n, arr[self._sparse_off : end], self.padding_slot, ring)
        if isinstance(input_ids, torch.Tensor):
            self._ids[:n].copy_(input_ids)
            self._ids[n:T].zero_()
            if step is not None:
                self._step_buf[o:end].copy_(host[o:end], non_blocking=True)
        else:
            arr[:n] = input_ids
            arr[n:T] = 0
            self._step_buf[:end].copy_(host[:end], non_blocking=True)
        self._staging.release()
        if step is not None:
            step.refresh()
        self._live[:n].copy_(meta.row_live_t)
        self._live[n:T].zero_()
        return step, sparse

    @staticmethod
    def _has_ring(manager: Any) -> bool:
        """Whether the sparse layers have MTP tail rings (a speculative executor's manager)."""
        return bool(getattr(manager, "decode_tail_rings", None))

    def _sparse_qualifies(self, meta: Any, n: int, T: int, manager: Any) -> bool:
        """Whether a KDA-inside step of ``n`` rows in bucket ``T`` also runs its sparse-MLA cores inside (the whole
        trunk one graph): the target binding of a `GlmKpoolMetadata` without selection sharing or rows of a captured
        width, and, without an MTP tail ring, a prefill row at least (the eager indexer then writes every row as a
        prefill chunk, what `StaticSparseStep` does; with decode rows only it takes the decode pass); with a ring,
        the step's accepted counts in the metadata's persistent buffer (the ring's cross-check reads it). (Padding
        rows: ``row_seq = -1``, skipped by the kernels and the torch references alike.)"""
        if not (
            self._sparse_inside
            and isinstance(meta, GlmKpoolMetadata)
            and not meta.draft_binding_active
            and meta.spec.shared_pool_ids is None
            and meta.valid_q_lens is None  # (its padding rows inside sequences: row_seq = -1 in the eager rows)
        ):
            return False
        if not self._has_ring(manager):
            return meta.num_decode_tokens < n
        acc = meta.spec.num_accepted_t
        return acc is not None and acc.data_ptr() == meta.accepted_buffer.data_ptr()

    def _sparse_step(self, T: int, meta: GlmKpoolMetadata, ring: bool) -> StaticSparseStep | None:
        """Bucket ``T``'s sparse rows on ``meta``'s persistent buffers (made at first use), or None when ``meta`` is
        not the metadata whose buffers the graphs already read (those cores then run eagerly)."""
        bound = (
            meta.target_slot_table.data_ptr(),
            meta.selection_buf.data_ptr(),
            meta.accepted_buffer.data_ptr(),
            meta.graph_pool_capacity,
        )
        if self._sparse_bound is None:
            self._sparse_bound = bound
        elif bound != self._sparse_bound:
            return None
        got = self._sparse_steps.get((T, ring))
        if got is None:
            o = self._sparse_off
            got = StaticSparseStep(
                self._step_buf[o : o + sparse_rows_size(T, ring)],
                meta.target_slot_table,
                meta.selection_buf,
                meta.graph_pool_capacity,
                meta.max_num_seqs,
                ring=ring,
                num_accepted=meta.accepted_buffer if ring else None,
            )
            self._sparse_steps[(T, ring)] = got
        return got

    # --------------------------------------------------------------------------------------------
    # Capture
    def capture_pool(self) -> Any:
        """The memory pool every segment graph shares (made on first use, and again after a failed capture)."""
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        return self.pool

    def _try_capture(
        self, key: tuple[Any, ...], fn: Callable[[], None] | None = None, *, warm_is_run: bool = False
    ) -> bool:
        """Capture ``fn`` (default: plain segment ``key``) as ``key``'s graph; False (recorded in ``failed``, the
        segment then runs eagerly) if the capture raised. ``warm_is_run``: the warm-up is the step's own run of a
        segment that is not pure (KDA cores inside): an error there propagates (as from an eager step), and the
        caller does not replay the graph this step."""
        if fn is None:
            fn = functools.partial(self._segment, *key)
        t0 = time.perf_counter()
        before = torch.cuda.memory_reserved(self.device)
        if warm_is_run:
            self._warm_up(fn)
        try:
            if not warm_is_run:
                self._warm_up(fn)
            self._record(key, fn)
        except Exception as e:  # noqa: BLE001 - a failed capture must leave the segment runnable eagerly
            self.stats.failed[key] = f"{type(e).__name__}: {e}"
            if isinstance(e, GraphCaptureError):
                self.pool = None
            logger.warning("piecewise CUDA graph of segment %s failed, running it eagerly: %s", key, e)
            return False
        self.stats.captures += 1
        self.stats.capture_s += time.perf_counter() - t0
        self.stats.pool_bytes += max(0, torch.cuda.memory_reserved(self.device) - before)
        return True

    def _warm_up(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on a side stream (Triton compiles, cuBLAS set-up, first-sight buffers) before its capture."""
        cur = torch.cuda.current_stream(self.device)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(cur)
        with torch.cuda.stream(side):
            fn()
        cur.wait_stream(side)

    def _record(self, key: tuple[Any, ...], fn: Callable[[], None]) -> None:
        """Capture ``fn`` into ``key``'s graph (recorded, not run) in the shared pool."""
        graph = torch.cuda.CUDAGraph()
        self._capturing = True
        try:
            with capture_graph(graph, pool=self.capture_pool()):
                fn()
        finally:
            self._capturing = False
        self.graphs[key] = graph

    def capture_all(self, buckets: Sequence[int] | None = None, manager: Any = None, meta: Any = None) -> None:
        """Capture every segment of ``buckets`` (default all) now, at start-up, rather than on first use. The carry
        buffers hold whatever they hold (zeros at first): segments are pure, and no cache or state is touched.
        With ``manager`` (the target cache manager) also the segments with KDA cores inside, their warm-ups run on a
        step of padding entries only (`describe_padding_step`: the padding slot is the only state they write);
        without it those are captured at first use. With ``meta`` too (the executor's metadata) the whole-trunk
        graphs as well, their sparse rows all padding (``row_seq = -1``: no cache written)."""
        if self.emulate or not self.enabled:
            return
        L = len(self.layers)
        with torch.inference_mode(), capture_session():
            for T in buckets if buckets is not None else self.buckets:
                for k in range(L + 1):
                    if k > 0:
                        if (k - 1, "x") not in self._where:
                            break  # the segment before never ran (its capture failed): first use tries again
                        self._expect_core(k - 1)
                    if (k, T) not in self.graphs and (k, T) not in self.stats.failed:
                        self._try_capture((k, T))
                for step in self._kda_steps.get(T, []) if manager is not None else []:
                    self._capture_kda(step, manager, meta)
        torch.cuda.synchronize(self.device)

    def _capture_kda(self, step: StaticKdaStep, manager: Any, meta: Any = None) -> None:
        """Capture the segments with KDA cores inside of ``step``'s bucket and width class (`capture_all`), their
        warm-ups on a step of padding entries only (the padding slot is the only state they write), and with
        ``meta`` the whole trunk's graph on padding rows only (they write no cache)."""
        T, o, end = step.caps.rows, self._kda_off, self._kda_off + step.caps.size
        host = self._staging.acquire()["step"]
        arr = self._staging.arrays()["step"]
        assert self.padding_slot is not None
        describe_padding_step(step.caps, self.padding_slot, arr[o:end])
        sparse = None
        ring = self._has_ring(manager)
        if meta is not None and self._sparse_inside and isinstance(meta, GlmKpoolMetadata):
            sparse = self._sparse_step(T, meta, ring)
        if sparse is not None:
            o2 = self._sparse_off
            end = o2 + sparse_rows_size(T, ring)
            describe_sparse_rows(None, 0, arr[o2:end], self.padding_slot, ring)  # padding rows only
        self._step_buf[o:end].copy_(host[o:end], non_blocking=True)
        self._staging.release()
        step.refresh()
        for p, q in self._fused_segments:
            if p > 0:
                if (p - 1, "x") not in self._where:
                    break  # the segment before never ran (its capture failed): first use tries again
                self._expect_core(p - 1)
            key = ("kda", p, T, step.caps.width)
            if key not in self.graphs and key not in self.stats.failed:
                self._try_capture(key, functools.partial(self._fused, p, q, T, step, manager))
        key = self._fused_key(0, T, step, sparse) if sparse is not None else None
        if key is not None and key not in self.graphs and key not in self.stats.failed:
            # (Its warm-up runs every piece and core first: every carry buffer exists before the recording.)
            self._try_capture(key, functools.partial(self._fused, 0, len(self.layers), T, step, manager, sparse))
