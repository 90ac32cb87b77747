"""Parity with the published reference (`transformers` ``Glm5NextForConditionalGeneration``, FP32).

Small random reference models (every weight perturbed) are saved with ``save_pretrained`` and served
through ``LLM(model=dir)``. Where ``index_topk`` covers every pool the two compute the same function,
so context logits, logits after chunked prefill, decode steps and speculative verify rows must match
to FP32 rounding (relative error <= 1e-3), and greedy tokens must agree except at near ties
(docs/design.md §7). Where ``index_topk`` drops pools our FP8 pooled selection and the reference's float
selection may differ near ties: pool-selection recall against the reference is measured instead.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from benchmarks.harness.hf_reference import build_hf_model, hf_greedy, hf_logits
from trtllm_glm import LLM, KvCacheConfig, NGramDecodingConfig, SamplingParams  # noqa: E402
from trtllm_glm.config import Glm5NextConfig  # noqa: E402
from trtllm_glm.speculative.drafters import OracleDrafter  # noqa: E402

pytest.importorskip("transformers")
pytestmark = pytest.mark.cpu_only

REL_TOL = 1e-3
NEAR_TIE = 1e-3


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(2, 290, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def ref_dir(tmp_path_factory):
    model = build_hf_model(seed=0)
    d = tmp_path_factory.mktemp("hf_glm5")
    model.save_pretrained(d)
    return model, str(d)


def make_llm(path: str, **kw) -> LLM:
    # Without prefix caching: the selection test counts one prefill pass (checkpoints cut chunks).
    kw.setdefault("kv_cache_config", KvCacheConfig(tokens_per_block=8, enable_block_reuse=False))
    return LLM(model=path, device="cpu", max_seq_len=256, **kw)


@pytest.mark.parametrize("chunk", [None, 7])
def test_context_logits_match_reference(ref_dir, chunk) -> None:
    model, path = ref_dir
    llm = make_llm(path, prefill_chunk_size=chunk)
    for n, seed in ((45, 1), (13, 2)):
        ids = prompt(n, seed)
        out = llm.generate(ids, SamplingParams(max_tokens=1, return_context_logits=True))
        assert out.context_logits.shape == (n, 300)
        assert rel_err(out.context_logits, hf_logits(model, ids)) <= REL_TOL


def _check_generation(model, ids: list[int], out) -> None:
    """Our generation logits vs the reference's on the same (teacher-forced) tokens; greedy agreement."""
    toks = out.outputs[0].token_ids
    ref = hf_logits(model, ids + toks)[len(ids) - 1 : len(ids) - 1 + len(toks)]
    assert rel_err(out.outputs[0].generation_logits, ref) <= REL_TOL
    # Greedy choices equal the reference's argmax except at near ties.
    for j, t in enumerate(toks):
        top = torch.topk(ref[j], 2)
        if t != int(top.indices[0]):
            assert float(top.values[0] - top.values[1]) < NEAR_TIE, f"token {j}: {t} vs {int(top.indices[0])}"


def test_decode_steps_match_reference(ref_dir) -> None:
    model, path = ref_dir
    llm = make_llm(path)
    ids = prompt(30, 3)
    out = llm.generate(ids, SamplingParams(max_tokens=14, ignore_eos=True, return_generation_logits=True))
    _check_generation(model, ids, out)
    # The continuation computed from scratch by the reference (one full forward per token).
    want, gaps = hf_greedy(model, ids, 14)
    got = out.outputs[0].token_ids
    for j, (a, b) in enumerate(zip(got, want)):
        if a != b:
            assert gaps[j] < NEAR_TIE, f"diverged at {j} with gap {gaps[j]}"
            break


def test_speculative_verify_rows_match_reference(ref_dir) -> None:
    model, path = ref_dir
    ids = prompt(26, 4)
    sp = SamplingParams(max_tokens=16, ignore_eos=True, return_generation_logits=True)
    plain = make_llm(path).generate(ids, sp).outputs[0].token_ids
    llm = make_llm(path, speculative_config=NGramDecodingConfig(max_draft_len=4))
    # Drafts known to be right except every third one, so that verify rounds are wide and accept partially.
    llm.executor.drafter = OracleDrafter({0: plain}, corrupt=lambda _i, j: j % 3 == 2)
    out = llm.generate(ids, sp)
    assert out.outputs[0].num_draft_rounds > 0 and out.outputs[0].mean_accepted_length > 1.5
    assert out.outputs[0].token_ids == plain
    _check_generation(model, ids, out)


def test_shared_indexer_layer_matches_reference(tmp_path) -> None:
    # The reference hands a selection only to the very next layer, so the shared layer follows a full one.
    layer_types = ["linear_attention", "indexed_attention", "indexed_attention", "linear_attention"]
    model = build_hf_model(
        seed=5,
        num_hidden_layers=4,
        layer_types=layer_types,
        indexer_types=["full", "full", "shared", "full"],
        mlp_layer_types=["dense", "sparse", "sparse", "sparse"],
        index_topk=8,
    )
    model.save_pretrained(tmp_path)
    cfg = Glm5NextConfig.from_pretrained(str(tmp_path))
    assert cfg.shares_indexer(2) and not cfg.shares_indexer(1)
    llm = make_llm(str(tmp_path))
    assert llm.model.model.layers[2].self_attn.indexer is None
    # index_topk = 8 drops pools from 12 tokens on; keep the prompt where selection is exact (<= 11 tokens)
    # so that the comparison tests the sharing itself, not FP8-vs-float ties.
    ids = prompt(11, 6)
    out = llm.generate(ids, SamplingParams(max_tokens=1, return_context_logits=True))
    assert rel_err(out.context_logits, hf_logits(model, ids)) <= REL_TOL


