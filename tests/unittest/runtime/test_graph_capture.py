"""`trtllm_glm.graph_capture.capture_graph` on the CPU, with torch's capture calls replaced by recorders: the
garbage collector runs before the capture and is held off during it; a failed capture ends its pool's recording,
restores the current stream and raises `GraphCaptureError`, after which the graph runner captures into a fresh
pool. The GPU twin (`test_graph_capture_gpu.py`) captures for real."""

from __future__ import annotations

import contextlib
import gc

import pytest
import torch

from trtllm_glm.graph_capture import GraphCaptureError, capture_graph, capture_session, end_pool_recording
from trtllm_glm.runtime.cuda_graph import CudaGraphRunner, GraphStats

pytestmark = pytest.mark.cpu_only


class _Finalized:
    """Sits in a reference cycle; records when the collector frees it."""

    log: list[str] = []

    def __init__(self) -> None:
        self.me = self

    def __del__(self) -> None:
        _Finalized.log.append("freed")


@pytest.fixture
def fake_cuda(monkeypatch):
    """torch.cuda's capture calls as recorders: ``events`` lists what happened, in order."""
    events: list[tuple] = []

    @contextlib.contextmanager
    def fake_graph(graph, pool=None, stream=None):
        events.append(("begin", pool, gc.isenabled()))
        current[0] = "capture stream"  # as torch.cuda.graph makes its capture stream current
        yield
        if getattr(graph, "fail_at_end", False):  # what capture_end does after an invalidated capture
            raise RuntimeError("CUDA error: operation failed due to a previous error during capture")
        events.append(("end", pool))

    ends: list[tuple[int, tuple[int, int]]] = []
    current = ["the caller's stream"]
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: current[0])
    monkeypatch.setattr(torch.cuda, "set_stream", lambda s: current.__setitem__(0, s))
    monkeypatch.setattr(torch.cuda, "graph", fake_graph)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: (0, 99))
    monkeypatch.setattr(torch._C, "_cuda_endAllocateToPool", lambda d, p: ends.append((d, p)), raising=False)
    return events, ends


class _Graph:
    fail_at_end = False


def test_collects_before_and_holds_the_collector_off_during_the_capture(fake_cuda) -> None:
    events, ends = fake_cuda
    _Finalized.log.clear()
    old = gc.get_threshold()
    gc.set_threshold(1_000_000)  # no automatic collection: only an explicit one frees the cycle
    try:
        _Finalized()  # garbage in a cycle: only the collector frees it
        assert gc.isenabled() and _Finalized.log == []
        with capture_graph(_Graph(), pool=(0, 7)):
            assert _Finalized.log == ["freed"]  # freed before the capture began
            assert not gc.isenabled()
        assert gc.isenabled()
    finally:
        gc.set_threshold(*old)
    assert events == [("begin", (0, 7), False), ("end", (0, 7))]
    assert ends == []  # a capture that succeeded leaves the allocator alone


def test_a_pool_of_its_own_when_none_is_given(fake_cuda) -> None:
    events, _ = fake_cuda
    with capture_graph(_Graph()):
        pass
    assert events[0][:2] == ("begin", (0, 99))


@pytest.mark.parametrize("where", ["body", "capture_end"])
def test_a_failed_capture_ends_its_pool_recording_restores_the_stream_and_raises(fake_cuda, where: str) -> None:
    events, ends = fake_cuda
    g = _Graph()
    g.fail_at_end = where == "capture_end"
    match = "inside" if where == "body" else "previous error"
    with pytest.raises(GraphCaptureError, match=match) as info, capture_graph(g, pool=(0, 5)):
        if where == "body":
            raise RuntimeError("raised inside the capture")
    assert isinstance(info.value.__cause__, RuntimeError)
    assert ends == [(3, (0, 5))]
    assert torch.cuda.current_stream() == "the caller's stream"
    assert gc.isenabled()


