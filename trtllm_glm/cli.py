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


def _make_llm(args: argparse.Namespace, *, max_batch_size: int, speculative_config: object | None):
    """The `LLM` the ``generate`` arguments describe (also the non-speculative reference of
    ``--check-lossless``, which must differ from the run under test only in speculation and batch)."""
    from .runtime.llm import LLM, KvCacheConfig

    return LLM(
        args.model or args.preset,
        kv_cache_config=KvCacheConfig(tokens_per_block=args.tokens_per_block),
        max_batch_size=max_batch_size,
        max_num_tokens=args.max_num_tokens,
        max_seq_len=args.max_seq_len,
        dtype=args.dtype,
        device=args.device,
        seed=args.seed,
        prefill_chunk_size=args.prefill_chunk_size,
        speculative_config=speculative_config,
    )


def _cmd_generate(args: argparse.Namespace) -> int:
    from .runtime.sampling import SamplingParams

    model = args.model or args.preset
    spec = None
    if args.speculative:
        from .speculative.config import MTPDecodingConfig, NGramDecodingConfig

        if args.speculative == "mtp":
            spec = MTPDecodingConfig(num_nextn_predict_layers=args.draft_len, draft_kv_mode=args.draft_kv_mode)
        else:
            spec = NGramDecodingConfig(max_draft_len=args.draft_len)
    llm = _make_llm(args, max_batch_size=max(1, len(args.prompt)), speculative_config=spec)
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
        if spec is not None:
            acc = ", ".join(f"{x:.2f}" for x in c.acceptance_per_position)
            print(
                f"[{i}] speculative: {c.num_draft_rounds} verify rounds, mean accepted length "
                f"{c.mean_accepted_length:.2f}, acceptance per draft position [{acc}]"
            )
    print(
        f"generated {n_tok} tokens in {el:.2f} s: {n_tok / el if el > 0 else 0.0:.1f} tok/s "
        f"({llm.executor.num_steps} steps, model={model}, device={llm.device})"
    )
    if args.check_lossless:
        return _check_lossless(args, outs, sp)
    return 0


def _check_lossless(args: argparse.Namespace, outs: list, sp) -> int:
    """Re-run without speculation and compare greedy tokens under the near-tie rule."""
    from .runtime.lossless import compare_greedy

    if not sp.greedy:
        print("trtllm-glm: --check-lossless needs greedy sampling (temperature 0)", file=sys.stderr)
        return 2
    ref_llm = _make_llm(args, max_batch_size=1, speculative_config=None)
    bad = 0
    for i, (prompt, o) in enumerate(zip(args.prompt, outs)):
        ref = ref_llm.generate(prompt, sp)
        d = compare_greedy(ref.outputs[0].token_ids, ref.outputs[0].logit_gaps, o.outputs[0].token_ids)
        if d is None:
            print(f"[{i}] lossless: identical to non-speculative greedy ({len(ref.outputs[0].token_ids)} tokens)")
        elif d.excused:
            print(f"[{i}] lossless: {d}")
        else:
            print(f"[{i}] lossless check FAILED: {d}")
            bad += 1
    return 1 if bad else 0


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
    g.add_argument("--speculative", choices=["mtp", "ngram"], default=None, help="speculative decoding")
    g.add_argument("--draft-len", type=int, default=3, help="drafts per round (mtp: 1-5, ngram: 1-7)")
    g.add_argument("--draft-kv-mode", choices=["shared", "separate"], default="shared")
    g.add_argument(
        "--check-lossless", action="store_true",
        help="also run without speculation; exit 1 if greedy tokens diverge outside a near tie",
    )  # fmt: skip
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
