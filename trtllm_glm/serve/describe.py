"""`describe_engine`: the start-up log lines that say what the server loaded (model, parallelism, speculation,
CUDA graphs, KV cache, step sizes); written by whichever process builds the `LLM` (the engine process, or the
server's own with ``--no-engine-process``)."""

from __future__ import annotations

import os
from typing import Any

__all__ = ["describe_engine"]


def describe_engine(engine: Any, model: Any, load_s: float | None = None) -> list[str]:
    """What was loaded, for the start-up log: model, device, dtype, parallelism, speculation, CUDA graphs and
    the KV page pool."""
    llm = engine.llm
    ex = engine.executor
    cfg = ex.cfg
    params = sum(p.numel() for p in llm.model.parameters())
    dtype = str(next(llm.model.parameters()).dtype).replace("torch.", "")
    spec = llm.speculative_config
    if spec is None:
        spec_s = "off"
    else:
        fields = ", ".join(f"{k}={v}" for k, v in vars(spec).items() if not k.startswith("_") and not callable(v))
        spec_s = f"{type(spec).__name__}({fields})"
    runner = getattr(ex, "graph_runner", None)
    graphs = "off" if runner is None else f"{len(runner.graphs)} captured at start-up"
    if not (cfg.overlap_scheduler and runner is not None):
        overlap = "off" if not cfg.overlap_scheduler else "off (needs CUDA graphs)"
    elif spec is not None and getattr(ex, "drafts_ahead_supported", False):
        overlap = "on (MTP drafting rounds launched ahead while no request can end by length, sample or read logits)"
    elif spec is not None:
        overlap = "on for width-one rounds above max_concurrency (speculative rounds run one at a time)"
    else:
        overlap = "on"
    mapping = getattr(llm, "mapping", None)
    parallel = mapping is not None and mapping.is_parallel
    if parallel:
        par_s = (
            f"{mapping.world_size} ranks: tp {mapping.tp_size}, moe_ep {mapping.moe_ep_size}, "
            f"moe_tp {mapping.moe_tp_size}"
        )
    else:
        par_s = "one device (no tensor or expert parallelism)"
    mgr = ex.manager
    sizes = getattr(llm, "step_sizes", None)
    loaded = f" in {load_s:.1f} s" if load_s is not None else ""
    return [
        f"model {os.fspath(model)}{loaded}: {params / 1e6:.1f}M parameters{' on rank 0' if parallel else ''}, "
        f"{dtype}, on {llm.device}, "
        f"{llm.config.num_hidden_layers} layers, vocab {llm.config.vocab_size}",
        f"parallelism: {par_s}",
        f"speculative decoding: {spec_s}",
        f"CUDA graphs: {graphs}; overlap scheduler {overlap}; batch-invariant "
        f"numerics {'on' if getattr(llm, 'batch_invariant', False) else 'off'}",
        f"KV cache: {mgr.num_pages} pages of {cfg.tokens_per_block} tokens; max_seq_len {ex.max_seq_len}, queue "
        f"{engine.max_queue_size}; prefix caching {'on' if ex.prefix is not None else 'off'}",
        "step sizes: "
        + (
            sizes.describe()
            if sizes is not None
            else f"max_batch_size {cfg.max_batch_size}, max_num_tokens {cfg.max_num_tokens}"
        ),
    ]
