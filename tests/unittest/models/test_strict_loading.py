"""Strict checkpoint loading: every defect is a one-line error naming the file or tensor, never random
weights, and nothing is allocated for a model that cannot fit."""

from __future__ import annotations

import json
import logging
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from trtllm_glm.config import ConfigError, Glm5NextConfig
from trtllm_glm.errors import CheckpointError
from trtllm_glm.models.checkpoint import SINGLE_FILE, quantize_block_fp8
from trtllm_glm.models.glm5_next import Glm5NextForCausalLM, check_memory

pytestmark = pytest.mark.cpu_only

PRE = "model.language_model."


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    cfg = Glm5NextConfig.from_pretrained("tiny")
    model = Glm5NextForCausalLM.from_config(cfg, seed=1)
    d = tmp_path_factory.mktemp("ckpt")
    model.save_pretrained(d)
    return model, d


def _rewrite(src, dst, edit) -> None:
    """Copy a checkpoint directory, editing its tensors (``edit(dict)``) and keeping its config."""
    os.makedirs(dst, exist_ok=True)
    sd = load_file(os.path.join(src, SINGLE_FILE))
    edit(sd)
    save_file(sd, os.path.join(dst, SINGLE_FILE), metadata={"format": "pt"})
    with open(os.path.join(src, "config.json")) as f, open(os.path.join(dst, "config.json"), "w") as g:
        g.write(f.read())


def _one_line(e: pytest.ExceptionInfo) -> str:
    msg = str(e.value)
    assert "\n" not in msg
    return msg


def test_round_trip_is_exact(saved) -> None:
    model, d = saved
    m2 = Glm5NextForCausalLM.from_pretrained(str(d))
    for (n, a), (_, b) in zip(model.state_dict().items(), m2.state_dict().items()):
        assert torch.equal(a, b), n


@pytest.mark.parametrize(
    "edit, match",
    [
        (lambda sd: sd.pop(PRE + "layers.2.hc_ffn_base"), "missing tensor 'model.language_model.layers.2.hc_ffn_base'"),
        (lambda sd: sd.__setitem__(PRE + "layers.1.extra.weight", torch.ones(2)), "unexpected tensor"),
        (lambda sd: sd.__setitem__(PRE + "norm.weight", torch.ones(7)), r"norm.weight' has shape \(7,\)"),
        (lambda sd: sd[PRE + "layers.3.self_attn.q_a_proj.weight"].__setitem__((0, 0), float("nan")), "non-finite"),
        (lambda sd: sd.__setitem__("lm_head.weight", sd["lm_head.weight"].to(torch.float8_e4m3fn)), "no _scale_inv"),
    ],
)  # fmt: skip
def test_defective_tensors_are_one_line_errors(saved, tmp_path, edit, match) -> None:
    _, d = saved
    _rewrite(d, tmp_path, edit)
    with pytest.raises(CheckpointError, match=match) as e:
        Glm5NextForCausalLM.from_pretrained(str(tmp_path))
    _one_line(e)


def test_unknown_config_key_names_the_file_and_key(saved, tmp_path) -> None:
    _, d = saved
    _rewrite(d, tmp_path, lambda sd: None)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["text_config"]["hc_mode"] = "dynamic"
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="config.json: hc_mode: unknown config key") as e:
        Glm5NextForCausalLM.from_pretrained(str(tmp_path))
    _one_line(e)


def test_file_instead_of_directory(saved) -> None:
    _, d = saved
    with pytest.raises(ConfigError, match="is a file") as e:
        Glm5NextForCausalLM.from_pretrained(str(d / SINGLE_FILE))
    _one_line(e)


def test_truncated_safetensors(saved, tmp_path) -> None:
    _, d = saved
    _rewrite(d, tmp_path, lambda sd: None)
    path = tmp_path / SINGLE_FILE
    path.write_bytes(path.read_bytes()[:100])
    with pytest.raises(CheckpointError, match="cannot read") as e:
        Glm5NextForCausalLM.from_pretrained(str(tmp_path))
    _one_line(e)


