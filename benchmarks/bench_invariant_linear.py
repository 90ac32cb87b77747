"""Benchmark of the batch-invariant mode's GEMMs (docs/numerics.md) at GLM-5.3-Flash's real shapes, against what
the default mode runs for the same call.

Per weight shape ``[N, K]`` (the model's projections after `fuse_weights`, the LM head, the router) and
``M`` in {1, 4, 16, 64, 256, 2048}:

* ``bf16 cuBLAS``: ``F.linear`` (the default mode's float projection);
* ``invariant bm=B gG``: `trtllm_glm.linear.invariant_linear_triton` with row tile ``B`` (16, 32, 64; the
  kernel's default is `INVARIANT_BLOCK_M`) and ``G`` weight tiles per program beyond one row tile (1, 4: the
  same bits; `INVARIANT_GROUP_N`), checked row-invariant (rows 0..M-1 against the same rows of a 200-row call)
  and against the fp64 product before it is timed;
* with ``--fp8``: ``fp8 default`` (`fp8_linear`) and ``fp8 invariant`` (`fp8_linear_invariant`: 64-row launches).

Each time is the replay of a CUDA graph of ``C`` calls over ``C`` weight copies (together ~2.5x the L2, so each
call reads its weight from HBM as a decode step does) divided by ``C``, median of several replays. The summary
prints, per M, the geometric mean of invariant / default over the shapes: the mode's GEMM cost factor.

Usage (on a CUDA machine, from the repository root)::

    python -m benchmarks.bench_invariant_linear [--quick] [--fp8] [--json PATH]
    python -m benchmarks.bench_invariant_linear --sweep --json SWEEP.json   # launch shapes
    python -m benchmarks.bench_invariant_linear --apply SWEEP.json          # winners -> defaults

``--sweep`` times every launch shape of `SWEEP_SPLITS` x `SWEEP_BLOCK_K` x `SWEEP_STAGES` x `SWEEP_WARPS` per
16-bit weight shape at M = 1 and 16 with the default row tile (the rule alone, ``tuned=False``, is ``rule``), each
checked row-invariant and against the fp64 product first, next to cuBLAS and to a device copy of the weight's bytes
(``floor / 2`` read, ``floor / 2`` written) as graphs of ``C`` calls like the kernel: the copy ceiling at that size.
Per shape the winner is the launch shape with the least time summed over the two M (a launch shape may not depend
on M); ``--apply`` writes the winners into ``_TUNED_SHAPES`` of ``trtllm_glm/linear/kernels.py`` (between its
``BEGIN TUNED`` / ``END TUNED`` markers; no CUDA needed).

Without CUDA it prints a message and exits 0.
"""

from __future__ import annotations

import argparse
import json
import math
import os
from functools import partial

import torch
import torch.nn.functional as F

from benchmarks.harness.rows import write_json
from benchmarks.harness.timing import graph_us

