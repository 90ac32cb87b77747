"""The server's `AsyncEngine`: the runtime's engine (`trtllm_glm.runtime.async_engine`, which
`LLM.generate_async` also runs on) recording into Prometheus `ServeMetrics` by default."""

from __future__ import annotations

from typing import Any

from ..runtime.async_engine import AsyncEngine as _RuntimeEngine
from ..runtime.async_engine import (
    Delta,
    EngineError,
    EngineStoppedError,
    GenerationRequest,
    QueueFullError,
    ResultStream,
)
from .metrics import ServeMetrics

__all__ = [
    "AsyncEngine",
    "GenerationRequest",
    "Delta",
    "ResultStream",
    "EngineError",
    "QueueFullError",
    "EngineStoppedError",
]


class AsyncEngine(_RuntimeEngine):
    """`trtllm_glm.runtime.async_engine.AsyncEngine` with ``metrics`` defaulting to a new `ServeMetrics`
    (its own registry), which ``/metrics`` renders."""

    def __init__(
        self,
        llm: Any,
        *,
        max_queue_size: int = 64,
        metrics: ServeMetrics | None = None,
        step_log: Any = None,
        detokenize: bool = True,
    ) -> None:
        super().__init__(
            llm, max_queue_size=max_queue_size, metrics=metrics if metrics is not None else ServeMetrics(),
            step_log=step_log, detokenize=detokenize,
        )  # fmt: skip
