"""Benchmark of the fused MoE (routed experts) against the per-expert loop at real GLM-5.3-Flash geometry.

One MoE layer of the ``glm-5.3-flash`` preset (H = 4096, I = 2048, E = 288 routed experts, top-8, clamped
SwiGLU), bf16 weights (14.5 GB), routing by the layer's own router on random activations (so the expert
pattern is the router's, with its correction bias), N in {1, 8, 16, 64, 128} rows.

Timings per case:

* ``fused``: replay of a CUDA graph of G back-to-back ``kernels.fused_moe`` calls (sorting, the two grouped
  GEMMs and the combine) divided by G, median of several replays (CUDA events). The touched experts' weights
  (>= 8 x 50 MB) are far beyond the L2, so every call reads them from HBM.
* ``fused eager``: ``triton.testing.do_bench`` of one call (L2 flushed before each; includes launch overhead).
* ``loop``: ``do_bench`` of the per-expert loop `MoE._routed_loop` (host sync, one GatedMLP per expert).

Bytes floor: distinct experts touched x expert bytes (``3 * H * I * 2``) + the activations (``x`` in bf16, the
fp32 output). GB/s = floor bytes / fused time; ``%copy`` against a 1 GiB device-to-device copy measured in the
same run (bytes read + written); ``x floor`` = fused time / (floor bytes at the copy bandwidth). Each case is
checked against the fp32 reference before it is timed.

Usage (on a CUDA machine, from the repository root)::

    PYTHONPATH=. python3 benchmarks/bench_moe.py [--quick] [--sweep] [--json PATH]

Where N is a multiple of 8, a ``live 3k/N`` case times the same call with ``row_live`` flagging rows 3..7 of
every 8 dead (width-8 verify rows whose sequence proposed 2 drafts: the rest is filler); its floor counts the
experts of the live rows only.

``--sweep`` also times the torch pair sorting (``align="torch"``) and other launch shapes (block_n, num_warps,
num_stages) of the fused kernels. Without CUDA it prints a message and exits 0.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict, dataclass
from functools import partial

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_sparse_kernels import _bench, _copy_ceiling, _graph_us  # noqa: E402

ROWS = (1, 8, 16, 64, 128)
GRAPH_CALLS = 10
# Rows per sequence of the dead-row cases (a width-8 verify).
VERIFY_WIDTH = 8


@dataclass
class Row:
    name: str
    n: int
    experts: int
    fused_us: float
    fused_eager_us: float
    loop_us: float | None
    mbytes: float
    gbps: float
    pct_copy: float
    floor_ratio: float
    speedup: float | None
    rel_err: float
    note: str = ""


def _layer(dev: torch.device):
    """One MoE layer of the real geometry, bf16 experts, fp32 router, random weights (std 0.02)."""
    from trtllm_glm.config import Glm5NextConfig
    from trtllm_glm.modules.ffn import MoE

    cfg = Glm5NextConfig.from_pretrained("glm-5.3-flash")
    with torch.device("meta"):
        m = MoE(cfg).to(torch.bfloat16)  # cast on meta: to_empty then allocates bf16 directly
    m.to_empty(device=dev)
    m.gate.float()
    g = torch.Generator(device=dev).manual_seed(0)
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0.0, 0.02, generator=g)
    return m.eval()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions")
    parser.add_argument("--sweep", action="store_true", help="also time other launch shapes")
    parser.add_argument("--no-loop", action="store_true", help="skip the per-expert loop baseline")
    parser.add_argument("--json", default=None, help="also write the rows as JSON to this path")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_moe: CUDA is not available; nothing to benchmark.")
        return 0
    import triton

    from trtllm_glm.moe import kernels as K
    from trtllm_glm.moe import ops as R

    dev = torch.device("cuda")
    print(f"device: {torch.cuda.get_device_name(dev)}; torch {torch.__version__}; triton {triton.__version__}")
    ceiling = _copy_ceiling(dev, args.quick)
    print(f"copy ceiling: {ceiling:.0f} GB/s (read + write)", flush=True)
    m = _layer(dev)
    w13, w2 = m.stacked_expert_weights()
    e, two_i, h = w13.shape
    inter = two_i // 2
    limit = m.swiglu_limit
    expert_bytes = 3 * h * inter * w13.element_size()
    print(f"geometry: H={h} I={inter} E={e} top-{m.top_k}; {expert_bytes / 1e6:.1f} MB per expert", flush=True)
    rows: list[Row] = []
    g = torch.Generator(device=dev).manual_seed(1)
    for n in ROWS:
        x = (torch.randn(n, h, device=dev, generator=g) * 4.0).to(torch.bfloat16)
        with torch.no_grad():
            ids, w = m.gate(x)
        out = torch.empty(n, h, device=dev)
        ref = R.fused_moe_ref(x, ids, w, w13, w2, limit)
        K.fused_moe(x, ids, w, w13, w2, limit, out=out)
        rel = ((out - ref).abs().max() / ref.abs().max()).item()
        configs: list[tuple[str, dict]] = [("default", {})]
        if n % VERIFY_WIDTH == 0:
            # Width-8 verify rows of n / 8 sequences, each with 2 proposed drafts: rows 3..7 are filler.
            live = (torch.arange(n, device=dev) % VERIFY_WIDTH <= 2).to(torch.int64)
            configs.append((f"live {int(live.sum())}/{n}", {"row_live": live}))
        if args.sweep:
            configs.append(("align=torch", {"align": "torch"}))
            for bn in (16, 32, 64, 128):
                for nw, ns in ((4, 3), (4, 4), (8, 3)):
                    kw = {"block_n": (bn, bn), "num_warps": nw, "num_stages": ns}
                    configs.append((f"bn={bn} w={nw} s={ns}", kw))
        loop_us = None
        if not args.no_loop:
            loop_us = _bench(partial(m._routed_loop, x, ids, w), args.quick, slow=n >= 64)
        for label, kw in configs:
            live = kw.get("row_live")
            distinct = int((ids if live is None else ids[live.bool()]).unique().numel())
            nbytes = distinct * expert_bytes + n * h * (2 + 4)
            try:
                call = partial(K.fused_moe, x, ids, w, w13, w2, limit, out=out, **kw)
                eager_us = _bench(call, args.quick)
                graph_us = _graph_us([call] * GRAPH_CALLS, args.quick)
            except Exception as ex:  # noqa: BLE001 - a launch shape that does not compile is reported
                print(f"  N={n} {label}: FAILED {type(ex).__name__}: {str(ex)[:200]}", flush=True)
                continue
            gbps = nbytes / (graph_us * 1e-6) / 1e9
            floor_us = nbytes / (ceiling * 1e9) * 1e6
            speedup = loop_us / graph_us if loop_us else None
            row = Row(
                f"N={n} {label}",
                n,
                distinct,
                graph_us,
                eager_us,
                loop_us,
                nbytes / 1e6,
                gbps,
                100 * gbps / ceiling,
                graph_us / floor_us,
                speedup,
                rel,
                label,
            )
            rows.append(row)
            lp = f"{loop_us:9.1f}" if loop_us is not None else f"{'-':>9}"
            sp = f"{speedup:6.1f}x" if speedup is not None else f"{'-':>7}"
            print(
                f"N={n:<4} {label:<20} experts {distinct:3d}  fused {graph_us:8.1f} us (eager {eager_us:8.1f})  "
                f"loop {lp} us  {sp}  {nbytes / 1e6:8.1f} MB  {gbps:6.0f} GB/s  {100 * gbps / ceiling:5.1f}% copy  "
                f"x{graph_us / floor_us:5.2f} floor  rel err {rel:.1e}",
                flush=True,
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"copy_gbps": ceiling, "rows": [asdict(r) for r in rows]}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
