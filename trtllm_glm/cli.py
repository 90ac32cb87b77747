"""``trtllm-glm`` command line: ``generate`` (the main job), ``serve`` (an OpenAI-compatible server) and
``indexer-demo``.

User errors (bad option values or combinations, an unknown preset, a broken checkpoint or options file, a
device that is not there) print one ``trtllm-glm: error: ...`` line and exit with status 2; options are
checked before a model is built, so a typo costs nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import sys
import time
from collections.abc import Iterator, Sequence
from typing import Any

__all__ = ["main", "build_parser", "UserError"]

PROG = "trtllm-glm"

# One line per preset for --help (presets missing here are still listed, without a description).
_PRESET_NOTES = {
    "small": "5M-parameter model of this architecture trained on Python sources (the default; shipped weights)",
    "tiny": "8-layer model with seeded random weights and a byte tokenizer: runs anywhere in seconds",
    "glm-5.3-flash": "the real GLM-5.3-Flash geometry with seeded random weights (needs a large GPU)",
}


class UserError(Exception):
    """A mistake in the command line or its inputs: reported in one line, exit status 2."""


def _presets() -> list[str]:
    from .config import PRESETS

    return sorted(PRESETS)


def _description() -> str:
    lines = [
        "Run GLM-5.3-Flash-class models (KDA + pooled-indexer sparse MLA) with the trtllm_glm PyTorch backend.",
        "",
        "presets (a MODEL that needs no checkpoint directory):",
    ]
    lines += [f"  {name:<15} {_PRESET_NOTES.get(name, '')}".rstrip() for name in _presets()]
    lines += [
        "",
        "examples:",
        '  trtllm-glm generate --preset small --prompt "    def __init__(self" --max-tokens 96',
        '  trtllm-glm generate --model /path/to/checkpoint --prompt "Hi" --speculative mtp --draft-len 3',
        "  trtllm-glm serve small --port 8000 --config examples/serve_options.yaml",
    ]
    return "\n".join(lines)


def _run_errors() -> tuple[type[BaseException], ...]:
    """Exceptions of a run that mean "the input was wrong" (a prompt that does not fit, a bad token)."""
    from .config import ConfigError
    from .errors import CapacityError, CheckpointError

    return (ConfigError, CheckpointError, CapacityError, ValueError, TypeError)


def _setup_errors() -> tuple[type[BaseException], ...]:
    """Exceptions of setting up (options, checkpoint, device) that mean "the user asked for something
    wrong": also ``RuntimeError`` (``LLM`` raises it for a device that is not there) and ``OSError``."""
    return (*_run_errors(), RuntimeError, OSError)


def _check_device(device: str | None) -> None:
    """A device that does not exist here is a one-line error, before anything is built."""
    if device is None:
        return
    import torch

    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError):
        raise UserError(f"--device must be cpu, cuda or cuda:N (a device torch knows), got {device!r}") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise UserError(f"--device {device!r} asked for but CUDA is not available on this machine")


@contextlib.contextmanager
def _stderr_logging(level: str = "info", fmt: str = f"{PROG}: %(message)s") -> Iterator[None]:
    """The package's log lines (load progress, server start-up and drain) on stderr while a command runs, so
    that stdout keeps only the generated text. The handler goes when the command ends."""
    import logging

    pkg = logging.getLogger("trtllm_glm")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(fmt))
    old_level = pkg.level
    pkg.addHandler(handler)
    pkg.setLevel(level.upper())
    try:
        yield
    finally:
        pkg.removeHandler(handler)
        pkg.setLevel(old_level)


