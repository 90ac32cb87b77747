"""Write benchmarks/results/README.md from benchmarks/results/manifest.json (``--check``: only compare).

Usage: ``python -m benchmarks.results_index [--check]``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"
MANIFEST = RESULTS / "manifest.json"
INDEX = RESULTS / "README.md"


def load(path: Path = MANIFEST) -> dict[str, Any]:
    return json.loads(path.read_text(encoding="utf-8"))


def listed_files(manifest: dict[str, Any]) -> set[str]:
    """Every file the manifest's rows name, relative to the results folder."""
    return {f for s in manifest["sections"] for r in s["rows"] for f in r["files"]}


def files_cell(files: list[str], note: str | None) -> str:
    """Links to a row's files, one per run (a ``.json`` beside its ``.log`` joins the log's link)."""
    runs: dict[str, list[str]] = {}
    for f in files:
        runs.setdefault(f.rsplit(".", 1)[0], []).append(f)
    parts = []
    for group in runs.values():
        main, *rest = sorted(group, key=lambda f: (not f.endswith((".log", ".md")), f))
        link = f"[`{main.rsplit('/', 1)[-1]}`]({main})"
        parts.append(link + "".join(f" ([{f.rsplit('.', 1)[1]}]({f}))" for f in rest))
    return ", ".join(parts) + (f" {note}" if note else "")


def render(manifest: dict[str, Any]) -> str:
    """The index page."""
    out = ["# Benchmark results", "", manifest["intro"], ""]
    for s in manifest["sections"]:
        first = s["first_column"]
        out += [f"## {s['title']}", "", f"| {first} | number | files | date | commit |", "|---|---|---|---|---|"]
        for r in s["rows"]:
            cells = [r[first], r.get("number", ""), files_cell(r["files"], r.get("file_note")), r["date"], r["commit"]]
            out.append("| " + " | ".join(cells) + " |")
        out.append("")
    return "\n".join(out)


def problems(manifest: dict[str, Any], index_text: str) -> list[str]:
    """What is out of step: the page, files not listed, listed files missing."""
    found = {p.relative_to(RESULTS).as_posix() for p in RESULTS.rglob("*") if p.is_file()} - {
        INDEX.name,
        MANIFEST.name,
    }
    listed = listed_files(manifest)
    out = [f"not in the manifest: {f}" for f in sorted(found - listed)]
    out += [f"in the manifest, missing: {f}" for f in sorted(listed - found)]
    if index_text != render(manifest):
        out.append(f"{INDEX} is out of date: run python -m benchmarks.results_index")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="only report what is out of step (exit 1 if anything)")
    args = ap.parse_args(argv)
    manifest = load()
    if not args.check:
        INDEX.write_text(render(manifest), encoding="utf-8")
    found = problems(manifest, INDEX.read_text(encoding="utf-8"))
    for p in found:
        print(p, file=sys.stderr)
    return 1 if found else 0


if __name__ == "__main__":
    raise SystemExit(main())
