"""`benchmarks/bench_fp8_linear.py --sweep`'s choice of winners and ``--apply``'s rewrite of the tuned tables."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.bench_fp8_linear import CANDIDATES, _label, apply_tuned, summarize_sweep

pytestmark = pytest.mark.cpu_only

KERNELS_PY = Path(__file__).resolve().parents[3] / "trtllm_glm" / "quant" / "kernels.py"


def _row(name: str, n: int, k: int, m: int, cls: str, times: dict[str, float], alias: dict[str, str]) -> dict:
    variants: dict = {"default": {"graph_us": 100.0}}
    variants.update({lab: {"graph_us": t} for lab, t in times.items()})
    variants.update({lab: {"same_as": to} for lab, to in alias.items()})
    return {"name": name, "n": n, "k": k, "m": m, "class": cls, "floor_bytes": n * k, "launch_us": 3.0,
            "copy_us": 5.0, "variants": variants}  # fmt: skip


def test_sweep_winners_are_per_weight_shape_and_m_independent(tmp_path, capsys) -> None:
    a, b, c = (_label(kw) for kw in CANDIDATES[5:8])
    rows = [
        # Shape 1: b is best at M = 1 alone, a over the rows together (the table cannot depend on M).
        _row("one", 4096, 8192, 1, "large", {"rule": 50.0, a: 20.0, b: 18.0, c: 40.0}, {}),
        _row("one", 4096, 8192, 16, "large", {"rule": 50.0, a: 20.0, b: 30.0, c: 40.0}, {}),
        # The same weight shape under a second name pools its rows; c resolves to a's launch here.
        _row("two", 4096, 8192, 1, "large", {"rule": 50.0, a: 20.0, b: 19.0}, {c: a}),
        _row("tiny", 8192, 128, 1, "tiny", {"rule": 3.0, a: 4.0, b: 5.0, c: 6.0}, {}),
    ]
    tuned = summarize_sweep(rows, ceiling=4000.0)
    out = capsys.readouterr().out
    assert tuned["tuned_shapes"] == [[4096, 8192, CANDIDATES[5]]]  # the rule won the tiny shape: no entry
    assert tuned["tuned_classes"] == {"large": CANDIDATES[5]}
    assert "one, two [4096, 8192]" in out and "tiny (launch-bound)" in out
    # --apply writes the tables between the markers of a copy of kernels.py; they run and hold the winners.
    target = tmp_path / "kernels.py"
    target.write_text(KERNELS_PY.read_text())
    sweep = tmp_path / "sweep.json"
    sweep.write_text(json.dumps({"rows": rows, "tuned": tuned}))
    assert apply_tuned(str(sweep), str(target)) == 0
    src = target.read_text()
    block = src[src.index("# BEGIN TUNED\n") : src.index("# END TUNED\n")]
    scope: dict = {}
    exec(block, scope)  # noqa: S102 - the generated tables
    assert scope["_TUNED_SHAPES"] == {(4096, 8192): CANDIDATES[5]} and scope["_TUNED_CLASSES"] == tuned["tuned_classes"]
    orig = KERNELS_PY.read_text()
    orig_block = orig[orig.index("# BEGIN TUNED\n") : orig.index("# END TUNED\n")]
    assert src.replace(block, "") == orig.replace(orig_block, "")  # nothing else changed
    sweep.write_text(json.dumps({"tuned": {"tuned_shapes": [[1, 2, {"bogus": 1}]], "tuned_classes": {}}}))
    with pytest.raises(ValueError, match=r"unknown knobs \['bogus'\]"):
        apply_tuned(str(sweep), str(target))
