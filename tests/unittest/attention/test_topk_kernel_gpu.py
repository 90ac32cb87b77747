"""Pool top-k kernel (``kernels/topk.py``, compiled, CUDA) against the torch reference at GLM geometry.

Top 512 pools of 8192 and 32768 per row, 1 to 64 rows. A third of the rows hold coarse scores (many exact
ties, also at the k-th place, and ``-0.0``), a few hold NaN or ``+-inf``, others are continuous; positions
give rows without a complete pool, with fewer complete pools than 512, ending inside a chunk, and full
rows. Every launch variant of the chunked path (search, candidate slots, chunk size, programmatic dependent
launch) and the row path must give ids identical to the reference; outputs are poisoned first. The default
launch is also captured in a CUDA graph and replayed on new inputs. Needs CUDA (tests/conftest.py skips
``gpu`` tests without it).
"""

from __future__ import annotations

import pytest
import torch

from trtllm_glm.attention.sparse.glm_kpool import kernels as K
from trtllm_glm.attention.sparse.glm_kpool import ops as R

pytestmark = pytest.mark.gpu

TOPK_POOLS = 512

VARIANTS = {
    "default": {},  # chunked, bisection, programmatic dependent launch of the merge pass (sm_90+)
    "no-pdl": {"pdl": False},
    "snap": {"search": "snap", "pdl": False},
    "snap-pdl": {"search": "snap"},
    "bisect/snap": {"search": "bisect/snap"},
    "slots512": {"slots": 512},
    "chunk2048": {"chunk": 2048},
    "chunk8192": {"chunk": 8192, "num_warps": 8},
    "row": {"method": "row"},
}


def _inputs(n_rows: int, max_pools: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``[n_rows, max_pools]`` fp32 scores and ``[n_rows]`` int64 positions on the GPU (see the module doc)."""
    g = torch.Generator().manual_seed(seed)
    scores = torch.randn(n_rows, max_pools, generator=g)
    coarse = torch.arange(n_rows) % 3 == 0
    scores[coarse] = torch.round(scores[coarse] * 4) / 4
    scores[coarse, ::9] = -0.0
    if n_rows > 4:
        scores[1, 7::101] = float("nan")
        scores[2, 3::57] = float("inf")
        scores[2, 5::31] = float("-inf")
        scores[4, 4096:] = 3.5  # a plateau of ties above everything, from the second chunk on
    positions = torch.full((n_rows,), 4 * max_pools - 1, dtype=torch.int64)
    short = torch.tensor([0, 2, 3, 4 * 100 + 2, 4 * TOPK_POOLS - 1, 4 * TOPK_POOLS + 5, 4 * 3000 + 1, 4 * 4100])
    k = min(n_rows // 2, short.numel())
    positions[n_rows - k :] = short[:k]
    return scores.cuda(), positions.cuda()


def _check(scores: torch.Tensor, positions: torch.Tensor, **kw) -> None:
    ref = R.select_topk_pools(scores, positions, TOPK_POOLS)
    out = torch.randint(-50, 50, ref.shape, dtype=torch.int32, device="cuda")
    got = K.kernel_module("topk", scores.device).select_topk_pools(scores, positions, TOPK_POOLS, out=out, **kw)
    assert got.data_ptr() == out.data_ptr()
    bad = (got != ref).any(dim=1).nonzero().flatten().tolist()
    assert not bad, f"rows {bad} differ"


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("max_pools", [32768, 8192])
def test_matches_reference(max_pools: int, variant: str) -> None:
    for n_rows, seed in ((64, 1), (16, 2), (1, 3)):
        scores, positions = _inputs(n_rows, max_pools, seed + max_pools)
        _check(scores, positions, **VARIANTS[variant])


def test_package_entry_point() -> None:
    scores, positions = _inputs(16, 32768, 11)
    out = torch.full((16, TOPK_POOLS), -7, dtype=torch.int32, device="cuda")
    K.select_topk_pools(scores, positions, TOPK_POOLS, out=out)
    assert torch.equal(out, R.select_topk_pools(scores, positions, TOPK_POOLS))


@pytest.mark.parametrize("variant", ["default", "no-pdl", "snap"])
def test_cuda_graph_replay(variant: str) -> None:
    """Captured once (scratch from the graph's pool), replayed on new scores and positions."""
    mod = K.kernel_module("topk", "cuda")
    scores, positions = _inputs(16, 32768, 5)
    out = torch.empty(16, TOPK_POOLS, dtype=torch.int32, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        mod.select_topk_pools(scores, positions, TOPK_POOLS, out=out, **VARIANTS[variant])
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        mod.select_topk_pools(scores, positions, TOPK_POOLS, out=out, **VARIANTS[variant])
    for seed in (6, 7):
        s2, p2 = _inputs(16, 32768, seed)
        scores.copy_(s2)
        positions.copy_(p2)
        out.fill_(-7)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, R.select_topk_pools(scores, positions, TOPK_POOLS))