def test_vision_weights_are_skipped_with_one_message(saved, tmp_path, caplog) -> None:
    model, d = saved

    def add_vision(sd):
        sd["model.visual.blocks.0.attn.qkv.weight"] = torch.ones(4, 4)
        sd["model.visual.merger.proj.weight"] = torch.ones(4, 4)

    _rewrite(d, tmp_path, add_vision)
    with caplog.at_level(logging.INFO, logger="trtllm_glm"):
        m2 = Glm5NextForCausalLM.from_pretrained(str(tmp_path))
    msgs = [r.getMessage() for r in caplog.records if "vision" in r.getMessage()]
    assert len(msgs) == 1 and "skipping 2 vision tensors" in msgs[0]
    assert torch.equal(m2.lm_head.weight, model.lm_head.weight)


_QCFG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
         "weight_block_size": [128, 128], "modules_to_not_convert": ["lm_head"]}  # fmt: skip


def _fp8_checkpoint(saved, dst, extra=None, qcfg=_QCFG) -> list[str]:
    """``saved`` with every 2-D ``*proj.weight`` outside the indexer stored block-FP8 (+ ``extra(sd)``), config
    carrying ``qcfg``; returns the quantised names."""
    model, d = saved
    quantised = []

    def quantise(sd):
        for k in list(sd):
            if k.endswith("proj.weight") and sd[k].dim() == 2 and "indexer" not in k:
                sd[k], sd[k + "_scale_inv"] = quantize_block_fp8(sd[k])
                quantised.append(k)
        if extra is not None:
            extra(sd)

    _rewrite(d, dst, quantise)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["quantization_config"] = qcfg
    (dst / "config.json").write_text(json.dumps(cfg))
    return quantised


def test_block_fp8_weights_load_as_fp8_or_dequantised_and_skip_listed_modules(saved, tmp_path) -> None:
    model, _ = saved
    quantised = _fp8_checkpoint(saved, tmp_path)
    p1 = dict(model.named_parameters())
    name = "model.layers.3.self_attn.q_a_proj.weight"
    assert PRE + "layers.3.self_attn.q_a_proj.weight" in quantised
    # Default: held as FP8 (codes and scales as stored).
    m2 = Glm5NextForCausalLM.from_pretrained(str(tmp_path))
    assert m2.config.quantization is not None
    p2 = dict(m2.named_parameters())
    assert p2[name].dtype == torch.float8_e4m3fn and p2[name + "_scale_inv"].dtype == torch.float32
    w8, s = quantize_block_fp8(p1[name])
    assert torch.equal(p2[name].view(torch.uint8), w8.view(torch.uint8)) and torch.equal(p2[name + "_scale_inv"], s)
    assert torch.equal(p2["lm_head.weight"], p1["lm_head.weight"])  # not converted: bit-exact
    # Debug option: dequantised at load.
    m3 = Glm5NextForCausalLM.from_pretrained(str(tmp_path), quantization="none")
    p3 = dict(m3.named_parameters())
    assert p3[name].dtype == torch.float32 and name + "_scale_inv" not in p3
    err = (p3[name] - p1[name]).abs().max() / p1[name].abs().max()
    assert 0 < err < 0.07  # e4m3 keeps 3 mantissa bits
    assert torch.equal(p3["lm_head.weight"], p1["lm_head.weight"])


@pytest.mark.parametrize(
    "extra, match",
    [
        (lambda sd: sd.pop(PRE + "layers.0.self_attn.q_proj.weight_scale_inv"),
         "FP8 tensor 'model.language_model.layers.0.self_attn.q_proj.weight' has no _scale_inv partner"),
        (lambda sd: sd.__setitem__(PRE + "layers.0.self_attn.q_proj.weight_scale_inv", torch.ones(2, 1)),
         r"model.language_model.layers.0.self_attn.q_proj.weight: scale_inv shape \(2, 1\) does not match"),
        (lambda sd: sd[PRE + "layers.0.self_attn.o_proj.weight_scale_inv"].__setitem__((0, 0), float("nan")),
         "scale 'model.language_model.layers.0.self_attn.o_proj.weight_scale_inv' holds non-finite values"),
        (lambda sd: sd[PRE + "layers.0.self_attn.o_proj.weight"].view(torch.uint8).__setitem__((3, 5), 0x7F),
         "tensor 'model.language_model.layers.0.self_attn.o_proj.weight' holds non-finite values"),
    ],
)  # fmt: skip
def test_block_fp8_defects_are_one_line_errors(saved, tmp_path, extra, match) -> None:
    _fp8_checkpoint(saved, tmp_path, extra)
    with pytest.raises(CheckpointError, match=match) as e:
        Glm5NextForCausalLM.from_pretrained(str(tmp_path))
    _one_line(e)


