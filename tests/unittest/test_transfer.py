"""`to_device`: the index lists the runtime builds every step, copied without a stream sync."""

from __future__ import annotations

import pytest
import torch

from trtllm_glm.transfer import to_device


@pytest.mark.cpu_only
def test_values_and_dtypes_on_the_cpu() -> None:
    t = to_device([3, 1, 2], "cpu")
    assert t.dtype == torch.int64 and t.tolist() == [3, 1, 2]
    assert to_device([1, 2], torch.device("cpu"), torch.int32).dtype == torch.int32
    assert to_device([], "cpu", torch.int64).shape == (0,)


@pytest.mark.gpu
def test_copy_is_ordered_on_the_stream_and_does_not_sync() -> None:
    """Values land before later work on the stream reads them, and no host sync is issued."""
    dev = torch.device("cuda")
    big = torch.randn(4096, 4096, device=dev)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for i in range(20):
            big = big @ big.T * 1e-3  # keep the stream busy
            idx = to_device([i, i + 1, i + 2], dev)
            out = torch.arange(100, device=dev)[idx]
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert out.tolist() == [19, 20, 21]
