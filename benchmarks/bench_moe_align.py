"""Benchmark of the MoE pair sorting (`trtllm_glm.moe.kernels.moe_align`) alone, at the real expert count.

E = 288 experts, top-8, N in {1, 8, 16, 64, 128} rows (uniform random routing, distinct experts per row),
with and without ``row_live`` flags. Times: CUDA-graph replay of ``GRAPH_CALLS`` back-to-back calls divided by
that count (the sort runs on the critical path before the grouped GEMMs of every MoE layer), for the
library's `moe_align` (the register-sort kernel at these sizes), the chunked single-program kernel at two
launch shapes (``num_warps``, pairs per chunk; the one the library used before, 64 / 8) and the torch ops of
`trtllm_glm.moe.ops.moe_align`. Every variant is checked to give the reference's layout first.

Usage (CUDA machine, repository root)::

    PYTHONPATH=. python3 benchmarks/bench_moe_align.py [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from functools import partial

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_sparse_kernels import graph_us  # noqa: E402

ROWS = (1, 8, 16, 64, 128)
GRAPH_CALLS = 20
E, TOP_K = 288, 8


def _launch(ids: torch.Tensor, live: torch.Tensor | None, block_m: int, chunk: int, num_warps: int, bufs):
    """One `_align_kernel` launch with an explicit launch shape (the library's wrapper fixes it)."""
    import triton

    from trtllm_glm.moe import kernels as K

    sorted_pairs, block_expert, cursor = bufs
    p = ids.numel()
    K._align_kernel[(1,)](
        ids,
        live if live is not None else ids,
        sorted_pairs,
        block_expert,
        cursor,
        p,
        TOP_K,
        E,
        sorted_pairs.numel(),
        block_expert.numel(),
        HAS_LIVE=live is not None,
        BLOCK_M=block_m,
        BLOCK_E=max(16, triton.next_power_of_2(E)),
        CHUNK=chunk,
        num_warps=num_warps,
    )


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
            slots = R.padded_pairs_bound(n * TOP_K, E, m)
            bufs = (
                torch.empty(slots, dtype=torch.int32, device=dev),
                torch.empty(slots // m, dtype=torch.int32, device=dev),
                torch.empty(E, dtype=torch.int32, device=dev),
            )
            variants = [("torch ops", partial(R.moe_align, ids, E, m, live)),
                        ("moe_align (register sort)", partial(K.moe_align, ids, E, m, live))]  # fmt: skip
            for chunk, nw in ((32, 4), (64, 8)):
                variants.append((f"chunked {chunk} w={nw}", partial(_launch, ids, live, m, chunk, nw, bufs)))
            for name, call in variants:
                call()
                got = call() if not name.startswith("chunked") else (bufs[0], bufs[1])
                ok = all(torch.equal(a, b) for a, b in zip(got, want))
                us = graph_us([call] * GRAPH_CALLS, 20)
                tag = "all live" if live is None else "3/8 live"
                rows.append({"n": n, "live": tag, "variant": name, "us": us, "layout_ok": ok})
                print(f"N={n:<4} {tag:<9} {name:<27} {us:7.2f} us  {'ok' if ok else 'LAYOUT MISMATCH'}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
