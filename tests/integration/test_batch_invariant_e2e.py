"""End to end on the CPU, batch-invariant mode (issue 31): speculative greedy decoding (n-gram oracle drafts of
K = 3, some wrong, and MTP K = 3) gives the plain greedy run's logits bit for bit, a request alone gives the
same logits as inside a batch, a prefix-cache hit gives what recomputing the prompt gives, and preempted
requests recompute to the same bits, on the ``small`` preset's geometry (random weights, fp32).

The CPU path runs torch's references, with a limit the GPU kernels do not have:

* ATen's vectorised elementwise kernels compute a tensor's tail (``numel`` mod the vector width) with the scalar
  code, whose ``sigmoid`` / ``silu`` round differently: a row's bits would depend on where it sits in the tensor.
  The cases run in a subprocess with ``ATEN_CPU_CAPABILITY=default`` (ATen's generic per-lane vectors, the scalar
  functions for every element).
The whole model (sparse MLA and MTP included) and a KDA-only subset (every KDA layer of the preset, no MTP,
prefix hits and preemption) are checked.

CPU time: ~10 s (two subprocesses; each builds its model once).
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.cpu_only

ROOT = Path(__file__).resolve().parents[2]
T = 8  # generated tokens per request


def run_cases(kind: str) -> dict:
    """Plain, speculative and alone runs in the mode; per comparison, whether every logit row is bit-equal."""
    import torch

    from trtllm_glm.config import Glm5NextConfig
    from trtllm_glm.models.glm5_next import Glm5NextForCausalLM, subset_config
    from trtllm_glm.numerics import batch_invariant_mode
    from trtllm_glm.runtime.executor import Executor, ExecutorConfig
    from trtllm_glm.runtime.sampling import SamplingParams
    from trtllm_glm.runtime.speculative_executor import SpeculativeExecutor
    from trtllm_glm.speculative.config import MTPDecodingConfig, NGramDecodingConfig
    from trtllm_glm.speculative.drafters import OracleDrafter

    torch.set_num_threads(1)
    full = Glm5NextConfig.from_pretrained("small")
    if kind == "kda":
        keep = [i for i, t in enumerate(full.layer_types) if t == "kda"]
        cfg = dataclasses.replace(subset_config(full, keep), num_nextn_predict_layers=0)
    else:
        cfg = full
    model = Glm5NextForCausalLM.from_config(cfg, seed=0)
    rng = random.Random(3)
    prompts = [[rng.randrange(cfg.vocab_size) for _ in range(n)] for n in (5, 23, 40)]
    ecfg = ExecutorConfig(tokens_per_block=8, max_tokens=1024, max_batch_size=4, max_num_tokens=64, max_seq_len=128)

    def params() -> SamplingParams:
        return SamplingParams(max_tokens=T, ignore_eos=True, return_generation_logits=True)

    def same(a, b) -> bool:
        pairs = zip(a.generation_logits, b.generation_logits)
        return a.output_ids == b.output_ids and all(torch.equal(x, y) for x, y in pairs)

    out: dict[str, bool] = {}
    with batch_invariant_mode(True):
        ex = Executor(model, ecfg)
        plain = [ex.add_request(p, params()) for p in prompts]
        ex.run_until_done()
        cont = {i: r.output_ids for i, r in enumerate(plain)}
        wrong = {(i, j) for i in range(len(prompts)) for j in range(T) if rng.random() < 0.4}
        specs = {"oracle": (NGramDecodingConfig(max_draft_len=3),
                            OracleDrafter(cont, lambda i, j: (i, j) in wrong, vocab_size=cfg.vocab_size))}  # fmt: skip
        if cfg.num_nextn_predict_layers:
            specs["mtp"] = (MTPDecodingConfig(adaptive=False, num_nextn_predict_layers=3), None)
        for name, (spec, drafter) in specs.items():
            sx = SpeculativeExecutor(model, ecfg, spec, drafter=drafter)
            tests = [sx.add_request(p, params()) for p in prompts]
            while sx.has_work:
                sx.step()
            out[name] = all(same(a, b) for a, b in zip(plain, tests))
        ax = Executor(model, ecfg)
        alone = ax.add_request(prompts[1], params())
        ax.run_until_done()
        out["alone"] = same(alone, plain[1])
        # A prefix-cache hit (a checkpoint on the chunk grid) gives what recomputing the prompt gives.
        longer = prompts[2] + [rng.randrange(cfg.vocab_size) for _ in range(13)]
        px = Executor(model, dataclasses.replace(ecfg, enable_block_reuse=True, checkpoint_interval=16))
        px.add_request(prompts[2], params())
        px.run_until_done()
        hit = px.add_request(longer, params())
        px.run_until_done()
        fresh = Executor(model, ecfg)
        ref = fresh.add_request(longer, params())
        fresh.run_until_done()
        out["prefix_hit"] = hit.num_cached_tokens > 0 and same(hit, ref)
        # Preempted requests (96 cache tokens for three) recompute to the same bits.
        small = dataclasses.replace(ecfg, max_tokens=96)
        short = [p[:30] for p in prompts[1:]] + [prompts[0] * 6]
        long_params = SamplingParams(max_tokens=20, ignore_eos=True, return_generation_logits=True)
        qx = Executor(model, small)
        pre = [qx.add_request(p, long_params) for p in short]
        qx.run_until_done()
        rx = Executor(model, ecfg)
        ref = [rx.add_request(p, long_params) for p in short]
        rx.run_until_done()
        out["preempted"] = sum(r.num_preemptions for r in pre) > 0 and all(same(a, b) for a, b in zip(pre, ref))
    return out


def _subprocess(kind: str) -> dict:
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "default", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), str(Path(__file__).parent)])}  # fmt: skip
    code = f"import json, test_batch_invariant_e2e as t; print(json.dumps(t.run_cases({kind!r})))"
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


def test_kda_model_speculative_equals_plain_bit_for_bit() -> None:
    assert _subprocess("kda") == {"oracle": True, "alone": True, "prefix_hit": True, "preempted": True}


def test_whole_model_speculative_equals_plain_bit_for_bit() -> None:
    assert _subprocess("full") == {"oracle": True, "mtp": True, "alone": True, "prefix_hit": True, "preempted": True}


# --------------------------------------------------------------------------------------------------
# Collectives: the fixed-order all-reduce of a 3-rank gloo world (3: a bf16 sum of two values is rounded once
# whatever the order; of three it is not). fp32 sums of three bf16 values are mostly exact in any order, so the
# world also sums fp32 parts that cancel: [1e8, -1e8, 1] gives 1 in rank order and 0 in any order that adds the
# 1 to one of the large parts first (reversed: (1 + -1e8) + 1e8 = 0).
RANK_ORDER_PARTS = (1e8, -1e8, 1.0)


def _ordered_rank(rank: int, port: int, q) -> None:
    import torch

    from trtllm_glm.distributed.mapping import Mapping
    from trtllm_glm.distributed.process_group import init_rank, shutdown_rank
    from trtllm_glm.numerics import batch_invariant_mode

    torch.set_num_threads(1)
    try:
        comm = init_rank(Mapping.from_sizes(3, None, None, rank=rank), torch.device("cpu"), f"tcp://127.0.0.1:{port}")
        g = torch.Generator().manual_seed(rank)
        x = (torch.randn(70, 33, generator=g) * 1e3).to(torch.bfloat16)
        with batch_invariant_mode(True):
            full = comm.all_reduce(x.clone())
            rows = [comm.all_reduce(x[i : i + 1].clone()) for i in (0, 5, 69)]
            cancel = comm.all_reduce(torch.full((4, 3), RANK_ORDER_PARTS[rank], dtype=torch.float32))
        q.put((rank, full.float().tolist(), [r.float().tolist() for r in rows], comm.num_all_reduces, cancel.tolist()))
        shutdown_rank()
    except Exception as e:  # noqa: BLE001 - reported to the test
        q.put((rank, f"{type(e).__name__}: {e}", None, None, None))


def test_all_reduce_in_rank_order_for_any_message_size() -> None:
    import multiprocessing as mp

    import torch

    from trtllm_glm.distributed.process_group import free_port

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_ordered_rank, args=(r, port, q), daemon=True) for r in range(3)]
    for p in procs:
        p.start()
    got = sorted((q.get(timeout=120) for _ in procs), key=lambda v: v[0])
    for p in procs:
        p.join(30)
    assert all(v[2] is not None for v in got), got
    (_, full0, rows0, n0, c0), (_, full1, rows1, _, c1), (_, full2, rows2, _, c2) = got
    assert full0 == full1 == full2 and rows0 == rows1 == rows2 and n0 == 5
    # Parts that cancel: only the sum in rank order keeps the 1 (every rank gets it).
    assert c0 == c1 == c2 == [[1.0] * 3] * 4, (c0, c1, c2)
    # The sum in rank order, in fp32, rounded once; one row alone gets that row's bits.
    xs = [(torch.randn(70, 33, generator=torch.Generator().manual_seed(r)) * 1e3).to(torch.bfloat16) for r in (0, 1, 2)]
    want = (xs[0].float() + xs[1].float() + xs[2].float()).to(torch.bfloat16).float()
    assert torch.equal(torch.tensor(full0), want)
    for i, row in zip((0, 5, 69), rows0):
        assert torch.equal(torch.tensor(row), want[i : i + 1])
