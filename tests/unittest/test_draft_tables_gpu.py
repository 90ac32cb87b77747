"""Hazard §6.1 under CUDA graphs: a draft forward captured with the draft slot table bound replays correctly
after the draft manager's page ids and state slots change, because the pre-replay prepare refreshes the
same persistent buffer in place.

What is captured: every part of the sparse layer's draft forward that reads the slot table or state slots
and can be captured: the projections, the latent row write, the index keys, the decode pool / tail-ring
update, the query quantisation and the pool scoring (Triton kernels on CUDA). What blocked the rest
(seen on an H200 with torch 2.11): ``ops.rotate_quant`` (through ``ops.fwht``) and
``ops.indexer_head_weights`` build a constant with ``torch.tensor(..., device=cuda)``, a pageable
host-to-device copy that capture refuses ("Cannot copy between CPU and CUDA tensors during CUDA graph
capture unless the CPU tensor is pinned"), so the captured part uses the Triton ``rotate_quant``
(bit-identical) and a constant made before capture; ``ops.select_topk_pools`` validates with
``int(n_c.max())`` and ``ops.sparse_mla_attention`` validates page ids through ``lookup_pages``
(``.any()``, ``int(...)``) and gathers through boolean-mask indexing, all device-to-host syncs that
invalidate the capture. Those two and the output projections run eagerly after the replay, reading the
same bound draft table.

Needs CUDA (tests/conftest.py skips it otherwise). Run with ``-s`` to see what is compared.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

from trtllm_glm.attention.graph_check import GraphAddressGuard
from trtllm_glm.attention.sparse.glm_kpool import kernels as K
from trtllm_glm.attention.sparse.glm_kpool.backend import kpool_ops
from trtllm_glm.attention.sparse.glm_kpool.layer import GlmKpoolSparseMLA
from trtllm_glm.attention.sparse.glm_kpool.metadata import GlmKpoolMetadata
from trtllm_glm.attention.sparse.glm_kpool.ops import select_topk_pools, sparse_mla_attention
from trtllm_glm.cache.manager import Glm5NextCacheManager, KpoolLayerCache
from trtllm_glm.config import INDEX_HEAD_DIM, Glm5NextConfig
from trtllm_glm.speculative.interface import (
    draft_replay,
    prepare_attn_metadata_for_draft_replay,
    restore_attn_metadata_after_draft_replay,
)

pytestmark = pytest.mark.gpu

CFG = Glm5NextConfig.from_pretrained("tiny")
P = 8
A, B = 1, 2
# Decode positions 15 and 7 each complete a pool (pos % 4 == 3), so the graph writes FP8 pools too.
PROMPT = {A: 15, B: 7}


def _managers(dev: torch.device) -> tuple[Glm5NextCacheManager, Glm5NextCacheManager]:
    kw: dict[str, Any] = dict(tokens_per_block=P, max_num_requests=6, num_sparse_layers=1, num_kda_layers=0, device=dev)
    tgt = Glm5NextCacheManager(CFG, num_pages=32, **kw)
    drf = Glm5NextCacheManager(CFG, num_pages=12, **kw)
    # Shift the target's ids past the draft pool and the draft's state slots by one (as in the CPU test).
    tgt.add_request(100, 12 * P)
    drf.add_request(100, 2 * P)
    drf.add_request(101)
    for rid, n in PROMPT.items():
        for m in (tgt, drf):
            m.add_request(rid, n + 1)
    return tgt, drf


def _clone(c: KpoolLayerCache) -> KpoolLayerCache:
    return KpoolLayerCache(c.latent.clone(), c.index_k.clone(), c.index_scale.clone(), c.tail_ring.clone(), c.page_size)


def _restore(dst: KpoolLayerCache, src: KpoolLayerCache) -> None:
    for name in ("latent", "index_k", "index_scale", "tail_ring"):
        getattr(dst, name).copy_(getattr(src, name))


def _planes(c: KpoolLayerCache) -> dict[str, torch.Tensor]:
    return {
        "latent": c.latent,
        "index_k": c.index_k.view(torch.uint8),
        "index_scale": c.index_scale,
        "tail": c.tail_ring,
    }


class DraftStep:
    """The sparse layer's draft forward split into a graph-safe part and the eager tail (see module doc)."""

    def __init__(self, layer: GlmKpoolSparseMLA, meta: GlmKpoolMetadata, num_rows: int) -> None:
        self.layer, self.meta = layer, meta
        dev = meta.device
        idx = layer.indexer
        # indexer_head_weights' constant, made before capture (the op itself copies it host-to-device).
        self.c = torch.tensor((INDEX_HEAD_DIM * idx.n_heads) ** -0.5, dtype=torch.float32, device=dev)
        self.scores = torch.empty(num_rows, meta.max_pools, dtype=torch.float32, device=dev)

    def graph_part(self, h: torch.Tensor) -> torch.Tensor:
        """Cache writes and scoring through the bound slot table and state slots; returns ``q_lora``."""
        layer, meta, idx = self.layer, self.meta, self.layer.indexer
        ops = kpool_ops(h.device)
        cache = meta.kv_cache_manager.kpool_layer_cache(0)
        N = h.shape[0]
        pos, rs, table = meta.positions_t, meta.row_seq_t, meta.slot_table_t
        q_lora = layer.q_a_layernorm(layer.q_a_proj(h))
        latent = layer.kv_a_layernorm(layer.kv_a_proj_with_mqa(h))
        ops.write_latent_rows(cache.latent, latent.to(cache.latent.dtype), pos, rs, table, cache.page_size)
        key, gate = idx.keys(h)
        ops.update_decode_pools(cache, key, gate, idx.ape.float(), pos, rs, table, meta.state_slots_t)
        # The Triton quantiser: the reference's FWHT copies a constant host-to-device (not capturable).
        q8, qscale = K.rotate_quant(idx.wq_b(q_lora).float().view(N, idx.n_heads, INDEX_HEAD_DIM))
        w = (F.linear(h.float(), idx.weights_proj.weight.float()) * qscale) * self.c
        ops.score_pools(
            q8, w, cache.index_k, cache.index_scale, pos, rs, table, cache.page_size, meta.max_pools, out=self.scores
        )
        return q_lora

    def eager_tail(self, q_lora: torch.Tensor) -> torch.Tensor:
        """Selection and sparse attention from the scores (host-syncing reference ops); the layer's output."""
        layer, meta = self.layer, self.meta
        cache = meta.kv_cache_manager.kpool_layer_cache(0)
        N = q_lora.shape[0]
        pool_ids = select_topk_pools(self.scores, meta.positions_t, layer.indexer.topk_pools)
        sel = meta.selection(N)
        sel.copy_(kpool_ops(q_lora.device).expand_selection(pool_ids, meta.positions_t, layer.indexer.select_width))
        w_uk, w_uv = layer.absorbed_weights()
        q = layer.q_b_proj(q_lora).view(N, layer.num_heads, layer.qk_nope)
        q_abs = torch.einsum("nhd,hdr->nhr", q, w_uk)
        o_lat = sparse_mla_attention(
            q_abs, cache.latent, sel, meta.row_seq_t, meta.slot_table_t, cache.page_size, layer.softmax_scale
        )
        o = torch.einsum("nhr,hvr->nhv", o_lat, w_uv).reshape(N, layer.num_heads * layer.v_head)
        return layer.o_proj(o)


