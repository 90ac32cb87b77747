"""Benchmark of the Triton KDA speculative verify + commit kernels at real GLM-5.3-Flash KDA geometry.

64 heads, K = V = 128 (from the ``glm-5.3-flash`` preset), FP32 state pool ``[S, H, K, V]`` addressed
through slots (as the layer does), batch N = 1, 16, 64 sequences, W = 1, 4, 8 verify rows each, every
sequence accepting all W rows (the commit's worst case). Inputs are FP32 like the layer's (``--dtype
bfloat16`` for half-width inputs). Per case:

* ``triton``: verify (outputs into persistent buffers) + commit, replayed from a CUDA graph (G back-to-back
  steps on disjoint data and slots, together larger than the L2, divided by G; CUDA events), also split
  into ``verify`` and ``commit`` alone; ``eager`` is do_bench's median (L2 flushed before each run);
* ``torch``: the reference verify + commit (gather, token loop, masked replay, scatter), eager;
* ``fla``: fla-core's ``fused_recurrent_kda`` over the same W rows from the same states (reads the state
  once, writes the final state once: a forward-only speed yardstick, it cannot roll back), graph replay.

The bytes floor is the brief's: the state read and written once, q/k/g/v/beta read once, ``o`` written
once (FP32). The record-based pair cannot reach it by design: verify must not write the state (acceptance
is unknown), so the state is read twice and ``u`` is written and read back; that floor is the ``2-pass``
column. GB/s and ``x floor`` use the floor bytes over the graph time; the copy ceiling is a 1 GiB
device-to-device copy in the same run (read + write). Each kernel's results are checked against the
reference before timing.

Usage (on a CUDA machine, from the repository root)::

    python -m benchmarks.bench_kda_verify [--quick] [--sweep] [--dtype bfloat16] [--json PATH]

``--sweep`` also times other launch shapes (``block_v`` x ``num_warps``, and no row-loop prefetch). Without
CUDA it prints a message and exits 0.
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import asdict, dataclass, field
from functools import partial

import torch

from benchmarks.harness.ceiling import copy_ceiling_gbs
from benchmarks.harness.rows import device_line, write_json
from benchmarks.harness.timing import bench_us, graph_us_quick
from trtllm_glm.config import Glm5NextConfig
from trtllm_glm.kda import kernels as KK
from trtllm_glm.kda.ops import fla_kda_available, kda_gate, l2_normalize
from trtllm_glm.kda.ops import verify as R

_REAL = Glm5NextConfig.from_pretrained("glm-5.3-flash")
H, K, V = _REAL.kda_num_heads, _REAL.kda_head_dim, _REAL.kda_head_dim
SCALE = K**-0.5
BATCHES = (1, 16, 64)
WIDTHS = (1, 4, 8)
L2_DEFEAT_BYTES = 256 << 20  # the graph's steps together touch at least this much distinct data
MAX_SETS = 32


@dataclass
class Case:
    N: int
    W: int
    dtype: str
    floor_mb: float
    floor_us: float
    two_pass_us: float
    triton_graph_us: float | None = None
    triton_eager_us: float | None = None
    verify_graph_us: float | None = None
    commit_graph_us: float | None = None
    torch_eager_us: float | None = None
    fla_graph_us: float | None = None
    fla_eager_us: float | None = None
    gbps: float | None = None
    pct_copy: float | None = None
    x_floor: float | None = None
    err_o: float | None = None
    err_state: float | None = None
    sweep: dict[str, float] = field(default_factory=dict)
    note: str = ""


def _bytes(N: int, W: int, es: int) -> tuple[int, int]:
    """``(floor, two_pass)`` bytes of one verify + commit of N sequences x W rows (all accepted)."""
    state = N * H * K * V * 4
    inputs = N * W * H * (3 * K + V + 1) * es
    o = N * W * H * V * 4
    floor = 2 * state + inputs + o
    # verify: state + inputs read, o and u written; commit: state read + written, g, k (FP32) and u read.
    two_pass = 3 * state + inputs + 2 * o + N * W * H * (2 * K * 4 + V * 4)
    return floor, two_pass


class _Set:
    """One batch: inputs, its N slots of the shared pool, output buffers, accepted counts."""

    def __init__(self, N: int, W: int, slots: torch.Tensor, dtype: torch.dtype, seed: int) -> None:
        dev = slots.device
        gen = torch.Generator(device=dev).manual_seed(seed)

        def r(*s: int) -> torch.Tensor:
            return torch.randn(*s, device=dev, generator=gen)

        A_log = torch.empty(H, device=dev).uniform_(1.0, 16.0, generator=gen).log()
        self.q = l2_normalize(r(N, W, H, K)).to(dtype)
        self.k = l2_normalize(r(N, W, H, K)).to(dtype)
        self.v = r(N, W, H, V).to(dtype)
        self.g = kda_gate(r(N, W, H, K) * 2.0, A_log, r(H * K) * 0.1, -5.0).to(dtype)
        self.beta = torch.sigmoid(r(N, W, H)).to(dtype)
        self.slots = slots
        self.fresh = torch.zeros(N, dtype=torch.bool, device=dev)
        self.a = torch.full((N,), W, dtype=torch.int64, device=dev)
        self.o = torch.empty(N, W, H, V, device=dev)
        self.u = torch.empty(N, W, H, V, device=dev)
        self.args = (self.q, self.k, self.v, self.g, self.beta)

    def verify(self, pool: torch.Tensor, **kw):
        return KK.kda_verify(
            *self.args, SCALE, pool, state_slots=self.slots, fresh=self.fresh, out=(self.o, self.u), **kw
        )

    def step(self, pool: torch.Tensor, **kw) -> None:
        _, rec = self.verify(pool, **kw)
        KK.kda_commit(pool, rec, self.a, state_slots=self.slots, fresh=self.fresh, **kw)

    def commit_only(self, pool: torch.Tensor, rec: R.KdaRecords) -> None:
        KK.kda_commit(pool, rec, self.a, state_slots=self.slots, fresh=self.fresh)

    def torch_step(self, pool: torch.Tensor) -> None:
        _, rec = R.kda_verify(*self.args, SCALE, pool, state_slots=self.slots, fresh=self.fresh, backend="torch")
        R.kda_commit(pool, rec, self.a, state_slots=self.slots, fresh=self.fresh, backend="torch")


def _rel(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


def bench_case(
    N: int, W: int, dtype: torch.dtype, ceiling: float, quick: bool, sweep: bool, dev: torch.device | None = None
) -> Case:
    """Checks and times one (N, W) case (``dev`` other than CUDA only for smoke runs with stubbed timers)."""
    dev = dev or torch.device("cuda")
    es = torch.tensor([], dtype=dtype).element_size()
    floor, two_pass = _bytes(N, W, es)
    case = Case(
        N, W, str(dtype).removeprefix("torch."), floor / 1e6, floor / (ceiling * 1e9) * 1e6,
        two_pass / (ceiling * 1e9) * 1e6,
    )  # fmt: skip
    G = max(1, min(MAX_SETS, math.ceil(L2_DEFEAT_BYTES / two_pass)))
    gen = torch.Generator(device=dev).manual_seed(N * 100 + W)
    # A pool larger than the batches, slots permuted: the kernels gather through the slot table.
    S = G * N + 3
    pool = 0.5 * torch.randn(S, H, K, V, device=dev, generator=gen)
    perm = torch.randperm(S, device=dev, generator=gen)
    sets = [_Set(N, W, perm[i * N : (i + 1) * N].contiguous(), dtype, seed=i) for i in range(G)]

    # Correctness on set 0 before timing.
    s0 = sets[0]
    ref_pool, got_pool = pool.clone(), pool.clone()
    o_ref, rec_ref = R.kda_verify(
        *[t.float() for t in s0.args], SCALE, ref_pool, state_slots=s0.slots, fresh=s0.fresh, backend="torch"
    )
    R.kda_commit(ref_pool, rec_ref, s0.a, state_slots=s0.slots, fresh=s0.fresh, backend="torch")
    o, _ = s0.verify(got_pool)
    o = o.clone()
    s0.step(got_pool)
    case.err_o, case.err_state = _rel(o, o_ref), _rel(got_pool[s0.slots], ref_pool[s0.slots])
    if not (case.err_o < 1e-4 and case.err_state < 1e-4):
        raise AssertionError(f"N={N} W={W}: relative error o {case.err_o:.2e}, state {case.err_state:.2e}")
    del ref_pool, got_pool, rec_ref, o_ref

    case.triton_eager_us = bench_us(partial(s0.step, pool), quick)
    case.triton_graph_us = graph_us_quick([partial(s.step, pool) for s in sets], quick)
    case.verify_graph_us = graph_us_quick([partial(s.verify, pool) for s in sets], quick)
    recs = [s.verify(pool)[1] for s in sets]
    case.commit_graph_us = graph_us_quick([partial(s.commit_only, pool, r) for s, r in zip(sets, recs)], quick)
    t = case.triton_graph_us
    case.gbps = floor / (t * 1e-6) / 1e9
    case.pct_copy = 100 * case.gbps / ceiling
    case.x_floor = t / case.floor_us
    case.torch_eager_us = bench_us(partial(s0.torch_step, pool), quick, slow=True)

    if fla_kda_available():
        from fla.ops.kda import fused_recurrent_kda

        states = [pool.index_select(0, s.slots) for s in sets]

        def fla_call(s: _Set, h0: torch.Tensor) -> None:
            fused_recurrent_kda(
                q=s.q, k=s.k, v=s.v, g=s.g, beta=s.beta, scale=SCALE, initial_state=h0, output_final_state=True
            )

        try:
            case.fla_eager_us = bench_us(partial(fla_call, sets[0], states[0]), quick)
            case.fla_graph_us = graph_us_quick([partial(fla_call, s, h0) for s, h0 in zip(sets, states)], quick)
        except Exception as e:  # noqa: BLE001 - the yardstick is optional
            case.note += f"fla failed: {type(e).__name__}: {' '.join(str(e).split())[:120]} "
        del states
    else:
        case.note += "fla-core not importable "

    bv_default = KK.kernel_module("verify", dev).choose_block_v(N * H, V, dev)
    if sweep:
        shapes = [(bv, nw, 2) for bv in (8, 16, 32, 64) for nw in (2, 4, 8)] + [(bv_default, 4, 1)]
        for bv, nw, st in shapes:
            label = f"bv{bv} w{nw} s{st}"
            try:
                calls = [partial(s.step, pool, block_v=bv, num_warps=nw, num_stages=st) for s in sets]
                case.sweep[label] = graph_us_quick(calls, quick)
            except Exception as e:  # noqa: BLE001 - one failing launch shape must not lose the others
                print(f"    sweep {label}: FAILED {type(e).__name__}: {str(e)[:200]}", flush=True)
    case.note += f"G={G} bv={bv_default}"
    return case


def _fmt(x: float | None, w: int = 8, p: int = 1) -> str:
    return f"{x:{w}.{p}f}" if x is not None else f"{'-':>{w}}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions")
    parser.add_argument("--sweep", action="store_true", help="also time other launch shapes")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="input dtype")
    parser.add_argument("--json", default=None, help="also write the cases as JSON to this path")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_kda_verify: CUDA is not available; nothing to benchmark.")
        return 0

    dtype = getattr(torch, args.dtype)
    print(device_line(), flush=True)
    print(f"geometry: H={H} K={K} V={V}; inputs {args.dtype}; fla-core importable: {fla_kda_available()}")
    ceiling = copy_ceiling_gbs(torch.device("cuda"), args.quick)
    print(f"copy ceiling: {ceiling:.0f} GB/s (read + write)", flush=True)
    head = (
        f"{'N':>3} {'W':>2} {'triton':>8} {'eager':>8} {'verify':>8} {'commit':>8} {'torch':>9} {'fla':>8} "
        f"{'floor':>7} {'2-pass':>7} {'GB/s':>6} {'%copy':>6} {'xfloor':>6} {'vs torch':>8} {'vs fla':>6}  note"
    )
    print("times in us; triton/verify/commit/fla: CUDA-graph replay; eager/torch: do_bench median")
    print(head)
    print("-" * len(head), flush=True)
    cases, failed = [], []
    for N in BATCHES:
        for W in WIDTHS:
            try:
                c = bench_case(N, W, dtype, ceiling, args.quick, args.sweep)
            except Exception as e:  # noqa: BLE001 - reported and reflected in the exit code
                failed.append((N, W))
                print(f"{N:>3} {W:>2} FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
                torch.cuda.empty_cache()
                continue
            cases.append(c)
            vs_t = c.torch_eager_us / c.triton_eager_us if c.torch_eager_us and c.triton_eager_us else None
            vs_f = c.fla_graph_us / c.triton_graph_us if c.fla_graph_us and c.triton_graph_us else None
            print(
                f"{N:>3} {W:>2} {_fmt(c.triton_graph_us)} {_fmt(c.triton_eager_us)} {_fmt(c.verify_graph_us)} "
                f"{_fmt(c.commit_graph_us)} {_fmt(c.torch_eager_us, 9)} {_fmt(c.fla_graph_us)} "
                f"{c.floor_us:7.1f} {c.two_pass_us:7.1f} {_fmt(c.gbps, 6, 0)} {_fmt(c.pct_copy, 6)} "
                f"{_fmt(c.x_floor, 6, 2)} {_fmt(vs_t, 8)} {_fmt(vs_f, 6, 2)}  "
                f"err o {c.err_o:.1e} S {c.err_state:.1e}; {c.note}",
                flush=True,
            )
            for label, us in c.sweep.items():
                print(f"      sweep {label:<13} {us:8.1f} us  x{us / c.floor_us:5.2f} floor", flush=True)
            torch.cuda.empty_cache()
    if failed:
        print(f"failed cases (N, W): {failed}")
    if args.json:
        write_json(args.json, {"copy_gbps": ceiling, "H": H, "K": K, "V": V, "cases": [asdict(c) for c in cases]})
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
