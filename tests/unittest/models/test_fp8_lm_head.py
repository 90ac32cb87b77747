"""``fp8_lm_head`` (docs/fp8.md, "The LM head"): its values and refusals, how ``"auto"`` resolves, the head held as
`Fp8Linear` through load / save / reload (``modules_to_not_convert`` kept true), the load-time estimate, and every
reader of the head: `compute_logits`, the greedy pack, sampling and the MTP drafter (plain greedy == speculative
greedy)."""

from __future__ import annotations

import json
import random

import pytest
import torch

from tests.spec_helpers import assert_lossless
from trtllm_glm.config import ConfigError, Glm5NextConfig
from trtllm_glm.errors import CheckpointError
from trtllm_glm.logits import greedy_pack, greedy_top2_reference
from trtllm_glm.models import glm5_next
from trtllm_glm.models.glm5_next import (
    Glm5NextForCausalLM,
    decide_fp8_lm_head,
    resolve_fp8_lm_head,
)
from trtllm_glm.modules.linear import Fp8Linear, NumericsLinear
from trtllm_glm.quant.fp8 import dequantize_block_fp8, quantize_block_fp8
from trtllm_glm.runtime.executor import Executor, ExecutorConfig
from trtllm_glm.runtime.lossless import compare_greedy
from trtllm_glm.runtime.sampling import SamplingParams
from trtllm_glm.runtime.speculative_executor import SpeculativeExecutor
from trtllm_glm.speculative.config import MTPDecodingConfig

pytestmark = pytest.mark.cpu_only

FP8 = torch.float8_e4m3fn


def skip_list(directory) -> list[str]:  # noqa: ANN001
    return json.loads((directory / "config.json").read_text())["quantization_config"]["modules_to_not_convert"]


# --------------------------------------------------------------------------------------------------
# Values, refusals, resolution
# --------------------------------------------------------------------------------------------------
def test_values_and_refusals() -> None:
    for v in (None, "auto", True, False):
        assert resolve_fp8_lm_head(v) is v or resolve_fp8_lm_head(v) == v
    for bad in ("on", "true", 1, 0, "fp8", "AUTO"):
        with pytest.raises(ValueError, match="fp8_lm_head must be 'auto', True, False or None"):
            resolve_fp8_lm_head(bad)
    # "auto" follows the trunk; a tied head stays float under "auto" and refuses True.
    table = {(True, False): True, (False, False): False, (True, True): False, (False, True): False}
    for (trunk, tied), want in table.items():
        assert decide_fp8_lm_head("auto", trunk_fp8=trunk, tied=tied) is want
    assert decide_fp8_lm_head(None, trunk_fp8=True, tied=False) is None  # the default: as stored
    assert decide_fp8_lm_head(True, trunk_fp8=False, tied=False) is True
    assert decide_fp8_lm_head(False, trunk_fp8=True, tied=False) is False
    with pytest.raises(ValueError, match="ties lm_head to the embedding"):
        decide_fp8_lm_head(True, trunk_fp8=True, tied=True)
    cfg = Glm5NextConfig.from_pretrained("tiny")
    cfg.tie_word_embeddings = True
    tied = Glm5NextForCausalLM.from_config(cfg, quantization="fp8", fp8_lm_head="auto")
    assert tied.lm_head.weight is tied.model.embed_tokens.weight and tied.lm_head.weight.dtype == torch.float32
    with pytest.raises(ValueError, match="ties lm_head"):
        Glm5NextForCausalLM.from_config(cfg, fp8_lm_head=True)


