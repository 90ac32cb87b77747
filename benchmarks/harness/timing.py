"""Timers: ``do_bench`` medians, CUDA-graph replays, CUDA-event medians and loops."""

from __future__ import annotations

from collections.abc import Callable

import torch

# (warm-up ms, repetition ms) of `bench_us`: full, --quick, and slow cases (a host loop per call).
_FULL, _QUICK, _SLOW = (25, 200), (10, 40), (5, 30)


def do_bench_us(fn: Callable[[], object], warmup: int, rep: int) -> float:
    """Median microseconds of ``fn`` under ``triton.testing.do_bench`` (the L2 flushed before each run)."""
    from triton.testing import do_bench

    return do_bench(fn, warmup=warmup, rep=rep, return_mode="median") * 1e3


def bench_us(fn: Callable[[], object], quick: bool = False, slow: bool = False) -> float:
    """`do_bench_us` with the kernel benchmarks' repetition budget (``quick`` for smoke runs)."""
    warmup, rep = _SLOW if slow else _QUICK if quick else _FULL
    return do_bench_us(fn, warmup, rep)


def graph_us(calls: list[Callable[[], object]], reps: int) -> float:
    """Microseconds per call of a CUDA graph replaying ``calls`` in order (median over ``reps`` replays)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for c in calls:  # warm-up (compilation, allocator) outside the capture
            c()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for c in calls:
            c()
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    times = []
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(reps):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / len(calls))
    del graph
    times.sort()
    return times[len(times) // 2]


def graph_us_quick(calls: list[Callable[[], object]], quick: bool) -> float:
    """`graph_us` over 30 replays (10 with ``quick``)."""
    return graph_us(calls, 10 if quick else 30)


def event_us(fn: Callable[[], object], iters: int = 20, warmup: int = 3) -> float:
    """Median microseconds of ``fn`` over ``iters`` calls, each between two CUDA events, after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) * 1e3)
    ts.sort()
    return ts[len(ts) // 2]


def loop_us(fn: Callable[[], object], iters: int, warmup: int = 0) -> float:
    """Mean microseconds per call of ``iters`` back-to-back calls between two CUDA events (no host sync
    between calls), after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    if warmup:
        torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return 1e3 * start.elapsed_time(end) / iters
