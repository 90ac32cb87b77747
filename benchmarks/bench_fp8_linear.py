"""Benchmark of the weight-only block-FP8 linear (`trtllm_glm.quant.fp8_linear_triton`) at GLM-5.3-Flash's real
shapes, against the bf16 cuBLAS GEMM it replaces and the copy ceiling measured in the same run.

Shapes (``[N, K]`` of the weight, as the model multiplies them after `fuse_weights`): the KDA input projections
(q | k | v | f_a | g_a, ``b_proj`` apart), KDA ``o_proj``, ``f_b`` / ``g_b``, the sparse-MLA input projections
(q_a | kv_a | indexer wk), ``q_b``, MLA ``o_proj``, the indexer's ``wq_b``, the dense MLP (gate | up, down), the
shared expert and the MTP ``eh_proj``. ``M`` in {1, 4, 16, 64, 256} (decode, verify, small chunks) and 2048
(a prefill chunk), bf16 activations and output.

Per case:

* ``fp8``: replay of a CUDA graph of ``C`` back-to-back calls divided by ``C`` (median of several replays). Each
  call has its own weight copy, ``C`` copies together ~2.5x the L2, so every call reads its weight from HBM, as
  a decode step does.
* ``bf16``: the same graph of ``F.linear`` with the bf16 weight (cuBLAS), what the model runs without FP8.

Bytes floor: e4m3 weight + fp32 scales + x + y. ``GB/s`` = floor bytes / time; ``%copy`` against a 1 GiB
device-to-device copy timed in the same run (bytes read + written); the issue's goal is >= 80 % at ``M <= 16``.
``vs bf16`` = bf16 time / fp8 time. Every variant is checked against the fp64 product of the dequantised weight
(relative to ``|x| @ |W|^T``, bf16 output rounding allowed) before it is timed.

Usage (on a CUDA machine, from the repository root)::

    python -m benchmarks.bench_fp8_linear [--quick] [--rows 1,4,16] [--shapes a,b] [--json PATH]
    python -m benchmarks.bench_fp8_linear --sweep --quick --json SWEEP.json   # tuning, ~3-5 min
    python -m benchmarks.bench_fp8_linear --apply SWEEP.json                  # winners -> defaults

``--sweep`` (rows 1, 4, 16 unless ``--rows`` says otherwise) times every candidate of `CANDIDATES` per case (the
launch shapes that resolve to the same `Fp8LinearConfig` for a shape are timed once) with the tuned table off
(``tuned=False``: the rule alone is ``rule``), and also, per case, a zero-work Triton kernel with the rule's grid
and a device copy moving the floor's bytes (``floor / 2`` read, ``floor / 2`` written), both as graphs of ``C``
calls like the kernel: the first is what a launch costs at all, the second what the copy ceiling is at that size.
The summary names, per shape, the candidate with the least time summed over the rows (a launch shape may not
depend on M) and its % of the copy ceiling per row; per size class (`kernels.shape_class`) the candidate best
over the class's shapes; and the bytes-weighted % of the copy ceiling (sum of floor bytes / sum of times) of the
rule, of the per-shape winners and of the per-class winners, over the tiny shapes apart (launch-bound) and the
rest. ``--apply`` writes those winners into the tuned tables of ``trtllm_glm/quant/kernels.py`` (between its
``BEGIN TUNED`` / ``END TUNED`` markers; no CUDA needed). ``--candidates 0,5,9`` times a subset of `CANDIDATES`;
the ``best per M`` column is what an M-dependent choice would add (not allowed: a row's bits would change with the
batch). Without CUDA the benchmark prints a message and exits 0.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from functools import partial

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from benchmarks.harness.ceiling import copy_ceiling_gbs
from benchmarks.harness.rows import write_json
from benchmarks.harness.timing import graph_us

SHAPES: list[tuple[str, int, int]] = [
    ("kda.qkv|f_a|g_a", 3 * 8192 + 2 * 128, 4096),
    ("kda.o_proj", 4096, 8192),
    ("kda.f_b/g_b", 8192, 128),
    ("mla.q_a|kv_a|wk", 1536 + 512 + 128, 4096),
    ("mla.q_b", 64 * 256, 1536),
    ("mla.o_proj", 4096, 64 * 256),
    ("indexer.wq_b", 32 * 128, 1536),
    ("mlp.gate|up", 2 * 12288, 4096),
    ("mlp.down", 4096, 12288),
    ("shared.gate|up", 2 * 2048, 4096),
    ("shared.down", 4096, 2048),
    ("mtp.eh_proj", 4096, 8192),
]
ROWS = (1, 4, 16, 64, 256, 2048)
SWEEP_ROWS = (1, 4, 16)
BLOCK = 128
# Decode launch shapes timed by --sweep at M <= 16 (`launch_config` knobs; ``x_as_a``: the fused MoE's operand
# orientation, mma.sync with the weight as the right operand). Resolved per shape: duplicates are timed once.
CANDIDATES: list[dict] = [
    dict(x_as_a=False),  # the rule's tile in the old orientation, for comparison
    dict(x_as_a=False, block_n=32, k_chunk=1024),
    dict(x_as_a=False, block_n=64, k_chunk=2048),
    dict(x_as_a=False, block_n=64, k_chunk=2048, unroll=2),
    dict(x_as_a=False, block_n=128, k_chunk=1024),
    dict(x_as_a=True),
    dict(x_as_a=True, block_n=16, k_chunk=1024),
    dict(x_as_a=True, block_n=16, k_chunk=2048),
    dict(x_as_a=True, block_n=32, k_chunk=512),
    dict(x_as_a=True, block_n=32, k_chunk=1024),
    dict(x_as_a=True, block_n=32, k_chunk=2048),
    dict(x_as_a=True, block_n=32, k_chunk=4096),
    dict(x_as_a=True, block_n=64, k_chunk=512),
    dict(x_as_a=True, block_n=64, k_chunk=1024),
    dict(x_as_a=True, block_n=64, k_chunk=2048),
    dict(x_as_a=True, block_n=64, k_chunk=4096),
    dict(x_as_a=True, block_n=64, k_chunk=1 << 30),  # no split: the MoE's whole-K programs
    dict(x_as_a=True, block_n=128, k_chunk=1024),
    dict(x_as_a=True, block_n=128, k_chunk=2048),
    dict(x_as_a=True, block_n=128, k_chunk=1024, num_warps=8),
    dict(x_as_a=True, block_n=256, k_chunk=1024, num_warps=8),
    dict(x_as_a=True, block_n=64, k_chunk=2048, num_stages=3),
    dict(x_as_a=True, block_n=64, k_chunk=2048, num_stages=5),
    dict(x_as_a=True, block_n=64, k_chunk=2048, num_stages=6),
    dict(x_as_a=True, block_n=64, k_chunk=2048, num_warps=2),
    dict(x_as_a=True, block_n=64, k_chunk=2048, num_warps=8),
    dict(x_as_a=True, block_n=32, k_chunk=2048, unroll=2),
    dict(x_as_a=True, block_n=64, k_chunk=2048, unroll=2),
    dict(x_as_a=True, block_n=64, k_chunk=2048, block_k=64),
    # Programmatic dependent launch (`trtllm_glm.pdl`): each call starts streaming (and prefetching into L2 the start
    # of its chunk) while the call before it finishes; in the model the kernel before is a norm or an activation.
    dict(x_as_a=True, pdl=True),
    dict(x_as_a=True, block_n=64, k_chunk=1024, pdl=True),
    dict(x_as_a=True, block_n=128, k_chunk=1024, pdl=True),
    dict(x_as_a=True, block_n=128, k_chunk=2048, pdl=True),
    dict(x_as_a=True, block_n=128, k_chunk=2048, pdl=True, prefetch=0),
    dict(x_as_a=True, block_n=128, k_chunk=2048, pdl=True, prefetch=2048),
    dict(x_as_a=False, block_n=32, k_chunk=1024, pdl=True),
    # Stream-K (`kernels._fp8_linear_sk_kernel`): the tiles x steps units shared equally by this many programs (two
    # or four per SM on 132 SMs), so no wave runs half empty; with PDL too.
    dict(x_as_a=True, block_n=64, stream_k=264),
    dict(x_as_a=True, block_n=128, stream_k=132),
    dict(x_as_a=True, block_n=128, stream_k=264),
    dict(x_as_a=True, block_n=128, stream_k=528),
    dict(x_as_a=True, block_n=128, stream_k=264, pdl=True),
]
# Timed by --sweep for M > 16 (prefill-sized: no split).
SWEEP_LARGE: list[dict] = [
    dict(block_n=64),
    dict(block_n=64, num_warps=4),
    dict(num_warps=4),
    dict(num_stages=2),
    dict(num_stages=3),
    dict(block_k=64),
    dict(block_k=64, num_stages=4),
]


@triton.jit
def _empty_kernel(x_ptr, n):
    """A launch that does nothing (``n >= 0``): what any kernel costs at a given grid."""
    if n < 0:
        tl.store(x_ptr, 0)


def _exact(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x @ w^T, |x| @ |w|^T)`` in fp64 (once per case: `_check` compares every variant with them)."""
    xd, wd = x.double(), w.double()
    return xd @ wd.T, xd.abs() @ wd.abs().T


