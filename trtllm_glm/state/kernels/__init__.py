"""Triton kernels of the per-request state planes, drop-in for the torch references beside their owners.

`tail_ring_prepare_step` is `trtllm_glm.state.tail_ring.DecodeTailRing.prepare_step_reference` in one launch
(``tail_ring.py`` has the kernel design); `DecodeTailRing.prepare_step` dispatches here
(``TRTLLM_GLM_TAIL_RING_BACKEND``).

Where the kernels run: CUDA tensors go to the compiled kernels; any other device (the CPU) goes to an interpreted
copy of the same source, imported under its own module name with Triton's interpreter switched on only for that
import (`trtllm_glm.triton_interp`, shared by every kernel package). Triton is imported lazily, on the first call.
"""

from __future__ import annotations

from typing import Any

import torch

from trtllm_glm.triton_interp import KernelPackage

__all__ = ["kernel_module", "tail_ring_prepare_step"]

# CPU tensors run an interpreted copy of the same module (trtllm_glm/triton_interp.py).
_PACKAGE = KernelPackage(__name__, __path__)


def kernel_module(name: str, device: torch.device | str) -> Any:
    """The kernel module ``name`` (``"tail_ring"``) for ``device``: compiled on CUDA, interpreted elsewhere."""
    return _PACKAGE.module(name, device)


def tail_ring_prepare_step(
    ring: torch.Tensor,
    key: torch.Tensor,
    gate: torch.Tensor,
    positions: torch.Tensor,
    row_seq: torch.Tensor,
    state_slots: torch.Tensor,
    num_accepted_tokens: torch.Tensor | None,
    snapshot: torch.Tensor,
    saved_rows: torch.Tensor,
    saved_pos: torch.Tensor,
    saved_count: torch.Tensor,
    num_disagreements: torch.Tensor,
    **launch: Any,
) -> None:
    """Triton `DecodeTailRing.prepare_step` on explicit buffers (one launch; ``tail_ring.py`` has the design).

    Args:
        ring: ``[S, 2, 4, 128]`` fp32 tail ring, updated in place.
        key: ``[N, 128]`` this step's keys (any float dtype).
        gate: ``[N, 128]`` this step's gate logits.
        positions: ``[N]`` int token positions.
        row_seq: ``[N]`` int sequence index per row (``< 0``: padding).
        state_slots: ``[B]`` int state slot per sequence.
        num_accepted_tokens: optional ``[B]`` int scheduler counts (cross-check only).
        snapshot: ``[S, 2, 4, 128]`` fp32 backup ring.
        saved_rows: ``[S, R, 2, 128]`` fp32 saved rows.
        saved_pos: ``[S]`` int64 first position of the backed-up step.
        saved_count: ``[S]`` int64 saved row counts.
        num_disagreements: ``[]`` int64 counter.
        **launch: ``num_warps``.
    """
    kernel_module("tail_ring", ring.device).prepare_step(
        ring, key, gate, positions, row_seq, state_slots, num_accepted_tokens,
        snapshot, saved_rows, saved_pos, saved_count, num_disagreements, **launch,
    )  # fmt: skip
