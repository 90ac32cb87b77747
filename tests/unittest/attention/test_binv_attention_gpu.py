"""Batch-invariant mode (issue 31) on CUDA at the real GLM-5.3-Flash geometry: KDA, sparse MLA, the indexer.

Bit-for-bit checks (int views) in the mode (`trtllm_glm.numerics.batch_invariant_mode`), bf16 inputs:

* KDA: a sequence's verify outputs / records and its decode output / new state are the same alone and inside
  batches of M = 3, 8, 64 sequences; ``W`` verify rows equal ``W`` decode steps and a commit of ``a`` rows
  leaves the state of ``a`` decode steps (ops level and through the layer: short conv, gates, recurrence,
  conv windows);
* sparse MLA (the default kernel, Gluon on the H200, and the Triton one): a query row alone equals the row in
  batches of 3, 8, 64 rows, for selections whose valid entries end in different splits;
* indexer: scores, top-k pool ids and the expanded selection of a row alone equal those in batches of 3, 8, 64
  rows of other context lengths.

Outputs are poisoned (NaN) first; slots outside the batch hold NaN and must stay so. Needs CUDA (skipped
without). Each test fails with its part of the mode turned off (checked once on the H200 by the lead).
"""

from __future__ import annotations

import pytest
import torch

from trtllm_glm.attention.sparse.glm_kpool import kernels as KP
from trtllm_glm.attention.sparse.glm_kpool import ops as RP
from trtllm_glm.cache.manager import KpoolLayerCache
from trtllm_glm.config import Glm5NextConfig
from trtllm_glm.kda import KdaBatch, KimiDeltaAttention
from trtllm_glm.kda import kernels as KK
from trtllm_glm.kda.ops import kda_gate, l2_normalize
from trtllm_glm.kda.ops import verify as R
from trtllm_glm.kda.ops.backend import kda_decode_inplace
from trtllm_glm.numerics import batch_invariant_mode
from trtllm_glm.state import KdaLayerState

pytestmark = pytest.mark.gpu

_REAL = Glm5NextConfig.from_pretrained("glm-5.3-flash")
H = _REAL.kda_num_heads
K = V = _REAL.kda_head_dim
SCALE = K**-0.5
ROWS = (1, 3, 8, 64)
DEV = torch.device("cuda")


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(_bits(a), _bits(b))


# ------------------------------------------------------------------------------------------------
# KDA kernels
def _kda_rows(gen: torch.Generator, n: int, *lead: int) -> list[torch.Tensor]:
    """bf16 ``q, k, v, g, beta`` of ``n`` sequences (``[n, *lead, ...]``) on CUDA."""

    def r(*s: int) -> torch.Tensor:
        return torch.randn(n, *lead, *s, generator=gen)

    A_log = torch.empty(H).uniform_(1.0, 16.0, generator=gen).log()
    g = kda_gate(r(H, K) * 2.0, A_log, torch.randn(H * K, generator=gen) * 0.1, -5.0)
    ts = (l2_normalize(r(H, K)), l2_normalize(r(H, K)), r(H, V), g, torch.sigmoid(r(H)))
    return [t.to(DEV, torch.bfloat16) for t in ts]


def _embed(target: list[torch.Tensor], others: list[torch.Tensor], at: int) -> list[torch.Tensor]:
    return [torch.cat([o[:at], t, o[at:]]) for t, o in zip(target, others)]


@pytest.mark.parametrize("M", ROWS[1:])
def test_kda_verify_and_decode_rows_same_alone_and_in_batch(M: int) -> None:
    gen = torch.Generator().manual_seed(900 + M)
    W, at = 4, M // 2
    target = _kda_rows(gen, 1, W)
    others = _kda_rows(gen, M - 1, W)
    S0 = (0.5 * torch.randn(H, K, V, generator=gen)).to(DEV)
    pool = torch.full((M + 3, H, K, V), float("nan"), device=DEV)
    slots = torch.randperm(M + 3, generator=gen)[:M].to(DEV)  # out of order, with unused slots between
    pool[slots] = (0.5 * torch.randn(M, H, K, V, generator=gen)).to(DEV)
    pool[slots[at]] = S0
    with batch_invariant_mode(True):
        o1, rec1 = KK.kda_verify(*target, SCALE, S0[None].clone())
        oM, recM = KK.kda_verify(*_embed(target, others, at), SCALE, pool, state_slots=slots)
        assert _same(oM[at], o1[0]) and _same(recM.u[at], rec1.u[0]), "verify rows depend on the batch"
        st1 = S0[None].clone()
        zero = torch.zeros(1, dtype=torch.int64, device=DEV)
        d1 = kda_decode_inplace(*(t[:, 0] for t in target), SCALE, st1, zero)
        dM = kda_decode_inplace(*(t[:, 0] for t in _embed(target, others, at)), SCALE, pool, slots)
        assert _same(dM[at], d1[0]) and _same(pool[slots[at]], st1[0]), "decode rows depend on the batch"
    unused = torch.ones(M + 3, dtype=torch.bool, device=DEV)
    unused[slots] = False
    assert pool[unused].isnan().all()


