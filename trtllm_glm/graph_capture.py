"""CUDA-graph capture that survives the rest of the process: `capture_graph`, the one way the package captures.

The cyclic garbage collector runs once before a capture and is held off during it (`capture_session`: collect once
and freeze for many captures in a row); a failed capture ends its pool's recording, restores the caller's stream and
raises `GraphCaptureError` (capture the next graph into a fresh pool). The two hazards, as seen on an H200 / H100:
docs/gpu.md, "Capturing in a long-lived process". A captured graph is uploaded to the device at once (`upload_graph`):
otherwise its first replay pays the upload, inside whichever step first meets that graph. Imports nothing of the package
but `envs` (a leaf).
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
from collections.abc import Iterator

import torch

from . import envs

__all__ = ["GraphCaptureError", "capture_graph", "capture_session", "end_pool_recording", "upload_graph"]


class GraphCaptureError(RuntimeError):
    """A CUDA-graph capture failed. Its memory pool can take no further capture: capture the next graph into a
    fresh ``torch.cuda.graph_pool_handle()`` (graphs captured into the pool before stay valid)."""


def end_pool_recording(device: int, pool: tuple[int, int]) -> bool:
    """End the caching allocator's allocation to ``pool`` on ``device`` (after a failed capture).

    Returns:
        True if a recording was ended; False if none was under way (or this torch has no such call).
    """
    end = getattr(torch._C, "_cuda_endAllocateToPool", None)  # torch >= 2.6 (CUDA and CPU builds)
    if end is None:
        return False
    try:
        end(device, pool)
    except RuntimeError:  # "not currently recording": the capture failed before it began allocating
        return False
    return True


_sessions = 0


@contextlib.contextmanager
def capture_session() -> Iterator[None]:
    """Many captures in a row: one full collection now, then the objects alive are frozen (``gc.freeze``) so
    that each `capture_graph` inside collects only what was made since; unfrozen when the outermost session
    ends (sessions nest)."""
    global _sessions
    if _sessions == 0:
        gc.collect()
        gc.freeze()
    _sessions += 1
    try:
        yield
    finally:
        _sessions -= 1
        if _sessions == 0:
            gc.unfreeze()


@contextlib.contextmanager
def capture_graph(
    graph: torch.cuda.CUDAGraph, pool: tuple[int, int] | None = None, stream: torch.cuda.Stream | None = None
) -> Iterator[None]:
    """``torch.cuda.graph(graph, pool, stream)`` with the garbage collector run before and held off during the
    capture; a failed capture ends the pool's recording, restores the current stream and raises
    `GraphCaptureError` (from the original exception).

    Args:
        graph: the graph to capture into.
        pool: a ``torch.cuda.graph_pool_handle()`` to share with other graphs, or None (a pool of its own).
        stream: the capture stream (None: torch's default capture stream).
    """
    if pool is None:  # a pool of its own, but one whose id we know (to end its recording after a failure)
        pool = torch.cuda.graph_pool_handle()
    gc.collect()  # a dropped executor's graphs and pinned buffers are destroyed now, not inside the capture
    # (inside a `capture_session` this walks only the objects made since the session began)
    enabled = gc.isenabled()
    gc.disable()
    device = torch.cuda.current_device()
    current = torch.cuda.current_stream(device)
    try:
        with torch.cuda.graph(graph, pool=pool, stream=stream):
            yield
    except Exception as e:
        end_pool_recording(device, pool)
        torch.cuda.set_stream(current)  # torch.cuda.graph leaves its capture stream current when capture_end raises
        raise GraphCaptureError(f"CUDA graph capture failed: {type(e).__name__}: {e}") from e
    finally:
        if enabled:
            gc.enable()
    if envs.GRAPH_UPLOAD.get():
        upload_graph(graph)


# The CUDA runtime torch runs on, loaded once (False: none found; `_cudart`).
_runtime: ctypes.CDLL | bool | None = None


def _cudart() -> ctypes.CDLL | None:
    """The ``libcudart`` this process has mapped (torch's own: a graph handle is only valid in the runtime that made
    it), or None where none is mapped (a static runtime, no CUDA)."""
    global _runtime
    if _runtime is None:
        _runtime = False
        try:
            with open("/proc/self/maps") as f:
                paths = sorted({line.split()[-1] for line in f if "/libcudart.so" in line})
            # torch's own major version first, should another runtime be mapped beside it
            major = f"/libcudart.so.{(torch.version.cuda or '').split('.')[0]}"
            paths.sort(key=lambda p: major not in p)
            if paths:
                lib = ctypes.CDLL(paths[0])
                lib.cudaGraphUpload.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
                lib.cudaGraphUpload.restype = ctypes.c_int
                _runtime = lib
        except (OSError, AttributeError):  # no /proc, or a runtime without the call
            pass
    return _runtime or None


def upload_graph(graph: torch.cuda.CUDAGraph, stream: torch.cuda.Stream | None = None) -> bool:
    """Upload an instantiated graph to the device now (``cudaGraphUpload`` on ``stream``, default the current one),
    so that its first replay costs what the later ones do.

    Without it the first ``cudaGraphLaunch`` of each graph uploads it, host-synchronously: a cost paid inside the
    first step that meets each (batch size, draft width) graph, which a policy timing its rounds then takes for the
    round's own. Returns False where it could not (no mapped CUDA runtime, a torch without
    ``raw_cuda_graph_exec``, an error code): the first replay then uploads, as before.
    """
    lib = _cudart()
    raw = getattr(graph, "raw_cuda_graph_exec", None)
    if lib is None or raw is None:
        return False
    s = stream if stream is not None else torch.cuda.current_stream()
    return lib.cudaGraphUpload(ctypes.c_void_p(raw()), ctypes.c_void_p(s.cuda_stream)) == 0
