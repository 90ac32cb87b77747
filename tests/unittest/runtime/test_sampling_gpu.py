"""The sampler on CUDA logits: no host sync, and a seed gives the CPU's draw.

Needs CUDA (tests/conftest.py skips ``gpu`` tests without it).
"""

from __future__ import annotations

import pytest
import torch

from trtllm_glm.runtime.sampling import Sampler, SamplingParams, make_generator

pytestmark = pytest.mark.gpu

V = 154880  # the real vocabulary


def test_sampling_needs_no_host_sync_and_matches_the_cpu() -> None:
    # A greedy row between sampled ones; plain temperature, top-p and top-k.
    params = [
        SamplingParams(temperature=1.0, seed=1),
        SamplingParams(),
        SamplingParams(temperature=0.7, top_p=0.9, seed=2),
        SamplingParams(temperature=1.2, top_k=40, seed=3),
    ]
    logits = torch.randn(len(params), V, generator=torch.Generator().manual_seed(0)) * 3
    dev = logits.cuda()
    s = Sampler()
    for _ in range(2):  # warm-up: first-use allocations (pinned staging) are not what is checked
        s.sample(dev, params, [make_generator(p) for p in params])
    torch.cuda.synchronize()
    cpu_gens = [make_generator(p) for p in params]
    gpu_gens = [make_generator(p) for p in params]
    want, got = [], []
    torch.cuda.set_sync_debug_mode("error")
    try:
        for step in range(8):
            got.append(s.sample(dev + 0.05 * step, params, gpu_gens))
    finally:
        torch.cuda.set_sync_debug_mode(0)
    for step in range(8):
        want.append(s.sample(logits + 0.05 * step, params, cpu_gens))
    # The same uniform per row on both devices: the same token unless it fell within rounding of a boundary.
    assert [g.tolist() for g in got] == [w.tolist() for w in want]
