"""Indexer-key precision vs the `transformers` reference (CPU, FP32): selection recall and greedy agreement.

For each key format (``KvCacheConfig.indexer_key_dtype`` = ``fp8`` / ``bf16``) and each prompt, where
``index_topk`` drops pools:

* pool-selection recall of the first sparse layer against the reference's float selection (prefill rows;
  later layers compound earlier differences, so only the first measures the indexer alone), also per layer;
* greedy agreement: our greedy continuation (``max_new`` tokens) against the reference's, computed from
  scratch by full recomputation; whether it matches entirely and the first position where it parts.

Models: ``random`` (a small random reference model, every weight perturbed: benchmarks/harness/hf_reference.py, 8
indexer heads, ``index_topk`` 16 tokens = 4 pools) and/or ``small`` (the trained preset, ``index_topk`` 64 = 16 pools,
loaded into the reference from its checkpoint directory).

    python -m benchmarks.indexer_keys_fidelity --models random small --json out.json

Prints one line per (model, key format) and a summary; docs/indexer_keys.md has the numbers.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from typing import Any

import torch

from benchmarks.harness.hf_reference import build_hf_model, hf_greedy, import_reference
from benchmarks.harness.rows import write_json
from benchmarks.harness.selection_recall import our_selections, recall_counts, reference_selections
from trtllm_glm import LLM, KvCacheConfig, SamplingParams  # noqa: E402
from trtllm_glm.config import resolve_preset_dir  # noqa: E402

KEY_DTYPES = ("fp8", "bf16")


def first_divergence(a: list[int], b: list[int]) -> int | None:
    for j, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return j
    return None


def load_reference(name: str, tmp: str) -> tuple[Any, str]:
    """``(reference model, checkpoint dir our LLM loads)``."""
    if name == "random":
        model = build_hf_model(seed=7, index_topk=16, index_n_heads=8)
        model.save_pretrained(tmp)
        return model, tmp
    if name == "small":
        _, cls = import_reference()
        d = str(resolve_preset_dir("small"))
        model = cls.from_pretrained(d, torch_dtype=torch.float32, attn_implementation="eager").eval()
        return model, d
    raise SystemExit(f"unknown model {name!r} (random, small)")


def prompts(vocab: int, lengths: list[int], seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, min(vocab, 256) - 8, (n,), generator=g).tolist() for n in lengths]


def run_model(name: str, lengths: list[int], max_new: int, seed: int) -> list[dict[str, Any]]:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model, path = load_reference(name, tmp)
        cfg = model.config.text_config if hasattr(model.config, "text_config") else model.config
        topk = cfg.index_topk
        ps = prompts(cfg.vocab_size, lengths, seed)
        t0 = time.perf_counter()
        ref_sel = [reference_selections(model, ids) for ids in ps]
        ref_greedy = [hf_greedy(model, ids, max_new) for ids in ps]
        ref_s = time.perf_counter() - t0
        for kd in KEY_DTYPES:
            kv = KvCacheConfig(tokens_per_block=16, enable_block_reuse=False, indexer_key_dtype=kd)
            llm = LLM(model=path, device="cpu", dtype=torch.float32, max_seq_len=1024, kv_cache_config=kv)
            hits = [0] * len(ref_sel[0])
            totals = [0] * len(ref_sel[0])
            agree, firsts, per_prompt = 0, [], []
            for ids, rsel, (want, gaps) in zip(ps, ref_sel, ref_greedy):
                osel = our_selections(llm, ids)
                assert len(osel) == len(rsel), (len(osel), len(rsel))
                for layer, (a, b) in enumerate(zip(osel, rsel)):
                    h, t = recall_counts(a, b, len(ids))
                    hits[layer] += h
                    totals[layer] += t
                got = llm.generate(ids, SamplingParams(max_tokens=max_new, ignore_eos=True)).outputs[0].token_ids
                j = first_divergence(got, want)
                agree += j is None
                firsts.append(j)
                per_prompt.append(
                    {"len": len(ids), "first_divergence": j, "gap_there": None if j is None else round(gaps[j], 5)}
                )
            row = {
                "model": name,
                "indexer_key_dtype": kd,
                "index_topk": topk,
                "prompt_lengths": lengths,
                "max_new_tokens": max_new,
                "recall_first_sparse_layer": round(hits[0] / totals[0], 4),
                "recall_per_sparse_layer": [round(h / t, 4) for h, t in zip(hits, totals)],
                "greedy_agree_prompts": agree,
                "num_prompts": len(ps),
                "first_divergence": firsts,
                "per_prompt": per_prompt,
                "reference_seconds": round(ref_s, 1),
            }
            print(
                f"{name:6s} keys={kd:4s} index_topk={topk}: "
                f"recall(first sparse layer)={row['recall_first_sparse_layer']:.4f}"
                f" per layer {row['recall_per_sparse_layer']}; greedy == reference for {agree}/{len(ps)} prompts"
                f" ({max_new} tokens; first divergence {firsts})",
                flush=True,
            )
            rows.append(row)
            llm.shutdown()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["random", "small"], choices=["random", "small"])
    ap.add_argument("--lengths", type=int, nargs="+", default=[40, 57, 83, 101, 126, 150, 199])
    ap.add_argument("--max-new", type=int, default=16)
    ap.add_argument("--seed", type=int, default=11)
    ap.add_argument("--json", default=None, metavar="FILE")
    args = ap.parse_args()
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, CPU fp32, prompts {args.lengths}, {args.max_new} greedy tokens", flush=True)
    rows = []
    for m in args.models:
        rows += run_model(m, args.lengths, args.max_new, args.seed)
    if args.json:
        write_json(args.json, rows)


if __name__ == "__main__":
    main()
