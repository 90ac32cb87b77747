"""Where the GPU waits for the host during decode steps: idle time of the device, by project function.

`idle_sites` profiles a few steps (torch profiler, CPU + CUDA activity, Python frames recorded) and
walks the GPU timeline: every interval in which no kernel, copy or memset runs is idle time, and each
idle microsecond is charged to the innermost project frame (``trtllm_glm/...``, or the benchmark's own)
that the host was executing at that moment. Unlike a cProfile of the host (`bench_e2e.host_profile`),
which counts a function's time whether or not the device was busy meanwhile, this names only the host
work the device actually waited for. Python frame recording slows the host (roughly 1.5-2x): shares are
meaningful, absolute idle times are upper bounds.

`attribute_idle` is the pure part (intervals in, charges out) and runs on the CPU in the tests.
"""

from __future__ import annotations

import bisect
import json
import os
import tempfile
from collections.abc import Callable, Sequence

__all__ = ["attribute_idle", "idle_sites", "merge_intervals"]

# Chrome-trace categories of device activity.
_DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")


def merge_intervals(spans: Sequence[tuple[float, float]]) -> list[tuple[float, float]]:
    """The union of ``(start, end)`` spans as sorted, disjoint spans."""
    out: list[tuple[float, float]] = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            if b > out[-1][1]:
                out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return out


def attribute_idle(
    busy: Sequence[tuple[float, float]],
    frames: Sequence[tuple[float, float, str]],
    window: tuple[float, float],
    *,
    resolution: float = 1.0,
) -> tuple[float, float, dict[str, float], dict[str, float]]:
    """Charge the device's idle time inside ``window`` to the innermost host frame running meanwhile.

    Args:
        busy: ``(start, end)`` device activity (kernels, copies), any order, overlaps allowed.
        frames: ``(start, end, name)`` host frames of one thread; properly nested (a frame that starts inside
            another ends inside it), so the innermost frame at a time is the latest-starting one covering it.
        window: ``(start, end)`` the span to account.
        resolution: sampling step (same unit as the times) inside idle spans.

    Returns:
        ``(busy_time, idle_time, inner, inclusive)`` inside ``window``. ``inner[name]`` is the idle time during
        which ``name`` was the innermost frame, ``inner["(no project frame)"]`` what no frame covered (the
        interpreter between calls); ``inclusive[name]`` the idle time during which ``name`` was anywhere on
        the stack (a frame recursing into itself counts once).
    """
    lo, hi = window
    if hi <= lo:
        raise ValueError(f"empty window {window}")
    if resolution <= 0:
        raise ValueError("resolution must be positive")
    merged = [(max(a, lo), min(b, hi)) for a, b in merge_intervals(busy) if b > lo and a < hi]
    busy_t = sum(b - a for a, b in merged)
    idle: list[tuple[float, float]] = []
    t = lo
    for a, b in merged:
        if a > t:
            idle.append((t, a))
        t = max(t, b)
    if t < hi:
        idle.append((t, hi))
    fr = sorted(frames, key=lambda f: (f[0], -f[1]))
    starts = [f[0] for f in fr]
    # Parent of each frame: the innermost earlier frame still open at its start (nesting).
    parent: list[int] = []
    stack: list[int] = []
    for i, (s, _, _) in enumerate(fr):
        while stack and fr[stack[-1]][1] <= s:
            stack.pop()
        parent.append(stack[-1] if stack else -1)
        stack.append(i)
    charges: dict[str, float] = {}
    inclusive: dict[str, float] = {}
    for a, b in idle:
        n = max(1, round((b - a) / resolution))
        step = (b - a) / n
        for k in range(n):
            x = a + (k + 0.5) * step
            # Frames starting at or before x; the innermost covering one is the latest such start that ends
            # after x (nesting: walk back until one covers x).
            i = bisect.bisect_right(starts, x) - 1
            while i >= 0 and fr[i][1] <= x:
                i -= 1
            name = fr[i][2] if i >= 0 else "(no project frame)"
            charges[name] = charges.get(name, 0.0) + step
            seen = set()
            while i >= 0:
                if fr[i][1] > x and fr[i][2] not in seen:
                    seen.add(fr[i][2])
                    inclusive[fr[i][2]] = inclusive.get(fr[i][2], 0.0) + step
                i = parent[i]
    return busy_t, sum(b - a for a, b in idle), charges, inclusive


