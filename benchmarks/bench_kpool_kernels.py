"""Benchmark of the pooled (C4) FP8 indexer's Triton kernels at real GLM-5.3-Flash geometry.

Times (median of ``triton.testing.do_bench``, which flushes the L2 between runs) the decode/verify cache
update, the prefill pool write, the latent row write, the query rotate-quantise, the scoring (decode rows
over 32k-token contexts, with a few launch shapes and both fp8 decodes; and a prefill chunk) and the
selection expansion. For each it reports the bytes the kernel must move (each input read once, each output
written once), the achieved bandwidth against a device-to-device copy ceiling measured in the same run,
and the time of the torch reference op (``ops``) in the same run. Before timing, each kernel's output is
checked against the reference (bitwise where the contract says so), so the numbers belong to correct code.

Usage (on a CUDA machine, from the repository root)::

    python -m benchmarks.bench_kpool_kernels [--quick] [--json PATH]

Without CUDA it prints a message and exits with status 0.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass
from functools import partial

import torch

from benchmarks.harness.ceiling import copy_ceiling_gbs
from benchmarks.harness.rows import device_line
from benchmarks.harness.timing import bench_us, do_bench_us

D, H_IDX, P, LATENT = 128, 32, 64, 512
TOPK_POOLS, WIDTH = 512, 2051
# Problem sizes (module constants so that a smoke run can shrink them).
DECODE_SEQS, DECODE_CTX = 128, 32768
PREFILL_SEQS, PREFILL_CHUNK = 4, 4096
ROTATE_ROWS = 2048
SCORE_SEQS, SCORE_CTX, SCORE_PREFILL_ROWS = 64, 32768, 1024
EXPAND_ROWS = 2048


@dataclass
class Row:
    name: str
    kernel_us: float
    mbytes: float
    gbps: float
    pct_copy: float
    ref_us: float | None
    speedup: float | None
    note: str = ""


def _bench(fn: Callable[[], object], quick: bool, slow: bool = False) -> float:
    """Median microseconds of ``fn`` (``slow``: a few runs only, for the Python-loop references)."""
    return do_bench_us(fn, 1, 1) if slow else bench_us(fn, quick)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def _valid_e4m3(shape: tuple[int, ...], dev: torch.device) -> torch.Tensor:
    codes = torch.randint(0, 256, shape, dtype=torch.uint8, device=dev)
    codes[(codes & 0x7F) == 0x7F] = 0x3A  # no NaN codes
    return codes.view(torch.float8_e4m3fn)


def _matmul_ceiling(dev: torch.device, quick: bool) -> float:
    """fp16 matrix-product rate in TFLOP/s (random data), for the compute-heavy prefill scoring."""
    a = torch.randn(8192, 8192, device=dev, dtype=torch.float16)
    b = torch.randn(8192, 8192, device=dev, dtype=torch.float16)
    t = _bench(partial(torch.matmul, a, b), quick)
    return 2 * 8192**3 / (t * 1e-6) / 1e12


class _Ctx:
    """What every section needs: device, repetition mode, the two op sets and the result rows."""

    def __init__(self, dev: torch.device, quick: bool, ceiling: float, mm: float) -> None:
        from trtllm_glm.attention.sparse.glm_kpool import kernels, ops

        self.dev, self.quick, self.ceiling, self.mm = dev, quick, ceiling, mm
        self.K, self.R = kernels, ops
        self.rows: list[Row] = []

    def bench(self, fn: Callable[..., object], *args: object, slow: bool = False, **kwargs: object) -> float:
        return _bench(partial(fn, *args, **kwargs), self.quick, slow)

    def record(self, name: str, nbytes: float, t_k: float, t_r: float | None, note: str = "") -> None:
        gbps = nbytes / (t_k * 1e-6) / 1e9
        speedup = (t_r / t_k) if t_r else None
        self.rows.append(Row(name, t_k, nbytes / 1e6, gbps, 100 * gbps / self.ceiling, t_r, speedup, note))

    def cache(self, num_pages: int, num_slots: int, latent: bool = False):
        from trtllm_glm.cache.manager import KpoolLayerCache

        dev = self.dev
        lat = torch.randn(num_pages if latent else 1, P, LATENT, device=dev).to(torch.bfloat16)
        return KpoolLayerCache(
            latent=lat,
            index_k=_valid_e4m3((num_pages, P // 4, D), dev),
            index_scale=torch.exp2(torch.randint(-12, 2, (num_pages, P // 4), device=dev).float()),
            tail_ring=torch.randn(num_slots, 2, 4, D, device=dev),
            tokens_per_block=P,
        )


def _clone(c):
    return type(c)(c.latent.clone(), c.index_k.clone(), c.index_scale.clone(), c.tail_ring.clone(), c.page_size)


def _planes_equal(a, b) -> bool:
    pairs = ((a.index_k, b.index_k), (a.index_scale, b.index_scale), (a.tail_ring, b.tail_ring))
    return all(torch.equal(_bits(x), _bits(y)) for x, y in pairs)


def bench_decode(cx: _Ctx) -> None:
    """Decode/verify update: 128 sequences at random lengths below 32k, widths 1 and 4."""
    K, R, dev = cx.K, cx.R, cx.dev
    b_dec, ctx = DECODE_SEQS, DECODE_CTX
    pages_per_seq = ctx // P + 1
    c_dec = cx.cache(b_dec * pages_per_seq, b_dec)
    table = torch.randperm(b_dec * pages_per_seq, device=dev).view(b_dec, pages_per_seq).to(torch.int32)
    slots = torch.randperm(b_dec, device=dev)
    ape = torch.randn(4, D, device=dev)
    for width in (1, 4):
        past = torch.randint(0, ctx - width, (b_dec,), device=dev)
        positions = (past[:, None] + torch.arange(width, device=dev)[None, :]).flatten()
        row_seq = torch.arange(b_dec, device=dev).repeat_interleave(width)
        n = positions.numel()
        key, gate = torch.randn(n, D, device=dev), torch.randn(n, D, device=dev)
        a, b = _clone(c_dec), _clone(c_dec)
        rest = (key, gate, ape, positions, row_seq, table, slots)
        K.update_decode_pools(a, *rest)
        R.update_decode_pools(b, *rest)
        assert _planes_equal(a, b), "decode update differs from the reference"
        n_pools = int((positions % 4 == 3).sum())
        # Rows (key + gate), every ring read and written once, the completed pools.
        nbytes = n * 2 * D * 4 + b_dec * 2 * (2 * 4 * D * 4) + n_pools * (D + 4)
        t_k = cx.bench(K.update_decode_pools, a, *rest)
        t_r = cx.bench(R.update_decode_pools, b, *rest, slow=True)
        cx.record(f"decode update B={b_dec} width={width}", nbytes, t_k, t_r, f"{n_pools} pools")


def bench_prefill(cx: _Ctx) -> None:
    """Prefill: 4 sequences x 4096-token chunks at unaligned starts; pools, tail and latent rows."""
    K, R, dev = cx.K, cx.R, cx.dev
    b_pre, chunk = PREFILL_SEQS, PREFILL_CHUNK
    pages_per_seq = 2 * chunk // P + 2
    c_pre = cx.cache(b_pre * pages_per_seq, b_pre, latent=True)
    table = torch.randperm(b_pre * pages_per_seq, device=dev).view(b_pre, pages_per_seq).to(torch.int32)
    slots = torch.arange(b_pre, device=dev)
    ape = torch.randn(4, D, device=dev)
    starts = torch.tensor([0, 1, 2, chunk + 3], device=dev)[:b_pre]
    positions = (starts[:, None] + torch.arange(chunk, device=dev)[None, :]).flatten()
    row_seq = torch.arange(b_pre, device=dev).repeat_interleave(chunk)
    n = positions.numel()
    key, gate = torch.randn(n, D, device=dev), torch.randn(n, D, device=dev)
    a, b = _clone(c_pre), _clone(c_pre)
    rest = (key, gate, ape, positions, row_seq, table, slots)
    K.update_prefill(a, *rest)
    R.update_prefill(b, *rest)
    assert _planes_equal(a, b), "prefill update differs from the reference"
    n_pools = int((positions % 4 == 3).sum())
    nbytes = n * 2 * D * 4 + n_pools * (D + 4)
    t_k = cx.bench(K.update_prefill_pools, a, *rest)
    t_r = cx.bench(R.update_prefill_pools, b, *rest)
    cx.record(f"prefill pools N={n}", nbytes, t_k, t_r, f"{n_pools} pools")
    tail = (key, gate, positions, row_seq, slots)
    t_k = cx.bench(K.write_prefill_tail, a.tail_ring, *tail)
    t_r = cx.bench(R.write_prefill_tail, b.tail_ring, *tail)
    cx.record(f"prefill tail N={n}", b_pre * 4 * 2 * D * 4 * 2, t_k, t_r, "launch-bound")
    lat_rows = torch.randn(n, LATENT, device=dev)
    lat = (lat_rows, positions, row_seq, table, P)
    K.write_latent_rows(a.latent, *lat)
    R.write_latent_rows(b.latent, *lat)
    assert torch.equal(_bits(a.latent), _bits(b.latent)), "latent rows differ from the reference"
    t_k = cx.bench(K.write_latent_rows, a.latent, *lat)
    t_r = cx.bench(R.write_latent_rows, b.latent, *lat)
    cx.record(f"latent rows N={n} fp32->bf16", n * LATENT * (4 + 2), t_k, t_r)


def bench_rotate_quant(cx: _Ctx) -> None:
    """Query rotate-quantise: 2048 rows x 32 heads."""
    K, R = cx.K, cx.R
    q_idx = torch.randn(ROTATE_ROWS, H_IDX, D, device=cx.dev)
    qk, sk = K.rotate_quant(q_idx)
    qr, sr = R.rotate_quant(q_idx)
    assert torch.equal(_bits(qk), _bits(qr)) and torch.equal(sk, sr), "rotate_quant differs from the reference"
    nbytes = q_idx.numel() * 4 + q_idx.numel() + sk.numel() * 4
    cx.record(
        f"rotate_quant {ROTATE_ROWS}x{H_IDX} rows",
        nbytes,
        cx.bench(K.rotate_quant, q_idx),
        cx.bench(R.rotate_quant, q_idx),
    )


def bench_score(cx: _Ctx) -> None:
    """Scoring: 64 decode rows over their own 32k-token sequences, and a 1024-row prefill chunk."""
    K, R, dev = cx.K, cx.R, cx.dev
    b_sc, ctx = SCORE_SEQS, SCORE_CTX
    pages_per_seq = ctx // P
    c_sc = cx.cache(b_sc * pages_per_seq, 1)
    table = torch.randperm(b_sc * pages_per_seq, device=dev).view(b_sc, pages_per_seq).to(torch.int32)
    positions = torch.full((b_sc,), ctx - 1, device=dev)
    row_seq = torch.arange(b_sc, device=dev)
    q8, qscale = K.rotate_quant(torch.randn(b_sc, H_IDX, D, device=dev))
    w = R.indexer_head_weights(torch.randn(b_sc, H_IDX, device=dev), qscale, H_IDX)
    max_pools = ctx // 4
    sargs = (q8, w, c_sc.index_k, c_sc.index_scale, positions, row_seq, table, P, max_pools)
    s_ref = R.score_pools(*sargs)
    t_r = cx.bench(R.score_pools, *sargs)
    # Per row and pool: the e4m3 key, its scale and its score; plus the queries (table reads are negligible).
    nbytes = b_sc * max_pools * (D + 4 + 4) + b_sc * H_IDX * (D + 4)
    score_mod = K.kernel_module("score", dev)
    for block_p, iters, warps in ((64, 4, 4), (128, 2, 8), (64, 8, 4), (32, 8, 4)):
        for decode in ("arith", "hw"):
            kw = {"block_p": block_p, "iters": iters, "num_warps": warps, "fp8_decode": decode}
            err = ((score_mod.score_pools(*sargs, **kw) - s_ref).abs().max() / s_ref.abs().max()).item()
            assert err < 1e-5, f"scores differ from the reference (relative {err:.2e})"
            t_k = cx.bench(score_mod.score_pools, *sargs, **kw)
            name = f"score decode {b_sc}x{max_pools} bp={block_p} it={iters} w={warps} {decode}"
            cx.record(name, nbytes, t_k, t_r, f"rel err {err:.1e}")

    n_pf = SCORE_PREFILL_ROWS
    positions = torch.arange(ctx - n_pf, ctx, device=dev)
    row_seq = torch.zeros(n_pf, dtype=torch.long, device=dev)
    q8, qscale = K.rotate_quant(torch.randn(n_pf, H_IDX, D, device=dev))
    w = R.indexer_head_weights(torch.randn(n_pf, H_IDX, device=dev), qscale, H_IDX)
    sargs = (q8, w, c_sc.index_k, c_sc.index_scale, positions, row_seq, table, P, max_pools)
    s_ref = R.score_pools(*sargs)
    fin = torch.isfinite(s_ref)
    t_r = cx.bench(R.score_pools, *sargs)
    flops = 2 * D * H_IDX * float(((positions + 1) // 4).sum())
    # Keys are shared by all rows (read once at best); the score matrix dominates.
    nbytes = max_pools * (D + 4) + n_pf * max_pools * 4 + n_pf * H_IDX * (D + 4)
    for decode in ("arith", "hw"):
        got = score_mod.score_pools(*sargs, fp8_decode=decode)
        err = ((got[fin] - s_ref[fin]).abs().max() / s_ref[fin].abs().max()).item()
        assert err < 1e-5, f"prefill scores differ from the reference (relative {err:.2e})"
        t_k = cx.bench(score_mod.score_pools, *sargs, fp8_decode=decode)
        note = f"{flops / (t_k * 1e-6) / 1e12:.0f} of {cx.mm:.0f} TFLOP/s"
        cx.record(f"score prefill {n_pf}x{max_pools} {decode}", nbytes, t_k, t_r, note)


def bench_expand(cx: _Ctx) -> None:
    """Expansion: 2048 rows, top-512 pools of 8192, width 2051."""
    K, R, dev = cx.K, cx.R, cx.dev
    n_ex, ctx = EXPAND_ROWS, SCORE_CTX
    positions = torch.randint(4 * TOPK_POOLS, ctx, (n_ex,), device=dev)
    ids = R.select_topk_pools(torch.randn(n_ex, ctx // 4, device=dev), positions, TOPK_POOLS)
    assert torch.equal(K.expand_selection(ids, positions, WIDTH), R.expand_selection(ids, positions, WIDTH))
    out = torch.empty(n_ex, WIDTH, dtype=torch.int32, device=dev)
    t_k = cx.bench(K.expand_selection, ids, positions, WIDTH, out=out)
    t_r = cx.bench(R.expand_selection, ids, positions, WIDTH)
    cx.record(f"expand {n_ex}x{TOPK_POOLS} -> {WIDTH}", n_ex * (TOPK_POOLS + WIDTH) * 4, t_k, t_r)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions")
    parser.add_argument("--json", default=None, help="also write the rows as JSON to this path")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_kpool_kernels: CUDA is not available; nothing to benchmark.")
        return 0
    dev = torch.device("cuda")
    torch.manual_seed(0)
    print(device_line(dev), flush=True)
    ceiling = copy_ceiling_gbs(dev, args.quick)
    mm = _matmul_ceiling(dev, args.quick)
    print(f"copy ceiling: {ceiling:.0f} GB/s (read + write); fp16 matmul: {mm:.0f} TFLOP/s", flush=True)
    cx = _Ctx(dev, args.quick, ceiling, mm)
    failed = []
    for section in (bench_decode, bench_prefill, bench_rotate_quant, bench_score, bench_expand):
        # One broken section must not lose the others' numbers.
        try:
            section(cx)
            print(f"done: {section.__name__}", flush=True)
        except Exception as e:  # noqa: BLE001 - reported and reflected in the exit code
            failed.append(section.__name__)
            print(f"FAILED: {section.__name__}: {type(e).__name__}: {e}", flush=True)
        torch.cuda.empty_cache()

    print()
    head = f"{'kernel':<48} {'us':>9} {'MB':>8} {'GB/s':>7} {'%copy':>6} {'torch us':>10} {'speedup':>8}  note"
    print(head)
    print("-" * len(head))
    for r in cx.rows:
        ref = f"{r.ref_us:10.1f}" if r.ref_us is not None else f"{'-':>10}"
        sp = f"{r.speedup:8.1f}" if r.speedup is not None else f"{'-':>8}"
        print(f"{r.name:<48} {r.kernel_us:9.1f} {r.mbytes:8.2f} {r.gbps:7.0f} {r.pct_copy:6.1f} {ref} {sp}  {r.note}")
    if failed:
        print(f"failed sections: {failed}")
    if args.json:
        with open(args.json, "w") as f:
            rows = [asdict(r) for r in cx.rows]
            json.dump({"copy_gbps": ceiling, "matmul_tflops": mm, "rows": rows}, f, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
