"""Long-context prefill on the GPU (issue 32): the indexer and sparse MLA at a 1M-token context against their torch
references, and a 128K-token prompt of the 4-layer real slice whose next-token logits agree across chunk sizes.

* Indexer at 1M: one sequence of 1,048,000 tokens on shuffled pages of 64 (16,375 pages), query rows near its end
  and at chunk boundaries inside a pool; the score matrix has 262,144 columns (the power-of-two width the
  metadata gives), so row offsets times columns pass 2^31 for 8,192 rows (here the row stride alone is checked
  with a few rows: offsets are int64 in the kernels). Scores vs `ops.score_pools` (fp32 rounding), top-k ids vs
  `ops.select_topk_pools` (exact), and the selection expanded to token positions.
* Sparse MLA at 1M: the same rows attend to 2,051 selected tokens spread over the whole context (latent plane of
  16,384 pages x 64 x 512 bf16: 1 GiB); kernel vs `ops.sparse_mla_attention` in fp32 on the same bf16 inputs.
* 128K prompt (random bf16 weights of the real 4-layer slice, `benchmarks/harness/models.random_model`): prefilled in
  chunks of 8,192 and of 32,768 rows; the first sampled token's logits agree within bf16 noise (chunking changes
  GEMM shapes, so not bit for bit).

Needs CUDA (tests/conftest.py skips ``gpu`` tests without it); ~1 min on an H200 (most of it the two 128K prompts).
"""

from __future__ import annotations

from contextlib import contextmanager

import pytest
import torch

from trtllm_glm.attention.sparse.glm_kpool import kernels as K
from trtllm_glm.attention.sparse.glm_kpool import ops as R

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

P, HEADS_IDX, D_IDX, H, RANK, TOPK_POOLS = 64, 32, 128, 64, 512, 512
CONTEXT = 1_048_000
COLS = 1 << 18  # score_columns of a 1,048,000-token context: 262,000 pools rounded up


