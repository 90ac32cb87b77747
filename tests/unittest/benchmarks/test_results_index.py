"""benchmarks/results/: the index page is the one `benchmarks.results_index` generates from the manifest, every
file there is listed in the manifest and every file the manifest lists exists."""

from __future__ import annotations

import pytest

from benchmarks import results_index

pytestmark = pytest.mark.cpu_only


def test_index_is_generated_and_every_file_is_reachable() -> None:
    manifest = results_index.load()
    assert results_index.problems(manifest, results_index.INDEX.read_text(encoding="utf-8")) == []


def test_files_cell_joins_a_runs_json_to_its_log() -> None:
    cell = results_index.files_cell(["e2e/a_2026-12-01.json", "e2e/a_2026-12-01.log", "e2e/b_2026-12-02.json"], "(x)")
    assert cell == (
        "[`a_2026-12-01.log`](e2e/a_2026-12-01.log) ([json](e2e/a_2026-12-01.json)), "
        "[`b_2026-12-02.json`](e2e/b_2026-12-02.json) (x)"
    )
