"""CPU time of a process tree, per process and per thread, from ``/proc`` (Linux): where a server's host time goes.

A served run is bounded by whichever Python thread saturates first (the API process's event loop, its receiver
thread, the engine loop); a thread near 100 % of one core is the bottleneck whatever the GPU does. `snapshot` reads
every thread's ``utime + stime`` of a root process and its descendants; `usage` turns two snapshots into shares of
one core over the wall time between them.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

__all__ = ["CpuSnapshot", "format_usage", "snapshot", "usage"]

_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


@dataclass
class CpuSnapshot:
    """Thread CPU seconds at one moment: ``{(pid, tid): (comm, seconds)}``, the processes' command names
    ``{pid: name}`` and the wall clock (``time.monotonic``)."""

    threads: dict[tuple[int, int], tuple[str, float]]
    names: dict[int, str]
    t: float


def _stat(path: str) -> tuple[str, int, float] | None:
    """(comm, ppid, CPU seconds) from a ``stat`` file, None if it vanished."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            s = f.read()
    except OSError:
        return None
    lo, hi = s.find("("), s.rfind(")")
    rest = s[hi + 2 :].split()
    # Fields after comm: state(0) ppid(1) ... utime(11) stime(12).
    return s[lo + 1 : hi], int(rest[1]), (int(rest[11]) + int(rest[12])) / _TICK


def _tree(root: int) -> list[int]:
    """``root`` and its descendants (one scan of /proc)."""
    children: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            st = _stat(f"/proc/{d}/stat")
            if st is not None:
                children.setdefault(st[1], []).append(int(d))
    out, todo = [], [root]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, []))
    return out


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def snapshot(root: int) -> CpuSnapshot:
    """Every thread's CPU seconds in the process tree under ``root`` (empty off Linux)."""
    threads: dict[tuple[int, int], tuple[str, float]] = {}
    names: dict[int, str] = {}
    if not os.path.isdir("/proc"):
        return CpuSnapshot(threads, names, time.monotonic())
    for pid in _tree(root):
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        names[pid] = _cmdline(pid)
        for tid in tids:
            st = _stat(f"/proc/{pid}/task/{tid}/stat")
            if st is not None:
                threads[(pid, int(tid))] = (st[0], st[2])
    return CpuSnapshot(threads, names, time.monotonic())


def usage(a: CpuSnapshot, b: CpuSnapshot, top: int = 4) -> list[dict]:
    """Per process of ``b``: its name, its CPU share (1.0 = one core busy the whole interval) and its ``top``
    busiest threads' shares (``main`` is the thread whose id is the process id), busiest process first."""
    wall = max(b.t - a.t, 1e-9)
    per: dict[int, list[tuple[float, str]]] = {}
    for (pid, tid), (comm, sec) in b.threads.items():
        busy = (sec - a.threads.get((pid, tid), (comm, 0.0))[1]) / wall
        per.setdefault(pid, []).append((busy, "main" if tid == pid else f"{comm}:{tid}"))
    rows = []
    for pid, ths in per.items():
        ths.sort(reverse=True)
        rows.append({
            "pid": pid, "name": b.names.get(pid, ""), "cpu": sum(x for x, _ in ths),
            "threads": [{"thread": n, "cpu": round(x, 3)} for x, n in ths[:top] if x > 0.005],
        })  # fmt: skip
    rows.sort(key=lambda r: -r["cpu"])
    return rows


def format_usage(rows: list[dict], label: dict[int, str] | None = None) -> str:
    """One line per process: ``label 87% (main 61%, python3:123 22%)``."""
    parts = []
    for r in rows:
        if r["cpu"] < 0.01:
            continue
        name = (label or {}).get(r["pid"]) or r["name"].split(" ")[-1][:40] or str(r["pid"])
        ths = ", ".join(f"{t['thread']} {100 * t['cpu']:.0f}%" for t in r["threads"])
        parts.append(f"{name} {100 * r['cpu']:.0f}% ({ths})")
    return "; ".join(parts)
