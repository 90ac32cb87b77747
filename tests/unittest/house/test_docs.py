"""The documentation runs as written: every fenced ``python`` block of README.md and docs/*.md executes on
the CPU (blocks of one page share a namespace, in order), the files the docs name exist, and README keeps
its two set-up commands, the second being what ``.ci/run`` runs."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.cpu_only

ROOT = Path(__file__).resolve().parents[3]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)


def blocks(page: Path, lang: str) -> list[str]:
    return [body for kind, body in FENCE.findall(page.read_text(encoding="utf-8")) if kind == lang]


@pytest.mark.parametrize("page", [p for p in PAGES if blocks(p, "python")], ids=lambda p: p.name)
def test_python_blocks_run(page: Path, capsys) -> None:
    ns: dict = {"__name__": f"docs_{page.stem}"}
    for i, code in enumerate(blocks(page, "python")):
        try:
            # dont_inherit: a block runs as written, without this file's ``from __future__ import annotations``
            # (string annotations would send a block's dataclass looking for its module in sys.modules).
            exec(compile(code, f"{page.name}[python block {i}]", "exec", dont_inherit=True), ns)
        except Exception as e:
            raise AssertionError(f"{page.relative_to(ROOT)}: python block {i} failed: {type(e).__name__}: {e}") from e
    capsys.readouterr()


def test_named_files_exist() -> None:
    """Paths the pages name (``examples/...``, ``benchmarks/...``, ``docs/...``) exist, and so do the result
    files they name alone (``e2e_..._2026-12-01.log``: in a topic folder of benchmarks/results/)."""
    pat = re.compile(r"(?<![\w/.])((?:examples|benchmarks|docs|scripts|tests)/[\w./-]+\.(?:py|md|yaml|log|jsonl|json))")
    result = re.compile(r"(?<![\w/.-])([\w-]+_20\d\d-\d\d-\d\d\w*\.(?:log|json|md))")
    results = {p.name for p in (ROOT / "benchmarks" / "results").rglob("*") if p.is_file()}
    missing = []
    for page in [*PAGES, ROOT / "benchmarks" / "results" / "README.md"]:
        text = page.read_text(encoding="utf-8")
        for path in set(pat.findall(text)):
            if not (ROOT / path).exists():
                missing.append(f"{page.name}: {path}")
        for name in set(result.findall(text)):
            if name not in results:
                missing.append(f"{page.name}: {name}")
    assert not missing, missing


def test_examples_options_file_loads() -> None:
    pytest.importorskip("yaml")
    from trtllm_glm.serve.config import load_llm_options

    opts = load_llm_options(str(ROOT / "examples" / "serve_options.yaml"))
    assert opts["speculative_config"].max_draft_len == 3 and opts["max_batch_size"] == 8


def test_readme_keeps_the_two_set_up_commands() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    cmds = [b.strip() for b in blocks(ROOT / "README.md", "bash") if b.strip().startswith("bash scripts/bootstrap.sh")]
    assert len(cmds) == 2 and "trtllm-glm generate" in cmds[0], cmds
    test_cmd = cmds[1].split("&& ", 1)[1]
    assert test_cmd in (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert len(readme.splitlines()) <= 150
