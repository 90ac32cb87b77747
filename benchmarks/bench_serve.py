"""Load generator for ``trtllm-glm serve``: throughput, TTFT / ITL / TPOT / E2E percentiles, goodput, and where
the time to first token goes.

Bounded by construction: loopback only (127.0.0.0/8, ::1, localhost), a fixed number of requests per load level
and a wall-clock limit per level (outstanding requests are cancelled at the limit). Without ``--url`` it starts
``trtllm-glm serve`` as a child process on 127.0.0.1 and a free port (the client's Python then never competes
with the server's for one interpreter), with ``--step-log`` so that each level also reports the server's own
split of TTFT and its steps; the child is stopped at the end.

Workloads (token-id prompts, so lengths are exact and no tokenizer is needed):

- ``--input-len I --output-len O``: every request I prompt tokens and exactly O output tokens (``ignore_eos``);
  prompts are seeded random ids, distinct per request (no prefix is shared).
- ``--workload FILE``: a JSON-lines file of ``{"input_len", "output_len"}`` per request, used in order and
  cycled (``benchmarks/workloads/mixed_chat.jsonl``, made by ``benchmarks/make_workload.py``).

Load: ``--concurrency 1,16,64`` (closed loop: that many requests in flight) or ``--request-rate 4,16`` (open
loop: Poisson arrivals at that many requests per second, seeded; ``inf`` sends all at once).

Per request (streamed ``/v1/completions``, greedy, ``continuous_usage_stats``): TTFT (sent to the first token),
ITL (gaps between token chunks), TPOT ``(E2E - TTFT) / (tokens - 1)``, E2E. Goodput: requests per second that met
``--slo-ttft-ms`` and ``--slo-tpot-ms``. With a child server each level also prints the server's TTFT parts
(p50 of queue, prefill and delivery, from its step log; the rest of the client's TTFT is HTTP and the
event loop), its steps by kind, and the Triton kernels it compiled during the level (``kernel_compiles_total``;
the start-up warm-up should leave none).

``--engine-baseline`` (child-server mode): after the levels and with the server stopped, the same model and
options run the engine alone (``LLM``'s executor, steady decode of ``min(level, max_batch_size)`` requests of
the same lengths) and each level's row carries ``engine_tok_per_s`` and the ratio of the server's tokens/s to it.

Run (CPU, tiny preset)::

    .venv/bin/python benchmarks/bench_serve.py --model tiny --concurrency 1,8,32 --input-len 32 --output-len 32
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import json
import os
import platform
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import httpx

from benchmarks.harness import proc_cpu

HOST = "127.0.0.1"
REPO = Path(__file__).resolve().parents[1]


@dataclass
class Result:
    ok: bool = False
    error: str = ""
    sent: float = 0.0
    ttft: float = 0.0
    # Seconds from the start to the request written out (a new connection's set-up included), and whether it opened
    # a connection (httpcore's trace). The API answers with its headers and the first token together.
    written: float = 0.0
    connected: bool = False
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    tokens: int = 0
    input_len: int = 0


def percentiles(xs: list[float], ps=(50, 90, 99)) -> list[float]:
    """Nearest-rank percentiles (no interpolation: every value is a measured one)."""
    if not xs:
        return [float("nan")] * len(ps)
    s = sorted(xs)
    return [s[min(len(s) - 1, max(0, -(-p * len(s) // 100) - 1))] for p in ps]


def check_loopback(url: str) -> None:
    host = urlparse(url).hostname or ""
    if host == "localhost":
        return
    try:
        if ipaddress.ip_address(host).is_loopback:
            return
    except ValueError:
        pass
    raise SystemExit(f"bench_serve: refusing {url!r}: only loopback servers (127.0.0.0/8, ::1, localhost)")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


# ------------------------------------------------------------------------------------------------
# Workloads
def load_workload(args: argparse.Namespace) -> list[tuple[int, int]]:
    """``(input_len, output_len)`` per request slot (cycled by the levels)."""
    if args.workload:
        rows = [json.loads(x) for x in Path(args.workload).read_text().splitlines() if x.strip()]
        if not rows:
            raise SystemExit(f"bench_serve: {args.workload} holds no request")
        return [(int(r["input_len"]), int(r["output_len"])) for r in rows]
    return [(args.input_len, args.output_len)]


def make_prompt(rng: random.Random, n: int, vocab: int) -> list[int]:
    """``n`` random ids in ``[1, vocab)``; the first one per request makes prompts distinct (no shared prefix)."""
    return [rng.randrange(1, vocab) for _ in range(n)]


# ------------------------------------------------------------------------------------------------
# The child server
def start_child_server(args: argparse.Namespace, step_log: str) -> tuple[str, subprocess.Popen, Path]:
    """``trtllm-glm serve`` in a child process on a free loopback port; waits for ``/health``."""
    port = free_port()
    log_path = Path(step_log).with_suffix(".server.log")
    cmd = [sys.executable, "-m", "trtllm_glm.cli", "serve", args.model_path, "--host", HOST, "--port", str(port),
           "--max-queue-size", str(args.max_queue_size), "--step-log", step_log, "--log-level", "info",
           "--served-model-name", args.model]  # fmt: skip
    if args.config:
        cmd += ["--config", args.config]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = f"{REPO}{os.pathsep}{env['PYTHONPATH']}" if env.get("PYTHONPATH") else str(REPO)
    f = open(log_path, "w", encoding="utf-8")  # noqa: SIM115 - the child writes to it until it exits
    proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    url = f"http://{HOST}:{port}"
    deadline = time.monotonic() + args.start_timeout
    try:
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"bench_serve: the server exited ({proc.returncode}):\n{log_path.read_text()[-3000:]}")
            try:
                if httpx.get(f"{url}/health", timeout=2.0, trust_env=False).status_code == 200:
                    return url, proc, log_path
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise SystemExit(
                    f"bench_serve: no /health after {args.start_timeout:.0f} s:\n{log_path.read_text()[-3000:]}"
                )
            time.sleep(0.2)
    except BaseException:
        # The child is in its own session: nothing else stops it (a server left behind holds the GPU's memory).
        proc.kill()
        proc.wait(timeout=30)
        raise


def _exit_on_sigterm(signum: int, frame: Any) -> None:
    """SIGTERM (``timeout``, a job runner) as an exit that runs the ``finally`` blocks: the child server, in its own
    session, is stopped rather than left running (an H100 run under ``timeout`` left one holding 50 GiB)."""
    raise SystemExit(128 + signum)


def stop_child_server(proc: subprocess.Popen) -> None:
    proc.terminate()  # the server drains (nothing is in flight now), then exits
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10)


def metric_value(text: str, name: str) -> float:
    """Sum of the samples named ``name`` in a Prometheus text page (0 when absent)."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and (line[len(name)] in " {"):
            total += float(line.rsplit(" ", 1)[1])
    return total


# ------------------------------------------------------------------------------------------------
# Requests
async def one_request(c: httpx.AsyncClient, url: str, model: str, prompt: list[int], max_tokens: int) -> Result:
    body = {
        "model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
        "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }  # fmt: skip
    res = Result(input_len=len(prompt))
    t0 = res.sent = time.perf_counter()
    last = None
    seen = 0

    async def trace(event: str, info: dict) -> None:  # noqa: ARG001 - httpcore's signature
        if event == "connection.connect_tcp.complete":
            res.connected = True
        elif event == "http11.send_request_body.complete":
            res.written = time.perf_counter() - t0

    try:
        async with c.stream("POST", f"{url}/v1/completions", json=body, extensions={"trace": trace}) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                ev = json.loads(line[6:])
                if "error" in ev:
                    res.error = ev["error"]["message"]
                    return res
                n = (ev.get("usage") or {}).get("completion_tokens", seen)
                if n > seen:
                    now = time.perf_counter()
                    if last is None:
                        res.ttft = now - t0
                    else:
                        res.itl.append(now - last)
                    last, seen = now, n
        res.e2e = time.perf_counter() - t0
        res.tokens = seen
        res.ok = seen > 0
        if not res.ok:
            res.error = "no tokens"
    except (httpx.HTTPError, OSError) as e:
        res.error = f"{type(e).__name__}: {e}"
    return res


def client_procs(args: argparse.Namespace, load: tuple[str, float], n_jobs: int) -> int:
    """Load-generator processes for a level: ``--client-procs``, or (0, auto) one per 16 requests in flight.

    One asyncio process parsing every stream's SSE events (httpx, JSON) saturates near 5,000 events/s (an H100 run
    at concurrency 64: the client's own loop lag p50 16 ms, client TTFT 212 ms against the server's 75 ms): its
    TTFT and ITL then measure the client. Each process drives its share of the requests and of the load."""
    kind, value = load
    if kind == "rate" and not args.client_procs:
        return 1  # (an open loop's in-flight count is the server's doing: set --client-procs for high rates)
    inflight = int(value) if kind == "concurrency" else (args.max_concurrency or n_jobs)
    n = args.client_procs or -(-inflight // 16)
    return max(1, min(n, inflight, n_jobs))


async def run_level(
    url: str, args: argparse.Namespace, load: tuple[str, float], jobs: list[tuple[list[int], int]]
) -> tuple[dict[str, Any], list[Result]]:
    """Run ``jobs`` (prompt, output length) under ``load`` (``("concurrency", n)`` or ``("rate", r)``), from
    `client_procs` processes (each with its share of the jobs and of the concurrency or rate)."""
    kind, value = load
    procs = client_procs(args, load, len(jobs))
    if procs == 1:
        parts = [await drive(url, args, load, jobs, args.seed + 1)]
    else:
        import concurrent.futures
        import multiprocessing

        shares = [jobs[i::procs] for i in range(procs)]
        if kind == "concurrency":  # the first value % procs processes keep one more in flight
            subs = [(kind, float(int(value) // procs + (i < int(value) % procs))) for i in range(procs)]
        else:
            subs = [(kind, value / procs)] * procs
        if args.max_concurrency:
            args = argparse.Namespace(**{**vars(args), "max_concurrency": max(1, args.max_concurrency // procs)})
        loop = asyncio.get_running_loop()
        with concurrent.futures.ProcessPoolExecutor(procs, mp_context=multiprocessing.get_context("spawn")) as pool:
            # Started (and imported) before the clock runs: a spawn costs ~1 s.
            await asyncio.gather(*(loop.run_in_executor(pool, time.sleep, 0.2) for _ in range(procs)))
            parts = await asyncio.gather(
                *(loop.run_in_executor(pool, drive_sync, url, args, sub, share, args.seed + 1 + i)
                  for i, (sub, share) in enumerate(zip(subs, shares)))
            )  # fmt: skip
    results = [r for p in parts for r in p[0]]
    lags = [x for p in parts for x in p[1]]
    t0, wall = min(p[2] for p in parts), max(p[3] for p in parts) - min(p[2] for p in parts)
    pending_n = sum(p[4] for p in parts)
    ok = [r for r in results if r.ok]
    toks = sum(r.tokens for r in ok)
    tpot = {id(r): (r.e2e - r.ttft) / (r.tokens - 1) for r in ok if r.tokens > 1}
    good = [r for r in ok if r.ttft * 1e3 <= args.slo_ttft_ms and tpot.get(id(r), 0.0) * 1e3 <= args.slo_tpot_ms]
    itl = [x for r in ok for x in r.itl]
    row = {
        "load": kind, "level": value, "requests": len(jobs), "completed": len(ok),
        "failed": len(results) - len(ok), "cancelled": pending_n, "wall_s": wall,
        "req_per_s": len(ok) / wall, "out_tok_per_s": toks / wall,
        "in_tokens": sum(r.input_len for r in ok), "out_tokens": toks,
        "ttft_ms": [x * 1e3 for x in percentiles([r.ttft for r in ok])],
        # The client's side of TTFT: writing the request out, a new connection's set-up included (the rest is the
        # server's and the token's way back), and how many requests opened a connection.
        "written_ms": [x * 1e3 for x in percentiles([r.written for r in ok])],
        "new_connections": sum(r.connected for r in ok),
        "itl_ms": [x * 1e3 for x in percentiles(itl)],
        "tpot_ms": [x * 1e3 for x in percentiles(list(tpot.values()))],
        "e2e_ms": [x * 1e3 for x in percentiles([r.e2e for r in ok])],
        "goodput_req_per_s": len(good) / wall, "goodput_share": len(good) / max(1, len(jobs)),
        "slo": {"ttft_ms": args.slo_ttft_ms, "tpot_ms": args.slo_tpot_ms},
        "t_start": t0, "t_end": t0 + wall,
        "errors": sorted({r.error for r in results if not r.ok})[:3],
        "client_loop_lag_ms": [x * 1e3 for x in percentiles(lags or [0.0])],
        "client_procs": procs,
    }  # fmt: skip
    if itl:
        p50 = percentiles(itl, (50,))[0]
        row["itl_p99_over_p50"] = percentiles(itl, (99,))[0] / p50 if p50 > 0 else float("nan")
    if ok:
        p = percentiles([r.ttft for r in ok], (50, 99))
        row["ttft_p99_over_p50"] = p[1] / p[0] if p[0] > 0 else float("nan")
    return row, results


def drive_sync(
    url: str, args: argparse.Namespace, load: tuple[str, float], jobs: list[tuple[list[int], int]], seed: int
) -> tuple[list[Result], list[float], float, float, int]:
    """`drive` in a load-generator process of its own (`run_level`)."""
    return asyncio.run(drive(url, args, load, jobs, seed))


async def drive(
    url: str, args: argparse.Namespace, load: tuple[str, float], jobs: list[tuple[list[int], int]], seed: int
) -> tuple[list[Result], list[float], float, float, int]:
    """Send ``jobs`` under ``load`` from this process's event loop.

    Returns:
        The results, this loop's lag samples (s), the start and end times (``perf_counter``: one clock for every
        process of the machine) and how many requests the time limit cancelled.
    """
    kind, value = load
    inflight = int(value) if kind == "concurrency" else (args.max_concurrency or len(jobs))
    sem = asyncio.Semaphore(inflight)
    results: list[Result] = []
    limits = httpx.Limits(max_connections=inflight + 4, max_keepalive_connections=inflight + 4)
    rng = random.Random(seed)
    async with httpx.AsyncClient(timeout=args.time_limit, limits=limits, trust_env=False) as c:

        async def worker(prompt: list[int], n_out: int) -> None:
            async with sem:
                results.append(await one_request(c, url, args.model, prompt, n_out))

        lags: list[float] = []

        async def probe() -> None:
            # This client's own event loop lag (how late a 5 ms sleep wakes): a loop that cannot keep up with the
            # streams it parses inflates the TTFT and ITL it measures, whatever the server does.
            while True:
                t = time.perf_counter()
                await asyncio.sleep(0.005)
                lags.append(time.perf_counter() - t - 0.005)

        if not args.fresh_connections:
            # A serving client keeps its connections (the OpenAI SDK's pool): open this process's share before the
            # clock starts, so that TTFT does not measure a burst of TCP set-ups (an H100 run at concurrency 64 with
            # fresh connections: writing a request out took 160 ms at p99, the server's own TTFT p99 was 51 ms).
            await asyncio.gather(*(c.get(f"{url}/health") for _ in range(min(inflight, len(jobs)))))
        prober = asyncio.ensure_future(probe())
        t0 = time.perf_counter()
        tasks = []
        for prompt, n_out in jobs:
            if kind == "rate" and value != float("inf") and tasks:
                await asyncio.sleep(rng.expovariate(value))  # Poisson arrivals
            tasks.append(asyncio.ensure_future(worker(prompt, n_out)))
        left = max(0.0, args.time_limit - (time.perf_counter() - t0))
        done, pending = await asyncio.wait(tasks, timeout=left)
        for t in pending:  # the time limit: cancel what is left (the server aborts those requests)
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        t1 = time.perf_counter()
        prober.cancel()
    return results, lags, t0, t1, len(pending)


# ------------------------------------------------------------------------------------------------
# The server's own account (its step log)
def server_split(step_log: Path, t0: float, t1: float) -> dict[str, Any]:
    """TTFT parts of the requests that arrived in ``[t0, t1]`` and the steps that began then (the step log's
    clock is ``perf_counter``: CLOCK_MONOTONIC, the same in every process of the machine)."""
    reqs, steps = [], []
    for line in step_log.read_text().splitlines():
        obj = json.loads(line)
        if "request" in obj and t0 <= obj["request"]["arrival"] <= t1:
            reqs.append(obj["request"])
        elif "step" in obj and t0 <= obj["step"]["t_start"] <= t1:
            st = obj["step"]
            # A level's first step waited since the previous level (or the warm-up): only its share inside the level
            # counts (a c64 level of 270 steps had averaged 3.8 ms of "idle" a step, most of it the pause before it).
            inside = max(0.0, st["t_start"] - t0)
            st["gap_s"] = min(st["gap_s"], inside)
            st["idle_s"] = min(st.get("idle_s", 0.0), st["gap_s"])
            steps.append(st)
    out: dict[str, Any] = {"server_requests": len(reqs)}
    for part in ("ttft_s", "inbox_s", "transport_s", "loop_wait_s", "schedule_s", "queue_s", "prefill_s", "delivery_s"):
        xs = [r[part] for r in reqs if r.get(part) is not None]
        out[f"server_{part[:-2]}_ms"] = [x * 1e3 for x in percentiles(xs)]
    out["server_prefill_steps_p50"] = percentiles([r["prefill_steps"] for r in reqs], (50,))[0]
    by_kind: dict[str, int] = {}
    for s in steps:
        by_kind[s["kind"]] = by_kind.get(s["kind"], 0) + 1
    n = max(1, len(steps))
    gpu = [s["gpu_s"] for s in steps if s.get("gpu_s") is not None]
    out.update(
        steps=len(steps), steps_by_kind=by_kind, eager_steps=sum(not s["graph"] for s in steps),
        overlapped_steps=sum(s["overlapped"] for s in steps),
        step_host_ms_mean=sum(s["host_s"] for s in steps) / n * 1e3,
        step_gap_ms_mean=sum(s["gap_s"] for s in steps) / n * 1e3,
        step_idle_ms_mean=sum(s.get("idle_s", 0.0) for s in steps) / n * 1e3,
        step_gpu_ms_mean=(sum(gpu) / len(gpu) * 1e3) if gpu else None,
        rows_per_step_mean=sum(s["rows"] for s in steps) / n,
    )  # fmt: skip
    out.update(step_cadence(steps))
    return out


def step_cadence(steps: list[dict[str, Any]]) -> dict[str, Any]:
    """The server's side of inter-token latency, from its step log: the interval from each step's start to the
    next one's, counted once per sequence decoding in the next step (each of them got a token from the earlier step,
    a decode row or its prompt's last chunk, and gets its next one from the later). Against the client's ITL this
    separates the engine's cadence from delivery and the load generator's own lag.

    Returns ``server_itl_ms`` (p50/p90/p99 over those weighted intervals), ``slow_intervals`` (intervals above twice
    the p50, each counted once, by the earlier step's kind: an admission's mixed step shows as ``mixed``) and
    ``slow_interval_share`` (their decoding sequences' share of all the weighted intervals: above 1 % puts the p99
    over twice the p50)."""
    steps = sorted(steps, key=lambda s: s["index"])
    pairs = [(b["t_start"] - a["t_start"], b["decode_seqs"], a["kind"])
             for a, b in zip(steps, steps[1:]) if b["index"] == a["index"] + 1 and b["decode_seqs"] > 0]  # fmt: skip
    weighted = [dt for dt, w, _ in pairs for _ in range(w)]
    itl = [x * 1e3 for x in percentiles(weighted)]
    slow = [(w, kind) for dt, w, kind in pairs if dt * 1e3 > 2 * itl[0]]
    by_kind: dict[str, int] = {}
    for _, kind in slow:
        by_kind[kind] = by_kind.get(kind, 0) + 1
    share = sum(w for w, _ in slow) / len(weighted) if weighted else float("nan")
    return {"server_itl_ms": itl, "slow_intervals": by_kind, "slow_interval_share": share}


# ------------------------------------------------------------------------------------------------
# The engine alone (same model and options, server stopped)
def engine_decode_rate(llm: Any, batch: int, input_len: int, output_len: int, seed: int) -> float:
    """Steady decode tokens/s of ``batch`` requests through the executor (after every request's first token)."""
    from trtllm_glm import SamplingParams

    ex = llm.executor
    rng = random.Random(seed)
    p = SamplingParams(max_tokens=max(2, output_len), temperature=0.0, ignore_eos=True)
    reqs = [ex.add_request(make_prompt(rng, input_len, llm.config.vocab_size), p) for _ in range(batch)]
    while any(r.num_output == 0 for r in reqs):
        ex.step()
    _sync(llm)
    n0, t0 = sum(r.num_output for r in reqs), time.perf_counter()
    while ex.has_work:
        ex.step()
    _sync(llm)
    return (sum(r.num_output for r in reqs) - n0) / (time.perf_counter() - t0)


def generate_rate(llm: Any, n: int, input_len: int, output_len: int, seed: int) -> float:
    """Output tokens/s of one ``LLM.generate`` call of ``n`` prompts (the second of two identical calls: the first
    compiles and captures whatever the call needs)."""
    from trtllm_glm import SamplingParams

    rng = random.Random(seed)
    prompts = [make_prompt(rng, input_len, llm.config.vocab_size) for _ in range(n)]
    p = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    llm.generate(prompts, p)
    _sync(llm)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, p)
    _sync(llm)
    return sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t0)


def _sync(llm: Any) -> None:
    import torch

    if str(llm.device).startswith("cuda"):
        torch.cuda.synchronize()


# ------------------------------------------------------------------------------------------------
def _labels(rows: list[dict[str, Any]]) -> dict[int, str]:
    """Short names of the server's processes: the API process (``trtllm_glm.cli serve``) and its spawned engine."""
    out = {}
    for r in rows:
        name = r["name"]
        out[r["pid"]] = ("api" if "trtllm_glm.cli" in name else "engine" if "spawn_main" in name
                         else "tracker" if "resource_tracker" in name else "")  # fmt: skip
    return out


def fmt_row(s: dict[str, Any]) -> str:
    def trio(v: list[float]) -> str:
        return "/".join(f"{x:.1f}" for x in v)

    lvl = f"c={int(s['level'])}" if s["load"] == "concurrency" else f"r={s['level']:g}"
    line = (
        f"{lvl:>6} {s['completed']:>4}/{s['requests']:<4} {s['wall_s']:7.2f} {s['req_per_s']:7.2f} "
        f"{s['out_tok_per_s']:9.1f}  {trio(s['ttft_ms']):>22} {trio(s['itl_ms']):>18} {trio(s['tpot_ms']):>18} "
        f"{trio(s['e2e_ms']):>24} {s['goodput_req_per_s']:7.2f}"
    )
    if "server_ttft_ms" in s:
        line += (
            f"\n       server TTFT p50 {s['server_ttft_ms'][0]:.1f} ms = queue {s['server_queue_ms'][0]:.1f} "
            f"(inbox {s['server_inbox_ms'][0]:.1f}"
            + (
                f" = to the engine {s['server_transport_ms'][0]:.1f} + its loop {s['server_loop_wait_ms'][0]:.1f}"
                if s.get("server_transport_ms") and s["server_transport_ms"][0] == s["server_transport_ms"][0]
                else ""  # (a server without the split: its percentiles are NaN)
            )
            + f", schedule {s['server_schedule_ms'][0]:.1f}) + prefill "
            f"{s['server_prefill_ms'][0]:.1f} ({s['server_prefill_steps_p50']:.0f} steps) + delivery "
            f"{s['server_delivery_ms'][0]:.1f}; client TTFT p50 {s['ttft_ms'][0]:.1f}"
            + (
                f" (request written p50/p99 {trio(s['written_ms'][::2])} ms, {s['new_connections']} new connections)"
                if "written_ms" in s
                else ""
            )
            + f"\n       steps {s['steps']} {s['steps_by_kind']}, eager {s['eager_steps']}, overlapped "
            f"{s['overlapped_steps']}, rows/step {s['rows_per_step_mean']:.1f}, host {s['step_host_ms_mean']:.2f} ms"
            f" + gap {s['step_gap_ms_mean']:.2f} ms (idle {s.get('step_idle_ms_mean', 0.0):.2f})"
            + (f", GPU {s['step_gpu_ms_mean']:.2f} ms" if s.get("step_gpu_ms_mean") is not None else "")
            + f"; kernels compiled {s.get('kernel_compiles', 'n/a')}"
        )
    if "server_itl_ms" in s:
        line += (
            f"\n       server ITL p50/p90/p99 {trio(s['server_itl_ms'])} ms (step to step, per decoding sequence; "
            f"client {trio(s['itl_ms'])}); intervals over 2x p50: {s['slow_intervals']} after steps of those kinds, "
            f"{s['slow_interval_share'] * 100:.1f} % of tokens"
        )
    if s.get("server_cpu"):
        cpu = proc_cpu.format_usage(s["server_cpu"], _labels(s["server_cpu"]))
        line += f"\n       server CPU (1 core = 100%): {cpu}"
    if "client_loop_lag_ms" in s:
        procs = s.get("client_procs", 1)
        line += f"\n       client event-loop lag p50/p90/p99 {trio(s['client_loop_lag_ms'])} ms ({procs} process"
        line += "es)" if procs != 1 else ")"
    return line


async def main_async(
    args: argparse.Namespace, url: str, step_log: Path | None, server_pid: int | None = None
) -> list[dict[str, Any]]:
    shapes = load_workload(args)
    vocab = args.vocab_size
    async with httpx.AsyncClient(timeout=60, trust_env=False) as c:
        r = await c.get(f"{url}/health")
        if r.status_code != 200:
            raise SystemExit(f"bench_serve: {url}/health answered {r.status_code}")
    out = []
    rng = random.Random(args.seed)
    i = 0
    for load in args.loads:
        n = args.num_requests or max(8, 2 * int(load[1] if load[0] == "concurrency" else 8))
        jobs = []
        for _ in range(n):
            il, ol = shapes[i % len(shapes)]
            jobs.append((make_prompt(rng, il, vocab), ol))
            i += 1
        if args.warmup_requests:
            # Not measured: requests of the level's first shapes (connections, the server's first uses of each
            # shape), with prompts of their own: a measured prompt seen before would be a prefix-cache repeat.
            warm = [(make_prompt(rng, len(p), vocab), ol) for p, ol in jobs[: min(len(jobs), args.warmup_requests)]]
            await run_level(url, args, load, warm)
        before = (await _metrics(url)) if step_log is not None else ""
        cpu0 = proc_cpu.snapshot(server_pid) if server_pid is not None else None
        row, _ = await run_level(url, args, load, jobs)
        if cpu0 is not None:
            # The server's processes and busiest threads over the level: a thread near 100 % is the bottleneck.
            row["server_cpu"] = proc_cpu.usage(cpu0, proc_cpu.snapshot(server_pid))
        if step_log is not None:
            await asyncio.sleep(0.3)  # the idle engine writes its last steps' GPU times
            row.update(server_split(step_log, row["t_start"], row["t_end"] + 0.2))
            after = await _metrics(url)
            name = "trtllm:kernel_compiles_total"
            row["kernel_compiles"] = int(metric_value(after, name) - metric_value(before, name))
        out.append(row)
        print(fmt_row(row), flush=True)
        if row["errors"]:
            print(f"     errors: {row['errors']}", flush=True)
    return out


async def _metrics(url: str) -> str:
    async with httpx.AsyncClient(timeout=30, trust_env=False) as c:
        return (await c.get(f"{url}/metrics")).text


def parse_loads(args: argparse.Namespace) -> list[tuple[str, float]]:
    if args.request_rate:
        return [("rate", float(x)) for x in args.request_rate.split(",")]
    return [("concurrency", float(int(x))) for x in args.concurrency.split(",")]


def prepare_model(args: argparse.Namespace) -> None:
    """``args.model_path``: the model as given, or a ``--layers`` slice of a preset saved as a checkpoint (drawn in
    a child process, so that this one holds no GPU memory the server needs; reused when already saved)."""
    args.model_path = args.model
    if args.layers is None:
        return
    args.model_path = os.path.join(args.slice_dir, f"{args.model}-{args.layers}l-{args.dtype or 'bfloat16'}")
    if os.path.isfile(os.path.join(args.model_path, "config.json")):
        return  # saved by an earlier run (the same seed: the same weights)
    cmd = [sys.executable, __file__, "--save-slice", args.model_path, "--model", args.model, "--layers",
           str(args.layers), "--dtype", args.dtype or "bfloat16"]  # fmt: skip
    subprocess.run(cmd, check=True)


def save_slice(args: argparse.Namespace) -> None:
    """Draw the ``--layers`` slice of the preset (seed 0, on the GPU when there is one) and save it."""
    import torch

    from benchmarks.harness.models import random_model  # a slice drawn on the GPU itself, as bench_e2e times it
    from trtllm_glm.config import Glm5NextConfig
    from trtllm_glm.models.glm5_next import subset_config

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    full = Glm5NextConfig.from_pretrained(args.model)
    cfg = subset_config(full, list(range(min(args.layers, full.num_hidden_layers))))
    cfg.num_nextn_predict_layers = max(1, cfg.num_nextn_predict_layers)
    random_model(cfg, dev, args.dtype, seed=0).save_pretrained(args.save_slice)


def release_llm(llm: Any) -> None:
    """Shut ``llm`` down and hand its device memory back (the caller drops its last reference right after): the
    next `LLM` sizes its cache from the memory free then."""
    import gc

    import torch

    llm.shutdown()
    llm.model = None
    llm.executor = None
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def main() -> int:
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default=None, help="a running server (loopback only); default: start one as a child")
    ap.add_argument("--model", default="tiny", help="preset or checkpoint (also the model name sent)")
    ap.add_argument("--layers", type=int, default=None, help="serve the preset cut to its first N layers")
    ap.add_argument("--dtype", default=None, help="dtype of a --layers slice (default: bfloat16)")
    ap.add_argument("--slice-dir", default=tempfile.gettempdir(), help="where a --layers slice is saved and reused")
    ap.add_argument("--config", default=None, help="LLM options YAML for the child server (default: its defaults)")
    ap.add_argument("--concurrency", default="1,8,32", help="comma-separated concurrency levels (closed loop)")
    ap.add_argument("--request-rate", default=None, help="comma-separated Poisson request rates (req/s); replaces "
                    "--concurrency")  # fmt: skip
    ap.add_argument("--max-concurrency", type=int, default=None, help="cap on requests in flight at a request rate")
    ap.add_argument("--client-procs", type=int, default=0,
                    help="load-generator processes per level (0: one per 16 requests in flight; one asyncio client "
                    "saturates near 5,000 streamed tokens/s and then measures itself)")  # fmt: skip
    ap.add_argument("--num-requests", type=int, default=0, help="requests per level (default max(8, 2 x level))")
    ap.add_argument("--input-len", type=int, default=32, help="prompt tokens per request (fixed-length workload)")
    ap.add_argument("--output-len", "--max-tokens", type=int, default=32, help="output tokens per request")
    ap.add_argument("--workload", default=None, help="JSON lines of {input_len, output_len} (replaces the lengths)")
    ap.add_argument("--slo-ttft-ms", type=float, default=float("inf"), help="goodput: TTFT at most this")
    ap.add_argument("--slo-tpot-ms", type=float, default=float("inf"), help="goodput: TPOT at most this")
    ap.add_argument("--warmup-requests", type=int, default=4, help="unmeasured requests before each level")
    ap.add_argument("--fresh-connections", action="store_true",
                    help="open each request's connection inside the measured level (default: the connections are "
                         "opened before it, as a client's keep-alive pool holds them)")  # fmt: skip
    ap.add_argument("--time-limit", type=float, default=180.0, help="seconds per level before cancelling")
    ap.add_argument("--start-timeout", type=float, default=900.0, help="seconds the child server may take to start")
    ap.add_argument("--max-queue-size", type=int, default=256, help="queue of the child server")
    ap.add_argument("--engine-baseline", action="store_true", help="also measure the engine alone (child mode)")
    ap.add_argument("--generate-check", default=None, metavar="NxLxO", help="with --engine-baseline: LLM.generate of "
                    "N prompts of L tokens, O out, at the defaults against max_num_tokens 4096 / 16384")  # fmt: skip
    ap.add_argument("--seed", type=int, default=0, help="seed of prompts and arrivals")
    ap.add_argument("--json", default=None, help="also write the results to this JSON file")
    ap.add_argument("--save-slice", default=None, help=argparse.SUPPRESS)  # the child process of prepare_model
    args = ap.parse_args()
    if args.save_slice:
        save_slice(args)
        return 0
    args.loads = parse_loads(args)
    from trtllm_glm.config import Glm5NextConfig, resolve_preset_dir

    args.vocab_size = Glm5NextConfig.from_pretrained(resolve_preset_dir(args.model)).vocab_size
    tmp = Path(tempfile.mkdtemp(prefix="bench_serve_"))
    proc = None
    step_log: Path | None = None
    if args.url:
        check_loopback(args.url)
        url = args.url.rstrip("/")
        info = f"url={url}"
    else:
        prepare_model(args)
        step_log = tmp / "steps.jsonl"
        url, proc, server_log = start_child_server(args, str(step_log))
        info = f"child server: model={args.model_path} config={args.config or 'defaults'}"
    print(f"# bench_serve  {time.strftime('%Y-%m-%d %H:%M:%S')}  {platform.node()}  cpus={os.cpu_count()}  "
          f"python={sys.version.split()[0]}")  # fmt: skip
    print(f"# {info}")
    wl = args.workload or f"input {args.input_len} / output {args.output_len} tokens"
    print(f"# /v1/completions streaming, greedy, ignore_eos, token-id prompts ({wl}); time limit "
          f"{args.time_limit:.0f} s per level; percentiles p50/p90/p99 in ms; goodput req/s under TTFT <= "
          f"{args.slo_ttft_ms:g} ms, TPOT <= {args.slo_tpot_ms:g} ms")  # fmt: skip
    print(f"{'level':>6} {'done/req':>9} {'wall_s':>7} {'req/s':>7} {'out_tok/s':>9}  {'TTFT p50/p90/p99':>22} "
          f"{'ITL p50/p90/p99':>18} {'TPOT p50/p90/p99':>18} {'E2E p50/p90/p99':>24} {'goodput':>7}")  # fmt: skip
    results: list[dict[str, Any]] = []
    startup: list[str] = []
    try:
        results = asyncio.run(main_async(args, url, step_log, proc.pid if proc is not None else None))
    finally:
        if proc is not None:
            stop_child_server(proc)
            # Start-up lines, and the kernels the server compiled while serving (which ones: a stall's cause).
            startup = [x for x in server_log.read_text().splitlines()
                       if "warm-up" in x or "step sizes" in x or "while serving" in x]  # fmt: skip
            for line in startup:
                print(f"# server: {line.strip()}")
    if args.engine_baseline and proc is not None:
        from trtllm_glm import LLM
        from trtllm_glm.serve.config import load_llm_options, split_serve_options

        opts, _ = split_serve_options(load_llm_options(args.config) if args.config else {})  # engine_process: serve's
        llm = LLM(args.model_path, **{**opts, "warmup": False})  # the decode graphs are captured; no prefill timed
        il, ol = load_workload(args)[0]
        B = llm.executor.cfg.max_batch_size
        for row in results:
            b = min(B, int(row["level"])) if row["load"] == "concurrency" else None
            if b is None:
                continue
            row["engine_batch"] = b
            row["engine_tok_per_s"] = engine_decode_rate(llm, b, il, max(ol, 16), args.seed + 7)
            row["server_over_engine"] = row["out_tok_per_s"] / row["engine_tok_per_s"]
            print(f"# engine alone, batch {b}: {row['engine_tok_per_s']:.1f} tok/s; server c={b}: "
                  f"{row['out_tok_per_s']:.1f} tok/s = {row['server_over_engine']:.2f}x")  # fmt: skip
        if args.generate_check:
            n, il_g, ol_g = (int(x) for x in args.generate_check.split("x"))
            rates = {"defaults": generate_rate(llm, n, il_g, ol_g, args.seed + 11)}
            # One LLM on the card at a time: each sizes its KV cache from the memory it finds free (the second one
            # ran out of memory on an H200 while the first still held the card).
            release_llm(llm)
            del llm
            for mnt in (4096, 16384):
                other = LLM(args.model_path, **{**opts, "warmup": False, "max_num_tokens": mnt})
                rates[f"max_num_tokens={mnt}"] = generate_rate(other, n, il_g, ol_g, args.seed + 11)
                release_llm(other)
                del other
            best = max(rates.values())
            for k, v in rates.items():
                print(f"# LLM.generate {n} x {il_g} tokens, {ol_g} out, {k}: {v:.1f} tok/s = {v / best:.2f}x the best")
            results.append({"load": "generate", "level": n, "input_len": il_g, "output_len": ol_g, "rates": rates})
        else:
            llm.shutdown()
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"info": info, "workload": wl, "startup": startup, "levels": results}, f, indent=2)
    served = [r for r in results if r["load"] != "generate"]
    return 0 if all(r["failed"] == 0 and r["cancelled"] == 0 for r in served) else 1


if __name__ == "__main__":
    sys.exit(main())