def _prefill(layer, meta, drf, h: torch.Tensor, *, one_by_one: bool = False) -> None:
    """Eager prefill of both prompts (rows of A, then B, in ``h``) in the draft domain.

    Writes the draft manager's current pages. ``one_by_one`` runs B then A as single-request steps, which
    leaves the draft buffer holding another batch's rows afterwards.
    """
    rows = {A: h[: PROMPT[A]], B: h[PROMPT[A] :]}
    batches = [[B], [A]] if one_by_one else [[A, B]]
    for rids in batches:
        meta.prepare(rids, past_lens=[0] * len(rids), q_lens=[PROMPT[r] for r in rids], num_decode_seqs=0)
        with draft_replay(meta, drf):
            layer(torch.cat([rows[r] for r in rids]), meta, meta.kv_cache_manager.kpool_layer_cache(0))


@torch.no_grad()
def test_captured_draft_forward_replays_after_draft_ids_change() -> None:
    dev = torch.device("cuda")
    tgt, drf = _managers(dev)
    layer = GlmKpoolSparseMLA(CFG)
    layer.reset_parameters(torch.Generator().manual_seed(0), 0.05)
    layer = layer.to(dev)
    meta = GlmKpoolMetadata(
        kv_cache_manager=tgt, max_num_seqs=4, max_num_tokens=64, max_pages_per_seq=4, select_width=19, device=dev
    )
    g = torch.Generator().manual_seed(1)
    h_prompt = torch.randn(PROMPT[A] + PROMPT[B], CFG.hidden_size, generator=g).to(dev)
    h_decode = [torch.randn(2, CFG.hidden_size, generator=g).to(dev) for _ in range(2)]
    decode = dict(past_lens=[PROMPT[A], PROMPT[B]], q_lens=[1, 1], num_decode_seqs=2)

    _prefill(layer, meta, drf, h_prompt)
    meta.prepare([A, B], **decode)
    step = DraftStep(layer, meta, num_rows=2)
    static_h = h_decode[0].clone()

    # Warm up on a side stream (Triton compiles, allocator pools settle), with the draft table bound.
    saved = prepare_attn_metadata_for_draft_replay(meta, drf)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step.graph_part(static_h)
    torch.cuda.current_stream().wait_stream(side)
    restore_attn_metadata_after_draft_replay(meta, saved)
    old_rows = drf.get_batch_slot_tables([A, B])
    old_slots = drf.get_batch_state_slots([A, B])

    graph = torch.cuda.CUDAGraph()
    guard = GraphAddressGuard()
    with torch.cuda.graph(graph):
        # During capture the hook only rebinds (a fill would be recorded from host staging).
        captured = meta.prepare_for_draft_forward(drf)
        guard.capture(meta)
        static_q_lora = step.graph_part(static_h)
        meta.restore_after_draft_forward(captured)
    captured_ptr = guard.addresses["slot_table"]
    assert captured_ptr == meta.draft_slot_table.data_ptr() != meta.target_slot_table.data_ptr()

    # The draft manager re-admits both requests: their pages and state slots change; request 200 takes
    # the freed ids, so a replay that wrote through the old table would corrupt it.
    drf.free_request(A)
    drf.free_request(B)
    drf.add_request(200, 3 * P)
    for rid in (B, A):
        drf.add_request(rid, PROMPT[rid] + 1)
    new_rows = drf.get_batch_slot_tables([A, B])
    assert all(set(o).isdisjoint(n) for o, n in zip(old_rows, new_rows))
    assert drf.get_batch_state_slots([A, B]) != old_slots
    print(f"\n[draft-graph] draft rows {old_rows} -> {new_rows}, state slots {old_slots} -> "
          f"{drf.get_batch_state_slots([A, B])}")  # fmt: skip
    _prefill(layer, meta, drf, h_prompt, one_by_one=True)  # the new pages get the same history, eagerly
    meta.prepare([A, B], **decode)
    expected = [r + [-1] * (4 - len(r)) for r in new_rows]
    # What the last eager draft forward left in the buffer is not this step's table: the refill must happen.
    assert meta.draft_slot_table[:2].tolist() != expected
    dcache = drf.kpool_layer_cache(0)
    start = _clone(dcache)

    # Pre-replay prepare (outside capture): fills the captured buffer in place, then replay.
    saved = prepare_attn_metadata_for_draft_replay(meta, drf)
    guard.check(meta)  # every graph-visible tensor where it was captured (draft binding as captured)
    assert meta.slot_table.data_ptr() == captured_ptr
    table = meta.draft_slot_table[:2].tolist()
    assert table == expected
    static_h.copy_(h_decode[1])
    graph.replay()
    out_graph = step.eager_tail(static_q_lora)
    restore_attn_metadata_after_draft_replay(meta, saved)
    after_graph = _clone(dcache)
    print(f"[draft-graph] captured slot_table {captured_ptr:#x}, after refill {meta.draft_slot_table.data_ptr():#x}, "
          f"holds {table}")  # fmt: skip

    # Eager reference from the same cache state.
    _restore(dcache, start)
    with draft_replay(meta, drf) as m:
        out_eager = layer(h_decode[1], m, m.kv_cache_manager.kpool_layer_cache(0))
    torch.cuda.synchronize()

    diff = (out_graph - out_eager).abs().max().item()
    print(f"[draft-graph] replayed vs eager draft output {tuple(out_graph.shape)}: max abs diff {diff:.3e}")
    assert torch.isfinite(out_graph).all()
    assert diff <= 1e-5
    ga, ea, sa = _planes(after_graph), _planes(dcache), _planes(start)
    for name in ga:
        bad = int((ga[name] != ea[name]).sum())
        print(f"[draft-graph] draft cache {name}: {bad} elements differ between replay and eager")
        assert bad == 0, name
    # Request 200 now owns the old pages: the replay did not write through the stale table.
    for p in drf.get_batch_slot_tables([200])[0]:
        for name in ga:
            if name != "tail":
                assert torch.equal(ga[name][p], sa[name][p]), (name, p)
    # The replay did write this step's rows (position 15 of A, 7 of B) into the new pages.
    for i, rid in enumerate((A, B)):
        pos = PROMPT[rid]
        page = new_rows[i][pos // P]
        assert not torch.equal(ga["latent"][page, pos % P], sa["latent"][page, pos % P])