@pytest.mark.parametrize("M", ROWS)
def test_kda_verify_then_commit_equals_decode_steps(M: int) -> None:
    gen = torch.Generator().manual_seed(910 + M)
    W = 4
    q, k, v, g, beta = _kda_rows(gen, M, W)
    pool = torch.full((M + 2, H, K, V), float("nan"), device=DEV)
    slots = torch.randperm(M + 2, generator=gen)[:M].to(DEV)
    pool[slots] = (0.5 * torch.randn(M, H, K, V, generator=gen)).to(DEV)
    a = torch.randint(0, W + 1, (M,), generator=gen)
    a[0] = W
    with batch_invariant_mode(True):
        o_v, rec = R.kda_verify(q, k, v, g, beta, SCALE, pool, state_slots=slots)
        committed = pool.clone()
        R.kda_commit(committed, rec, a.to(DEV), state_slots=slots)
        steps, expect = pool.clone(), pool.clone()
        for t in range(W):
            o_t = kda_decode_inplace(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], SCALE, steps, slots)
            assert _same(o_v[:, t], o_t), f"M={M}: verify row {t} differs from decode step {t}"
            done = (a == t + 1).nonzero().flatten().tolist()
            expect[slots[done]] = steps[slots[done]]
    assert _same(committed, expect), f"M={M}: committed states differ from the decode steps'"


@pytest.mark.parametrize("M", ROWS)
def test_kda_layer_verify_commit_equals_decode_steps(M: int) -> None:
    """Through the layer (bf16 weights): short conv + gates + recurrence; mixer outputs, recurrent and conv
    states bitwise. The projections run once for the verify rows (GEMM invariance is not this test's).

    Under no_grad, as serving runs: with a gradient (the layer's parameters require one) the conv ops' `auto`
    backend takes their torch references instead of the kernels, which no serving path runs. That is the likely
    reason this test failed on the H200 on 2026-12-03 (it then ran with a gradient) while the ops called directly
    agreed; not yet confirmed there. The CPU twin, test_binv_kda.py::test_layer_verify_commit_equals_decode_steps,
    passes with the kernels forced and fails without the mode."""
    dev = DEV
    cfg = Glm5NextConfig(hidden_size=1024, kda_num_heads=H, kda_head_dim=K, kda_gate_low_rank=128)
    layer = KimiDeltaAttention(cfg, kda_idx=0, device=dev)
    layer.reset_parameters(torch.Generator().manual_seed(0), std=0.03)
    layer.to(torch.bfloat16)
    gen = torch.Generator().manual_seed(920 + M)
    W, S = 4, M + 2
    slots = torch.randperm(S, generator=gen)[:M].tolist()
    past = torch.randint(5, 400, (M,), generator=gen).tolist()
    rec0 = torch.full((S, H, K, V), float("nan"), device=dev)
    rec0[slots] = (0.5 * torch.randn(M, H, K, V, generator=gen)).to(dev)
    conv0 = torch.full((S, layer.conv_dim, 3), float("nan"), device=dev)
    conv0[slots] = torch.randn(M, layer.conv_dim, 3, generator=gen).to(dev)
    hidden = torch.randn(M * W, 1024, generator=gen).to(dev, torch.bfloat16)
    a = torch.randint(0, W + 1, (M,), generator=gen).tolist()
    with batch_invariant_mode(True), torch.no_grad():
        inputs = layer._inputs(hidden)
        st_v = KdaLayerState(recurrent=rec0.clone(), conv=conv0.clone())
        o_v, records = layer._verify_o(hidden, KdaBatch.build([W] * M, past, slots, device=dev), st_v, inputs)
        records.commit(a, st_v)
        st_d = KdaLayerState(recurrent=rec0.clone(), conv=conv0.clone())
        exp_rec, exp_conv = rec0.clone(), conv0.clone()
        for t in range(W):
            step = tuple(x[t::W] for x in inputs[:3]) + (None,)
            batch = KdaBatch.build([1] * M, [p + t for p in past], slots, device=dev)
            o_t = layer._forward_o(hidden[t::W], batch, st_d, step)
            assert _same(o_v[t::W], o_t), f"M={M}: verify row {t} differs from decode step {t}"
            for j, s in enumerate(slots):
                if a[j] == t + 1:
                    exp_rec[s], exp_conv[s] = st_d.recurrent[s], st_d.conv[s]
    assert _same(st_v.recurrent, exp_rec), f"M={M}: committed recurrent states differ"
    assert _same(st_v.conv, exp_conv), f"M={M}: committed conv windows differ"