SHAPES: list[tuple[str, int, int]] = [
    ("kda.qkv|f_a|g_a|b", 3 * 8192 + 2 * 128 + 64, 4096),
    ("kda.o_proj", 4096, 8192),
    ("kda.f_b/g_b", 8192, 128),
    ("mla.q_a|kv_a|wk", 1536 + 512 + 128, 4096),
    ("mla.q_b", 64 * 256, 1536),
    ("mla.o_proj", 4096, 64 * 256),
    ("mlp.gate|up", 2 * 12288, 4096),
    ("mlp.down", 4096, 12288),
    ("shared.gate|up", 2 * 2048, 4096),
    ("shared.down", 4096, 2048),
    ("router (fp32 out)", 288, 4096),
    ("lm_head", 154880, 4096),
]
ROWS = (1, 4, 16, 64, 256, 2048)
SWEEP_ROWS = (1, 16)
SWEEP_SPLITS = (None, 1, 2, 4)  # None: the rule (~16 KB of weight per program)
SWEEP_BLOCK_K = (128, 256)
SWEEP_STAGES = (4,)
SWEEP_WARPS = (4, 8)
KERNELS_PY = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "trtllm_glm", "linear", "kernels.py")
BLOCK_MS = (16, 32, 64)
GROUPS = (1, 4)  # weight tiles per program beyond one row tile (prefill rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions, fewer rows")
    parser.add_argument("--fp8", action="store_true", help="also the block-FP8 linear, default vs invariant")
    parser.add_argument("--json", default=None, help="also write the rows as JSON to this path")
    parser.add_argument("--sweep", action="store_true", help="time launch shapes per weight (see the docstring)")
    parser.add_argument("--apply", default=None, metavar="SWEEP.json", help="write a sweep's winners as defaults")
    args = parser.parse_args(argv)
    if args.apply:
        return apply_tuned(args.apply)
    if not torch.cuda.is_available():
        print("bench_invariant_linear: CUDA is not available; nothing to benchmark.")
        return 0
    from trtllm_glm.linear import invariant_linear_triton, linear_fp32
    from trtllm_glm.linear.kernels import INVARIANT_BLOCK_M
    from trtllm_glm.quant import quantize_block_fp8
    from trtllm_glm.quant.ops import fp8_linear, fp8_linear_invariant

    dev = torch.device("cuda")
    props = torch.cuda.get_device_properties(dev)
    print(f"device: {props.name}; torch {torch.__version__}; default invariant row tile {INVARIANT_BLOCK_M}")
    if args.sweep:
        return sweep(args.json, props)
    reps = 10 if args.quick else 30
    rows_m = (1, 16, 64, 2048) if args.quick else ROWS
    g = torch.Generator(device=dev).manual_seed(0)
    out: list[dict] = []
    ratios: dict[tuple[int, str], list[float]] = {}
    for name, n, k in SHAPES:
        fp32_out = name.startswith("router")
        w_bytes = n * k * 2
        copies = max(2, min(64, math.ceil(2.5 * props.L2_cache_size / w_bytes)))
        w0 = (torch.randn(n, k, device=dev, generator=g) * k**-0.5).to(torch.bfloat16)
        ws = [w0.clone() for _ in range(copies)]
        x200 = torch.randn(200, k, device=dev, generator=g).to(torch.bfloat16)
        ref200 = {bm: invariant_linear_triton(x200, w0, block_m=bm, group_n=1) for bm in BLOCK_MS}
        held_fp8 = args.fp8 and not fp32_out and name != "lm_head"  # the router and the LM head stay 16-bit
        qs = [quantize_block_fp8(w0.float(), 128) for _ in range(min(copies * 2, 64))] if held_fp8 else []
        for m in rows_m:
            xs = [torch.randn(m, k, device=dev, generator=g).to(torch.bfloat16) for _ in range(copies)]
            row: dict = {"name": name, "n": n, "k": k, "m": m, "copies": copies}
            if fp32_out:
                base = graph_us([partial(linear_fp32, x, w, backend="auto") for x, w in zip(xs, ws)], reps)
            else:
                base = graph_us([partial(F.linear, x, w) for x, w in zip(xs, ws)], reps)
            row["default_us"] = base
            line = f"  {name:<20} [{n:>6}, {k:>5}] M={m:<5} default {base:8.2f} us"
            od = torch.float32 if fp32_out else None
            for bm, gn in [(bm, gn) for bm in BLOCK_MS for gn in GROUPS if gn == 1 or m > bm]:
                y = invariant_linear_triton(x200[: min(m, 200)], w0, block_m=bm, group_n=gn)
                if not torch.equal(y, ref200[bm][: min(m, 200)]):
                    raise AssertionError(f"{name} M={m} bm={bm} g={gn}: rows differ from the 200-row call")
                yf = invariant_linear_triton(xs[0], w0, block_m=bm, group_n=gn, out_dtype=torch.float32).double()
                exact = xs[0].double() @ w0.double().T
                if ((yf - exact).abs() > 1e-5 * (xs[0].double().abs() @ w0.double().abs().T) + 1e-30).any():
                    raise AssertionError(f"{name} M={m} bm={bm} g={gn}: outside the fp32 bound")
                t = graph_us([partial(invariant_linear_triton, x, w, block_m=bm, group_n=gn, out_dtype=od)
                              for x, w in zip(xs, ws)], reps)  # fmt: skip
                row[f"invariant_bm{bm}_g{gn}_us"] = t
                ratios.setdefault((m, f"bm{bm}g{gn}"), []).append(t / base)
                line += f" | bm{bm}g{gn} {t:7.2f} us x{t / base:5.2f}"
            if qs:
                q_calls = list(zip(xs * 2, qs))[: len(qs)]
                t8 = graph_us([partial(fp8_linear, x, q, s, 128) for x, (q, s) in q_calls], reps)
                t8i = graph_us([partial(fp8_linear_invariant, x, q, s, 128) for x, (q, s) in q_calls], reps)
                row.update(fp8_default_us=t8, fp8_invariant_us=t8i)
                ratios.setdefault((m, "fp8"), []).append(t8i / t8)
                line += f" | fp8 {t8:8.2f} -> {t8i:8.2f} us x{t8i / t8:5.2f}"
            print(line, flush=True)
            out.append(row)
    print("geometric mean of invariant / default over the shapes:")
    for (m, kind), rs in sorted(ratios.items()):
        gm = math.exp(sum(math.log(r) for r in rs) / len(rs))
        print(f"  M={m:<5} {kind:<8} x{gm:5.2f}")
    if args.json:
        write_json(args.json, out)
    return 0


