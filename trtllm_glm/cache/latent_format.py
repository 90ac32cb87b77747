"""Storage format of the sparse layers' latent rows in the paged cache (``KvCacheConfig.latent_dtype``).

``"auto"`` (default): the model dtype, ``kv_lora_rank`` values a token (1024 bytes at GLM-5.3-Flash's 512 in
bf16). ``"fp8"``: float8_e4m3fn codes plus one power-of-two fp32 scale per 128-column block of each row
(`LATENT_SCALE_BLOCK`), 512 + 16 = 528 bytes a token (docs/fp8.md, "FP8 latent cache").
"""

from __future__ import annotations

import torch

from ..attention.sparse.glm_kpool.cache_layout import LATENT_SCALE_BLOCK, latent_scale_blocks

__all__ = [
    "LATENT_DTYPES",
    "LATENT_SCALE_BLOCK",
    "check_latent_dtype",
    "latent_bytes_per_token",
    "latent_dtype",
    "latent_scale_blocks",
]

LATENT_DTYPES: tuple[str, ...] = ("auto", "fp8")
"""Option names: ``"auto"`` stores the model dtype, ``"fp8"`` e4m3 codes with block scales."""


def check_latent_dtype(name: str | torch.dtype) -> None:
    """Refuse anything but an option name of `LATENT_DTYPES` (or ``torch.float8_e4m3fn``) before a model dtype is known.

    Raises:
        ValueError: one line naming the allowed values.
    """
    latent_dtype(name, torch.float32 if isinstance(name, str) else torch.float8_e4m3fn)


def latent_dtype(name: str | torch.dtype, model_dtype: torch.dtype) -> torch.dtype:
    """The storage dtype of a ``latent_dtype`` option: ``model_dtype`` for ``"auto"`` (or that dtype itself),
    ``torch.float8_e4m3fn`` for ``"fp8"`` (or that dtype).

    Raises:
        ValueError: anything else (one line naming the allowed values).
    """
    if isinstance(name, torch.dtype) and name in (model_dtype, torch.float8_e4m3fn):
        return name
    if isinstance(name, str) and name.lower() in LATENT_DTYPES:
        return torch.float8_e4m3fn if name.lower() == "fp8" else model_dtype
    raise ValueError(f"latent_dtype must be one of {', '.join(map(repr, LATENT_DTYPES))}, got {name!r}")


def latent_bytes_per_token(kv_lora_rank: int, dtype: torch.dtype) -> int:
    """Cache bytes of one token's latent row in one sparse layer: the row, plus its fp32 block scales for FP8."""
    if dtype == torch.float8_e4m3fn:
        return kv_lora_rank + 4 * latent_scale_blocks(kv_lora_rank)
    return kv_lora_rank * dtype.itemsize