def _make_llm(args: argparse.Namespace, *, max_batch_size: int, speculative_config: object | None):
    """The `LLM` the ``generate`` arguments describe (also the non-speculative reference of
    ``--check-lossless``, which must differ from the run under test only in speculation and batch)."""
    from .runtime.llm import LLM, KvCacheConfig

    return LLM(
        args.model or args.preset,
        kv_cache_config=KvCacheConfig(
            tokens_per_block=args.tokens_per_block,
            indexer_key_dtype=args.indexer_key_dtype,
            latent_dtype=args.latent_dtype,
        ),
        max_batch_size=max_batch_size,
        max_num_tokens=args.max_num_tokens,
        max_seq_len=args.max_seq_len,
        dtype=args.dtype,
        quantization=args.quantization,
        fp8_lm_head=_FP8_LM_HEAD_CHOICES[args.fp8_lm_head],
        device=args.device,
        seed=args.seed,
        prefill_chunk_size=args.prefill_chunk_size,
        speculative_config=speculative_config,
        batch_invariant=_batch_invariant(args),
        **_parallel_options(args),
    )


_BATCH_INVARIANT_CHOICES = {"on": True, "off": False, "auto": None}
# ``--fp8-lm-head``: LLM's fp8_lm_head (None, the default: the head as the checkpoint stores it).
_FP8_LM_HEAD_CHOICES: dict[str | None, str | bool | None] = {None: None, "auto": "auto", "on": True, "off": False}


def _add_batch_invariant_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--batch_invariant", "--batch-invariant", choices=list(_BATCH_INVARIANT_CHOICES), default=None,
        help="batch-invariant numerics: speculative greedy == plain greedy bit for bit (docs/numerics.md; "
        "default auto)",
    )  # fmt: skip


def _batch_invariant(args: argparse.Namespace) -> bool | None:
    """``--batch_invariant`` as ``LLM``'s argument (``None``: auto, or not given)."""
    return _BATCH_INVARIANT_CHOICES[args.batch_invariant or "auto"]


def _add_parallel_args(p: argparse.ArgumentParser) -> None:
    """TensorRT-LLM's flags of the parallel sizes (docs/parallelism.md)."""
    p.add_argument(
        "--tp_size",
        type=int,
        default=None,
        metavar="N",
        help="tensor-parallel ranks (LLM's tensor_parallel_size; one process each)",
    )
    p.add_argument(
        "--ep_size",
        type=int,
        default=None,
        metavar="N",
        help="expert-parallel blocks of routed experts (moe_expert_parallel_size)",
    )
    p.add_argument("--moe_tp_size", type=int, default=None, metavar="N",
                   help="slices of each routed expert (moe_tensor_parallel_size)")  # fmt: skip


def _parallel_options(args: argparse.Namespace) -> dict[str, int]:
    """The ``LLM`` keywords the parallel flags given on the command line set."""
    out = {}
    for flag, key in (("tp_size", "tensor_parallel_size"), ("ep_size", "moe_expert_parallel_size"),
                      ("moe_tp_size", "moe_tensor_parallel_size")):  # fmt: skip
        v = getattr(args, flag, None)
        if v is not None:
            if v < 1:
                raise UserError(f"--{flag} must be >= 1, got {v}")
            out[key] = v
    return out


# Drafter options: flag, the config field it sets, and why a drafter whose config lacks the field ignores it.
_DRAFTER_FLAGS = (
    ("--draft-kv-mode", "draft_kv_mode", "has no KV cache"),
    ("--draft-vocab-size", "draft_vocab_size", "has no LM head"),
)


def _speculative_config(args: argparse.Namespace) -> object | None:
    """The speculative config (``--draft-len`` is its ``max_draft_len``), refusing draft options that would be
    ignored."""
    from .speculative.registry import decoding_types_text, speculation_entry

    if args.speculative is None:
        given = [f for f, v in (("--draft-len", args.draft_len), ("--draft-kv-mode", args.draft_kv_mode),
                                ("--draft-vocab-size", args.draft_vocab_size)) if v]  # fmt: skip
        if given:
            verb = "need" if len(given) > 1 else "needs"
            raise UserError(f"{' and '.join(given)} {verb} --speculative ({decoding_types_text().lower()})")
        if args.check_lossless:
            raise UserError("--check-lossless compares a speculative run with a plain one: it needs --speculative")
        return None
    cls = speculation_entry(args.speculative).config_cls
    k = 3 if args.draft_len is None else args.draft_len
    top = cls.MAX_DRAFT_LEN
    if not 1 <= k <= top:  # named as the user wrote it, not as the config field it becomes
        raise UserError(f"--draft-len must be in [1, {top}] for --speculative {args.speculative}, got {k}")
    kwargs: dict[str, object] = {"max_draft_len": k}
    for flag, field, why in _DRAFTER_FLAGS:
        value = getattr(args, field)
        if value is None:
            continue
        if field not in {f.name for f in dataclasses.fields(cls)}:
            takers = " / ".join(_speculative_choices(field))
            raise UserError(f"{flag} applies to --speculative {takers} only (the {args.speculative} drafter {why})")
        kwargs[field] = value
    return cls(**kwargs)


