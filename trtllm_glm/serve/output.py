"""Output processing for the server: the runtime's (`trtllm_glm.runtime.output`), shared with the LLM API."""

from __future__ import annotations

from ..runtime.output import IncrementalDetokenizer, OutputProcessor, TokenStrings

__all__ = ["IncrementalDetokenizer", "OutputProcessor", "TokenStrings"]
