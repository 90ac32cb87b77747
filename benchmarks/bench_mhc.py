"""Benchmark of one mHC-wrapped block's hyper-connection work: fused Triton kernels vs the torch reference.

Real GLM-5.3-Flash geometry: S = 4 streams of D = 4096 in bf16, ``fn [24, 16384]`` fp32, 20 Sinkhorn
iterations; N in {1, 16, 64, 128} tokens (decode / verify). The block itself is the identity, so the time is
the mHC's alone: ``mhc_pre`` (RMS, mixing logits, Sinkhorn, collapse) + ``mhc_post`` (expand) for the
kernels, ``mhc_weights`` + ``mhc_collapse`` + ``mhc_expand`` (~70 small ops) for the reference.

Timings are CUDA-graph replays (both paths captured; median of several replays, CUDA events) of a chain of
G = 40 blocks, each with its own ``fn`` / ``base`` / ``scale`` and fed the previous block's streams, divided by
G: 40 x 1.5 MB of ``fn`` exceed the H200's 50 MB L2, so as in a real forward each block reads its ``fn`` from
HBM. ``hot`` rows replay one block's parameters G times (``fn`` stays in L2). ``pre`` / ``post`` rows time the
two kernels alone (same chain). Reference eager time (no graph, ``do_bench``) is given for context.

Bytes floor per block: ``fn`` (1.5 MB) + streams read and written (2 x N x S x D x 2) + the collapsed input
written and the block output read (2 x N x D x 2). GB/s = floor / time; ``%copy`` against a 1 GiB
device-to-device copy measured in the same run (bytes read + written); ``x floor`` = time / (floor at the copy
bandwidth). Each case is checked against the reference before it is timed.

Prefill rows (N in {128, 256, 1024, 8192}): ``mhc_pre`` alone, graph-replayed over the same chain of ``fn``s, block
``i`` reading the ``i % B``-th of ``B`` stream buffers holding >= 128 MB together (at least 4: 4 x 268 MB at N =
8192; 31 x 4.2 MB at 128), more than the L2, so each block reads its streams from HBM, as in a forward, on the old
FMA path (``path="fma"``, IEEE fp32 ``tl.dot``) and on the tensor-core path (``path="tc"``: ``mma="split3"``, the
default, ``"split3_chain"``, and Triton's ``"tf32x3"`` and ``"bf16x6"``) in the same run; ``proj`` rows time the
projection alone (`mix_partials`; floor: the streams and ``fn`` read once). Each variant's ``pre`` / ``post`` /
``comb`` max rel error against the fp64 weights (benchmarks/harness/mhc_fp64.py) is printed and in its note.
``mhc_post`` alone at the same N for context.

Usage (on a CUDA machine, from the repository root)::

    python -m benchmarks.bench_mhc [--quick] [--sweep] [--prefill-only] [--json PATH]

``--sweep`` also times other launch shapes (the projection's split and block_k, the hidden slice per
program of the collapse and of the expand; at prefill sizes the tensor-core path's block_n, block_k, split and
warps). ``--prefill-only`` skips the decode rows. Without CUDA it prints a message and exits 0.
"""

from __future__ import annotations

import argparse
import json
import sys
import traceback
from dataclasses import asdict, dataclass
from functools import partial

import torch

from benchmarks.harness.ceiling import copy_ceiling_gbs
from benchmarks.harness.timing import bench_us, graph_us_quick

ROWS = (1, 16, 64, 128)
PREFILL_ROWS = (128, 256, 1024, 8192)  # 128 and 256: where the tensor-core path starts to pay (TC_MIN_ROWS)
S, D = 4, 4096
CHAIN = 40
KW = dict(norm_eps=1e-5, hc_eps=1e-6, sinkhorn_iters=20)


@dataclass
class Row:
    name: str
    n: int
    us: float
    mbytes: float
    gbps: float
    pct_copy: float
    floor_ratio: float
    ref_graph_us: float | None = None
    ref_eager_us: float | None = None
    speedup_vs_ref_graph: float | None = None
    note: str = ""


def _params(g: int, dev: torch.device, seed: int = 0):
    gen = torch.Generator(device=dev).manual_seed(seed)
    m = (2 + S) * S
    fns = [torch.randn(m, S * D, device=dev, generator=gen) * (2.0 / (S * D) ** 0.5) for _ in range(g)]
    bases = [torch.randn(m, device=dev, generator=gen) for _ in range(g)]
    scales = [1.0 + 0.3 * torch.randn(3, device=dev, generator=gen) for _ in range(g)]
    return fns, bases, scales


def _floor_bytes(n: int, part: str = "block") -> float:
    """Bytes that must move: ``fn`` and the streams read (pre), the streams read and written (post), the
    collapsed input written (pre) and read back as the block output (post)."""
    fn_bytes = (2 + S) * S * S * D * 4
    streams, row = n * S * D * 2, n * D * 2
    if part == "pre":
        return fn_bytes + streams + row
    if part == "proj":
        return fn_bytes + streams
    if part == "post":
        return 2 * streams + row
    return fn_bytes + 2 * streams + 2 * row


