"""`scripts/train_small.py` and `scripts/eval_small.py` on the smoke model (toy size, a few steps).

The smoke run writes a checkpoint in the real layout; our strict loader and the published reference must
both load it and compute the same logits, the MTP block must sit under the checkpoint's names and compute
in our runtime what it computed in training, and the evaluation must run end to end on it.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import sys

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "scripts"))

pytest.importorskip("transformers")

import eval_small  # noqa: E402
import train_small  # noqa: E402

from benchmarks.harness.model_harness import ModelHarness  # noqa: E402
from trtllm_glm import LLM, KvCacheConfig, SamplingParams  # noqa: E402
from trtllm_glm.config import Glm5NextConfig  # noqa: E402
from trtllm_glm.models.glm5_next import Glm5NextForCausalLM  # noqa: E402

pytestmark = pytest.mark.cpu_only

REL_TOL = 1e-4
TEXT = b"import os\n\n\ndef main(argv):\n    for name in sorted(os.listdir(argv[1])):\n        print(name)\n"


@pytest.fixture(scope="module")
def smoke_dir(tmp_path_factory) -> str:
    out = str(tmp_path_factory.mktemp("smoke"))
    assert train_small.main(["--smoke", "--out", out]) == 0
    return out


def _dense_copy(src: str, dst: str) -> str:
    """The checkpoint with ``index_topk`` covering every pool: our FP8 selection and the reference's float
    selection then both keep everything, and the two must compute the same function."""
    shutil.copytree(src, dst)
    path = os.path.join(dst, "config.json")
    with open(path, encoding="utf-8") as f:
        cfg = json.load(f)
    cfg["text_config"]["index_topk"] = 1024
    with open(path, "w", encoding="utf-8") as f:
        json.dump(cfg, f)
    return dst


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def test_smoke_checkpoint_loads_in_ours_and_reference_with_same_logits(smoke_dir, tmp_path) -> None:
    _, model_cls, _ = train_small.import_reference()
    ids = [train_small.BOS] + list(TEXT)
    for path, n in ((smoke_dir, 11), (_dense_copy(smoke_dir, str(tmp_path / "dense")), len(ids))):
        # With the trained index_topk, prompts up to index_topk + 3 tokens select exactly; the dense copy
        # compares the whole prompt.
        llm = LLM(model=path, device="cpu", max_seq_len=256, kv_cache_config=KvCacheConfig(tokens_per_block=8))
        ours = llm.generate(ids[:n], SamplingParams(max_tokens=1, return_context_logits=True)).context_logits
        ref = model_cls.from_pretrained(path, attn_implementation="eager").float().eval()
        with torch.no_grad():
            want = ref(input_ids=torch.tensor([ids[:n]]), use_cache=False).logits[0]
        assert _rel(ours, want) <= REL_TOL
    assert Glm5NextConfig.from_pretrained(smoke_dir).num_nextn_predict_layers == 1


def test_mtp_weights_under_checkpoint_names(smoke_dir) -> None:
    with open(os.path.join(smoke_dir, "config.json"), encoding="utf-8") as f:
        cfg = json.load(f)
    text = cfg["text_config"]
    assert text["num_nextn_predict_layers"] == 1 and text["dtype"] == "float32"
    L = text["num_hidden_layers"]
    with safe_open(os.path.join(smoke_dir, "model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
    prefix = f"model.language_model.layers.{L}."
    mtp = {k[len(prefix) :] for k in keys if k.startswith(prefix)}
    for name in ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight",
                 "input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.kv_b_proj.weight",
                 "self_attn.indexer.wq_b.weight", "self_attn.indexer.index_kpool_compress_ape",
                 "mlp.gate.weight", "mlp.gate.e_score_correction_bias", "mlp.experts.0.gate_proj.weight",
                 "mlp.shared_experts.down_proj.weight"):  # fmt: skip
        assert name in mtp, name
    assert not any(k.startswith("hc_") for k in mtp)
    assert not any(k.startswith(f"model.language_model.layers.{L + 1}.") for k in keys)
    # Every trunk layer carries its mHC weights; nothing of the vision tower is written.
    assert all(f"model.language_model.layers.{i}.hc_attn_fn" in keys for i in range(L))
    assert not any("visual" in k for k in keys)


def test_reference_load_is_quiet(capfd) -> None:
    """The reference lacks the MTP block: its load report (~60 lines listing layer L as unexpected) and its
    progress bar are silenced."""
    from trtllm_glm.config import PRESET_CHECKPOINTS

    capfd.readouterr()
    _, mtp = eval_small.load_reference_with_mtp(PRESET_CHECKPOINTS["small"])
    out, err = capfd.readouterr()
    assert mtp is not None and "LOAD REPORT" not in out + err and "Loading weights" not in err, err[:500]


def test_runtime_mtp_layer_computes_the_trained_block(smoke_dir, tmp_path) -> None:
    """Our runtime's MTP layer (loaded from the checkpoint) gives the training code's MTP hidden."""
    dense = _dense_copy(smoke_dir, str(tmp_path / "dense"))
    ref, mtp = eval_small.load_reference_with_mtp(dense)
    ids = [train_small.BOS] + list(TEXT[:40])
    with torch.no_grad():
        h = train_small.trunk_forward(ref, torch.tensor([ids]), sparse=False)
        want, _ = train_small.mtp_forward(mtp, ref, h, torch.tensor([ids]), sparse=False)
    model = Glm5NextForCausalLM.from_pretrained(dense)
    harness = ModelHarness(model, include_mtp_layer=True)
    hidden = harness.step([(0, ids)])
    assert _rel(hidden, h[0]) <= REL_TOL
    harness.meta.prepare([0], past_lens=[0], q_lens=[len(ids) - 1], num_decode_seqs=0)
    with torch.no_grad():
        got = model.mtp_forward(
            torch.tensor(ids[1:]), hidden[:-1], harness.meta, harness.manager, harness.manager.num_sparse_layers - 1
        )
    assert _rel(got, want[0]) <= REL_TOL


def test_training_forward_matches_reference() -> None:
    """The training forward (chunked KDA, explicit MLA) is the reference's function, dense and sparse."""
    _, _, mod = train_small.import_reference()
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 37, 2, 16, generator=g) for _ in range(3))
    gate = -5 * torch.sigmoid(2 * torch.randn(2, 37, 2, 16, generator=g))
    beta = torch.rand(2, 37, 2, generator=g)
    want, _ = mod.chunk_kimi_delta_attention(q, k, v, gate, beta, use_qk_l2norm_in_kernel=True)
    assert _rel(train_small.kda_chunked(q, k, v, gate, beta), want) <= 1e-5
    model, _ = train_small.build_models(train_small.SMOKE_TEXT_CONFIG, seed=3)
    model.eval()
    ids = torch.randint(0, 256, (2, 40), generator=g)
    with torch.no_grad():
        want = model(input_ids=ids, use_cache=False).logits
        got = model.lm_head(train_small.trunk_forward(model, ids, sparse=True))
    assert _rel(got, want) <= REL_TOL


