"""The tensor-parallel code path on one GPU (docs/parallelism.md): a 1-rank NCCL world whose collectives are
issued anyway (`init_world_of_one`), eager and inside the CUDA graphs of decode steps.

At world size 1 an all-reduce is the identity, so greedy tokens must equal the plain model's bit for bit; the
graphs must hold the collective (captured, then replayed) rather than call it around the replay. Needs CUDA
(tests/conftest.py skips ``gpu`` tests without it); multi-GPU checks are issue 14's.
"""

from __future__ import annotations

import pytest
import torch

from trtllm_glm.distributed import NULL_COMM
from trtllm_glm.models.glm5_next import Glm5NextForCausalLM
from trtllm_glm.runtime.cuda_graph import CudaGraphConfig
from trtllm_glm.runtime.executor import Executor, ExecutorConfig
from trtllm_glm.runtime.sampling import SamplingParams

pytestmark = pytest.mark.gpu

PROMPTS = [list(b"import os\nimport sys\n\nclass Reader:\n"), list(b"def fib(n):\n"), list(b"for i in range(")]


@pytest.fixture(scope="module")
def comm():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from trtllm_glm.distributed.process_group import init_world_of_one, shutdown_rank

    c = init_world_of_one(torch.device("cuda", torch.cuda.current_device()))
    yield c
    shutdown_rank()


def _tokens(model: Glm5NextForCausalLM, graphs: bool) -> list[list[int]]:
    cfg = ExecutorConfig(tokens_per_block=16, max_tokens=2048, max_batch_size=4, max_num_tokens=256, max_seq_len=256,
                         cuda_graph_config=CudaGraphConfig() if graphs else None)  # fmt: skip
    ex = Executor(model, cfg)
    ex.capture_cuda_graphs()
    reqs = [ex.add_request(p, SamplingParams(max_tokens=24, ignore_eos=True)) for p in PROMPTS]
    ex.run_until_done()
    return [list(r.output_ids) for r in reqs]


@pytest.mark.parametrize("graphs", [False, True])
def test_nccl_path_at_world_size_one_keeps_tokens(comm, graphs: bool) -> None:
    model = Glm5NextForCausalLM.from_pretrained("small", device="cuda", dtype="bfloat16")
    model.set_comm(NULL_COMM)
    want = _tokens(model, graphs)
    model.set_comm(comm)
    before = comm.num_all_reduces
    got = _tokens(model, graphs)
    assert comm.num_all_reduces > before
    assert got == want


def test_all_reduce_captured_in_a_graph(comm) -> None:
    x = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)
    y = torch.empty_like(x)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):  # warm-up outside the capture (NCCL's lazy set-up)
            y.copy_(x)
            comm.all_reduce(y)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y.copy_(x)
        comm.all_reduce(y)
        y.mul_(2)
    for _ in range(3):
        x.normal_()
        y.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(y, x * 2)
