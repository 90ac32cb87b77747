"""Per-layer decode-step benchmark at real GLM-5.3-Flash geometry (bf16, one H200).

Times one decode step of a sparse MLA layer (k-pool indexer + sparse attention over 2051 selected
tokens) and of a KDA layer for a batch of requests with a long context, eagerly and as a CUDA-graph
replay (the sparse layer), and reports achieved bandwidth (weights + cache bytes read) against a
device-to-device copy ceiling measured in the same run, plus the ratio to the torch-reference backend.

The KDA layer is also timed as the decode graph runs it (fused input weights, graph replay) with its fused
decode kernel off and on (``TRTLLM_GLM_KDA_FUSED_DECODE``).

Usage: ``python -m benchmarks.bench_layers [--batch 64] [--context 4096]``. Exits cleanly without CUDA.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

from benchmarks.harness.ceiling import copy_ceiling_gbs
from benchmarks.harness.timing import event_us
from trtllm_glm import envs
from trtllm_glm.attention.sparse.glm_kpool.layer import GlmKpoolSparseMLA
from trtllm_glm.attention.sparse.glm_kpool.metadata import GlmKpoolMetadata
from trtllm_glm.cache.manager import Glm5NextCacheManager
from trtllm_glm.config import Glm5NextConfig
from trtllm_glm.kda.batch import KdaBatch
from trtllm_glm.kda.layer import KimiDeltaAttention


def _param_bytes(m: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in m.parameters())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--context", type=int, default=4096)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_layers: CUDA is not available; nothing to benchmark.")
        return 0
    torch.manual_seed(0)
    dev = torch.device("cuda")
    cfg = Glm5NextConfig.from_pretrained("glm-5.3-flash")
    B, T, P = args.batch, args.context, 64
    ceiling = copy_ceiling_gbs()
    print(f"device {torch.cuda.get_device_name()}  copy ceiling {ceiling:.0f} GB/s  batch {B}  context {T}")

    # ---------------------------------------------------------------- sparse MLA layer
    mgr = Glm5NextCacheManager(cfg, num_pages=B * (T // P + 1), tokens_per_block=P, max_num_requests=B,
                               num_sparse_layers=1, num_kda_layers=0, dtype=torch.bfloat16, device=dev)  # fmt: skip
    layer = GlmKpoolSparseMLA(cfg)
    layer.reset_parameters(torch.Generator().manual_seed(0), 0.02)
    layer = layer.to(device=dev, dtype=torch.bfloat16)
    meta = GlmKpoolMetadata(kv_cache_manager=mgr, max_num_seqs=B, max_num_tokens=max(B, 8192),
                            max_pages_per_seq=T // P + 1, select_width=cfg.index_select_width, device=dev)  # fmt: skip
    cache = mgr.kpool_layer_cache(0)
    for r in range(B):
        mgr.add_request(r, T + 1)
    # Fill the caches with a real chunked prefill (512-row chunks keep the reference attention's
    # [rows, 2051, 512] gather small).
    C = 512
    with torch.no_grad():
        for r in range(B):
            for s in range(0, T, C):
                meta.prepare([r], past_lens=[s], q_lens=[min(C, T - s)], num_decode_seqs=0)
                layer(torch.randn(min(C, T - s), cfg.hidden_size, device=dev, dtype=torch.bfloat16), meta, cache)
    meta.prepare(list(range(B)), past_lens=[T] * B, q_lens=[1] * B, num_decode_seqs=B)
    h = torch.randn(B, cfg.hidden_size, device=dev, dtype=torch.bfloat16)

    def step() -> torch.Tensor:
        with torch.no_grad():
            return layer(h, meta, cache)

    rows = []
    w_bytes = _param_bytes(layer)
    sel_bytes = B * cfg.index_select_width * cfg.kv_lora_rank * 2  # selected latent rows (bf16)
    idx_bytes = B * (T // 4) * 132  # every complete pool's FP8 key + scale is scored
    moved = w_bytes + sel_bytes + idx_bytes
    us = event_us(step)
    rows.append(("sparse MLA decode (triton, eager)", us, moved))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    rows.append(("sparse MLA decode (triton, graph replay)", event_us(graph.replay), moved))
    os.environ["TRTLLM_GLM_KPOOL_BACKEND"] = "torch"
    rows.append(("sparse MLA decode (torch reference, eager)", event_us(step, iters=5), moved))
    os.environ["TRTLLM_GLM_KPOOL_BACKEND"] = "auto"
    del graph
    torch.cuda.empty_cache()

    # ---------------------------------------------------------------- KDA layer
    kmgr = Glm5NextCacheManager(cfg, num_pages=1, tokens_per_block=P, max_num_requests=B, num_sparse_layers=0,
                                num_kda_layers=1, dtype=torch.bfloat16, device=dev)  # fmt: skip
    kda = KimiDeltaAttention(cfg, 0)
    kda.reset_parameters(torch.Generator().manual_seed(0), 0.02)
    kda = kda.to(device=dev, dtype=torch.bfloat16)
    kda.A_log.data = kda.A_log.data.float()
    kda.dt_bias.data = kda.dt_bias.data.float()
    for r in range(B):
        kmgr.add_request(r)
    kmgr.kda_recurrent.normal_()
    kmeta = KdaBatch.build(
        q_lens=[1] * B, past_lens=[T] * B, state_slots=kmgr.get_batch_state_slots(range(B)), device=dev
    )
    state = kmgr.kda_layer_state(0)
    state_bytes = 2 * B * cfg.kda_num_heads * cfg.kda_head_dim * cfg.kda_head_dim * 4  # read + write FP32 state
    kmoved = _param_bytes(kda) + state_bytes
    for backend in ("fla", "torch"):
        kda.backend = backend
        try:
            us = event_us(lambda: kda(h, kmeta, state), iters=20 if backend == "fla" else 5)
        except Exception as e:  # noqa: BLE001 - a missing fla-core is reported, not fatal
            print(f"KDA backend {backend}: {type(e).__name__}: {e}")
            continue
        rows.append((f"KDA decode ({backend}, eager)", us, kmoved))
    # As the decode graph runs it (fused input weights, one CUDA-graph replay): the unfused path, then the fused
    # decode kernel (`TRTLLM_GLM_KDA_FUSED_DECODE`, docs/kernels.md "Fused KDA decode step"); read per call, so
    # each capture takes its own path.
    kda.backend = None
    kda.fuse_weights()
    before = os.environ.get(envs.KDA_FUSED_DECODE.name)
    try:
        for setting in ("0", "1"):
            os.environ[envs.KDA_FUSED_DECODE.name] = setting
            kda(h, kmeta, state)  # compile outside the capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                kda(h, kmeta, state)
            rows.append((f"KDA decode (fused {setting}, graph replay)", event_us(graph.replay), kmoved))
            del graph
    finally:
        if before is None:
            os.environ.pop(envs.KDA_FUSED_DECODE.name, None)
        else:
            os.environ[envs.KDA_FUSED_DECODE.name] = before

    base = {n.split(" (")[0]: us for n, us, _ in rows if "reference" in n or "torch" in n}
    print(f"\n{'step':<44} {'us':>9} {'MB moved':>9} {'GB/s':>7} {'%copy':>6} {'vs torch':>9}")
    for name, us, b in rows:
        ref = base.get(name.split(" (")[0])
        ratio = f"{ref / us:8.1f}x" if ref and "torch" not in name else f"{'-':>9}"
        gbps = b / (us * 1e-6) / 1e9
        print(f"{name:<44} {us:9.1f} {b / 1e6:9.1f} {gbps:7.0f} {100 * gbps / ceiling:6.1f} {ratio}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
