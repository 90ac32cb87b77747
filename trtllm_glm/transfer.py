"""Host-to-device copies of small index lists without a stream synchronisation.

``torch.tensor(values, device="cuda")`` copies synchronously: the host waits for the stream to drain, one
sync per call, and the speculative loop builds a dozen such index tensors per round. Here int64 values go
into a persistent pinned ring (`_PinnedRing`) and are copied with ``non_blocking=True``: the copy is
ordered on the current stream and the host does not wait. The ring replaced a fresh pinned tensor per
call, whose allocation and event bookkeeping in torch's caching host allocator cost ~25 µs each.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import torch

from . import traffic

__all__ = ["to_device"]


class _PinnedRing:
    """Pinned int64 staging in two halves; a half is refilled only after the copies from it completed.

    Values go to the current half until it is full; then an event is recorded on every stream that copied
    from it and the other half is taken, after waiting for the event recorded when it was last left (a
    half holds thousands of lists, so that wait finds copies issued long ago, already done).
    """

    def __init__(self, numel: int = 1 << 16) -> None:
        self.half = numel // 2
        self.host = torch.empty(2 * self.half, dtype=torch.int64, pin_memory=True)
        self.arr = self.host.numpy()
        self.pos = 0
        self.turn = 0
        self.streams: list[set[torch.cuda.Stream]] = [set(), set()]
        self.events: list[list[torch.cuda.Event]] = [[], []]
        self.lock = threading.Lock()

    def put(self, values: Sequence[int], device: torch.device) -> torch.Tensor:
        n = len(values)
        with self.lock:
            if self.pos + n > self.half:
                self._switch()
            start = self.turn * self.half + self.pos
            self.pos += n
            self.arr[start : start + n] = values
            stream = torch.cuda.current_stream(device)
            self.streams[self.turn].add(stream)
            out = torch.empty(n, dtype=torch.int64, device=device)
            out.copy_(self.host[start : start + n], non_blocking=True)
        return out

    def _switch(self) -> None:
        done = []
        for s in self.streams[self.turn]:
            ev = torch.cuda.Event()
            ev.record(s)
            done.append(ev)
        self.events[self.turn], self.streams[self.turn] = done, set()
        self.turn ^= 1
        for ev in self.events[self.turn]:
            ev.synchronize()
        self.events[self.turn] = []
        self.pos = 0


_rings: dict[torch.device, _PinnedRing] = {}
_rings_lock = threading.Lock()


def _ring(device: torch.device) -> _PinnedRing:
    ring = _rings.get(device)
    if ring is None:
        with _rings_lock:
            ring = _rings.setdefault(device, _PinnedRing())
    return ring


def to_device(
    values: Sequence[int] | Sequence[float], device: torch.device | str, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """``values`` as a tensor on ``device`` (a plain tensor on the CPU), copied without waiting for the stream.

    Args:
        values: numbers (a flat list).
        device: target device.
        dtype: tensor dtype (default: torch's inference, int64 for ints).

    Returns:
        ``[len(values)]`` tensor on ``device``.
    """
    traffic.put()
    dev = torch.device(device)
    if dev.type == "cpu":
        return torch.tensor(values, dtype=dtype)
    ints = dtype is torch.int64 or (dtype is None and all(type(v) is int for v in values))
    # The ring's host memory is rewritten later: a graph being captured must not record a copy from it.
    if ints and 0 < len(values) <= 1024 and not torch.cuda.is_current_stream_capturing():
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        return _ring(dev).put(values, dev)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(dev, non_blocking=True)
