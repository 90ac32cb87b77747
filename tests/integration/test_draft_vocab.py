"""The restricted MTP draft vocabulary (`speculative.draft_vocab`, ``MTPDecodingConfig.draft_vocab_size``):
the subset head against its masked full-head reference, the drafts it proposes (inside the subset, not always
the full head's), lossless output in mixed batches eagerly and through the (emulated) MTP graphs, the small
preset's shipped ranking, and the configurations it refuses."""

from __future__ import annotations

import json
import random

import pytest
import torch
from torch import nn

from tests.spec_helpers import assert_lossless, emulate_graphs
from trtllm_glm.models.glm5_next import Glm5NextForCausalLM
from trtllm_glm.modules.linear import Fp8Linear
from trtllm_glm.runtime.cuda_graph import CudaGraphConfig
from trtllm_glm.runtime.executor import Executor, ExecutorConfig
from trtllm_glm.runtime.sampling import SamplingParams
from trtllm_glm.runtime.speculative_executor import SpeculativeExecutor
from trtllm_glm.speculative.config import MTPDecodingConfig
from trtllm_glm.speculative.draft_vocab import (
    TOKEN_FREQUENCY_FILE,
    DraftVocab,
    greedy_reference,
    load_token_ranking,
    resolve_draft_vocab,
    subset_ids,
)

pytestmark = pytest.mark.cpu_only

MAX_TOKENS = 16


@pytest.fixture(scope="module")
def model() -> Glm5NextForCausalLM:
    return Glm5NextForCausalLM.from_pretrained("tiny", seed=0, dtype="float32").eval()


def write_ranking(path, ids: list[int]) -> str:
    f = path / TOKEN_FREQUENCY_FILE
    f.write_text(json.dumps({"ranking": ids}))
    return str(f)


def ranking(seed: int, vocab: int = 264) -> list[int]:
    ids = list(range(vocab))
    random.Random(seed).shuffle(ids)
    return ids


# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fp8", [False, True])
def test_subset_head_matches_masked_reference(fp8: bool) -> None:
    torch.manual_seed(0)
    head = nn.Linear(64, 300, bias=False)
    if fp8:
        head = Fp8Linear.from_linear(head, block=32)
    ids = sorted(random.Random(1).sample(range(300), 57))
    dv = DraftVocab(head, ids, torch.float32)
    assert dv.weight.shape == (57, 64) and dv.size == 57
    h = torch.randn(40, 64)
    got = dv.greedy(h)
    assert torch.equal(got, greedy_reference(head, ids, h))
    assert set(got.tolist()) <= set(ids)
    # The subset changes the argmax of some rows (else this test could not tell the two heads apart).
    full = greedy_reference(head, list(range(300)), h)
    assert not torch.equal(got, full)


def test_ranking_file_and_subset_errors(tmp_path) -> None:
    assert load_token_ranking(write_ranking(tmp_path, [5, 3, 9])) == [5, 3, 9]
    assert subset_ids([9, 5, 3, 700], 3, 264) == [3, 5, 9]  # ascending; ids past the vocabulary skipped
    for bad in ([], [1, 1], [1, -2], [1, 2.0], "x"):
        (tmp_path / "bad.json").write_text(json.dumps({"ranking": bad}))
        with pytest.raises(ValueError, match="ranking"):
            load_token_ranking(tmp_path / "bad.json")
    with pytest.raises(ValueError, match="cannot read"):
        load_token_ranking(tmp_path / "missing.json")
    with pytest.raises(ValueError, match=r"draft_vocab_size must be in \[1, 264\]"):
        subset_ids(list(range(264)), 265, 264)
    with pytest.raises(ValueError, match="holds only 3 ids"):
        subset_ids([1, 2, 3], 4, 264)


def test_bad_configs_refused(model, tmp_path) -> None:
    for bad in (0, -3, 2.5, True, "64"):
        with pytest.raises(ValueError, match="draft_vocab_size"):
            MTPDecodingConfig(adaptive=False, draft_vocab_size=bad)
    with pytest.raises(ValueError, match="set draft_vocab_size too"):
        MTPDecodingConfig(adaptive=False, draft_vocab_file="freq.json")
    with pytest.raises(ValueError, match="draft_vocab_file"):
        MTPDecodingConfig(adaptive=False, draft_vocab_size=8, draft_vocab_file="")
    cfg = ExecutorConfig(tokens_per_block=8, max_tokens=256, max_batch_size=2, max_num_tokens=32, max_seq_len=64)
    # The tiny preset is built from a seed: no ranking ships with it.
    with pytest.raises(ValueError, match="needs a token-frequency ranking"):
        SpeculativeExecutor(model, cfg, MTPDecodingConfig(adaptive=False, draft_vocab_size=32))
    f = write_ranking(tmp_path, ranking(0))
    with pytest.raises(ValueError, match=r"must be in \[1, 264\]"):
        SpeculativeExecutor(model, cfg, MTPDecodingConfig(adaptive=False, draft_vocab_size=300, draft_vocab_file=f))
    # The whole vocabulary is the full head (no copy).
    ex = SpeculativeExecutor(model, cfg, MTPDecodingConfig(adaptive=False, draft_vocab_size=264, draft_vocab_file=f))
    assert ex.draft_vocab is None and ex.drafter.draft_vocab is None


