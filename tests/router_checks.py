"""Shared by the router kernel tests (CPU and GPU): counting the kernel's launches through the dispatcher."""

from __future__ import annotations

import pytest

from trtllm_glm.moe import router as R


def count_fused_route_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Wrap `fused_route` so that each call appends to the returned list (the dispatcher's choice, observed)."""
    calls: list[int] = []
    real = R.fused_route

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(R, "fused_route", counting)
    return calls
