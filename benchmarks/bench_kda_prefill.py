"""KDA layer prefill at real GLM-5.3-Flash geometry (bf16, fused weights, one H200): the prefill glue, old vs new.

Times one call of `KimiDeltaAttention.forward` on a prefill chunk (default 8,192 rows) three ways in the same run:

* ``legacy``: the layer's prefill as it was before issue 32's glue work, replicated here (`_legacy_forward`): the
  torch conv per sequence on an FP32 copy of its rows, SiLU, ``torch.cat``, the q / k L2 norms as two row-norm
  launches, ``torch.zeros`` of ``o`` plus ``index_copy_``, gathers of ``g`` / ``beta``;
* ``torch conv``: today's layer with ``TRTLLM_GLM_KDA_CONV_BACKEND=torch`` (the conv reference, the new glue);
* ``fused``: today's layer by default (`ops.conv.conv_prefill`: one conv + SiLU + norm launch, one window launch).

Cases: one cold chunk (the first of a prompt), one warm chunk (``past_len > 0``, the window read from the state)
and three sequences back to back (one of 2 rows). Also the conv front half alone (the fused kernel vs
`conv_prefill_reference`) against a copy ceiling measured in the same run: the kernel reads ``x`` (bf16) and
writes ``q, k, v`` (FP32). Every path is checked against the legacy one before it is timed.

Usage: ``python -m benchmarks.bench_kda_prefill [--rows 8192] [--json out.json] [--sweep]`` (``--sweep``: the conv
kernel's launch shapes, default ``block_t=32, num_warps=4``). Exits cleanly without CUDA.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

from benchmarks.harness.ceiling import copy_ceiling_gbs
from benchmarks.harness.rows import write_json
from benchmarks.harness.timing import event_us
from trtllm_glm.config import Glm5NextConfig
from trtllm_glm.kda.batch import KdaBatch
from trtllm_glm.kda.layer import KimiDeltaAttention
from trtllm_glm.kda.ops import causal_conv1d_ref, conv_prefill, conv_prefill_reference, kda_prefill, l2_normalize
from trtllm_glm.state import KdaLayerState
from trtllm_glm.transfer import to_device

_ENV = "TRTLLM_GLM_KDA_CONV_BACKEND"


def _ms(fn, iters: int = 10) -> float:
    """Median milliseconds of ``fn`` over ``iters`` CUDA-event-timed calls after two warm-up calls."""
    return event_us(fn, iters, warmup=2) / 1e3


@torch.no_grad()
def _legacy_forward(layer: KimiDeltaAttention, hidden: torch.Tensor, batch: KdaBatch, st: KdaLayerState):
    """The layer's forward on a prefill-only batch as the code stood before the fused prefill conv (same math)."""
    N, dev = hidden.shape[0], hidden.device
    H, K, V = layer.num_heads, layer.head_k_dim, layer.head_v_dim
    x, g, beta, ga = layer._inputs(hidden)
    weight = layer._conv_weight()
    seqs = list(range(batch.num_seqs))
    ys, row_ids, sub_cu = [], [], [0]
    for b in seqs:
        s, n, slot = batch.cu_seqlens[b], batch.q_lens[b], batch.state_slots[b]
        prev = st.conv[slot] if batch.past_lens[b] > 0 else None
        y, conv_new = causal_conv1d_ref(x[s : s + n].float(), prev, weight)
        st.conv[slot].copy_(conv_new)
        ys.append(y)
        row_ids.append(torch.arange(s, s + n, dtype=torch.int64, device=dev))
        sub_cu.append(sub_cu[-1] + n)
    rows = row_ids[0] if len(row_ids) == 1 else torch.cat(row_ids)
    y = torch.cat(ys, dim=0)
    q, k, v = y.split([H * K, H * K, H * V], dim=-1)
    q, k, v = l2_normalize(q.reshape(-1, H, K)), l2_normalize(k.reshape(-1, H, K)), v.reshape(-1, H, V)
    slots = batch.state_slots_t
    fresh = to_device([int(batch.past_lens[b] == 0) for b in seqs], dev, torch.int64) != 0
    S0 = torch.where(fresh.view(-1, 1, 1, 1), 0.0, st.recurrent.index_select(0, slots))
    op, S_end = kda_prefill(q, k, v, g[rows], beta[rows], layer.scale, S0, sub_cu, lower_bound=layer.lower_bound,
                            backend=layer.backend, chunk_size=layer.chunk_size)  # fmt: skip
    st.recurrent.index_copy_(0, slots, S_end.to(st.recurrent.dtype))
    o = torch.zeros(N, H, V, dtype=torch.float32, device=dev)
    o.index_copy_(0, rows, op)
    return layer._output(hidden, o, ga)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=8192, help="prefill rows per call (the chunk size)")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--json", default=None, help="write the rows here")
    ap.add_argument("--sweep", action="store_true", help="also time the conv kernel's launch shapes (block_t, warps)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_kda_prefill: CUDA is not available; nothing to benchmark.")
        return 0
    torch.set_grad_enabled(False)  # inference only (the parameters require grad; the kernels have no backward)
    dev = torch.device("cuda")
    cfg = Glm5NextConfig.from_pretrained("glm-5.3-flash")
    layer = KimiDeltaAttention(cfg, 0)
    layer.reset_parameters(torch.Generator().manual_seed(0), 0.02)
    layer = layer.to(device=dev, dtype=torch.bfloat16)
    layer.A_log.data, layer.dt_bias.data = layer.A_log.data.float(), layer.dt_bias.data.float()
    layer.fuse_weights()
    H, K, V, W, C = layer.num_heads, layer.head_k_dim, layer.head_v_dim, layer.conv_size, layer.conv_dim
    S, R = 8, args.rows
    gen = torch.Generator(device=dev).manual_seed(1)
    rec0 = 0.1 * torch.randn(S, H, K, V, device=dev, generator=gen)
    conv0 = torch.randn(S, C, W - 1, device=dev, generator=gen)
    hidden = torch.randn(R, cfg.hidden_size, device=dev, generator=gen).to(torch.bfloat16)
    ceiling = copy_ceiling_gbs()
    print(f"device {torch.cuda.get_device_name()}  copy ceiling {ceiling:.0f} GB/s  rows {R}  "
          f"H={H} K={K} V={V} W={W} hidden={cfg.hidden_size}")  # fmt: skip

    a, b = (R * 3) // 8, R - (R * 3) // 8 - 2
    cases = {
        "1 seq, cold": KdaBatch.build([R], [0], [3], device=dev),
        "1 seq, warm": KdaBatch.build([R], [R], [3], device=dev),
        "3 seqs": KdaBatch.build([a, 2, b], [R, 0, 40], [5, 1, 6], device=dev),
    }
    results = []
    for name, batch in cases.items():
        st = {p: KdaLayerState(recurrent=rec0.clone(), conv=conv0.clone()) for p in ("legacy", "torch", "fused")}

        def run(path: str, batch: KdaBatch = batch, st: dict = st) -> torch.Tensor:
            s = st[path]
            if path == "legacy":
                return _legacy_forward(layer, hidden, batch, s)
            os.environ[_ENV] = "torch" if path == "torch" else "auto"
            return layer(hidden, batch, s)

        # One checked call per path from the same state, then timed calls (the state keeps moving; same work).
        outs = {p: run(p) for p in st}
        ref = outs["legacy"].float()
        errs = {p: ((o.float() - ref).abs().max() / ref.abs().max()).item() for p, o in outs.items()}
        ms = {p: _ms(lambda p=p: run(p), iters=args.iters) for p in st}
        os.environ.pop(_ENV, None)
        print(f"\n[{name}] rows {R}, q_lens {batch.q_lens}, past {batch.past_lens}")
        for p in st:
            print(f"  KDA layer prefill ({p:<6}) {ms[p]:8.3f} ms/call   vs legacy {ms['legacy'] / ms[p]:5.2f}x   "
                  f"max rel. diff to legacy {errs[p]:.1e}")  # fmt: skip
        results.append({"case": name, "rows": R, "ms": ms, "rel_diff_vs_legacy": errs})

    # The conv front half alone: kernel vs reference, one cold sequence of R rows.
    x = torch.randn(R, C, device=dev, generator=gen).to(torch.bfloat16)
    weight = layer._conv_weight()
    slots = torch.tensor([3], device=dev)
    cu = torch.tensor([0, R], device=dev)
    pool = conv0.clone()
    ms_k = _ms(lambda: conv_prefill(x, pool, weight, slots, cu, H, K, V, backend="triton"), iters=args.iters)
    ms_r = _ms(lambda: conv_prefill_reference(x, pool, weight, slots, cu, H, K, V), iters=args.iters)
    moved = R * C * (2 + 4)  # x read (bf16) + q, k, v written (FP32)
    gbps = moved / (ms_k * 1e-3) / 1e9
    print(f"\nconv front half, {R} rows: fused {ms_k:.3f} ms ({gbps:.0f} GB/s, {100 * gbps / ceiling:.0f}% of copy), "
          f"reference {ms_r:.3f} ms ({ms_r / ms_k:.1f}x)")  # fmt: skip
    results.append({"case": "conv front half", "rows": R, "ms": {"fused": ms_k, "reference": ms_r},
                    "gb_per_s": gbps, "copy_ceiling_gb_per_s": ceiling})  # fmt: skip
    if args.sweep:
        from trtllm_glm.kda import kernels as KK

        sweep = {}
        for bt, nw in ((16, 2), (16, 4), (32, 4), (32, 8), (64, 4), (64, 8), (128, 8)):
            ms = _ms(lambda bt=bt, nw=nw: KK.conv_prefill(x, pool, weight, slots, cu, H, K, V, block_t=bt,
                                                             num_warps=nw), iters=args.iters)  # fmt: skip
            sweep[f"block_t={bt},num_warps={nw}"] = ms
            g2 = moved / (ms * 1e-3) / 1e9
            print(f"  conv_prefill block_t={bt:<4} num_warps={nw}: {ms:.3f} ms ({100 * g2 / ceiling:.0f}% of copy)")
        results.append({"case": "conv launch sweep", "rows": R, "ms": sweep})
    if args.json:
        write_json(args.json, {"device": torch.cuda.get_device_name(), "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
