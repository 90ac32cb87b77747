"""Hazard §6.1 under CUDA graphs: a draft forward captured with the draft slot table bound replays correctly
after the draft manager's page ids and state slots change, because the pre-replay prepare refreshes the
same persistent buffer in place.

What is captured: the whole sparse MLA layer's draft forward (projections, latent write, index keys,
decode pool and tail-ring update, query quantisation, scoring, top-k selection, expansion, sparse
attention, output projection) with the Triton kernels on CUDA. The reference ops skip their host-syncing
validation while a graph is being captured (the eager run validated the same shapes) and use no
data-dependent shapes, so nothing in the layer syncs with the host.

Needs CUDA (tests/conftest.py skips it otherwise). Run with ``-s`` to see what is compared.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from trtllm_glm.attention.graph_check import GraphAddressGuard
from trtllm_glm.attention.sparse.glm_kpool.layer import GlmKpoolSparseMLA
from trtllm_glm.attention.sparse.glm_kpool.metadata import GlmKpoolMetadata
from trtllm_glm.cache.manager import Glm5NextCacheManager, KpoolLayerCache
from trtllm_glm.config import Glm5NextConfig
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
    """The sparse layer's draft forward on a static input; ``out`` is the static output a replay refills."""

    def __init__(self, layer: GlmKpoolSparseMLA, meta: GlmKpoolMetadata, num_rows: int) -> None:
        self.layer, self.meta = layer, meta
        self.out: torch.Tensor | None = None

    def graph_part(self, h: torch.Tensor) -> torch.Tensor:
        """The whole layer through the bound slot table and state slots."""
        self.out = self.layer(h, self.meta, self.meta.kv_cache_manager.kpool_layer_cache(0))
        return self.out

    def eager_tail(self, out: torch.Tensor) -> torch.Tensor:
        """Nothing is left to run eagerly: the captured graph produced the output."""
        return out


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
