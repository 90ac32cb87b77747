"""Write a mixed-length serving workload for ``bench_serve.py --workload`` (JSON lines of input / output lengths).

The mix is synthetic and seeded (no data set is downloaded): prompt and output lengths are log-normal, the shape
chat traffic is usually summarised by (a median of a few hundred prompt tokens with a long tail; shorter outputs),
clipped to the ranges below. ``benchmarks/workloads/mixed_chat.jsonl`` is this script's output with its
defaults::

    python -m benchmarks.make_workload --out benchmarks/workloads/mixed_chat.jsonl
"""

from __future__ import annotations

import argparse
import json
import math
import random


def lengths(rng: random.Random, median: float, sigma: float, lo: int, hi: int) -> int:
    """One log-normal length with the given median, clipped to ``[lo, hi]``."""
    return max(lo, min(hi, round(rng.lognormvariate(math.log(median), sigma))))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--requests", type=int, default=400)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--input-median", type=float, default=256)
    ap.add_argument("--input-sigma", type=float, default=1.0)
    ap.add_argument("--input-range", type=int, nargs=2, default=[8, 4096])
    ap.add_argument("--output-median", type=float, default=128)
    ap.add_argument("--output-sigma", type=float, default=0.8)
    ap.add_argument("--output-range", type=int, nargs=2, default=[8, 1024])
    args = ap.parse_args()
    rng = random.Random(args.seed)
    with open(args.out, "w", encoding="utf-8") as f:
        for _ in range(args.requests):
            il = lengths(rng, args.input_median, args.input_sigma, *args.input_range)
            ol = lengths(rng, args.output_median, args.output_sigma, *args.output_range)
            f.write(json.dumps({"input_len": il, "output_len": ol}) + "\n")


if __name__ == "__main__":
    main()
