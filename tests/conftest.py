"""Shared pytest set-up: markers, CUDA skipping, and the server tests' optional dependencies."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

# The server tests need the `serve` extra (and the official `openai` client). Where it is not installed
# (e.g. a GPU machine set up for the kernels) they are not collected, so `pytest -m gpu tests` works there.
# CI installs everything and sets TRTLLM_GLM_REQUIRE_SERVE=1: a missing package is then an error, never a
# silently skipped suite.
_SERVE_DEPS = ("fastapi", "uvicorn", "httpx", "prometheus_client", "yaml", "openai")
_missing = [m for m in _SERVE_DEPS if importlib.util.find_spec(m) is None]
collect_ignore_glob = ["serve/*"] if _missing else []
if _missing and os.environ.get("TRTLLM_GLM_REQUIRE_SERVE") == "1":
    raise RuntimeError(f"TRTLLM_GLM_REQUIRE_SERVE=1 but the serve extra is incomplete: missing {_missing}")

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
