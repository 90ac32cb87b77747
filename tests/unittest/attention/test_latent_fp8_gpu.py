"""The FP8 latent cache (``latent_dtype="fp8"``, docs/fp8.md "FP8 latent cache") on CUDA at real GLM-5.3-Flash
geometry: 512 latent columns (four scale blocks), 64 heads, page size 64, selections 2051 wide.

Compiled kernels against the torch reference: the writer bit for bit (poisoned planes, bf16 rows of wide
magnitudes, pages drawn from a larger pool in random order, padding rows); the sparse MLA reader with bf16 queries
(tensor cores on the dequantised rows, exact in bf16) to about one bf16 unit of the rows' size, and against the
same kernel over a bf16 plane holding the dequantised rows (the model-dtype path, the Gluon kernel on sm_90). Then
end to end with CUDA graphs on the ``small`` preset: greedy with the FP8 latent against the model-dtype cache, and
MTP greedy against plain greedy with the FP8 latent (near ties excused, docs/design.md §7). Run with ``-s`` to see
the errors.
"""

from __future__ import annotations

import pytest
import torch

from trtllm_glm.attention.sparse.glm_kpool import kernels as K
from trtllm_glm.attention.sparse.glm_kpool import ops as R

pytestmark = pytest.mark.gpu

E4M3 = torch.float8_e4m3fn
RANK, HEADS, P, WIDTH, NUM_PAGES = 512, 64, 64, 2051, 400


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def _batch(g: torch.Generator):
    """Decode rows, a verify of 8 and a prefill chunk, over sequences of 777-5122 tokens, pages from a larger pool."""
    past, qlen = [3001, 4099, 777, 5000], [1, 8, 1, 122]
    width = max(-(-(p + q) // P) for p, q in zip(past, qlen))
    table = torch.randperm(NUM_PAGES, generator=g)[: len(past) * width].view(len(past), width).to(torch.int32)
    positions = torch.cat([torch.arange(p, p + q) for p, q in zip(past, qlen)])
    row_seq = torch.cat([torch.full((q,), b) for b, q in enumerate(qlen)])
    return positions.cuda(), row_seq.cuda(), table.cuda()


def test_writer_bit_exact_at_real_geometry() -> None:
    g = torch.Generator().manual_seed(0)
    positions, row_seq, table = _batch(g)
    n = positions.numel()
    rows = torch.randn(n, RANK, generator=g) * torch.exp2(torch.randint(-12, 12, (n, 1), generator=g).float())
    rows = rows.to(torch.bfloat16).cuda()
    codes = torch.randint(0, 256, (NUM_PAGES, P, RANK), generator=g, dtype=torch.uint8).cuda()
    ref_lat, ref_sc = codes.view(E4M3), torch.full((NUM_PAGES, P, 4), float("nan"), device="cuda")
    ker_lat, ker_sc = ref_lat.clone(), ref_sc.clone()
    R.write_latent_rows(ref_lat, rows, positions, row_seq, table, P, latent_scale=ref_sc)
    seq_pad = torch.cat([row_seq, torch.full((3,), -1, device="cuda")])  # graph padding rows: skipped
    pos_pad = torch.cat([positions, torch.arange(3, device="cuda")])
    rows_pad = torch.cat([rows, torch.randn(3, RANK, device="cuda").to(torch.bfloat16)])
    K.write_latent_rows(ker_lat, rows_pad, pos_pad, seq_pad, table, P, latent_scale=ker_sc)
    torch.cuda.synchronize()
    assert torch.equal(_bits(ref_lat), _bits(ker_lat))
    assert torch.equal(_bits(ref_sc), _bits(ker_sc))


def test_sparse_mla_over_fp8_latent_at_real_geometry() -> None:
    g = torch.Generator().manual_seed(1)
    positions, row_seq, table = _batch(g)
    n = positions.numel()
    rows = torch.randn(NUM_PAGES * P, RANK, generator=g) * (1 + 3 * torch.rand(1, RANK, generator=g))
    q8, sc = R.quant_latent(rows.view(NUM_PAGES, P, RANK))
    lat, sc = q8.cuda(), sc.cuda()
    sel = torch.full((n, WIDTH), -1, dtype=torch.int32)
    for i, p in enumerate(positions.tolist()):
        k = min(WIDTH - 3, p + 1)
        sel[i, torch.randperm(WIDTH, generator=g)[:k]] = torch.randperm(p + 1, generator=g)[:k].to(torch.int32)
    sel = sel.cuda()
    q = (torch.randn(n, HEADS, RANK, generator=g) * 0.05).to(torch.bfloat16).cuda()
    ref = R.sparse_mla_attention(q, lat, sel, row_seq, table, P, 512**-0.5, latent_scale=sc).float()
    out = torch.full_like(q, float("nan"))
    got = K.sparse_mla_attention(q, lat, sel, row_seq, table, P, 512**-0.5, latent_scale=sc, out=out).float()
    dense = R.dequant_latent(lat, sc).to(torch.bfloat16)  # exact: e4m3 values times powers of two
    assert torch.equal(dense.float(), R.dequant_latent(lat, sc))
    model_dtype = K.sparse_mla_attention(q, dense, sel, row_seq, table, P, 512**-0.5).float()
    torch.cuda.synchronize()
    size = dense.float().abs().amax()
    err, err_model = (got - ref).abs().max() / size, (got - model_dtype).abs().max() / size
    print(f"[latent-fp8-gpu] sparse MLA, FP8 latent: max error {err:.2e} vs reference, {err_model:.2e} vs bf16 plane")
    assert torch.isfinite(got).all()
    assert err <= 2.0**-7 and err_model <= 2.0**-7


def test_fp8_latent_with_cuda_graphs_greedy_and_mtp() -> None:
    from trtllm_glm import LLM, KvCacheConfig, MTPDecodingConfig, SamplingParams
    from trtllm_glm.runtime.lossless import compare_greedy

    prompts = [[(7 * i + n) % 250 + 2 for i in range(n)] for n in (300, 77, 1030)]
    sp = SamplingParams(max_tokens=24, ignore_eos=True)

    def llm(latent: str, **kw) -> LLM:
        kv = KvCacheConfig(latent_dtype=latent)
        return LLM("small", dtype=torch.float32, device="cuda", kv_cache_config=kv, warmup=False, **kw)

    auto = [o.outputs[0] for o in llm("auto").generate(prompts, sp)]
    plain_llm = llm("fp8")
    assert plain_llm.executor.manager.latent.dtype == E4M3 and plain_llm.executor.graph_runner is not None
    plain = [o.outputs[0] for o in plain_llm.generate(prompts, sp)]
    spec = llm("fp8", speculative_config=MTPDecodingConfig(adaptive=False, num_nextn_predict_layers=3))
    got = [o.outputs[0].token_ids for o in spec.generate(prompts, sp)]
    for a, p, s in zip(auto, plain, got):
        for ref, test in ((a, p.token_ids), (p, s)):
            d = compare_greedy(ref.token_ids, ref.logit_gaps, test)
            assert d is None or d.excused, d
