"""``trtllm-glm`` command line: ``generate`` (the main job) and ``indexer-demo``."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence

__all__ = ["main"]


def _progress_printer(total: int, stream=sys.stderr):
    """A one-line progress display for long runs (silent for short ones and non-TTY streams)."""
    start = time.perf_counter()
    shown = [False]

    def show(done: int, steps: int) -> None:
        if total < 64 or not stream.isatty():
            return
        el = time.perf_counter() - start
        rate = done / el if el > 0 else 0.0
        stream.write(f"\r  {done}/{total} tokens  {steps} steps  {rate:7.1f} tok/s")
        stream.flush()
        shown[0] = True

    def close() -> None:
        if shown[0]:
            stream.write("\n")

    return show, close


def _cmd_generate(args: argparse.Namespace) -> int:
    from .runtime.llm import LLM, KvCacheConfig
    from .runtime.sampling import SamplingParams

    model = args.model or args.preset
    llm = LLM(
        model,
        kv_cache_config=KvCacheConfig(tokens_per_block=args.tokens_per_block),
        max_batch_size=max(1, len(args.prompt)),
        max_num_tokens=args.max_num_tokens,
        max_seq_len=args.max_seq_len,
        dtype=args.dtype,
        device=args.device,
        seed=args.seed,
        prefill_chunk_size=args.prefill_chunk_size,
    )
    sp = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.sampling_seed,
        ignore_eos=args.ignore_eos,
    )
    show, close = _progress_printer(args.max_tokens * len(args.prompt))
    t0 = time.perf_counter()
    outs = llm.generate(list(args.prompt), sp, progress=show)
    el = time.perf_counter() - t0
    close()
    assert isinstance(outs, list)
    n_tok = 0
    for i, o in enumerate(outs):
        c = o.outputs[0]
        n_tok += len(c.token_ids)
        print(f"[{i}] prompt: {o.prompt!r}")
        print(f"[{i}] completion: {c.text!r}")
        print(f"[{i}] tokens: {len(c.token_ids)}  finish_reason: {c.finish_reason}")
    print(
        f"generated {n_tok} tokens in {el:.2f} s: {n_tok / el if el > 0 else 0.0:.1f} tok/s "
        f"({llm.executor.num_steps} steps, model={model}, device={llm.device})"
    )
    return 0


def _cmd_indexer_demo(args: argparse.Namespace) -> int:
    from .demo import run_indexer_demo

    run_indexer_demo(
        preset=args.preset,
        num_requests=args.num_requests,
        prompt_len=args.prompt_len,
        tokens_per_block=args.tokens_per_block,
        seed=args.seed,
        device=args.device,
    )
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="trtllm-glm", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text with a preset or a checkpoint")
    src = g.add_mutually_exclusive_group()
    src.add_argument("--preset", default="tiny", help="embedded preset (default: tiny)")
    src.add_argument("--model", default=None, help="checkpoint directory (HF layout)")
    g.add_argument("--prompt", action="append", required=True, help="prompt text (repeat for a batch)")
    g.add_argument("--max-tokens", type=int, default=32)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--sampling-seed", type=int, default=None)
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--seed", type=int, default=0, help="seed of preset weights")
    g.add_argument("--dtype", default=None)
    g.add_argument("--device", default=None)
    g.add_argument("--tokens-per-block", type=int, default=16)
    g.add_argument("--max-num-tokens", type=int, default=512)
    g.add_argument("--max-seq-len", type=int, default=2048)
    g.add_argument("--prefill-chunk-size", type=int, default=None)
    g.set_defaults(func=_cmd_generate)

    d = sub.add_parser("indexer-demo", help="prefill random requests through one sparse layer")
    d.add_argument("--preset", default="tiny")
    d.add_argument("--num-requests", type=int, default=3)
    d.add_argument("--prompt-len", type=int, default=37)
    d.add_argument("--tokens-per-block", type=int, default=16)
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--device", default="cpu")
    d.set_defaults(func=_cmd_indexer_demo)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except (ValueError, RuntimeError) as e:
        print(f"trtllm-glm: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