def _decoding_types() -> list[str]:
    from .speculative.registry import decoding_types

    return decoding_types()


def _speculative_choices(field: str | None = None) -> list[str]:
    """The ``--speculative`` choices (the registry's decoding types), or those whose config has ``field``."""
    from .speculative.registry import speculation_entry

    entries = [speculation_entry(t) for t in _decoding_types()]
    return [e.cli_name for e in entries if field is None or field in {f.name for f in dataclasses.fields(e.config_cls)}]


def _draft_len_ranges() -> str:
    """``"mtp: 1-5, ngram: 1-7"``: each decoding type's ``--draft-len`` range."""
    from .speculative.registry import speculation_entry

    return ", ".join(f"{e.cli_name}: 1-{e.config_cls.MAX_DRAFT_LEN}" for e in map(speculation_entry, _decoding_types()))


def _check_prompt_arg(text: str, i: int) -> None:
    """A ``--prompt`` whose bytes are not UTF-8 (Python keeps them as U+DC80..U+DCFF escapes) is named as such."""
    for j, ch in enumerate(text):
        if 0xDC80 <= ord(ch) <= 0xDCFF:
            raise UserError(f"--prompt {i + 1}: not valid UTF-8 (byte 0x{ord(ch) - 0xDC00:02x} at character {j})")


def _cmd_generate(args: argparse.Namespace) -> int:
    from .runtime.sampling import SamplingParams

    try:
        # Everything a user can get wrong is checked before the model is built.
        for i, p in enumerate(args.prompt):
            _check_prompt_arg(p, i)
        sp = SamplingParams(
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            seed=args.sampling_seed,
            ignore_eos=args.ignore_eos,
        )
        spec = _speculative_config(args)
        if args.check_lossless and not sp.greedy:
            raise UserError("--check-lossless needs greedy sampling (--temperature 0)")
        _check_device(args.device)
        with _stderr_logging():  # load progress (the shards of a large checkpoint)
            llm = _make_llm(args, max_batch_size=max(1, len(args.prompt)), speculative_config=spec)
    except _setup_errors() as e:
        raise UserError(str(e)) from None
    t0 = time.perf_counter()
    try:
        outs = asyncio.run(_stream_outputs(llm, list(args.prompt), sp, as_json=args.json))
    except _run_errors() as e:
        raise UserError(str(e)) from None
    finally:
        llm.shutdown()  # the engine thread, and a parallel LLM's worker processes
    el = time.perf_counter() - t0
    n_tok = sum(len(o.outputs[0].token_ids) for o in outs)
    rate = n_tok / el if el > 0 else 0.0
    model = args.model or args.preset
    if args.json:
        summary = {"tokens": n_tok, "seconds": round(el, 4), "tokens_per_s": round(rate, 2),
                   "steps": llm.executor.num_steps, "model": model, "device": llm.device}  # fmt: skip
        print(json.dumps({"summary": summary}))
    else:
        for i, o in enumerate(outs):
            c = o.outputs[0]
            print(f"[{i}] tokens: {len(c.token_ids)}  finish_reason: {c.finish_reason}")
            if spec is not None:
                acc = ", ".join(f"{x:.2f}" for x in c.acceptance_per_position)
                print(
                    f"[{i}] speculative: {c.num_draft_rounds} verify rounds, mean accepted length "
                    f"{c.mean_accepted_length:.2f}, acceptance per draft position [{acc}]"
                )
        print(
            f"generated {n_tok} tokens in {el:.2f} s: {rate:.1f} tok/s "
            f"({llm.executor.num_steps} steps, model={model}, device={llm.device})"
        )
    if args.check_lossless:
        return _check_lossless(args, outs, sp)
    return 0


