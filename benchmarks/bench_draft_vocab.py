"""MTP acceptance against the restricted draft vocabulary's size on the trained ``small`` preset (issue 43 item 3).

The draft steps score only the ``N`` most frequent tokens of the preset's shipped ranking
(``trtllm_glm/presets/small/token_frequency.json``, `MTPDecodingConfig.draft_vocab_size`); verification keeps
the full vocabulary, so every run's greedy output must equal plain decoding's (checked per request). Per size
the row gives the mean accepted tokens per verify round (root + accepted drafts), the acceptance per draft
position, the share of the full head each draft step reads (``N / V``) and the losslessness check. Prompts are
the held-out stdlib modules (`bench_e2e.held_out_prompt_ids`), greedy.

Usage: ``python -m benchmarks.bench_draft_vocab --sizes full 128 64 32 16 --k 3 --json out.json``
(``--device cuda --dtype bfloat16`` runs the same on a GPU; CPU numbers are acceptance, not speed).
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from benchmarks.harness.prompts import held_out_prompt_ids
from trtllm_glm.models.glm5_next import Glm5NextForCausalLM  # noqa: E402
from trtllm_glm.runtime.executor import Executor, ExecutorConfig  # noqa: E402
from trtllm_glm.runtime.lossless import compare_greedy  # noqa: E402
from trtllm_glm.runtime.sampling import SamplingParams  # noqa: E402
from trtllm_glm.runtime.speculative_executor import SpeculativeExecutor  # noqa: E402
from trtllm_glm.speculative.config import MTPDecodingConfig  # noqa: E402


def run(model, prompts, gen: int, device: str, spec: MTPDecodingConfig | None, batch: int) -> tuple[list, float]:
    cfg = ExecutorConfig(tokens_per_block=64, max_tokens=batch * (max(map(len, prompts)) + gen + 80),
                         max_batch_size=batch, max_num_tokens=2048,
                         max_seq_len=max(map(len, prompts)) + gen + 16)  # fmt: skip
    ex = Executor(model, cfg) if spec is None else SpeculativeExecutor(model, cfg, spec)
    reqs = [ex.add_request(p, SamplingParams(max_tokens=gen, ignore_eos=True)) for p in prompts]
    t0 = time.perf_counter()
    ex.run_until_done()
    if device == "cuda":
        torch.cuda.synchronize()
    return reqs, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", nargs="+", default=["full", "128", "96", "64", "48", "32", "16"])
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--gen", type=int, default=96)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    model = Glm5NextForCausalLM.from_pretrained("small", dtype=args.dtype, device=args.device).eval()
    V = model.config.vocab_size
    prompts = held_out_prompt_ids(args.prompts, args.prompt_len)
    plain, plain_s = run(model, prompts, args.gen, args.device, None, args.batch)
    rows = []
    for size in args.sizes:
        n = None if size == "full" else int(size)
        spec = MTPDecodingConfig(adaptive=False, num_nextn_predict_layers=args.k, draft_vocab_size=n)
        reqs, dt = run(model, prompts, args.gen, args.device, spec, args.batch)
        rounds = sum(r.num_verify_rounds for r in reqs)
        prop = [sum(r.proposed_per_position[j] for r in reqs if j < len(r.proposed_per_position))
                for j in range(args.k)]  # fmt: skip
        acc = [sum(r.accepted_per_position[j] for r in reqs if j < len(r.accepted_per_position))
               for j in range(args.k)]  # fmt: skip
        diverged = sum(
            1
            for a, b in zip(plain, reqs)
            if (d := compare_greedy(a.output_ids, a.logit_gaps, b.output_ids)) and not d.excused
        )
        row = {
            "preset": "small", "mode": f"mtp{args.k}", "K": args.k, "draft_vocab_size": n or V, "vocab_size": V,
            "head_share": round((n or V) / V, 4), "overlap": False, "graphs": False, "device": args.device,
            "dtype": args.dtype, "requests": len(reqs), "batch": args.batch, "gen": args.gen,
            "mean_accepted_per_round": round(sum(r.num_accepted_total for r in reqs) / max(rounds, 1), 4),
            "acceptance_per_position": [round(a / p, 4) if p else None for a, p in zip(acc, prop)],
            "rounds": rounds, "lossless_diverged": diverged, "wall_s": round(dt, 3), "plain_wall_s": round(plain_s, 3),
        }  # fmt: skip
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
