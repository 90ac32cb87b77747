"""The speculation registry (issue 46, item 1): a drafter registered in one place is what the LLM API, the YAML
options and the CLI run; an unknown decoding type is refused with the registered ones named."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from trtllm_glm import LLM, KvCacheConfig, SamplingParams
from trtllm_glm.cli import _speculative_config, build_parser
from trtllm_glm.config import ConfigError
from trtllm_glm.serve.config import llm_options_from_dict
from trtllm_glm.speculative.config import DecodingBaseConfig, MTPDecodingConfig, NGramDecodingConfig
from trtllm_glm.speculative.context import DraftContext, DraftResources
from trtllm_glm.speculative.drafters import DraftSeq, ParallelDrafter
from trtllm_glm.speculative.registry import (
    decoding_types,
    register_speculation,
    speculation_entry,
    unregister_speculation,
)

pytestmark = pytest.mark.cpu_only


# ---- A new drafter: everything it needs, in one place -------------------------------------------------------
@dataclass
class RepeatDecodingConfig(DecodingBaseConfig):
    """Propose the last token ``max_draft_len`` times."""

    max_draft_len: int = 3


class RepeatDrafter(ParallelDrafter):
    def __init__(self, max_draft_len: int) -> None:
        self.max_draft_len = max_draft_len

    def propose_seq(self, seq: DraftSeq) -> list[int]:
        return [seq.tokens[-1]] * seq.want


def build_repeat(ctx: DraftContext, spec: RepeatDecodingConfig) -> DraftResources:
    return DraftResources(RepeatDrafter(spec.max_draft_len))


@pytest.fixture
def repeat() -> Iterator[None]:
    register_speculation("Repeat", RepeatDecodingConfig, build_repeat)
    try:
        yield
    finally:
        unregister_speculation("Repeat")


# ------------------------------------------------------------------------------------------------------------
def test_builtin_types() -> None:
    assert decoding_types() == ["MTP", "NGram"]
    assert speculation_entry("mtp").config_cls is MTPDecodingConfig
    assert speculation_entry(NGramDecodingConfig()).cli_name == "ngram"


def test_registered_drafter_runs_end_to_end_and_lossless(repeat) -> None:
    """The toy drafter through the LLM API: its drafts are verified, and greedy output is plain greedy's."""
    kw = dict(device="cpu", kv_cache_config=KvCacheConfig(tokens_per_block=8), max_seq_len=128, max_batch_size=4)
    prompts = [[5, 6, 7, 7, 7], [1, 2, 3], [9] * 12]
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    plain = [o.outputs[0].token_ids for o in LLM("tiny", **kw).generate(prompts, params)]
    spec = LLM("tiny", speculative_config=RepeatDecodingConfig(max_draft_len=3), **kw)
    assert isinstance(spec.executor.drafter, RepeatDrafter)
    outs = spec.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in outs] == plain
    assert all(o.outputs[0].num_draft_rounds > 0 for o in outs)


def test_registered_drafter_reaches_yaml_and_cli(repeat) -> None:
    opts = llm_options_from_dict({"speculative_config": {"decoding_type": "repeat", "max_draft_len": 2}})
    assert opts["speculative_config"] == RepeatDecodingConfig(max_draft_len=2)
    args = build_parser().parse_args(["generate", "--prompt", "x", "--speculative", "repeat", "--draft-len", "5"])
    assert _speculative_config(args) == RepeatDecodingConfig(max_draft_len=5)


def test_draft_len_is_max_draft_len_everywhere() -> None:
    """``--draft-len`` and MTP's old ``num_nextn_predict_layers`` both set ``max_draft_len``."""
    for kind, cls in (("mtp", MTPDecodingConfig), ("ngram", NGramDecodingConfig)):
        args = build_parser().parse_args(["generate", "--prompt", "x", "--speculative", kind, "--draft-len", "2"])
        assert _speculative_config(args) == cls(max_draft_len=2)
    old = MTPDecodingConfig(num_nextn_predict_layers=4)
    assert old == MTPDecodingConfig(max_draft_len=4) and old.num_nextn_predict_layers == 4


def test_unknown_decoding_types_name_the_registered_ones(repeat, capsys) -> None:
    with pytest.raises(ValueError, match="unknown decoding_type 'Eagle': expected MTP, NGram or Repeat"):
        speculation_entry("Eagle")
    with pytest.raises(ConfigError, match="decoding_type: expected MTP, NGram or Repeat, got 'Eagle'"):
        llm_options_from_dict({"speculative_config": {"decoding_type": "Eagle"}})
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "--prompt", "x", "--speculative", "eagle"])
    assert "choose from 'mtp', 'ngram', 'repeat'" in capsys.readouterr().err

    @dataclass
    class Unregistered(DecodingBaseConfig):
        pass

    with pytest.raises(TypeError, match="one of MTPDecodingConfig, NGramDecodingConfig, RepeatDecodingConfig"):
        LLM("tiny", device="cpu", max_seq_len=64, max_batch_size=1, speculative_config=Unregistered())


def test_a_taken_name_or_class_is_refused(repeat) -> None:
    with pytest.raises(ValueError, match="registered already"):
        register_speculation("repeat", RepeatDecodingConfig, build_repeat)
    with pytest.raises(ValueError, match="RepeatDecodingConfig is registered already"):
        register_speculation("Other", RepeatDecodingConfig, build_repeat)
    with pytest.raises(TypeError, match="subclass DecodingBaseConfig"):
        register_speculation("Other", dict, build_repeat)  # type: ignore[arg-type]
