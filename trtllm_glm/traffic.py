"""Opt-in accounting of the host <-> device traffic of the executor's steps (issue 43: the host's share of a round).

Off by default and then free (one global ``None`` test per site). Inside `recording()` every host-to-device put of
the library's own transfer paths (`transfer.to_device`, the metadata's `HostStaging` copies) and every read-back
the library waits for at its own sites (a step's results, its packed rows, deferred drafts) is counted, attributed to
a source site (``file:line function`` of the caller inside the package, or a name the site gives).

On the CPU the counts are those of the GPU (the same calls run), though nothing waits there: that is how the CPU
tests and ``benchmarks/bench_round_host.py`` measure the syncs of a round. Reads hidden in arbitrary tensor methods
(``.item()``, ``.tolist()``, ``.cpu()``) are caught by the benchmark / test helper
``benchmarks.harness.host_traffic.watch_tensor_reads``, which wraps them only inside its context manager; the
library's read-back sites register their code here (`HOST_BUFFER_READERS`) so that the tensor reads they make of
their own host buffers are not counted twice.
"""

from __future__ import annotations

import collections
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import CodeType

__all__ = ["Traffic", "HOST_BUFFER_READERS", "current", "put", "read", "recording", "site_of"]


@dataclass
class Traffic:
    """Counters of one recording: ``reads`` (blocking device-to-host reads) and ``puts`` (host-to-device copies),
    each a `collections.Counter` of sites."""

    reads: collections.Counter = field(default_factory=collections.Counter)
    puts: collections.Counter = field(default_factory=collections.Counter)

    def clear(self) -> None:
        self.reads.clear()
        self.puts.clear()

    @property
    def num_reads(self) -> int:
        return sum(self.reads.values())

    @property
    def num_puts(self) -> int:
        return sum(self.puts.values())


_rec: Traffic | None = None
# The transfer code itself is never a site: its caller is.
_SKIPPED = {__file__, __file__.replace("traffic.py", "transfer.py")}

# Code objects of the library functions that count their own read (`read`) and then read a host buffer with a
# tensor method: the tensor-method helper skips reads made directly from them.
HOST_BUFFER_READERS: set[CodeType] = set()


def current() -> Traffic | None:
    """The active recording, or None."""
    return _rec


def site_of(depth: int) -> str:
    """``file:line function`` of the innermost frame at least ``depth`` frames up that lies in the package outside
    this module and `transfer` (the caller of a transfer helper is the site), else of the innermost frame outside
    those two."""
    f = sys._getframe(depth)
    first = None
    while f is not None:
        name = f.f_code.co_filename
        if name not in _SKIPPED:
            if "trtllm_glm" in name:
                break
            first = first or f
        f = f.f_back
    f = f or first or sys._getframe(depth)
    path = f.f_code.co_filename
    if "trtllm_glm" in path:
        path = path.rsplit("trtllm_glm", 1)[1].lstrip("/")
    return f"{path}:{f.f_lineno} {f.f_code.co_name}"


def put(site: str | None = None, n: int = 1) -> None:
    """Count ``n`` host-to-device copies at ``site`` (default: the calling site in the package)."""
    r = _rec
    if r is not None:
        r.puts[site or site_of(2)] += n


def read(site: str | None = None, n: int = 1) -> None:
    """Count ``n`` blocking device-to-host reads at ``site`` (default: the calling site in the package)."""
    r = _rec
    if r is not None:
        r.reads[site or site_of(2)] += n


@contextmanager
def recording(traffic: Traffic | None = None) -> Iterator[Traffic]:
    """Count the traffic inside the block into ``traffic`` (default a fresh `Traffic`); nests (the outer recording
    resumes afterwards)."""
    global _rec
    prev, _rec = _rec, traffic if traffic is not None else Traffic()
    try:
        yield _rec
    finally:
        _rec = prev
