"""/metrics counts the prefix reuse lost (issue 34): cached pages that no checkpoint let a request skip."""

from __future__ import annotations

import pytest

from tests.serve_helpers import MODEL, client, make_llm, metric, run, wait_idle
from trtllm_glm import KvCacheConfig
from trtllm_glm.serve.app import build_app
from trtllm_glm.serve.engine import AsyncEngine

pytestmark = pytest.mark.cpu_only

NAMES = ("trtllm:prefix_cache_lost_requests_total", "trtllm:prefix_cache_lost_tokens_total",
         "trtllm:prefix_cache_reused_tokens_total")  # fmt: skip
# 88 byte tokens, and "Q: " after it: the prompts share 91 tokens, 11 full pages of 8 (page 10 ends at token
# 88, and its key covers token 88 too).
SYSTEM = "You are a careful assistant. Answer briefly.\n" * 2


def serve(kv: KvCacheConfig, questions: list[str]) -> tuple[dict[str, float], AsyncEngine]:
    eng = AsyncEngine(make_llm(kv_cache_config=kv), max_queue_size=8)
    app = build_app(eng, served_model_name=MODEL, manage_engine=False)
    eng.start()
    try:

        async def main():
            async with client(app) as c:
                for q in questions:  # one after another
                    r = await c.post("/v1/completions", json={"prompt": SYSTEM + q, "max_tokens": 2})
                    assert r.status_code == 200

        run(main())
        wait_idle(eng)
        return {n: metric(app, n) for n in NAMES}, eng
    finally:
        eng.stop(drain_timeout=0)


def test_lost_reuse_is_counted_when_no_checkpoint_can_serve() -> None:
    got, eng = serve(KvCacheConfig(tokens_per_block=8, max_checkpoints=0), ["Q: one?", "Q: two?", "Q: six?"])
    assert got["trtllm:prefix_cache_lost_requests_total"] == 2
    assert got["trtllm:prefix_cache_lost_tokens_total"] == 2 * 88
    assert got["trtllm:prefix_cache_reused_tokens_total"] == 0
    assert eng.stats()["prefix_cache_lost_tokens"] == 2 * 88
    assert metric(eng, "trtllm:prefix_cache_checkpoints_skipped_total") > 0


def test_no_reuse_is_lost_once_the_branch_point_is_checkpointed() -> None:
    got, eng = serve(KvCacheConfig(tokens_per_block=8), ["Q: one?", "Q: two?", "Q: six?", "Q: ten?"])
    # The second request recomputes the system prompt once and checkpoints its end; the others restore it.
    assert got["trtllm:prefix_cache_lost_requests_total"] == 1
    assert got["trtllm:prefix_cache_reused_tokens_total"] >= 2 * 88
    assert metric(eng, "trtllm:prefix_cache_checkpoint_bytes") > 0
