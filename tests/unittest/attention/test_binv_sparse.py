"""Batch-invariant mode (issue 31), sparse MLA and the pooled indexer: a row's bits do not depend on its batch.

CPU, Triton's interpreter (the glm_kpool kernels package runs CPU tensors through an interpreted copy). Checked
bit for bit on fresh random FP32 inputs with poisoned outputs:

* sparse MLA: a query row alone (M = 1) and at any position of a batch of 3 or 8 rows gives the same output
  (in the mode the split count follows the selection width only; by default it follows the number of rows,
  and so do the bits); and the split combine's head block does not change a head's bits;
* indexer: a row's pool scores, its top-k pool ids and its expanded selection are the same alone and beside
  longer rows (a wider score matrix); ids come out ascending, ties to the lower id;
* pooled-key writes: the same rows written as width-one decode steps or as one verify step of several rows
  leave the same pools, scales and tail rings.
"""

from __future__ import annotations

import pytest
import torch

from trtllm_glm.attention.sparse.glm_kpool import kernels as K
from trtllm_glm.attention.sparse.glm_kpool import ops as R
from trtllm_glm.cache.manager import KpoolLayerCache
from trtllm_glm.numerics import batch_invariant_mode

pytest.importorskip("triton")

pytestmark = pytest.mark.cpu_only

D = 128


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


# ------------------------------------------------------------------------------------------------
# Sparse MLA
HEADS, RANK, PAGE, WIDTH = 4, 32, 16, 300  # 5 tiles of 64 entries; a row alone takes 5 splits by default
LENS = [300, 120, 250]


