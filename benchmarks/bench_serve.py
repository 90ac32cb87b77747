"""Load generator for ``trtllm-glm serve``: throughput and TTFT / ITL / TPOT / E2E percentiles.

Bounded by construction: loopback only (127.0.0.0/8, ::1, localhost), a fixed number of requests per
concurrency level and a wall-clock limit per level (outstanding requests are cancelled at the limit).
Without ``--url`` it starts its own server in-process on 127.0.0.1 and a free port.

Each request streams ``/v1/completions`` (greedy, ``ignore_eos``, fixed ``--max-tokens``) with
``stream_options.continuous_usage_stats`` so that every engine step that produced tokens is one chunk
carrying the running token count:

- TTFT: request sent to the first chunk with a token.
- ITL: gaps between consecutive token chunks (one engine step; a speculative step can carry several).
- TPOT: ``(E2E - TTFT) / (output tokens - 1)`` per request.
- E2E: request sent to the last byte.

Run (CPU, tiny preset)::

    .venv/bin/python benchmarks/bench_serve.py --model tiny --concurrency 1,8,32
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import json
import os
import platform
import socket
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlparse

import httpx

HOST = "127.0.0.1"


@dataclass
class Result:
    ok: bool = False
    error: str = ""
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    tokens: int = 0


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


def start_server(args: argparse.Namespace) -> tuple[str, Any, threading.Thread, Any]:
    """An in-process server for ``args.model`` on 127.0.0.1 (its engine starts with the app)."""
    import uvicorn

    from trtllm_glm.serve.config import load_llm_options
    from trtllm_glm.serve.server import make_app

    opts: dict[str, Any] = {"max_batch_size": 32, "max_seq_len": 512}
    if args.config:
        opts.update(load_llm_options(args.config))
    app = make_app(args.model, opts, served_model_name=args.model, max_queue_size=args.max_queue_size)
    port = free_port()
    srv = uvicorn.Server(uvicorn.Config(app, host=HOST, port=port, log_level="warning", lifespan="on"))
    th = threading.Thread(target=srv.run, name="bench-server", daemon=True)
    th.start()
    deadline = time.monotonic() + 120
    while not srv.started:
        if not th.is_alive() or time.monotonic() > deadline:
            raise SystemExit("bench_serve: the server did not start")
        time.sleep(0.05)
    return f"http://{HOST}:{port}", srv, th, app


async def one_request(c: httpx.AsyncClient, url: str, model: str, prompt: str, max_tokens: int) -> Result:
    body = {
        "model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
        "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }  # fmt: skip
    res = Result()
    t0 = time.perf_counter()
    last = None
    seen = 0
    try:
        async with c.stream("POST", f"{url}/v1/completions", json=body) as r:
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


async def run_level(url: str, args: argparse.Namespace, concurrency: int, n_requests: int) -> dict[str, Any]:
    prompts = [f"Request {i}: tell me about sparse attention. " * (1 + i % 3) for i in range(n_requests)]
    sem = asyncio.Semaphore(concurrency)
    results: list[Result] = []
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=args.time_limit, limits=limits, trust_env=False) as c:

        async def worker(p: str) -> None:
            async with sem:
                results.append(await one_request(c, url, args.model, p, args.max_tokens))

        t0 = time.perf_counter()
        tasks = [asyncio.ensure_future(worker(p)) for p in prompts]
        done, pending = await asyncio.wait(tasks, timeout=args.time_limit)
        for t in pending:  # the time limit: cancel what is left (the server aborts those requests)
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        wall = time.perf_counter() - t0
    ok = [r for r in results if r.ok]
    toks = sum(r.tokens for r in ok)
    tpot = [(r.e2e - r.ttft) / (r.tokens - 1) for r in ok if r.tokens > 1]
    return {
        "concurrency": concurrency, "requests": n_requests, "completed": len(ok),
        "failed": len(results) - len(ok), "cancelled": len(pending), "wall_s": wall,
        "req_per_s": len(ok) / wall, "out_tok_per_s": toks / wall,
        "ttft_ms": [x * 1e3 for x in percentiles([r.ttft for r in ok])],
        "itl_ms": [x * 1e3 for x in percentiles([x for r in ok for x in r.itl])],
        "tpot_ms": [x * 1e3 for x in percentiles(tpot)],
        "e2e_ms": [x * 1e3 for x in percentiles([r.e2e for r in ok])],
        "errors": sorted({r.error for r in results if not r.ok})[:3],
    }  # fmt: skip


def fmt_row(s: dict[str, Any]) -> str:
    def trio(v: list[float]) -> str:
        return "/".join(f"{x:.1f}" for x in v)

    return (
        f"{s['concurrency']:>4} {s['completed']:>4}/{s['requests']:<4} {s['wall_s']:7.2f} {s['req_per_s']:7.2f} "
        f"{s['out_tok_per_s']:9.1f}  {trio(s['ttft_ms']):>22} {trio(s['itl_ms']):>18} {trio(s['tpot_ms']):>18} "
        f"{trio(s['e2e_ms']):>24}"
    )


async def main_async(args: argparse.Namespace, url: str) -> list[dict[str, Any]]:
    async with httpx.AsyncClient(timeout=60, trust_env=False) as c:
        r = await c.get(f"{url}/health")
        if r.status_code != 200:
            raise SystemExit(f"bench_serve: {url}/health answered {r.status_code}")
        # Warm-up, not measured: a burst at each concurrency level, so that first-use kernel compilation
        # and autotuning (per batch shape on a GPU) stay out of the measured levels.
        for conc in args.concurrency:
            prompts = [f"Request {i}: tell me about sparse attention. " * (1 + i % 3) for i in range(conc)]
            await asyncio.gather(*(one_request(c, url, args.model, p, min(8, args.max_tokens)) for p in prompts))
    out = []
    for conc in args.concurrency:
        n = args.num_requests or max(8, 2 * conc)
        out.append(await run_level(url, args, conc, n))
        print(fmt_row(out[-1]), flush=True)
        if out[-1]["errors"]:
            print(f"     errors: {out[-1]['errors']}", flush=True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default=None, help="a running server (loopback only); default: start one in-process")
    ap.add_argument("--model", default="tiny", help="preset or checkpoint (also the model name sent)")
    ap.add_argument("--config", default=None, help="LLM options YAML for the in-process server")
    ap.add_argument("--concurrency", default="1,8,32", help="comma-separated concurrency levels")
    ap.add_argument("--num-requests", type=int, default=0, help="requests per level (default max(8, 2 x level))")
    ap.add_argument("--max-tokens", type=int, default=32, help="output tokens per request")
    ap.add_argument("--time-limit", type=float, default=120.0, help="seconds per level before cancelling")
    ap.add_argument("--max-queue-size", type=int, default=256, help="queue of the in-process server")
    ap.add_argument("--json", default=None, help="also write the results to this JSON file")
    args = ap.parse_args()
    args.concurrency = [int(x) for x in args.concurrency.split(",")]
    if args.url:
        check_loopback(args.url)
        url, srv = args.url.rstrip("/"), None
        info = f"url={url}"
    else:
        url, srv, th, app = start_server(args)
        eng = app.state.engine
        import torch

        spec = eng.llm.speculative_config
        info = (f"in-process server: model={args.model} device={eng.llm.device} "
                f"torch_threads={torch.get_num_threads()} max_batch_size={eng.executor.cfg.max_batch_size} "
                f"max_seq_len={eng.max_seq_len} speculative={spec!r}")  # fmt: skip
    print(f"# bench_serve  {time.strftime('%Y-%m-%d %H:%M:%S')}  {platform.node()}  {platform.processor() or ''} "
          f"cpus={os.cpu_count()}  python={sys.version.split()[0]}")  # fmt: skip
    print(f"# {info}")
    print(f"# /v1/completions streaming, greedy, ignore_eos, max_tokens={args.max_tokens}, "
          f"time limit {args.time_limit:.0f} s per level; percentiles p50/p90/p99 in ms")  # fmt: skip
    print(f"{'conc':>4} {'done/req':>9} {'wall_s':>7} {'req/s':>7} {'out_tok/s':>9}  {'TTFT p50/p90/p99':>22} "
          f"{'ITL p50/p90/p99':>18} {'TPOT p50/p90/p99':>18} {'E2E p50/p90/p99':>24}")  # fmt: skip
    try:
        results = asyncio.run(main_async(args, url))
    finally:
        if srv is not None:
            srv.should_exit = True
            th.join(timeout=60)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"info": info, "max_tokens": args.max_tokens, "levels": results}, f, indent=2)
    return 0 if all(r["failed"] == 0 and r["cancelled"] == 0 for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
