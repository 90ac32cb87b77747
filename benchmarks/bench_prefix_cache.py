"""Time to first token with prefix caching: cold vs hit, and the cost of taking a checkpoint (issue 9).

Builds the real GLM-5.3-Flash geometry cut to ``--layers`` trunk layers (as `bench_e2e.py`, random weights
drawn on the device) and, per prompt length, runs one request on an empty cache (cold: prefill in chunks
of ``--chunk`` tokens, checkpoints taken at every ``--interval`` tokens and at the last page boundary),
then a second request with the same prompt but a different last token (hit: it restores the checkpoint at
the last page boundary and computes the rest). Reports TTFT of both, the tokens reused, the time spent
taking checkpoints (device-synchronised around each) and their bytes.

Usage: ``python -m benchmarks.bench_prefix_cache --layers 4 --lengths 4096 32768 --json out.json``;
``--preset tiny --device cpu --lengths 200`` runs the same code on the CPU (a smoke test).
"""

from __future__ import annotations

import argparse
import time

import torch

from benchmarks.harness.models import random_model
from benchmarks.harness.rows import emit, write_json
from trtllm_glm.config import Glm5NextConfig  # noqa: E402
from trtllm_glm.models.glm5_next import subset_config  # noqa: E402
from trtllm_glm.runtime.executor import Executor, ExecutorConfig  # noqa: E402
from trtllm_glm.runtime.sampling import SamplingParams  # noqa: E402


def ttft(ex: Executor, prompt: list[int], sync) -> tuple[float, int]:
    """Seconds from submission to the first output token, and the tokens restored from the cache."""
    sync()
    t0 = time.perf_counter()
    r = ex.add_request(prompt, SamplingParams(max_tokens=1, ignore_eos=True))
    while not r.output_ids:
        ex.step()
    sync()
    return time.perf_counter() - t0, r.num_cached_tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="glm-5.3-flash")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--lengths", type=int, nargs="+", default=[4096, 32768])
    ap.add_argument("--page", type=int, default=64)
    ap.add_argument("--chunk", type=int, default=8192)
    ap.add_argument("--interval", type=int, default=None)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    base = Glm5NextConfig.from_pretrained(args.preset)
    cfg = subset_config(base, list(range(min(args.layers, base.num_hidden_layers))))
    model = random_model(cfg, args.device, args.dtype, seed=0)
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    rows = []
    for L in args.lengths:
        ecfg = ExecutorConfig(tokens_per_block=args.page, max_tokens=2 * (L + 2 * args.page), max_batch_size=2,
                              max_num_tokens=args.chunk, max_seq_len=L + 16, enable_block_reuse=True,
                              checkpoint_interval=args.interval)  # fmt: skip
        g = torch.Generator().manual_seed(L)
        prompt = torch.randint(0, cfg.vocab_size, (L,), generator=g).tolist()
        # Warm-up: the same prompt cold in a throwaway executor, so first-use compilation and autotuning
        # at these chunk shapes are not in the timed cold run.
        ttft(Executor(model, ecfg), prompt, sync)
        ex = Executor(model, ecfg)
        taken: list[float] = []
        take = ex.prefix._take

        def timed_take(*a, _take=take, _taken=taken, **kw):
            sync()
            t = time.perf_counter()
            _take(*a, **kw)
            sync()
            _taken.append(time.perf_counter() - t)

        ex.prefix._take = timed_take  # type: ignore[method-assign]
        cold, _ = ttft(ex, prompt, sync)
        other = prompt[:-1] + [(prompt[-1] + 1) % cfg.vocab_size]
        hit, cached = ttft(ex, other, sync)
        st = ex.prefix.stats
        row = {"layers": args.layers, "prompt": L, "page": args.page, "chunk": args.chunk,
               "ttft_cold_ms": 1e3 * cold, "ttft_hit_ms": 1e3 * hit, "speedup": cold / hit,
               "cached_tokens": cached, "checkpoints": st.checkpoints_taken,
               "checkpoint_ms_each": 1e3 * sum(taken) / max(1, len(taken)),
               "checkpoint_bytes_total": ex.prefix.store.nbytes, "dtype": args.dtype}  # fmt: skip
        rows.append(row)
        emit(row)
        del ex
        if args.device == "cuda":
            torch.cuda.empty_cache()
    if args.json:
        write_json(args.json, rows)


if __name__ == "__main__":
    main()
