"""The cases of tests/integration/test_parallel.py, run by every rank of a 2-process gloo world (as under
torchrun: ``RANK`` / ``WORLD_SIZE`` / ``MASTER_*`` set, one `LLM` per case in each process) and by the test
process alone at world size 1 (the reference)."""

from __future__ import annotations

import os
import traceback
from typing import Any

PROMPTS = ["def fib(n):\n    if n < 2:\n        return n\n", "import os\nimport sys\n", "class Foo:\n    def"]
# Long enough (> 2 pages of 16 tokens) for a prefix checkpoint; the second turn extends it.
PREFIX = PROMPTS[0] * 3


def cases(ckpt_dir: str) -> list[tuple[str, str, dict[str, Any]]]:
    """``(name, model, LLM keyword arguments without the parallel sizes)``; the parallel sizes are `LAYOUTS`."""
    from trtllm_glm import KvCacheConfig, MTPDecodingConfig, NGramDecodingConfig

    return [
        ("plain", "small", {}),
        ("mtp3_shared", "small", {"speculative_config": MTPDecodingConfig(adaptive=False, num_nextn_predict_layers=3)}),
        (
            "mtp3_separate",
            "small",
            {
                "speculative_config": MTPDecodingConfig(
                    adaptive=False, num_nextn_predict_layers=3, draft_kv_mode="separate"
                )
            },
        ),
        ("ngram", "small", {"speculative_config": NGramDecodingConfig(max_draft_len=3)}),
        # 96 cache tokens for three growing requests: the newest are preempted and recomputed.
        ("preempt", "small", {"kv_cache_config": KvCacheConfig(tokens_per_block=8, max_tokens=96)}),
        ("real_layout", os.path.join(ckpt_dir, "real"), {}),
        # Block-FP8 (32-wide tiles): weights and scales cut on tiles stay FP8 on each rank; KDA's b_proj (4 rows,
        # 2 per rank) is cut inside a tile and held dequantised.
        ("fp8_layout", os.path.join(ckpt_dir, "fp8"), {}),
    ]


# Which parallel sizes each case runs under (all three layouts appear; the cases stay few).
LAYOUTS = {
    "plain": {"tensor_parallel_size": 2},
    "mtp3_shared": {"tensor_parallel_size": 2, "moe_expert_parallel_size": 2},
    "mtp3_separate": {"moe_expert_parallel_size": 2},
    "ngram": {"tensor_parallel_size": 2, "moe_expert_parallel_size": 2},
    "preempt": {"tensor_parallel_size": 2},
    "real_layout": {"tensor_parallel_size": 2, "moe_expert_parallel_size": 2},
    "fp8_layout": {"tensor_parallel_size": 2, "moe_expert_parallel_size": 2},
}


def run_case(model: str, kw: dict[str, Any], parallel: dict[str, Any]) -> dict[str, Any]:
    """Greedy tokens (and gaps) of `PROMPTS`, then (unless the cache is too small for it, ``preempt``) the
    prefix-cache hit of a second turn."""
    import torch

    from trtllm_glm import LLM, SamplingParams

    sp = SamplingParams(max_tokens=20)
    llm = LLM(model, device="cpu", max_batch_size=4, max_seq_len=512, **kw, **parallel)
    try:
        outs = llm.generate(PROMPTS, sp)
        turns = [] if "kv_cache_config" in kw else [PREFIX, PREFIX + "    x = 1\n"]
        outs += [llm.generate(t, sp) for t in turns]
        return {
            "tokens": [o.outputs[0].token_ids for o in outs],
            "gaps": [o.outputs[0].logit_gaps for o in outs],
            "cached": outs[-1].num_cached_tokens if turns else None,
            "preemptions": llm.executor.num_preemptions,
            "rank": llm.mapping.rank,
            "kda_heads": llm.model.config.kda_num_heads,
            "local_experts": next(len(m.experts) for m in llm.model.modules() if hasattr(m, "expert_start")),
            "all_reduces": llm.comm.num_all_reduces,
            "fp8_params": sum(p.dtype == torch.float8_e4m3fn for p in llm.model.parameters()),
            "fp8_b_proj": sum(
                p.dtype == torch.float8_e4m3fn for n, p in llm.model.named_parameters() if n.split(".")[-2] == "b_proj"
            ),
        }
    finally:
        llm.shutdown()


def rank_main(rank: int, world: int, port: int, ckpt_dir: str, queue: Any) -> None:
    """One rank of the torchrun-style world: the process group first (kept across the cases), then each case."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), OMP_NUM_THREADS="1")  # fmt: skip
    import datetime

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120))
    try:
        for name, model, kw in cases(ckpt_dir):
            queue.put((rank, name, run_case(model, kw, LAYOUTS[name])))
    except BaseException as e:  # noqa: BLE001 - reported to the test
        queue.put((rank, "error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
    finally:
        dist.destroy_process_group()
