"""Host time of one KDA layer's mixed-step orchestration (issue 42), kernels stubbed: a CPU proxy of what the host
pays per KDA layer around the kernels when a step admits prompts next to decoding requests.

`KimiDeltaAttention._forward_o` runs on a ``D`` decode + ``N`` short-prefill batch (``L`` rows each, fresh) with its
fused ops (conv, recurrent step, verify, commit) replaced by stand-ins that only allocate their outputs, so what is
timed is the layer's own Python and torch ops (row splits, index building, gathers, the output's allocation and
scatters): the part the GPU pays on the host too, the kernels' launches aside. The batch carries a per-step scratch
as ``AttentionMetadata`` does, so the first layer of a step builds the step's host plan and index tensors and the
later layers reuse them; both are reported (µs, min and median over ``--reps`` steps; later layers averaged over
``--layers - 1``).

Usage: ``OMP_NUM_THREADS=1 python -m benchmarks.bench_kda_mixed_host --decode 15 --new 16 --prompt-len 30``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--decode", type=int, default=15, help="decoding requests (D)")
    ap.add_argument("--new", type=int, default=16, help="prompts admitted (N)")
    ap.add_argument("--prompt-len", type=int, default=30, help="their length (L, at most the short-prefill limit)")
    ap.add_argument("--layers", type=int, default=5, help="KDA layers per step (the first builds the step's plan)")
    ap.add_argument("--reps", type=int, default=300)
    args = ap.parse_args()
    os.environ.setdefault("TRTLLM_GLM_KDA_SHORT_PREFILL", "64")  # the CUDA default
    torch.set_num_threads(1)
    import trtllm_glm.kda.layer as kda_layer
    from trtllm_glm.config import Glm5NextConfig
    from trtllm_glm.kda.batch import KdaBatch
    from trtllm_glm.kda.ops import KdaRecords
    from trtllm_glm.state import KdaLayerState

    cfg = Glm5NextConfig.from_pretrained("tiny")
    layer = kda_layer.KimiDeltaAttention(cfg, 0)
    layer.fuse_weights()
    H, K, V = layer.num_heads, layer.head_k_dim, layer.head_v_dim

    # Stand-ins for the fused ops (one allocation each, as a kernel launch allocates its outputs).
    def conv_decode(x, conv, w, slots, *dims):  # noqa: ANN001, ANN002, ANN202, ARG001
        return torch.empty(x.shape[0], H, K), torch.empty(x.shape[0], H, K), torch.empty(x.shape[0], H, V)

    def decode(q, *a, **k):  # noqa: ANN001, ANN002, ANN003, ANN202, ARG001
        return torch.empty(q.shape[0], H, V)

    def conv_verify(x, conv, w, slots, h, k_, v_, Wm, **kw):  # noqa: ANN001, ANN003, ANN202, ARG001
        n = slots.shape[0]
        return torch.empty(n, Wm, H, K), torch.empty(n, Wm, H, K), torch.empty(n, Wm, H, V)

    def verify(q, k, v, g, beta, *a, **kw):  # noqa: ANN001, ANN002, ANN003, ANN202, ARG001
        return torch.empty(q.shape[0], q.shape[1], H, V), KdaRecords(g=g, k=k, u=v)

    def nothing(*a, **k) -> None:  # noqa: ANN002, ANN003, ARG001
        return None

    stubs = {"conv_decode": conv_decode, "kda_decode_inplace": decode, "conv_verify_qkv": conv_verify,
             "kda_verify": verify, "conv_commit_slots": nothing, "kda_commit": nothing}  # fmt: skip
    for name, fn in stubs.items():
        setattr(kda_layer, name, fn)

    q = [1] * args.decode + [args.prompt_len] * args.new
    p = [20] * args.decode + [0] * args.new
    batch = KdaBatch.build(q, p, list(range(len(q))))
    N = sum(q)
    x, g, beta = torch.randn(N, layer.conv_dim), torch.randn(N, H, K), torch.randn(N, H)
    state = KdaLayerState(recurrent=torch.zeros(len(q), H, K, V), conv=torch.zeros(len(q), layer.conv_dim, 3))
    hidden = torch.randn(N, cfg.hidden_size)
    first, later = [], []
    for _ in range(args.reps):
        batch.kda_scratch = {}  # a new step
        t0 = time.perf_counter()
        layer._forward_o(hidden, batch, state, (x, g, beta, None))
        t1 = time.perf_counter()
        for _ in range(args.layers - 1):
            layer._forward_o(hidden, batch, state, (x, g, beta, None))
        t2 = time.perf_counter()
        first.append(1e6 * (t1 - t0))
        later.append(1e6 * (t2 - t1) / max(1, args.layers - 1))
    print(
        f"KDA mixed-step orchestration, D={args.decode} N={args.new} L={args.prompt_len}: first layer of a step "
        f"min {min(first):.1f} / median {statistics.median(first):.1f} us; later layers min {min(later):.1f} / "
        f"median {statistics.median(later):.1f} us"
    )


if __name__ == "__main__":
    main()
