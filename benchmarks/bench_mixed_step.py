"""What admitting new prompts costs a decoding batch: the mixed (prefill + decode) step, timed and profiled.

A served batch at concurrency C keeps C requests decoding; each arrival is prefilled in a step shared with the
others' decode rows. Such a step cannot replay a decode graph, so it runs eagerly. This benchmark builds the
`LLM` at its default settings (warm-up included) on a ``--layers`` slice of the real geometry, keeps ``D``
requests decoding, then adds ``N`` prompts of ``L`` tokens and steps until each has its first token. Per
(D, N, L) it reports, over ``--reps`` repetitions (new requests aborted after their first token, so ``D`` stays):

- ``admit_ms``: wall time from adding the prompts to their first tokens being on the host (synchronised), and
  ``steps`` it took; ``decode_ms``: one steady decode step of the same batch (the same run), for scale;
- ``launches`` / ``syncs``: kernel launches and device-to-host waits in one admission (torch profiler);
- ``gpu_busy_ms``: device time of one admission (sum of kernels) - the rest of ``admit_ms`` is the device idle;
- ``host_top`` / ``host_own``: package functions by cumulative host time and any functions by own time (cProfile),
  ``idle_sites``: who the device waited for, ``sync_sites``: where the host waited for the device.

Usage (GPU): ``python -m benchmarks.bench_mixed_step --layers 4 --decode 15 63 --new 1 16 --prompt-len 30 1024
--json out.json``; ``--preset tiny --device cpu`` runs the same code on the CPU (a smoke test). Piecewise CUDA
graphs of the mixed steps (docs/gpu.md): ``TRTLLM_GLM_PIECEWISE=1`` (or ``--llm-args '{"cuda_graph_config":
{"piecewise": true}}'``) against ``=0``; rows then also show ``pw_steps`` / ``pw_replays`` / ``pw_trunk_steps``
(steps run as one whole-trunk graph) of one admission.

CPU proxy of the host cost (no GPU needed): ``--widths tiny`` keeps the preset's layer pattern (KDA / sparse MLA,
dense / MoE FFNs, mHC streams, Sinkhorn iterations, MTP layer) and shrinks every width (`TINY_WIDTHS`), so an
eager step's time is Python and per-op dispatch, as a GPU step's host time is; it also takes the CUDA defaults'
code paths where they depend on a setting or the device (KDA short prefill: `TRTLLM_GLM_KDA_SHORT_PREFILL` 64
unless set; the fused KDA input weights, `Glm5NextForCausalLM.fuse_weights`).
``--emulate-graphs`` (CPU): the executor's CUDA graphs emulated as in the tests (full decode graphs and the
piecewise segments run eagerly on their buffers), each piecewise segment counted by ``--ops`` as one op (its replay)
and its body left out of ``func_host_ms_outside_fused`` (its replay's host time is a launch): with ``--llm-args
'{"cuda_graph_config": {"piecewise": true}}'`` the CPU proxy of a piecewise admission.
With ``"speculative_config": {"decoding_type": "MTP", "max_draft_len": 3, "adaptive": false}`` in ``--llm-args`` the
decoding requests verify drafts, so an admission step carries verify rows (piecewise since 2026-12-08, wholly eager
before: ``TRTLLM_GLM_PIECEWISE=0`` is that baseline).
``--ops`` adds ``ops_by_part`` / ``ops_by_function``: torch ops (about one launch each on the GPU) per model part
and function of one admission (`benchmarks.harness.profiling.op_counts`), each call of an op that CUDA runs as a
fused kernel (`_FUSED`, a torch reference on the CPU) counted as one; and ``func_host_ms_outside_fused``: the host
time by function with the time inside those references left out (the orchestration's host time, which the GPU pays
too; ``(fused)``: the references' time and calls). Example (issue 42, 2-core CPU, one torch thread)::

    OMP_NUM_THREADS=1 python -m benchmarks.bench_mixed_step --widths tiny --device cpu --dtype float32 \
        --layers 4 --decode 15 --new 16 --prompt-len 30 --reps 9 --ops
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import time
from pathlib import Path

import torch

from benchmarks.harness.host_syncs import sync_sites
from benchmarks.harness.idle_sites import idle_sites
from benchmarks.harness.models import random_model
from benchmarks.harness.profiling import count_launches_and_syncs, func_host_ms, module_host_ms, op_counts, top_kernels
from trtllm_glm import LLM, KvCacheConfig, SamplingParams  # noqa: E402
from trtllm_glm.config import Glm5NextConfig  # noqa: E402
from trtllm_glm.models.glm5_next import subset_config  # noqa: E402
from trtllm_glm.speculative.registry import speculation_entry  # noqa: E402


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


class Batch:
    """``D`` decoding requests on ``llm``'s executor and the admission of ``N`` new ``L``-token prompts."""

    def __init__(self, llm: LLM, decode: int, seed: int) -> None:
        self.llm, self.ex = llm, llm.executor
        self.rng = random.Random(seed)
        self.vocab = llm.config.vocab_size
        long = SamplingParams(max_tokens=100_000, temperature=0.0, ignore_eos=True)
        self.decoding = [self.ex.add_request(self.prompt(16), long) for _ in range(decode)]
        while any(r.num_output == 0 for r in self.decoding):
            self.ex.step()

    def prompt(self, n: int) -> list[int]:
        return [self.rng.randrange(self.vocab) for _ in range(n)]

    def decode_step(self) -> None:
        self.ex.step()

    def admit(self, new: int, length: int) -> int:
        """Add ``new`` prompts, step until each has its first token; abort them. Returns the steps taken."""
        p = SamplingParams(max_tokens=100_000, temperature=0.0, ignore_eos=True)
        reqs = [self.ex.add_request(self.prompt(length), p) for _ in range(new)]
        steps = 0
        while any(r.num_output == 0 for r in reqs):
            self.ex.step()
            steps += 1
        for r in reqs:
            self.ex.abort_request(r.request_id)
        return steps


