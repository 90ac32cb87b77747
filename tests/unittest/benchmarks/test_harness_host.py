"""The host-time breakdowns of the benchmark harness: per model part (`module_host_ms`), per function with the fused
ops' references left out (`func_host_ms`, `op_counts`) and per server process (`proc_cpu`)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch
from torch import nn

from benchmarks.harness import proc_cpu
from benchmarks.harness.profiling import func_host_ms, module_host_ms, op_counts


class _Slow(nn.Module):
    def __init__(self, delay: float) -> None:
        super().__init__()
        self.delay = delay
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(self.delay)
        return self.lin(x)


def test_module_host_ms_times_each_named_part_inclusively() -> None:
    model = nn.Sequential(_Slow(0.02), _Slow(0.01), nn.ReLU())
    x = torch.randn(2, 4)
    out = module_host_ms(model, lambda: model(x), ("_Slow", "Linear", "Sequential"))
    step, _ = out["(step)"]
    slow_ms, slow_calls = out["_Slow"]
    assert slow_calls == 2 and out["Linear"][1] == 2 and out["Sequential"][1] == 1
    assert slow_ms >= 29.0 and out["Sequential"][0] >= slow_ms >= out["Linear"][0] and step >= out["Sequential"][0]
    assert "ReLU" not in out  # only the named classes
    # The hooks are gone afterwards.
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())


def _reference(x: torch.Tensor) -> torch.Tensor:
    """Stands for a fused op's torch reference: slow, three ops."""
    time.sleep(0.02)
    return (x * 2 + 1).exp()


def _orchestrate(x: torch.Tensor) -> torch.Tensor:
    y = x + 1  # one op
    z = _reference(y)  # one launch on the GPU (three ops on the CPU)
    return z.view(-1).to(torch.float32).clone()  # a view and a cast of what already is fp32: nothing; one copy


def test_op_counts_and_host_ms_take_a_fused_reference_as_one_launch() -> None:
    x = torch.randn(4)
    orch, ref = f"{__name__}:_orchestrate", f"{__name__}:_reference"
    before = (globals()["_orchestrate"], globals()["_reference"])
    assert op_counts(lambda: _orchestrate(x), (orch,)) == {"(step)": (5, 1), "_orchestrate": (5, 1)}
    assert op_counts(lambda: _orchestrate(x), (orch,), fused=(ref,)) == {"(step)": (3, 1), "_orchestrate": (3, 1)}
    out = func_host_ms(lambda: _orchestrate(x), (orch,), reps=2, fused=(ref,))
    assert out["(fused)"][0] >= 19.0 and out["(fused)"][1] == 1
    assert out["_orchestrate"][0] < 10.0 and out["(step)"][0] < 10.0  # the reference's time is left out
    assert func_host_ms(lambda: _orchestrate(x), (orch,))["_orchestrate"][0] >= 19.0
    assert (globals()["_orchestrate"], globals()["_reference"]) == before  # the wrappers are gone


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads /proc")
def test_proc_cpu_sees_a_busy_child_thread() -> None:
    # The child says when it starts spinning, so that the window never falls on its start-up.
    code = "import time\nprint('go', flush=True)\nt=time.time()\nwhile time.time()-t<2.0: pass\n"
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "go"
        a = proc_cpu.snapshot(os.getpid())
        time.sleep(0.5)
        b = proc_cpu.snapshot(os.getpid())
    finally:
        child.wait(timeout=10)
    rows = {r["pid"]: r for r in proc_cpu.usage(a, b)}
    # One core spinning; on a loaded 2-core CI machine it may get well under a whole core, never next to nothing.
    assert rows[child.pid]["cpu"] > 0.2
    assert rows[child.pid]["threads"][0]["thread"] == "main"
    assert rows[os.getpid()]["cpu"] < rows[child.pid]["cpu"]  # this test sleeps
    line = proc_cpu.format_usage(list(rows.values()), {child.pid: "spinner"})
    assert line.startswith("spinner ") and "main" in line