async def _stream_outputs(llm: Any, prompts: list[str], sp: Any, *, as_json: bool) -> list[Any]:
    """Generate every prompt at once (one batch) through `LLM.generate_async`, printing as tokens come.

    Text mode: one prompt streams its completion to stdout as it is generated; with several, each completion
    is printed whole, under an ``[i]`` header, as it finishes. ``as_json``: one JSON object per prompt (in
    prompt order, once all are done). Returns the final `RequestOutput`s in prompt order.
    """
    handles = [llm.generate_async(p, sp, streaming=len(prompts) == 1 and not as_json) for p in prompts]
    out = sys.stdout

    async def one(i: int) -> Any:
        printed = 0
        final = None
        async for part in handles[i]:
            final = part
            if as_json:
                continue
            text = part.outputs[0].text
            if len(prompts) == 1:
                out.write(text[printed:])
                out.flush()
                printed = len(text)
        assert final is not None
        if not as_json:
            if len(prompts) > 1:
                out.write(f"[{i}] {prompts[i]!r} ->\n{final.outputs[0].text}")
            out.write("\n")
            out.flush()
        return final

    try:
        outs = list(await asyncio.gather(*(one(i) for i in range(len(prompts)))))
    finally:
        llm.shutdown()
    if as_json:
        for i, o in enumerate(outs):
            c = o.outputs[0]
            rec = {"index": i, "prompt": o.prompt, "text": c.text, "token_ids": c.token_ids,
                   "finish_reason": c.finish_reason, "num_cached_tokens": o.num_cached_tokens}  # fmt: skip
            if c.num_draft_rounds:
                rec["speculative"] = {
                    "verify_rounds": c.num_draft_rounds,
                    "mean_accepted_length": c.mean_accepted_length,
                    "acceptance_per_position": c.acceptance_per_position,
                }
            print(json.dumps(rec, ensure_ascii=False))
    return outs


def _check_lossless(args: argparse.Namespace, outs: list, sp) -> int:
    """Re-run without speculation and compare greedy tokens under the near-tie rule."""
    from .runtime.lossless import compare_greedy

    ref_llm = _make_llm(args, max_batch_size=1, speculative_config=None)
    bad = 0
    refs = [ref_llm.generate(prompt, sp) for prompt in args.prompt]
    ref_llm.shutdown()
    for i, (ref, o) in enumerate(zip(refs, outs)):
        d = compare_greedy(ref.outputs[0].token_ids, ref.outputs[0].logit_gaps, o.outputs[0].token_ids)
        if d is None:
            print(f"[{i}] lossless: identical to non-speculative greedy ({len(ref.outputs[0].token_ids)} tokens)")
        elif d.excused:
            print(f"[{i}] lossless: {d}")
        else:
            print(f"[{i}] lossless check FAILED: {d}")
            bad += 1
    return 1 if bad else 0


# ``serve --http`` / ``--loop``: `serve.http_loop.HTTP_CHOICES` / `LOOP_CHOICES` written out, so that building the
# parser imports nothing of the server (the serve package imports the runtime, and torch); a test keeps them equal.
_HTTP_CHOICES = ("auto", "httptools", "h11")
_LOOP_CHOICES = ("auto", "uvloop", "asyncio")


def _serve_http_loop(args: argparse.Namespace, serve_options: dict[str, Any]) -> tuple[str, str]:
    """uvicorn's HTTP parser and event loop asked for: ``--http`` / ``--loop`` over the ``--config`` file's ``http`` /
    ``loop`` keys (default ``auto``). Checked now, before the address is bound or the model built: a C one named that
    does not import is an error naming where it was asked for, never a fall-back to the pure-Python one."""
    from .serve.http_loop import choose_http_loop

    asked = []
    for key in ("http", "loop"):
        flag = getattr(args, key)
        if flag is not None:
            value, source = flag, f"--{key} {flag}"
        else:
            value, source = serve_options.get(key, "auto"), f"{args.config}: {key}"
        try:
            choose_http_loop(**{key: value})  # the other one "auto": only this one's name can fail
        except ValueError as e:
            raise UserError(f"{source}: {e}") from None
        asked.append(value)
    return asked[0], asked[1]


