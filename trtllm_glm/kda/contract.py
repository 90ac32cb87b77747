"""Names the KDA torch references (`trtllm_glm.kda.ops`) and their Triton kernels (`trtllm_glm.kda.kernels`)
share: the verify pass's commit records, the accepted-count argument of the commits, and the L2-norm epsilon.

They live apart from both so that imports run one way: ``ops`` call ``kernels`` (the backend choice), and
``kernels`` import only this module, never ``ops``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = ["KdaRecords", "L2NORM_EPS", "accepted_tensor"]

# Added to the squared norm before the reciprocal square root; the same epsilon fla-core uses in its in-kernel
# L2 norm, so callers normalising outside the kernel match a kernel that normalises inside.
L2NORM_EPS = 1e-6


@dataclass
class KdaRecords:
    """Per-row commit records of a verify pass (batched layout ``[N, W, ...]``).

    Attributes:
        g: ``[N, W, H, K]`` FP32 log decay of each row.
        k: ``[N, W, H, K]`` FP32 (L2-normalised) key of each row.
        u: ``[N, W, H, V]`` FP32 delta-rule correction of each row.

    The Triton verify returns FP32 ``g``/``k`` inputs themselves here (no copy; possibly strided views), the
    reference clones them: either way they must not be modified before the commit.
    """

    g: torch.Tensor
    k: torch.Tensor
    u: torch.Tensor

    @property
    def width(self) -> int:
        return self.g.shape[1]


def accepted_tensor(
    num_accepted: Sequence[int] | torch.Tensor | int, N: int, width: int, device: torch.device
) -> torch.Tensor:
    """``[N]`` int64 accepted counts on ``device``; host values are range-checked."""
    if isinstance(num_accepted, torch.Tensor):
        a = num_accepted.to(device=device, dtype=torch.int64).reshape(-1)
        if a.numel() == 1 and N != 1:
            a = a.expand(N)
    else:
        vals = [int(num_accepted)] * N if isinstance(num_accepted, int) else [int(x) for x in num_accepted]
        if len(vals) != N or any(not 0 <= x <= width for x in vals):
            raise ValueError(f"num_accepted must be {N} values in [0, {width}], got {vals}")
        a = torch.tensor(vals, dtype=torch.int64, device=device)
    if a.numel() != N:
        raise ValueError(f"num_accepted has {a.numel()} entries for {N} sequences")
    return a
