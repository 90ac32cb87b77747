"""What a user meets first through the Python API (issue 33): bad models, bad prompts and bad arguments are
one clear error naming the argument, the same checks as the server's; a checkpoint without a tokenizer
still serves token-id prompts."""

from __future__ import annotations

import json

import pytest

from trtllm_glm import LLM, SamplingParams
from trtllm_glm.cli import main as cli_main
from trtllm_glm.config import PRESETS, ConfigError, Glm5NextConfig
from trtllm_glm.models.glm5_next import Glm5NextForCausalLM

pytestmark = pytest.mark.cpu_only


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(model="tiny", device="cpu", max_seq_len=64)


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> str:
    d = tmp_path_factory.mktemp("tiny_ckpt")
    Glm5NextForCausalLM.from_pretrained("tiny").save_pretrained(d)
    return str(d)


def test_a_file_is_never_a_model(saved, capsys) -> None:
    """`--model DIR/config.json` used to serve seeded random weights and exit 0."""
    path = f"{saved}/config.json"
    with pytest.raises(ConfigError, match="is a file; give the checkpoint directory"):
        LLM(model=path, device="cpu")
    for argv in (["generate", "--model", path, "--prompt", "x", "--device", "cpu"], ["serve", path]):
        assert cli_main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "config.json' is a file" in err[0], err
    # The directory itself loads (and is not the random preset: the saved weights come back).
    assert LLM(model=saved, device="cpu").generate([5, 6, 7], SamplingParams(max_tokens=3)).outputs[0].token_ids


@pytest.mark.parametrize(
    ("cfg", "match"),
    [({}, "lacks required key.*vocab_size, hidden_size, num_hidden_layers, num_attention_heads"),
     ({"model_type": "glm5_next", "text_config": {"vocab_size": 300}}, "text_config lacks required key.*hidden_size")],
)  # fmt: skip
def test_config_without_the_geometry_is_refused(tmp_path, cfg, match) -> None:
    """An empty config.json used to become the full model ("need about 583.8 GiB")."""
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match=match) as e:
        LLM(model=str(tmp_path), device="cpu")
    assert "GiB" not in str(e.value)


def test_checkpoint_without_tokenizer_and_low_special_ids(tmp_path) -> None:
    """Special ids below 256 rule out the byte tokenizer: the model loads anyway, token-id prompts run and
    text prompts get an error naming the missing tokenizer.json."""
    cfg = Glm5NextConfig.from_dict({**PRESETS["tiny"], "vocab_size": 320, "pad_token_id": 0, "bos_token_id": 1,
                                    "eos_token_id": 2})  # fmt: skip
    Glm5NextForCausalLM.from_config(cfg, seed=0).save_pretrained(tmp_path)
    llm = LLM(model=str(tmp_path), device="cpu", max_seq_len=64)
    out = llm.generate([5, 6, 7], SamplingParams(max_tokens=4, ignore_eos=True)).outputs[0]
    assert len(out.token_ids) == 4 and out.text == ""
    with pytest.raises(ValueError, match="has no tokenizer.json.*token-id prompts"):
        llm.generate("hello")
    assert not llm.executor.has_work


@pytest.mark.parametrize(
    ("call", "exc", "match"),
    [
        (lambda llm: llm.generate({"a": 1}), TypeError, "prompts must be a string.*got dict"),
        (lambda llm: llm.generate(None), TypeError, "prompts must be a string.*got NoneType"),
        (lambda llm: llm.generate(["p"], "greedy"), TypeError, "sampling_params must be a SamplingParams.*got str"),
        (lambda llm: llm.generate(["p", "q"], [SamplingParams()]), ValueError, "1 given for 2 prompts"),
        (lambda llm: llm.generate(["p"], [None]), TypeError, "expected SamplingParams items, got NoneType"),
        (lambda llm: llm.generate("hi", SamplingParams(max_tokens=10**9)), ValueError,
         "maximum context length is 64 tokens.*lower max_tokens to at most 61"),
        (lambda llm: llm.generate([1, 2], SamplingParams(max_tokens=63)), ValueError, "at most 62"),
        (lambda llm: llm.generate(list(range(64))), ValueError, "prompt has 64 tokens, which leaves no room"),
        (lambda llm: llm.generate("hi", SamplingParams(stop_token_ids=[10**9])), ValueError,
         r"stop_token_ids: 1000000000 is outside the vocabulary \[0, 264\)"),
        (lambda llm: llm.generate(["ok", "\ud800abc"]), ValueError, "prompt 1: not valid Unicode text.*surrogate"),
        (lambda llm: llm.generate([[]]), ValueError, "prompt 0: the prompt is empty"),
        (lambda llm: llm.generate([[5, 300]]), ValueError, "token id 300 is outside the vocabulary"),
    ],
)  # fmt: skip
def test_bad_requests_name_the_argument(llm, call, exc, match) -> None:
    with pytest.raises(exc, match=match):
        call(llm)
    assert not llm.executor.has_work  # nothing was queued


@pytest.mark.parametrize(
    ("kw", "match"),
    [({"max_seq_len": 0}, "max_seq_len must be an int >= 1, got 0"), ({"max_seq_len": 1}, "max_seq_len must be >= 2"),
     ({"max_batch_size": 0}, "max_batch_size must be an int >= 1"), ({"max_num_tokens": -3}, "max_num_tokens")],
)  # fmt: skip
def test_bad_llm_sizes_name_the_argument(kw, match) -> None:
    with pytest.raises(ValueError, match=match):
        LLM(model="tiny", device="cpu", **kw)


def test_cli_max_tokens_beyond_max_seq_len_is_an_error(capsys) -> None:
    """``--max-seq-len 8 --max-tokens 32`` used to return 6 tokens silently."""
    rc = cli_main(["generate", "--preset", "tiny", "--device", "cpu", "--prompt", "ab", "--max-seq-len", "8",
                   "--max-tokens", "32"])  # fmt: skip
    err = capsys.readouterr().err
    assert rc == 2 and "maximum context length is 8 tokens" in err and "max_tokens to at most 5" in err


def test_cli_shows_load_progress_of_a_sharded_checkpoint(tmp_path, capsys) -> None:
    import logging

    Glm5NextForCausalLM.from_pretrained("tiny").save_pretrained(tmp_path, max_shard_bytes=3_000_000)
    handlers = list(logging.getLogger("trtllm_glm").handlers)
    argv = ["generate", "--model", str(tmp_path), "--prompt", "hi", "--max-tokens", "2", "--device", "cpu"]
    assert cli_main(argv) == 0
    cap = capsys.readouterr()
    assert "reading shard 1/4" in cap.err and "reading shard 4/4" in cap.err and "shard" not in cap.out
    assert logging.getLogger("trtllm_glm").handlers == handlers  # the command's handler is gone