@pytest.fixture(scope="module")
def scene() -> dict[str, torch.Tensor]:
    """One 1M-token sequence on shuffled pages (+ spare pages), its index keys / scales and latent rows."""
    g = torch.Generator(device="cuda").manual_seed(0)
    pages = -(-CONTEXT // P)
    num_pages = pages + 9
    perm = torch.randperm(num_pages, device="cuda", generator=g)
    table = perm[:pages].to(torch.int32)[None, :]
    index_k = (torch.randn(num_pages, P // 4, D_IDX, device="cuda", generator=g) * 60).to(torch.float8_e4m3fn)
    index_scale = torch.exp2(torch.randint(-10, 2, (num_pages, P // 4), device="cuda", generator=g).float())
    latent = torch.randn(num_pages, P, RANK, device="cuda", generator=g).to(torch.bfloat16)
    # Rows: the last token, a chunk boundary inside a pool (8192 * 127 + 2), early rows with few pools.
    positions = torch.tensor([CONTEXT - 1, CONTEXT - 2, 8192 * 127 + 2, 8192 * 64 - 1, 4099, 7], device="cuda")
    return {"table": table, "index_k": index_k, "index_scale": index_scale, "latent": latent, "pos": positions}


def test_indexer_scores_and_topk_at_one_million_tokens(scene: dict[str, torch.Tensor]) -> None:
    g = torch.Generator(device="cuda").manual_seed(1)
    pos = scene["pos"]
    n = pos.shape[0]
    rs = torch.zeros(n, dtype=torch.int64, device="cuda")
    q8 = (torch.randn(n, HEADS_IDX, D_IDX, device="cuda", generator=g) * 60).to(torch.float8_e4m3fn)
    w = torch.randn(n, HEADS_IDX, device="cuda", generator=g)
    args = (q8, w, scene["index_k"], scene["index_scale"], pos, rs, scene["table"], P, COLS)
    out = torch.full((n, COLS), float("nan"), device="cuda")
    got = K.score_pools(*args, out=out)
    ref = R.score_pools(*args)
    assert not got.isnan().any()
    visible = (pos + 1) // 4
    cols = torch.arange(COLS, device="cuda")
    assert torch.equal(got.isinf(), cols[None, :] >= visible[:, None])
    fin = ~ref.isinf()
    err = ((got - ref).abs()[fin] / ref.abs()[fin].clamp(min=1e-30)).max().item()
    print(f"1M-context scores: max rel err {err:.2e}")
    torch.testing.assert_close(got[fin], ref[fin], rtol=1e-5, atol=1e-5 * ref[fin].abs().max().item())
    ids = K.select_topk_pools(got, pos, TOPK_POOLS)
    ref_ids = R.select_topk_pools(got, pos, TOPK_POOLS)
    assert torch.equal(ids.sort(dim=1).values, ref_ids.sort(dim=1).values)
    # Every chosen pool is a complete pool of its row, and rows with fewer pools than topk take them all.
    ok = ids >= 0
    assert ((ids < visible[:, None]) | ~ok).all()
    assert int(ok[-1].sum()) == int(visible[-1]) == 2
    sel = K.expand_selection(ids, pos, 4 * TOPK_POOLS + 3)
    assert torch.equal(sel, R.expand_selection(ids, pos, 4 * TOPK_POOLS + 3))
    assert (sel <= pos[:, None]).all()


def test_sparse_mla_at_one_million_tokens(scene: dict[str, torch.Tensor]) -> None:
    g = torch.Generator(device="cuda").manual_seed(2)
    pos = scene["pos"]
    n = pos.shape[0]
    width = 4 * TOPK_POOLS + 3
    # Selections spread over the whole context up to each row (distinct tokens, -1 holes).
    sel = torch.full((n, width), -1, dtype=torch.int32, device="cuda")
    for r in range(n):
        m = min(width, int(pos[r]) + 1)
        sel[r, :m] = torch.randperm(int(pos[r]) + 1, device="cuda", generator=g)[:m].to(torch.int32)
    sel[:, ::97] = -1
    q = (torch.randn(n, H, RANK, device="cuda", generator=g) * 0.05).to(torch.bfloat16)
    rs = torch.zeros(n, dtype=torch.int64, device="cuda")
    scale = 256**-0.5
    got = K.sparse_mla_attention(q, scene["latent"], sel, rs, scene["table"], P, scale)
    ref = R.sparse_mla_attention(q.float(), scene["latent"].float(), sel, rs, scene["table"], P, scale)
    err = (got.float() - ref).abs().max().item()
    print(f"1M-context sparse MLA: max abs err {err:.2e} (output max {ref.abs().max().item():.2f})")
    assert err <= 2e-2 * ref.abs().max().item()


def test_128k_prompt_next_token_logits_agree_across_chunk_sizes() -> None:
    from benchmarks.harness.models import random_model
    from trtllm_glm.config import Glm5NextConfig
    from trtllm_glm.models.glm5_next import subset_config
    from trtllm_glm.runtime.llm import LLM, KvCacheConfig
    from trtllm_glm.runtime.sampling import SamplingParams

    n = 131072
    cfg = subset_config(Glm5NextConfig.from_pretrained("glm-5.3-flash"), [0, 1, 2, 3])
    cfg.num_nextn_predict_layers = 0
    model = random_model(cfg, "cuda", "bfloat16", seed=0)
    ids = torch.randint(0, cfg.vocab_size, (n,), generator=torch.Generator().manual_seed(5)).tolist()
    logits = []
    for chunk in (8192, 32768):
        kv = KvCacheConfig(tokens_per_block=P, enable_block_reuse=False)
        llm = LLM(model, max_seq_len=n + 8, max_num_tokens=chunk, max_batch_size=1, cuda_graph_config=None,
                  warmup=False, kv_cache_config=kv)  # fmt: skip
        try:
            out = llm.generate(ids, SamplingParams(max_tokens=1, temperature=0.0, return_generation_logits=True))
        finally:
            llm.shutdown()
        logits.append(out.outputs[0].generation_logits[0].float())
    a, b = logits
    cos = torch.nn.functional.cosine_similarity(a, b, dim=0).item()
    rel = ((a - b).abs().max() / a.abs().max()).item()
    print(f"128K prompt, chunks 8192 vs 32768: cosine {cos:.6f}, max rel diff {rel:.2e}")
    assert cos > 0.999 and rel < 0.05
    top_a, top_b = a.topk(2), b.topk(2)
    gap = (top_a.values[0] - top_a.values[1]).item()
    assert top_a.indices[0] == top_b.indices[0] or gap < 0.25  # same greedy token unless a near tie


@contextmanager
def no_host_sync():
    """Any host synchronisation (``.item()``, a blocking copy, a stream sync) raises inside the block."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_moe_prefill_chunk_has_no_host_sync() -> None:
    """The MoE of a prefill chunk (4,100 rows, small geometry) runs on the fused path without a host sync (the
    per-expert loop it replaced read the expert counts back)."""
    from trtllm_glm.config import Glm5NextConfig
    from trtllm_glm.modules.ffn import MoE

    d = Glm5NextConfig.from_pretrained("tiny").text_dict()
    d.update(hidden_size=256, moe_intermediate_size=128, n_routed_experts=16, num_experts_per_tok=4)
    m = MoE(Glm5NextConfig.from_dict(d))
    m.reset_parameters(torch.Generator().manual_seed(0), 0.05)
    m = m.to("cuda", torch.bfloat16).eval()
    m.gate.float()
    x = torch.randn(4100, 256, device="cuda").to(torch.bfloat16)
    with torch.no_grad():
        m(x)  # first call: stacks checked, kernels compiled
        with no_host_sync():
            out = m(x)
    assert out.shape == x.shape and not out.isnan().any()


def test_kda_prefill_layer_has_no_host_sync(monkeypatch: pytest.MonkeyPatch) -> None:
    """A KDA layer's prefill of two sequences (one continuing, one fresh) builds its row indices and fresh-state
    flags without a blocking host-to-device copy (fla's chunk function, not ours, is stubbed out)."""
    import trtllm_glm.kda.layer as kda_layer
    from trtllm_glm.config import Glm5NextConfig
    from trtllm_glm.kda import KdaBatch, KimiDeltaAttention
    from trtllm_glm.state.owner import KdaLayerState

    def stub(q, k, v, g, beta, scale, S0, cu, **kw):
        return torch.zeros(q.shape[0], v.shape[1], v.shape[2], device=q.device), S0.clone()

    monkeypatch.setattr(kda_layer, "kda_prefill", stub)
    cfg = Glm5NextConfig.from_pretrained("small")
    layer = KimiDeltaAttention(cfg, kda_idx=0)
    layer.reset_parameters(torch.Generator().manual_seed(0), std=0.2)
    layer = layer.to("cuda").eval()
    H, K, V = layer.num_heads, layer.head_k_dim, layer.head_v_dim
    conv = torch.randn(4, layer.conv_dim, layer.conv_size - 1, device="cuda")
    st = KdaLayerState(recurrent=torch.randn(4, H, K, V, device="cuda"), conv=conv)
    batch = KdaBatch.build([37, 50], [12, 0], [2, 0], device="cuda")
    hidden = torch.randn(87, cfg.hidden_size, device="cuda")
    with torch.no_grad():
        layer(hidden, batch, st)  # first call: compiles
        with no_host_sync():
            out = layer(hidden, batch, st)
    assert out.shape == hidden.shape
