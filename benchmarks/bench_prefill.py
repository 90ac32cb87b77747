"""Long-context prefill on a real-geometry slice of GLM-5.3-Flash: time to first token against a compute floor
(issue 32's yardstick).

Builds ``Glm5NextForCausalLM`` from the real config cut to ``--layers`` trunk layers (seeded random weights on the
device, `bench_e2e.random_model`; ``--weights fp8`` quantises them to 128 x 128 block FP8) and sends ONE cold prompt
of each ``--lens`` length (random tokens, prefix cache off) through ``LLM.generate`` for each ``--chunks`` size
(``max_num_tokens``). Per row:

* ``ttft_ms``: wall time from ``generate`` to the first sampled token (host included: what a client waits for);
* ``compute_floor_ms``: the prompt's FLOPs counted per op class (`prefill_flops`) at the dense matmul rate measured
  in the same run (`matmul_tflops`: bf16, or FP8 for the weight GEMMs of ``--weights fp8``), and ``ratio`` =
  ``ttft_ms / compute_floor_ms``; ``floor_ms_by_class`` the same per class;
* ``peak_gib``: peak allocated device memory during the prompt, ``transient_gib`` the part above what was allocated
  before it (weights, caches); ``est_workspace_gib``: the executor's estimate of a chunk's transient buffers
  (`trtllm_glm.runtime.prefill_memory`), checked before allocation (a ``[check]`` line flags an undercount);
* ``ms_by_class`` (second cold prompt of the same length, ``--attribute``): device time between CUDA events
  recorded around the op classes (innermost range wins): ``kda_core`` (fla chunk kernels), ``kda_layer`` (the
  rest of a KDA layer: projections, conv, gates), ``indexer_score``, ``topk``, ``sparse_mla``, ``indexer_other``
  (index keys, pools, FP8 quantisation), ``mla_layer`` (the MLA layer's projections), ``moe``, ``dense_mlp``,
  ``other`` (embedding, mHC, norms, lm_head, host gaps between layers): what each class costs in TTFT, host
  stalls inside a class included;
* ``compiles``: Triton kernels compiled during the timed prompt (0 after a warm-up that covers the shapes:
  a prefill of ``2 * chunk + 1`` tokens, then the indexer's score / top-k launches at every power-of-two score
  width up to the prompt's, `warm_indexer_shapes`);
* ``decode_ms_per_token`` (the longest prompt, ``--decode N`` tokens after it);
* ``ttft_ms_ab`` (``--env-ab VAR=VALUE``, prompts up to ``--ab-max-len``): one more cold prompt with that variable
  set, e.g. ``TRTLLM_GLM_MOE_BACKEND=torch`` for the MoE's per-expert loop that prefill used before.

``--transformers`` adds the reference's TTFT (its ``generate`` with one new token, same weights) at the lengths up
to ``--transformers-max-len`` (its attention masks are dense: 32K needs > 100 GB). ``[goal]`` lines: TTFT <= 3x
the floor at 32K and 128K on the 4-layer slice; the longest prompt completes.

Usage (one H200): ``python -m benchmarks.bench_prefill --layers 4 --lens 8192 32768 131072 1048000 --chunks 8192
--json out.json``; ``--preset small --device cpu --lens 512 --chunks 128`` runs the same code on the CPU (a smoke
test; numbers mean little).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import time
from collections.abc import Callable
from contextlib import contextmanager
from functools import partial

import torch

from benchmarks.harness.ceiling import matmul_tflops
from benchmarks.harness.env_ab import add_env_ab_argument
from benchmarks.harness.floors import floor_ms, prefill_flops
from benchmarks.harness.hf_reference import run_transformers
from benchmarks.harness.models import random_model
from benchmarks.harness.profiling import top_kernels
from benchmarks.harness.rows import emit, say, write_json
from trtllm_glm.config import Glm5NextConfig
from trtllm_glm.models.glm5_next import Glm5NextForCausalLM, subset_config
from trtllm_glm.runtime.llm import LLM, KvCacheConfig
from trtllm_glm.runtime.sampling import SamplingParams


# ------------------------------------------------------------------------------------------------------
# Time per op class: CUDA events around ranges
# ------------------------------------------------------------------------------------------------------
class _HostEvent:
    """`torch.cuda.Event`'s two methods on the host clock (CPU runs: the device is the host)."""

    def __init__(self, enable_timing: bool = True) -> None:
        self.t = 0.0

    def record(self) -> None:
        self.t = time.perf_counter()

    def elapsed_time(self, end: _HostEvent) -> float:
        return (end.t - self.t) * 1e3


