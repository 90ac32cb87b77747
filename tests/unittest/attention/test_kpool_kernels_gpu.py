"""Triton indexer kernels (compiled, CUDA) against the torch reference ops at real GLM-5.3-Flash geometry.

Indexer 32 heads x 128, page size 64, kv_lora 512 (bf16 latent), index_topk 2048 (512 pools, selection
width 2051), several requests of a few thousand tokens, chunked prefill then decode and verify steps. The
cache planes start poisoned (garbage e4m3 bytes including NaN codes, NaN scales, random rings, NaN
latent rows). Pools, scales, rings, latent rows, pooled fp32 keys, the FWHT and the query quantisation
must be bit-identical; scores agree to fp32 rounding, and selections may differ only at near-ties of the
reference scores. Needs CUDA (tests/conftest.py skips ``gpu`` tests without it); run with ``-s`` to see
the mismatch counts and errors.
"""

from __future__ import annotations

import pytest
import torch

from benchmarks.harness.selection_recall import assert_differences_at_near_ties
from trtllm_glm.attention.sparse.glm_kpool import kernels as K
from trtllm_glm.attention.sparse.glm_kpool import ops as R
from trtllm_glm.cache.manager import KpoolLayerCache

pytestmark = pytest.mark.gpu

D, H_IDX, P, LATENT = 128, 32, 64, 512
TOPK_POOLS, WIDTH = 2048 // 4, 2048 + 3
PROMPTS = [3001, 4099, 2050, 5122, 777]  # every alignment mod 4 and mod 64
CHUNK = 1024
NUM_SLOTS = 8


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def _mismatch(name: str, a: torch.Tensor, b: torch.Tensor) -> int:
    bad = int((_bits(a) != _bits(b)).sum())
    print(f"[kpool-gpu] {name}: {bad} of {a.numel()} elements differ bitwise")
    return bad


def _planes_mismatch(what: str, ref: KpoolLayerCache, ker: KpoolLayerCache) -> int:
    return (
        _mismatch(f"{what} index_k", ref.index_k, ker.index_k)
        + _mismatch(f"{what} index_scale", ref.index_scale, ker.index_scale)
        + _mismatch(f"{what} tail_ring", ref.tail_ring, ker.tail_ring)
        + _mismatch(f"{what} latent", ref.latent, ker.latent)
    )


def _clone(c: KpoolLayerCache) -> KpoolLayerCache:
    return KpoolLayerCache(c.latent.clone(), c.index_k.clone(), c.index_scale.clone(), c.tail_ring.clone(), c.page_size)


