"""Counts of a step's host <-> device traffic on any device, the CPU included (`trtllm_glm.traffic`).

`watch_tensor_reads` adds, inside its block only, the reads the library does not count itself: every
``Tensor.item / tolist / cpu / numpy`` and ``int / float / bool`` of a tensor called from the package (each one a
blocking device-to-host read on a GPU), attributed to the innermost package frame; and, as puts, every
``torch.tensor`` / ``torch.as_tensor`` of host data given a ``device`` (a copy from pageable memory: on a GPU it
also waits for the stream). Reads made directly by the
library's own read-back sites (`trtllm_glm.traffic.HOST_BUFFER_READERS`: they count themselves) are skipped, and so
are reads of pinned tensors (host buffers on a GPU machine). For benchmarks and tests only: it patches
``torch.Tensor`` while the block runs.
"""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from trtllm_glm import traffic

__all__ = ["GraphBodies", "OpCounts", "count_ops", "recorded", "watch_tensor_reads"]

_METHODS = ("item", "tolist", "cpu", "numpy", "__int__", "__float__", "__bool__", "__index__")


def _package_caller(ops: bool = False) -> tuple[bool, str | None]:
    """(called directly from a self-counting read-back site, the package site of the call or None); ``ops``: the
    caller is a dispatch mode (the read-back site is the first package frame, not the direct caller)."""
    f = sys._getframe(2)
    if f.f_code in traffic.HOST_BUFFER_READERS:
        return True, None
    while f is not None:
        name = f.f_code.co_filename
        if "trtllm_glm" in name and name not in traffic._SKIPPED:
            if ops and f.f_code in traffic.HOST_BUFFER_READERS:
                return True, None
            path = name.rsplit("trtllm_glm", 1)[1].lstrip("/")
            return False, f"{path}:{f.f_lineno} {f.f_code.co_name}"
        f = f.f_back
    return False, None


@contextmanager
def watch_tensor_reads() -> Iterator[None]:
    """Count tensor reads called from the package into the active `traffic.recording` (see the module doc)."""
    saved = {m: getattr(torch.Tensor, m) for m in _METHODS}

    def wrap(name, fn):  # noqa: ANN001, ANN202
        def counted(self, *a, **kw):  # noqa: ANN001, ANN202
            rec = traffic.current()
            if rec is not None and not (self.device.type == "cpu" and self.is_pinned()):
                own, site = _package_caller()
                if not own and site is not None:
                    rec.reads[f"{site} .{name.strip('_')}"] += 1
            return fn(self, *a, **kw)

        return counted

    made = {m: getattr(torch, m) for m in ("tensor", "as_tensor")}

    def wrap_make(name, fn):  # noqa: ANN001, ANN202
        def counted(data, *a, **kw):  # noqa: ANN001, ANN202
            rec = traffic.current()
            if rec is not None and kw.get("device") is not None and not isinstance(data, torch.Tensor):
                _, site = _package_caller()
                if site is not None:
                    rec.puts[f"{site} torch.{name}"] += 1
            return fn(data, *a, **kw)

        return counted

    for m, fn in saved.items():
        setattr(torch.Tensor, m, wrap(m, fn))
    for m, fn in made.items():
        setattr(torch, m, wrap_make(m, fn))
    try:
        yield
    finally:
        for m, fn in saved.items():
            setattr(torch.Tensor, m, fn)
        for m, fn in made.items():
            setattr(torch, m, fn)


class GraphBodies:
    """Inside the block, the bodies of the graphs (`CudaGraphRunner._body`, `MtpChainGraphs._body`), which run eagerly
    when emulated on the CPU, are the device's work: nothing they do is counted (on a GPU a replay runs them without
    the host), and the time spent in them is summed in ``s`` (the bench subtracts it from the host's time)."""

    def __init__(self) -> None:
        self.s = 0.0
        self._saved: list[tuple[type, str, object]] = []

    def __enter__(self) -> GraphBodies:
        import time

        from trtllm_glm.runtime.cuda_graph import CudaGraphRunner
        from trtllm_glm.speculative.mtp.graphs import MtpChainGraphs

        for cls in (CudaGraphRunner, MtpChainGraphs):
            fn = cls.__dict__["_body"]
            self._saved.append((cls, "_body", fn))

            def body(*a, _fn=fn, **kw):  # noqa: ANN002, ANN003, ANN202
                t0 = time.perf_counter()
                try:
                    with _paused():
                        return _fn(*a, **kw)
                finally:
                    self.s += time.perf_counter() - t0

            cls._body = body  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: object) -> None:
        for cls, name, fn in self._saved:
            setattr(cls, name, fn)


@contextmanager
def _paused() -> Iterator[None]:
    """No recording inside the block (the active one resumes afterwards)."""
    saved = traffic.current()
    traffic._rec = None
    try:
        yield
    finally:
        traffic._rec = saved


@contextmanager
def recorded() -> Iterator[traffic.Traffic]:
    """`traffic.recording` with `watch_tensor_reads`, graph bodies excluded (`GraphBodies`): every read and put the
    package makes on the host inside the block."""
    with traffic.recording() as rec, watch_tensor_reads(), GraphBodies():
        yield rec


class OpCounts:
    """Tensor ops the package runs on the host's side of a step, outside the graph bodies (`count_ops`): ``launches``
    (each a kernel launch on a GPU: every op but views and host-only ones) and ``allocs`` (ops that make a new device
    tensor rather than write into one), by site."""

    def __init__(self) -> None:
        self.launches: Counter = Counter()
        self.allocs: Counter = Counter()


@contextmanager
def count_ops() -> Iterator[OpCounts]:
    """Count the package's tensor ops inside the block while a `traffic.recording` is active and outside graph bodies
    (`GraphBodies` pauses the recording there). For benchmarks and tests: a ``TorchDispatchMode``."""
    from torch.utils._python_dispatch import TorchDispatchMode

    aten = torch.ops.aten
    host_only = {aten.lift_fresh, aten.detach_, aten.detach, aten.alias}
    alloc_only = {aten.empty, aten.empty_strided, aten.empty_like}
    counts = OpCounts()

    class Mode(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN202
            out = func(*args, **(kwargs or {}))
            packet = func.overloadpacket
            if traffic.current() is None or packet in host_only:
                return out
            cast = packet is aten.to and not (args and out is args[0])  # `to` reaches the mode whole: a copy or not
            if func.is_view and not cast:
                return out
            own, site = _package_caller(ops=True)
            if site is None or own:
                return out
            if packet not in alloc_only:
                counts.launches[site] += 1
            if cast or packet in alloc_only or not func._schema.is_mutable:
                counts.allocs[site] += 1
            return out

    with Mode():
        yield counts
