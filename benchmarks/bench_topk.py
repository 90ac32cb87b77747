"""Benchmark of the pool top-k kernel (``kernels/topk.py``): CUDA-graph replay at GLM-5.3-Flash geometry.

Top 512 pools (``index_topk`` 2048 tokens / 4) of N = 1, 16, 64 rows over 8192 and 32768 pools, every row
at full context (all pools complete). Each case builds ``SETS`` independent input sets (scores and
positions); a CUDA graph captures one call per set, back to back, and the replay time divided by the number
of calls is the time per call (no launch overhead; the inputs rotate, so successive calls see different
data, though each set's scores may still be in L2 as they are after the scoring kernel in the model).
The median over several replays is reported. Every variant's ids are first compared with the torch
reference on every set (identical ids required); a variant that differs is reported and not timed.

Distributions: ``randn``; ``relu-sum`` (indexer-like: non-negative sums of ReLU'd products, many near zero);
``coarse`` (values on a 1/4 grid: many exact ties at the k-th place, the bisection's worst case).

Rows per case: ``new`` (the default launch), ``old`` (the one-program-per-row kernel, ``method="row"``),
``torch`` (the reference op, captured in a graph too), and unless ``--no-sweep`` alternative launch shapes
of the chunked path (chunk size, candidate slots per chunk, warps, threshold search, programmatic dependent
launch). ``eager`` (do_bench median, includes the launch) is given for ``new`` only. At the end, the
profiler's device time per kernel of one call (16 rows x 32768 pools) when CUPTI is available.

Usage (on a CUDA machine, from the repository root)::

    python -m benchmarks.bench_topk [--quick] [--no-sweep] [--json PATH]

``--compile-only K/M`` only compiles (every M-th variant from the K-th, one call each): run M such processes
in parallel beforehand to fill Triton's cache, so that the timed run does not wait for the compiler.
Without CUDA it prints a message and exits 0.
"""

from __future__ import annotations

import argparse
import sys
from functools import partial

import torch

from benchmarks.harness.rows import device_line, write_json
from benchmarks.harness.timing import graph_us

TOPK_POOLS = 512
# The issue-8 target case first (a run cut short by a time limit still has it).
CASES = ((16, 32768), (64, 32768), (1, 32768), (16, 8192), (64, 8192), (1, 8192))
SETS = 16  # input sets per case; the graph replays one call per set


def _scores(dist: str, n_rows: int, max_pools: int, g: torch.Generator, dev: torch.device) -> torch.Tensor:
    """``[n_rows, max_pools]`` fp32 scores of distribution ``dist``."""
    if dist == "randn":
        return torch.randn(n_rows, max_pools, device=dev, generator=g)
    if dist == "relu-sum":
        return torch.relu(torch.randn(n_rows, max_pools, 4, device=dev, generator=g)).sum(-1) * 0.01
    if dist == "coarse":
        return torch.round(torch.randn(n_rows, max_pools, device=dev, generator=g) * 4) / 4
    raise ValueError(dist)


# Launch shapes of the chunked path compared by the sweep: (chunk, slots, chunk-pass warps, merge warps).
_SWEEP = {
    32768: [
        (4096, 1024, 8, 8),
        (4096, 1024, 4, 16),
        (4096, 1024, 4, 4),
        (4096, 512, 4, 4),
        (4096, 512, 4, 8),
        (8192, 1024, 8, 4),
        (8192, 512, 8, 4),
        (2048, 512, 2, 8),
        (2048, 512, 4, 8),
        (2048, 1024, 2, 16),
    ],
    8192: [
        (4096, 1024, 8, 4),
        (4096, 512, 4, 4),
        (2048, 1024, 2, 4),
        (2048, 1024, 4, 4),
        (2048, 512, 2, 4),
        (1024, 1024, 1, 8),
        (1024, 512, 1, 4),
        (1024, 512, 2, 4),
    ],
}


def _sweep_variants(max_pools: int) -> list[tuple[str, dict]]:
    """Alternative launches of the chunked path for ``max_pools`` (labels name the knobs that differ from
    the default: chunk pools, candidate slots, warps of the two passes, search, programmatic launch)."""
    out: list[tuple[str, dict]] = []
    for chunk, slots, w, mw in _SWEEP.get(max_pools, []):
        kw = dict(chunk=chunk, slots=slots, num_warps=w, merge_warps=mw)
        out.append((f"c{chunk} s{slots} w{w} mw{mw}", kw))
    out.append(("default no-pdl", dict(pdl=False)))
    out.append(("default snap", dict(search="snap")))
    out.append(("default snap no-pdl", dict(search="snap", pdl=False)))
    out.append(("default bisect/snap", dict(search="bisect/snap")))
    out.append(("default snap/bisect", dict(search="snap/bisect")))
    return out