def time_call(fn, device: str, reps: int) -> tuple[float, object]:
    """Median wall ms of ``fn()`` over ``reps`` synchronised calls, and the last call's result."""
    times, out = [], None
    for _ in range(reps):
        _sync(device)
        t0 = time.perf_counter()
        out = fn()
        _sync(device)
        times.append(1e3 * (time.perf_counter() - t0))
    times.sort()
    return times[len(times) // 2], out


def host_top(fn, n: int) -> tuple[list[tuple[str, float, float]], list[tuple[str, float, float]]]:
    """Where the host spends one call of ``fn`` (cProfile): the ``n`` package functions with the most cumulative
    time, and the ``n`` functions of any module (fla, triton, torch included) with the most own time (ms, calls)."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    fn()
    prof.disable()
    cum_rows, own_rows = [], []
    for (f, line, name), (_, calls, own, cum, _) in pstats.Stats(prof).stats.items():
        where = f.split("site-packages/")[-1].split("trtllm_glm/")[-1]
        if "trtllm_glm" in f:
            cum_rows.append((f"{where}:{line} {name}", round(1e3 * cum, 2), calls))
        own_rows.append((f"{where}:{line} {name}", round(1e3 * own, 2), calls))
    cum_rows.sort(key=lambda r: -r[1])
    own_rows.sort(key=lambda r: -r[1])
    return cum_rows[:n], own_rows[:n]


def run_case(llm: LLM, decode: int, new: int, length: int, args: argparse.Namespace) -> dict:
    b = Batch(llm, decode, seed=args.seed)
    dev = args.device
    for _ in range(3):  # warm
        b.admit(new, length)
        b.decode_step()
    decode_ms = time_call(b.decode_step, dev, 20)[0] if decode else float("nan")
    admit_ms, steps = time_call(lambda: b.admit(new, length), dev, args.reps)
    row = {"decode": decode, "new": new, "prompt_len": length, "admit_ms": round(admit_ms, 2), "steps": steps,
           "decode_ms": round(decode_ms, 3)}  # fmt: skip
    pw = b.ex.piecewise
    pw0 = (pw.stats.steps, pw.stats.replays, pw.stats.trunk_steps) if pw is not None else None
    launches, syncs = count_launches_and_syncs(lambda: b.admit(new, length))
    row.update(launches=launches, syncs=syncs)
    # The host's time issuing each part of one admission (no profiler, no sync): which part keeps it host-bound.
    row["module_host_ms"] = module_host_ms(b.ex.model, lambda: b.admit(new, length), _PARTS)
    # The same by function (the runtime around the forward and the KDA core's parts), averaged over three admissions.
    row["func_host_ms"] = func_host_ms(lambda: b.admit(new, length), _FUNCS, reps=args.func_reps)
    if args.ops:  # the same without the fused ops' torch references (the CPU proxy's orchestration time)
        row["func_host_ms_outside_fused"] = func_host_ms(
            lambda: b.admit(new, length), _FUNCS, reps=args.func_reps, fused=_FUSED
        )
    if args.ops:  # torch ops (about one launch each on the GPU) by part and by function, one admission
        ops = op_counts(lambda: b.admit(new, length), _FUNCS, b.ex.model, _PARTS, _FUSED)
        row["ops_by_part"] = {k: v for k, v in ops.items() if k == "(step)" or k in _PARTS}
        row["ops_by_function"] = {k: v for k, v in ops.items() if k != "(step)" and k not in _PARTS}
    if pw is not None and pw0 is not None:  # piecewise steps / segment replays of that one admission
        row.update(pw_steps=pw.stats.steps - pw0[0], pw_replays=pw.stats.replays - pw0[1],
                   pw_trunk_steps=pw.stats.trunk_steps - pw0[2])  # fmt: skip
    if dev == "cuda":
        row["gpu_busy_ms"] = round(top_kernels(lambda: b.admit(new, length), 0)[0][1] / 1e3, 2)
        if args.profile:
            row["kernels_top"] = top_kernels(lambda: b.admit(new, length), args.profile)[1:]
            row["idle_sites"] = idle_sites(lambda: b.admit(new, length), 2, args.profile)
            per, sites = sync_sites(lambda: b.admit(new, length), 2)
            row["sync_sites"] = sites.most_common(args.profile)
    if args.profile:
        row["host_top"], row["host_own"] = host_top(lambda: b.admit(new, length), args.profile)
    for r in b.decoding:
        b.ex.abort_request(r.request_id)
    while b.ex.has_work:
        b.ex.step()
    return row


# Model parts whose host time `module_host_ms` reports (inclusive: a decoder layer holds its mixer and MoE).
_PARTS = ("Glm5NextModel", "Glm5NextDecoderLayer", "KimiDeltaAttention", "GlmKpoolSparseMLA", "GlmKpoolIndexer",
          "MoE", "GatedMLP", "Glm5NextMTPLayer")  # fmt: skip
# Functions whose host time `func_host_ms` reports (inclusive; per admission).
_FUNCS = tuple(
    f"trtllm_glm.{m}" for m in (
        "runtime.executor:Executor._plan", "runtime.executor:Executor._forward",
        "runtime.executor:Executor._sample_rows", "runtime.executor:Executor._advance",
        "runtime.executor:Executor._after_step", "runtime.executor:Executor._emit",
        "runtime.prefix_cache:PrefixCache.after_step", "attention.metadata:AttentionMetadata.prepare",
        "models.glm5_next:Glm5NextModel.forward", "models.glm5_next:Glm5NextDecoderLayer._mhc",
        "models.glm5_next:Glm5NextDecoderLayer._ffn", "kda.layer:KimiDeltaAttention._inputs",
        "kda.layer:KimiDeltaAttention._forward_o", "kda.layer:KimiDeltaAttention._decode",
        "kda.layer:KimiDeltaAttention._short_prefill", "kda.layer:KimiDeltaAttention._ragged_verify",
        "kda.layer:KimiDeltaAttention._prefill", "kda.layer:KimiDeltaAttention._output",
        "kda.layer:KdaLayerRecords.commit",
        "attention.sparse.glm_kpool.layer:GlmKpoolSparseMLA.forward",
        "attention.sparse.glm_kpool.indexer:GlmKpoolIndexer.forward", "modules.ffn:MoE.forward",
    )
)  # fmt: skip
# Ops that CUDA runs as fused kernels (one or a few launches) and the CPU as torch references: `op_counts` counts
# each call as one op (names as looked up by their callers: the KDA layer imports its ops into `kda.layer`).
_FUSED = (
    "trtllm_glm.modules.norm:rms_norm", "trtllm_glm.kda.layer:GatedRMSNorm.forward",
    "trtllm_glm.modules.mhc:mhc_block_pre", "trtllm_glm.modules.mhc:mhc_block_post",
    *(f"trtllm_glm.kda.layer:{f}" for f in (
        "kda_gate_beta", "conv_decode", "kda_decode_inplace", "conv_verify_qkv", "kda_verify", "conv_commit_slots",
        "kda_commit", "conv_prefill", "kda_prefill")),
    *(f"trtllm_glm.attention.sparse.glm_kpool.ops:{f}" for f in (
        "write_latent_rows", "update_decode_pools", "update_prefill_pools", "write_prefill_tail", "score_pools",
        "expand_selection", "rotate_quant", "select_topk_pools", "sparse_mla_attention")),
    "trtllm_glm.modules.ffn:swiglu", "trtllm_glm.modules.ffn:clamped_swiglu",
    "trtllm_glm.modules.ffn:MoE._routed_loop", "trtllm_glm.moe.router:route",
)  # fmt: skip
# `--emulate-graphs`: the piecewise runner's segment bodies, each call one graph replay (one launch equivalent).
_SEGMENTS = (
    "trtllm_glm.runtime.piecewise:PiecewiseRunner._segment",
    "trtllm_glm.runtime.piecewise:PiecewiseRunner._fused",
)
_LISTS = (
    "module_host_ms",
    "func_host_ms",
    "func_host_ms_outside_fused",
    "ops_by_part",
    "ops_by_function",
    "kernels_top",
    "idle_sites",
    "host_top",
    "host_own",
    "sync_sites",
)

# `--widths tiny`: every width of the CPU proxy (the layer pattern, mHC streams, Sinkhorn iterations and the
# constrained sizes - indexer head dim 128, pools of 4 - stay the preset's). index_topk stays above any context
# of the run (as 2048 does for the GPU's 30-token prompts): every pool is selected, on the same code path.
TINY_WIDTHS = {
    "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32,
    "n_routed_experts": 8, "num_experts_per_tok": 2, "num_attention_heads": 4, "num_key_value_heads": 4,
    "q_lora_rank": 64, "kv_lora_rank": 64, "qk_nope_head_dim": 32, "v_head_dim": 32, "index_n_heads": 4,
    "index_topk": 128, "kda_num_heads": 4, "kda_head_dim": 32, "kda_gate_low_rank": 32, "pad_token_id": None,
}  # fmt: skip


def proxy_config(full: Glm5NextConfig) -> Glm5NextConfig:
    """``full`` with `TINY_WIDTHS` (validated as any config)."""
    cfg = dataclasses.replace(full, **TINY_WIDTHS)
    cfg.validate()
    return cfg


def _emulate_graphs(llm: LLM, cuda_graph_config: object) -> None:
    """`--emulate-graphs`: ``llm``'s executor rebuilt with its CUDA graphs emulated (the tests' way: the LLM keeps
    graphs off off CUDA), and the piecewise segments counted as replays (`_SEGMENTS`)."""
    global _FUSED
    from trtllm_glm.runtime.cuda_graph import CudaGraphConfig
    from trtllm_glm.runtime.executor import Executor
    from trtllm_glm.runtime.piecewise import PiecewiseRunner

    Executor._graphs_supported = lambda self: True  # type: ignore[method-assign]
    cgc = CudaGraphConfig.from_value(cuda_graph_config if cuda_graph_config is not None else {})
    # Full decode graphs of one sequence only: the CPU's torch k-pool ops refuse a graph's padding sequences (larger
    # decode steps run piecewise, as uncovered ones do).
    cgc = dataclasses.replace(cgc, batch_sizes=[1])
    llm.executor_config = dataclasses.replace(llm.executor_config, cuda_graph_config=cgc)
    llm.executor = llm._make_executor()
    # (`_fused`: the segments with KDA cores inside, where the runner has them)
    _FUSED = (*_FUSED, *(f for f in _SEGMENTS if f.rsplit(".", 1)[1] in vars(PiecewiseRunner)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="glm-5.3-flash")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--decode", type=int, nargs="+", default=[15, 63], help="requests decoding (D)")
    ap.add_argument("--new", type=int, nargs="+", default=[1, 16], help="prompts admitted at once (N)")
    ap.add_argument("--prompt-len", type=int, nargs="+", default=[30, 1024], help="their length (L)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--profile", type=int, default=0, help="N: also the top N host functions / kernels / idle sites")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--widths",
        choices=("real", "tiny"),
        default="real",
        help="tiny: the CPU proxy of the host cost (the preset's layer pattern at tiny widths)",
    )
    ap.add_argument("--ops", action="store_true", help="also torch ops per model part / function of one admission")
    ap.add_argument("--func-reps", type=int, default=3, help="admissions averaged by the host-by-function breakdown")
    ap.add_argument(
        "--emulate-graphs", action="store_true", help="CPU: emulate the CUDA graphs (segments count as replays)"
    )
    ap.add_argument("--json", default=None)
    ap.add_argument("--llm-args", default="{}", help="extra LLM keyword arguments as JSON (kv_cache_config: a dict)")
    args = ap.parse_args()
    torch.manual_seed(args.seed)
    full = Glm5NextConfig.from_pretrained(args.preset)
    if args.widths == "tiny":
        full = proxy_config(full)
        # The CUDA default (a CPU run would take the chunked KDA prefill): the same code path as the GPU's.
        os.environ.setdefault("TRTLLM_GLM_KDA_SHORT_PREFILL", "64")
    cfg = subset_config(full, list(range(min(args.layers, full.num_hidden_layers))))
    model = random_model(cfg, args.device, args.dtype, seed=args.seed)
    if args.widths == "tiny":
        model.fuse_weights()  # as the executor does on CUDA (the CPU keeps separate GEMMs otherwise)
    kw = json.loads(args.llm_args)
    if "kv_cache_config" in kw:
        kw["kv_cache_config"] = KvCacheConfig(**kw["kv_cache_config"])
    if "speculative_config" in kw:  # {"decoding_type": "MTP", ...}: its registered config class (as the YAML's)
        spec = dict(kw["speculative_config"])
        kw["speculative_config"] = speculation_entry(spec.pop("decoding_type")).config_cls(**spec)
    t0 = time.perf_counter()
    llm = LLM(model, device=args.device, **kw)
    if args.emulate_graphs:
        _emulate_graphs(llm, kw.get("cuda_graph_config"))
    print(f"# LLM built (defaults{' + ' + args.llm_args if kw else ''}) in {time.perf_counter() - t0:.1f} s; "
          f"max_batch_size {llm.executor.cfg.max_batch_size}, max_num_tokens {llm.executor.cfg.max_num_tokens}",
          flush=True)  # fmt: skip
    pw = llm.executor.piecewise
    if pw is not None:  # TRTLLM_GLM_PIECEWISE=1 or cuda_graph_config.piecewise: what its start-up capture cost
        st = pw.stats
        print(
            f"# piecewise: buckets up to {pw.max_tokens}, {st.captures} segment graphs in {st.capture_s:.1f} s, "
            f"pool +{st.pool_bytes / 2**20:.0f} MiB, carry {st.carry_bytes / 2**20:.0f} MiB",
            flush=True,
        )
    rows = []
    for d in args.decode:
        for n in args.new:
            if d + n > llm.executor.cfg.max_batch_size:
                continue
            for length in args.prompt_len:
                r = run_case(llm, d, n, length, args)
                rows.append(r)
                print(json.dumps({k: v for k, v in r.items() if k not in _LISTS}),
                      flush=True)  # fmt: skip
                parts = ", ".join(f"{k} {ms:.2f} ms ({c})" for k, (ms, c) in r["module_host_ms"].items())
                print(f"    host by part: {parts}")
                funcs = ", ".join(f"{k} {ms:.2f} ms ({c})" for k, (ms, c) in r["func_host_ms"].items())
                print(f"    host by function: {funcs}")
                if "func_host_ms_outside_fused" in r:
                    funcs = ", ".join(
                        f"{k} {ms:.2f} ms ({c})" for k, (ms, c) in r["func_host_ms_outside_fused"].items()
                    )
                    print(f"    host by function outside fused ops: {funcs}")
                for key, label in (("ops_by_part", "ops by part"), ("ops_by_function", "ops by function")):
                    if key in r:
                        print(f"    {label}: " + ", ".join(f"{k} {n} ({c})" for k, (n, c) in r[key].items()))
                for key in ("host_top", "host_own", "kernels_top", "sync_sites"):
                    for item in r.get(key, []):
                        print(f"    {key}: {item}")
                if "idle_sites" in r:
                    s = r["idle_sites"]
                    print(f"    idle: busy {s['busy_us']} us, idle {s['idle_us']} us per admission")
                    for item in s["sites"]:
                        print(f"    idle_site: {item}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
