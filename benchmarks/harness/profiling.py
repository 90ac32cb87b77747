"""Breakdowns of one step: the costliest kernels, launch sites, host time, launches and syncs."""

from __future__ import annotations

import torch


def top_kernels(step, n: int) -> list[tuple[str, float, int]]:
    """The ``n`` device kernels that took the most time in one call of ``step``: (name, µs, calls), after a
    first row with the sum over every kernel (GPU busy time and kernel count; the step time minus it is idle).

    Kernels replayed from a CUDA graph are recorded too (CUPTI), so this also breaks down a graph step.
    """
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    by_name: dict[str, list[float]] = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA and e.device_time_total > 0:
            by_name.setdefault(e.name[:90], []).append(e.device_time_total)
    rows = sorted(((k, sum(v), len(v)) for k, v in by_name.items()), key=lambda r: -r[1])
    every = ("(all kernels: busy time, count)", sum(r[1] for r in rows), sum(r[2] for r in rows))
    return [(k, round(t, 1), c) for k, t, c in [every, *rows[:n]]]


# Aten ops that only re-describe memory (no kernel launch).
VIEW_OPS = ("view", "_unsafe_view", "t", "detach", "detach_", "slice", "select", "as_strided", "expand",
             "unsqueeze", "squeeze", "permute", "transpose", "alias", "split", "split_with_sizes", "unbind",
             "empty", "empty_strided", "empty_like", "lift_fresh", "narrow", "reshape", "chunk", "sym_size",
             "is_same_size", "new_empty", "new_empty_strided", "resolve_conj", "resolve_neg", "set_")  # fmt: skip


# Aten ops that return their input unchanged when it already has the asked dtype / layout (no launch then).
_CASTS = ("to", "contiguous", "type_as")


def op_sites(step, n: int) -> list[tuple[str, int]]:
    """The torch ops of one call of ``step`` by call site: the ``n`` busiest (``op @ file:line function`` of the
    innermost ``trtllm_glm`` frame, calls), after a first row with the total. Each such op is about one kernel
    launch, so this shows where a step's small launches come from (Triton launches are not torch ops and are
    not counted). Only eager steps have call sites: a replayed graph is one launch.
    """
    import traceback

    from torch.utils._python_dispatch import TorchDispatchMode

    count: dict[str, int] = {}

    class _Sites(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
            op = func.overloadpacket.__name__
            if op not in VIEW_OPS:
                frames = [f for f in traceback.extract_stack() if "trtllm_glm/" in f.filename]
                f = frames[-1] if frames else None
                site = f"{f.filename.split('trtllm_glm/')[-1]}:{f.lineno} {f.name}" if f else "?"
                key = f"{op} @ {site}"
                count[key] = count.get(key, 0) + 1
            return func(*args, **(kwargs or {}))

    with _Sites():
        step()
    rows = sorted(count.items(), key=lambda r: -r[1])
    return [("(all torch ops)", sum(count.values())), *rows[:n]]


def host_profile(ex, steps: int, n: int) -> list[tuple[str, float, float]]:
    """Where the host spends a step: the ``n`` package functions with the most cumulative time over up to
    ``steps`` steps (cProfile), as (``file:line function``, ms per step, calls per step)."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    done = 0
    prof.enable()
    while done < steps and ex.has_work:
        ex.step()
        done += 1
    prof.disable()
    if not done:
        return []
    st = pstats.Stats(prof).stats  # (file, line, name) -> (prim calls, calls, tottime, cumtime, callers)
    rows = []
    for (f, line, name), (_, calls, _, cum, _) in st.items():
        if "trtllm_glm" in f:
            rows.append((f"{f.split('trtllm_glm/')[-1]}:{line} {name}", 1e3 * cum / done, calls / done))
    rows.sort(key=lambda r: -r[1])
    return [(k, round(ms, 3), round(c, 1)) for k, ms, c in rows[:n]]


def count_launches_and_syncs(step) -> tuple[int, int]:
    """Kernel launches and device-to-host synchronisations of one call of ``step`` (torch profiler)."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=acts) as prof:
        step()
    launches = syncs = 0
    for e in prof.events():
        n = e.name
        if n in ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx", "cudaGraphLaunch"):
            launches += 1
        # An event wait is a sync too (`HostStaging.acquire`, results read back late): the host blocks on the GPU.
        elif n in ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize") or (
            n == "cudaMemcpyAsync" and "DtoH" in str(e)
        ):
            syncs += 1
    return launches, syncs