def _cmd_serve(args: argparse.Namespace) -> int:
    if not 0 < args.port < 65536:
        raise UserError(f"--port must be in 1..65535, got {args.port}")
    if args.max_queue_size < 0:
        raise UserError(f"--max-queue-size must be >= 0, got {args.max_queue_size}")
    if args.drain_timeout < 0:
        raise UserError(f"--drain-timeout must be >= 0, got {args.drain_timeout}")
    try:
        from .serve.config import load_llm_options, split_serve_options
        from .serve.server import bind_socket, make_app, run_server
    except ImportError as e:
        raise UserError(f"serve needs the serve extra (pip install 'trtllm_glm[serve]'): {e}") from None
    try:
        options, serve_options = split_serve_options(load_llm_options(args.config) if args.config else {})
        engine_process = serve_options.get("engine_process", True) and not args.no_engine_process
        http, loop = _serve_http_loop(args, serve_options)
        options.update(_parallel_options(args))
        if args.batch_invariant is not None:  # the flag overrides the YAML key
            options["batch_invariant"] = _batch_invariant(args)
        _check_device(options.get("device"))
    except _setup_errors() as e:
        raise UserError(str(e)) from None
    try:  # the address first: a port in use is an error now, not after the model has loaded
        sock = bind_socket(args.host, args.port)
    except OSError as e:
        raise UserError(f"cannot listen on {args.host}:{args.port}: {e.strerror or e}") from None
    # uvicorn's format, so that start-up and drain lines read like its own.
    with contextlib.closing(sock), _stderr_logging(args.log_level, "%(levelname)s:     %(message)s"):
        try:
            app = make_app(
                args.model, options, served_model_name=args.served_model_name, max_queue_size=args.max_queue_size,
                drain_timeout=args.drain_timeout, step_log=args.step_log, reasoning_parser=args.reasoning_parser,
                engine_process=engine_process,
            )  # fmt: skip
        except _setup_errors() as e:
            raise UserError(str(e)) from None
        try:
            run_server(app, host=args.host, port=args.port, log_level=args.log_level, drain_timeout=args.drain_timeout,
                       sock=sock, http=http, loop=loop)  # fmt: skip
        finally:
            engine = getattr(getattr(app, "state", None), "engine", None)
            llm = getattr(engine, "llm", None)
            if llm is not None and hasattr(llm, "shutdown"):
                llm.shutdown()  # the worker processes of a parallel LLM
            if hasattr(engine, "close"):
                engine.close()  # the engine process (stopped by the drain; ended here if uvicorn never started)
    return 0


def _cmd_indexer_demo(args: argparse.Namespace) -> int:
    from .demo import run_indexer_demo

    _check_device(args.device)
    try:
        run_indexer_demo(
            preset=args.preset,
            num_requests=args.num_requests,
            prompt_len=args.prompt_len,
            tokens_per_block=args.tokens_per_block,
            seed=args.seed,
            device=args.device,
        )
    except _run_errors() as e:
        raise UserError(str(e)) from None
    return 0


