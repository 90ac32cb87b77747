"""MTP acceptance with and without ``index_share_for_mtp_iteration`` on the trained ``small`` preset.

Prompts are 600-character windows of a held-out standard-library module (``textwrap``, never trained
on); greedy, 64 new tokens each. Prints the mean accepted length and the per-position acceptance for
K = 3 and 5 with sharing off and on. CPU is enough (``python -m benchmarks.bench_mtp_index_sharing``).
"""

from __future__ import annotations

import os
import sysconfig

import torch

from trtllm_glm import LLM, MTPDecodingConfig, SamplingParams


def main() -> None:
    torch.set_num_threads(1)
    path = os.path.join(sysconfig.get_paths()["stdlib"], "textwrap.py")
    with open(path, encoding="utf-8") as f:
        src = f.read()
    prompts = [src[i : i + 600] for i in range(2000, 2000 + 12 * 1500, 1500)]
    for k in (3, 5):
        for share in (False, True):
            spec = MTPDecodingConfig(adaptive=False, num_nextn_predict_layers=k, index_share_for_mtp_iteration=share)
            outs = LLM(model="small", speculative_config=spec).generate(prompts, SamplingParams(max_tokens=64))
            comps = [o.outputs[0] for o in outs]
            rounds = sum(c.num_draft_rounds for c in comps)
            mean = sum(c.mean_accepted_length * c.num_draft_rounds for c in comps) / rounds
            pos = [round(sum(c.acceptance_per_position[j] for c in comps) / len(comps), 3) for j in range(k)]
            print(f"K={k} index_share_for_mtp_iteration={share}: mean accepted length {mean:.3f}, per position {pos}")


if __name__ == "__main__":
    main()