def _ident(x: torch.Tensor) -> torch.Tensor:
    return x


class _Bench:
    def __init__(self, quick: bool, sweep: bool) -> None:
        from trtllm_glm import mhc as K
        from trtllm_glm.modules import mhc as R

        self.K, self.R = K, R
        self.quick, self.sweep = quick, sweep
        self.dev = torch.device("cuda")
        self.ceiling = copy_ceiling_gbs(self.dev, quick)
        self.fns, self.bases, self.scales = _params(CHAIN, self.dev)
        self.rows: list[Row] = []

    def record(
        self, name: str, n: int, t: float, part: str = "block", ref_g: float | None = None,
        ref_e: float | None = None, note: str = "",
    ) -> None:  # fmt: skip
        nbytes = _floor_bytes(n, part)
        gbps = nbytes / (t * 1e-6) / 1e9
        floor_us = nbytes / (self.ceiling * 1e9) * 1e6
        sp = ref_g / t if ref_g else None
        pct = 100 * gbps / self.ceiling
        self.rows.append(Row(name, n, t, nbytes / 1e6, gbps, pct, t / floor_us, ref_g, ref_e, sp, note))
        extra = f"  ref graph {ref_g:8.1f} us (x{sp:5.1f})" if ref_g and sp else ""
        extra += f"  ref eager {ref_e:8.1f} us" if ref_e else ""
        print(
            f"  {name:<22} N={n:<4} {t:8.2f} us  {nbytes / 1e6:6.2f} MB  {gbps:6.0f} GB/s  {pct:5.1f}% copy  "
            f"x{t / floor_us:5.1f} floor{extra}"
        )

    def chain(self, streams: torch.Tensor, backend: str, hot: bool = False) -> torch.Tensor:
        """CHAIN blocks, each fed the previous one's streams (``hot``: all with block 0's parameters)."""
        h = streams
        for i in range(CHAIN):
            j = 0 if hot else i
            h = self.R.mhc_block(h, _ident, self.fns[j], self.bases[j], self.scales[j], **KW, backend=backend)
        return h

    def pre_chain(self, streams: torch.Tensor, **launch) -> None:
        for i in range(CHAIN):
            self.K.mhc_pre(streams, self.fns[i], self.bases[i], self.scales[i], **KW, **launch)

    def post_chain(
        self, streams: torch.Tensor, x_in: torch.Tensor, post: torch.Tensor, comb: torch.Tensor, **launch
    ) -> None:
        for _ in range(CHAIN):
            self.K.mhc_post(streams, x_in, post, comb, **launch)

    def case(self, n: int) -> None:
        R, q = self.R, self.quick
        gen = torch.Generator(device=self.dev).manual_seed(100 + n)
        streams = (3.0 * torch.randn(n, S, D, device=self.dev, generator=gen)).to(torch.bfloat16)
        f0, b0, s0 = self.fns[0], self.bases[0], self.scales[0]
        # Correctness first: one block against the reference.
        got = R.mhc_block(streams, _ident, f0, b0, s0, **KW, backend="triton")
        want = R.mhc_block(streams, _ident, f0, b0, s0, **KW, backend="torch")
        err = ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()
        ndiff = (got != want).float().mean().item()
        print(f"N={n}: block max rel err vs reference {err:.1e} ({ndiff:.3%} of bf16 values differ)")
        t_ref = graph_us_quick([partial(self.chain, streams, "torch")], q) / CHAIN
        t_ref_eager = bench_us(partial(self.chain, streams, "torch", hot=True), q, slow=True) / CHAIN
        t_k = graph_us_quick([partial(self.chain, streams, "triton")], q) / CHAIN
        self.record("kernels (pre+post)", n, t_k, ref_g=t_ref, ref_e=t_ref_eager, note=f"err {err:.1e}")
        self.record("kernels hot L2", n, graph_us_quick([partial(self.chain, streams, "triton", hot=True)], q) / CHAIN)
        self.record("  mhc_pre alone", n, graph_us_quick([partial(self.pre_chain, streams)], q) / CHAIN, "pre")
        x_in, post, comb = self.K.mhc_pre(streams, f0, b0, s0, **KW)
        t_post = graph_us_quick([partial(self.post_chain, streams, x_in, post, comb)], q) / CHAIN
        self.record("  mhc_post alone", n, t_post, "post")
        if self.sweep:
            for split, bk in ((32, 32), (64, 32), (256, 32), (128, 64), (128, 16)):
                t = graph_us_quick([partial(self.pre_chain, streams, split=split, block_k=bk)], q) / CHAIN
                self.record(f"  pre split={split} bk={bk}", n, t, "pre")
            for bd in (256, 512, 2048):
                t = graph_us_quick([partial(self.pre_chain, streams, block_d=bd)], q) / CHAIN
                self.record(f"  pre block_d={bd}", n, t, "pre")
                t = graph_us_quick([partial(self.post_chain, streams, x_in, post, comb, block_d=bd)], q) / CHAIN
                self.record(f"  post block_d={bd}", n, t, "post")

    def prefill_chain(self, streams: list[torch.Tensor], proj: bool = False, **launch) -> None:
        """``mhc_pre`` (or, ``proj``, the projection alone) of CHAIN blocks over rotating stream buffers."""
        mod = self.K.kernel_module(self.dev)
        for i in range(CHAIN):
            x = streams[i % len(streams)]
            if proj:
                mod.mix_partials(x, self.fns[i], **launch)
            else:
                self.K.mhc_pre(x, self.fns[i], self.bases[i], self.scales[i], **KW, **launch)

    def prefill_case(self, n: int) -> None:
        """``mhc_pre`` at prefill sizes: old (FMA) and new (tensor-core) paths in the same run, with errors."""
        from benchmarks.harness.mhc_fp64 import mhc_weights_fp64

        q = self.quick
        gen = torch.Generator(device=self.dev).manual_seed(200 + n)
        n_bufs = min(CHAIN, max(4, -(-(128 << 20) // (n * S * D * 2))))  # >= 128 MB: past the L2
        bufs = [(3.0 * torch.randn(n, S, D, device=self.dev, generator=gen)).to(torch.bfloat16) for _ in range(n_bufs)]
        streams = bufs[0]
        f0, b0, s0 = self.fns[0], self.bases[0], self.scales[0]
        want = mhc_weights_fp64(streams, f0, b0, s0, **KW)
        variants = {
            "fma (old)": dict(path="fma"),
            "tc split3": dict(path="tc", mma="split3"),
            "tc split3_chain": dict(path="tc", mma="split3_chain"),
            "tc tf32x3": dict(path="tc", mma="tf32x3"),
            "tc bf16x6": dict(path="tc", mma="bf16x6"),
        }
        base_t = None
        for name, launch in variants.items():
            _, pre, post, comb = self.K.mhc_pre(streams, f0, b0, s0, **KW, return_pre=True, **launch)
            err = max(((g.double() - w).abs().max() / w.abs().max()).item() for g, w in zip((pre, post, comb), want))
            t = graph_us_quick([partial(self.prefill_chain, bufs, **launch)], q) / CHAIN
            base_t = base_t or t
            note = f"max rel err of pre/post/comb vs fp64 {err:.2e}; x{base_t / t:.1f} faster than the old path"
            self.record(f"  pre {name}", n, t, "pre", note=note)
            print(f"      {note}")
            t = graph_us_quick([partial(self.prefill_chain, bufs, proj=True, **launch)], q) / CHAIN
            self.record(f"  proj {name}", n, t, "proj")
        if self.sweep:
            for bn, bk, split, nw in (
                (64, 64, None, 4), (128, 32, None, 8), (128, 128, None, 8), (128, 64, None, 4),
                (128, 64, 2, 8), (128, 64, 8, 8), (128, 64, 16, 8), (256, 64, None, 8),
            ):  # fmt: skip
                launch = dict(path="tc", block_n=bn, block_k=bk, split=split, num_warps=nw)
                t = graph_us_quick([partial(self.prefill_chain, bufs, proj=True, **launch)], q) / CHAIN
                self.record(f"  proj tc {bn}x{bk} s={split or 'auto'} w{nw}", n, t, "proj")
        x_in, post, comb = self.K.mhc_pre(streams, f0, b0, s0, **KW)
        self.record(
            "  mhc_post alone",
            n,
            graph_us_quick([partial(self.post_chain, streams, x_in, post, comb)], q) / CHAIN,
            "post",
        )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--prefill-only", action="store_true")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_mhc: needs CUDA; nothing to do")
        return 0
    torch.backends.cuda.matmul.allow_tf32 = False  # the reference's fp32 projection, as in the model
    b = _Bench(args.quick, args.sweep)
    print(f"{torch.cuda.get_device_name(b.dev)}; copy ceiling {b.ceiling:.0f} GB/s; chain of {CHAIN} blocks")
    cases = [] if args.prefill_only else [(b.case, n) for n in ROWS]
    cases += [(b.prefill_case, n) for n in PREFILL_ROWS]
    for case, n in cases:
        if case == b.prefill_case:
            print(f"N={n} (prefill): mhc_pre, old path vs tensor cores")
        try:
            with torch.no_grad():
                case(n)
        except Exception:  # keep timing the other sizes; the log shows what failed
            traceback.print_exc()
            print(f"N={n}: FAILED")
        torch.cuda.synchronize()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "device": torch.cuda.get_device_name(b.dev),
                    "copy_ceiling_gbps": b.ceiling,
                    "chain": CHAIN,
                    "geometry": dict(S=S, D=D, **KW),
                    "rows": [asdict(r) for r in b.rows],
                },
                f,
                indent=1,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
