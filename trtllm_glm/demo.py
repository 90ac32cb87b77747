"""Indexer demo: prefill a few random requests through one sparse MLA layer and show the selection."""

from __future__ import annotations

import torch

from .attention.sparse.glm_kpool.backend import backend_name
from .attention.sparse.glm_kpool.layer import GlmKpoolSparseMLA
from .attention.sparse.glm_kpool.metadata import GlmKpoolMetadata
from .cache.manager import Glm5NextCacheManager
from .config import Glm5NextConfig

__all__ = ["run_indexer_demo"]


@torch.no_grad()
def run_indexer_demo(
    *,
    preset: str = "tiny",
    num_requests: int = 3,
    prompt_len: int = 37,
    tokens_per_block: int = 16,
    seed: int = 0,
    device: str = "cpu",
) -> dict[str, object]:
    """Prefill ``num_requests`` random prompts (lengths around ``prompt_len``) through one sparse layer.

    Prints, per request, the selected token positions of its last row and the cache bytes in use;
    returns the same facts as a dict.
    """
    cfg = Glm5NextConfig.from_pretrained(preset)
    g = torch.Generator().manual_seed(seed)
    lens = [max(1, prompt_len + 5 * i) for i in range(num_requests)]
    P = tokens_per_block
    pages = sum(-(-n // P) for n in lens)
    mgr = Glm5NextCacheManager(
        cfg, num_pages=pages, tokens_per_block=P, max_num_requests=num_requests, num_kda_layers=0,
        num_sparse_layers=1, device=device,
    )  # fmt: skip
    layer = GlmKpoolSparseMLA(cfg)
    layer.reset_parameters(g, cfg.initializer_range)
    layer.to(device)
    meta = GlmKpoolMetadata(
        kv_cache_manager=mgr,
        max_num_seqs=num_requests,
        max_num_tokens=sum(lens),
        max_pages_per_seq=max(-(-n // P) for n in lens),
        select_width=cfg.index_select_width,
        device=device,
    )
    for i, n in enumerate(lens):
        mgr.add_request(i, n)
    meta.prepare(list(range(num_requests)), past_lens=[0] * num_requests, q_lens=lens, num_decode_seqs=0)
    h = torch.randn(sum(lens), cfg.hidden_size, generator=g).to(device)
    out = layer(h, meta, mgr.kpool_layer_cache(0))
    sel = meta.selection_buf[: sum(lens)].cpu()
    print(f"preset={preset}  index_topk={cfg.index_topk} tokens ({cfg.index_topk_pools} pools)  "
          f"page={P} tokens  backend={backend_name(torch.device(device))}")  # fmt: skip
    report = {"selected": [], "bytes_used": mgr.used_bytes(), "bytes_per_token": mgr.bytes_per_token}
    for i, n in enumerate(lens):
        last = meta.cu_seqlens[i + 1] - 1
        ids = [t for t in sel[last].tolist() if t >= 0]
        report["selected"].append(ids)  # type: ignore[union-attr]
        print(f"request {i}: {n} tokens, pages {mgr.get_batch_slot_tables([i])[0]}")
        print(f"  last row (pos {n - 1}) attends {len(ids)} of {n} tokens: {ids}")
    print(f"cache: {mgr.used_bytes()} bytes in use, {mgr.bytes_per_token:.1f} bytes/token/all sparse layers; "
          f"output norm {out.norm().item():.4f}")  # fmt: skip
    return report
