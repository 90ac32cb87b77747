"""Glm5NextConfig: presets, HF key names, validation messages."""

from __future__ import annotations

import json

import pytest

from trtllm_glm.config import LAYER_KDA, LAYER_SPARSE_MLA, ConfigError, Glm5NextConfig

pytestmark = pytest.mark.cpu_only


def test_real_geometry_preset() -> None:
    c = Glm5NextConfig.from_pretrained("glm-5.3-flash")
    assert c.num_hidden_layers == 45
    assert c.sparse_layer_ids == list(range(3, 45, 4))
    assert len(c.kda_layer_ids) == 34
    assert (c.index_n_heads, c.index_head_dim, c.index_kpool, c.index_topk) == (32, 128, 4, 2048)
    assert c.index_topk_pools == 512 and c.index_select_width == 2051
    assert c.softmax_scale == pytest.approx(256**-0.5)
    assert c.vocab_size == 154880 and c.hidden_size == 4096


def test_tiny_preset_same_structure() -> None:
    c = Glm5NextConfig.from_pretrained("tiny")
    assert all((t == LAYER_SPARSE_MLA) == (i % 4 == 3) for i, t in enumerate(c.layer_types))
    assert c.index_head_dim == 128 and c.index_kpool == 4
    # Selection must really drop pools at test lengths.
    assert c.index_topk <= 32


def test_roundtrip_real_layout(tmp_path) -> None:
    c = Glm5NextConfig.from_pretrained("tiny")
    c.save(tmp_path)
    d = json.loads((tmp_path / "config.json").read_text())
    assert d["model_type"] == "glm5_next" and d["text_config"]["model_type"] == "glm5_next_text"
    assert d["text_config"]["linear_num_heads"] == c.kda_num_heads
    assert d["text_config"]["layer_types"][3] == "indexed_attention"
    c2 = Glm5NextConfig.from_pretrained(str(tmp_path))
    assert c2.to_dict() == c.to_dict()


def test_linear_attn_config_alias() -> None:
    c = Glm5NextConfig.from_dict({"num_hidden_layers": 4, "linear_attn_config": {"num_heads": 8, "head_dim": 64}})
    assert (c.kda_num_heads, c.kda_head_dim, c.kda_gate_low_rank) == (8, 64, 64)


@pytest.mark.parametrize(
    "patch, field",
    [
        ({"hc_mult_typo": 4}, "hc_mult_typo"),
        ({"index_kpool_always_select_tail": False}, "index_kpool_always_select_tail"),
        ({"indexer_types": ["shared", "full", "full", "full"], "num_hidden_layers": 4,
          "layer_types": ["indexed_attention", "linear_attention", "linear_attention", "indexed_attention"]},
         r"indexer_types\[0\]"),
        ({"mlp_layer_types": ["dense", "bogus"], "num_hidden_layers": 2}, r"mlp_layer_types\[1\]"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"linear_attn_config": {"mystery": 1}}, "linear_attn_config.mystery"),
    ],
)  # fmt: skip
def test_unknown_or_unsupported_keys_raise(patch, field) -> None:
    with pytest.raises(ConfigError, match=field):
        Glm5NextConfig.from_dict(patch)


def test_vl_layout_top_level_is_strict() -> None:
    with pytest.raises(ConfigError, match="surprise"):
        Glm5NextConfig.from_dict({"model_type": "glm5_next", "text_config": {"num_hidden_layers": 4}, "surprise": 1})
    with pytest.raises(ConfigError, match="quant_method"):
        Glm5NextConfig.from_dict(
            {"text_config": {"num_hidden_layers": 4}, "quantization_config": {"quant_method": "awq"}}
        )
    c = Glm5NextConfig.from_dict(
        {
            "model_type": "glm5_next",
            "text_config": {"num_hidden_layers": 4, "model_type": "glm5_next_text"},
            "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128],
                                    "activation_scheme": "dynamic", "modules_to_not_convert": ["lm_head"]},
            "vision_config": {"depth": 1},
            "image_token_id": 5,
        }
    )  # fmt: skip
    assert c.quantization is not None and c.quantization.modules_to_not_convert == ["lm_head"]
    d = c.to_dict()
    assert d["quantization_config"]["quant_method"] == "fp8" and d["vision_config"] == {"depth": 1}


def test_file_where_directory_expected(tmp_path) -> None:
    f = tmp_path / "weights.bin"
    f.write_text("x")
    with pytest.raises(ConfigError, match="is a file"):
        Glm5NextConfig.from_pretrained(str(f))


def test_layer_types_listed_in_file() -> None:
    d = dict(num_hidden_layers=4, layer_types=["linear_attention", "full_attention", "kda", "sparse_mla"])
    c = Glm5NextConfig.from_dict(d)
    assert c.layer_types == [LAYER_KDA, LAYER_SPARSE_MLA, LAYER_KDA, LAYER_SPARSE_MLA]


@pytest.mark.parametrize(
    "patch, field",
    [
        ({"index_head_dim": 64}, "index_head_dim"),
        ({"index_kpool": 8}, "index_kpool"),
        ({"index_topk": 2050}, "index_topk"),
        ({"qk_rope_head_dim": 64}, "qk_rope_head_dim"),
        ({"layer_types": ["kda"] * 3}, "layer_types"),
        ({"layer_types": ["kda", "bogus"]}, "layer_types[1]"),
        ({"num_experts_per_tok": 999}, "num_experts_per_tok"),
        ({"hidden_size": 0}, "hidden_size"),
        ({"eos_token_id": 10**9}, "eos_token_id"),
        ({"torch_dtype": "int8"}, "torch_dtype"),
    ],
)
def test_inconsistent_config_names_field(patch, field) -> None:
    with pytest.raises(ConfigError, match=field.replace("[", r"\[").replace("]", r"\]")):
        Glm5NextConfig.from_dict(patch)


def test_bad_files(tmp_path) -> None:
    p = tmp_path / "config.json"
    p.write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        Glm5NextConfig.from_json_file(p)
    p.write_text("[1, 2]")
    with pytest.raises(ConfigError, match="JSON object"):
        Glm5NextConfig.from_json_file(p)
    with pytest.raises(ConfigError, match="neither a preset"):
        Glm5NextConfig.from_pretrained(str(tmp_path / "missing"))