def test_llm_yaml_and_cli_take_the_option() -> None:
    from trtllm_glm import LLM
    from trtllm_glm.cli import build_parser
    from trtllm_glm.serve.config import llm_options_from_dict

    with pytest.raises(ValueError, match="fp8_lm_head must be"):
        LLM("tiny", fp8_lm_head="yes", device="cpu")
    with pytest.raises(ValueError, match="model object is used as it is"):
        LLM(Glm5NextForCausalLM.from_pretrained("tiny"), fp8_lm_head=True)
    for v in ("auto", True, False, None):
        assert llm_options_from_dict({"fp8_lm_head": v})["fp8_lm_head"] == v
    for bad in ("on", 1, "fp8"):
        with pytest.raises(ConfigError, match="fp8_lm_head: expected auto, true, false or null"):
            llm_options_from_dict({"fp8_lm_head": bad}, source="o.yaml")
    p = build_parser()
    base = ["generate", "--prompt", "x"]
    assert p.parse_args(base).fp8_lm_head is None
    assert p.parse_args([*base, "--fp8-lm-head", "on"]).fp8_lm_head == "on"
    with pytest.raises(SystemExit):
        p.parse_args([*base, "--fp8-lm-head", "yes"])
    llm = LLM("tiny", quantization="fp8", fp8_lm_head="auto", device="cpu", max_seq_len=64, max_batch_size=2)
    assert isinstance(llm.model.lm_head, Fp8Linear)


def test_auto_resolves_per_source(tmp_path) -> None:
    def head(**kw) -> Glm5NextForCausalLM:
        return Glm5NextForCausalLM.from_pretrained("tiny", dtype="bfloat16", **kw)

    assert type(head(fp8_lm_head="auto").lm_head) is NumericsLinear  # a bf16 model: the head stays bf16
    assert type(head(quantization="fp8").lm_head) is NumericsLinear  # the default: as before (kept)
    q = head(quantization="fp8", fp8_lm_head="auto")
    assert isinstance(q.lm_head, Fp8Linear) and q.config.quantization.modules_to_not_convert == []
    assert type(head(quantization="fp8", fp8_lm_head=False).lm_head) is NumericsLinear
    forced = head(fp8_lm_head=True)  # only the head in FP8: the list names every other linear
    assert [n for n, m in forced.named_modules() if isinstance(m, Fp8Linear)] == ["lm_head"]
    skip = forced.config.quantization.modules_to_not_convert
    assert "lm_head" not in skip and "model.language_model.layers.0.self_attn.q_proj" in skip
    # An FP8 checkpoint as GLM ships it (lm_head listed, stored bf16): auto quantises the head at load.
    head(quantization="fp8").save_pretrained(tmp_path)
    assert skip_list(tmp_path) == ["lm_head"]
    stored = Glm5NextForCausalLM.from_pretrained(str(tmp_path), quantization="none")
    assert type(Glm5NextForCausalLM.from_pretrained(str(tmp_path)).lm_head) is NumericsLinear
    a = Glm5NextForCausalLM.from_pretrained(str(tmp_path), fp8_lm_head="auto")
    assert isinstance(a.lm_head, Fp8Linear) and isinstance(a.model.layers[0].self_attn.q_proj, Fp8Linear)
    codes, scales = quantize_block_fp8(stored.lm_head.weight, 128)
    assert torch.equal(a.lm_head.weight.view(torch.uint8), codes.view(torch.uint8))
    assert torch.equal(a.lm_head.weight_scale_inv, scales)
    # quantization="none" dequantises the trunk, so auto keeps the head float; True forces it alone.
    assert type(Glm5NextForCausalLM.from_pretrained(str(tmp_path), quantization="none", fp8_lm_head="auto").lm_head) \
        is NumericsLinear  # fmt: skip
    only = Glm5NextForCausalLM.from_pretrained(str(tmp_path), quantization="none", fp8_lm_head=True)
    assert [n for n, m in only.named_modules() if isinstance(m, Fp8Linear)] == ["lm_head"]
    # A rank's share built in place (meta, then drawn linear by linear) takes it too; the caller's config is kept.
    cfg = Glm5NextConfig.from_pretrained("tiny")
    local = Glm5NextForCausalLM.from_config(cfg, quantization="fp8", local_init=True, fp8_lm_head="auto")
    assert isinstance(local.lm_head, Fp8Linear) and local.lm_head.dequantized().abs().mean() > 0
    assert cfg.quantization is None