def test_small_preset_ships_a_ranking() -> None:
    """The small preset's ranking (`scripts/token_frequency.py`) covers its vocabulary; its most frequent
    tokens are the space and the newline, as in any Python source."""
    small = Glm5NextForCausalLM.from_pretrained("small")
    assert small.checkpoint_dir is not None
    dv = resolve_draft_vocab(small.lm_head, small.config.vocab_size, 32, None, small.checkpoint_dir, torch.float32)
    assert dv is not None and dv.size == 32
    ids = dv.ids.tolist()
    assert ord(" ") in ids and ord("\n") in ids and ord("e") in ids and 0 not in ids


# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("source", "subset"), [("float", False), ("float", True), ("fp8", False), ("fp8", True)])
def test_fp8_draft_head_matches_reference(source: str, subset: bool) -> None:
    """``draft_head_fp8``: the head's rows (all, or a subset's) as block-FP8 codes read by the FP8 linear; the argmax
    is the reference's over the same rounded rows, and the rounding moves some drafts off the float head's."""
    torch.manual_seed(1)
    head = nn.Linear(256, 600, bias=False)
    head.weight.data.mul_(4.0)
    if source == "fp8":
        head = Fp8Linear.from_linear(head, block=32)
    ids = sorted(random.Random(2).sample(range(600), 300)) if subset else None
    dv = DraftVocab(head, ids, torch.float32, fp8=True)
    assert dv.fp8 and dv.weight.dtype == torch.float8_e4m3fn and dv.size == (300 if subset else 600)
    # A model head that is FP8 already is reused whole (no copy); any other is quantised over its own 128-tiles.
    assert (dv.weight is head.weight) == (source == "fp8" and not subset)
    h = torch.randn(512, 256)
    got = dv.greedy(h)
    assert torch.equal(got, greedy_reference(head, ids, h, fp8=True))
    if source == "float":
        assert not torch.equal(got, greedy_reference(head, ids, h))  # the copy's rounding shows in some drafts
    with pytest.raises(ValueError, match="full vocabulary"):
        DraftVocab(head, None, torch.float32)


def test_fp8_draft_head_through_the_executor(model) -> None:
    """``MTPDecodingConfig(draft_head_fp8=True)`` without a draft vocabulary: the drafter scores the full vocabulary
    through an FP8 copy of the head; greedy output stays plain greedy."""
    ps = prompts(4, 21)
    refs = plain_reference(model, ps)
    cfg = ExecutorConfig(tokens_per_block=8, max_tokens=1024, max_batch_size=4, max_num_tokens=64, max_seq_len=128)
    spec = MTPDecodingConfig(adaptive=False, num_nextn_predict_layers=3, draft_head_fp8=True)
    seen: list[list[int]] = []
    tests, ex = run_mtp(model, ps, cfg, spec, seen.append)
    assert ex.draft_vocab is not None and ex.draft_vocab.fp8 and ex.draft_vocab.ids is None
    assert ex.draft_vocab.size == model.config.vocab_size
    assert_lossless(refs, tests)
    assert seen
    with pytest.raises(ValueError, match="draft_head_fp8"):
        MTPDecodingConfig(draft_head_fp8="yes")


def plain_reference(model, ps, max_tokens=MAX_TOKENS):
    ex = Executor(model, ExecutorConfig(tokens_per_block=16, max_tokens=2048, max_batch_size=8, max_num_tokens=512,
                                        max_seq_len=128))  # fmt: skip
    reqs = [ex.add_request(p, SamplingParams(max_tokens=max_tokens, ignore_eos=True)) for p in ps]
    ex.run_until_done()
    return reqs


def run_mtp(model, ps, cfg, spec, on_draft=None, sampled=()):
    ex = SpeculativeExecutor(model, cfg, spec)
    if on_draft is not None:
        orig = ex.drafter.draft

        def spy(seqs, hidden, _orig=orig):
            _orig(seqs, hidden)
            for s in seqs:
                if s.live and s.want:
                    on_draft(s.state.resolve()[: s.want])

        ex.drafter.draft = spy
    reqs = []
    for i, p in enumerate(ps):
        sp = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
        if i in sampled:  # never drafted for: a mixed batch's verify filler
            sp = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, temperature=0.9, seed=i)
        reqs.append(ex.add_request(p, sp))
    ex.run_until_done()
    return reqs, ex


def prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(256) for _ in range(rng.randrange(2, 40))] for _ in range(n)]


@pytest.mark.parametrize(("k", "mode", "size"), [(1, "shared", 8), (3, "separate", 40), (3, "shared", 128)])
def test_restricted_drafts_change_drafts_never_output(model, tmp_path, k, mode, size) -> None:
    """Mixed batches (a sampled request, per-request widths, chunked prefill): the greedy output equals plain
    greedy decoding, every draft lies in the subset, and some drafts differ from the full head's."""
    seed = 100 * k + size
    rng = random.Random(seed)
    ps = prompts(5, seed)
    refs = plain_reference(model, ps)
    f = write_ranking(tmp_path, ranking(seed))
    subset = set(subset_ids(ranking(seed), size, 264))
    cfg = ExecutorConfig(tokens_per_block=rng.choice([4, 8]), max_tokens=1024, max_batch_size=4, max_num_tokens=40,
                         max_seq_len=128, prefill_chunk_size=rng.choice([None, 7]))  # fmt: skip

    def spec(**kw) -> MTPDecodingConfig:
        return MTPDecodingConfig(adaptive=False, num_nextn_predict_layers=k, draft_kv_mode=mode,
                                 draft_len_fn=lambda r: (r.request_id + len(r.tokens)) % (k + 2), **kw)  # fmt: skip

    seen: list[list[int]] = []
    tests, ex = run_mtp(model, ps, cfg, spec(draft_vocab_size=size, draft_vocab_file=f), seen.append, sampled={1})
    assert ex.draft_vocab is not None and ex.draft_vocab.size == size
    assert_lossless(refs, tests, skip={1})
    drafts = [t for d in seen for t in d]
    assert drafts and set(drafts) <= subset
    full: list[list[int]] = []
    run_mtp(model, ps, cfg, spec(), full.append, sampled={1})
    assert any(t not in subset for d in full for t in d)  # the restriction changed some drafts


def test_restricted_drafts_through_emulated_mtp_graphs(model, tmp_path, monkeypatch) -> None:
    """The MTP graphs' bodies (chained steps, catch-up and the fused draft; run eagerly by an emulating
    runner) draft over the subset too, and the output stays plain greedy."""

    m = Glm5NextForCausalLM.from_pretrained("tiny", layers=[0, 3], dtype="float32").eval()
    ps = prompts(3, 7)
    refs = plain_reference(m, ps)
    emulate_graphs(monkeypatch)  # the runner pads and runs its graphs' bodies eagerly
    f = write_ranking(tmp_path, ranking(7))
    subset = set(subset_ids(ranking(7), 24, 264))
    cfg = ExecutorConfig(tokens_per_block=8, max_tokens=1024, max_batch_size=4, max_num_tokens=64, max_seq_len=96,
                         cuda_graph_config=CudaGraphConfig(batch_sizes=[1, 4], enable_padding=True))  # fmt: skip
    seen: list[list[int]] = []
    spec = MTPDecodingConfig(adaptive=False, num_nextn_predict_layers=3, draft_vocab_size=24, draft_vocab_file=f)
    tests, ex = run_mtp(m, ps, cfg, spec, seen.append)
    chain = ex.drafter.chain_graphs
    assert ex.graph_runner.emulate and chain is not None and chain.draft_vocab is ex.draft_vocab
    assert chain.draft_replays + chain.catchup_replays > 0
    assert_lossless(refs, tests)
    assert seen and {t for d in seen for t in d} <= subset


def test_bf16_model_keeps_subset_in_head_dtype(tmp_path) -> None:
    m = Glm5NextForCausalLM.from_pretrained("tiny", layers=[0], dtype="bfloat16").eval()
    f = write_ranking(tmp_path, ranking(3))
    dv = resolve_draft_vocab(m.lm_head, 264, 16, f, None, torch.bfloat16)
    assert dv is not None and dv.weight.dtype == torch.bfloat16
    h = torch.randn(5, m.config.hidden_size, dtype=torch.bfloat16)
    ref = greedy_reference(m.lm_head, dv.ids.tolist(), h)
    assert set(dv.greedy(h).tolist()) <= set(dv.ids.tolist())
    # bf16 products round differently from the fp32 reference only at near ties.
    assert (dv.greedy(h) == ref).float().mean() >= 0.6
