"""Benchmark of the MoE pair sorting (`trtllm_glm.moe.kernels.moe_align`) alone, at the real expert count.

E = 288 experts, top-8, N in {1, 8, 16, 64, 128, 256, 512} rows (uniform random routing, distinct experts
per row), with and without ``row_live`` flags. Times: CUDA-graph replay of ``GRAPH_CALLS`` back-to-back calls
divided by that count (the sort runs on the critical path before the grouped GEMMs of every MoE layer), for
the library's `moe_align` (the register-sort kernel at these sizes: up to 4096 pairs) and the torch ops of
`trtllm_glm.moe.ops.moe_align` (what it runs above that). Both are checked to give the reference's layout
first. ``benchmarks/results/kernels/moe_align_chunked_h200_2026-12-02.log`` also times a chunked single-program
kernel the library had before (removed: slower than the torch ops from 64 rows on).

Usage (CUDA machine, repository root)::

    python -m benchmarks.bench_moe_align [--json PATH]
"""

from __future__ import annotations

import argparse
import sys
from functools import partial

import torch

from benchmarks.harness.rows import write_json
from benchmarks.harness.timing import graph_us

ROWS = (1, 8, 16, 64, 128, 256, 512)
GRAPH_CALLS = 20
E, TOP_K = 288, 8


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_moe_align: CUDA is not available; nothing to benchmark.")
        return 0
    from trtllm_glm.moe import kernels as K
    from trtllm_glm.moe import ops as R

    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    rows = []
    for n in ROWS:
        ids = torch.rand(n, E, device=dev, generator=g).topk(TOP_K, dim=1).indices.to(torch.int32).contiguous()
        m = K.default_block_m(n * TOP_K, E)
        for live in (None, (torch.arange(n, device=dev) % 8 <= 2).to(torch.int64)):
            want = R.moe_align(ids, E, m, live)
            variants = [("torch ops", partial(R.moe_align, ids, E, m, live)),
                        ("moe_align (register sort)", partial(K.moe_align, ids, E, m, live))]  # fmt: skip
            for name, call in variants:
                call()
                got = call()
                ok = all(torch.equal(a, b) for a, b in zip(got, want))
                us = graph_us([call] * GRAPH_CALLS, 20)
                tag = "all live" if live is None else "3/8 live"
                rows.append({"n": n, "live": tag, "variant": name, "us": us, "layout_ok": ok})
                print(f"N={n:<4} {tag:<9} {name:<27} {us:7.2f} us  {'ok' if ok else 'LAYOUT MISMATCH'}", flush=True)
    if args.json:
        write_json(args.json, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
