"""Precision of the indexer's pooled keys in the paged cache (``KvCacheConfig.indexer_key_dtype``).

``"fp8"`` (default): e4m3 keys after a Hadamard rotation, one power-of-two fp32 scale per pool (132 bytes
per pool). ``"bf16"``: the pooled key rounded to bfloat16, unrotated and unscaled (256 bytes per pool, no
scale plane), the way TensorRT-LLM stores them; queries are then bf16 too (docs/indexer_keys.md).
"""

from __future__ import annotations

import torch

from ..config import INDEX_HEAD_DIM

__all__ = ["INDEXER_KEY_DTYPES", "indexer_key_dtype", "index_key_bytes_per_pool"]

INDEXER_KEY_DTYPES: dict[str, torch.dtype] = {"fp8": torch.float8_e4m3fn, "bf16": torch.bfloat16}
"""Option name -> storage dtype of ``index_k``."""


def indexer_key_dtype(name: str | torch.dtype) -> torch.dtype:
    """The storage dtype of an ``indexer_key_dtype`` option (a name of `INDEXER_KEY_DTYPES` or its dtype).

    Raises:
        ValueError: anything else (one line naming the allowed values).
    """
    if isinstance(name, torch.dtype) and name in INDEXER_KEY_DTYPES.values():
        return name
    if isinstance(name, str) and name.lower() in INDEXER_KEY_DTYPES:
        return INDEXER_KEY_DTYPES[name.lower()]
    raise ValueError(f"indexer_key_dtype must be one of {', '.join(map(repr, INDEXER_KEY_DTYPES))}, got {name!r}")


def index_key_bytes_per_pool(dtype: torch.dtype) -> int:
    """Cache bytes of one pooled key: the 128-vector, plus its fp32 scale for FP8 keys."""
    dtype = indexer_key_dtype(dtype)
    scale = 4 if dtype == torch.float8_e4m3fn else 0
    return INDEX_HEAD_DIM * dtype.itemsize + scale
