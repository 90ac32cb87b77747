"""index_share_for_mtp_iteration: chained MTP steps reuse step 0's pools (drafts only; output lossless)."""

from __future__ import annotations

import pytest
import torch

from trtllm_glm.attention.sparse.glm_kpool.ops import expand_selection_window
from trtllm_glm.errors import TableWidthError
from trtllm_glm.models.glm5_next import Glm5NextForCausalLM
from trtllm_glm.runtime.executor import Executor, ExecutorConfig
from trtllm_glm.runtime.sampling import SamplingParams
from trtllm_glm.runtime.speculative_executor import SpeculativeExecutor
from trtllm_glm.speculative.config import MTPDecodingConfig

pytestmark = pytest.mark.cpu_only


def test_expand_selection_window_reference() -> None:
    pools = torch.tensor([[3, 0, -1], [-1, -1, -1], [1, 2, 4]], dtype=torch.int32)
    ws = torch.tensor([16, 0, 20])
    pos = torch.tensor([22, 2, 20])
    out = expand_selection_window(pools, ws, pos, 20)
    assert out[0].tolist() == [0, 1, 2, 3, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22] + [-1] * 5
    assert out[1].tolist() == [0, 1, 2] + [-1] * 17
    assert out[2].tolist() == [4, 5, 6, 7, 8, 9, 10, 11, 16, 17, 18, 19, 20] + [-1] * 7
    with pytest.raises(ValueError, match="overlaps"):
        expand_selection_window(torch.tensor([[4]]), torch.tensor([16]), torch.tensor([18]), 10)
    with pytest.raises(TableWidthError):
        expand_selection_window(pools, ws, pos, 12)


@pytest.fixture(scope="module")
def model() -> Glm5NextForCausalLM:
    torch.manual_seed(0)
    return Glm5NextForCausalLM.from_pretrained("tiny", seed=4)


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, 256, (n,), generator=g).tolist() for n in (23, 40, 9)]


def _cfg() -> ExecutorConfig:
    return ExecutorConfig(tokens_per_block=8, max_tokens=2048, max_batch_size=4, max_seq_len=160)


@pytest.mark.parametrize("mode", ["shared", "separate"])
def test_sharing_is_lossless_and_chained_steps_reuse_step0(model, mode) -> None:
    ref = Executor(model, _cfg())
    want = [ref.add_request(p, SamplingParams(max_tokens=24, ignore_eos=True)) for p in _prompts()]
    ref.run_until_done()

    spec = MTPDecodingConfig(
        adaptive=False, num_nextn_predict_layers=4, draft_kv_mode=mode, index_share_for_mtp_iteration=True
    )
    ex = SpeculativeExecutor(model, _cfg(), spec)
    assert ex.share_mtp_selection and ex.meta.select_width == model.config.index_select_width + 4
    seen: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
    mtp_indexer = model.mtp.block.self_attn.indexer

    def hook(_m, args, out):
        meta = args[2]
        if meta.spec.shared_pool_ids is not None:
            seen.append((meta.spec.shared_pool_ids.clone(), meta.spec.shared_window_start.clone(), out.clone()))

    h = mtp_indexer.register_forward_hook(hook)
    try:
        got = [ex.add_request(p, SamplingParams(max_tokens=24, ignore_eos=True)) for p in _prompts()]
        ex.run_until_done()
    finally:
        h.remove()
    assert [g.output_ids for g in got] == [w.output_ids for w in want]
    assert seen, "no chained MTP step reused a selection"
    for pools, ws, sel in seen:
        for r in range(sel.shape[0]):
            row = [t for t in sel[r].tolist() if t >= 0]
            toks = sorted(4 * p + m for p in pools[r].tolist() if p >= 0 for m in range(4))
            n_pool = len(toks)
            assert row[:n_pool] == toks
            assert row[n_pool:] == list(range(int(ws[r]), row[-1] + 1))  # the window, up to the row's position


def test_sharing_off_runs_the_indexer(model) -> None:
    spec = MTPDecodingConfig(adaptive=False, num_nextn_predict_layers=3, index_share_for_mtp_iteration=False)
    ex = SpeculativeExecutor(model, _cfg(), spec)
    assert not ex.share_mtp_selection and ex.meta.select_width == model.config.index_select_width
    # The model config's flag is the default.
    assert not SpeculativeExecutor(
        model, _cfg(), MTPDecodingConfig(adaptive=False, num_nextn_predict_layers=3)
    ).share_mtp_selection
    # Every MTP step, chained ones included, scores pools itself: no reused selection is ever bound.
    calls = {"mtp": 0, "shared": 0}

    def hook(_m, args, _out):
        calls["mtp"] += 1
        calls["shared"] += int(args[2].spec.shared_pool_ids is not None)

    h = model.mtp.block.self_attn.indexer.register_forward_hook(hook)
    try:
        for p in _prompts():
            ex.add_request(p, SamplingParams(max_tokens=12, ignore_eos=True))
        ex.run_until_done()
    finally:
        h.remove()
    assert calls["mtp"] > 0 and calls["shared"] == 0
