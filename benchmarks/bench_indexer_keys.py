"""GPU cost of BF16 indexer keys against FP8 keys (docs/indexer_keys.md): the kernels that touch the keys.

Real geometry (32 indexer heads x 128, pages of 64 tokens); per case the median of
``triton.testing.do_bench`` (L2 flushed) for ``indexer_key_dtype`` fp8 and bf16, and the ratio:

* score, decode: 64 rows, each over its own 32K-token sequence (8192 pools): memory bound on the keys,
  which double (132 -> 256 bytes a pool);
* score, prefill: a 1024-row chunk at the end of a 32K sequence (compute bound);
* cache writes: 128 verify rows (64 sequences x width 2, each completing a pool) and a 16384-row prefill
  chunk (the pooled key stored as bf16 instead of rotated and quantised).

Each kernel result is first checked against the torch reference (scores to 1e-5 relative, pools bitwise).

    python -m benchmarks.bench_indexer_keys [--quick] [--json out.json]
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from functools import partial

import torch

from benchmarks.harness.rows import write_json
from benchmarks.harness.timing import bench_us, do_bench_us
from trtllm_glm.attention.sparse.glm_kpool import kernels as K
from trtllm_glm.attention.sparse.glm_kpool import ops as R
from trtllm_glm.cache.manager import KpoolLayerCache

D, H_IDX, P = 128, 32, 64
CTX, SEQS, PREFILL_ROWS = 32768, 64, 1024
DECODE_ROWS, PREFILL_CHUNK = 128, 16384


def _bench(fn: Callable[[], object], quick: bool) -> float:
    return do_bench_us(fn, 5, 30) if quick else bench_us(fn)


def _cache(kd: str, num_pages: int, num_slots: int, dev: torch.device) -> KpoolLayerCache:
    if kd == "bf16":
        ik = torch.randn(num_pages, P // 4, D, device=dev).to(torch.bfloat16)
        return KpoolLayerCache(torch.empty(0, device=dev), ik, None, torch.randn(num_slots, 2, 4, D, device=dev), P)
    q, s = R.rotate_quant(torch.randn(num_pages, P // 4, D, device=dev))
    return KpoolLayerCache(torch.empty(0, device=dev), q, s, torch.randn(num_slots, 2, 4, D, device=dev), P)


def _clone(c: KpoolLayerCache) -> KpoolLayerCache:
    scale = None if c.index_scale is None else c.index_scale.clone()
    return KpoolLayerCache(c.latent, c.index_k.clone(), scale, c.tail_ring.clone(), P)


def _queries(kd: str, n: int, dev: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    q_idx = torch.randn(n, H_IDX, D, device=dev)
    logits = torch.randn(n, H_IDX, device=dev)
    if kd == "bf16":
        return q_idx.to(torch.bfloat16), R.indexer_head_weights(logits, None, H_IDX)
    q8, qscale = K.rotate_quant(q_idx)
    return q8, R.indexer_head_weights(logits, qscale, H_IDX)


def run(quick: bool, dev: torch.device) -> list[dict]:
    torch.manual_seed(0)
    rows: list[dict] = []
    pages_per_seq = CTX // P
    table = torch.randperm(SEQS * pages_per_seq, device=dev).view(SEQS, pages_per_seq).to(torch.int32)
    max_pools = CTX // 4
    cases: dict[str, dict[str, float]] = {}
    for kd in ("fp8", "bf16"):
        c = _cache(kd, SEQS * pages_per_seq, DECODE_ROWS + 1, dev)
        # Score, decode rows.
        pos = torch.full((SEQS,), CTX - 1, device=dev)
        seq = torch.arange(SEQS, device=dev)
        q, w = _queries(kd, SEQS, dev)
        args = (q, w, c.index_k, c.index_scale, pos, seq, table, P, max_pools)
        ref = R.score_pools(*args)
        err = ((K.score_pools(*args) - ref).abs().max() / ref.abs().max()).item()
        assert err < 1e-5, f"{kd} decode scores differ from the reference ({err:.1e})"
        cases.setdefault("score decode 64 rows x 8192 pools", {})[kd] = _bench(partial(K.score_pools, *args), quick)
        # Score, a prefill chunk of one sequence.
        pos = torch.arange(CTX - PREFILL_ROWS, CTX, device=dev)
        seq = torch.zeros(PREFILL_ROWS, dtype=torch.long, device=dev)
        q, w = _queries(kd, PREFILL_ROWS, dev)
        args = (q, w, c.index_k, c.index_scale, pos, seq, table, P, max_pools)
        ref = R.score_pools(*args)
        fin = torch.isfinite(ref)
        err = ((K.score_pools(*args)[fin] - ref[fin]).abs().max() / ref[fin].abs().max()).item()
        assert err < 1e-5, f"{kd} prefill scores differ from the reference ({err:.1e})"
        name = "score prefill 1024 rows x 8192 pools"
        cases.setdefault(name, {})[kd] = _bench(partial(K.score_pools, *args), quick)
        # Cache writes.
        ape = torch.randn(4, D, device=dev)
        key, gate = torch.randn(PREFILL_CHUNK, D, device=dev), torch.randn(PREFILL_CHUNK, D, device=dev)
        # Verify-like rows: two per sequence at positions CTX / 2 + 2, + 3: every sequence completes a pool.
        dseq = torch.arange(SEQS, device=dev).repeat_interleave(DECODE_ROWS // SEQS)
        dpos = CTX // 2 + 2 + torch.arange(DECODE_ROWS, device=dev) % (DECODE_ROWS // SEQS)
        slots = torch.arange(SEQS, device=dev)
        ref_c, ker_c = _clone(c), _clone(c)
        R.update_decode_pools(ref_c, key[:DECODE_ROWS], gate[:DECODE_ROWS], ape, dpos, dseq, table, slots)
        K.update_decode_pools(ker_c, key[:DECODE_ROWS], gate[:DECODE_ROWS], ape, dpos, dseq, table, slots)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        assert torch.equal(ref_c.index_k.view(torch.uint8), ker_c.index_k.view(torch.uint8)), f"{kd} decode pools"
        dargs = (ker_c, key[:DECODE_ROWS], gate[:DECODE_ROWS], ape, dpos, dseq, table, slots)
        cases.setdefault("decode update 64 x 2 rows", {})[kd] = _bench(partial(K.update_decode_pools, *dargs), quick)
        ppos = torch.arange(PREFILL_CHUNK, device=dev)
        pseq = torch.zeros(PREFILL_CHUNK, dtype=torch.long, device=dev)
        pargs = (ker_c, key, gate, ape, ppos, pseq, table, slots)
        cases.setdefault("prefill pools 16384 rows", {})[kd] = _bench(partial(K.update_prefill_pools, *pargs), quick)
    for name, t in cases.items():
        row = {"case": name, "fp8_us": round(t["fp8"], 2), "bf16_us": round(t["bf16"], 2)}
        row["bf16_over_fp8"] = round(t["bf16"] / t["fp8"], 3)
        print(f"{name:40s} fp8 {t['fp8']:9.2f} us   bf16 {t['bf16']:9.2f} us   x{row['bf16_over_fp8']:.3f}", flush=True)
        rows.append(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer repetitions")
    ap.add_argument("--json", default=None, metavar="FILE")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_indexer_keys.py needs CUDA")
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    rows = run(args.quick, torch.device("cuda"))
    if args.json:
        write_json(args.json, rows)


if __name__ == "__main__":
    main()
