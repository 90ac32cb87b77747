"""Fixtures of the server tests: one tiny-preset LLM and a running engine per module."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from tests.serve_helpers import MODEL, make_llm
from trtllm_glm import LLM
from trtllm_glm.serve.app import build_app
from trtllm_glm.serve.engine import AsyncEngine


@pytest.fixture(scope="module")
def llm() -> LLM:
    return make_llm()


@pytest.fixture(scope="module")
def engine(llm: LLM) -> Iterator[AsyncEngine]:
    """A running engine over the module's LLM (do not call ``llm.generate`` while it runs)."""
    eng = AsyncEngine(llm, max_queue_size=8)
    eng.start()
    yield eng
    eng.stop(drain_timeout=0)


@pytest.fixture(scope="module")
def app(engine: AsyncEngine) -> Any:
    return build_app(engine, served_model_name=MODEL, manage_engine=False)
