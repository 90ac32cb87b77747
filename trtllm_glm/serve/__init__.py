"""``trtllm-glm serve``: an OpenAI-compatible HTTP server on an async continuous-batching engine.

- `engine`: `AsyncEngine`, one background thread stepping the executor for many asyncio callers (the
  runtime's engine, `trtllm_glm.runtime.async_engine`, which `LLM.generate_async` shares, with metrics).
- `engine_client`, `engine_core`, `engine_messages`: the engine in a process of its own (the server's default):
  the API process's `EngineClient`, the engine process, and the ZeroMQ / msgspec messages between them.
- `app`: the FastAPI app (OpenAI routes, health, version, ``/metrics``).
- `output`: incremental detokenization and stop strings (`trtllm_glm.runtime.output`).
- `chat`: chat templates. `config`: the YAML options file. `metrics`: Prometheus metrics.

Needs the ``serve`` extra (``pip install -e ".[serve]"``).
"""

from __future__ import annotations

from .engine import AsyncEngine, Delta, EngineStoppedError, GenerationRequest, QueueFullError, ResultStream

__all__ = ["AsyncEngine", "Delta", "EngineStoppedError", "GenerationRequest", "QueueFullError", "ResultStream"]
