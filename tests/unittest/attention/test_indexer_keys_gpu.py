"""BF16 indexer keys (docs/indexer_keys.md) on CUDA at real GLM-5.3-Flash geometry.

Compiled Triton kernels against the torch reference with bf16 ``index_k`` and no scale plane: indexer 32
heads x 128, page size 64, prompts of 777-5122 tokens in uneven prefill chunks, then decode and verify steps
(widths up to 8); the planes start poisoned (random bf16 bit patterns, random rings). Pools and rings must be
bit-identical; scores (bf16 operands on the tensor cores, fp32 accumulation) agree with the reference's fp64
dot to fp32 rounding, and top-k selections may differ only at near ties. Then the option end to end with
CUDA graphs on the ``small`` preset: speculative (MTP) greedy equals plain greedy in fp32 with BF16 keys.
Run with ``-s`` to see the counts and errors.
"""

from __future__ import annotations

import pytest
import torch

from benchmarks.harness.selection_recall import assert_differences_at_near_ties
from trtllm_glm.attention.sparse.glm_kpool import kernels as K
from trtllm_glm.attention.sparse.glm_kpool import ops as R
from trtllm_glm.cache.manager import KpoolLayerCache

pytestmark = pytest.mark.gpu

D, H_IDX, P = 128, 32, 64
TOPK_POOLS = 2048 // 4
PROMPTS = [3001, 4099, 2050, 5122, 777]
CHUNK = 1024
NUM_SLOTS = 8


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def _mismatch(name: str, a: torch.Tensor, b: torch.Tensor) -> int:
    bad = int((_bits(a) != _bits(b)).sum())
    print(f"[idxkeys-gpu] {name}: {bad} of {a.numel()} elements differ bitwise")
    return bad


def _clone(c: KpoolLayerCache) -> KpoolLayerCache:
    return KpoolLayerCache(c.latent, c.index_k.clone(), None, c.tail_ring.clone(), c.page_size)