class _Scenario:
    """Requests, their slot table and state slots, and one key/gate/latent row per token, on the GPU."""

    def __init__(self, seed: int, extra_tokens: int) -> None:
        dev = torch.device("cuda")
        g = torch.Generator().manual_seed(seed)
        self.total = [n + extra_tokens for n in PROMPTS]
        width = max(-(-n // P) for n in self.total)
        num_pages = len(PROMPTS) * width + 16
        self.table = torch.randperm(num_pages, generator=g)[: len(PROMPTS) * width].view(len(PROMPTS), width)
        self.table = self.table.to(torch.int32).to(dev)
        self.slots = torch.randperm(NUM_SLOTS, generator=g)[: len(PROMPTS)].to(dev)
        self.key = [torch.randn(n, D, generator=g).to(dev) for n in self.total]
        self.gate = [(torch.randn(n, D, generator=g) * 2).to(dev) for n in self.total]
        self.latent_rows = [torch.randn(n, LATENT, generator=g).to(dev) for n in self.total]
        self.ape = torch.randn(4, D, generator=g).to(dev)
        index_k = torch.randint(0, 256, (num_pages, P // 4, D), generator=g, dtype=torch.uint8)
        self.cache = KpoolLayerCache(
            latent=torch.full((num_pages, P, LATENT), float("nan"), dtype=torch.bfloat16, device=dev),
            index_k=index_k.view(torch.float8_e4m3fn).to(dev),
            index_scale=torch.full((num_pages, P // 4), float("nan"), device=dev),
            tail_ring=(torch.randn(NUM_SLOTS, 2, 4, D, generator=g) * 3).to(dev),
            tokens_per_block=P,
        )

    def batch(self, spans: list[tuple[int, int, int]]):
        """Rows for ``(sequence, start, length)`` spans: key, gate, latent rows, positions, row_seq."""
        dev = self.table.device
        key = torch.cat([self.key[b][s : s + n] for b, s, n in spans])
        gate = torch.cat([self.gate[b][s : s + n] for b, s, n in spans])
        lat = torch.cat([self.latent_rows[b][s : s + n] for b, s, n in spans])
        positions = torch.cat([torch.arange(s, s + n) for _, s, n in spans]).to(dev)
        row_seq = torch.cat([torch.full((n,), b) for b, _, n in spans]).to(dev)
        return key, gate, lat, positions, row_seq

    def step(self, ref: KpoolLayerCache, ker: KpoolLayerCache, spans, decode: bool) -> None:
        key, gate, lat, positions, row_seq = self.batch(spans)
        rfn = R.update_decode_pools if decode else R.update_prefill
        kfn = K.update_decode_pools if decode else K.update_prefill
        rfn(ref, key, gate, self.ape, positions, row_seq, self.table, self.slots)
        kfn(ker, key, gate, self.ape, positions, row_seq, self.table, self.slots)
        R.write_latent_rows(ref.latent, lat, positions, row_seq, self.table, P)
        K.write_latent_rows(ker.latent, lat, positions, row_seq, self.table, P)


def _prefill_all(sc: _Scenario, ref: KpoolLayerCache, ker: KpoolLayerCache) -> int:
    """Chunked prefill of every prompt, all requests in each step; returns the total mismatch count."""
    bad = 0
    done = [0] * len(PROMPTS)
    step = 0
    while any(d < n for d, n in zip(done, PROMPTS)):
        # Uneven chunks so that chunk starts fall on every alignment.
        spans = [(b, d, min(CHUNK - 37 * b, n - d)) for b, (d, n) in enumerate(zip(done, PROMPTS)) if d < n]
        sc.step(ref, ker, spans, decode=False)
        torch.cuda.synchronize()
        bad += _planes_mismatch(f"prefill step {step}", ref, ker)
        for b, _, n in spans:
            done[b] += n
        step += 1
    return bad


def test_fp8_chain_pieces_bit_exact() -> None:
    dev = torch.device("cuda")
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(4096, D, generator=g) * torch.exp(torch.randn(4096, D, generator=g) * 3)).to(dev)
    assert _mismatch("fwht (fp32)", K.fwht(x), R.fwht(x)) == 0
    q_idx = torch.randn(2048, H_IDX, D, generator=g).to(dev)
    qk, sk = K.rotate_quant(q_idx)
    qr, sr = R.rotate_quant(q_idx)
    assert _mismatch("rotate_quant q8", qk, qr) + _mismatch("rotate_quant scale", sk, sr) == 0
    grid = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    grid = grid[~grid.isnan()].unique()
    v = torch.cat([x.flatten()[:100000].cpu(), grid, (grid[1:] + grid[:-1]) / 2]).to(dev)
    assert _mismatch("round_to_e4m3", K.round_to_e4m3(v), R.round_to_e4m3(v)) == 0
    assert _mismatch("pow2_scale", K.pow2_scale(v.abs()), R.pow2_scale(v.abs())) == 0
    key = torch.randn(20000, 4, D, generator=g).to(dev)
    gate = (torch.randn(20000, 4, D, generator=g) * 4).to(dev)
    ape = torch.randn(4, D, generator=g).to(dev)
    # Catches an FMA contraction or a different exp: both move the fp32 result by an ulp.
    assert _mismatch("pool_keys (fp32)", K.pool_keys(key, gate, ape), R.pool_keys(key, gate, ape)) == 0


def test_prefill_then_decode_and_verify_bit_exact() -> None:
    sc = _Scenario(seed=1, extra_tokens=24)
    ref = sc.cache
    ker = _clone(ref)
    bad = _prefill_all(sc, ref, ker)
    # Decode (width 1) and verify-style steps (widths up to 8) per request, mixed in one batch.
    pos = list(PROMPTS)
    for step, widths in enumerate([[1, 1, 1, 1, 1], [8, 3, 1, 5, 2], [2, 8, 4, 1, 7], [1, 6, 8, 3, 1]]):
        spans = [(b, p, w) for b, (p, w) in enumerate(zip(pos, widths))]
        sc.step(ref, ker, spans, decode=True)
        torch.cuda.synchronize()
        bad += _planes_mismatch(f"decode step {step} widths {widths}", ref, ker)
        pos = [p + w for p, w in zip(pos, widths)]
    assert bad == 0


def test_scores_selection_and_expansion() -> None:
    dev = torch.device("cuda")
    sc = _Scenario(seed=2, extra_tokens=8)
    ref = sc.cache
    ker = _clone(ref)
    _prefill_all(sc, ref, ker)
    g = torch.Generator().manual_seed(3)
    # Query rows: one decode row per request, a verify group of 8, and a 300-row prefill chunk.
    spans = [(b, n - 1, 1) for b, n in enumerate(PROMPTS)] + [(1, PROMPTS[1] - 8, 8), (3, PROMPTS[3] - 300, 300)]
    _, _, _, positions, row_seq = sc.batch(spans)
    n = positions.numel()
    q_idx = torch.randn(n, H_IDX, D, generator=g).to(dev)
    q8, qscale = K.rotate_quant(q_idx)
    w = R.indexer_head_weights(torch.randn(n, H_IDX, generator=g).to(dev), qscale, H_IDX)
    max_pools = max(PROMPTS) // 4 + 8
    args = (q8, w, ker.index_k, ker.index_scale, positions, row_seq, sc.table, P, max_pools)
    s_ref = R.score_pools(*args)
    abs_args = (
        q8.float().abs().to(torch.float8_e4m3fn),
        w.abs(),
        ker.index_k.float().abs().to(torch.float8_e4m3fn),
        *args[3:],
    )
    bound = R.score_pools(*abs_args)
    for decode in ("arith", "hw"):
        out = torch.full((n, max_pools), 777.0, device=dev)
        mod = K.kernel_module("score", dev)
        s_ker = mod.score_pools(*args, out=out, fp8_decode=decode)
        torch.cuda.synchronize()
        assert torch.equal(torch.isneginf(s_ker), torch.isneginf(s_ref))
        fin = torch.isfinite(s_ref)
        err = (s_ker[fin] - s_ref[fin]).abs()
        rel = (err / bound[fin].clamp(min=1e-30)).max().item()
        exact = (s_ker[fin] == s_ref[fin]).float().mean().item()
        print(f"[kpool-gpu] scores ({decode} fp8 decode): max err/bound {rel:.2e}, bit-equal {exact:.4f}")
        assert rel < 1e-5
    s_ker = K.score_pools(*args)
    ids_ref = R.select_topk_pools(s_ref, positions, TOPK_POOLS)
    ids_ker = R.select_topk_pools(s_ker, positions, TOPK_POOLS)
    rows_diff = (ids_ref != ids_ker).any(dim=1)
    print(f"[kpool-gpu] top-{TOPK_POOLS} pool selection: {int(rows_diff.sum())} of {n} rows differ")
    # A different choice is allowed only at a near-tie of the reference scores around the row's threshold.
    assert_differences_at_near_ties(ids_ref, ids_ker, s_ref, bound)
    sel_ref = R.expand_selection(ids_ref, positions, WIDTH)
    sel_out = torch.randint(-9, 99999, (n, WIDTH), dtype=torch.int32, device=dev)
    sel_ker = K.expand_selection(ids_ref, positions, WIDTH, out=sel_out)
    assert _mismatch("expand_selection", sel_ker, sel_ref) == 0
