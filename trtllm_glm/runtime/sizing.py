"""Serving defaults for the batch and the token budget, sized against the device's memory at start-up.

`LLM(max_batch_size=None, max_num_tokens=None)` take `DEFAULT_MAX_BATCH_SIZE` sequences and a
`DEFAULT_MAX_NUM_TOKENS`-row budget and halve them (the budget first, down to `MIN_AUTO_NUM_TOKENS`, then the batch,
down to `MIN_AUTO_BATCH_SIZE`) until the KV cache, the state slots and a prefill chunk's buffers fit in
`AUTO_MEMORY_FRACTION` of the memory free after the weights. A value the caller sets is kept; one that cannot fit is
refused by the executor's check (`Executor._make_manager`). Why these sizes: docs/serving.md, "Defaults that fit
serving".
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..cache.manager import Glm5NextCacheManager
from ..config import Glm5NextConfig
from ..models.glm5_next import free_bytes
from .prefill_memory import prefill_workspace_bytes

__all__ = [
    "DEFAULT_MAX_BATCH_SIZE",
    "DEFAULT_MAX_NUM_TOKENS",
    "MIN_AUTO_BATCH_SIZE",
    "MIN_AUTO_NUM_TOKENS",
    "AUTO_MEMORY_FRACTION",
    "StepSizes",
    "resolve_step_sizes",
]

DEFAULT_MAX_BATCH_SIZE = 64
DEFAULT_MAX_NUM_TOKENS = 8192
MIN_AUTO_BATCH_SIZE = 8
MIN_AUTO_NUM_TOKENS = 512
# The share of free memory the automatic sizes may plan for: the rest stays for CUDA graphs' pools, a drafter's
# cache, the allocator's rounding and the sampler's buffers, none of which the estimates count.
AUTO_MEMORY_FRACTION = 0.85


@dataclass(frozen=True)
class StepSizes:
    """The executor's batch and token budget, and how they were chosen.

    Attributes:
        max_batch_size: sequences per step.
        max_num_tokens: rows per step.
        auto: the fields the caller left to `resolve_step_sizes` (``"max_batch_size"``, ``"max_num_tokens"``).
        reduced: whether memory made an automatic size smaller than its default.
        estimate_bytes: the cache + workspace estimate at the chosen sizes.
        free_bytes: what the device had free (``None``: unknown).
    """

    max_batch_size: int
    max_num_tokens: int
    auto: tuple[str, ...] = ()
    reduced: bool = False
    estimate_bytes: int = 0
    free_bytes: int | None = None

    def describe(self) -> str:
        """One start-up log line."""
        how = "set" if not self.auto else f"auto ({', '.join(self.auto)})"
        line = f"max_batch_size {self.max_batch_size}, max_num_tokens {self.max_num_tokens} [{how}]"
        if self.reduced and self.free_bytes is not None:
            line += f": reduced to fit {self.free_bytes / 2**30:.1f} GiB free"
        return line


def resolve_step_sizes(
    config: Glm5NextConfig,
    device: str | torch.device,
    *,
    max_batch_size: int | None,
    max_num_tokens: int | None,
    max_seq_len: int,
    tokens_per_block: int,
    kv_max_tokens: int | None,
    dtype: torch.dtype,
    indexer_key_dtype: str = "fp8",
    latent_dtype: str = "auto",
    free: int | None | Callable[[], int | None] = free_bytes,
) -> StepSizes:
    """Choose the sizes the caller left ``None`` (see the module docstring); keep the others.

    Args:
        config: the model's (this rank's) config.
        device: where the caches live.
        max_batch_size: the caller's value, or ``None`` for automatic.
        max_num_tokens: the caller's value, or ``None`` for automatic.
        max_seq_len: longest sequence (already capped by the model's context).
        tokens_per_block: page size.
        kv_max_tokens: the page pool's size in tokens (``None``: ``max_batch_size * max_seq_len``).
        dtype: activations' and caches' dtype.
        indexer_key_dtype: pooled indexer keys' precision.
        latent_dtype: latent rows' storage (``"auto"``: ``dtype``; ``"fp8"``: e4m3 with block scales).
        free: free bytes of ``device``, or a function of the device returning them (tests pass a number).

    Returns:
        The chosen `StepSizes`.
    """
    auto = tuple(n for n, v in (("max_batch_size", max_batch_size), ("max_num_tokens", max_num_tokens)) if v is None)
    B = DEFAULT_MAX_BATCH_SIZE if max_batch_size is None else max_batch_size
    N = DEFAULT_MAX_NUM_TOKENS if max_num_tokens is None else max_num_tokens

    def estimate(b: int, n: int) -> int:
        P = tokens_per_block
        pages = -(-(kv_max_tokens or b * max_seq_len) // P)
        cache = Glm5NextCacheManager.estimate_bytes(
            config, num_pages=pages, tokens_per_block=P, max_num_requests=b + 1, dtype=dtype,
            indexer_key_dtype=indexer_key_dtype, latent_dtype=latent_dtype,
        )  # fmt: skip
        seq = min(max_seq_len, pages * P)
        return cache + prefill_workspace_bytes(config, n, seq, dtype)

    have = free(device) if callable(free) else free
    if not auto or have is None:
        return StepSizes(B, N, auto, False, estimate(B, N) if auto else 0, have)
    budget = int(have * AUTO_MEMORY_FRACTION)
    reduced = False
    while estimate(B, N) > budget:
        if max_num_tokens is None and N > MIN_AUTO_NUM_TOKENS:
            N = max(MIN_AUTO_NUM_TOKENS, N // 2)
        elif max_batch_size is None and B > MIN_AUTO_BATCH_SIZE:
            B = max(MIN_AUTO_BATCH_SIZE, B // 2)
        else:
            break  # the executor's own check refuses it, with the numbers
        reduced = True
    return StepSizes(B, N, auto, reduced, estimate(B, N), have)
