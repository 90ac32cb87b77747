"""The MoE router's top-k: a full stable sort of every expert score against `stable_topk_indices`.

Both give the same ids (tests/unittest/test_ffn.py); this times them per call in a CUDA graph (median of
replays of 20 calls) at the real geometry (288 experts, top 8) for decode and verify row counts. A decode
step of the real model runs one per MoE layer (42 of them). JSON lines to stdout.

Usage: ``python benchmarks/bench_router_topk.py [--rows 1 16 64 256]``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_sparse_kernels import graph_us  # noqa: E402

from trtllm_glm.modules.ffn import stable_topk_indices  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64, 256])
    ap.add_argument("--experts", type=int, default=288)
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--reps", type=int, default=50)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs CUDA")
    g = torch.Generator(device="cuda").manual_seed(0)
    for n in args.rows:
        v = torch.sigmoid(torch.randn(n, args.experts, device="cuda", generator=g)) + 0.01 * torch.randn(
            args.experts, device="cuda", generator=g
        )
        ref = torch.sort(v, dim=-1, descending=True, stable=True).indices[:, : args.k]
        same = bool(torch.equal(stable_topk_indices(v, args.k), ref))
        sort_us = graph_us([lambda v=v: torch.sort(v, dim=-1, descending=True, stable=True).indices[:, : args.k]]
                           * 20, args.reps)  # fmt: skip
        topk_us = graph_us([lambda v=v: stable_topk_indices(v, args.k)] * 20, args.reps)
        print(json.dumps({"rows": n, "experts": args.experts, "k": args.k, "sort_us": round(sort_us, 2),
                          "stable_topk_us": round(topk_us, 2), "speedup": round(sort_us / topk_us, 2),
                          "same_ids": same}), flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
