"""`capture_graph` on a GPU: the two hazards it exists for, reproduced.

* Dropped CUDA graphs held in reference cycles, with the collector set to run at almost every allocation: a capture
  through `capture_graph` succeeds (the collector frees them before the capture and is held off during it). Through
  plain ``torch.cuda.graph`` the collector may destroy them mid-capture, which invalidates the capture.
* A capture that fails (a host synchronisation inside it) is followed by a capture into the same pool, which
  succeeds and replays correctly; without ending the failed capture's recording it fails with "already recording
  to mempool_id".
"""

from __future__ import annotations

import gc

import pytest
import torch

from trtllm_glm.graph_capture import capture_graph

pytestmark = pytest.mark.gpu


def _garbage_graphs(n: int) -> None:
    """``n`` captured graphs, each left in a reference cycle (as a dropped executor leaves its graphs)."""
    x = torch.randn(64, device="cuda")
    for _ in range(n):
        g = torch.cuda.CUDAGraph()
        with capture_graph(g):
            x.mul_(1.0)
        cycle: list = [g, x]
        cycle.append(cycle)


def test_capture_survives_dropped_graphs_and_an_eager_collector() -> None:
    x = torch.randn(1000, device="cuda")
    y = torch.empty_like(x)
    torch.cuda.synchronize()
    _garbage_graphs(4)
    old = gc.get_threshold()
    gc.set_threshold(1, 1, 1)
    try:
        g = torch.cuda.CUDAGraph()
        with capture_graph(g):
            junk = [[i] for i in range(200)]  # container allocations: the collector would run here
            torch.mul(x, 2.0, out=y)
            del junk
    finally:
        gc.set_threshold(*old)
    y.fill_(float("nan"))
    x.copy_(torch.randn_like(x))
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, x * 2.0)


def test_a_failed_capture_does_not_poison_the_next_one_in_its_pool() -> None:
    pool = torch.cuda.graph_pool_handle()
    x = torch.randn(1000, device="cuda")
    bad = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError), capture_graph(bad, pool=pool):
        torch.mul(x, 3.0)
        torch.cuda.synchronize()  # not permitted while capturing: the capture fails
    del bad
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with capture_graph(g, pool=pool):
        y = x * 2.0  # allocated from the pool
    x.copy_(torch.randn_like(x))
    y.fill_(float("nan"))
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, x * 2.0)