def sweep(json_path: str | None, props: torch.cuda._CudaDeviceProperties) -> int:
    """``--sweep``: per 16-bit weight shape, every launch shape at `SWEEP_ROWS` (see the module docstring)."""
    from trtllm_glm.linear import invariant_linear_triton
    from trtllm_glm.linear.kernels import launch_config

    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    cands = [dict(split_k=sp, block_k=bk, num_stages=st, num_warps=nw)
             for sp in SWEEP_SPLITS for bk in SWEEP_BLOCK_K for st in SWEEP_STAGES for nw in SWEEP_WARPS]  # fmt: skip
    rows: list[dict] = []
    tuned: dict[str, dict] = {}
    tot = {"rule": [0.0, 0.0], "winner": [0.0, 0.0], "cublas": [0.0, 0.0], "copy": [0.0, 0.0]}
    for name, n, k in SHAPES:
        if name.startswith("router"):
            continue
        w_bytes = n * k * 2
        copies = max(2, min(64, math.ceil(2.5 * props.L2_cache_size / w_bytes)))
        w0 = (torch.randn(n, k, device=dev, generator=g) * k**-0.5).to(torch.bfloat16)
        ws = [w0.clone() for _ in range(copies)]
        x200 = torch.randn(200, k, device=dev, generator=g).to(torch.bfloat16)
        xs = {m: [torch.randn(m, k, device=dev, generator=g).to(torch.bfloat16) for _ in range(copies)]
              for m in SWEEP_ROWS}  # fmt: skip
        srcs = [torch.empty(w_bytes // 2, dtype=torch.uint8, device=dev) for _ in range(copies)]
        dsts = [torch.empty_like(t) for t in srcs]
        copy_us = graph_us([partial(d.copy_, t) for d, t in zip(dsts, srcs)], 5)
        base = {m: graph_us([partial(F.linear, x, w) for x, w in zip(xs[m], ws)], 5) for m in SWEEP_ROWS}
        rule_cfg = launch_config(n, k, 2, False, tuned=False)
        seen: dict = {}
        for kw in cands:
            kws = {key: v for key, v in kw.items() if v is not None}
            cfg = launch_config(n, k, 2, False, tuned=False, **kws)
            if cfg in seen:
                continue
            ref = invariant_linear_triton(x200, w0, **kws)
            if not torch.equal(invariant_linear_triton(x200[:7], w0, **kws), ref[:7]):
                raise AssertionError(f"{name} {kws}: rows differ from the 200-row call")
            exact = x200.double() @ w0.double().T
            yf = invariant_linear_triton(x200, w0, out_dtype=torch.float32, **kws).double()
            if ((yf - exact).abs() > 1e-5 * (x200.double().abs() @ w0.double().abs().T) + 1e-30).any():
                raise AssertionError(f"{name} {kws}: outside the fp32 bound")
            ts = {m: graph_us([partial(invariant_linear_triton, x, w, **kws) for x, w in zip(xs[m], ws)], 5)
                  for m in SWEEP_ROWS}  # fmt: skip
            seen[cfg] = (kws, ts)
        best_cfg = min(seen, key=lambda c: sum(seen[c][1].values()))
        best_kws, best_ts = seen[best_cfg]
        rule_ts = seen[rule_cfg][1] if rule_cfg in seen else None
        tuned[f"{n},{k}"] = {
            "split_k": best_cfg.split, "block_k": best_cfg.block_k,
            "num_warps": best_cfg.num_warps, "num_stages": best_cfg.num_stages,
        }  # fmt: skip
        for i, m in enumerate(SWEEP_ROWS):
            floor_gbs = w_bytes / (best_ts[m] * 1e-6) / 1e9
            copy_gbs = 2 * (w_bytes // 2) / (copy_us * 1e-6) / 1e9
            line = (
                f"  {name:<20} [{n:>6}, {k:>5}] M={m:<3} cuBLAS {base[m]:8.2f} | rule "
                f"{(rule_ts or {}).get(m, float('nan')):8.2f} | best {best_ts[m]:8.2f} us ({floor_gbs:6.0f} GB/s; "
                f"copy of the bytes {copy_gbs:6.0f} GB/s) x{best_ts[m] / base[m]:5.2f} cuBLAS"
            )
            print(line, flush=True)
            rows.append({
                "name": name, "n": n, "k": k, "m": m, "cublas_us": base[m], "copy_us": copy_us,
                "rule_us": (rule_ts or {}).get(m), "best_us": best_ts[m], "best": tuned[f"{n},{k}"],
            })  # fmt: skip
            tot["winner"][i] += best_ts[m]
            tot["cublas"][i] += base[m]
            tot["copy"][i] += copy_us
            tot["rule"][i] += (rule_ts or best_ts)[m]
        print(f"  -> {name}: {tuned[f'{n},{k}']} ({len(seen)} launch shapes timed)", flush=True)
        if json_path:  # after every shape: a run cut by a time limit keeps the winners found so far
            write_json(json_path, {"device": props.name, "rows": rows, "tuned": tuned})
    for i, m in enumerate(SWEEP_ROWS):
        c, r, w, cp = (tot[key][i] for key in ("cublas", "rule", "winner", "copy"))
        print(f"[sum] M={m}: cuBLAS {c:.1f} us, rule {r:.1f}, winners {w:.1f} (x{w / c:.2f}), copy {cp:.1f}")
    return 0


def apply_tuned(path: str, kernels_py: str = KERNELS_PY) -> int:
    """Write the winners of a ``--sweep --json`` run into ``_TUNED_SHAPES`` of ``kernels_py`` (between
    ``# BEGIN TUNED`` and ``# END TUNED``); knobs outside `kernels.TUNABLE` are refused."""
    from trtllm_glm.linear.kernels import TUNABLE

    with open(path) as f:
        tuned = json.load(f).get("tuned")
    if not tuned:
        print(f"bench_invariant_linear: {path} holds no sweep winners (run --sweep --json)")
        return 1
    lines = ["_TUNED_SHAPES: dict[tuple[int, int], dict[str, int]] = {"]
    for key, kw in tuned.items():
        bad = set(kw) - set(TUNABLE)
        if bad:
            raise ValueError(f"unknown knobs {sorted(bad)} in {path}")
        n, k = (int(v) for v in key.split(","))
        lines.append(f"    ({n}, {k}): {{{', '.join(f'{chr(34)}{a}{chr(34)}: {b}' for a, b in sorted(kw.items()))}}},")
    lines.append("}")
    with open(kernels_py) as f:
        src = f.read()
    begin, end = "# BEGIN TUNED\n", "# END TUNED\n"
    i, j = src.index(begin) + len(begin), src.index(end)
    with open(kernels_py, "w") as f:
        f.write(src[:i] + "\n".join(lines) + "\n" + src[j:])
    print(f"bench_invariant_linear: wrote {len(tuned)} shape entries into {kernels_py}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
