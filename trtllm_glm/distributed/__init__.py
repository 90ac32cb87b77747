"""Tensor and expert parallelism over torch.distributed (docs/parallelism.md).

Import order: `mapping` and `comm` import only torch; `sharding` imports `config`. The layers (models/,
modules/) import this package; the process machinery that starts ranks (`launcher`, `worker`) is imported
by the runtime only.
"""

from __future__ import annotations

from .comm import NULL_COMM, Comm, LockstepError
from .mapping import Mapping, ParallelConfigError

__all__ = ["Mapping", "ParallelConfigError", "Comm", "NULL_COMM", "LockstepError"]
