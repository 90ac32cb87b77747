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

    PYTHONPATH=. python benchmarks/bench_fp8_linear.py [--quick] [--sweep] [--json PATH]

``--sweep`` also times other launch shapes (``split_k``, ``block_n``, ``num_warps``, ``num_stages``, ``block_k``)
per case; the summary names the best. Without CUDA it prints a message and exits 0.
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

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_sparse_kernels import _copy_ceiling, graph_us  # noqa: E402

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
BLOCK = 128
SWEEP: list[dict] = [
    dict(split_k=1),
    dict(split_k=2),
    dict(split_k=4),
    dict(split_k=8),
    dict(split_k=16),
    dict(block_n=32),
    dict(block_n=32, split_k=4),
    dict(block_n=64, split_k=8),
    dict(num_warps=8),
    dict(num_warps=2),
    dict(num_stages=3),
    dict(num_stages=6),
    dict(block_k=64),
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


def _check(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, weight_rounding: float = 1e-5) -> None:
    """``y`` against ``x @ w^T`` in fp64; ``weight_rounding``: the relative error of the weights as used (the
    dequant+cuBLAS path rounds them to bf16: 2^-9)."""
    ref = x.double() @ w.double().T
    bound = 2.0**-8 * ref.abs() + weight_rounding * (x.double().abs() @ w.double().abs().T)
    bad = ((y.double() - ref).abs() > bound) | ~torch.isfinite(y)
    if bad.any():
        raise AssertionError(f"{int(bad.sum())} elements outside the bound")


def _label(kw: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in kw.items()) or "default"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions")
    parser.add_argument("--sweep", action="store_true", help="also time other launch shapes")
    parser.add_argument("--json", default=None, help="also write the rows as JSON to this path")
    parser.add_argument("--shapes", default=None, help="comma-separated shape names to run (default: all)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_fp8_linear: CUDA is not available; nothing to benchmark.")
        return 0
    import triton

    from trtllm_glm.quant import dequantize_block_fp8, quantize_block_fp8
    from trtllm_glm.quant.ops import fp8_dequantize_triton, fp8_linear_triton, kernel_module

    def dequant_cublas(x: torch.Tensor, q: torch.Tensor, s: torch.Tensor, out: torch.Tensor) -> None:
        """The prefill path of `fp8_linear` (rows >= `dequant_min_rows`): dequantise, then cuBLAS."""
        torch.matmul(x, fp8_dequantize_triton(q, s, BLOCK, x.dtype).T, out=out)

    dev = torch.device("cuda")
    props = torch.cuda.get_device_properties(dev)
    ceiling = _copy_ceiling(dev, args.quick)
    print(f"device: {props.name}; torch {torch.__version__}; triton {triton.__version__}; "
          f"L2 {props.L2_cache_size / 2**20:.0f} MiB; copy ceiling {ceiling:.0f} GB/s")  # fmt: skip
    reps = 10 if args.quick else 30
    mod = kernel_module(dev)
    rows: list[dict] = []
    failed = 0
    g = torch.Generator(device=dev).manual_seed(0)
    pick = set(args.shapes.split(",")) if args.shapes else None
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
        for m in ROWS:
            xs = [torch.randn(m, k, device=dev, generator=g).to(torch.bfloat16) for _ in range(copies)]
            ys = [torch.empty(m, n, device=dev, dtype=torch.bfloat16) for _ in range(copies)]
            floor_bytes = w_bytes + m * k * 2 + m * n * 2
            floor_us = floor_bytes / (ceiling * 1e9) * 1e6
            case = f"{name} [{n}, {k}] M={m}"
            row: dict = {"name": name, "n": n, "k": k, "m": m, "copies": copies, "floor_bytes": floor_bytes,
                         "floor_us": floor_us, "default_config": vars(mod.launch_config(m, n, k, BLOCK, False)),
                         "variants": {}}  # fmt: skip
            t_bf16 = graph_us([partial(F.linear, x, w) for x, w in zip(xs, bf * copies)], reps)
            row["bf16_us"] = t_bf16
            print(f"  {case:<36} bf16 cuBLAS                      graph {t_bf16:8.2f} us", flush=True)
            sweep = (SWEEP if m <= 16 else SWEEP_LARGE) if args.sweep else []
            variants: list[dict | None] = [{}] + sweep + ([None] if m >= 16 else [])
            for kw in variants:
                label = _label(kw) if kw is not None else "dequant+cuBLAS"
                fn = partial(fp8_linear_triton, **kw) if kw is not None else None
                try:
                    ys[0].fill_(float("nan"))
                    if fn is None:
                        dequant_cublas(xs[0], qs[0][0], qs[0][1], ys[0])
                        calls = [partial(dequant_cublas, x, q, s, y) for x, (q, s), y in zip(xs, qs, ys)]
                    else:
                        fn(xs[0], qs[0][0], qs[0][1], BLOCK, out=ys[0])
                        calls = [partial(fn, x, q, s, BLOCK, out=y) for x, (q, s), y in zip(xs, qs, ys)]
                    _check(ys[0], xs[0], deq, 2.0**-8 if fn is None else 1e-5)
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
            del xs, ys
            if args.json:  # after every case, so that a run cut short keeps what it measured
                _write_json(args.json, props.name, ceiling, rows)
        del qs, bf, deq
        torch.cuda.empty_cache()

    print()
    head = (f"{'case':<36} {'fp8 us':>8} {'bf16 us':>8} {'vs bf16':>7} {'GB/s':>6} {'%copy':>6} {'x floor':>7} "
            f"{'best sweep':>34}")  # fmt: skip
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
              f"{d['pct_copy']:6.1f} {d['x_floor']:7.2f} {best_s:>34}")  # fmt: skip
    small = [r for r in rows if r["m"] <= 16 and "pct_copy" in r["variants"].get("default", {})]
    if small:
        pcts = [r["variants"]["default"]["pct_copy"] for r in small]
        worst = min(small, key=lambda r: r["variants"]["default"]["pct_copy"])
        print(f"[goal] M <= 16: {sum(p >= 80 for p in pcts)}/{len(pcts)} cases at >= 80% of the copy ceiling "
              f"(mean {sum(pcts) / len(pcts):.1f}%, worst {worst['name']} M={worst['m']} "
              f"{worst['variants']['default']['pct_copy']:.1f}%)")  # fmt: skip
    if args.json:
        _write_json(args.json, props.name, ceiling, rows)
    if failed:
        print(f"{failed} variant(s) failed")
    return 1 if failed else 0


def _write_json(path: str, device: str, ceiling: float, rows: list[dict]) -> None:
    with open(path, "w") as f:
        json.dump({"device": device, "copy_gbps": ceiling, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
