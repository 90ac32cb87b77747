"""Host-to-device copies of small index lists without a stream synchronisation.

``torch.tensor(values, device="cuda")`` copies synchronously: the host waits for the stream to drain, one
sync per call, and the speculative loop builds a dozen such index tensors per round. Here the values go
into pinned host memory (torch's caching host allocator) and are copied with ``non_blocking=True``: the
copy is ordered on the current stream, torch keeps the pinned block until the copy has completed, and
the host does not wait (from pageable memory the driver may still synchronise).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["to_device"]


def to_device(
    values: Sequence[int] | Sequence[float], device: torch.device | str, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """``values`` as a tensor on ``device`` (a plain tensor on the CPU), copied without waiting for the stream.

    Args:
        values: numbers (a flat list).
        device: target device.
        dtype: tensor dtype (default: torch's inference, int64 for ints).

    Returns:
        ``[len(values)]`` tensor on ``device``.
    """
    if torch.device(device).type == "cpu":
        return torch.tensor(values, dtype=dtype)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)
