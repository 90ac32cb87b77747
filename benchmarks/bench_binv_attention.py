"""Cost of the batch-invariant mode (issue 31) in the attention kernels: default vs mode, CUDA-graph replay.

Real GLM-5.3-Flash geometry, one line per (op, rows), the default launch and the mode's
(`trtllm_glm.numerics.batch_invariant_mode`), microseconds per call:

* ``kda decode``: the in-place decode step of N sequences on an FP32 state pool (default: fla-core's
  ``fused_recurrent_kda`` in place when it imports, else the torch reference; mode: the verify kernel's step,
  ``kernels.kda_decode_inplace``, value block 32, no FP contraction);
* ``kda verify+commit``: W = 4 verify rows and a commit of all 4 (default: the value block shrinks with few
  sequences; mode: 32 always);
* ``sparse mla``: W = 2051 selected entries, 64 heads x 512 latent, bf16 (default: the split count follows
  the rows; mode: 11 splits at every row count);
* ``mla absorb q+o``: the layer's two absorbed per-head products, ``q W_uk`` and ``o_lat W_uv^T`` (default:
  ``torch.einsum``, cuBLAS; mode: ``trtllm_glm.linear.invariant_bmm``).

Each graph replays G steps on disjoint data and slots (together larger than the L2), divided by G.

Usage (CUDA machine, repository root)::

    python -m benchmarks.bench_binv_attention [--quick] [--json PATH]

Without CUDA it prints a message and exits 0.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable

import torch

from benchmarks.bench_sparse_kernels import MlaData
from benchmarks.harness.timing import graph_us
from trtllm_glm.attention.sparse.glm_kpool import kernels as KP
from trtllm_glm.config import Glm5NextConfig
from trtllm_glm.kda.ops import kda_commit, kda_gate, kda_verify, l2_normalize
from trtllm_glm.kda.ops.backend import kda_decode_inplace
from trtllm_glm.numerics import batch_invariant_mode

_REAL = Glm5NextConfig.from_pretrained("glm-5.3-flash")
H, K, V = _REAL.kda_num_heads, _REAL.kda_head_dim, _REAL.kda_head_dim
SCALE = K**-0.5
KDA_ROWS = (1, 16, 64)
MLA_ROWS = (1, 2, 4, 16, 64)
STATE_BYTES = H * K * V * 4


def _kda_inputs(N: int, W: int, dev: torch.device, seed: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator(device=dev).manual_seed(seed)

    def r(*s: int) -> torch.Tensor:
        return torch.randn(*s, device=dev, generator=gen)

    A_log = torch.empty(H, device=dev).uniform_(1.0, 16.0, generator=gen).log()
    g = kda_gate(r(N, W, H, K) * 2.0, A_log, r(H * K) * 0.1, -5.0)
    return l2_normalize(r(N, W, H, K)), l2_normalize(r(N, W, H, K)), r(N, W, H, V), g, torch.sigmoid(r(N, W, H))


def _sets(N: int) -> int:
    """Steps per graph: their states together exceed 256 MiB (more than the L2), at most 32."""
    return max(2, min(32, -(-(256 << 20) // (N * STATE_BYTES))))


def _time(make: Callable[[bool], list[Callable[[], object]]], reps: int) -> tuple[float, float]:
    """``(default, mode)`` microseconds per step; the mode is on while the graph is captured."""
    out = []
    for mode in (False, True):
        with batch_invariant_mode(mode):
            calls = make(mode)
            out.append(graph_us(calls, reps) / len(calls))
    return out[0], out[1]


def kda_cases(dev: torch.device, reps: int) -> list[dict]:
    rows = []
    for N in KDA_ROWS:
        G = _sets(N)
        pool = torch.randn(G * N, H, K, V, device=dev) * 0.5
        slots = [torch.arange(i * N, (i + 1) * N, device=dev) for i in range(G)]
        dec = [tuple(t[:, 0].contiguous() for t in _kda_inputs(N, 1, dev, 10 + i)) for i in range(G)]

        def decode(_mode: bool, dec=dec, pool=pool, slots=slots) -> list[Callable[[], object]]:
            return [lambda i=i: kda_decode_inplace(*dec[i], SCALE, pool, slots[i]) for i in range(len(dec))]

        t_def, t_mode = _time(decode, reps)
        rows.append({"op": "kda decode", "rows": N, "default_us": t_def, "mode_us": t_mode})
        ver = [_kda_inputs(N, 4, dev, 100 + i) for i in range(G)]
        a = torch.full((N,), 4, dtype=torch.int64, device=dev)

        def verify(_mode: bool, ver=ver, pool=pool, slots=slots, a=a) -> list[Callable[[], object]]:
            def step(i: int) -> None:
                _, rec = kda_verify(*ver[i], SCALE, pool, state_slots=slots[i])
                kda_commit(pool, rec, a, state_slots=slots[i])

            return [lambda i=i: step(i) for i in range(len(ver))]

        t_def, t_mode = _time(verify, reps)
        rows.append({"op": "kda verify+commit W=4", "rows": N, "default_us": t_def, "mode_us": t_mode})
        del pool
    return rows


def mla_cases(dev: torch.device, reps: int) -> list[dict]:
    rows = []
    data = MlaData(dev, 128)
    for N in MLA_ROWS:
        G = max(2, min(16, 128 // N))
        batches = [data.batch(N, (i * N) % 128) for i in range(G)]
        outs = [torch.empty_like(b[0]) for b in batches]

        def mla(_mode: bool, batches=batches, outs=outs) -> list[Callable[[], object]]:
            return [
                lambda i=i: KP.sparse_mla_attention(
                    batches[i][0], data.cache, batches[i][1], batches[i][2], data.table, 64, 0.05, out=outs[i]
                )
                for i in range(len(batches))
            ]

        t_def, t_mode = _time(mla, reps)
        rows.append({"op": "sparse mla W=2051", "rows": N, "default_us": t_def, "mode_us": t_mode})
    return rows


def absorb_cases(dev: torch.device, reps: int) -> list[dict]:
    """The sparse-MLA layer's two absorbed per-head products (`layer.absorb_q` / `absorb_o`): einsum vs
    `invariant_bmm`."""
    from trtllm_glm.attention.sparse.glm_kpool.layer import absorb_o, absorb_q

    nope, vh, R, Hm = _REAL.qk_nope_head_dim, _REAL.v_head_dim, _REAL.kv_lora_rank, _REAL.num_attention_heads
    rows = []
    G = 8
    kv_b = [torch.randn(Hm, nope + vh, R, device=dev, dtype=torch.bfloat16) * 0.05 for _ in range(G)]
    uk_t = [w[:, :nope].transpose(1, 2).contiguous() for w in kv_b]
    for N in KDA_ROWS:
        q = [torch.randn(N, Hm, nope, device=dev, dtype=torch.bfloat16) for _ in range(G)]
        o = [torch.randn(N, Hm, R, device=dev, dtype=torch.bfloat16) for _ in range(G)]

        def both(_mode: bool, q=q, o=o) -> list[Callable[[], object]]:
            def step(i: int) -> None:
                absorb_q(q[i], kv_b[i][:, :nope], uk_t[i])
                absorb_o(o[i], kv_b[i][:, nope:])

            return [lambda i=i: step(i) for i in range(G)]

        t_def, t_mode = _time(both, reps)
        rows.append({"op": "mla absorb q+o", "rows": N, "default_us": t_def, "mode_us": t_mode})
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer replays")
    parser.add_argument("--json", default=None, help="also write the rows as JSON to this path")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_binv_attention: no CUDA device; nothing to measure")
        return 0
    dev = torch.device("cuda")
    reps = 10 if args.quick else 30
    rows = kda_cases(dev, reps) + mla_cases(dev, reps) + absorb_cases(dev, reps)
    print(f"{'op':<24} {'rows':>5} {'default us':>11} {'mode us':>9} {'mode/default':>13}")
    for r in rows:
        r["ratio"] = r["mode_us"] / r["default_us"]
        print(f"{r['op']:<24} {r['rows']:>5} {r['default_us']:>11.2f} {r['mode_us']:>9.2f} {r['ratio']:>13.3f}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
