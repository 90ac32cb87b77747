"""`benchmarks/bench_structured.py` on the CPU (the small preset, a few steps): every mode runs, the grammar runs
report the mask's share of their own steps (issue 45's goal, measured in one run), and the goal line says it."""

from __future__ import annotations

import pytest

pytest.importorskip("llguidance")
from benchmarks.bench_structured import main

pytestmark = pytest.mark.cpu_only


def test_reports_the_mask_share_of_the_same_run(capsys) -> None:
    rows = main(["--preset", "small", "--device", "cpu", "--dtype", "float32", "--batch", "4", "--gen", "12",
                 "--prompt-len", "32", "--modes", "free", "json", "ngram-json"])  # fmt: skip
    by = {r["mode"]: r for r in rows}
    for mode in ("json", "ngram-json"):
        r = by[mode]
        assert r["grammar_ok_share"] == 1.0 and r["mask_fill_ms"] > 0 and r["mask_apply_ms"] > 0
        assert r["mask_ms"] >= r["mask_fill_ms"] + r["mask_apply_ms"] - 1e-9
        assert 0 < r["mask_share"] < 1 and abs(r["mask_share"] - r["mask_ms"] / r["step_ms_mean"]) < 1e-6
    assert by["ngram-json"]["draft_cut_ms"] > 0 and by["free"]["mask_share"] == 0
    out = capsys.readouterr().out
    assert "goal (json): constrained decoding costs" in out and "of a batch-4 step in the same run" in out
