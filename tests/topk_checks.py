"""Shared checks of the pool top-k kernel against its torch reference (CPU interpreter tests)."""

from __future__ import annotations

import torch

from trtllm_glm.attention.sparse.glm_kpool import kernels as K
from trtllm_glm.attention.sparse.glm_kpool import ops as R


def topk_scores(n_rows: int, max_pools: int, g: torch.Generator, *, ties: bool) -> torch.Tensor:
    """``[n_rows, max_pools]`` fp32 scores; with ``ties``, coarse values (many exact ties, also across the
    k-th place) and signed zeros."""
    s = torch.randn(n_rows, max_pools, generator=g)
    if ties:
        s = torch.round(s * 3) / 3
        s[:, ::7] = 0.0
        s[:, 3::7] = -0.0
    return s


def special_scores(max_pools: int, g: torch.Generator) -> torch.Tensor:
    """``[7, max_pools]`` rows that stress ordering: all equal (ties decided by id alone), +-0.0, +-inf among
    huge values, subnormals, all negative, and NaNs of both signs (first, as in ``torch.sort``)."""
    scores = torch.zeros(7, max_pools)
    scores[1] = 1.5
    scores[2] = torch.where(torch.rand(max_pools, generator=g) < 0.5, 0.0, -0.0)
    scores[3] = torch.randn(max_pools, generator=g) * 1e30
    scores[3, ::5] = float("inf")
    scores[3, 1::5] = float("-inf")
    scores[4] = torch.randn(max_pools, generator=g) * 1e-38  # subnormals
    scores[5] = -torch.rand(max_pools, generator=g)  # all negative
    scores[6] = torch.randn(max_pools, generator=g)
    scores[6, 5::11] = float("nan")
    scores[6, 9::13] = -float("nan")
    return scores


def check_topk(scores: torch.Tensor, positions: torch.Tensor, topk: int, **kw) -> None:
    """Kernel ids equal the reference's in every row, written into a poisoned ``out`` that is returned.

    ``kw`` (launch options) go to the CPU kernel module's function; without them the public wrapper runs.
    """
    ref = R.select_topk_pools(scores, positions, topk)
    poison = torch.Generator().manual_seed(99)
    out = torch.randint(-50, 50, (scores.shape[0], topk), generator=poison, dtype=torch.int32)
    if kw:
        got = K.kernel_module("topk", "cpu").select_topk_pools(scores, positions, topk, out=out, **kw)
    else:
        got = K.select_topk_pools(scores, positions, topk, out=out)
    assert got.data_ptr() == out.data_ptr()
    bad = (got != ref).any(dim=1).nonzero().flatten().tolist()
    assert not bad, f"rows {bad} differ: kernel {got[bad[0]].tolist()} reference {ref[bad[0]].tolist()}"