def _check(y: torch.Tensor, exact: tuple[torch.Tensor, torch.Tensor], weight_rounding: float = 1e-5) -> None:
    """``y`` against the fp64 ``exact`` product; ``weight_rounding``: the relative error of the weights as used (the
    dequant+cuBLAS path rounds them to bf16: 2^-9)."""
    ref, mag = exact
    bound = 2.0**-8 * ref.abs() + weight_rounding * mag
    bad = ((y.double() - ref).abs() > bound) | ~torch.isfinite(y)
    if bad.any():
        raise AssertionError(f"{int(bad.sum())} elements outside the bound")


def _label(kw: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in kw.items()) or "rule"


def _pct(floor_bytes: float, us: float, ceiling: float) -> float:
    return 100 * floor_bytes / (us * 1e-6) / 1e9 / ceiling


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions")
    parser.add_argument("--sweep", action="store_true", help="time the candidate launch shapes (tuning)")
    parser.add_argument("--json", default=None, help="also write the rows as JSON to this path")
    parser.add_argument("--shapes", default=None, help="comma-separated shape names to run (default: all)")
    parser.add_argument("--rows", default=None, help="comma-separated M values (default: 1,4,16 with --sweep)")
    parser.add_argument("--apply", default=None, metavar="SWEEP.json", help="write a sweep's winners as defaults")
    parser.add_argument("--candidates", default=None, help="--sweep: comma-separated indices into CANDIDATES")
    args = parser.parse_args(argv)
    if args.apply:
        return apply_tuned(args.apply)
    if not torch.cuda.is_available():
        print("bench_fp8_linear: CUDA is not available; nothing to benchmark.")
        return 0
    from trtllm_glm.quant import dequantize_block_fp8, quantize_block_fp8
    from trtllm_glm.quant.ops import fp8_dequantize_triton, fp8_linear_triton, kernel_module

    def dequant_cublas(x: torch.Tensor, q: torch.Tensor, s: torch.Tensor, out: torch.Tensor) -> None:
        """The prefill path of `fp8_linear` (rows >= `dequant_min_rows`): dequantise, then cuBLAS."""
        torch.matmul(x, fp8_dequantize_triton(q, s, BLOCK, x.dtype).T, out=out)

    dev = torch.device("cuda")
    props = torch.cuda.get_device_properties(dev)
    ceiling = copy_ceiling_gbs(dev, args.quick)
    print(f"device: {props.name}; torch {torch.__version__}; triton {triton.__version__}; "
          f"L2 {props.L2_cache_size / 2**20:.0f} MiB; copy ceiling {ceiling:.0f} GB/s")  # fmt: skip
    reps = 10 if args.quick else 30
    mod = kernel_module(dev)
    row_ms = [int(v) for v in args.rows.split(",")] if args.rows else list(SWEEP_ROWS if args.sweep else ROWS)
    rows: list[dict] = []
    failed = 0
    g = torch.Generator(device=dev).manual_seed(0)
    pick = set(args.shapes.split(",")) if args.shapes else None
    cands = [CANDIDATES[int(i)] for i in args.candidates.split(",")] if args.candidates else CANDIDATES
    for name, n, k in SHAPES:
        if pick is not None and name not in pick:
            continue
        w_bytes = n * k + math.ceil(n / BLOCK) * math.ceil(k / BLOCK) * 4
        copies = max(4, min(256, math.ceil(2.5 * props.L2_cache_size / w_bytes)))
        w0 = torch.randn(n, k, device=dev, generator=g) * k**-0.5
        q0, s0 = quantize_block_fp8(w0, BLOCK)
        deq = dequantize_block_fp8(q0, s0, BLOCK)
        del w0
        qs = [(q0.clone(), s0.clone()) for _ in range(copies)]
        bf = [deq.to(torch.bfloat16) for _ in range(max(4, copies // 2))]
        for m in row_ms:
            xs = [torch.randn(m, k, device=dev, generator=g).to(torch.bfloat16) for _ in range(copies)]
            ys = [torch.empty(m, n, device=dev, dtype=torch.bfloat16) for _ in range(copies)]
            floor_bytes = w_bytes + m * k * 2 + m * n * 2
            floor_us = floor_bytes / (ceiling * 1e9) * 1e6
            case = f"{name} [{n}, {k}] M={m}"
            exact = _exact(xs[0], deq)
            rule = mod.launch_config(m, n, k, BLOCK, False, tuned=False)
            row: dict = {"name": name, "n": n, "k": k, "m": m, "copies": copies, "floor_bytes": floor_bytes,
                         "floor_us": floor_us, "class": mod.shape_class(n, k),
                         "default_config": vars(mod.launch_config(m, n, k, BLOCK, False)),
                         "variants": {}}  # fmt: skip
            t_bf16 = graph_us([partial(F.linear, x, w) for x, w in zip(xs, bf * copies)], reps)
            row["bf16_us"] = t_bf16
            print(f"  {case:<36} bf16 cuBLAS                      graph {t_bf16:8.2f} us", flush=True)
            if args.sweep:
                # What any kernel costs at this size: an empty launch with the rule's grid, and a copy moving the
                # floor's bytes, both from HBM (C distinct buffers) like the kernel's calls.
                grid = (triton.cdiv(n, rule.block_n), rule.split, triton.cdiv(m, rule.block_m))
                row["launch_us"] = graph_us([partial(_empty_kernel[grid], ys[0], 1) for _ in range(copies)], reps)
                half = max(1, floor_bytes // 2)
                bufs = [(torch.empty(half, dtype=torch.uint8, device=dev), torch.empty(half, dtype=torch.uint8,
                         device=dev)) for _ in range(copies)]  # fmt: skip
                row["copy_us"] = graph_us([partial(d.copy_, c) for c, d in bufs], reps)
                del bufs
                lp, cp = _pct(floor_bytes, row["launch_us"], ceiling), _pct(floor_bytes, row["copy_us"], ceiling)
                print(f"  {case:<36} {'empty launch / copy of the bytes':<32} graph {row['launch_us']:8.2f} / "
                      f"{row['copy_us']:.2f} us  ({lp:.0f}% / {cp:.0f}% of the copy ceiling)", flush=True)  # fmt: skip
            variants: list[tuple[str, dict | None]] = [("default", {})]
            if args.sweep and m <= 16:
                variants += [(_label(kw), dict(kw, tuned=False)) for kw in [{}] + cands]
            elif args.sweep:
                variants += [(_label(kw), dict(kw, tuned=False)) for kw in SWEEP_LARGE]
            if m >= 16:
                variants.append(("dequant+cuBLAS", None))
            seen: dict[object, str] = {}  # resolved configs (hashable) -> first label
            for label, kw in variants:
                if kw is not None and label != "default":
                    knobs = {a: b for a, b in kw.items() if a != "tuned"}
                    cfg = mod.launch_config(m, n, k, BLOCK, False, tuned=False, **knobs)
                    if cfg in seen:  # the same launch as an earlier candidate: not timed again
                        row["variants"][label] = {"same_as": seen[cfg]}
                        continue
                    seen[cfg] = label
                fn = partial(fp8_linear_triton, **kw) if kw is not None else None
                try:
                    ys[0].fill_(float("nan"))
                    if fn is None:
                        dequant_cublas(xs[0], qs[0][0], qs[0][1], ys[0])
                        calls = [partial(dequant_cublas, x, q, s, y) for x, (q, s), y in zip(xs, qs, ys)]
                    else:
                        fn(xs[0], qs[0][0], qs[0][1], BLOCK, out=ys[0])
                        calls = [partial(fn, x, q, s, BLOCK, out=y) for x, (q, s), y in zip(xs, qs, ys)]
                    _check(ys[0], exact, 2.0**-8 if fn is None else 1e-5)
                    t = graph_us(calls, reps)
                    res = {"graph_us": t, "gbps": floor_bytes / (t * 1e-6) / 1e9}
                    res["pct_copy"] = 100 * res["gbps"] / ceiling
                    res["x_floor"] = t / floor_us
                    res["vs_bf16"] = t_bf16 / t
                    print(f"  {case:<36} {label:<32} graph {t:8.2f} us  {res['gbps']:6.0f} GB/s "
                          f"{res['pct_copy']:5.1f}% copy  x{res['x_floor']:5.2f} floor  "
                          f"{res['vs_bf16']:5.2f}x bf16", flush=True)  # fmt: skip
                except Exception as e:  # noqa: BLE001 - reported, reflected in the exit code
                    failed += 1
                    res = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
                    print(f"  {case:<36} {label:<32} FAILED {res['error']}", flush=True)
                row["variants"][label] = res
            rows.append(row)
            del xs, ys, exact
            if args.json:  # after every case, so that a run cut short keeps what it measured
                _write_json(args.json, props.name, ceiling, rows)
        del qs, bf, deq
        torch.cuda.empty_cache()

    print()
    head = (f"{'case':<36} {'fp8 us':>8} {'bf16 us':>8} {'vs bf16':>7} {'GB/s':>6} {'%copy':>6} {'x floor':>7} "
            f"{'best variant':>40}")  # fmt: skip
    print(head)
    print("-" * len(head))
    for r in rows:
        d = r["variants"].get("default", {})
        swept = [(k, v) for k, v in r["variants"].items() if k != "default" and "graph_us" in v]
        best = min(swept, key=lambda kv: kv[1]["graph_us"], default=None)
        best_s = f"{best[0]} {best[1]['graph_us']:.2f} ({best[1]['pct_copy']:.0f}%)" if best else "-"
        case = f"{r['name']} [{r['n']}, {r['k']}] M={r['m']}"
        if "graph_us" not in d:
            print(f"{case:<36} FAILED")
            continue
        print(f"{case:<36} {d['graph_us']:8.2f} {r['bf16_us']:8.2f} {d['vs_bf16']:7.2f} {d['gbps']:6.0f} "
              f"{d['pct_copy']:6.1f} {d['x_floor']:7.2f} {best_s:>40}")  # fmt: skip
    small = [r for r in rows if r["m"] <= 16 and "pct_copy" in r["variants"].get("default", {})]
    if small:
        pcts = [r["variants"]["default"]["pct_copy"] for r in small]
        worst = min(small, key=lambda r: r["variants"]["default"]["pct_copy"])
        print(f"[goal] default, M <= 16: {sum(p >= 80 for p in pcts)}/{len(pcts)} cases at >= 80% of the copy "
              f"ceiling (mean {sum(pcts) / len(pcts):.1f}%, worst {worst['name']} M={worst['m']} "
              f"{worst['variants']['default']['pct_copy']:.1f}%)")  # fmt: skip
    tuned: dict = {}
    if args.sweep:
        tuned = summarize_sweep(rows, ceiling)
    if args.json:
        _write_json(args.json, props.name, ceiling, rows, tuned)
    if failed:
        print(f"{failed} variant(s) failed")
    return 1 if failed else 0


def _time(r: dict, label: str) -> float | None:
    """``label``'s graph time in row ``r``, following ``same_as`` links; None if absent or failed."""
    v = r["variants"].get(label)
    if v is not None and "same_as" in v:
        v = r["variants"].get(v["same_as"])
    return v.get("graph_us") if v else None


def _knobs(label: str) -> dict:
    """The candidate's knob dict (from `CANDIDATES`) for a label; ``{}`` for the rule."""
    for kw in CANDIDATES:
        if _label(kw) == label:
            return dict(kw)
    return {}


def _best(rows: list[dict], labels: list[str]) -> tuple[str, float] | None:
    """The candidate with the least time summed over ``rows`` (timed in all of them)."""
    totals = []
    for lab in labels:
        ts = [_time(r, lab) for r in rows]
        if all(t is not None for t in ts):
            totals.append((lab, sum(ts)))
    return min(totals, key=lambda lt: lt[1], default=None)


def summarize_sweep(rows: list[dict], ceiling: float) -> dict:
    """Print the per-shape and per-class winners (one launch shape for all rows of a shape) and the bytes-weighted
    % of the copy ceiling; return ``{"tuned_shapes": [[n, k, knobs], ..], "tuned_classes": {cls: knobs}}``."""
    sweep_rows = [r for r in rows if r["m"] <= 16]
    labels = ["rule"] + [_label(kw) for kw in CANDIDATES]
    # Keyed by the weight's shape (the tables' key): two names with one shape (kda.o_proj, mtp.eh_proj) pool rows.
    shapes: dict[tuple[int, int], list[dict]] = {}
    names: dict[tuple[int, int], list[str]] = {}
    for r in sweep_rows:
        shapes.setdefault((r["n"], r["k"]), []).append(r)
        if r["name"] not in names.setdefault((r["n"], r["k"]), []):
            names[(r["n"], r["k"])].append(r["name"])
    win_shape: dict[tuple[int, int], str] = {}
    print()
    print("sweep: per shape, the launch shape with the least time summed over its rows (M-independent)")
    head = f"{'shape':<32} {'class':<5} {'MB':>6} {'winner':<44} {'% copy per M (winner / default / launch / copy)'}"
    print(head)
    print("-" * len(head))
    for (n, k), rs in shapes.items():
        name = ", ".join(names[(n, k)])
        best = _best(rs, labels)
        if best is None:
            print(f"{name:<32} no candidate timed at every row")
            continue
        win_shape[(n, k)] = best[0]
        per_m = []
        for r in rs:
            fb = r["floor_bytes"]
            parts = [_time(r, best[0]), _time(r, "default"), r.get("launch_us"), r.get("copy_us")]
            tag = f"{r['name'].split('.')[0]} M={r['m']}" if len(names[(n, k)]) > 1 else f"M={r['m']}"
            per_m.append(tag + ": " + " / ".join(f"{_pct(fb, t, ceiling):.0f}" if t else "-" for t in parts))
        print(f"{name + f' [{n}, {k}]':<32} {rs[0]['class']:<5} {n * k / 1e6:6.1f} {best[0]:<44} {'; '.join(per_m)}")
    classes: dict[str, list[dict]] = {}
    for r in sweep_rows:
        classes.setdefault(r["class"], []).append(r)
    win_class: dict[str, str] = {}
    for cls, rs in classes.items():
        best = _best(rs, labels)
        if best is not None:
            win_class[cls] = best[0]
            print(f"class {cls:<5}: {best[0]}")

    def agg(rs: list[dict], pick) -> str:
        ts = [pick(r) for r in rs]
        if not rs or any(t is None for t in ts):
            return "   -  "
        return f"{_pct(sum(r['floor_bytes'] for r in rs), sum(ts), ceiling):5.1f}%"

    print()
    print("bytes-weighted % of the copy ceiling (sum of floor bytes / sum of times), M in "
          f"{sorted({r['m'] for r in sweep_rows})}:")  # fmt: skip
    print(f"{'cases':<28} {'default':>8} {'rule':>8} {'shape winners':>14} {'class winners':>14} {'best per M':>11} "
          f"{'empty launch':>13} {'copy':>8}")  # fmt: skip

    def best_any(r: dict) -> float | None:  # an M-dependent choice (not allowed: the headroom it would add)
        ts = [t for t in (_time(r, lab) for lab in labels) if t is not None]
        return min(ts, default=None)

    groups = [("tiny (launch-bound)", [r for r in sweep_rows if r["class"] == "tiny"]),
              ("small + large", [r for r in sweep_rows if r["class"] != "tiny"]), ("all", sweep_rows)]  # fmt: skip
    for gname, rs in groups:
        print(f"{gname:<28} {agg(rs, lambda r: _time(r, 'default')):>8} {agg(rs, lambda r: _time(r, 'rule')):>8} "
              f"{agg(rs, lambda r: _time(r, win_shape.get((r['n'], r['k']), '?'))):>14} "
              f"{agg(rs, lambda r: _time(r, win_class.get(r['class'], '?'))):>14} {agg(rs, best_any):>11} "
              f"{agg(rs, lambda r: r.get('launch_us')):>13} {agg(rs, lambda r: r.get('copy_us')):>8}")  # fmt: skip
    goal = [r for r in sweep_rows if r["class"] != "tiny" and (r["n"], r["k"]) in win_shape]
    hit = sum(_pct(r["floor_bytes"], _time(r, win_shape[(r["n"], r["k"])]), ceiling) >= 80 for r in goal)
    print(f"[goal] shape winners, non-tiny shapes: {hit}/{len(goal)} cases at >= 80% of the copy ceiling")
    tuned = {
        "tuned_shapes": [[n, k, _knobs(lab)] for (n, k), lab in win_shape.items() if lab != "rule"],
        "tuned_classes": {cls: _knobs(lab) for cls, lab in win_class.items() if lab != "rule"},
    }
    print()
    print("tables for trtllm_glm/quant/kernels.py (`--apply SWEEP.json` writes them):")
    print(_render_tables(tuned))
    return tuned


def _render_tables(tuned: dict) -> str:
    """The Python of the tuned tables (between kernels.py's markers)."""

    def lit(kw: dict) -> str:
        return "{" + ", ".join(f'"{k}": {v!r}' for k, v in kw.items()) + "}"

    lines = ["_TUNED_SHAPES: dict[tuple[int, int], dict[str, int | bool]] = {"]
    for n, k, kw in tuned.get("tuned_shapes", []):
        lines.append(f"    ({n}, {k}): {lit(kw)},")
    lines.append("}")
    lines.append("_TUNED_CLASSES: dict[str, dict[str, int | bool]] = {")
    for cls, kw in tuned.get("tuned_classes", {}).items():
        lines.append(f'    "{cls}": {lit(kw)},')
    lines.append("}")
    return "\n".join(lines)


KERNELS_PY = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "trtllm_glm", "quant",
                          "kernels.py")  # fmt: skip


def apply_tuned(path: str, kernels_py: str = KERNELS_PY) -> int:
    """Write the winners of a ``--sweep --json`` run into the tuned tables of ``kernels_py`` (between
    ``# BEGIN TUNED`` and ``# END TUNED``); knobs outside `kernels.TUNABLE` are refused."""
    from trtllm_glm.quant.kernels import TUNABLE

    with open(path) as f:
        tuned = json.load(f).get("tuned")
    if not tuned:
        print(f"bench_fp8_linear: {path} holds no sweep winners (run --sweep --json)")
        return 1
    for kw in [e[2] for e in tuned["tuned_shapes"]] + list(tuned["tuned_classes"].values()):
        bad = set(kw) - set(TUNABLE)
        if bad:
            raise ValueError(f"unknown knobs {sorted(bad)} in {path}")
    with open(kernels_py) as f:
        src = f.read()
    begin, end = "# BEGIN TUNED\n", "# END TUNED\n"
    i, j = src.index(begin) + len(begin), src.index(end)
    with open(kernels_py, "w") as f:
        f.write(src[:i] + _render_tables(tuned) + "\n" + src[j:])
    print(f"bench_fp8_linear: wrote {len(tuned['tuned_shapes'])} shape and {len(tuned['tuned_classes'])} class "
          f"entries into {kernels_py}")  # fmt: skip
    return 0


def _write_json(path: str, device: str, ceiling: float, rows: list[dict], tuned: dict | None = None) -> None:
    write_json(path, {"device": device, "copy_gbps": ceiling, "rows": rows, "tuned": tuned or {}})


if __name__ == "__main__":
    sys.exit(main())