@pytest.mark.parametrize("setting", [None, "0"])
def test_a_captured_graph_is_uploaded_at_once_unless_switched_off(fake_cuda, monkeypatch, setting) -> None:
    """Its first replay would otherwise upload it, inside the first step that meets it (docs/gpu.md)."""
    import trtllm_glm.graph_capture as gc_mod

    uploaded: list = []
    monkeypatch.setattr(gc_mod, "upload_graph", lambda g, stream=None: uploaded.append(g) or True)
    if setting is not None:
        monkeypatch.setenv("TRTLLM_GLM_GRAPH_UPLOAD", setting)
    ok, bad = _Graph(), _Graph()
    bad.fail_at_end = True
    with capture_graph(ok, pool=(0, 7)):
        assert uploaded == []  # not before the capture ends
    with pytest.raises(GraphCaptureError), capture_graph(bad, pool=(0, 8)):
        pass
    assert uploaded == ([ok] if setting is None else [])  # never a graph whose capture failed


def test_upload_calls_the_runtime_with_the_graphs_handle(monkeypatch) -> None:
    """`upload_graph` hands the instantiated graph's handle and the stream to ``cudaGraphUpload`` and reports its
    return code; with no runtime mapped (a CPU build) it calls nothing and returns False (the first replay uploads, as
    before)."""
    import trtllm_glm.graph_capture as gc_mod

    calls: list[tuple[int, int]] = []
    rc = [0]

    class Runtime:
        def cudaGraphUpload(self, graph, stream):  # noqa: ANN001, ANN201, N802 - the C name
            calls.append((graph.value, stream.value))
            return rc[0]

    class Graph:
        def raw_cuda_graph_exec(self) -> int:
            return 0x1234

    class Stream:
        cuda_stream = 0x99

    monkeypatch.setattr(gc_mod, "_runtime", Runtime())
    assert gc_mod.upload_graph(Graph(), Stream()) is True
    rc[0] = 700  # an error code: the first replay will upload
    assert gc_mod.upload_graph(Graph(), Stream()) is False
    assert calls == [(0x1234, 0x99)] * 2
    monkeypatch.setattr(gc_mod, "_runtime", False)  # none mapped
    assert gc_mod.upload_graph(Graph(), Stream()) is False
    assert len(calls) == 2


def _runner(pool) -> CudaGraphRunner:
    """A runner with just what `_try_capture` touches (no model, no device)."""
    r = CudaGraphRunner.__new__(CudaGraphRunner)
    r.pool, r.stats = pool, GraphStats()
    r.manager = type("M", (), {"state": type("S", (), {"discard_pending": lambda self: None})()})()
    return r


@pytest.mark.parametrize("error", [GraphCaptureError("capture failed"), RuntimeError("warm-up failed")])
def test_the_runner_captures_into_a_fresh_pool_after_a_failed_capture(monkeypatch, error) -> None:
    r = _runner((0, 5))

    def fail(key):
        raise error

    monkeypatch.setattr(r, "capture", fail)
    assert r._try_capture((2, 1)) is False
    assert (2, 1) in r.stats.failed
    if isinstance(error, GraphCaptureError):  # the pool takes no further capture: a fresh one next
        assert r.pool is None
        monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: (0, 6))
        assert r.capture_pool() == (0, 6)
    else:  # failed before capturing (e.g. the warm-up): the pool is fine
        assert r.pool == (0, 5)


def test_a_disabled_collector_stays_disabled(fake_cuda) -> None:
    gc.disable()
    try:
        with capture_graph(_Graph(), pool=(0, 1)):
            assert not gc.isenabled()
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_ending_a_recording_that_is_not_under_way_is_not_an_error(monkeypatch) -> None:
    def refuse(device, pool):
        raise RuntimeError("endAllocatePool: not currently recording to mempool_id")

    monkeypatch.setattr(torch._C, "_cuda_endAllocateToPool", refuse, raising=False)
    assert end_pool_recording(0, (0, 1)) is False
    monkeypatch.delattr(torch._C, "_cuda_endAllocateToPool", raising=False)
    assert end_pool_recording(0, (0, 1)) is False


def test_a_session_freezes_what_is_alive_and_captures_still_free_garbage_made_inside_it(fake_cuda) -> None:
    _Finalized.log.clear()
    assert gc.get_freeze_count() == 0
    with capture_session():
        frozen = gc.get_freeze_count()
        assert frozen > 0  # the process's objects: each capture's collection skips them
        with capture_session():  # nested (the MTP graphs inside an executor's start-up): still frozen
            pass
        assert gc.get_freeze_count() == frozen
        _Finalized()  # garbage made after the freeze: a capture's collection still frees it
        with capture_graph(_Graph(), pool=(0, 2)):
            assert _Finalized.log == ["freed"]
    assert gc.get_freeze_count() == 0