class _Scenario:
    def __init__(self, seed: int, extra: int) -> None:
        dev = torch.device("cuda")
        g = torch.Generator().manual_seed(seed)
        total = [n + extra for n in PROMPTS]
        width = max(-(-n // P) for n in total)
        num_pages = len(PROMPTS) * width + 16
        self.table = torch.randperm(num_pages, generator=g)[: len(PROMPTS) * width].view(len(PROMPTS), width)
        self.table = self.table.to(torch.int32).to(dev)
        self.slots = torch.randperm(NUM_SLOTS, generator=g)[: len(PROMPTS)].to(dev)
        self.key = [torch.randn(n, D, generator=g).to(dev) for n in total]
        self.gate = [(torch.randn(n, D, generator=g) * 2).to(dev) for n in total]
        self.ape = torch.randn(4, D, generator=g).to(dev)
        ik = torch.randint(-(2**15), 2**15, (num_pages, P // 4, D), generator=g, dtype=torch.int16)
        self.cache = KpoolLayerCache(
            latent=torch.empty(0, device=dev),
            index_k=ik.view(torch.bfloat16).to(dev),
            index_scale=None,
            tail_ring=(torch.randn(NUM_SLOTS, 2, 4, D, generator=g) * 3).to(dev),
            tokens_per_block=P,
        )

    def batch(self, spans):
        dev = self.table.device
        key = torch.cat([self.key[b][s : s + n] for b, s, n in spans])
        gate = torch.cat([self.gate[b][s : s + n] for b, s, n in spans])
        positions = torch.cat([torch.arange(s, s + n) for _, s, n in spans]).to(dev)
        row_seq = torch.cat([torch.full((n,), b) for b, _, n in spans]).to(dev)
        return key, gate, positions, row_seq

    def step(self, ref: KpoolLayerCache, ker: KpoolLayerCache, spans, decode: bool) -> int:
        key, gate, positions, row_seq = self.batch(spans)
        rfn = R.update_decode_pools if decode else R.update_prefill
        kfn = K.update_decode_pools if decode else K.update_prefill
        rfn(ref, key, gate, self.ape, positions, row_seq, self.table, self.slots)
        kfn(ker, key, gate, self.ape, positions, row_seq, self.table, self.slots)
        torch.cuda.synchronize()
        return _mismatch("index_k", ref.index_k, ker.index_k) + _mismatch("tail_ring", ref.tail_ring, ker.tail_ring)

    def prefill_all(self, ref: KpoolLayerCache, ker: KpoolLayerCache) -> int:
        bad, done = 0, [0] * len(PROMPTS)
        while any(d < n for d, n in zip(done, PROMPTS)):
            spans = [(b, d, min(CHUNK - 37 * b, n - d)) for b, (d, n) in enumerate(zip(done, PROMPTS)) if d < n]
            bad += self.step(ref, ker, spans, decode=False)
            for b, _, n in spans:
                done[b] += n
        return bad


def test_bf16_pools_prefill_decode_verify_bit_exact() -> None:
    sc = _Scenario(seed=11, extra=24)
    ref, ker = sc.cache, _clone(sc.cache)
    bad = sc.prefill_all(ref, ker)
    pos = list(PROMPTS)
    for widths in ([1, 1, 1, 1, 1], [8, 3, 1, 5, 2], [2, 8, 4, 1, 7], [1, 6, 8, 3, 1]):
        bad += sc.step(ref, ker, [(b, p, w) for b, (p, w) in enumerate(zip(pos, widths))], decode=True)
        pos = [p + w for p, w in zip(pos, widths)]
    assert bad == 0


def test_bf16_scores_and_selection() -> None:
    dev = torch.device("cuda")
    sc = _Scenario(seed=12, extra=8)
    ref, ker = sc.cache, _clone(sc.cache)
    sc.prefill_all(ref, ker)
    g = torch.Generator().manual_seed(13)
    spans = [(b, n - 1, 1) for b, n in enumerate(PROMPTS)] + [(1, PROMPTS[1] - 8, 8), (3, PROMPTS[3] - 300, 300)]
    _, _, positions, row_seq = sc.batch(spans)
    n = positions.numel()
    q = torch.randn(n, H_IDX, D, generator=g).to(dev).to(torch.bfloat16)
    w = R.indexer_head_weights(torch.randn(n, H_IDX, generator=g).to(dev), None, H_IDX)
    max_pools = max(PROMPTS) // 4 + 8
    args = (q, w, ker.index_k, None, positions, row_seq, sc.table, P, max_pools)
    s_ref = R.score_pools(*args)
    bound = R.score_pools(q.abs(), w.abs(), ker.index_k.abs(), *args[3:])
    fin = torch.isfinite(s_ref)
    mod = K.kernel_module("score", dev)
    for decode in ("hw", "arith"):  # bf16 operands on the tensor cores / widened to fp32 (IEEE dot)
        out = torch.full((n, max_pools), 777.0, device=dev)
        s_ker = mod.score_pools(*args, out=out, fp8_decode=decode)
        torch.cuda.synchronize()
        assert torch.equal(torch.isneginf(s_ker), torch.isneginf(s_ref))
        rel = ((s_ker[fin] - s_ref[fin]).abs() / bound[fin].clamp(min=1e-30)).max().item()
        print(f"[idxkeys-gpu] bf16 scores ({decode}): max err/bound {rel:.2e}")
        assert rel < 1e-5
    s_ker = K.score_pools(*args)
    ids_ref = R.select_topk_pools(s_ref, positions, TOPK_POOLS)
    ids_ker = K.select_topk_pools(s_ker, positions, TOPK_POOLS)
    rows_diff = (ids_ref != ids_ker).any(dim=1)
    print(f"[idxkeys-gpu] top-{TOPK_POOLS} with bf16 keys: {int(rows_diff.sum())} of {n} rows differ")
    assert_differences_at_near_ties(ids_ref, ids_ker, s_ref, bound)


def test_bf16_keys_with_cuda_graphs_mtp_equals_plain() -> None:
    from trtllm_glm import LLM, KvCacheConfig, MTPDecodingConfig, SamplingParams
    from trtllm_glm.runtime.lossless import compare_greedy

    prompts = [[(7 * i + n) % 250 + 2 for i in range(n)] for n in (300, 77, 1030)]
    sp = SamplingParams(max_tokens=24, ignore_eos=True)
    kv = KvCacheConfig(indexer_key_dtype="bf16")
    plain = LLM("small", dtype=torch.float32, device="cuda", kv_cache_config=kv, warmup=False)
    assert plain.executor.manager.index_k.dtype == torch.bfloat16 and plain.executor.graph_runner is not None
    want = [o.outputs[0] for o in plain.generate(prompts, sp)]
    spec = LLM(
        "small", dtype=torch.float32, device="cuda", kv_cache_config=kv, warmup=False,
        speculative_config=MTPDecodingConfig(adaptive=False, num_nextn_predict_layers=3),
    )  # fmt: skip
    got = [o.outputs[0].token_ids for o in spec.generate(prompts, sp)]
    for w, g in zip(want, got):
        d = compare_greedy(w.token_ids, w.logit_gaps, g)
        assert d is None or d.excused, d  # fp32: identical but for a near tie of the plain run