def _pool_sets(sel: torch.Tensor, positions: list[int]) -> list[set[int]]:
    """Selected complete pools per row (the open pool's tail excluded)."""
    out = []
    for r, pos in enumerate(positions):
        n_complete = (pos + 1) // 4
        out.append({int(t) // 4 for t in sel[r].tolist() if t >= 0 and int(t) // 4 < n_complete})
    return out


def test_pool_selection_recall_against_reference(tmp_path) -> None:
    """With index_topk dropping pools, our FP8 selection agrees with the reference's float selection.

    Eight indexer heads: with very few heads many pools score exactly 0 after the ReLU, and the
    reference's ``topk`` breaks such ties arbitrarily. The misses left are FP8 rounding (e4m3 keeps 3
    mantissa bits) at boundaries where random weights leave pools a few percent apart; a recompute of
    the reference's float scores from its own weights selects exactly what it does (checked once by hand).
    """
    model = build_hf_model(seed=7, index_topk=16, index_n_heads=8)
    model.save_pretrained(tmp_path)
    ids = prompt(120, 8)
    hf_sel: list[torch.Tensor] = []
    hooks = [
        m.register_forward_hook(lambda _m, _i, o: hf_sel.append(o[0].clone()))
        for n, m in model.named_modules()
        if n.endswith("self_attn.indexer")
    ]
    hf_logits(model, ids)
    for h in hooks:
        h.remove()
    llm = make_llm(str(tmp_path))
    ours: list[torch.Tensor] = []
    hooks = [
        layer.self_attn.indexer.register_forward_hook(lambda _m, _i, o: ours.append(o.clone()))
        for layer in llm.model.model.layers
        if layer.is_sparse
    ]
    llm.generate(ids, SamplingParams(max_tokens=1))
    for h in hooks:
        h.remove()
    assert len(ours) == len(hf_sel) == 2
    positions = list(range(len(ids)))
    recalls = []
    for a, b in zip(ours, hf_sel):
        hit = total = 0
        for sa, sb in zip(_pool_sets(a, positions), _pool_sets(b, positions)):
            hit += len(sa & sb)
            total += len(sb)
        recalls.append(hit / total)
    # The first sparse layer sees the same input as the reference (to rounding): its recall measures the
    # indexer alone. Later layers compound: an earlier different selection changes their input.
    recall = recalls[0]
    print(f"pool-selection recall vs reference per sparse layer: {[round(r, 4) for r in recalls]}")
    # Measured 0.97-0.98 on random weights (issue 7's goal is 0.98); a bug in pooling, gates, the position
    # bias or the head weights drops it far lower (0.68 when the pooling position bias is left out).
    assert recall >= 0.95


def test_config_round_trip_with_reference(ref_dir, tmp_path) -> None:
    from transformers import Glm5NextConfig as HfConfig

    _, path = ref_dir
    ours = Glm5NextConfig.from_pretrained(path)
    ours.save(tmp_path)
    hf = HfConfig.from_pretrained(str(tmp_path))
    with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
        src = json.load(f)["text_config"]
    for k, v in src.items():
        if k in ("transformers_version", "dtype"):
            continue
        assert getattr(hf.text_config, k) == v, k
    # And ours reads back what it wrote.
    assert Glm5NextConfig.from_pretrained(str(tmp_path)).to_dict() == ours.to_dict()


def test_reference_loads_our_checkpoint(tmp_path) -> None:
    """A model saved by us (trunk; the MTP layer is ignored by the reference) gives the reference's logits."""
    from benchmarks.harness.hf_reference import import_reference
    from trtllm_glm.models.glm5_next import Glm5NextForCausalLM

    cfg = Glm5NextConfig.from_pretrained("tiny")
    ours = Glm5NextForCausalLM.from_config(cfg, seed=3)
    ours.save_pretrained(tmp_path)
    _, HfModel = import_reference()
    ref = HfModel.from_pretrained(str(tmp_path), attn_implementation="eager").float().eval()
    ids = prompt(21, 9)
    llm = make_llm(str(tmp_path))
    out = llm.generate(ids, SamplingParams(max_tokens=1, return_context_logits=True))
    assert rel_err(out.context_logits, hf_logits(ref, ids)) <= REL_TOL


def test_in_memory_conversion_matches_reference() -> None:
    """The GPU parity benchmark's path: the reference's in-memory weights -> checkpoint names -> our model."""
    from benchmarks.harness.hf_reference import to_checkpoint_names
    from trtllm_glm.models.glm5_next import Glm5NextForCausalLM

    model = build_hf_model(seed=11)
    cfg = Glm5NextConfig.from_dict(model.config.to_diff_dict())
    with torch.device("meta"):
        ours = Glm5NextForCausalLM(cfg)
    ours.load_weights(to_checkpoint_names(model), dtype=torch.float32, source="reference", assign=True)
    llm = LLM(model=ours, max_seq_len=128, kv_cache_config=KvCacheConfig(tokens_per_block=8))
    ids = prompt(33, 12)
    out = llm.generate(ids, SamplingParams(max_tokens=1, return_context_logits=True))
    assert rel_err(out.context_logits, hf_logits(model, ids)) <= REL_TOL