def _kernel_breakdown(mod: object, dev: torch.device, n_rows: int, max_pools: int, kw: dict) -> dict[str, float]:
    """Mean device time (us) per kernel of one call, from the torch profiler (CUPTI), over 20 eager calls."""
    from torch.profiler import ProfilerActivity, profile

    scores = torch.randn(n_rows, max_pools, device=dev)
    positions = torch.full((n_rows,), 4 * max_pools - 1, device=dev, dtype=torch.int64)
    out = torch.empty(n_rows, TOPK_POOLS, dtype=torch.int32, device=dev)
    for _ in range(3):
        mod.select_topk_pools(scores, positions, TOPK_POOLS, out=out, **kw)  # type: ignore[attr-defined]
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(20):
            mod.select_topk_pools(scores, positions, TOPK_POOLS, out=out, **kw)  # type: ignore[attr-defined]
        torch.cuda.synchronize()
    res: dict[str, float] = {}
    for ev in prof.key_averages():
        if ev.device_type.name == "CUDA" or getattr(ev, "device_time_total", 0) > 0:
            t = getattr(ev, "device_time_total", 0.0) or getattr(ev, "cuda_time_total", 0.0)
            if t > 0:
                res[ev.key] = t / 20
    return res


def _write_json(path: str, dev: torch.device, rows: list[dict]) -> None:
    write_json(path, {"device": torch.cuda.get_device_name(dev), "topk_pools": TOPK_POOLS, "rows": rows})


