"""Structured output on CUDA (``pytest -m gpu tests/unittest/runtime/test_grammar_gpu.py``): CUDA graphs captured, the
overlap scheduler on, batch-invariant numerics. A batch mixing free requests, grammar requests and grammar requests
that think first gives valid output and the same tokens with MTP and n-gram speculation as without (the plain run
launches steps with grammar requests ahead, choosing their tokens one step late; the speculative ones do not);
speculation did run on the grammar requests (drafts verified and accepted under their masks) and graphs were
replayed."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("llguidance")

from trtllm_glm import LLM, MTPDecodingConfig, NGramDecodingConfig  # noqa: E402
from trtllm_glm.runtime.grammar import GuidedDecodingParams  # noqa: E402
from trtllm_glm.runtime.sampling import SamplingParams  # noqa: E402

from .test_grammar import PROMPTS, SCHEMA, _valid  # noqa: E402

pytestmark = pytest.mark.gpu


def test_gpu_graphs_overlap_and_speculation_under_grammars() -> None:
    prompts = [PROMPTS[i % len(PROMPTS)] + ("<think>" if i % 4 == 3 else "") for i in range(8)]
    plain = GuidedDecodingParams(json=SCHEMA)
    think = GuidedDecodingParams(json=SCHEMA, reasoning="inside", max_reasoning_tokens=12)
    # Requests 1, 5: JSON; 3, 7: thinking (12 tokens at most) then JSON; even ones free.
    params = [SamplingParams(max_tokens=180, guided_decoding=(think if i % 4 == 3 else plain)) if i % 2
              else SamplingParams(max_tokens=160) for i in range(8)]  # fmt: skip
    got = {}
    for name, spec in (("plain", None), ("mtp", MTPDecodingConfig(num_nextn_predict_layers=3, adaptive=False)),
                       ("ngram", NGramDecodingConfig(max_draft_len=4))):  # fmt: skip
        llm = LLM("small", device="cuda", max_batch_size=8, max_seq_len=512, batch_invariant=True,
                  speculative_config=spec)  # fmt: skip
        outs = [o.outputs[0] for o in llm.generate(prompts, params)]
        for i, o in enumerate(outs):
            if i % 2:
                answer = o.text.partition("</think>")[2] if i % 4 == 3 else o.text
                assert o.finish_reason == "stop" and _valid(json.loads(answer), SCHEMA), (name, i, o.text)
            if name == "mtp" and i % 2:  # MTP drafts every round: each grammar request verified some
                assert o.num_draft_rounds > 0, (name, i)
        if spec is not None:  # drafts verified and some accepted under the grammars' masks
            assert sum(o.mean_accepted_length * o.num_draft_rounds - o.num_draft_rounds
                       for i, o in enumerate(outs) if i % 2) > 0, name  # fmt: skip
        got[name] = [o.token_ids for o in outs]
        stats = llm.executor.graph_runner.stats if llm.executor.graph_runner is not None else None
        # An n-gram verify step carrying a grammar request's drafts runs eagerly (its masks are made on the host
        # from the drafts), which is every verify step of this batch: its replays are the width-one steps
        # launched ahead (``device_row_replays``). The H100 run of 2026-12-06 saw 0 / 5 there.
        assert stats is not None and stats.replays + (stats.device_row_replays if name == "ngram" else 0) > 0
        if spec is None:  # steps with grammar requests launched ahead, their tokens chosen one step late
            assert llm.executor.num_overlapped_steps > 0
        llm.shutdown()
    assert got["mtp"] == got["plain"] and got["ngram"] == got["plain"]
