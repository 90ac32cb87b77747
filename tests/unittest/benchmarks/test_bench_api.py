"""`benchmarks/bench_api.py` on the CPU with tiny settings: every measurement runs (the uvicorn one in its child
process) and reports its fields; no timing is asserted."""

from __future__ import annotations

import math

import pytest

from benchmarks.bench_api import STAGES, main

pytestmark = pytest.mark.cpu_only


def test_reports_stages_bursts_and_chunks(capsys) -> None:
    row = main(["--concurrency", "4", "--bursts", "2", "--reps", "20", "--max-tokens", "4", "--step-ms", "2"])
    assert (row["concurrency"], row["prompt_len"], row["max_tokens"]) == (4, 30, 4)
    for stage in (*[s for s in STAGES if s != "submit"], "other", "to_submit", "to_start", "chunk"):
        assert math.isfinite(row[f"stage_{stage}_us"]), stage
    for kind in ("asgi", "http"):
        for name in ("last_submit_ms", "first_submit_ms", "to_submit_per_req_us", "first_chunk_us", "chunk_us",
                     "server_ttft_p50_ms", "server_first_chunk_p50_ms"):  # fmt: skip
            assert row[f"{kind}_{name}"] > 0, (kind, name)
        assert row[f"{kind}_last_submit_ms"] >= row[f"{kind}_first_submit_ms"]
    assert row["http_client_ttft_max_ms"] >= row["http_client_ttft_p50_ms"] > 0
    # The protocol class and loop that served the bursts (httptools / uvloop where installed: the serve extra).
    assert row["http_server"].split(", ")[0] in ("BoundedHttpToolsProtocol", "H11Protocol"), row["http_server"]
    out = capsys.readouterr().out
    assert "per request, one at a time" in out and "asgi burst of 4" in out and "http burst of 4" in out
    assert "client TTFT p50" in out and "server: uvicorn" in out
