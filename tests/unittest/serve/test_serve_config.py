"""``--config options.yaml``: LLM API options for the server."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from trtllm_glm import LLM, KvCacheConfig, MTPDecodingConfig, NGramDecodingConfig
from trtllm_glm.config import ConfigError
from trtllm_glm.serve.config import llm_options_from_dict, load_llm_options, split_serve_options

pytestmark = pytest.mark.cpu_only


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "options.yaml"
    p.write_text(textwrap.dedent(text))
    return p


def test_full_file_maps_to_llm_kwargs_and_builds(tmp_path: Path) -> None:
    p = write(
        tmp_path,
        """
        max_batch_size: 4
        max_num_tokens: 128
        max_seq_len: 256
        dtype: float32
        device: cpu
        seed: 3
        prefill_chunk_size: null
        enable_chunked_prefill: true
        disable_overlap_scheduler: true
        batch_wait_timeout_iters: 4
        batch_wait_max_tokens_ratio: 0.25
        kv_cache_config:
          tokens_per_block: 8
          max_tokens: 512
        speculative_config:
          decoding_type: MTP
          num_nextn_predict_layers: 2
          draft_kv_mode: separate
    """,
    )
    opts = load_llm_options(p)
    assert opts["kv_cache_config"] == KvCacheConfig(tokens_per_block=8, max_tokens=512)
    spec = opts["speculative_config"]
    assert isinstance(spec, MTPDecodingConfig) and spec.num_nextn_predict_layers == 2
    assert spec.draft_kv_mode == "separate"
    assert "enable_chunked_prefill" not in opts
    llm = LLM(model="tiny", **opts)
    assert llm.executor_config.max_batch_size == 4 and llm.executor_config.tokens_per_block == 8
    assert opts["disable_overlap_scheduler"] is True and not llm.executor_config.overlap_scheduler
    assert llm.executor_config.batch_wait_timeout_iters == 4 and llm.executor_config.batch_wait_max_tokens_ratio == 0.25
    assert type(llm.executor).__name__ == "SpeculativeExecutor"


def test_ngram_and_empty_file(tmp_path: Path) -> None:
    spec = llm_options_from_dict({"speculative_config": {"decoding_type": "ngram", "max_draft_len": 5}})
    assert spec["speculative_config"] == NGramDecodingConfig(max_draft_len=5)
    spec = llm_options_from_dict({"speculative_config": {"decoding_type": "MTP", "max_concurrency": 8}})
    assert spec["speculative_config"] == MTPDecodingConfig(max_concurrency=8)
    assert load_llm_options(write(tmp_path, "# nothing\n")) == {}


def test_max_draft_len_and_its_old_mtp_name() -> None:
    """Issue 46, item 1: ``max_draft_len`` is every decoding type's drafts per round; MTP's YAML also takes its
    old name, ``num_nextn_predict_layers``, with the same meaning."""
    new = llm_options_from_dict({"speculative_config": {"decoding_type": "MTP", "max_draft_len": 2}})
    old = llm_options_from_dict({"speculative_config": {"decoding_type": "mtp", "num_nextn_predict_layers": 2}})
    assert new == old and new["speculative_config"].max_draft_len == 2
    assert old["speculative_config"].num_nextn_predict_layers == 2


def test_mtp_draft_vocab_and_adaptive_keys() -> None:
    """Issue 43's MTP options travel through the YAML like the others, and bad values name their key."""
    d = {"decoding_type": "MTP", "num_nextn_predict_layers": 3, "draft_vocab_size": 32, "adaptive": False}
    spec = llm_options_from_dict({"speculative_config": d})["speculative_config"]
    assert spec == MTPDecodingConfig(num_nextn_predict_layers=3, draft_vocab_size=32, adaptive=False)
    # Unset: the drafter's default (MTP: on where rounds replay CUDA graphs on a GPU).
    unset = llm_options_from_dict({"speculative_config": {"decoding_type": "MTP"}})["speculative_config"]
    assert unset.adaptive is None
    for bad, msg in (({"draft_vocab_size": "32"}, "draft_vocab_size: expected an int"),
                     ({"draft_vocab_size": 0}, "draft_vocab_size must be None"),
                     ({"adaptive": "no"}, "adaptive must be a bool"),
                     ({"draft_vocab_file": "f.json"}, "set draft_vocab_size too")):  # fmt: skip
        with pytest.raises(ConfigError, match=msg):
            llm_options_from_dict({"speculative_config": {"decoding_type": "MTP", **bad}})


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"max_batch_sizes": 4}, "unknown key 'max_batch_sizes'"),
        ({"cuda_graph_config": {"padding": True}}, "cuda_graph_config: unknown key 'padding'"),
        ({"tokenizer": "x"}, "unknown key 'tokenizer'"),
        ({"enable_chunked_prefill": False}, "enable_chunked_prefill: only True"),
        ({"kv_cache_config": {"page_size": 16}}, "kv_cache_config: unknown key 'page_size'"),
        ({"kv_cache_config": {"tokens_per_block": 6}}, "multiple of 4"),
        ({"kv_cache_config": {"tokens_per_block": "16"}}, "tokens_per_block: expected an int"),
        ({"kv_cache_config": [16]}, "expected a mapping"),
        ({"speculative_config": {"num_nextn_predict_layers": 2}}, "decoding_type: expected MTP or NGram"),
        ({"speculative_config": {"decoding_type": "Eagle"}}, "decoding_type: expected MTP or NGram"),
        ({"speculative_config": {"decoding_type": "MTP", "max_draft_len": 9}}, "max_draft_len must be in .1, 5."),
        (
            {"speculative_config": {"decoding_type": "MTP", "num_nextn_predict_layers": "2"}},
            "num_nextn_predict_layers: expected an int",
        ),
        (
            {"speculative_config": {"decoding_type": "MTP", "max_draft_len": 2, "num_nextn_predict_layers": 3}},
            "num_nextn_predict_layers is the old name of max_draft_len",
        ),
        ({"speculative_config": {"decoding_type": "NGram", "max_draft_len": 9}}, "max_draft_len must be in"),
        ({"speculative_config": {"decoding_type": "MTP", "max_concurrency": 0}}, "max_concurrency must be"),
        ({"speculative_config": {"decoding_type": "MTP", "draft_len_fn": 1}}, "unknown key 'draft_len_fn'"),
        ({"max_batch_size": "8"}, "max_batch_size: expected an int"),
        ({"max_batch_size": True}, "max_batch_size: expected an int"),
        ({"max_seq_len": 0}, "max_seq_len: must be >= 1"),
        ({"dtype": 16}, "dtype: expected a string"),
        ({"disable_overlap_scheduler": "no"}, "disable_overlap_scheduler: expected true or false"),
        ({"engine_process": "yes"}, "engine_process: expected true or false"),
        ({"http": "fast"}, "http: expected one of auto, httptools, h11, got 'fast'"),
        ({"loop": None}, "loop: expected one of auto, uvloop, asyncio, got None"),
    ],
)
def test_bad_options_name_the_key(options: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        llm_options_from_dict(options, source="opts.yaml")


def test_the_servers_keys_are_split_off() -> None:
    """``engine_process``, ``http`` and ``loop`` (serve's, not LLM's) are accepted and split off before the LLM is
    built."""
    opts = llm_options_from_dict({"max_batch_size": 4, "engine_process": False, "http": "h11", "loop": "uvloop"})
    assert split_serve_options(opts) == (
        {"max_batch_size": 4}, {"engine_process": False, "http": "h11", "loop": "uvloop"}
    )  # fmt: skip


def test_auto_values_of_kv_cache_config() -> None:
    """Fields that take an int or ``"auto"`` take ``auto`` from a YAML file too (it was refused as not an int); any
    other string is the class's error, naming the field."""
    kv = llm_options_from_dict({"kv_cache_config": {"checkpoint_interval": "auto", "checkpoint_max_bytes": "auto"}})
    assert kv["kv_cache_config"] == KvCacheConfig()
    with pytest.raises(ConfigError, match="checkpoint_interval must be a positive int, 'auto' or None, got 'often'"):
        llm_options_from_dict({"kv_cache_config": {"checkpoint_interval": "often"}})


def test_bad_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_llm_options(write(tmp_path, "- 1\n- 2\n"))
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_llm_options(write(tmp_path, "a: [1,\n"))
    with pytest.raises(ConfigError, match="cannot read"):
        load_llm_options(tmp_path / "missing.yaml")
