"""Host-to-device copies of small index lists without a stream synchronisation.

``torch.tensor(values, device="cuda")`` copies synchronously: the host waits for the stream to drain, one
sync per call, and the speculative loop builds a dozen such index tensors per round. A copy from pageable
host memory issued with ``non_blocking=True`` is staged by the driver right away (the temporary host
tensor may be freed at once) and ordered on the current stream, so it is as correct and does not wait.
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
    t = torch.tensor(values, dtype=dtype)
    return t if torch.device(device).type == "cpu" else t.to(device, non_blocking=True)
