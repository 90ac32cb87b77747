"""`benchmarks/bench_serve.py` end to end on the CPU: a child server on ``tiny``, a committed mixed workload at a
Poisson rate and a closed-loop level, goodput, the server's TTFT split and the engine alone; plus its pieces."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from benchmarks.bench_serve import metric_value, percentiles, server_split, step_cadence

ROOT = Path(__file__).resolve().parents[3]

pytestmark = pytest.mark.cpu_only


def test_percentiles_and_metric_parsing() -> None:
    assert percentiles([5.0, 1.0, 3.0, 2.0, 4.0]) == [3.0, 5.0, 5.0]
    page = 'trtllm:kernel_compiles_total 3.0\ntrtllm:kernel_compiles_created 1.7e9\nx{a="b"} 2\nx{a="c"} 5\n'
    assert metric_value(page, "trtllm:kernel_compiles_total") == 3.0 and metric_value(page, "x") == 7.0
    assert metric_value(page, "absent") == 0.0


def _step(index: int, t: float, kind: str, decode: int) -> dict:
    return {"index": index, "t_start": t, "kind": kind, "decode_seqs": decode}


def test_step_cadence_weights_intervals_by_the_sequences_decoding_next() -> None:
    # Steps 0-9 every 4 ms with 10 sequences decoding, then an admission (mixed, 10 decoding + 1 prompt) taking
    # 9 ms, then decode steps with 11. A step whose successor has no decoding sequence (the batch drained and the
    # engine idled 500 ms) and a hole in the indices (records out of the window) give no interval.
    steps, t = [], 0.0
    for i in range(10):
        steps.append(_step(i, t, "decode", 10))
        t += 0.004
    steps.append(_step(10, t, "mixed", 10))
    t += 0.009
    for i in range(11, 40):
        steps.append(_step(i, t, "decode", 11))
        t += 0.004
    steps.append(_step(40, t + 0.5, "prefill", 0))  # after an idle half second: nobody's ITL
    steps.append(_step(42, t + 0.6, "decode", 1))  # step 41 missing from the window: no interval either
    c = step_cadence(list(reversed(steps)))  # the order of records does not matter
    assert c["server_itl_ms"][0] == pytest.approx(4.0)
    # One slow interval (after the mixed step), counted for its 11 decoding sequences out of 10 * 10 + 29 * 11.
    assert c["slow_intervals"] == {"mixed": 1}
    assert c["slow_interval_share"] == pytest.approx(11 / (10 * 10 + 29 * 11))
    # p99 over 419 weighted intervals: the 11 slow ones are above the 99th rank.
    assert c["server_itl_ms"][2] == pytest.approx(9.0)
    empty = step_cadence([])
    assert empty["slow_intervals"] == {} and empty["server_itl_ms"][0] != empty["server_itl_ms"][0]


def test_server_split_counts_only_the_level_s_share_of_a_gap(tmp_path: Path) -> None:
    # A level starting at t0 = 100 s: its first step began 1 ms in, after 5 s idle since the previous level's last
    # step; the other nine steps each 4 ms apart with 0.5 ms of loop work between them. Only the 1 ms counts.
    recs = [{"index": 0, "kind": "decode", "num_seqs": 4, "decode_seqs": 4, "prefill_seqs": 0, "rows": 4,
             "prefill_rows": 0, "graph": True, "overlapped": True, "t_start": 100.001, "host_s": 0.0035, "gap_s": 5.0,
             "idle_s": 4.99, "gpu_s": 0.003}]  # fmt: skip
    for i in range(1, 10):
        recs.append({**recs[0], "index": i, "t_start": 100.001 + 0.004 * i, "gap_s": 0.0005, "idle_s": 0.0})
    log = tmp_path / "steps.jsonl"
    log.write_text("".join(json.dumps({"step": r}) + "\n" for r in recs))
    out = server_split(log, 100.0, 101.0)
    assert out["steps"] == 10
    assert out["step_gap_ms_mean"] == pytest.approx((1.0 + 9 * 0.5) / 10)
    assert out["step_idle_ms_mean"] == pytest.approx(1.0 / 10)


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
    # The server's cadence, the server side of ITL: measured from its steps, and no larger than the client's tail.
    assert 0 < lvl["server_itl_ms"][0] <= lvl["server_itl_ms"][2] and "server ITL p50/p90/p99" in r.stdout
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


def _child_server(parent: int) -> int | None:
    """The pid of ``trtllm-glm serve`` started by ``parent`` (from /proc), or None."""
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            cmd = (d / "cmdline").read_bytes()
        except (OSError, IndexError, ValueError):
            continue
        if ppid == parent and b"trtllm_glm.cli" in cmd:
            return int(d.name)
    return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="finds the child server through /proc")
def test_sigterm_stops_the_child_server() -> None:
    """SIGTERM to bench_serve (``timeout`` around it) while its child server starts: the child, in its own session,
    is stopped with it. Before, the default handler ended bench_serve at once and the server kept running (on an
    H100 it held the GPU's memory, and the next run could not load its model)."""
    cmd = [sys.executable, "-m", "benchmarks.bench_serve", "--model", "tiny", "--concurrency", "1",
           "--num-requests", "2", "--time-limit", "30"]  # fmt: skip
    p = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    child = None
    try:
        deadline = time.monotonic() + 120
        while child is None and p.poll() is None and time.monotonic() < deadline:
            child = _child_server(p.pid)
            time.sleep(0.05)
        assert child is not None, "no child server appeared"
        p.send_signal(signal.SIGTERM)
        assert p.wait(timeout=60) == 128 + signal.SIGTERM
        assert not _alive(child), "the child server outlived bench_serve"
    finally:
        if p.poll() is None:
            p.kill()
        if child is not None and _alive(child):
            os.kill(child, signal.SIGKILL)
