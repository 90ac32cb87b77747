"""`benchmarks/harness/idle_sites.py`: the GPU's idle time charged to the host frames running meanwhile."""

from __future__ import annotations

import pytest

from benchmarks.harness.idle_sites import _project_frame, attribute_idle, merge_intervals

pytestmark = pytest.mark.cpu_only


def test_merge_intervals_unions_overlaps_in_any_order():
    assert merge_intervals([(5, 7), (0, 2), (1, 3), (6, 9), (10, 11)]) == [(0, 3), (5, 9), (10, 11)]
    assert merge_intervals([]) == []


def test_idle_goes_to_the_innermost_frame_and_inclusive_to_every_frame_on_the_stack():
    # Device busy [0, 10) and [30, 40); idle [10, 30) and [40, 50).
    busy = [(30.0, 40.0), (0.0, 10.0), (2.0, 5.0)]
    frames = [
        (0.0, 50.0, "step"),  # outermost
        (8.0, 26.0, "prepare"),  # covers idle [10, 26)
        (12.0, 16.0, "to_device"),  # innermost inside prepare: idle [12, 16)
        (41.0, 44.0, "tolist"),  # idle [41, 44) inside step
    ]
    busy_t, idle_t, inner, incl = attribute_idle(busy, frames, (0.0, 50.0), resolution=0.5)
    assert busy_t == pytest.approx(20.0)
    assert idle_t == pytest.approx(30.0)
    assert inner["to_device"] == pytest.approx(4.0)
    assert inner["prepare"] == pytest.approx(16.0 - 4.0)
    assert inner["tolist"] == pytest.approx(3.0)
    assert inner["step"] == pytest.approx(30.0 - 16.0 - 3.0)
    assert sum(inner.values()) == pytest.approx(idle_t)
    assert incl["step"] == pytest.approx(30.0)
    assert incl["prepare"] == pytest.approx(16.0)
    assert incl["to_device"] == pytest.approx(4.0)


def test_uncovered_idle_and_the_window_clip():
    busy = [(-5.0, 3.0), (6.0, 8.0), (9.0, 30.0)]
    frames = [(4.0, 5.0, "f")]
    busy_t, idle_t, inner, incl = attribute_idle(busy, frames, (0.0, 10.0), resolution=0.25)
    assert busy_t == pytest.approx(3.0 + 2.0 + 1.0)
    assert idle_t == pytest.approx(4.0)  # [3, 6) and [8, 9)
    assert inner["f"] == pytest.approx(1.0)
    assert inner["(no project frame)"] == pytest.approx(3.0)
    assert incl == {"f": pytest.approx(1.0)}


def test_recursion_counts_once_inclusive():
    frames = [(0.0, 10.0, "f"), (1.0, 9.0, "f"), (2.0, 8.0, "g")]
    _, idle_t, inner, incl = attribute_idle([], frames, (0.0, 10.0))
    assert idle_t == pytest.approx(10.0)
    assert incl["f"] == pytest.approx(10.0)
    assert incl["g"] == pytest.approx(6.0)
    assert inner == {"f": pytest.approx(4.0), "g": pytest.approx(6.0)}


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="empty window"):
        attribute_idle([], [], (1.0, 1.0))
    with pytest.raises(ValueError, match="resolution"):
        attribute_idle([], [], (0.0, 1.0), resolution=0.0)


def test_project_frame_names():
    assert _project_frame("/x/site/trtllm_glm/runtime/executor.py(443): _prepare_graph_step") == (
        "runtime/executor.py:443 _prepare_graph_step"
    )
    assert _project_frame("/w/benchmarks/bench_e2e.py(12): run_case") == "benchmarks/bench_e2e.py:12 run_case"
    assert _project_frame("torch/nn/modules/module.py(1): _call_impl") is None