class ClassTimer:
    """CUDA events recorded on entry and exit of the op classes' modules and functions (no host sync inside);
    `totals` charges each range's device time minus its children's to its class. On the CPU, host clock marks."""

    def __init__(self, device: str = "cuda") -> None:
        self._event = torch.cuda.Event if device == "cuda" else _HostEvent
        self._cuda = device == "cuda"
        self.active = False
        self._stack: list[list] = []
        self._done: list[tuple[str, object, object, list]] = []
        self._undo: list[Callable[[], None]] = []

    def enter(self, name: str) -> None:
        if not self.active:
            return
        ev = self._event(enable_timing=True)
        ev.record()
        self._stack.append([name, ev, []])

    def exit(self) -> None:
        if not self.active or not self._stack:
            return
        name, start, children = self._stack.pop()
        end = self._event(enable_timing=True)
        end.record()
        rec = (name, start, end, children)
        if self._stack:
            self._stack[-1][2].append(rec)
        else:
            self._done.append(rec)

    def wrap_module(self, module: torch.nn.Module, name: str) -> None:
        h1 = module.register_forward_pre_hook(lambda m, a: self.enter(name))
        h2 = module.register_forward_hook(lambda m, a, o: self.exit())
        self._undo += [h1.remove, h2.remove]

    def wrap_function(self, owner: object, attr: str, name: str) -> None:
        fn = getattr(owner, attr, None)
        if fn is None:
            return

        def wrapped(*a, **kw):
            self.enter(name)
            try:
                return fn(*a, **kw)
            finally:
                self.exit()

        setattr(owner, attr, wrapped)
        self._undo.append(lambda: setattr(owner, attr, fn))

    def remove(self) -> None:
        for undo in reversed(self._undo):
            undo()
        self._undo.clear()

    @contextmanager
    def timing(self):
        self._done.clear()
        self.active = True
        try:
            yield self
        finally:
            self.active = False

    def totals(self) -> dict[str, float]:
        """Self milliseconds per class over the ranges recorded in the last `timing` block (syncs once)."""
        if self._cuda:
            torch.cuda.synchronize()
        out: dict[str, float] = {}

        def walk(rec) -> float:
            name, start, end, children = rec
            total = start.elapsed_time(end)
            out[name] = out.get(name, 0.0) + total - sum(walk(c) for c in children)
            return total

        for rec in self._done:
            walk(rec)
        return out


def install_class_timer(model: Glm5NextForCausalLM, device: str = "cuda") -> ClassTimer:
    """Ranges around every op class of the prefill path (see the module docstring)."""
    import trtllm_glm.kda.layer as kda_layer
    from trtllm_glm.attention.sparse.glm_kpool import kernels as kp_kernels
    from trtllm_glm.attention.sparse.glm_kpool import ops as kp_ops
    from trtllm_glm.attention.sparse.glm_kpool.indexer import GlmKpoolIndexer
    from trtllm_glm.attention.sparse.glm_kpool.layer import GlmKpoolSparseMLA
    from trtllm_glm.kda.layer import KimiDeltaAttention
    from trtllm_glm.modules.ffn import GatedMLP, MoE

    t = ClassTimer(device)
    for layer in model.model.layers:
        attn = layer.self_attn
        if isinstance(attn, KimiDeltaAttention):
            t.wrap_module(attn, "kda_layer")
        elif isinstance(attn, GlmKpoolSparseMLA):
            t.wrap_module(attn, "mla_layer")
            if isinstance(attn.indexer, GlmKpoolIndexer):
                t.wrap_module(attn.indexer, "indexer_other")
        if isinstance(layer.mlp, MoE):
            t.wrap_module(layer.mlp, "moe")
        elif isinstance(layer.mlp, GatedMLP):
            t.wrap_module(layer.mlp, "dense_mlp")
    t.wrap_function(kda_layer, "kda_prefill", "kda_core")
    for mod in (kp_kernels, kp_ops):
        t.wrap_function(mod, "score_pools", "indexer_score")
        t.wrap_function(mod, "select_topk_pools", "topk")
        t.wrap_function(mod, "sparse_mla_attention", "sparse_mla")
    t.wrap_module(model, "other")
    return t


