"""`OracleAcceptanceDrafter` (bench_e2e's ``mtporacle`` modes): the MTP layer drafts, the oracle's tokens are
proposed, eagerly and with the drafts left on the device by the fused MTP graph (emulated on the CPU)."""

from __future__ import annotations

import dataclasses

import pytest

from tests.spec_helpers import emulate_graphs
from trtllm_glm.models.glm5_next import Glm5NextForCausalLM
from trtllm_glm.runtime.cuda_graph import CudaGraphConfig
from trtllm_glm.runtime.executor import Executor, ExecutorConfig
from trtllm_glm.runtime.sampling import SamplingParams
from trtllm_glm.runtime.speculative_executor import SpeculativeExecutor
from trtllm_glm.speculative.config import MTPDecodingConfig
from trtllm_glm.speculative.drafters import OracleAcceptanceDrafter, OracleDrafter

pytestmark = pytest.mark.cpu_only

PROMPTS = [[5, 9, 2, 7, 5, 9, 2, 7, 5, 9, 2], [3, 1, 4, 1, 5, 9, 2, 6, 5], [8, 8, 1, 2, 3, 8, 8, 1]]
MAX_TOKENS = 12


def run(ex: Executor) -> list[list[int]]:
    reqs = [ex.add_request(p, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)) for p in PROMPTS]
    ex.run_until_done()
    return reqs


@pytest.mark.parametrize("graphs", [False, True])
def test_oracle_tokens_replace_mtp_drafts(monkeypatch, graphs: bool) -> None:
    model = Glm5NextForCausalLM.from_pretrained("tiny", layers=[0, 3], dtype="float32").eval()
    cfg = ExecutorConfig(tokens_per_block=8, max_tokens=1024, max_batch_size=4, max_num_tokens=64, max_seq_len=96)
    ref = run(Executor(model, cfg))
    if graphs:
        # The emulating runner (tests/unittest/runtime/test_cuda_graph.py's `emulated`): the fused MTP draft leaves its
        # drafts on the device (`DeviceDrafts`), which the wrapper replaces there.
        emulate_graphs(monkeypatch)
        cfg = dataclasses.replace(cfg, cuda_graph_config=CudaGraphConfig(batch_sizes=[1, 4], enable_padding=True))
    ex = SpeculativeExecutor(model, cfg, MTPDecodingConfig(num_nextn_predict_layers=3, adaptive=False))
    oracle = OracleDrafter({i: list(r.output_ids) for i, r in enumerate(ref)}, lambda i, j: j % 4 == 3)
    inner = ex.drafter
    calls = {"mtp": 0, "pending": 0}
    orig = model.mtp_forward

    def counted(*a, **k):
        calls["mtp"] += 1
        return orig(*a, **k)

    monkeypatch.setattr(model, "mtp_forward", counted)
    wrapper = OracleAcceptanceDrafter(inner, oracle, model.config.vocab_size)
    draft = wrapper.draft

    def spy(seqs, hidden):
        draft(seqs, hidden)
        calls["pending"] += sum(1 for s in seqs if s.live and s.state.pending is not None)

    wrapper.draft = spy
    ex.drafter = wrapper
    got = run(ex)
    assert [r.output_ids for r in got] == [r.output_ids for r in ref]
    assert calls["mtp"] > 0  # the MTP layer drafted every round (its cost is what the benchmark times)
    # Output position 3, 7, 11 is corrupted: a round starting at output j accepts up to the next such position.
    assert sum(r.num_accepted_total for r in got) / sum(r.num_verify_rounds for r in got) > 2.0
    if graphs:
        assert inner.chain_graphs is not None and inner.chain_graphs.draft_replays > 0 and calls["pending"] > 0
        assert wrapper.chain_graphs is inner.chain_graphs  # reached through the wrapper
    else:
        assert calls["pending"] == 0