# --------------------------------------------------------------------------------------------------
# Save / reload, the estimate
# --------------------------------------------------------------------------------------------------
def test_save_reload_keeps_the_head_and_the_list_true(tmp_path) -> None:
    m = Glm5NextForCausalLM.from_pretrained("tiny", quantization="fp8", fp8_lm_head="auto")
    m.save_pretrained(tmp_path / "a")
    assert skip_list(tmp_path / "a") == []  # the head is FP8: not listed (a listed FP8 tensor is refused at load)
    for kw in ({}, {"fp8_lm_head": "auto"}, {"fp8_lm_head": True}):
        r = Glm5NextForCausalLM.from_pretrained(str(tmp_path / "a"), **kw)
        assert isinstance(r.lm_head, Fp8Linear), kw
        assert torch.equal(r.lm_head.weight.view(torch.uint8), m.lm_head.weight.view(torch.uint8))
        assert torch.equal(r.lm_head.weight_scale_inv, m.lm_head.weight_scale_inv)
    off = Glm5NextForCausalLM.from_pretrained(str(tmp_path / "a"), fp8_lm_head=False)
    assert type(off.lm_head) is NumericsLinear and off.config.quantization.modules_to_not_convert == ["lm_head"]
    want = dequantize_block_fp8(m.lm_head.weight, m.lm_head.weight_scale_inv, 128)
    assert torch.equal(off.lm_head.weight, want)
    off.save_pretrained(tmp_path / "b")  # what is held: a float head, listed
    assert skip_list(tmp_path / "b") == ["lm_head"]
    assert type(Glm5NextForCausalLM.from_pretrained(str(tmp_path / "b")).lm_head) is NumericsLinear
    # A float trunk with an FP8 head round-trips too (strict load: the list must not name the FP8 head).
    only = Glm5NextForCausalLM.from_pretrained("tiny", fp8_lm_head=True)
    only.save_pretrained(tmp_path / "c")
    r = Glm5NextForCausalLM.from_pretrained(str(tmp_path / "c"))
    assert [n for n, x in r.named_modules() if isinstance(x, Fp8Linear)] == ["lm_head"]
    assert torch.equal(r.lm_head.weight.view(torch.uint8), only.lm_head.weight.view(torch.uint8))


