"""The host's share of a steady decode round: wall time and host <-> device traffic per round, by source site.

Issue 43: a steady MTP K = 3 round (greedy batch, CUDA graphs, early drafts, the overlap scheduler) is bound by
the host and its syncs, not by the GPU. Per mode this runs a greedy batch to a steady state, then times ``--rounds``
calls of ``Executor.step`` (one decode step, or one speculative round) and counts, per round, every blocking
device-to-host read and every host-to-device put the package makes (`trtllm_glm.traffic`, with
`benchmarks.harness.host_traffic.watch_tensor_reads` for reads hidden in tensor methods), by source site, and the
tensor ops it runs outside the graphs (``launches``: each one a kernel launch on a GPU; ``allocs``: those that make a
new device tensor; `benchmarks.harness.host_traffic.count_ops`).

Runs anywhere. On the CPU the graphs are emulated (the padded step runs eagerly, as in the speculative tests), so
the read and put counts are the GPU's, and ``host_ms`` is the round's wall time minus the time inside the emulated
graph bodies (what a replay would run on the device): the host's own work. ``step_ms`` is the whole round. On a GPU
the graphs are captured and ``host_ms`` is the time ``step`` takes on the host (it includes the waits). On the CPU the
results' and the drafts' host copies are clones: one device tensor made a round each that a GPU, copying into pinned
buffers, does not make (``allocs`` at ``results_to_host`` and ``DeviceDrafts.__init__``).

Modes: ``overlap`` (plain decoding, overlap scheduler), ``mtp3`` (MTP K = 3, early drafts, the overlap scheduler:
bench_e2e's ``mtp3+os``), ``mtp3+ov`` (also drafting rounds launched ahead, ``overlap_rounds``), ``mtp3+k0`` (the
speculative executor with speculation off for the batch, ``max_concurrency`` 1: width-one rounds, as an adaptive
choice of K = 0 runs, the MTP catch-up rows held); any ``mtpK``.

Usage: ``python -m benchmarks.bench_round_host --preset tiny --modes overlap mtp3 --batch 4 --json``
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time
from collections import Counter

import torch

from benchmarks.harness.graph_emulation import emulated_graphs
from benchmarks.harness.host_traffic import GraphBodies, count_ops, recorded
from benchmarks.harness.prompts import CODE_OPENINGS
from trtllm_glm.models.glm5_next import Glm5NextForCausalLM
from trtllm_glm.runtime.cuda_graph import CudaGraphConfig
from trtllm_glm.runtime.executor import Executor, ExecutorConfig
from trtllm_glm.runtime.sampling import SamplingParams
from trtllm_glm.runtime.speculative_executor import SpeculativeExecutor
from trtllm_glm.speculative.config import MTPDecodingConfig


def parse_mode(mode: str) -> tuple[int, set[str]]:
    """``(K, flags)`` of a mode: ``overlap`` is ``(0, set())``, ``mtp3+k0`` ``(3, {"k0"})``."""
    if mode == "overlap":
        return 0, set()
    name, *flags = mode.split("+")
    if not name.startswith("mtp") or not name[3:].isdigit() or set(flags) - {"ov", "k0"}:
        raise SystemExit(f"unknown mode {mode!r} (overlap, mtpK, mtpK+ov, mtpK+k0)")
    return int(name[3:]), set(flags)


def make_executor(model: Glm5NextForCausalLM, mode: str, batch: int, max_seq_len: int) -> Executor:
    gcfg = CudaGraphConfig(batch_sizes=sorted({1, 2, batch}), enable_padding=True)
    cfg = ExecutorConfig(tokens_per_block=16, max_tokens=batch * (max_seq_len + 64), max_batch_size=batch,
                         max_num_tokens=max(64, 8 * batch), max_seq_len=max_seq_len, cuda_graph_config=gcfg,
                         overlap_scheduler=True)  # fmt: skip
    if mode == "overlap":
        return Executor(model, cfg)
    k, flags = parse_mode(mode)
    if "k0" in flags and batch < 2:
        raise SystemExit(f"{mode}: k0 needs --batch >= 2 (speculation off above max_concurrency = 1)")
    # k0: the batch above max_concurrency, so every round is width one (what an adaptive choice of K = 0 runs).
    spec = MTPDecodingConfig(num_nextn_predict_layers=k, adaptive=False, overlap_rounds="ov" in flags,
                             max_concurrency=1 if "k0" in flags else None)  # fmt: skip
    return SpeculativeExecutor(model, cfg, spec)


def run_mode(model: Glm5NextForCausalLM, mode: str, args: argparse.Namespace) -> dict:
    B = args.batch
    prompts = [list(CODE_OPENINGS[i % len(CODE_OPENINGS)].encode()) for i in range(B)]
    # Every request must outlive the warm-up and both passes of rounds, each round emitting up to K + 1 tokens (a
    # finished batch leaves nothing to schedule: an H100 run of mtp3 at batch 16 stopped there).
    k, flags = parse_mode(mode)
    max_tokens = (args.warmup + 2 * args.rounds + 2) * (k + 1)
    max_seq_len = max(args.max_seq_len, max(map(len, prompts)) + max_tokens + 64)
    ex = make_executor(model, mode, B, max_seq_len)
    if ex.device.type == "cuda":
        ex.capture_cuda_graphs()
    for ids in prompts:
        ex.add_request(ids, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    for _ in range(args.warmup):
        ex.step()
    emitted0 = sum(r.num_output for r in ex.running)
    early0 = getattr(ex, "num_early_drafts", 0) + getattr(ex, "num_overlapped_rounds", 0)
    overlapped0 = ex.num_overlapped_steps
    host, step = [], []
    with GraphBodies() as clock:
        for _ in range(args.rounds):
            d0 = clock.s
            t0 = time.perf_counter()
            ex.step()
            if ex.device.type == "cuda":
                torch.cuda.synchronize()
            dt = time.perf_counter() - t0
            step.append(dt * 1e3)
            host.append((dt - (clock.s - d0) if ex.device.type != "cuda" else dt) * 1e3)
    tokens = sum(r.num_output for r in ex.running) - emitted0
    steady = getattr(ex, "num_early_drafts", 0) + getattr(ex, "num_overlapped_rounds", 0) - early0
    overlapped = ex.num_overlapped_steps - overlapped0
    # The counts: the same number of rounds again, recorded (the tensor-method hooks cost host time).
    with recorded() as rec, count_ops() as ops:
        for _ in range(args.rounds):
            ex.step()
    n = args.rounds
    if len(ex.running) != B:
        raise SystemExit(f"{mode}: {B - len(ex.running)} of {B} requests finished inside the measured rounds")

    def per_round(c: Counter) -> dict[str, float]:
        return {k: round(v / n, 3) for k, v in sorted(c.items(), key=lambda kv: (-kv[1], kv[0]))}

    return {
        "mode": mode, "preset": args.preset, "batch": B, "device": ex.device.type, "rounds": n,
        "host_ms": round(statistics.median(host), 3), "step_ms": round(statistics.median(step), 3),
        "tokens_per_round": round(tokens / n / B, 3),
        # Drafting rounds launched early or ahead; width-one steps (plain, k0) launched ahead.
        "steady_rounds": steady + overlapped if k == 0 or "k0" in flags else steady,
        "reads_per_round": round(rec.num_reads / n, 3), "puts_per_round": round(rec.num_puts / n, 3),
        "launches_per_round": round(ops.launches.total() / n, 3), "allocs_per_round": round(ops.allocs.total() / n, 3),
        "reads": per_round(rec.reads), "puts": per_round(rec.puts),
        "launches": per_round(ops.launches), "allocs": per_round(ops.allocs),
    }  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--modes", nargs="+", default=["overlap", "mtp3"])
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=6)
    ap.add_argument("--max-seq-len", type=int, default=256, help="at least what the rounds need (raised to fit)")
    ap.add_argument("--dtype", default=None, help="default: float32 on the CPU, bfloat16 on a GPU")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--json", action="store_true", help="one JSON row per mode instead of the table")
    args = ap.parse_args()
    dtype = args.dtype or ("float32" if args.device == "cpu" else "bfloat16")
    model = Glm5NextForCausalLM.from_pretrained(args.preset, dtype=dtype, device=args.device).eval()
    ctx = emulated_graphs() if args.device == "cpu" else contextlib.nullcontext()
    with ctx:
        for mode in args.modes:
            row = run_mode(model, mode, args)
            if args.json:
                print(json.dumps(row), flush=True)
                continue
            print(f"== {mode} ({args.preset}, batch {row['batch']}, {row['device']}): host {row['host_ms']:.3f} ms"
                  f" (step {row['step_ms']:.3f} ms), {row['tokens_per_round']:.2f} tokens/seq/round, "
                  f"{row['steady_rounds']}/{row['rounds']} steady; per round: {row['reads_per_round']:g} reads, "
                  f"{row['puts_per_round']:g} puts, {row['launches_per_round']:g} launches outside graphs, "
                  f"{row['allocs_per_round']:g} device tensors made")  # fmt: skip
            for kind in ("reads", "puts", "launches", "allocs"):
                for site, v in row[kind].items():
                    print(f"   {kind:8s} {v:6.2f}  {site}")


if __name__ == "__main__":
    main()
