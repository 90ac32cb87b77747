"""Benchmark of the skinny fp32 GEMM (`trtllm_glm.linear.skinny_gemm`) against the torch path the model ran before.

Cases: the MoE router weight ``[288, 4096]`` and the indexer's head-weight projection ``[32, 4096]``, bf16 weight
and bf16 rows, ``M`` in {1, 4, 16, 64}. Per case:

* ``kernel``: replay of a CUDA graph of ``C`` back-to-back `skinny_gemm` calls divided by ``C`` (median of several
  replays, CUDA events). Each call has its own weight copy, ``C`` copies together ~2.5x the L2, so every call
  reads its weight from HBM, as the model's 42 router weights per step do.
* ``torch``: the same graph of ``F.linear(x.float(), W.float())``: the two casts (the weight's: 2 bytes read and
  4 written per element) and cuBLAS's fp32 GEMM, as the model ran it.
* ``hot``: the kernel graph with one weight for every call (L2-resident after the first): the launch-bound floor.
* ``1-call``: replay of a graph holding one kernel call (graph launch overhead included).
* ``eager``: ``triton.testing.do_bench`` of one call (includes the launch).

Bytes floor: weight + x (bf16) + y (fp32). GB/s = floor bytes / kernel time; ``%copy`` against a 1 GiB
device-to-device copy measured in the same run (bytes read + written); ``x floor`` = kernel time / (floor bytes at
the copy bandwidth). ``vs torch`` = torch time / kernel time. Each variant is checked against an fp64 reference
(``|y - ref| <= 1e-6 * (|x| @ |W|^T)``) before it is timed; a variant that fails is reported and not timed.

Usage (on a CUDA machine, from the repository root)::

    python -m benchmarks.bench_skinny_gemm [--quick] [--sweep] [--json PATH]

``--sweep`` also times other launch shapes (``split_k``, ``block_k``, ``num_stages``, ``num_warps``) per case; the
summary names the best. Without CUDA it prints a message and exits 0.
"""

from __future__ import annotations

import argparse
import math
import sys
from functools import partial

import torch
import torch.nn.functional as F

from benchmarks.harness.ceiling import copy_ceiling_gbs
from benchmarks.harness.rows import write_json
from benchmarks.harness.timing import graph_us

HIDDEN = 4096
SHAPES = (288, 32)
ROWS = (1, 4, 16, 64)
REL_BOUND = 1e-6
# Launch shapes timed by --sweep (keywords of `skinny_gemm`); the default shape is always timed as "default".
SWEEP: list[dict] = [
    dict(split_k=1),  # no fixup: one program per 16 weight rows
    dict(split_k=2),
    dict(split_k=4),
    dict(split_k=8),
    dict(split_k=16),
    dict(split_k=32),
    dict(split_k=64),
    dict(block_k=64),
    dict(block_k=256),
    dict(num_stages=2),
    dict(num_stages=3),
    dict(num_warps=2),
    dict(num_warps=8),
    dict(split_k=16, block_k=64),
    dict(split_k=32, block_k=64),
]


