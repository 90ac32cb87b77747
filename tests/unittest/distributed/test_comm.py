"""`sum_in_rank_order` (the batch-invariant all-reduce's sum) without processes: the order is observable.

With two parts fp32 addition commutes, so a reversed sum would pass every 2-rank test; three parts that cancel
tell the orders apart. The 3-rank gloo world of tests/integration/test_batch_invariant_e2e.py checks the same
through the collective.
"""

from __future__ import annotations

import pytest
import torch

from trtllm_glm.distributed.comm import sum_in_rank_order

pytestmark = pytest.mark.cpu_only


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_three_parts_sum_in_rank_order(dtype: torch.dtype) -> None:
    parts = torch.tensor([[1e8, 1.0], [-1e8, 1e8], [1.0, -1e8]], dtype=dtype)
    out = torch.empty(2, dtype=dtype)
    got = sum_in_rank_order(parts, out)
    assert got is out
    # Rank order: (1e8 - 1e8) + 1 = 1; (1 + 1e8) - 1e8 = 0 (the 1 is lost in fp32; bf16 parts are summed in fp32
    # too). Reversed gives 0 and 1.
    assert got.float().tolist() == [1.0, 0.0]
    # The gathered input is never written (an fp32 slice is a view of it).
    assert parts[:, 0].float().tolist() == [pytest.approx(1e8, rel=1e-2), pytest.approx(-1e8, rel=1e-2), 1.0]


def test_world_of_one_is_a_copy() -> None:
    parts = torch.randn(1, 5)
    assert torch.equal(sum_in_rank_order(parts, torch.empty(5)), parts[0])
