"""``trtllm-glm`` as a new user meets it: help, version, one-line errors, and ``serve`` set-up."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import torch

from trtllm_glm import __version__
from trtllm_glm.cli import build_parser, main
from trtllm_glm.config import PRESETS

pytestmark = pytest.mark.cpu_only


def run_cli(argv: list[str], capsys) -> tuple[int, str, str]:
    try:
        rc = main(argv)
    except SystemExit as e:  # argparse: --help, --version, usage errors
        rc = int(e.code or 0)
    out, err = capsys.readouterr()
    return rc, out, err


def test_help_lists_presets_without_markup(capsys) -> None:
    rc, out, _ = run_cli(["--help"], capsys)
    assert rc == 0
    for name in PRESETS:
        assert name in out
    for cmd in ("generate", "serve", "indexer-demo"):
        assert cmd in out
    assert "`" not in out and "**" not in out
    rc, out, _ = run_cli(["serve", "--help"], capsys)
    assert rc == 0 and "MODEL" in out and "--config" in out and "`" not in out


def test_version(capsys) -> None:
    rc, out, _ = run_cli(["--version"], capsys)
    assert rc == 0 and out.strip() == f"trtllm-glm {__version__}"


def test_every_option_has_help() -> None:
    def walk(p: argparse.ArgumentParser):
        for a in p._actions:
            if isinstance(a, argparse._SubParsersAction):
                for sub in a.choices.values():
                    yield from walk(sub)
            else:
                yield p.prog, a

    for prog, a in walk(build_parser()):
        assert a.help and a.help.strip(), f"{prog} {a.option_strings or a.dest} has no help text"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["generate", "--prompt", "x", "--draft-len", "2"], "--draft-len needs --speculative"),
        (["generate", "--prompt", "x", "--draft-kv-mode", "separate"], "--draft-kv-mode needs --speculative"),
        (["generate", "--prompt", "x", "--speculative", "ngram", "--draft-kv-mode", "shared"], "mtp only"),
        (["generate", "--prompt", "x", "--draft-vocab-size", "32"], "--draft-vocab-size needs --speculative"),
        (["generate", "--prompt", "x", "--speculative", "ngram", "--draft-vocab-size", "32"], "no LM head"),
        (
            ["generate", "--preset", "tiny", "--prompt", "x", "--speculative", "mtp", "--draft-vocab-size", "32"],
            "needs a token-frequency ranking",
        ),
        (["generate", "--prompt", "x", "--check-lossless"], "needs --speculative"),
        (["generate", "--prompt", "x", "--speculative", "mtp", "--check-lossless", "--temperature", "1"], "greedy"),
        (["generate", "--prompt", "x", "--speculative", "mtp", "--draft-len", "9"], "--draft-len must be in [1, 5]"),
        (["generate", "--prompt", "x", "--top-p", "2"], "top_p"),
        (["generate", "--prompt", "x", "--temperature", "-1"], "temperature"),
        (["generate", "--prompt", "x", "--max-tokens", "0"], "max_tokens"),
        (["generate", "--prompt", "x", "--tokens-per-block", "6"], "multiple of 4"),
        (["generate", "--prompt", "x", "--device", "nonsense"], "got 'nonsense'"),
        (["generate", "--prompt", "x" * 300, "--max-seq-len", "64"], "leaves no room"),
        (["generate", "--model", "/nonexistent/ckpt", "--prompt", "x"], "neither a preset"),
        (["serve", "tiny", "--port", "0"], "--port"),
        (["serve", "tiny", "--max-queue-size", "-1"], "--max-queue-size"),
        (["serve", "/nonexistent/ckpt"], "neither a preset"),
        (["indexer-demo", "--tokens-per-block", "6"], "multiple of 4"),
    ],
)
def test_bad_usage_is_a_one_line_error(argv: list[str], message: str, capsys) -> None:
    rc, out, err = run_cli(argv, capsys)
    assert rc == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("trtllm-glm: error: "), err
    assert message in lines[0] and "Traceback" not in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA message")
@pytest.mark.parametrize("cmd", [["generate", "--prompt", "x"], ["indexer-demo"]])
def test_cuda_without_cuda_is_a_one_line_error(cmd: list[str], capsys) -> None:
    rc, _, err = run_cli([*cmd, "--device", "cuda"], capsys)
    assert (
        rc == 2
        and err.strip() == "trtllm-glm: error: --device 'cuda' asked for but CUDA is not available on this machine"
    )


def test_options_are_checked_before_the_model_is_built(monkeypatch, capsys) -> None:
    import trtllm_glm.runtime.llm as llm_mod

    def boom(*a, **k):
        raise AssertionError("the model must not be built for invalid options")

    monkeypatch.setattr(llm_mod.LLM, "__init__", boom)
    for argv in (["generate", "--prompt", "x", "--top-k", "-2"], ["generate", "--prompt", "x", "--draft-len", "2"]):
        rc, _, err = run_cli(argv, capsys)
        assert rc == 2 and "must not be built" not in err


def test_serve_config_errors_and_setup(tmp_path: Path, monkeypatch, capsys) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("max_batch_size: 4\ncuda_graph_configs: {}\n")
    rc, _, err = run_cli(["serve", "tiny", "--config", str(bad)], capsys)
    assert rc == 2 and "unknown key 'cuda_graph_configs'" in err and len(err.strip().splitlines()) == 1

    good = tmp_path / "good.yaml"
    good.write_text(
        "max_batch_size: 3\nmax_seq_len: 128\ndevice: cpu\nenable_chunked_prefill: true\n"
        "kv_cache_config: {tokens_per_block: 8}\nspeculative_config: {decoding_type: NGram, max_draft_len: 2}\n"
    )
    served = {}

    def fake_run(app, **kw):  # the real one blocks in uvicorn
        served.update(app=app, **kw)

    monkeypatch.setattr("trtllm_glm.serve.server.run_server", fake_run)
    rc, _, err = run_cli(
        ["serve", "tiny", "--config", str(good), "--port", "8123", "--max-queue-size", "5", "--no-engine-process"],
        capsys,
    )
    assert rc == 0, err
    eng = served["app"].state.engine
    assert served["port"] == 8123 and served["host"] == "127.0.0.1"
    assert eng.executor.cfg.max_batch_size == 3 and eng.capacity == 8 and eng.max_seq_len == 128
    assert eng.executor.spec.max_draft_len == 2 and not eng.running


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["generate", "--prompt", "x", "--speculative", "mtp", "--draft-len", "9"],
         "--draft-len must be in [1, 5] for --speculative mtp, got 9"),
        (["generate", "--prompt", "x", "--speculative", "ngram", "--draft-len", "8"],
         "--draft-len must be in [1, 7] for --speculative ngram, got 8"),
        (["generate", "--prompt", "ok", "--prompt", "caf\udce9"],
         "--prompt 2: not valid UTF-8 (byte 0xe9 at character 3)"),
        (["generate", "--prompt", "x", "--device", "tpu"], "--device must be cpu, cuda or cuda:N"),
    ],
)  # fmt: skip
def test_messages_name_what_the_user_wrote(argv: list[str], message: str, capsys) -> None:
    """Issue 45, item 7: the flag the user gave, not the config field it becomes; invalid UTF-8 bytes called
    that, not a lone surrogate; an unknown device without torch's list of every backend."""
    rc, _, err = run_cli(argv, capsys)
    assert rc == 2 and err.strip().startswith(f"trtllm-glm: error: {message}"), err
    assert len(err.strip().splitlines()) == 1 and "'mps'" not in err  # torch's list of every backend
    assert "num_nextn_predict_layers" not in err and "surrogate" not in err


