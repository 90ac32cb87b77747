"""Benchmark of the sparse MLA decode/verify kernel and the pool top-k kernel at real GLM-5.3-Flash geometry.

Sparse MLA: 64 heads x kv_lora 512, bf16 latent cache and queries, page size 64, 2051 selected rows per query
row (2048 pool tokens + 3 tail, as the indexer produces), N = 1, 16, 64, 128 query rows, each row on its own
sequence. Bytes floor: every selected latent row read once per query row, ``N * W * R * 2``. Each row count also
times the FP8 latent cache (``latent_dtype="fp8"``: the same rows as e4m3 codes with a fp32 scale per 128 columns,
floor ``N * W * (R + 16)``; row ``fp8 latent``). Top-k: N = 16, 64
rows over 32768 and 8192 pools, topk 512 (floor: the scores read once plus the ids written).

Two timings per case: ``eager`` is the median of ``triton.testing.do_bench`` (CUDA events; the L2 is flushed
before every repetition, so the latent rows come from HBM); ``graph`` is the replay of a CUDA graph of G
back-to-back calls divided by G (no launch overhead); for sparse MLA the G calls read disjoint latent rows
(together several times the L2), so the graph time is not an L2-resident figure either. GB/s and the floor
ratio use the graph time when there is one. The copy ceiling is a device-to-device copy of 1 GiB measured in
the same run (bytes read plus bytes written). ``vs torch`` is the eager time of the torch reference op divided
by the kernel's eager time. Each kernel's output is checked against the reference before it is timed.

Usage (on a CUDA machine, from the repository root)::

    python -m benchmarks.bench_sparse_kernels [--quick] [--sweep] [--json PATH] [--only mla|topk]
        [--rows 1,16,64,128] [--variants "default,triton bw64 s2"] [--no-torch]

``--sweep`` also times alternative launch shapes (tuning): every entry of ``MLA_VARIANTS`` unless
``--variants`` names some, plus other split counts and combine shapes at 1 to 64 rows and the combine alone.
Without CUDA it prints a message and exits 0.
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import asdict, dataclass
from functools import partial

import torch

from benchmarks.harness.ceiling import copy_ceiling_gbs
from benchmarks.harness.rows import device_line, write_json
from benchmarks.harness.timing import bench_us, graph_us_quick

H, RANK, P, WIDTH = 64, 512, 64, 2051
TOPK_POOLS = 512
SCALE = 192**-0.5
CTX = 4096  # tokens per sequence; each row selects WIDTH of them
MLA_ROWS = (1, 16, 64, 128)
TOPK_CASES = ((16, 32768), (64, 32768), (16, 8192), (64, 8192))
L2_DEFEAT_BYTES = 256 << 20  # the graph's calls together read this much distinct data at least


@dataclass
class Row:
    name: str
    eager_us: float
    graph_us: float | None
    mbytes: float
    gbps: float
    pct_copy: float
    floor_ratio: float
    ref_us: float | None
    vs_torch: float | None
    note: str = ""


class _Ctx:
    def __init__(self, dev: torch.device, quick: bool, sweep: bool, ceiling: float) -> None:
        from trtllm_glm.attention.sparse.glm_kpool import kernels, ops

        self.dev, self.quick, self.sweep, self.ceiling = dev, quick, sweep, ceiling
        self.K, self.R = kernels, ops
        self.rows: list[Row] = []
        self.mla_rows: tuple[int, ...] = MLA_ROWS
        self.mla_variants: list[str] = []
        self.time_torch = True

    def record(
        self, name: str, nbytes: float, t_eager: float, t_graph: float | None, t_ref: float | None, note: str = ""
    ) -> None:
        t = t_graph if t_graph is not None else t_eager
        gbps = nbytes / (t * 1e-6) / 1e9
        floor_us = nbytes / (self.ceiling * 1e9) * 1e6
        vs = (t_ref / t_eager) if t_ref else None
        self.rows.append(
            Row(name, t_eager, t_graph, nbytes / 1e6, gbps, 100 * gbps / self.ceiling, t / floor_us, t_ref, vs, note)
        )
        g = f"{t_graph:8.1f}" if t_graph is not None else f"{'-':>8}"
        print(f"  {name:<44} eager {t_eager:8.1f} us  graph {g} us  {gbps:6.0f} GB/s  x{t / floor_us:5.2f} floor")


class MlaData:
    """128 sequences of CTX tokens on permuted pages, and per-row selections of WIDTH tokens each."""

    def __init__(self, dev: torch.device, n_seqs: int) -> None:
        g = torch.Generator(device=dev).manual_seed(0)
        pages_per_seq = CTX // P
        num_pages = n_seqs * pages_per_seq
        self.cache = torch.randn(num_pages, P, RANK, device=dev, generator=g).to(torch.bfloat16)
        self.table = torch.randperm(num_pages, device=dev, generator=g).view(n_seqs, pages_per_seq).to(torch.int32)
        # Like the indexer's output: 512 pools (2048 tokens) in ascending order, then the 3 tail tokens.
        keys = torch.rand(n_seqs, CTX // 4 - 1, device=dev, generator=g)
        pools = torch.sort(torch.topk(keys, 512, dim=1).indices, dim=1).values
        toks = (4 * pools[:, :, None] + torch.arange(4, device=dev)).flatten(1)
        tail = torch.arange(CTX - 4, CTX - 1, device=dev).expand(n_seqs, 3)
        self.sel_by_seq = torch.cat([toks, tail], dim=1).to(torch.int32)
        self.n_seqs = n_seqs
        self.g = g
        self._fp8: tuple[torch.Tensor, torch.Tensor] | None = None

    def fp8(self, ops) -> tuple[torch.Tensor, torch.Tensor]:  # noqa: ANN001
        """The cache's rows in the FP8 latent format (``latent_dtype="fp8"``): e4m3 codes ``[pages, P, R]`` and fp32
        block scales ``[pages, P, R // 128]`` (`ops.quant_latent`), made once."""
        if self._fp8 is None:
            self._fp8 = ops.quant_latent(self.cache)
        return self._fp8

    def batch(self, n_rows: int, first_seq: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        seqs = (first_seq + torch.arange(n_rows, device=self.cache.device)) % self.n_seqs
        q = (torch.randn(n_rows, H, RANK, device=self.cache.device, generator=self.g) * 0.3).to(torch.bfloat16)
        return q, self.sel_by_seq[seqs].contiguous(), seqs.to(torch.int64)


def _mla_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


# Launch shapes timed by --sweep (name -> keywords of kernels.sparse_mla.sparse_mla_attention). "default" is
# what the wrapper runs: the Gluon kernel on sm_90 with bf16 (kernels/sparse_mla.py, `gluon_eligible`).
MLA_VARIANTS: dict[str, dict] = {
    "default": {},
    "gluon bw64": dict(impl="gluon", block_w=64),
    "gluon bw64 p-reg": dict(impl="gluon", block_w=64, gluon_p_smem=False),
    "gluon bw32": dict(impl="gluon", block_w=32),
    "gluon bw32 nb3": dict(impl="gluon", block_w=32, gluon_nbuf=3),
    "gluon bw16": dict(impl="gluon", block_w=16),
    # Diagnostics (wrong results by design): the same kernel without its products / without its copies.
    "diag bw64 no-mma": dict(impl="gluon", block_w=64, gluon_diag=1),
    "diag bw64 no-copy": dict(impl="gluon", block_w=64, gluon_diag=2),
    "diag bw32 no-mma": dict(impl="gluon", block_w=32, gluon_diag=1),
    "diag bw32 no-copy": dict(impl="gluon", block_w=32, gluon_diag=2),
    "triton bw64 s2": dict(impl="triton", block_w=64, num_stages=2),
    "triton bw32 s7": dict(impl="triton", block_w=32, num_stages=7),
}
# Extra split counts / combine shapes (default impl) timed by --sweep at these row counts.
MLA_SPLITS = {16: (4, 9, 11, 17), 64: (1, 4)}
MLA_COMBINE_BH = {16: (2, 4, 16)}
# Split count and combine head block together (--sweep). "splits=16 bh8" at N <= 8 and "splits=8 bh8" at 16 are
# what the op chose before 2026-12-03 (at most width / (2 H) splits, eight heads per combine program).
MLA_SPLITS_BH = {
    1: ((16, 8), (11, 1), (17, 1), (33, 2)),
    2: ((16, 8), (16, 1), (33, 2)),
    4: ((16, 8), (16, 1), (33, 2)),
    8: ((16, 8), (16, 2), (16, 4)),
    16: ((8, 8), (8, 2)),
}


def _mla_block_w(mod, kw: dict, q: torch.Tensor, cache: torch.Tensor) -> int:
    """Entries per tile of the launch that ``kw`` selects (for the split-count note)."""
    impl = kw.get("impl") or ("gluon" if mod.gluon_eligible(q, cache) and mod._DEFAULT_IMPL != "triton" else "triton")
    return kw.get("block_w", mod._GLUON_BLOCK_W if impl == "gluon" else mod._BLOCK_W)


def bench_sparse_mla(cx: _Ctx) -> None:
    """Sparse MLA at the row counts of ``cx.mla_rows``; default launch, then (with --sweep) alternatives."""
    K, R, dev = cx.K, cx.R, cx.dev
    data = MlaData(dev, max(MLA_ROWS))
    mod = K.kernel_module("sparse_mla", dev)
    names = cx.mla_variants or (list(MLA_VARIANTS) if cx.sweep else ["default"])
    for n_rows in cx.mla_rows:
        nbytes = n_rows * WIDTH * RANK * 2
        q, sel, rs = data.batch(n_rows, 0)
        args = (q, data.cache, sel, rs, data.table, P, SCALE)
        ref = R.sparse_mla_attention(*args)
        ref32 = R.sparse_mla_attention(q.float(), data.cache.float(), sel, rs, data.table, P, SCALE)
        ref_err = _mla_err(ref, ref32)
        t_ref = bench_us(partial(R.sparse_mla_attention, *args), cx.quick, slow=True) if cx.time_torch else None
        sets = max(1, min(64, math.ceil(L2_DEFEAT_BYTES / nbytes)))
        batches = [data.batch(n_rows, s * n_rows) for s in range(sets)]
        todo = [(name, MLA_VARIANTS[name]) for name in names if n_rows != 1 or name in ("default", "triton bw64 s2")]
        if cx.sweep:
            todo += [(f"splits={sp}", dict(splits=sp)) for sp in MLA_SPLITS.get(n_rows, ())]
            todo += [(f"combine bh{cb}", dict(combine_block_h=cb)) for cb in MLA_COMBINE_BH.get(n_rows, ())]
            todo += [
                (f"splits={sp} bh{cb}", dict(splits=sp, combine_block_h=cb)) for sp, cb in MLA_SPLITS_BH.get(n_rows, ())
            ]
        for label, kw in todo:
            try:
                out = torch.full_like(q, float("nan"))
                mod.sparse_mla_attention(*args, out=out, **kw)
                err = _mla_err(out, ref32)
                # Timed even when wrong (marked), so that a broken variant still shows what it would cost.
                bad = "" if err < 8e-3 else (" (diagnostic)" if "gluon_diag" in kw else " WRONG")
                t_k = bench_us(partial(mod.sparse_mla_attention, *args, **kw), cx.quick)
                outs = [torch.empty_like(b[0]) for b in batches]
                calls = [
                    partial(mod.sparse_mla_attention, b[0], data.cache, b[1], b[2], data.table, P, SCALE, out=o, **kw)
                    for b, o in zip(batches, outs)
                ]
                t_g = graph_us_quick(calls, cx.quick)
                bw = _mla_block_w(mod, kw, q, data.cache)
                asked = kw.get("splits", mod.choose_splits(n_rows, H, WIDTH, dev, 64, bw))
                label = label if "block_w" in kw or label != "default" else f"default (bw{bw})"
                n_splits = mod.split_layout(WIDTH, bw, asked)[1]
                cb = kw.get("combine_block_h", mod.choose_combine_block_h(n_rows, H, dev)) if n_splits > 1 else "-"
                note = f"splits={n_splits} bh{cb} err {err:.1e} (torch bf16 {ref_err:.1e}){bad}"
                cx.record(f"sparse_mla N={n_rows} {label}", nbytes, t_k, t_g, t_ref, note)
            except Exception as e:  # noqa: BLE001 - one failing launch shape must not lose the others
                print(f"  sparse_mla N={n_rows} {label}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
        _bench_fp8_latent(cx, mod, data, n_rows, batches, q, sel, rs)
        if cx.sweep and n_rows == 16:
            _bench_combine_only(cx, mod, n_rows)
        del batches
        torch.cuda.empty_cache()


def _bench_fp8_latent(cx: _Ctx, mod, data: MlaData, n_rows: int, batches: list, q, sel, rs) -> None:  # noqa: ANN001
    """The same rows from the FP8 latent cache (codes + a fp32 scale per 128 columns: ``N * W * (R + 16)`` bytes),
    the Triton split kernel decoding them after loading; checked against the reference over the same codes."""
    R = cx.R
    codes, scales = data.fp8(R)
    nbytes = n_rows * WIDTH * (RANK + 4 * (RANK // 128))
    label = "fp8 latent"
    try:
        ref32 = R.sparse_mla_attention(q.float(), codes, sel, rs, data.table, P, SCALE, latent_scale=scales)
        out = torch.full_like(q, float("nan"))
        mod.sparse_mla_attention(q, codes, sel, rs, data.table, P, SCALE, latent_scale=scales, out=out)
        err = _mla_err(out, ref32)
        bad = "" if err < 8e-3 else " WRONG"
        t_k = bench_us(partial(mod.sparse_mla_attention, q, codes, sel, rs, data.table, P, SCALE,
                               latent_scale=scales), cx.quick)  # fmt: skip
        outs = [torch.empty_like(b[0]) for b in batches]
        calls = [
            partial(mod.sparse_mla_attention, b[0], codes, b[1], b[2], data.table, P, SCALE, latent_scale=scales, out=o)
            for b, o in zip(batches, outs)
        ]
        t_g = graph_us_quick(calls, cx.quick)
        cx.record(f"sparse_mla N={n_rows} {label}", nbytes, t_k, t_g, None, f"err {err:.1e} vs fp32 reference{bad}")
    except Exception as e:  # noqa: BLE001 - report and go on with the other sections
        print(f"  sparse_mla N={n_rows} {label}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)


def _bench_combine_only(cx: _Ctx, mod, n_rows: int) -> None:
    """The split combine alone (graph replay) at the default split count: its share of the op's time."""
    splits = mod.split_layout(WIDTH, 64, mod.choose_splits(n_rows, H, WIDTH, cx.dev, 64, 64))[1]
    o_part = torch.randn(n_rows, splits, H, RANK, device=cx.dev)
    lse = torch.randn(n_rows, splits, H, device=cx.dev)
    out = torch.empty(n_rows, H, RANK, device=cx.dev, dtype=torch.bfloat16)
    for cb in (8, 2):

        def launch(cb: int = cb) -> None:
            mod._combine_kernel[(H // cb, n_rows)](
                o_part,
                lse,
                out,
                H,
                splits,
                *o_part.stride()[:3],
                *lse.stride()[:2],
                *out.stride()[:2],
                R=RANK,
                BLOCK_H=cb,
                RP=RANK,
                SP=triton_next_pow2(splits),
                num_warps=4,
            )

        t_g = graph_us_quick([launch] * 20, cx.quick)
        nbytes = o_part.numel() * 4 + lse.numel() * 4 + out.numel() * 2
        cx.record(f"sparse_mla combine only N={n_rows} bh{cb}", nbytes, t_g, t_g, None, f"splits={splits}")


def triton_next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def bench_topk(cx: _Ctx) -> None:
    """Top-512 pools of 32768 / 8192, 16 and 64 rows at full context."""
    K, R, dev = cx.K, cx.R, cx.dev
    mod = K.kernel_module("topk", dev)
    for n_rows, max_pools in TOPK_CASES:
        g = torch.Generator(device=dev).manual_seed(n_rows + max_pools)
        positions = torch.full((n_rows,), 4 * max_pools - 1, device=dev, dtype=torch.int64)
        dists = {
            "randn": torch.randn(n_rows, max_pools, device=dev, generator=g),
            # Indexer-like: non-negative sums of ReLU'd products, many near-zero.
            "relu-sum": torch.relu(torch.randn(n_rows, max_pools, 4, device=dev, generator=g)).sum(-1) * 0.01,
        }
        for dist, scores in dists.items():
            if dist != "randn" and max_pools != 32768:
                continue
            ref = R.select_topk_pools(scores, positions, TOPK_POOLS)
            t_ref = bench_us(partial(R.select_topk_pools, scores, positions, TOPK_POOLS), cx.quick)
            nbytes = n_rows * (max_pools * 4 + TOPK_POOLS * 4)
            variants: list[tuple[str, dict]] = [("default", {})]
            if cx.sweep and n_rows == 16:
                variants += [(f"w{w}", dict(num_warps=w)) for w in (4, 16, 32)]
            for label, kw in variants:
                try:
                    out = torch.full_like(ref, -7)
                    mod.select_topk_pools(scores, positions, TOPK_POOLS, out=out, **kw)
                    if not torch.equal(out, ref):
                        raise AssertionError("ids differ from the reference")
                    t_k = bench_us(
                        partial(mod.select_topk_pools, scores, positions, TOPK_POOLS, out=out, **kw), cx.quick
                    )
                    t_g = graph_us_quick(
                        [partial(mod.select_topk_pools, scores, positions, TOPK_POOLS, out=out, **kw)] * 20, cx.quick
                    )
                    cx.record(f"topk N={n_rows} pools={max_pools} {dist} {label}", nbytes, t_k, t_g, t_ref)
                except Exception as e:  # noqa: BLE001
                    print(f"  topk N={n_rows} {max_pools} {label}: FAILED {type(e).__name__}: {str(e)[:300]}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions")
    parser.add_argument("--sweep", action="store_true", help="also time alternative launch shapes")
    parser.add_argument("--json", default=None, help="also write the rows as JSON to this path")
    parser.add_argument("--only", choices=("mla", "topk"), default=None, help="run one section only")
    parser.add_argument("--rows", default=None, help="sparse MLA row counts, comma-separated (default 1,16,64,128)")
    parser.add_argument(
        "--variants", default=None, help=f"sparse MLA launch shapes, comma-separated, of: {', '.join(MLA_VARIANTS)}"
    )
    parser.add_argument("--no-torch", action="store_true", help="skip timing the torch reference")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_sparse_kernels: CUDA is not available; nothing to benchmark.")
        return 0
    dev = torch.device("cuda")
    torch.manual_seed(0)
    print(device_line(dev), flush=True)
    import triton

    print(f"triton {triton.__version__}", flush=True)
    ceiling = copy_ceiling_gbs(dev, args.quick)
    print(f"copy ceiling: {ceiling:.0f} GB/s (read + write)", flush=True)
    cx = _Ctx(dev, args.quick, args.sweep, ceiling)
    if args.rows:
        cx.mla_rows = tuple(int(x) for x in args.rows.split(","))
    if args.variants:
        cx.mla_variants = [v.strip() for v in args.variants.split(",")]
        unknown = [v for v in cx.mla_variants if v not in MLA_VARIANTS]
        if unknown:
            parser.error(f"unknown variants {unknown}")
    cx.time_torch = not args.no_torch
    failed = []
    sections = {"mla": (bench_sparse_mla,), "topk": (bench_topk,), None: (bench_sparse_mla, bench_topk)}[args.only]
    for section in sections:
        try:
            section(cx)
            print(f"done: {section.__name__}", flush=True)
        except Exception as e:  # noqa: BLE001 - reported and reflected in the exit code
            failed.append(section.__name__)
            print(f"FAILED: {section.__name__}: {type(e).__name__}: {e}", flush=True)
        torch.cuda.empty_cache()

    print()
    head = (
        f"{'case':<48} {'eager us':>9} {'graph us':>9} {'MB':>7} {'GB/s':>6} {'%copy':>6} "
        f"{'x floor':>7} {'torch us':>9} {'vs torch':>8}  note"
    )
    print(head)
    print("-" * len(head))
    for r in cx.rows:
        gr = f"{r.graph_us:9.1f}" if r.graph_us is not None else f"{'-':>9}"
        ref = f"{r.ref_us:9.1f}" if r.ref_us is not None else f"{'-':>9}"
        vs = f"{r.vs_torch:8.1f}" if r.vs_torch is not None else f"{'-':>8}"
        print(
            f"{r.name:<48} {r.eager_us:9.1f} {gr} {r.mbytes:7.2f} {r.gbps:6.0f} {r.pct_copy:6.1f} "
            f"{r.floor_ratio:7.2f} {ref} {vs}  {r.note}"
        )
    if failed:
        print(f"failed sections: {failed}")
    if args.json:
        write_json(args.json, {"copy_gbps": ceiling, "rows": [asdict(r) for r in cx.rows]})
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