def build_parser() -> argparse.ArgumentParser:
    from . import __version__

    fmt = argparse.RawDescriptionHelpFormatter
    presets = _presets()
    p = argparse.ArgumentParser(prog=PROG, description=_description(), formatter_class=fmt)
    p.add_argument("--version", action="version", version=f"{PROG} {__version__}", help="print the version and exit")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    g = sub.add_parser(
        "generate", help="generate text with a preset or a checkpoint (the main job)", formatter_class=fmt,
        description="Generate text for one or more prompts (batched) and print it with throughput.",
    )  # fmt: skip
    src = g.add_mutually_exclusive_group()
    src.add_argument("--preset", default="small", choices=presets, help="embedded preset (default: small)")
    src.add_argument("--model", default=None, metavar="DIR", help="checkpoint directory (HF layout); replaces --preset")
    g.add_argument("--prompt", action="append", required=True, metavar="TEXT", help="prompt text (repeat for a batch)")
    g.add_argument("--max-tokens", type=int, default=32, metavar="N", help="new tokens per prompt at most (default 32)")
    g.add_argument("--temperature", type=float, default=0.0, metavar="T", help="0 = greedy (default); > 0 samples")
    g.add_argument("--top-p", type=float, default=1.0, metavar="P", help="nucleus mass in (0, 1] (default 1: off)")
    g.add_argument("--top-k", type=int, default=0, metavar="K", help="keep the K most likely tokens (default 0: off)")
    g.add_argument("--sampling-seed", type=int, default=None, metavar="S", help="seed of the sampler (default: none)")
    g.add_argument("--ignore-eos", action="store_true", help="do not stop at the end-of-sequence token")
    g.add_argument(
        "--json", action="store_true",
        help="print one JSON object per prompt and a summary line instead of streaming text",
    )  # fmt: skip
    g.add_argument("--seed", type=int, default=0, help="seed of preset weights (default 0)")
    g.add_argument("--dtype", default=None, help="parameter dtype, e.g. bfloat16 (default: the checkpoint's)")
    g.add_argument(
        "--quantization", choices=["auto", "fp8", "none"], default=None,
        help="auto: block-FP8 checkpoints stay FP8 (default); fp8: also quantise bf16 weights at load; "
        "none: dequantise at load",
    )  # fmt: skip
    g.add_argument(
        "--fp8-lm-head", "--fp8_lm_head", choices=["auto", "on", "off"], default=None,
        help="the LM head in block FP8: auto = when the rest of the model is block FP8; on / off = always / never "
        "(default: as the checkpoint stores it; docs/fp8.md)",
    )  # fmt: skip
    g.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (default: cuda when available)")
    g.add_argument("--tokens-per-block", type=int, default=16, metavar="N", help="KV page size, a multiple of 4")
    g.add_argument(
        "--indexer-key-dtype", choices=["fp8", "bf16"], default="fp8",
        help="precision of the cached indexer keys (default fp8; bf16: closer to the reference, 2x their bytes)",
    )  # fmt: skip
    g.add_argument(
        "--latent-dtype", choices=["auto", "fp8"], default="auto",
        help="storage of the sparse layers' latent KV rows (default auto: the model dtype; fp8: e4m3 with a scale "
        "per 128 columns, about half the bytes)",
    )  # fmt: skip
    g.add_argument(
        "--max-num-tokens", type=int, default=None, metavar="N",
        help="token rows per step (default: 8192, smaller where memory is short)",
    )  # fmt: skip
    g.add_argument("--max-seq-len", type=int, default=2048, metavar="N", help="prompt + output limit (default 2048)")
    g.add_argument(
        "--prefill-chunk-size", type=int, default=None, metavar="N", help="cap on a prefill chunk (default: none)"
    )
    g.add_argument("--speculative", choices=_speculative_choices(), default=None, help="speculative decoding drafter")
    g.add_argument(
        "--draft-len", type=int, default=None, metavar="K",
        help=f"drafts per round, the config's max_draft_len ({_draft_len_ranges()}; default 3); needs --speculative",
    )  # fmt: skip
    g.add_argument(
        "--draft-kv-mode", choices=["shared", "separate"], default=None,
        help="where the MTP layer's KV pages live (default shared); needs --speculative mtp",
    )  # fmt: skip
    g.add_argument(
        "--draft-vocab-size", type=int, default=None, metavar="N",
        help="MTP drafts score only the N most frequent tokens (the checkpoint's token_frequency.json; "
        "verification keeps the full vocabulary); needs --speculative mtp",
    )  # fmt: skip
    g.add_argument(
        "--check-lossless", action="store_true",
        help="also run without speculation; exit 1 if greedy tokens diverge outside a near tie",
    )  # fmt: skip
    _add_parallel_args(g)
    _add_batch_invariant_arg(g)
    g.set_defaults(func=_cmd_generate)

    s = sub.add_parser(
        "serve", help="OpenAI-compatible HTTP server (completions, chat, streaming, /metrics)", formatter_class=fmt,
        description="Serve MODEL over HTTP: /v1/completions, /v1/chat/completions, /v1/models, /health,\n"
        "/health_generate, /version and /metrics (Prometheus). LLM options come from --config, a YAML\n"
        "file with the keys of LLM(...): max_batch_size, max_num_tokens, max_seq_len, dtype, quantization,\n"
        "fp8_lm_head, device, kv_cache_config {tokens_per_block, max_tokens, indexer_key_dtype, latent_dtype},\n"
        f"speculative_config {{decoding_type: {' | '.join(_decoding_types())}, ...}}.",
    )  # fmt: skip
    s.add_argument("model", metavar="MODEL", help=f"preset ({', '.join(presets)}) or checkpoint directory")
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    s.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000)")
    s.add_argument("--config", default=None, metavar="YAML", help="LLM API options file (see above)")
    s.add_argument("--served-model-name", default=None, metavar="NAME", help="model name clients send (default: MODEL)")
    s.add_argument(
        "--max-queue-size", type=int, default=64, metavar="N",
        help="requests that may wait beyond the running batch; more get 503 + Retry-After (default 64)",
    )  # fmt: skip
    s.add_argument(
        "--drain-timeout", type=float, default=30.0, metavar="S",
        help="seconds in-flight requests get to finish on shutdown before they are aborted (default 30)",
    )  # fmt: skip
    s.add_argument(
        "--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
        help="server log level (default info)",
    )  # fmt: skip
    s.add_argument(
        "--reasoning-parser", default="auto", choices=["auto", "none", "glm45"],
        help="split chat answers' thinking into reasoning_content (auto: glm45 when the chat template writes "
        "</think>)",
    )  # fmt: skip
    s.add_argument(
        "--step-log", default=None, metavar="FILE",
        help="append a JSON line per engine step and per request (TTFT split into queue, prefill, delivery)",
    )  # fmt: skip
    s.add_argument(
        "--no-engine-process", action="store_true",
        help="run the engine on a thread of the server's process instead of a process of its own (debugging; "
        "also the YAML key engine_process: false)",
    )  # fmt: skip
    s.add_argument(
        "--http", choices=list(_HTTP_CHOICES), default=None,
        help="uvicorn's HTTP parser: auto (httptools when installed, else h11; the default), httptools (an error when "
        "not installed) or h11; overrides the YAML key http",
    )  # fmt: skip
    s.add_argument(
        "--loop", choices=list(_LOOP_CHOICES), default=None,
        help="uvicorn's event loop: auto (uvloop when installed, else asyncio; the default), uvloop (an error when not "
        "installed) or asyncio; overrides the YAML key loop",
    )  # fmt: skip
    _add_parallel_args(s)
    _add_batch_invariant_arg(s)
    s.set_defaults(func=_cmd_serve)

    d = sub.add_parser(
        "indexer-demo", help="prefill random requests through one sparse layer and show the selection",
        description="Prefill a few random requests through one sparse MLA layer; print what each last row "
        "selected and the cache bytes in use.",
    )  # fmt: skip
    d.add_argument("--preset", default="tiny", choices=presets, help="embedded preset (default: tiny)")
    d.add_argument("--num-requests", type=int, default=3, metavar="N", help="requests to prefill (default 3)")
    d.add_argument("--prompt-len", type=int, default=37, metavar="N", help="length of the first prompt (default 37)")
    d.add_argument("--tokens-per-block", type=int, default=16, metavar="N", help="KV page size (default 16)")
    d.add_argument("--seed", type=int, default=0, help="seed of weights and inputs (default 0)")
    d.add_argument("--device", default="cpu", help="device (default cpu)")
    d.set_defaults(func=_cmd_indexer_demo)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except UserError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C (or serve's second one): a line, not a traceback
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
