"""Where the host waits for the GPU during a decode step: every synchronising call, by source line.

Runs a few steady-state decode steps of the executor under ``torch.cuda.set_sync_debug_mode("warn")``
(torch then warns at every call that synchronises the host with the device: ``.item()``, ``.tolist()``,
``.cpu()``, ``torch.tensor(list, device=cuda)`` from pageable memory, blocking copies, ...) and reports,
per mode, the syncs per step and the project source line (``trtllm_glm/...``) that caused each.

Usage (GPU): ``python -m benchmarks.sync_sites --preset small --modes plain mtp3 ngram7 --batch 4
--cuda-graphs``; the trained ``small`` preset's weights are used when it ships them.
"""

from __future__ import annotations

import argparse
import json

import torch

from benchmarks.harness.host_syncs import sync_sites
from benchmarks.harness.rows import write_json
from trtllm_glm.models.glm5_next import Glm5NextForCausalLM
from trtllm_glm.runtime.cuda_graph import CudaGraphConfig, default_batch_sizes
from trtllm_glm.runtime.executor import Executor, ExecutorConfig
from trtllm_glm.runtime.sampling import SamplingParams
from trtllm_glm.runtime.speculative_executor import SpeculativeExecutor
from trtllm_glm.speculative.config import MTPDecodingConfig, NGramDecodingConfig


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--modes", nargs="+", default=["plain", "mtp3", "ngram7"], help="plain, mtpK, mtpK+k0, ngramK")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--cuda-graphs", action="store_true")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("sync_sites needs CUDA (host syncs do not exist on the CPU)")
    model = Glm5NextForCausalLM.from_pretrained(args.preset, dtype=args.dtype, device="cuda").eval()
    rows = []
    for mode in args.modes:
        B = args.batch
        gcfg = CudaGraphConfig(batch_sizes=default_batch_sizes(B), enable_padding=True) if args.cuda_graphs else None
        cfg = ExecutorConfig(tokens_per_block=64, max_tokens=B * 1024, max_batch_size=B, max_num_tokens=2048,
                             max_seq_len=900, cuda_graph_config=gcfg)  # fmt: skip
        if mode == "plain":
            ex = Executor(model, cfg)
        elif mode.startswith("mtp"):
            # mtpK+k0: the batch above max_concurrency, every round width one (an adaptive choice of K = 0).
            name, *flags = mode.split("+")
            mc = 1 if flags == ["k0"] else None
            spec = MTPDecodingConfig(adaptive=False, num_nextn_predict_layers=int(name[3:]), max_concurrency=mc)
            ex = SpeculativeExecutor(model, cfg, spec)
        else:
            ex = SpeculativeExecutor(model, cfg, NGramDecodingConfig(max_draft_len=int(mode[5:])))
        ex.capture_cuda_graphs()
        g = torch.Generator().manual_seed(0)
        for _ in range(B):
            prompt = torch.randint(0, model.config.vocab_size, (300,), generator=g).tolist()
            ex.add_request(prompt, SamplingParams(max_tokens=200, ignore_eos=True))
        for _ in range(6):  # prefill and warm-up
            ex.step()
        per_step, sites = sync_sites(ex.step, args.steps)
        row = {"mode": mode, "batch": B, "graphs": args.cuda_graphs, "syncs_per_step": per_step,
               "sites": {k: v / args.steps for k, v in sites.most_common()}}  # fmt: skip
        rows.append(row)
        print(json.dumps(row, indent=1), flush=True)
    if args.json:
        write_json(args.json, rows)


if __name__ == "__main__":
    main()
