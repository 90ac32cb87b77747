"""All-reduce of one decode step's hidden state: eager NCCL, NCCL captured in a CUDA graph, and torch's symmetric
memory one-shot all-reduce (eager and captured) where this torch has it (docs/parallelism.md, "Collectives").

Batch 1 of the real model is ``[1, 4096]`` bf16 = 8 KB per all-reduce, two per layer (attention, FFN): at 45
layers that is 90 collectives a step, so their fixed latency, not bandwidth, is what decode pays. Each timing is
the mean of ``--iters`` calls after warm-up; the captured variants put ``--iters`` collectives in one graph and
time its replay (launch cost amortised, as in the executor's decode graphs).

Run on one GPU (world of 1: measures the call and launch overhead of the path) or with torchrun on several:

    python -m benchmarks.bench_allreduce
    NCCL_NVLS_ENABLE=0 torchrun --nproc_per_node 2 -m benchmarks.bench_allreduce

NVLink multicast stays off (``NCCL_NVLS_ENABLE=0``; no ``multimem`` symmetric-memory variant is timed). Prints one
JSON line per (variant, size).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os

import torch
import torch.distributed as dist

from benchmarks.harness.timing import loop_us


def _graph_of(fn, iters: int) -> torch.cuda.CUDAGraph:
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(iters):
            fn()
    return g


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[4096, 16 * 4096, 64 * 4096], help="bf16 elements")
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=20)
    args = ap.parse_args()
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    local = int(os.environ.get("LOCAL_RANK", rank))
    dev = torch.device("cuda", local)
    torch.cuda.set_device(dev)
    if world == 1 and "MASTER_ADDR" not in os.environ:
        from trtllm_glm.distributed.process_group import free_port

        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1")
    dist.init_process_group("nccl", device_id=dev, timeout=datetime.timedelta(seconds=120))
    group_name = dist.group.WORLD.group_name
    rows = []

    symm = None
    try:
        import torch.distributed._symmetric_memory as symm_mem

        if hasattr(symm_mem, "enable_symm_mem_for_group"):
            symm_mem.enable_symm_mem_for_group(group_name)
        symm = symm_mem
    except Exception as e:  # noqa: BLE001 - reported as a row
        rows.append({"variant": "symm_mem", "error": f"{type(e).__name__}: {e}"})

    for n in args.sizes:
        torch.manual_seed(n)  # the same input on every rank: the one-shot result is checked below
        x = torch.randn(n, device=dev, dtype=torch.bfloat16)
        y = x.clone()
        nbytes = n * 2

        def nccl(y: torch.Tensor = y) -> None:
            dist.all_reduce(y)

        for _ in range(args.warmup):
            nccl()
        rows.append({"variant": "nccl_eager", "bytes": nbytes, "us": loop_us(nccl, args.iters)})
        g = _graph_of(nccl, args.iters)
        rows.append({"variant": "nccl_graph", "bytes": nbytes, "us": loop_us(g.replay, 1) / args.iters})
        if symm is not None:
            try:
                buf = symm.empty(n, device=dev, dtype=torch.bfloat16)
                symm.rendezvous(buf, group_name)
                buf.copy_(x)
                out = torch.empty_like(buf)

                def one_shot(buf: torch.Tensor = buf, out: torch.Tensor = out) -> None:
                    torch.ops.symm_mem.one_shot_all_reduce_out(buf, "sum", group_name, out)

                for _ in range(args.warmup):
                    one_shot()
                rows.append({"variant": "symm_one_shot_eager", "bytes": nbytes, "us": loop_us(one_shot, args.iters)})
                g2 = _graph_of(one_shot, args.iters)
                rows.append(
                    {"variant": "symm_one_shot_graph", "bytes": nbytes, "us": loop_us(g2.replay, 1) / args.iters}
                )
                torch.testing.assert_close(out.float(), buf.float() * world, rtol=1e-2, atol=1e-2)
            except Exception as e:  # noqa: BLE001 - reported as a row
                rows.append({"variant": "symm_one_shot", "bytes": nbytes, "error": f"{type(e).__name__}: {e}"})
    if rank == 0:
        for r in rows:
            print(json.dumps({"world": world, **r}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