# ------------------------------------------------------------------------------------------------
# Sparse MLA
HM, RANK, PAGE, WIDTH = _REAL.num_attention_heads, _REAL.kv_lora_rank, 64, _REAL.index_select_width
CONTEXTS = (90, 700, 1500, 3000)  # valid entries ending in the first, a middle and the last split; a full row


def _mla(*args, **kw) -> torch.Tensor:
    """The kernel module's entry (launch knobs: ``impl``, ``combine_block_h``)."""
    return KP.kernel_module("sparse_mla", DEV).sparse_mla_attention(*args, **kw)


def _mla_case(gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    per = [-(-n // PAGE) for n in CONTEXTS]
    num_pages = sum(per) + 3
    perm = torch.randperm(num_pages, generator=gen)
    cache = torch.full((num_pages, PAGE, RANK), float("nan"))
    table = torch.full((len(CONTEXTS), max(per)), -1, dtype=torch.int32)
    used = 0
    for b, p in enumerate(per):
        ids = perm[used : used + p]
        used += p
        table[b, :p] = ids.to(torch.int32)
        cache[ids] = torch.randn(p, PAGE, RANK, generator=gen)
    return cache.to(DEV, torch.bfloat16), table.to(DEV)


def _mla_row(gen: torch.Generator, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    n = CONTEXTS[seq]
    m = min(n, WIDTH)
    sel = torch.full((WIDTH,), -1, dtype=torch.int32)
    sel[:m] = torch.randperm(n, generator=gen)[:m].sort().values.to(torch.int32)  # ascending, as selected
    return (torch.randn(HM, RANK, generator=gen) * 0.3).to(torch.bfloat16), sel


@pytest.mark.parametrize("impl", [None, "triton"])
def test_sparse_mla_row_same_alone_and_in_batch(impl: str | None) -> None:
    gen = torch.Generator().manual_seed(930)
    cache, table = _mla_case(gen)
    kw = {} if impl is None else {"impl": impl}
    with batch_invariant_mode(True):
        for seq in range(len(CONTEXTS)):
            q_t, sel_t = _mla_row(gen, seq)
            alone = _mla(
                q_t[None].to(DEV), cache, sel_t[None].to(DEV), torch.tensor([seq]).to(DEV), table, PAGE, 0.05, **kw
            )
            for M in ROWS[1:]:
                at = (seq * 7) % M
                seqs = torch.randint(0, len(CONTEXTS), (M,), generator=gen).tolist()
                seqs[at] = seq
                rows = [_mla_row(gen, s) for s in seqs]
                rows[at] = (q_t, sel_t)
                q = torch.stack([r[0] for r in rows]).to(DEV)
                sel = torch.stack([r[1] for r in rows]).to(DEV)
                out = torch.full_like(q, float("nan"))
                _mla(q, cache, sel, torch.tensor(seqs).to(DEV), table, PAGE, 0.05, out=out, **kw)
                assert _same(out[at], alone[0]), f"impl={impl} context={CONTEXTS[seq]} M={M}: row differs"


def test_sparse_mla_combine_head_block_keeps_bits() -> None:
    gen = torch.Generator().manual_seed(931)
    cache, table = _mla_case(gen)
    rows = [_mla_row(gen, s) for s in (3, 1, 2)]
    q = torch.stack([r[0] for r in rows]).to(DEV)
    sel = torch.stack([r[1] for r in rows]).to(DEV)
    seq = torch.tensor([3, 1, 2]).to(DEV)
    with batch_invariant_mode(True):
        outs = [_mla(q, cache, sel, seq, table, PAGE, 0.05, combine_block_h=cb) for cb in (1, 2, 4, 8)]
    assert all(_same(o, outs[0]) for o in outs[1:])


# ------------------------------------------------------------------------------------------------
# Indexer
def test_indexer_row_same_alone_and_in_batch() -> None:
    gen = torch.Generator().manual_seed(940)
    Hi, topk, page_size, num_pages = _REAL.index_n_heads, _REAL.index_topk_pools, 64, 700
    codes = torch.randint(0, 256, (num_pages, page_size // 4, 128), generator=gen, dtype=torch.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0x3A
    scale = torch.exp2(torch.randint(-12, 4, (num_pages, page_size // 4), generator=gen).float())
    cache = KpoolLayerCache(
        torch.zeros(1, page_size, 8), codes.view(torch.float8_e4m3fn), scale, torch.zeros(1, 2, 4, 128), page_size
    )
    ik, isc = cache.index_k.to(DEV), cache.index_scale.to(DEV)
    table = torch.randperm(num_pages, generator=gen)[: 4 * 170].view(4, 170).to(torch.int32).to(DEV)
    lens = [2500, 9000, 40, 10800]

    def run(q8, w, pos, seq, max_pools):
        s = KP.score_pools(q8, w, ik, isc, pos, seq, table, page_size, max_pools)
        ids = KP.select_topk_pools(s, pos, topk)
        return s, ids, KP.expand_selection(ids, pos, WIDTH)

    for seq_t, pos_t in ((0, 2499), (1, 8999), (3, 10799)):
        q8_t, _ = RP.rotate_quant(torch.randn(1, Hi, 128, generator=gen).to(DEV))
        w_t = torch.randn(1, Hi, generator=gen).to(DEV)
        n_c = (pos_t + 1) // 4
        with batch_invariant_mode(True):
            s1, i1, e1 = run(q8_t, w_t, torch.tensor([pos_t]).to(DEV), torch.tensor([seq_t]).to(DEV), n_c)
            for M in ROWS[1:]:
                at = M - 1
                q8, _ = RP.rotate_quant(torch.randn(M, Hi, 128, generator=gen).to(DEV))
                q8.view(torch.uint8)[at] = q8_t.view(torch.uint8)[0]
                w = torch.randn(M, Hi, generator=gen).to(DEV)
                w[at] = w_t[0]
                seqs = torch.randint(0, 4, (M,), generator=gen)
                seqs[at] = seq_t
                pos = torch.tensor([int(torch.randint(1, lens[s], (1,), generator=gen)) for s in seqs.tolist()])
                pos[at] = pos_t
                sM, iM, eM = run(q8, w, pos.to(DEV), seqs.to(DEV), 2700)
                assert _same(sM[at, :n_c], s1[0]), f"pos={pos_t} M={M}: scores differ"
                assert torch.equal(iM[at], i1[0]) and torch.equal(eM[at], e1[0]), f"pos={pos_t} M={M}: selection"


# ------------------------------------------------------------------------------------------------
# Absorbed per-head products of the sparse-MLA layer (einsum by default, `invariant_bmm` in the mode)
def test_sparse_mla_absorbed_products_row_same_alone_and_in_batch() -> None:
    from trtllm_glm.attention.sparse.glm_kpool.layer import absorb_o, absorb_q

    gen = torch.Generator().manual_seed(950)
    nope, vh = _REAL.qk_nope_head_dim, _REAL.v_head_dim
    kv_b = (torch.randn(HM, nope + vh, RANK, generator=gen) * 0.05).to(DEV, torch.bfloat16)
    w_uk, w_uv = kv_b[:, :nope], kv_b[:, nope:]  # the layer's views of kv_b_proj
    q_t = torch.randn(1, HM, nope, generator=gen).to(DEV, torch.bfloat16)
    o_t = torch.randn(1, HM, RANK, generator=gen).to(DEV, torch.bfloat16)
    with batch_invariant_mode(True):
        w_uk_t = w_uk.transpose(1, 2).contiguous()
        qa1 = absorb_q(q_t, w_uk, w_uk_t)
        oa1 = absorb_o(o_t, w_uv)
        ref = torch.einsum("nhd,hdr->nhr", q_t.float(), w_uk.float())
        assert ((qa1.float() - ref).abs().max() / ref.abs().max()).item() < 1e-2
        for M in ROWS[1:]:
            at = M - 2
            q = torch.randn(M, HM, nope, generator=gen).to(DEV, torch.bfloat16)
            o = torch.randn(M, HM, RANK, generator=gen).to(DEV, torch.bfloat16)
            q[at], o[at] = q_t[0], o_t[0]
            assert _same(absorb_q(q, w_uk, w_uk_t)[at], qa1[0]), f"M={M}: q_abs row differs"
            assert _same(absorb_o(o, w_uv)[at], oa1[0]), f"M={M}: o row differs"


@pytest.mark.parametrize("M", ROWS[1:])
def test_kda_conv_and_gate_rows_same_alone_and_in_batch(M: int) -> None:
    """Short conv (decode and verify) and gates at the real geometry: a row alone == the row in a batch."""
    gen = torch.Generator().manual_seed(960 + M)
    W, Wconv, C = 4, 4, H * (2 * K + V)
    weight = torch.randn(C, Wconv, generator=gen).to(DEV, torch.bfloat16)
    window = torch.randn(C, Wconv - 1, generator=gen).to(DEV)
    x_t = torch.randn(W, C, generator=gen).to(DEV, torch.bfloat16)
    g_t = torch.randn(1, H * K, generator=gen).to(DEV, torch.bfloat16)
    b_t = torch.randn(1, H, generator=gen).to(DEV, torch.bfloat16)
    A_log, dt_bias = torch.randn(H, generator=gen).to(DEV), torch.randn(H * K, generator=gen).to(DEV)

    def run(n: int, at: int) -> tuple[torch.Tensor, ...]:
        x = torch.randn(n * W, C, generator=gen).to(DEV, torch.bfloat16)
        x[at * W : (at + 1) * W] = x_t
        state = torch.randn(n + 2, C, Wconv - 1, generator=gen).to(DEV)
        slots = torch.randperm(n + 2, generator=gen)[:n].to(DEV)
        state[slots[at]] = window
        gr = torch.randn(n, H * K, generator=gen).to(DEV, torch.bfloat16)
        br = torch.randn(n, H, generator=gen).to(DEV, torch.bfloat16)
        gr[at], br[at] = g_t[0], b_t[0]
        with batch_invariant_mode(True):
            qv, kv, vv = KK.conv_verify_qkv(x, state, weight, slots, H, K, V, W)
            qd, kd, vd = KK.conv_decode(x[::W].contiguous(), state, weight, slots, H, K, V, 1e-6)
            g, beta = KK.kda_gate_beta(gr, br, A_log, dt_bias, -5.0)
        return qv[at], kv[at], vv[at], qd[at], kd[at], vd[at], state[slots[at]], g[at], beta[at]

    alone = run(1, 0)
    for i, (a, b) in enumerate(zip(run(M, M // 3), alone)):
        assert _same(a, b), f"M={M}: output {i} of the row changed"


def test_sparse_mla_row_slabs_keep_bits(monkeypatch: pytest.MonkeyPatch) -> None:
    """A prefill chunk in the mode (more rows than `PARTIAL_SLAB_ROWS`, the mode's 11 splits) runs in slabs of rows:
    the same bits as one launch over every row (the default kernel; the tail slab shorter)."""
    from trtllm_glm.attention.sparse.glm_kpool.kernels import sparse_mla as SM

    gen = torch.Generator().manual_seed(932)
    cache, table = _mla_case(gen)
    n = SM.PARTIAL_SLAB_ROWS + 77
    seqs = torch.randint(0, len(CONTEXTS), (n,), generator=gen)
    rows = [_mla_row(gen, int(s)) for s in seqs]
    q = torch.stack([r[0] for r in rows]).to(DEV)
    sel = torch.stack([r[1] for r in rows]).to(DEV)
    with batch_invariant_mode(True):
        sliced = _mla(q, cache, sel, seqs.to(DEV), table, PAGE, 0.05, out=torch.full_like(q, float("nan")))
        monkeypatch.setattr(SM, "PARTIAL_SLAB_ROWS", 1 << 30)
        whole = _mla(q, cache, sel, seqs.to(DEV), table, PAGE, 0.05, out=torch.full_like(q, float("nan")))
    assert not torch.isnan(sliced).any()
    assert _same(sliced, whole)
