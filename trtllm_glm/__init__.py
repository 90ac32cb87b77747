"""trtllm_glm: a TensorRT-LLM-style backend for GLM-5.3-Flash-class hybrid models."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# Lazy exports keep `import trtllm_glm` cheap (no model or kernel imports until used).
_EXPORTS = {
    "Glm5NextConfig": "trtllm_glm.config",
    "Glm5NextCacheManager": "trtllm_glm.cache.manager",
    "Glm5NextForCausalLM": "trtllm_glm.models.glm5_next",
    "LLM": "trtllm_glm.runtime.llm",
    "KvCacheConfig": "trtllm_glm.runtime.llm",
    "CudaGraphConfig": "trtllm_glm.runtime.cuda_graph",
    "RequestOutput": "trtllm_glm.runtime.llm",
    "SamplingParams": "trtllm_glm.runtime.sampling",
    "GuidedDecodingParams": "trtllm_glm.runtime.grammar",
    "MTPDecodingConfig": "trtllm_glm.speculative.config",
    "NGramDecodingConfig": "trtllm_glm.speculative.config",
}

__all__ = [
    "LLM",
    "CudaGraphConfig",
    "Glm5NextCacheManager",
    "Glm5NextConfig",
    "Glm5NextForCausalLM",
    "GuidedDecodingParams",
    "KvCacheConfig",
    "MTPDecodingConfig",
    "NGramDecodingConfig",
    "RequestOutput",
    "SamplingParams",
]

if TYPE_CHECKING:
    from .cache.manager import Glm5NextCacheManager
    from .config import Glm5NextConfig
    from .models.glm5_next import Glm5NextForCausalLM
    from .runtime.cuda_graph import CudaGraphConfig
    from .runtime.grammar import GuidedDecodingParams
    from .runtime.llm import LLM, KvCacheConfig, RequestOutput
    from .runtime.sampling import SamplingParams
    from .speculative.config import MTPDecodingConfig, NGramDecodingConfig


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'trtllm_glm' has no attribute {name!r}")
