"""The greedy / top-2 gap kernels (compiled, CUDA) at the real vocabulary (154,880) against torch's argmax
and topk, bit for bit, at decode and verify row counts, and replayed in a CUDA graph with new inputs.
Needs CUDA (tests/conftest.py skips ``gpu`` tests without it)."""

from __future__ import annotations

import pytest
import torch

from trtllm_glm.logits import greedy_pack, greedy_top2, greedy_top2_reference

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

V = 154_880


def _logits(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(seed)
    # bf16-rounded values cast to fp32, as the LM head produces: exact ties between columns are common.
    x = (torch.randn(n, V, device="cuda", generator=g) * 3).to(torch.bfloat16).float()
    if n > 1:
        x[1, 11] = x[1, V - 5] = 40.0
    if n > 2:
        x[2, 3] = float("nan")
    return x


@pytest.mark.parametrize("n", [1, 4, 16, 64, 512])
def test_matches_torch_bit_for_bit(n: int) -> None:
    x = _logits(n, n)
    ids, gap = greedy_top2(x, backend="triton")
    r_ids, r_gap = greedy_top2_reference(x)
    assert torch.equal(ids, r_ids)
    assert torch.equal(torch.nan_to_num(gap, nan=-7.0), torch.nan_to_num(r_gap, nan=-7.0))
    acc = torch.randint(1, 5, (n,), device="cuda")
    _, packed = greedy_pack(x, acc, backend="triton")
    _, r_packed = greedy_pack(x, acc, backend="torch")
    assert torch.equal(torch.nan_to_num(packed, nan=-7.0), torch.nan_to_num(r_packed, nan=-7.0))


def test_graph_replay_with_new_inputs() -> None:
    n = 16
    x = _logits(n, 0)
    greedy_pack(x, backend="triton")  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _, packed = greedy_pack(x, backend="triton")
    for seed in range(1, 4):
        x.copy_(_logits(n, seed))
        packed.fill_(float("nan"))
        graph.replay()
        _, ref = greedy_pack(x, backend="torch")
        assert torch.equal(torch.nan_to_num(packed, nan=-7.0), torch.nan_to_num(ref, nan=-7.0))
