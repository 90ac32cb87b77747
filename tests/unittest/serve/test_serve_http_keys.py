"""``trtllm-glm serve``'s HTTP parser and event loop from a deployment: the ``http`` / ``loop`` keys of the ``--config``
file and the ``--http`` / ``--loop`` flags reach the server (its start-up line names the pair that runs), and a bad or
unavailable one is a one-line error before anything starts."""

from __future__ import annotations

import gc
import importlib.metadata as md
import os
import socket
import sys
import types
from pathlib import Path
from typing import Any

import pytest

from trtllm_glm import cli
from trtllm_glm.cli import main
from trtllm_glm.serve.http_loop import HTTP_CHOICES, LOOP_CHOICES, _importable
from trtllm_glm.serve.server import DrainingServer

pytestmark = pytest.mark.cpu_only


HAVE_C = _importable("httptools") and _importable("uvloop")
# CI installs the serve extra and sets TRTLLM_GLM_REQUIRE_SERVE=1: there the C pair's test runs (and fails) without it.
C_REQUIRED = os.environ.get("TRTLLM_GLM_REQUIRE_SERVE") == "1"


def run_cli(argv: list[str], capsys) -> tuple[int, str]:
    try:
        rc = main(argv)
    except SystemExit as e:  # argparse: a bad choice
        rc = int(e.code or 0)
    return rc, capsys.readouterr().err


@pytest.fixture
def served(monkeypatch) -> list[DrainingServer]:
    """The servers `trtllm-glm serve` builds, through the real `run_server` and `make_server`, without a model (a
    stand-in app) and without serving (uvicorn's ``run`` returns at once)."""
    built: list[DrainingServer] = []

    def fake_app(model: Any, options: Any, **kw: Any) -> Any:
        return types.SimpleNamespace(state=types.SimpleNamespace(engine=types.SimpleNamespace()))

    monkeypatch.setattr("trtllm_glm.serve.server.make_app", fake_app)
    monkeypatch.setattr(DrainingServer, "run", lambda self, sockets=None: built.append(self))
    monkeypatch.setattr(gc, "freeze", lambda: None)  # run_server's: not in the test process
    return built


@pytest.fixture
def no_model(monkeypatch) -> None:
    """Building an app (a model) fails the test: errors must come before."""

    def boom(*a: Any, **k: Any) -> Any:
        raise AssertionError("nothing may start for a bad http / loop")

    monkeypatch.setattr("trtllm_glm.serve.server.make_app", boom)


def free_port() -> str:
    """A loopback port free now (the CLI binds it before anything else)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def options_file(tmp_path: Path, text: str) -> str:
    p = tmp_path / "opts.yaml"
    p.write_text(text)
    return str(p)


def pure_pair_line() -> str:
    return f"parser h11 {md.version('h11')} (asked for), event loop asyncio (asked for)"


def test_the_yaml_keys_reach_the_server(tmp_path: Path, served, capsys) -> None:
    cfg = options_file(tmp_path, "max_batch_size: 2\nhttp: h11\nloop: asyncio\n")
    rc, err = run_cli(["serve", "tiny", "--config", cfg, "--port", free_port()], capsys)
    assert rc == 0, err
    (server,) = served
    assert server.http_loop == ("h11", "asyncio")
    assert server.config.loop == "asyncio" and server.config.http == "h11"
    assert pure_pair_line() in err, err


def test_the_flags_reach_the_server_and_override_the_yaml(tmp_path: Path, served, capsys) -> None:
    cfg = options_file(tmp_path, "http: auto\nloop: auto\n")
    rc, err = run_cli(["serve", "tiny", "--config", cfg, "--port", free_port(), "--http", "h11", "--loop", "asyncio"],
                      capsys)  # fmt: skip
    assert rc == 0, err
    assert served[0].http_loop == ("h11", "asyncio") and pure_pair_line() in err, err


def test_one_flag_leaves_the_other_auto(served, capsys) -> None:
    rc, err = run_cli(["serve", "tiny", "--port", free_port(), "--loop", "asyncio"], capsys)
    assert rc == 0, err
    http = "httptools" if _importable("httptools") else "h11"
    assert served[0].http_loop == (http, "asyncio")
    line = next(x for x in err.splitlines() if "HTTP: uvicorn" in x)
    assert f"parser {http} {md.version(http)}" in line and "event loop asyncio (asked for)" in line, line


@pytest.mark.skipif(not HAVE_C and not C_REQUIRED, reason="httptools / uvloop not installed")
def test_the_c_pair_by_name(tmp_path: Path, served, capsys) -> None:
    cfg = options_file(tmp_path, "http: httptools\nloop: uvloop\n")
    rc, err = run_cli(["serve", "tiny", "--config", cfg, "--port", free_port()], capsys)
    assert rc == 0, err
    assert served[0].http_loop == ("httptools", "uvloop")
    want = (
        f"parser httptools {md.version('httptools')} (asked for), event loop uvloop {md.version('uvloop')} (asked for)"
    )
    assert want in err, err


@pytest.mark.parametrize(
    ("yaml", "argv", "message"),
    [
        ("http: fast\n", [], "opts.yaml: http: expected one of auto, httptools, h11, got 'fast'"),
        ("loop: trio\n", [], "opts.yaml: loop: expected one of auto, uvloop, asyncio, got 'trio'"),
        ("loop: true\n", [], "opts.yaml: loop: expected one of auto, uvloop, asyncio, got True"),
        ("", ["--http", "fast"], "argument --http: invalid choice: 'fast'"),
        ("", ["--loop", "trio"], "argument --loop: invalid choice: 'trio'"),
    ],
)
def test_bad_values_are_refused_before_anything_starts(
    yaml: str, argv: list[str], message: str, tmp_path: Path, no_model, capsys
) -> None:
    cfg = options_file(tmp_path, yaml or "{}\n")
    rc, err = run_cli(["serve", "tiny", "--config", cfg, "--port", free_port(), *argv], capsys)
    assert rc == 2 and message in err and "Traceback" not in err, err


@pytest.mark.parametrize(
    ("yaml", "argv", "message"),
    [
        ("", ["--http", "httptools"], "--http httptools: httptools is not installed (pip install "
         "'trtllm_glm[serve]'), or choose h11"),
        ("loop: uvloop\n", [], "{cfg}: loop: uvloop is not installed (pip install 'trtllm_glm[serve]'), or choose "
         "asyncio"),
        ("http: httptools\n", ["--loop", "uvloop"], "{cfg}: http: httptools is not installed"),
    ],
)  # fmt: skip
def test_a_c_one_not_installed_is_an_error_not_a_fallback(
    yaml: str, argv: list[str], message: str, tmp_path: Path, no_model, monkeypatch, capsys
) -> None:
    monkeypatch.setitem(sys.modules, "httptools", None)  # as if not installed: importing it raises ImportError
    monkeypatch.setitem(sys.modules, "uvloop", None)
    cfg = options_file(tmp_path, yaml or "{}\n")
    rc, err = run_cli(["serve", "tiny", "--config", cfg, "--port", free_port(), *argv], capsys)
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 1, err
    assert lines[0].startswith("trtllm-glm: error: " + message.format(cfg=cfg)), err


def test_the_flags_choices_are_the_servers() -> None:
    """The CLI writes the choices out (building its parser imports nothing of the server): they must not drift."""
    assert cli._HTTP_CHOICES == HTTP_CHOICES and cli._LOOP_CHOICES == LOOP_CHOICES