def _torch_path(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """What the model ran before: both casts, then cuBLAS's fp32 GEMM."""
    return F.linear(x.float(), w.float())


def _check(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    ref = x.double() @ w.double().T
    bound = REL_BOUND * (x.double().abs() @ w.double().abs().T)
    bad = ((y.double() - ref).abs() > bound) | ~torch.isfinite(y)
    if bad.any():
        raise AssertionError(f"{int(bad.sum())} elements outside the fp64 bound")


def _label(kw: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in kw.items()) or "default"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions")
    parser.add_argument("--sweep", action="store_true", help="also time other launch shapes")
    parser.add_argument("--json", default=None, help="also write the rows as JSON to this path")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_skinny_gemm: CUDA is not available; nothing to benchmark.")
        return 0
    import triton
    from triton.testing import do_bench

    from trtllm_glm.linear import kernel_module, skinny_gemm

    dev = torch.device("cuda")
    props = torch.cuda.get_device_properties(dev)
    ceiling = copy_ceiling_gbs(dev, args.quick)
    print(f"device: {props.name}; torch {torch.__version__}; triton {triton.__version__}; "
          f"L2 {props.L2_cache_size / 2**20:.0f} MiB; copy ceiling {ceiling:.0f} GB/s")  # fmt: skip
    reps = 10 if args.quick else 30
    mod = kernel_module(dev)
    rows: list[dict] = []
    failed = 0
    g = torch.Generator(device=dev).manual_seed(0)
    for n in SHAPES:
        w_bytes = n * HIDDEN * 2
        copies = max(8, min(512, math.ceil(2.5 * props.L2_cache_size / w_bytes)))
        weights = [(torch.randn(n, HIDDEN, device=dev, generator=g) * HIDDEN**-0.5).to(torch.bfloat16)
                   for _ in range(copies)]  # fmt: skip
        for m in ROWS:
            xs = [(torch.randn(m, HIDDEN, device=dev, generator=g) * 2).to(torch.bfloat16) for _ in range(copies)]
            ys = [torch.empty(m, n, device=dev) for _ in range(copies)]
            floor_bytes = w_bytes + m * HIDDEN * 2 + m * n * 4
            floor_us = floor_bytes / (ceiling * 1e9) * 1e6
            case = f"[{n}, {HIDDEN}] M={m}"
            cfg = mod.launch_config(n, HIDDEN, 2, False)
            row: dict = {"n": n, "k": HIDDEN, "m": m, "copies": copies, "floor_bytes": floor_bytes,
                         "floor_us": floor_us, "default_config": vars(cfg), "variants": {}}  # fmt: skip
            t_torch = graph_us([partial(_torch_path, x, w) for x, w in zip(xs, weights)], reps)
            row["torch_us"] = t_torch
            print(f"  {case:<20} torch (casts + cuBLAS)          graph {t_torch:7.2f} us", flush=True)
            for kw in [{}] + (SWEEP if args.sweep else []):
                label = _label(kw)
                try:
                    for x, w, y in zip(xs, weights, ys):
                        y.fill_(float("nan"))
                        skinny_gemm(x, w, out=y, **kw)
                        _check(y, x, w)
                    calls = [partial(skinny_gemm, x, w, out=y, **kw) for x, w, y in zip(xs, weights, ys)]
                    t = graph_us(calls, reps)
                    res = {"graph_us": t, "gbps": floor_bytes / (t * 1e-6) / 1e9}
                    res["pct_copy"] = 100 * res["gbps"] / ceiling
                    res["x_floor"] = t / floor_us
                    res["vs_torch"] = t_torch / t
                    extra = ""
                    if not kw:
                        hot = [partial(skinny_gemm, xs[0], weights[0], out=ys[0]) for _ in range(64)]
                        res["hot_us"] = graph_us(hot, reps)
                        res["one_call_graph_us"] = graph_us(calls[:1], reps * 3)
                        res["eager_us"] = (
                            do_bench(calls[0], warmup=10, rep=40 if args.quick else 100, return_mode="median") * 1e3
                        )
                        extra = (f"  hot {res['hot_us']:6.2f}  1-call {res['one_call_graph_us']:6.2f}"
                                 f"  eager {res['eager_us']:6.2f} us")  # fmt: skip
                    print(f"  {case:<20} {label:<32} graph {t:7.2f} us  {res['gbps']:6.0f} GB/s "
                          f"{res['pct_copy']:5.1f}% copy  x{res['x_floor']:5.2f} floor  "
                          f"{res['vs_torch']:5.1f}x torch{extra}", flush=True)  # fmt: skip
                except Exception as e:  # noqa: BLE001 - reported, reflected in the exit code
                    failed += 1
                    res = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
                    print(f"  {case:<20} {label:<32} FAILED {res['error']}", flush=True)
                row["variants"][label] = res
            rows.append(row)
            del xs, ys
            if args.json:  # after every case, so that a run cut short keeps what it measured
                _write_json(args.json, props.name, ceiling, rows)
        del weights
        torch.cuda.empty_cache()

    print()
    head = (f"{'case':<20} {'kernel us':>9} {'torch us':>9} {'vs torch':>8} {'GB/s':>6} {'x floor':>7} "
            f"{'hot us':>7} {'1-call':>7} {'best sweep':>36}")  # fmt: skip
    print(head)
    print("-" * len(head))
    for r in rows:
        d = r["variants"].get("default", {})
        swept = [(k, v) for k, v in r["variants"].items() if k != "default" and "graph_us" in v]
        best = min(swept, key=lambda kv: kv[1]["graph_us"], default=None)
        best_s = f"{best[0]} {best[1]['graph_us']:.2f}" if best else "-"
        case = f"[{r['n']}, {r['k']}] M={r['m']}"
        if "graph_us" not in d:
            print(f"{case:<20} FAILED")
            continue
        print(f"{case:<20} {d['graph_us']:9.2f} {r['torch_us']:9.2f} "
              f"{d['vs_torch']:8.1f} {d['gbps']:6.0f} {d['x_floor']:7.2f} {d['hot_us']:7.2f} "
              f"{d['one_call_graph_us']:7.2f} {best_s:>36}")  # fmt: skip
    if args.json:
        _write_json(args.json, props.name, ceiling, rows)
    if failed:
        print(f"{failed} variant(s) failed")
    return 1 if failed else 0


def _write_json(path: str, device: str, ceiling: float, rows: list[dict]) -> None:
    write_json(path, {"device": device, "copy_gbps": ceiling, "rows": rows})


if __name__ == "__main__":
    sys.exit(main())