def test_eval_script_runs_on_smoke_model(smoke_dir, tmp_path) -> None:
    prefix = str(tmp_path / "report")
    assert eval_small.main(["--model", smoke_dir, "--quick", "--out-prefix", prefix]) == 0
    with open(prefix + ".json", encoding="utf-8") as f:
        rep = json.load(f)
    bits = rep["bits_per_byte"]
    for mode in ("dense", "sparse"):
        assert all(math.isfinite(v) and 0 < v < 12 for v in bits[mode].values())
    assert 0 < rep["baselines"]["bigram"] < rep["baselines"]["unigram"] < 8
    assert set(rep["indexer"]) == {"layer 3", "layer 7", "mtp"}
    spec = rep["speculative"]
    assert {"plain", "mtp K=1", "mtp K=3", "ngram K=7"} <= set(spec)
    for name, r in spec.items():
        if name != "plain":
            assert r["mean_accepted_length"] >= 1.0 and r["lossless"]["diverged"] == 0
    assert os.path.getsize(prefix + ".md") > 0


def test_smoke_training_is_reproducible_from_the_seed(smoke_dir, tmp_path) -> None:
    again = str(tmp_path / "again")
    assert train_small.main(["--smoke", "--out", again]) == 0
    a = load_file(os.path.join(smoke_dir, "model.safetensors"))
    b = load_file(os.path.join(again, "model.safetensors"))
    assert set(a) == set(b)
    for k, t in a.items():
        assert torch.equal(t, b[k]), k


SMALL_DIR = os.path.join(ROOT, "trtllm_glm", "presets", "small")


@pytest.mark.skipif(not os.path.isdir(SMALL_DIR), reason="the small preset's checkpoint is not shipped")
def test_small_preset_is_the_shipped_checkpoint_and_speculation_pays() -> None:
    """``LLM(model="small")`` loads the shipped checkpoint strictly (not seeded weights), the reference computes
    the same logits, and MTP drafts are accepted while greedy output stays that of plain decoding."""
    from trtllm_glm import MTPDecodingConfig

    llm = LLM(model="small", device="cpu", max_seq_len=512)
    assert llm.model.mtp is not None and llm.config.index_topk == 64
    prompt = "    def __init__(self"
    ids = llm.tokenizer.encode(prompt)
    ours = llm.generate(ids, SamplingParams(max_tokens=1, return_context_logits=True)).context_logits
    _, model_cls, _ = train_small.import_reference()
    ref = model_cls.from_pretrained(SMALL_DIR, attn_implementation="eager").float().eval()
    with torch.no_grad():
        want = ref(input_ids=torch.tensor([ids]), use_cache=False).logits[0]
    assert _rel(ours, want) <= REL_TOL
    sp = SamplingParams(max_tokens=48, ignore_eos=True)
    plain = llm.generate(prompt, sp).outputs[0]
    assert "self" in plain.text  # trained weights, not noise
    spec = LLM(
        model="small",
        device="cpu",
        max_seq_len=512,
        speculative_config=MTPDecodingConfig(adaptive=False, num_nextn_predict_layers=3),
    )
    out = spec.generate(prompt, sp).outputs[0]
    assert out.token_ids == plain.token_ids
    assert out.mean_accepted_length >= 2.0