def _latent(g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """``[pages, PAGE, RANK]`` latent cache (NaN in pages nobody owns) and ``[3, max_pages]`` permuted table."""
    per = [-(-n // PAGE) for n in LENS]
    num_pages = sum(per) + 5
    perm = torch.randperm(num_pages, generator=g)
    cache = torch.full((num_pages, PAGE, RANK), float("nan"))
    table = torch.full((len(LENS), max(per) + 2), -1, dtype=torch.int32)
    used = 0
    for b in range(len(LENS)):
        ids = perm[used : used + per[b]]
        used += per[b]
        table[b, : per[b]] = ids.to(torch.int32)
        cache[ids] = torch.randn(per[b], PAGE, RANK, generator=g) * 2
    return cache, table


def _mla_row(g: torch.Generator, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One query row ``[H, R]`` and its selection ``[WIDTH]``: shuffled tokens with ``-1`` scattered between."""
    n = LENS[seq]
    m = int(torch.randint(n // 2, n + 1, (1,), generator=g))
    sel = torch.full((WIDTH,), -1, dtype=torch.int32)
    sel[torch.randperm(WIDTH, generator=g)[:m]] = torch.randperm(n, generator=g)[:m].to(torch.int32)
    return torch.randn(HEADS, RANK, generator=g) * 0.5, sel


def _mla(cache, table, q, sel, row_seq, **kw) -> torch.Tensor:
    out = torch.full(q.shape, float("nan"))
    o = K.kernel_module("sparse_mla", "cpu").sparse_mla_attention(
        q, cache, sel, row_seq, table, PAGE, RANK**-0.5, out=out, **kw
    )
    assert not o.isnan().any()
    return o


def test_sparse_mla_row_same_bits_alone_and_in_any_batch() -> None:
    g = torch.Generator().manual_seed(3101)
    cache, table = _latent(g)
    q_t, sel_t = _mla_row(g, 0)
    with batch_invariant_mode(True):
        alone = _mla(cache, table, q_t[None], sel_t[None], torch.tensor([0]))
        for M, at in ((3, 2), (8, 0), (8, 5)):
            seqs = [int(s) for s in torch.randint(0, len(LENS), (M,), generator=g)]
            seqs[at] = 0
            rows = [_mla_row(g, s) for s in seqs]
            rows[at] = (q_t, sel_t)
            q = torch.stack([r[0] for r in rows])
            sel = torch.stack([r[1] for r in rows])
            out = _mla(cache, table, q, sel, torch.tensor(seqs))
            assert torch.equal(_bits(out[at]), _bits(alone[0])), f"M={M}: the row's attention output changed"


def test_sparse_mla_split_count_follows_width_only_in_the_mode() -> None:
    from trtllm_glm.attention.sparse.glm_kpool.kernels import sparse_mla as mod

    dev = torch.device("cpu")
    with batch_invariant_mode(True):
        got = {mod.choose_splits(n, 64, 2051, dev, 64, 64) for n in (1, 2, 3, 8, 16, 64, 200)}
        assert got == {16}  # W / (2 H); split_layout makes it 11 splits of three 64-entry tiles
        assert mod.choose_splits(1, 64, 100, dev, 64, 64) == 1  # narrow selections stay whole
    with batch_invariant_mode(False):
        assert mod.choose_splits(1, 4, WIDTH, dev, 16, 64) != mod.choose_splits(3, 4, WIDTH, dev, 16, 64)


@pytest.mark.parametrize("combine_block_h", [1, 2])
def test_sparse_mla_combine_head_block_keeps_bits(combine_block_h: int) -> None:
    g = torch.Generator().manual_seed(3102)
    cache, table = _latent(g)
    rows = [_mla_row(g, s) for s in (0, 2, 1)]
    q, sel = torch.stack([r[0] for r in rows]), torch.stack([r[1] for r in rows])
    seq = torch.tensor([0, 2, 1])
    with batch_invariant_mode(True):
        base = _mla(cache, table, q, sel, seq, combine_block_h=4)
        other = _mla(cache, table, q, sel, seq, combine_block_h=combine_block_h)
    assert torch.equal(_bits(base), _bits(other))


# ------------------------------------------------------------------------------------------------
# Indexer scores, top-k, selection
def _index_cache(g: torch.Generator, num_pages: int, page_size: int) -> KpoolLayerCache:
    """Valid FP8 pools everywhere (no NaN codes) with power-of-two scales."""
    codes = torch.randint(0, 256, (num_pages, page_size // 4, D), generator=g, dtype=torch.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0x3A
    scale = torch.exp2(torch.randint(-12, 4, (num_pages, page_size // 4), generator=g).float())
    latent = torch.zeros(num_pages, page_size, 8)
    ring = torch.randn(4, 2, 4, D, generator=g)
    return KpoolLayerCache(latent, codes.view(torch.float8_e4m3fn), scale, ring, page_size)


def test_indexer_row_scores_topk_and_selection_same_alone_and_beside_longer_rows() -> None:
    g = torch.Generator().manual_seed(3103)
    page_size, num_pages, n_heads, topk = 16, 80, 4, 6
    c = _index_cache(g, num_pages, page_size)
    table = torch.randperm(num_pages, generator=g)[: 3 * 26].view(3, 26).to(torch.int32)
    pos_t = 101  # 25 complete pools
    q8_t, _ = R.rotate_quant(torch.randn(1, n_heads, D, generator=g))
    w_t = torch.randn(1, n_heads, generator=g)
    # Coarse head weights make ties likely among the target's pools: the order must still be by id.
    w_t = w_t.round()

    def run(q8, w, pos, seq, max_pools):
        scores = K.score_pools(q8, w, c.index_k, c.index_scale, pos, seq, table, page_size, max_pools)
        ids = K.select_topk_pools(scores, pos, topk)
        return scores, ids, K.expand_selection(ids, pos, topk * 4 + 3)

    with batch_invariant_mode(True):
        s1, i1, e1 = run(q8_t, w_t, torch.tensor([pos_t]), torch.tensor([0]), 25)
        q8_o, _ = R.rotate_quant(torch.randn(4, n_heads, D, generator=g))
        q8 = torch.cat([q8_o[:2], q8_t, q8_o[2:]])
        w = torch.cat([torch.randn(2, n_heads, generator=g), w_t, torch.randn(2, n_heads, generator=g)])
        pos = torch.tensor([400, 7, pos_t, 250, 3])
        seq = torch.tensor([1, 2, 0, 2, 1])
        s5, i5, e5 = run(q8, w, pos, seq, 100)
    assert torch.equal(_bits(s5[2, :25]), _bits(s1[0])) and torch.isneginf(s5[2, 25:]).all()
    assert torch.equal(i5[2], i1[0]) and torch.equal(e5[2], e1[0])
    ids = i1[0][i1[0] >= 0]
    assert torch.equal(ids, ids.sort().values)  # ascending: the order the attention kernel consumes
    assert torch.equal(i1, R.select_topk_pools(s1, torch.tensor([pos_t]), topk))  # ties to the lower id


def test_pool_writes_same_from_decode_steps_and_one_verify_step() -> None:
    g = torch.Generator().manual_seed(3104)
    page_size, num_pages = 8, 32
    c0 = _index_cache(g, num_pages, page_size)
    c0.index_scale.fill_(float("nan"))  # only written pools become finite
    table = torch.randperm(num_pages, generator=g)[:20].view(2, 10).to(torch.int32)
    slots = torch.tensor([3, 1])
    ape = torch.randn(4, D, generator=g)
    past, width = [5, 10], 7
    key = torch.randn(2 * width, D, generator=g)
    gate = torch.randn(2 * width, D, generator=g) * 2
    pos = torch.cat([torch.arange(p, p + width) for p in past])
    seq = torch.arange(2).repeat_interleave(width)
    verify = KpoolLayerCache(c0.latent, c0.index_k.clone(), c0.index_scale.clone(), c0.tail_ring.clone(), page_size)
    K.update_decode_pools(verify, key, gate, ape, pos, seq, table, slots)
    steps = KpoolLayerCache(c0.latent, c0.index_k.clone(), c0.index_scale.clone(), c0.tail_ring.clone(), page_size)
    for t in range(width):
        rows = torch.tensor([t, width + t])
        K.update_decode_pools(steps, key[rows], gate[rows], ape, pos[rows], torch.arange(2), table, slots)
    for name in ("index_k", "index_scale", "tail_ring"):
        assert torch.equal(_bits(getattr(verify, name)), _bits(getattr(steps, name))), name
    assert torch.isfinite(verify.index_scale).sum() >= 3  # pools were completed and written
