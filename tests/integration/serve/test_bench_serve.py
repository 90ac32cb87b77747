"""`benchmarks/bench_serve.py` end to end on the CPU: a child server on ``tiny``, a committed mixed workload at a
Poisson rate and a closed-loop level, goodput, the server's TTFT split and the engine alone; plus its pieces."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.bench_serve import metric_value, percentiles

ROOT = Path(__file__).resolve().parents[3]

pytestmark = pytest.mark.cpu_only


def test_percentiles_and_metric_parsing() -> None:
    assert percentiles([5.0, 1.0, 3.0, 2.0, 4.0]) == [3.0, 5.0, 5.0]
    page = 'trtllm:kernel_compiles_total 3.0\ntrtllm:kernel_compiles_created 1.7e9\nx{a="b"} 2\nx{a="c"} 5\n'
    assert metric_value(page, "trtllm:kernel_compiles_total") == 3.0 and metric_value(page, "x") == 7.0
    assert metric_value(page, "absent") == 0.0


def test_bench_serve_runs_a_mixed_workload(tmp_path: Path) -> None:
    wl = tmp_path / "wl.jsonl"
    wl.write_text("".join(json.dumps({"input_len": n, "output_len": m}) + "\n" for n, m in ((5, 3), (40, 6), (17, 2))))
    out = tmp_path / "out.json"
    cfg = tmp_path / "opts.yaml"
    cfg.write_text("max_seq_len: 128\nmax_batch_size: 4\n")
    cmd = [sys.executable, "-m", "benchmarks.bench_serve", "--model", "tiny", "--config", str(cfg),
           "--workload", str(wl), "--request-rate", "40", "--client-procs", "2", "--num-requests", "6",
           "--warmup-requests", "1",
           "--slo-ttft-ms", "100000", "--slo-tpot-ms", "100000", "--time-limit", "120", "--json", str(out)]  # fmt: skip
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stdout + r.stderr
    (lvl,) = json.loads(out.read_text())["levels"]
    # Two load-generator processes, three requests each: their results merged into one level.
    assert lvl["load"] == "rate" and lvl["completed"] == 6 and lvl["failed"] == 0 and lvl["client_procs"] == 2
    assert lvl["out_tokens"] == 3 + 6 + 2 + 3 + 6 + 2  # the workload cycled, every output length exact
    assert lvl["in_tokens"] == 5 + 40 + 17 + 5 + 40 + 17
    assert lvl["goodput_req_per_s"] == pytest.approx(lvl["req_per_s"])
    # The server's own account of the same requests: its TTFT parts add up and it counted every request.
    assert lvl["server_requests"] == 6 and lvl["kernel_compiles"] == 0 and lvl["steps"] > 0
    ttft, queue, prefill, delivery = (lvl[f"server_{k}_ms"][0] for k in ("ttft", "queue", "prefill", "delivery"))
    assert 0 < ttft <= lvl["ttft_ms"][2] and min(queue, prefill, delivery) >= 0
    assert "server TTFT p50" in r.stdout
    # The inbox wait split at the engine's inbox (the engine runs in its own process here).
    tr, loop = lvl["server_transport_ms"][0], lvl["server_loop_wait_ms"][0]
    assert tr >= 0 and loop >= 0 and "to the engine" in r.stdout
    # The client's share of TTFT: writing the request out, on connections opened before the level (a keep-alive
    # pool's), so that no measured request opened one.
    assert 0 < lvl["written_ms"][0] <= lvl["ttft_ms"][2] and lvl["new_connections"] == 0
    assert "request written p50/p99" in r.stdout
    # The server's processes' CPU over the level: the API process (its event loop busy serving) and the engine. Six
    # requests can cost the API process less than a clock tick (10 ms) under httptools and uvloop: /proc then says 0
    # and none of its threads reaches the listing's 0.5 %, so its main thread is asked for only when it is busier.
    cpu = {row["pid"]: row for row in lvl["server_cpu"]}
    api = [row for row in cpu.values() if "trtllm_glm.cli" in row["name"]]
    assert len(api) == 1 and api[0]["cpu"] >= 0
    if api[0]["cpu"] >= 0.05:
        assert any(t["thread"] == "main" for t in api[0]["threads"]), api[0]
    engine = [row for row in cpu.values() if "spawn_main" in row["name"]]  # the engine process, busiest
    assert len(engine) == 1 and engine[0]["cpu"] > api[0]["cpu"] and engine[0]["threads"]
    assert "server CPU (1 core = 100%): engine " in r.stdout
