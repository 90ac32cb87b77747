"""Pool top-k kernel (``kernels/topk.py``) against the torch reference, on the CPU interpreter.

Small geometry, so that the chunked path (a chunk pass of several programs per row, then a merge pass)
runs with several chunks: e.g. 64-pool chunks, ``topk`` 16. Scores are fresh seeded random values with
exact ties (also across the k-th place and across chunks), ``+-0.0``, ``+-inf``, NaN of both signs and
huge scores on pools past the complete count; positions give rows without a complete pool, rows with
fewer complete pools than ``topk``, rows whose complete pools end inside a chunk and full rows. The output
is poisoned with garbage ids before each call; ids must equal the reference's exactly. The kernels package
runs CPU tensors through an interpreted copy of the kernels by itself (``trtllm_glm/triton_interp.py``).
"""

from __future__ import annotations

import pytest
import torch

from tests.topk_checks import check_topk, special_scores, topk_scores
from trtllm_glm.attention.sparse.glm_kpool import kernels as K
from trtllm_glm.attention.sparse.glm_kpool import ops as R

pytest.importorskip("triton")

pytestmark = [
    pytest.mark.cpu_only,
    # The interpreter passes scalars as 1-element arrays; a run-time loop bound converts one with int(),
    # which numpy >= 1.25 flags as deprecated. Harmless here.
    pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0 to a scalar:DeprecationWarning"),
]


def _topk_module():
    return K.kernel_module("topk", "cpu")


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _positions(max_pools: int, topk: int, chunk: int) -> torch.Tensor:
    """No complete pool, fewer than topk, exactly topk, ending inside chunk 1 / 2, every alignment, full."""
    # (complete pools, position mod 4 offset): position = 4 * pools - 1 + offset.
    rows = [(0, 1), (0, 3), (5, 2), (topk, 0), (topk + 3, 1), (chunk + 9, 3), (2 * chunk + 1, 2)]
    rows += [(max_pools - 1, 3), (max_pools, 0)]
    return torch.tensor([4 * n - 1 + r for n, r in rows])


@pytest.mark.parametrize(
    ("max_pools", "topk", "chunk", "slots", "ties"),
    [
        (256, 16, 64, None, False),  # 4 chunks, default slots (2 x topk): windowed chunk pass
        (256, 16, 64, 16, True),  # slots == topk: exact chunk pass (ties broken in the chunk pass)
        (300, 12, 64, None, True),  # 5 chunks (candidate block padded), last chunk partial, topk not 2^k
        (512, 32, 128, 64, True),
    ],
)
@pytest.mark.parametrize("search", ["snap", "bisect"])
def test_chunked_matches_reference(
    max_pools: int, topk: int, chunk: int, slots: int | None, ties: bool, search: str
) -> None:
    g = _gen(max_pools + topk + chunk)
    positions = _positions(max_pools, topk, chunk)
    scores = topk_scores(positions.numel(), max_pools, g, ties=ties)
    kw = dict(method="chunked", chunk=chunk, slots=slots, num_warps=1, merge_warps=1, search=search)
    check_topk(scores, positions, topk, **kw)


@pytest.mark.parametrize("search", ["snap", "bisect"])
def test_chunked_special_values(search: str) -> None:
    """All-equal rows (ties decided by id alone, across chunks), +-0.0, +-inf, huge/tiny magnitudes, NaN."""
    g = _gen(5)
    max_pools, topk = 192, 16
    tied = torch.randn(1, max_pools, generator=g)
    tied[0, 100:] = 9.0  # the whole top-k tied, all in the last chunks
    scores = torch.cat([special_scores(max_pools, g), tied])
    positions = torch.full((8,), 4 * max_pools - 1)
    check_topk(scores, positions, topk, method="chunked", chunk=64, num_warps=1, merge_warps=1, search=search)


@pytest.mark.parametrize("search", ["snap", "bisect", "bisect/snap", "snap/bisect"])
def test_chunked_tie_overflow_in_a_chunk(search: str) -> None:
    """A chunk whose k-th place is tied by more keys than it has slots: the chunk pass breaks the tie by id
    (no threshold gives between topk and slots candidates), and the merge pass must still be exact."""
    g = _gen(6)
    max_pools, topk = 256, 16
    scores = torch.randn(3, max_pools, generator=g)
    scores[0, 10:60] = 2.0  # 50 equal keys in chunk 0, above everything else
    scores[1, 64:128] = 0.25  # a tied plateau filling chunk 1
    scores[1, 70] = 5.0
    scores[2, 200:] = 7.0  # 56 equal keys in chunk 3, plus more above in chunk 0
    scores[2, :4] = 8.0
    positions = torch.full((3,), 4 * max_pools - 1)
    check_topk(scores, positions, topk, method="chunked", chunk=64, num_warps=1, merge_warps=1, search=search)


def test_chunked_ignores_scores_beyond_complete_pools() -> None:
    """Huge scores on incomplete pools (including whole chunks past the complete count) are never chosen."""
    g = _gen(7)
    max_pools = 256
    scores = topk_scores(4, max_pools, g, ties=True)
    positions = torch.tensor([4 * 70 + 2, 4 * 10 + 3, 1, 4 * 129 + 3])
    for i, p in enumerate(positions.tolist()):
        scores[i, (p + 1) // 4 :] = 1e9
    check_topk(scores, positions, 16, method="chunked", chunk=64, num_warps=1, merge_warps=1)


def test_default_dispatch_and_row_path() -> None:
    """The package entry point (default launch: chunked where it applies) and the forced row path."""
    g = _gen(8)
    max_pools, topk = 320, 16
    positions = _positions(max_pools, topk, 64)
    scores = topk_scores(positions.numel(), max_pools, g, ties=True)
    mod = _topk_module()
    assert mod.chunked_shape(max_pools, topk, chunk=64) == (64, 5, 32)
    check_topk(scores, positions, topk, method="row")
    ref = R.select_topk_pools(scores, positions, topk)
    out = torch.full((positions.numel(), topk), -7, dtype=torch.int32)
    assert torch.equal(K.select_topk_pools(scores, positions, topk, out=out), ref)


def test_chunked_shape_limits() -> None:
    mod = _topk_module()
    assert mod.chunked_shape(32768, 512) == (4096, 8, 1024)
    assert mod.chunked_shape(4096, 512) is None  # one chunk: the row path
    assert mod.chunked_shape(8192, 512, chunk=256) is None  # chunk smaller than topk
    assert mod.chunked_shape(1 << 20, 512) is None  # more candidates than one merge program holds
    assert mod.chunked_shape(8192, 512, chunk=3000) is None
    with pytest.raises(ValueError, match="search must be"):
        mod.select_topk_pools(torch.zeros(1, 256), torch.tensor([1023]), 16, chunk=64, search="radix")
    with pytest.raises(ValueError, match="no chunked launch"):
        mod.select_topk_pools(torch.zeros(1, 64), torch.tensor([255]), 16, method="chunked", chunk=64)