# ------------------------------------------------------------------------------------------------------
# Warm-up and timing
# ------------------------------------------------------------------------------------------------------
class CompileCounter:
    """Counts Triton JIT compilations (in-process cache misses) while installed."""

    def __init__(self) -> None:
        self.names: list[str] = []

    def __enter__(self) -> CompileCounter:
        import triton

        self._prev = triton.knobs.runtime.jit_cache_hook

        def hook(*, fn, **kw) -> bool:
            self.names.append(fn.name)
            return False

        triton.knobs.runtime.jit_cache_hook = hook
        return self

    def __exit__(self, *exc: object) -> None:
        import triton

        triton.knobs.runtime.jit_cache_hook = self._prev


def warm_indexer_shapes(cfg: Glm5NextConfig, page_size: int, max_pools: int, device: str) -> None:
    """Compile the indexer's score and top-k launches for every power-of-two score width up to ``max_pools``
    (`GlmKpoolMetadata.score_columns`) on one dummy row each: a long prompt's later chunks then compile nothing."""
    from trtllm_glm.attention.sparse.glm_kpool.backend import kpool_ops

    ops = kpool_ops(torch.device(device))
    h = cfg.index_n_heads
    dev = torch.device(device)
    q8 = torch.zeros(1, h, cfg.index_head_dim, device=dev).to(torch.float8_e4m3fn)
    w = torch.zeros(1, h, device=dev)
    ik = torch.zeros(1, page_size // 4, cfg.index_head_dim, device=dev).to(torch.float8_e4m3fn)
    isc = torch.ones(1, page_size // 4, device=dev)
    # int64 rows and positions, as the metadata hands them to the kernels (`GlmKpoolMetadata`): a pointer's dtype
    # is part of a Triton kernel's signature, so int32 here would warm other compilations than a prompt takes.
    rs = torch.zeros(1, dtype=torch.int64, device=dev)
    topk = cfg.index_topk_pools
    c = 1
    # Up to the power of two at or above max_pools: the widths `GlmKpoolMetadata.score_columns` gives.
    while c < 2 * max(1, max_pools):
        pos = torch.full((1,), 4 * c - 1, dtype=torch.int64, device=dev)
        table = torch.zeros(1, -(-4 * c // page_size), dtype=torch.int32, device=dev)  # every pool on page 0
        scores = ops.score_pools(q8, w, ik, isc, pos, rs, table, page_size, c)
        ops.select_topk_pools(scores, pos, topk)
        c *= 2
    if dev.type == "cuda":
        torch.cuda.synchronize()


def make_llm(
    model: Glm5NextForCausalLM, max_seq_len: int, chunk: int, page: int, graphs: bool, batch_invariant: bool = False
) -> LLM:
    from trtllm_glm.runtime.cuda_graph import CudaGraphConfig

    return LLM(
        model,
        batch_invariant=batch_invariant,
        max_seq_len=max_seq_len,
        max_num_tokens=chunk,
        max_batch_size=1,
        kv_cache_config=KvCacheConfig(tokens_per_block=page, enable_block_reuse=False),
        cuda_graph_config=CudaGraphConfig(batch_sizes=[1]) if graphs else None,
        warmup=False,  # the benchmark warms its own shapes up (a served LLM's start-up warm-up is not timed here)
    )


def timed_prompt(llm: LLM, ids: list[int], decode: int, device: str) -> dict:
    """One cold prompt: TTFT (host wall time to the first token), then ``decode`` more tokens' ms per token."""
    sp = SamplingParams(max_tokens=1 + decode, temperature=0.0, ignore_eos=True)
    marks: dict[str, float] = {}

    def progress(tokens: int, steps: int) -> None:
        if tokens >= 1 and "first" not in marks:
            marks["first"] = time.perf_counter()

    base = 0
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()  # weights, caches, persistent buffers
    t0 = time.perf_counter()
    out = llm.generate(ids, sp, progress=progress)
    if device == "cuda":
        torch.cuda.synchronize()
    t1 = time.perf_counter()
    row = {"ttft_ms": (marks["first"] - t0) * 1e3, "generated": len(out.outputs[0].token_ids)}
    if decode:
        row["decode_ms_per_token"] = (t1 - marks["first"]) * 1e3 / decode
    if device == "cuda":
        peak = torch.cuda.max_memory_allocated()
        row["peak_gib"] = peak / 2**30
        row["transient_gib"] = (peak - base) / 2**30  # what the prompt allocated on top: vs est_workspace_gib
    return row


def prompt_ids(n: int, vocab: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n,), generator=g).tolist()


def goal_lines(rows: list[dict]) -> list[str]:
    """``[goal]`` lines: TTFT <= 3x the floor at 32K and 128K on the 4-layer slice; the longest prompt completes."""
    lines = []
    ours = [r for r in rows if r.get("impl") == "ours" and "ttft_ms" in r]
    for target in (32768, 131072):
        best = [r for r in ours if r["layers"] == 4 and r["prompt_len"] == target]
        if best:
            r = min(best, key=lambda r: r["ratio"])
            ok = "MET" if r["ratio"] <= 3.0 else "NOT MET"
            lines.append(
                f"[goal] 4 layers, {target} tokens: TTFT {r['ttft_ms']:.0f} ms vs floor {r['compute_floor_ms']:.0f} "
                f"ms = {r['ratio']:.2f}x (chunk {r['chunk']}; goal <= 3x: {ok})"
            )
    for r in ours:
        if r.get("transient_gib", 0.0) > r.get("est_workspace_gib", float("inf")):
            lines.append(
                f"[check] {r['prompt_len']} tokens, chunk {r['chunk']}: the prompt allocated {r['transient_gib']:.1f} "
                f"GiB beyond the weights and caches, above the executor's workspace estimate "
                f"{r['est_workspace_gib']:.1f} GiB (runtime/prefill_memory.py undercounts)"
            )
    if ours:
        longest = max(ours, key=lambda r: r["prompt_len"])
        extra = f", then {longest['decode_ms_per_token']:.1f} ms/token" if "decode_ms_per_token" in longest else ""
        lines.append(
            f"[goal] longest prompt {longest['prompt_len']} tokens on {longest['layers']} layers completed: TTFT "
            f"{longest['ttft_ms'] / 1e3:.1f} s vs floor {longest['compute_floor_ms'] / 1e3:.2f} s "
            f"({longest['ratio']:.2f}x), peak {longest.get('peak_gib', float('nan')):.1f} GiB{extra}"
        )
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="glm-5.3-flash")
    ap.add_argument("--layers", type=int, nargs="+", default=[4])
    ap.add_argument("--lens", type=int, nargs="+", default=[8192, 32768, 131072, 1048000])
    ap.add_argument(
        "--max-len-by-layers", nargs="*", default=["8:32768"], metavar="L:N",
        help="longest prompt for a layer count (default 8:32768: 8K/32K on the 8-layer slice)",
    )  # fmt: skip
    ap.add_argument("--chunks", type=int, nargs="+", default=[8192], help="max_num_tokens values (chunk sweep)")
    ap.add_argument("--page", type=int, default=64)
    ap.add_argument("--decode", type=int, default=16, help="tokens decoded after the longest prompt")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--weights", choices=["bf16", "fp8"], default="bf16")
    ap.add_argument(
        "--batch-invariant", choices=["on", "off"], default="off",
        help="the LLM's batch-invariant numerics mode (docs/numerics.md): its prefill cost; rows carry it",
    )  # fmt: skip
    ap.add_argument("--cuda-graphs", action="store_true", help="decode steps as CUDA graphs (prefill stays eager)")
    ap.add_argument(
        "--attribute-max-len", type=int, default=131072,
        help="time per op class (a second cold prompt) up to this length",
    )  # fmt: skip
    ap.add_argument("--profile-kernels", type=int, default=0, help="N costliest kernels of the 32K (or last) prompt")
    ap.add_argument("--transformers", action="store_true", help="also the reference's TTFT")
    ap.add_argument("--transformers-max-len", type=int, default=32768)
    add_env_ab_argument(
        ap, "also time one more cold prompt per length with this environment variable set (ttft_ms_ab), e.g. "
        "TRTLLM_GLM_MOE_BACKEND=torch: the per-expert loop prefill took before (--ab-env: the old spelling)",
        metavar="VAR=VALUE",
    )  # fmt: skip
    ap.add_argument("--ab-max-len", type=int, default=32768, help="longest prompt of the --env-ab timing")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    cap = {int(a): int(b) for a, b in (s.split(":") for s in args.max_len_by_layers)}
    full = Glm5NextConfig.from_pretrained(args.preset)
    dev = args.device
    rates = {"bf16": matmul_tflops(dev, "bf16"), "fp8": matmul_tflops(dev, "fp8")}
    say(json.dumps({"device": dev, "bf16_tflops": round(rates["bf16"], 1), "fp8_tflops": round(rates["fp8"], 1)}))
    rows: list[dict] = []
    for L in args.layers:
        lens = sorted(n for n in args.lens if n <= cap.get(L, 1 << 62))
        if not lens:
            continue
        cfg = subset_config(full, list(range(min(L, full.num_hidden_layers))))
        cfg.num_nextn_predict_layers = 0  # prefill of the trunk (no MTP drafts)
        if max(lens) + args.decode + 1 > cfg.max_position_embeddings:
            raise SystemExit(
                f"prompt {max(lens)} + {args.decode} decoded tokens exceed the model's "
                f"{cfg.max_position_embeddings} positions"
            )
        model = random_model(cfg, dev, args.dtype, seed=0)
        if args.weights == "fp8":
            from trtllm_glm.config import QuantConfig

            model.quantize_fp8_(QuantConfig.block_fp8(128, ["lm_head"]))
        timer = install_class_timer(model, dev)
        for chunk in args.chunks:
            max_seq = max(lens) + args.decode + 1
            llm = make_llm(model, max_seq, chunk, args.page, args.cuda_graphs, args.batch_invariant == "on")
            ws = getattr(llm.executor, "workspace_bytes", None)
            # Warm-up: every launch shape of a chunk (full and partial), then the indexer's score widths.
            timed_prompt(llm, prompt_ids(min(2 * chunk + 1, max_seq - 2), cfg.vocab_size, 1), 1, dev)
            for i, n in enumerate(lens):
                warm_indexer_shapes(cfg, args.page, -(-(n + args.decode + 1) // 4), dev)
                decode = args.decode if n == lens[-1] else 0
                with CompileCounter() as cc:
                    r = timed_prompt(llm, prompt_ids(n, cfg.vocab_size, 100 + i), decode, dev)
                flops = prefill_flops(cfg, model, n)
                per = floor_ms(flops, rates["bf16"], rates["fp8"], args.weights == "fp8")
                floor = sum(per.values())
                row = {"impl": "ours", "layers": L, "weights": args.weights,
                       "batch_invariant": args.batch_invariant == "on", "prompt_len": n, "chunk": chunk,
                       **r, "compute_floor_ms": floor, "ratio": r["ttft_ms"] / floor,
                       "gflop": sum(flops.values()) / 1e9, "compiles": len(cc.names),
                       "compiled": sorted(set(cc.names))[:8],
                       "floor_ms_by_class": {k: round(v, 2) for k, v in per.items()}}  # fmt: skip
                if ws is not None:
                    row["est_workspace_gib"] = ws / 2**30
                if args.env_ab and n <= args.ab_max_len:
                    var, value = args.env_ab.split("=", 1)
                    old = os.environ.get(var)
                    os.environ[var] = value
                    try:
                        ab = timed_prompt(llm, prompt_ids(n, cfg.vocab_size, 400 + i), 0, dev)
                    finally:
                        if old is None:
                            os.environ.pop(var)
                        else:
                            os.environ[var] = old
                    row["ab_env"], row["ttft_ms_ab"] = args.env_ab, ab["ttft_ms"]
                if n <= args.attribute_max_len:
                    with timer.timing():
                        timed_prompt(llm, prompt_ids(n, cfg.vocab_size, 200 + i), 0, dev)
                    row["ms_by_class"] = {k: round(v, 1) for k, v in sorted(timer.totals().items())}
                if args.profile_kernels and dev == "cuda" and (n == 32768 or n == lens[-1]) and n <= 131072:
                    ids = prompt_ids(n, cfg.vocab_size, 300 + i)
                    row["top_kernels"] = top_kernels(partial(timed_prompt, llm, ids, 0, dev), args.profile_kernels)
                rows.append(row)
                emit(row)
                save(args.json, rates, rows)  # after every row: a run cut short keeps what it measured
            llm.shutdown()
            del llm
            gc.collect()
        timer.remove()
        if args.transformers:
            for n in [n for n in lens if n <= args.transformers_max_len]:
                try:
                    tps = run_transformers(cfg, model, 1, n, 1)["tokens_per_s"]
                    row = {"impl": "transformers", "layers": L, "prompt_len": n, "ttft_ms": 1e3 / tps}
                except torch.OutOfMemoryError as e:
                    row = {"impl": "transformers", "layers": L, "prompt_len": n, "error": str(e).split("\n")[0][:120]}
                rows.append(row)
                emit(row)
                gc.collect()
                if dev == "cuda":
                    torch.cuda.empty_cache()
        del model
        gc.collect()
        if dev == "cuda":
            torch.cuda.empty_cache()
    for line in goal_lines(rows):
        say(line)
    save(args.json, rates, rows)


def save(path: str | None, rates: dict[str, float], rows: list[dict]) -> None:
    """The run so far as JSON (rates, rows, goal lines)."""
    if path:
        write_json(path, {"rates_tflops": rates, "rows": rows, "goals": goal_lines(rows)})


if __name__ == "__main__":
    main()
