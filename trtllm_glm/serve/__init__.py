"""``trtllm-glm serve``: an OpenAI-compatible HTTP server on an async continuous-batching engine.

`engine` (the runtime's `AsyncEngine` with metrics); `engine_client`, `engine_core`, `engine_messages` (the engine in
a process of its own, the default); `app` (the FastAPI app); `output` (detokenization and stop strings); `chat`,
`config`, `metrics`. Needs the ``serve`` extra (``pip install -e ".[serve]"``). docs/serving.md.
"""

from __future__ import annotations

from .engine import AsyncEngine, Delta, EngineStoppedError, GenerationRequest, QueueFullError, ResultStream

__all__ = ["AsyncEngine", "Delta", "EngineStoppedError", "GenerationRequest", "QueueFullError", "ResultStream"]
