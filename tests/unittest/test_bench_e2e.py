"""`benchmarks/bench_e2e.py`'s derived numbers: the oracle's expected tokens per round and the goal lines."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from bench_e2e import expected_tokens_per_step, goal_lines  # noqa: E402

pytestmark = pytest.mark.cpu_only


@pytest.mark.parametrize(
    ("mode", "want"),
    [("oracle0.7k3", 1 + 0.7 + 0.49 + 0.343), ("oracle0.5", 2 - 0.5**7), ("oracle0.9k3+mix", 3.439), ("mtp3", None)],
)
def test_expected_tokens_per_step(mode: str, want: float | None) -> None:
    got = expected_tokens_per_step(mode)
    assert got == pytest.approx(want) if want is not None else got is None


def test_oracle_goal_line_reports_realised_and_expected() -> None:
    row = {"layers": 4, "batch": 1, "mode": "oracle0.7k3", "graphs": True, "step_ms": 2.5,
           "speedup_vs_plain": 1.6, "tokens_per_step": 2.0, "expected_tokens_per_step": 2.533,
           "step_vs_plain": 1.25, "floor_vs_plain": 1.3}  # fmt: skip
    (line,) = goal_lines([row])
    assert "tokens/s vs plain 1.60" in line and "at both floors 1.54" in line
    assert "2.00 tokens per round realised, 2.53 expected: 2.03 vs plain at this step cost, 1.95 at both floors" in line