def test_ctrl_c_is_one_line(monkeypatch, capsys) -> None:
    """Issue 45, item 4: Ctrl-C during generate (or a second one to serve) ends with a line and status 130."""
    import trtllm_glm.cli as cli

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "_cmd_generate", interrupted)
    parser = cli.build_parser
    monkeypatch.setattr(cli, "build_parser", lambda: _with_func(parser(), interrupted))
    rc, _, err = run_cli(["generate", "--prompt", "x"], capsys)
    assert rc == 130 and err.strip() == "trtllm-glm: interrupted" and "Traceback" not in err


def _with_func(parser: argparse.ArgumentParser, fn) -> argparse.ArgumentParser:
    parser.set_defaults(func=fn)
    for action in parser._subparsers._group_actions:  # type: ignore[union-attr]
        for sub in action.choices.values():
            sub.set_defaults(func=fn)
    return parser


def test_serve_refuses_a_port_in_use_before_loading(monkeypatch, capsys) -> None:
    """The address is bound before the model loads: a port in use is a one-line error at once (and nothing the
    server starts meanwhile, such as a parallel world's rendezvous port, can take it)."""
    import socket

    import trtllm_glm.runtime.llm as llm_mod

    def boom(*a, **k):
        raise AssertionError("the model must not be built when the port is taken")

    monkeypatch.setattr(llm_mod.LLM, "__init__", boom)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        rc, _, err = run_cli(["serve", "tiny", "--port", str(port)], capsys)
    assert rc == 2 and f"cannot listen on 127.0.0.1:{port}" in err and len(err.strip().splitlines()) == 1, err