def _compile_only(mod: object, dev: torch.device, shard: str) -> int:
    """Call every launch variant of the benchmark once (one row: the compiled kernels do not depend on N)."""
    k, m = (int(x) for x in shard.split("/"))
    jobs = [(p, kw) for p in sorted({p for _, p in CASES}) for _, kw in [("new", {}), ("old", {"method": "row"})]]
    jobs += [(p, kw) for p in sorted({p for _, p in CASES}) for _, kw in _sweep_variants(p)]
    failed = 0
    for i, (max_pools, kw) in enumerate(jobs):
        if i % m == k:
            scores = torch.randn(1, max_pools, device=dev)
            positions = torch.full((1,), 4 * max_pools - 1, device=dev, dtype=torch.int64)
            try:
                mod.select_topk_pools(scores, positions, TOPK_POOLS, **kw)  # type: ignore[attr-defined]
                torch.cuda.synchronize()
            except Exception as e:  # noqa: BLE001 - reported; the timed run reports it again
                failed += 1
                print(f"  pools={max_pools} {kw}: FAILED {type(e).__name__}: {str(e)[:300]}")
    print(f"compiled shard {k}/{m}" + (f", {failed} failed" if failed else ""))
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions")
    parser.add_argument("--no-sweep", dest="sweep", action="store_false", help="skip the launch-shape sweep")
    parser.add_argument("--json", default=None, help="also write the rows as JSON to this path")
    parser.add_argument(
        "--compile-only",
        metavar="K/M",
        default=None,
        help="only compile (fill Triton's cache): every M-th variant from the K-th, one call each, no timing",
    )
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_topk: CUDA is not available; nothing to benchmark.")
        return 0
    from triton.testing import do_bench

    from trtllm_glm.attention.sparse.glm_kpool import kernels as K
    from trtllm_glm.attention.sparse.glm_kpool import ops as R

    dev = torch.device("cuda")
    print(device_line(dev), flush=True)
    mod = K.kernel_module("topk", dev)
    if args.compile_only:
        return _compile_only(mod, dev, args.compile_only)
    reps = 10 if args.quick else 30
    rows: list[dict] = []
    failed = 0

    for n_rows, max_pools in CASES:
        dists = ["randn"]
        if n_rows == 16:
            dists += ["relu-sum", "coarse"]
        for dist in dists:
            g = torch.Generator(device=dev).manual_seed(1000 * n_rows + max_pools + len(dist))
            positions = torch.full((n_rows,), 4 * max_pools - 1, device=dev, dtype=torch.int64)
            sets = [(_scores(dist, n_rows, max_pools, g, dev), positions.clone()) for _ in range(SETS)]
            refs = [R.select_topk_pools(s, p, TOPK_POOLS) for s, p in sets]
            outs = [torch.empty(n_rows, TOPK_POOLS, dtype=torch.int32, device=dev) for _ in sets]
            variants: list[tuple[str, dict | None]] = [("new", {}), ("old", {"method": "row"}), ("torch", None)]
            if args.sweep and n_rows in (16, 64) and dist == "randn":
                variants += _sweep_variants(max_pools)
            case = f"N={n_rows} pools={max_pools} {dist}"
            for label, kw in variants:
                row = {"n_rows": n_rows, "max_pools": max_pools, "dist": dist, "variant": label, "kwargs": kw}
                try:
                    if kw is None:
                        calls = [partial(R.select_topk_pools, s, p, TOPK_POOLS) for s, p in sets]
                    else:
                        calls = [
                            partial(mod.select_topk_pools, s, p, TOPK_POOLS, out=o, **kw)
                            for (s, p), o in zip(sets, outs, strict=True)
                        ]
                        for o in outs:
                            o.fill_(-7)
                        for c in calls:
                            c()
                        bad = [i for i, (o, r) in enumerate(zip(outs, refs, strict=True)) if not torch.equal(o, r)]
                        if bad:
                            raise AssertionError(f"ids differ from the reference in sets {bad}")
                    row["graph_us"] = graph_us(calls, reps)
                    if label == "new":
                        row["eager_us"] = do_bench(calls[0], warmup=10, rep=40 if args.quick else 100) * 1e3
                    eager = f"  eager {row['eager_us']:6.1f} us" if "eager_us" in row else ""
                    print(f"  {case:<28} {label:<28} graph {row['graph_us']:7.2f} us{eager}", flush=True)
                except Exception as e:  # noqa: BLE001 - reported, reflected in the exit code
                    failed += 1
                    row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                    print(f"  {case:<28} {label:<28} FAILED {row['error']}", flush=True)
                rows.append(row)
            del sets, refs, outs
            torch.cuda.empty_cache()
            if args.json:  # after every case, so that a run cut short keeps what it measured
                _write_json(args.json, dev, rows)

    breakdown: list[dict] = []
    for n_rows, max_pools, label, kw in ((16, 32768, "new", {}), (16, 32768, "snap", {"search": "snap"})):
        try:
            per = _kernel_breakdown(mod, dev, n_rows, max_pools, kw)
            breakdown.append({"n_rows": n_rows, "max_pools": max_pools, "variant": label, "kernels_us": per})
            items = ", ".join(f"{k}: {v:.2f}" for k, v in sorted(per.items(), key=lambda x: -x[1]))
            print(f"  kernel times N={n_rows} pools={max_pools} {label}: {items}", flush=True)
        except Exception as e:  # noqa: BLE001 - optional (needs CUPTI)
            print(f"  kernel times: unavailable ({type(e).__name__}: {str(e)[:200]})")
    rows.append({"kernel_breakdown": breakdown})

    print()
    head = f"{'case':<28} {'new us':>8} {'old us':>8} {'torch us':>9} {'old/new':>8} {'best sweep':>40}"
    print(head)
    print("-" * len(head))
    timed = [r for r in rows if "graph_us" in r]
    keys = sorted({(r["n_rows"], r["max_pools"], r["dist"]) for r in timed}, key=lambda k: (k[1], k[0], k[2]))
    for key in keys:
        sel = {r["variant"]: r for r in timed if (r["n_rows"], r["max_pools"], r["dist"]) == key}
        new, old, ref = (sel.get(v, {}).get("graph_us") for v in ("new", "old", "torch"))
        sweep = [r for v, r in sel.items() if v not in ("new", "old", "torch")]
        best = min(sweep, key=lambda r: r["graph_us"], default=None)
        fmt = lambda t: f"{t:8.2f}" if t is not None else f"{'-':>8}"  # noqa: E731
        ratio = f"{old / new:8.2f}" if new and old else f"{'-':>8}"
        best_s = f"{best['variant']} {best['graph_us']:.2f}" if best else "-"
        print(f"N={key[0]} pools={key[1]} {key[2]:<12} {fmt(new)} {fmt(old)} {fmt(ref)} {ratio} {best_s:>40}")
    if args.json:
        _write_json(args.json, dev, rows)
    if failed:
        print(f"{failed} variant(s) failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
