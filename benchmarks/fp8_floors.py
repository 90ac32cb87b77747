"""Bytes floors of a decode step, bf16 against block-FP8 weights, without a GPU (the model is built on the meta device).

The floors are `bench_e2e.floor_bytes` (what a step must read: dense weights once, the experts its rows reach, KDA
states, sparse-MLA rows) divided by a copy ceiling (default: the H200's measured 4,256 GB/s), for GLM-5.3-Flash cut
to ``--layers`` trunk layers, with ``lm_head`` kept in bf16 (as a block-FP8 checkpoint ships it) or quantised too
(``--fp8-skip none``). Their ratio bounds the FP8 step over the bf16 step (issue 28's batch-1 goal is 0.6x).

Usage: ``python -m benchmarks.fp8_floors --layers 4 45 --batch 1 16``.
"""

from __future__ import annotations

import argparse
import json

import torch

from benchmarks.harness.floors import floor_bytes
from trtllm_glm.config import Glm5NextConfig, QuantConfig
from trtllm_glm.models.glm5_next import Glm5NextForCausalLM, subset_config


def floors(layers: int, batch: int, skip: list[str], context: int, preset: str, ceiling_gbs: float) -> dict:
    """``{"bf16_ms", "fp8_ms", "ratio", "lm_head_share_fp8"}`` of a plain decode step of ``batch`` rows."""
    full = Glm5NextConfig.from_pretrained(preset)
    cfg = subset_config(full, list(range(min(layers, full.num_hidden_layers))))
    with torch.device("meta"):
        m = Glm5NextForCausalLM(cfg)
    m = m.to(torch.bfloat16)
    m.keep_fp32_params_()
    bf16 = floor_bytes(cfg, m, batch, batch, context)
    m.quantize_fp8_(QuantConfig.block_fp8(128, skip))
    fp8 = floor_bytes(cfg, m, batch, batch, context)
    head = m.lm_head.weight.numel() * m.lm_head.weight.element_size()
    ms = lambda b: b / (ceiling_gbs * 1e9) * 1e3  # noqa: E731
    return {"layers": len(cfg.layer_types), "batch": batch, "fp8_skip": skip, "bf16_ms": ms(bf16), "fp8_ms": ms(fp8),
            "ratio": fp8 / bf16, "lm_head_share_fp8": head / fp8}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="glm-5.3-flash")
    ap.add_argument("--layers", type=int, nargs="+", default=[4, 45])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--context", type=int, default=288, help="tokens per request (bench_e2e: prompt 256 + gen 32)")
    ap.add_argument("--ceiling-gbs", type=float, default=4256.0, help="copy ceiling (H200, measured 2026-12-04)")
    ap.add_argument("--fp8-skip", nargs="+", default=None, help="one case; 'none': lm_head in FP8 (default: both)")
    args = ap.parse_args(argv)
    skips = [["lm_head"], []] if args.fp8_skip is None else [[] if args.fp8_skip == ["none"] else args.fp8_skip]
    for layers in args.layers:
        for skip in skips:
            for batch in args.batch:
                row = floors(layers, batch, skip, args.context, args.preset, args.ceiling_gbs)
                digits = {"bf16_ms": 4, "fp8_ms": 4, "ratio": 3, "lm_head_share_fp8": 3}
                print(json.dumps({k: round(v, digits[k]) if k in digits else v for k, v in row.items()}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
