"""Served end to end (CPU, fp32, the ``small`` preset's whole model: KDA, sparse MLA, MoE, mHC): requests admitted
while others decode make mixed steps whose KDA decode rows ride the short prefills' verify grid
(`TRTLLM_GLM_KDA_DECODE_RIDE`, short prefills on as on CUDA). The tokens and logits equal those of the run with the
decode rows on their own path: the torch references compute a riding decode row as the decode step does.

CPU time: ~3 s.
"""

from __future__ import annotations

import random

import pytest
import torch

from trtllm_glm.config import Glm5NextConfig
from trtllm_glm.kda import KimiDeltaAttention
from trtllm_glm.models.glm5_next import Glm5NextForCausalLM
from trtllm_glm.runtime.executor import Executor, ExecutorConfig
from trtllm_glm.runtime.sampling import SamplingParams

pytestmark = pytest.mark.cpu_only


def _serve(model: Glm5NextForCausalLM, vocab: int) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Three requests decoding, then arrivals of 1, 9, 30 and 70 tokens (the last over the short limit: chunked)
    one or two at a time; greedy outputs and logits of every request."""
    rng = random.Random(5)
    ecfg = ExecutorConfig(tokens_per_block=8, max_tokens=2048, max_batch_size=8, max_num_tokens=256, max_seq_len=160)
    ex = Executor(model, ecfg)

    def params() -> SamplingParams:
        return SamplingParams(max_tokens=6, ignore_eos=True, return_generation_logits=True)

    reqs = [ex.add_request([rng.randrange(vocab) for _ in range(n)], params()) for n in (7, 12, 3)]
    for _ in range(2):
        ex.step()
    for arrivals in ((1,), (9, 30), (70,), (2, 5)):
        reqs += [ex.add_request([rng.randrange(vocab) for _ in range(n)], params()) for n in arrivals]
        ex.step()
    ex.run_until_done()
    return [r.output_ids for r in reqs], [torch.stack(list(r.generation_logits)) for r in reqs]


def test_served_mixed_steps_same_tokens_and_logits_with_riding_decode_rows(monkeypatch) -> None:
    torch.set_num_threads(1)
    monkeypatch.setenv("TRTLLM_GLM_KDA_SHORT_PREFILL", "64")
    cfg = Glm5NextConfig.from_pretrained("small")
    model = Glm5NextForCausalLM.from_config(cfg, seed=0)
    calls = {"_decode": 0, "_short_prefill": 0}
    for name in calls:
        orig = getattr(KimiDeltaAttention, name)

        def spy(self, *a, _o=orig, _n=name):  # noqa: ANN001, ANN202
            calls[_n] += 1
            return _o(self, *a)

        monkeypatch.setattr(KimiDeltaAttention, name, spy)
    monkeypatch.setenv("TRTLLM_GLM_KDA_DECODE_RIDE", "0")
    ids_off, logits_off = _serve(model, cfg.vocab_size)
    off = dict(calls)
    calls.update(_decode=0, _short_prefill=0)
    monkeypatch.setenv("TRTLLM_GLM_KDA_DECODE_RIDE", "512")
    ids_on, logits_on = _serve(model, cfg.vocab_size)
    # Mixed steps ran the decode path without the ride and not with it (plain decode steps take it either way).
    assert off["_short_prefill"] == calls["_short_prefill"] > 0 and calls["_decode"] < off["_decode"]
    assert ids_on == ids_off
    for a, b in zip(logits_on, logits_off):
        assert torch.equal(a, b)
