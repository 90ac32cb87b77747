"""Chunked prefill is lossless: a prompt prefilled in chunks of any size gives the one-pass prompt's next-token
logits (and context logits) on the ``small`` preset in fp32.

The prompt (300 tokens) is longer than the indexer's selection (``index_topk`` = 64 tokens: 16 pools), so top-k
drops pools; chunk sizes 7 and 50 end chunks inside a pool (pools are 4 tokens) and inside a page, 128 ends them
on page boundaries. Chunks of 50 pad the score width to a power of two as CUDA does
(`GlmKpoolMetadata.score_columns`): larger than the exact pool count for most chunks, which must not change the
selection.
"""

from __future__ import annotations

import pytest
import torch

from trtllm_glm.config import Glm5NextConfig
from trtllm_glm.models.glm5_next import Glm5NextForCausalLM
from trtllm_glm.runtime.llm import LLM, KvCacheConfig
from trtllm_glm.runtime.sampling import SamplingParams

pytestmark = pytest.mark.cpu_only

PROMPT = 300


@pytest.fixture(scope="module")
def model() -> Glm5NextForCausalLM:
    cfg = Glm5NextConfig.from_pretrained("small")
    return Glm5NextForCausalLM.from_config(cfg, seed=3, dtype="float32", device="cpu")


def _logits(
    model: Glm5NextForCausalLM, ids: list[int], chunk: int, pow2_scores: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    llm = LLM(model, max_seq_len=PROMPT + 8, max_num_tokens=chunk, max_batch_size=1, cuda_graph_config=None,
              kv_cache_config=KvCacheConfig(tokens_per_block=16, enable_block_reuse=False))  # fmt: skip
    llm.executor.meta.round_score_columns = pow2_scores
    try:
        sp = SamplingParams(max_tokens=2, temperature=0.0, return_context_logits=True, return_generation_logits=True)
        out = llm.generate(ids, sp)
    finally:
        llm.shutdown()
    return out.context_logits, out.outputs[0].generation_logits


def test_chunked_prefill_equals_one_pass(model: Glm5NextForCausalLM) -> None:
    cfg = model.config
    assert cfg.index_topk < PROMPT, "the prompt must outgrow the selection (pools dropped by top-k)"
    ids = torch.randint(0, cfg.vocab_size, (PROMPT,), generator=torch.Generator().manual_seed(9)).tolist()
    ctx_ref, gen_ref = _logits(model, ids, PROMPT)
    assert ctx_ref.shape == (PROMPT, cfg.vocab_size) and gen_ref.shape[0] == 2
    scale = gen_ref.abs().max().item()
    for chunk, pow2 in ((7, False), (50, True), (128, False)):
        ctx, gen = _logits(model, ids, chunk, pow2)
        torch.testing.assert_close(gen, gen_ref, rtol=1e-4, atol=1e-4 * scale, msg=f"chunk {chunk}")
        torch.testing.assert_close(ctx, ctx_ref, rtol=1e-4, atol=1e-4 * scale, msg=f"chunk {chunk}")
