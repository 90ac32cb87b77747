"""Build the engine and app for ``trtllm-glm serve`` and run them under uvicorn."""

from __future__ import annotations

import os
from typing import Any

from .app import build_app
from .chat import load_chat_template
from .engine import AsyncEngine

__all__ = ["make_app", "run_server"]


def make_app(
    model: str | os.PathLike[str],
    llm_options: dict[str, Any] | None = None,
    *,
    served_model_name: str | None = None,
    max_queue_size: int = 64,
    drain_timeout: float = 30.0,
) -> Any:
    """Build the `LLM`, its `AsyncEngine` and the app (the engine starts with the app).

    Args:
        model: preset name or checkpoint directory, as ``LLM(model=...)``.
        llm_options: ``LLM`` keyword arguments (`load_llm_options`).
        served_model_name: the name clients use (default: ``model`` as given).
        max_queue_size: generations that may queue beyond the running batch.
        drain_timeout: seconds in-flight requests get at shutdown.
    """
    from ..runtime.llm import LLM

    template = load_chat_template(model)  # a broken template fails before the model is built
    llm = LLM(model=model, **(llm_options or {}))
    engine = AsyncEngine(llm, max_queue_size=max_queue_size)
    return build_app(
        engine, served_model_name=served_model_name or os.fspath(model), chat_template=template,
        drain_timeout=drain_timeout,
    )  # fmt: skip


def run_server(app: Any, *, host: str, port: int, log_level: str = "info", drain_timeout: float = 30.0) -> None:
    """Serve ``app`` until SIGINT / SIGTERM; in-flight requests get ``drain_timeout`` seconds to finish."""
    import uvicorn

    uvicorn.run(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=drain_timeout)