def test_memory_estimate_counts_the_head_as_held(tmp_path, monkeypatch) -> None:
    base = Glm5NextForCausalLM.from_pretrained("tiny", quantization="fp8")
    base.save_pretrained(tmp_path)
    held = {}
    for head in (False, True):
        m = Glm5NextForCausalLM.from_pretrained(str(tmp_path), fp8_lm_head=head)
        real = sum(t.numel() * t.element_size() for t in m.parameters())
        assert m.param_bytes(torch.float32) == real
        held[head] = real + m.derived_weight_bytes(torch.float32)
    V, D = base.config.vocab_size, base.config.hidden_size
    assert held[False] - held[True] == 4 * V * D - (V * D + 4 * -(-V // 128) * -(-D // 128))
    # The refusal before loading uses the same numbers: memory for the FP8 head only is enough for it alone.
    monkeypatch.setattr(glm5_next, "free_bytes", lambda device: held[True])
    Glm5NextForCausalLM.from_pretrained(str(tmp_path), fp8_lm_head=True)
    with pytest.raises(CheckpointError, match="need about"):
        Glm5NextForCausalLM.from_pretrained(str(tmp_path), fp8_lm_head=False)


# --------------------------------------------------------------------------------------------------
# Readers of the head: logits, greedy pack, sampling, MTP
# --------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def pair() -> tuple[Glm5NextForCausalLM, Glm5NextForCausalLM, Glm5NextForCausalLM]:
    """(FP8 trunk + FP8 head, the same with the head as a float linear holding the dequantised FP8 head (the
    reference), the same trunk with the float head it was quantised from), all fp32 on the CPU."""
    fp8 = Glm5NextForCausalLM.from_pretrained("tiny", quantization="fp8", fp8_lm_head="auto")
    ref = Glm5NextForCausalLM.from_pretrained("tiny", quantization="fp8", fp8_lm_head="auto")
    ref.set_fp8_lm_head_(False)  # dequantised in place: the same values as a float weight
    plain = Glm5NextForCausalLM.from_pretrained("tiny", quantization="fp8")
    assert isinstance(fp8.lm_head, Fp8Linear) and type(ref.lm_head) is NumericsLinear
    return fp8, ref, plain


def test_compute_logits_and_greedy_pack_read_the_fp8_head(pair) -> None:
    fp8, ref, plain = pair
    h = torch.randn(7, fp8.config.hidden_size, generator=torch.Generator().manual_seed(0))
    got = fp8.compute_logits(h)
    want = h @ dequantize_block_fp8(fp8.lm_head.weight, fp8.lm_head.weight_scale_inv, 128).t()
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert torch.equal(got, ref.compute_logits(h))
    assert not torch.equal(got, plain.compute_logits(h))  # the FP8 head is what is read
    # The greedy path of a decode graph: the head's own dtype out (cast=False), the kernel writes the fp32 copy.
    hb = h.bfloat16()
    raw = fp8.compute_logits(hb, cast=False)
    assert raw.dtype == torch.bfloat16
    f32 = torch.empty(raw.shape, dtype=torch.float32)
    ids, packed = greedy_pack(raw, f32_out=f32, backend="triton")
    assert torch.equal(f32, raw.float())
    want_ids, gap = greedy_top2_reference(raw)
    assert torch.equal(ids, want_ids) and torch.equal(packed[:, 0].long(), want_ids)
    assert torch.equal(packed[:, 1].float(), gap)


def run(model, ps, sp=None, spec=None):  # noqa: ANN001, ANN201
    cfg = ExecutorConfig(tokens_per_block=8, max_tokens=1024, max_batch_size=4, max_num_tokens=64, max_seq_len=128)
    ex = Executor(model, cfg) if spec is None else SpeculativeExecutor(model, cfg, spec)
    reqs = [ex.add_request(p, s) for p, s in zip(ps, sp or [SamplingParams(max_tokens=12, ignore_eos=True)] * len(ps))]
    ex.run_until_done()
    return reqs, ex


def prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(256) for _ in range(rng.randrange(3, 30))] for _ in range(n)]


def test_greedy_and_sampling_with_the_fp8_head(pair) -> None:
    fp8, ref, plain = pair
    ps = prompts(4, 3)
    got, _ = run(fp8, ps)
    want, _ = run(ref, ps)
    assert [r.output_ids for r in got] == [r.output_ids for r in want]  # the same head values, the same bits
    # Against the float head it was quantised from: equal up to near ties (design.md section 7). The head's rounding
    # moves this random model's logits by up to ~0.07 (unit-RMS hidden rows), so only a top-2 gap below twice that
    # can flip: the tolerance.
    base, _ = run(plain, ps)
    for b, g in zip(base, got):
        d = compare_greedy(b.output_ids, b.logit_gaps, g.output_ids, tol=0.15)
        assert d is None or d.excused, d
    sp = [
        SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.9, top_k=40, top_p=0.9, seed=i) for i in range(4)
    ]
    a, _ = run(fp8, ps, sp)
    b, _ = run(ref, ps, sp)
    assert [r.output_ids for r in a] == [r.output_ids for r in b]


@pytest.mark.parametrize("draft_head_fp8", [False, True])
def test_mtp_with_the_fp8_head_is_plain_greedy(pair, draft_head_fp8: bool) -> None:
    fp8 = pair[0]
    ps = prompts(4, 11)
    refs, _ = run(fp8, ps)
    spec = MTPDecodingConfig(adaptive=False, num_nextn_predict_layers=3, draft_head_fp8=draft_head_fp8)
    tests, ex = run(fp8, ps, spec=spec)
    assert_lossless(refs, tests)
    if draft_head_fp8:  # the target's FP8 head is the draft head as it is: no second copy
        assert ex.draft_vocab is not None and ex.draft_vocab.weight is fp8.lm_head.weight
        assert ex.draft_vocab.scale_inv is fp8.lm_head.weight_scale_inv
    else:
        assert ex.draft_vocab is None  # drafts through compute_logits, i.e. the FP8 head