def _is_step(site: str) -> bool:
    """Whether a project frame is an executor's ``step`` (`Executor.step`)."""
    return site.startswith("runtime/") and site.endswith(" step")


def _project_frame(name: str) -> str | None:
    """``trtllm_glm/x.py(12): f`` -> ``x.py:12 f`` for project / benchmark frames, else None."""
    for root in ("trtllm_glm/", "benchmarks/"):
        k = name.find(root)
        if k >= 0:
            path_line, _, fn = name[k + len(root) :].partition(": ")
            path, _, line = path_line.rstrip(")").partition("(")
            return f"{root if root == 'benchmarks/' else ''}{path}:{line} {fn}"
    return None


def idle_sites(step: Callable[[], object], steps: int, n: int) -> dict:
    """Profile ``steps`` calls of ``step`` (after one more) and charge the GPU's idle time to the host's frames.

    Args:
        step: one decode step (``Executor.step``).
        steps: how many steps to profile (consecutive).
        n: how many sites to return.

    Returns:
        ``{"busy_us": per step, "idle_us": per step, "sites": [(site, idle µs per step), ...], "inclusive":
        [...]}``: idle time by innermost frame and by every frame on the stack, most first; empty lists when
        nothing ran on the device.
    """
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=True) as prof:
        # One step more than counted: the first CUDA calls under a fresh profiler absorb its start-up
        # (milliseconds in whatever call comes first), so the window starts at the second step.
        for _ in range(steps + 1):
            step()
        torch.cuda.synchronize()
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        with open(path) as f:
            trace = json.load(f)
    finally:
        os.unlink(path)
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]
    busy = [(float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in events if e.get("cat") in _DEVICE_CATS]
    if not busy:
        return {"busy_us": 0.0, "idle_us": 0.0, "sites": [], "inclusive": []}
    py = [e for e in events if e.get("cat") == "python_function"]
    # The main thread: the one with the most project frames.
    by_tid: dict[object, list[tuple[float, float, str]]] = {}
    for e in py:
        site = _project_frame(e.get("name", ""))
        if site is not None:
            by_tid.setdefault(e.get("tid"), []).append((float(e["ts"]), float(e["ts"]) + float(e["dur"]), site))
    frames = max(by_tid.values(), key=len) if by_tid else []
    # From the second step's start to the last device activity.
    starts = sorted(f[0] for f in frames if _is_step(f[2]))
    lo = starts[1] if len(starts) > 1 else min([f[0] for f in frames] + [b[0] for b in busy])
    hi = max(b[1] for b in busy)
    busy_t, idle_t, inner, inclusive = attribute_idle(busy, frames, (lo, hi))

    def top(d: dict[str, float]) -> list[tuple[str, float]]:
        return [(k, round(v / steps, 1)) for k, v in sorted(d.items(), key=lambda kv: -kv[1])[:n]]

    return {
        "busy_us": round(busy_t / steps, 1),
        "idle_us": round(idle_t / steps, 1),
        "sites": top(inner),
        "inclusive": top(inclusive),
        "last_step": _last_step_timeline(events, busy, frames),
    }


def _last_step_timeline(
    events: list[dict], busy: list[tuple[float, float]], frames: list[tuple[float, float, str]], min_us: float = 25.0
) -> list[tuple[float, float, str]]:
    """The last profiled step as ``(start µs from its beginning, duration µs, what)``, in time order: merged GPU
    activity (``GPU``), project frames and CUDA runtime calls (``cuda: name``) of at least ``min_us``."""
    steps = [f for f in frames if _is_step(f[2])]
    if not steps:
        return []
    lo, hi = max(steps, key=lambda f: f[0])[:2]
    hi = max([hi] + [b for a, b in busy if a < hi])
    out = [(a, b - a, "GPU") for a, b in merge_intervals(busy) if b > lo and a < hi]
    out += [(a, b - a, nm) for a, b, nm in frames if a >= lo and b <= hi and b - a >= min_us]
    for e in events:
        if e.get("cat") == "cuda_runtime" and float(e["dur"]) >= min_us and lo <= float(e["ts"]) <= hi:
            out.append((float(e["ts"]), float(e["dur"]), "cuda: " + e.get("name", "")))
    out.sort()
    return [(round(a - lo, 1), round(d, 1), w) for a, d, w in out]