def test_fp8_tensor_listed_in_modules_to_not_convert_is_refused(saved, tmp_path) -> None:
    qcfg = dict(_QCFG, modules_to_not_convert=["lm_head", "layers.2.mlp.shared_experts.down_proj"])
    _fp8_checkpoint(saved, tmp_path, qcfg=qcfg)
    for mode in (None, "none"):
        want = "FP8 tensor 'model.language_model.layers.2.mlp.shared_experts.down_proj.weight' is listed in"
        with pytest.raises(CheckpointError, match=want + " quantization_config.modules_to_not_convert") as e:
            Glm5NextForCausalLM.from_pretrained(str(tmp_path), quantization=mode)
        _one_line(e)


def test_fp8_memory_estimate_and_refusal_names_parallelism() -> None:
    from trtllm_glm.models.glm5_next import subset_config

    # A real-geometry slice (a dense and a 288-expert MoE layer, sparse MLA, the MTP layer): the whole model's
    # 46 layers would take ten times as long to build on the meta device.
    cfg = subset_config(Glm5NextConfig.from_pretrained("glm-5.3-flash"), [0, 3])
    with torch.device("meta"):
        m = Glm5NextForCausalLM(cfg)
    bf16 = m.param_bytes(torch.bfloat16)
    assert m.derived_weight_bytes(torch.bfloat16) == 0
    m.quantize_fp8_()
    fp8 = m.param_bytes(torch.bfloat16)
    assert 0.45 < fp8 / bf16 < 0.55  # nearly every weight is a quantised linear
    # The dequantised kv_b_proj each sparse-MLA layer keeps (the trunk's and the MTP layer's) is counted apart.
    sparse = [x for x in m.modules() if type(x).__name__ == "GlmKpoolSparseMLA"]
    assert sparse and m.derived_weight_bytes(torch.bfloat16) == sum(2 * x.kv_b_proj.weight.numel() for x in sparse)
    from trtllm_glm.models.glm5_next import _memory_hint

    hint = _memory_hint(bf16, fp8, "cpu")
    assert f"quantization='fp8') need about {fp8 / (1 << 30):.1f} GiB" in hint
    small = _memory_hint(1 << 62, 1 << 20, "cpu")
    assert small.endswith("which fits")
    huge = _memory_hint(1 << 62, 1 << 61, "cpu")
    assert "tensor / expert parallelism" in huge


def test_memory_estimate_refuses_before_allocating(monkeypatch) -> None:
    with pytest.raises(CheckpointError, match=r"need about .* GiB on cpu but only"):
        check_memory(1 << 60, "cpu", what="the parameters of glm-5.3-flash")
    cfg = Glm5NextConfig.from_pretrained("glm-5.3-flash")
    with torch.device("meta"):
        m = Glm5NextForCausalLM(cfg)
    # The real model is several hundred GB in bf16; the estimate says so before any allocation.
    assert m.param_bytes(torch.bfloat16) > 100 * (1 << 30)


def test_cache_estimate_matches_allocation_and_refuses_early() -> None:
    from trtllm_glm.cache.manager import Glm5NextCacheManager
    from trtllm_glm.runtime.executor import Executor, ExecutorConfig

    cfg = Glm5NextConfig.from_pretrained("tiny")
    kw = dict(num_pages=37, tokens_per_block=8, max_num_requests=3, include_mtp_layer=True, dtype=torch.bfloat16)
    m = Glm5NextCacheManager(cfg, **kw)
    planes = (m.latent, m.index_k, m.index_scale, m.tail_ring, m.kda_recurrent, m.kda_conv)
    assert Glm5NextCacheManager.estimate_bytes(cfg, **kw) == sum(t.numel() * t.element_size() for t in planes)
    model = Glm5NextForCausalLM.from_config(cfg)
    with pytest.raises(CheckpointError, match=r"the KV cache .* need about .* GiB on cpu"):
        Executor(model, ExecutorConfig(tokens_per_block=16, max_tokens=1 << 40, max_batch_size=2))