def module_host_ms(root: torch.nn.Module, step, names: tuple[str, ...]) -> dict[str, tuple[float, int]]:
    """Host wall time inside the forwards of ``root``'s modules whose class name is in ``names``, over one call of
    ``step``: ``{class name: (ms, calls)}``, inclusive of nested modules, plus ``"(step)"``: the whole call.

    Forward hooks read the host clock only (nothing synchronises), so on CUDA this is the time the host spent
    issuing each part, not the GPU's: a host-bound eager step's budget by part.
    """
    import time

    acc: dict[str, list[float]] = {}
    start: dict[int, list[float]] = {}

    def pre(mod, args):  # noqa: ANN001, ARG001
        start.setdefault(id(mod), []).append(time.perf_counter())

    def post(mod, args, out):  # noqa: ANN001, ARG001
        t0 = start[id(mod)].pop()
        a = acc.setdefault(type(mod).__name__, [0.0, 0])
        a[0] += time.perf_counter() - t0
        a[1] += 1

    handles = []
    for m in root.modules():
        if type(m).__name__ in names:
            handles += [m.register_forward_pre_hook(pre), m.register_forward_hook(post)]
    t = time.perf_counter()
    try:
        step()
    finally:
        for h in handles:
            h.remove()
    out = {"(step)": (round(1e3 * (time.perf_counter() - t), 3), 1)}
    out.update({k: (round(1e3 * v[0], 3), int(v[1])) for k, v in sorted(acc.items(), key=lambda kv: -kv[1][0])})
    return out


def _resolve(name: str) -> tuple[object, str, object]:
    """``(owner, attr, raw)`` of a ``"package.module:attr"`` / ``"package.module:Class.attr"`` name (see
    `func_host_ms`); ValueError for a name that does not resolve to a plain function or method."""
    import importlib

    mod_name, _, path = name.partition(":")
    owner: object = importlib.import_module(mod_name)
    *outer, attr = path.split(".")
    for part in outer:
        owner = getattr(owner, part)
    if isinstance(owner, type) and attr not in owner.__dict__:
        raise ValueError(f"{name}: {attr} is not defined in {owner.__name__} itself (name the class that is)")
    raw = owner.__dict__[attr] if isinstance(owner, type) else getattr(owner, attr)
    if isinstance(raw, staticmethod | classmethod):
        raise ValueError(f"{name}: static and class methods are not timed")
    return owner, attr, raw


def _with_wrapped(names: tuple[str, ...], wrap, run) -> None:  # noqa: ANN001
    """Call ``run()`` with each named function replaced by ``wrap(label, fn)`` (label: the name after ``:``),
    restoring them afterwards."""
    undo: list[tuple[object, str, object]] = []
    try:
        for name in names:
            owner, attr, raw = _resolve(name)
            undo.append((owner, attr, raw))
            setattr(owner, attr, wrap(name.partition(":")[2], raw))
        run()
    finally:
        for owner, attr, raw in reversed(undo):
            setattr(owner, attr, raw)


