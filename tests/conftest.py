"""Shared pytest set-up: markers and CUDA skipping."""

from __future__ import annotations

import pytest
import torch

# Test tensors are tiny: intra-op threads only add OpenMP spin-waits, and with pytest-xdist (one worker
# per core) they oversubscribe the cores and slow every step down by orders of magnitude.
torch.set_num_threads(1)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
