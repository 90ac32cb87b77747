"""`capture_graph` on a GPU: the two hazards it exists for, reproduced.

* Dropped CUDA graphs held in reference cycles and a collection in the middle of the capture: through
  `capture_graph` the capture succeeds (the collector freed them before it began). Through plain
  ``torch.cuda.graph`` the collection destroys them mid-capture, which invalidates the capture.
* A capture that fails (a host synchronisation inside it) raises `GraphCaptureError` with the caller's stream
  current again, and the next capture (into a fresh pool, as the error asks) succeeds and replays correctly.
  Plain ``torch.cuda.graph`` leaves its capture stream current, and a capture into the failed one's pool is
  refused ("already recording to mempool_id"; H100, torch 2.11, 2026-12-06).
"""

from __future__ import annotations

import gc

import pytest
import torch

from trtllm_glm.graph_capture import GraphCaptureError, capture_graph, upload_graph

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


def test_capture_survives_dropped_graphs_collected_mid_capture() -> None:
    x = torch.randn(1000, device="cuda")
    y = torch.empty_like(x)
    torch.cuda.synchronize()
    gc.disable()  # the dropped graphs stay uncollected until the capture runs the collector
    try:
        _garbage_graphs(4)
        g = torch.cuda.CUDAGraph()
        with capture_graph(g):
            torch.mul(x, 2.0, out=y)
            gc.collect()  # a collection at this moment (an automatic one would run here if the collector were on)
    finally:
        gc.enable()
    y.fill_(float("nan"))
    x.copy_(torch.randn_like(x))
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, x * 2.0)


def test_a_failed_capture_restores_the_stream_and_the_next_capture_succeeds() -> None:
    pool = torch.cuda.graph_pool_handle()
    x = torch.randn(1000, device="cuda")
    caller = torch.cuda.current_stream()
    bad = torch.cuda.CUDAGraph()
    with pytest.raises(GraphCaptureError), capture_graph(bad, pool=pool):
        torch.mul(x, 3.0)
        torch.cuda.synchronize()  # not permitted while capturing: the capture fails
    assert torch.cuda.current_stream() == caller
    assert not torch.cuda.is_current_stream_capturing()
    del bad
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with capture_graph(g, pool=torch.cuda.graph_pool_handle()):
        y = x * 2.0  # allocated from the pool
    x.copy_(torch.randn_like(x))
    y.fill_(float("nan"))
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, x * 2.0)


def test_an_executor_captures_every_other_size_after_one_capture_fails() -> None:
    """The failure seen on the H200: one size's capture fails; the sizes captured after it must still capture (a
    fresh pool), and greedy tokens with the graphs equal an eager executor's."""
    from trtllm_glm.models.glm5_next import Glm5NextForCausalLM
    from trtllm_glm.runtime.cuda_graph import CudaGraphConfig
    from trtllm_glm.runtime.executor import Executor, ExecutorConfig
    from trtllm_glm.runtime.sampling import SamplingParams

    model = Glm5NextForCausalLM.from_pretrained("small", dtype="float32", device="cuda").eval()

    def make(graphs: CudaGraphConfig | None) -> Executor:
        cfg = ExecutorConfig(tokens_per_block=16, max_tokens=4096, max_batch_size=4, max_num_tokens=256,
                             max_seq_len=256, cuda_graph_config=graphs)  # fmt: skip
        return Executor(model, cfg)

    ex = make(CudaGraphConfig(batch_sizes=[1, 2, 4], enable_padding=True))
    runner = ex.graph_runner
    body = runner._body

    def failing_body(P: int, W: int):
        out = body(P, W)
        if P == 2 and torch.cuda.is_current_stream_capturing():
            torch.cuda.synchronize()  # not permitted while capturing: this size's capture fails
        return out

    runner._body = failing_body
    ex.capture_cuda_graphs()
    runner._body = body
    assert (2, 1) in runner.stats.failed and "GraphCaptureError" in runner.stats.failed[(2, 1)]
    assert {(1, 1), (4, 1)} <= set(runner.graphs)  # (4, 1) was captured after the failure
    prompts = [list(b"def add(a, b):\n    return a + b\n"), list(b"import os\nimport sys\n"), list(b"for i in ra")]

    def tokens(e: Executor) -> list[list[int]]:
        reqs = [e.add_request(p, SamplingParams(max_tokens=12, ignore_eos=True)) for p in prompts]
        while e.has_work:
            e.step()
        return [r.output_ids for r in reqs]

    assert tokens(ex) == tokens(make(None))
    assert runner.stats.replays > 0


def test_upload_finds_torchs_runtime_and_the_uploaded_graph_replays_correctly() -> None:
    x = torch.randn(4096, device="cuda")
    y = torch.empty_like(x)
    g = torch.cuda.CUDAGraph()
    with capture_graph(g):  # uploads (TRTLLM_GLM_GRAPH_UPLOAD unset)
        torch.add(x, 1.0, out=y).mul_(3.0)
    assert upload_graph(g) is True  # a second upload of the same graph is allowed too
    y.fill_(float("nan"))
    x.copy_(torch.randn_like(x))
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, (x + 1.0) * 3.0)