def func_host_ms(
    step, names: tuple[str, ...], reps: int = 1, fused: tuple[str, ...] = ()
) -> dict[str, tuple[float, int]]:
    """Host wall time inside each named function over ``reps`` calls of ``step``, per call: ``{name: (ms, calls)}``,
    inclusive of what it calls, plus ``"(step)"``. Names are ``"package.module:attr"`` or
    ``"package.module:Class.attr"`` with ``Class`` the class defining ``attr`` (wrapped there, so every instance's call
    is timed; a module function only where it is looked up through its module at call time).

    Only the host clock is read (no profiler, no synchronisation): the time the host spent issuing each part, with
    one clock read per call in and out instead of cProfile's per-function overhead. A name that does not resolve is
    an error (a renamed function must not silently vanish from a breakdown).

    ``fused`` (named alike; see `op_counts`): functions CUDA runs as fused kernels while the CPU runs their torch
    reference. Time inside them is left out of every row (``"(step)"`` too), and ``"(fused)"`` reports it with their
    calls: on the CPU proxy the rest is the orchestration's host time (Python, index building, the torch ops around
    the kernels), which the GPU pays too, while a reference's compute stands in for a kernel launch's host cost.
    """
    import functools
    import time

    acc: dict[str, list[float]] = {}
    inside = [0.0, 0, 0]  # time inside fused functions so far, their calls, nesting depth

    def wrap(label: str, fn):  # noqa: ANN001, ANN202
        a = acc.setdefault(label, [0.0, 0])

        @functools.wraps(fn)
        def timed(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            f0 = inside[0]
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                a[0] += time.perf_counter() - t0 - (inside[0] - f0)
                a[1] += 1

        return timed

    def wrap_fused(label: str, fn):  # noqa: ANN001, ANN202, ARG001
        @functools.wraps(fn)
        def timed(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            if inside[2]:  # nested: the outer call times it
                return fn(*args, **kwargs)
            inside[1] += 1
            inside[2] += 1
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                inside[0] += time.perf_counter() - t0
                inside[2] -= 1

        return timed

    total = [0.0]

    def run() -> None:
        t = time.perf_counter()
        for _ in range(reps):
            step()
        total[0] = time.perf_counter() - t - inside[0]

    _with_wrapped(names, wrap, lambda: _with_wrapped(fused, wrap_fused, run))
    out = {"(step)": (round(1e3 * total[0] / reps, 3), 1)}
    if fused:
        out["(fused)"] = (round(1e3 * inside[0] / reps, 3), round(inside[1] / reps))
    out.update({k: (round(1e3 * v[0] / reps, 3), round(v[1] / reps)) for k, v in acc.items()})
    return out


def op_counts(
    step,
    funcs: tuple[str, ...],
    root: torch.nn.Module | None = None,
    modules: tuple[str, ...] = (),
    fused: tuple[str, ...] = (),
) -> dict[str, tuple[int, int]]:
    """Torch ops (aten calls that are not views, `VIEW_OPS`) issued inside each named function and each module class
    over one call of ``step``: ``{name: (ops, calls)}``, inclusive, plus ``"(step)"``. ``funcs`` are named as for
    `func_host_ms`; ``modules`` are class names of ``root``'s modules (forward hooks, as `module_host_ms`).

    On the GPU an eager op is about one kernel launch and its host cost, so on the CPU this counts the launches an
    eager step would issue where the code path is the CUDA one. ``fused`` names the functions (named as ``funcs``)
    that CUDA runs as a fused kernel while the CPU runs their torch reference: each call counts as one op and the
    reference's own ops not at all, so the counts are launch equivalents of the CUDA path (a fused op of two or
    three launches still counts one). Triton launches themselves are not torch ops (a CUDA run counts none of them).
    """
    import functools

    from torch.utils._python_dispatch import TorchDispatchMode

    active: dict[str, int] = {}  # name -> nesting depth (a recursive call counts its ops once)
    acc: dict[str, list[int]] = {}
    total = [0]
    in_fused = [0]  # depth inside `fused` functions: their ops are the CPU's stand-in for one kernel

    def count_one() -> None:
        total[0] += 1
        for label in active:
            acc[label][0] += 1

    def enter(label: str) -> None:
        a = acc.setdefault(label, [0, 0])
        a[1] += 1
        active[label] = active.get(label, 0) + 1

    def leave(label: str) -> None:
        active[label] -= 1
        if not active[label]:
            del active[label]

    class _Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
            out = func(*args, **(kwargs or {}))
            op = func.overloadpacket.__name__
            # A cast that returns its input (``.to`` / ``.float()`` / ``.contiguous()`` of what already is) launches
            # nothing (in-place ops return their input too, and do launch).
            if not in_fused[0] and op not in VIEW_OPS and not (op in _CASTS and args and out is args[0]):
                count_one()
            return out

    def wrap(label: str, fn):  # noqa: ANN001, ANN202
        acc.setdefault(label, [0, 0])

        @functools.wraps(fn)
        def counted(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            enter(label)
            try:
                return fn(*args, **kwargs)
            finally:
                leave(label)

        return counted

    handles = []
    if root is not None:
        for m in root.modules():
            name = type(m).__name__
            if name in modules:
                acc.setdefault(name, [0, 0])
                handles.append(m.register_forward_pre_hook(lambda mod, a, n=name: enter(n)))  # noqa: ARG005
                handles.append(m.register_forward_hook(lambda mod, a, o, n=name: leave(n)))  # noqa: ARG005

    def wrap_fused(label: str, fn):  # noqa: ANN001, ANN202, ARG001
        @functools.wraps(fn)
        def one(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            if not in_fused[0]:
                count_one()
            in_fused[0] += 1
            try:
                return fn(*args, **kwargs)
            finally:
                in_fused[0] -= 1

        return one

    def run() -> None:
        with _Count():
            step()

    try:
        _with_wrapped(funcs, wrap, lambda: _with_wrapped(fused, wrap_fused, run))
    finally:
        for h in handles:
            h.remove()
    out = {"(step)": (total[0], 1)}
    out.update({k: (v[0], v[1]) for k, v in acc.items()})
    return out
