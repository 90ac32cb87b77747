"""A verify round launched ahead: its rows' description and inputs written in one launch.

A drafting round launched before the previous round was read back (`CudaGraphRunner.replay_verify_ahead`, issue 43)
takes its lengths, root tokens and the previous round's accepted counts from that round's packed results on the
device. `stage_verify_ahead_reference` is the torch definition (the rows `AttentionMetadata.prepare` would describe,
the accepted counts, the input grid), some thirty small launches; `stage_verify_ahead` runs it, or
`kernels.stage_verify_ahead` in one launch on CUDA (``TRTLLM_GLM_VERIFY_STAGE_BACKEND``; the CPU runs an interpreted
copy when triton is forced: `trtllm_glm.triton_interp`). On an H100 those launches were the host's work of a round
launched ahead (docs/speculation.md, "MTP drafting rounds under the overlap scheduler").

For ``B`` real sequences of ``W`` rows padded to ``P`` sequences, with ``acc[j] = packed[j W, 2]`` (round ``n``'s
accepted count of sequence ``j``) and ``past[j]`` the length the description holds (``seq[1, j]``, round ``n``'s
start):

* ``seq [5, >= P + 1]`` (`AttentionMetadata`'s per-sequence rows): ``seq[1, j] = past[j] + acc[j]`` (padding: as it
  was), ``seq[2, j] = W``, ``seq[3, j] = seq[1, j] + W`` for ``j < P``; ``seq[4, j] = j W`` for ``j <= P``;
* ``tok [3, >= P W]`` (per-row): row ``r = j W + i`` at position ``seq[1, j] + i``, owned by ``j`` (``-1`` for
  padding sequences), live when owned;
* ``ids [>= P W]``: row ``j W`` the bonus token ``packed[j W + acc[j] - 1, 0]``, rows ``j W + 1 ..`` the drafts
  ``drafts[j]`` (real sequences only; padding rows as they were);
* ``acc_buf [>= P]``: ``acc[j]``, 0 for padding sequences.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from trtllm_glm import envs
from trtllm_glm.triton_interp import KernelPackage, kernel_backend

__all__ = ["VerifyBuffers", "kernel_module", "stage_verify_ahead", "stage_verify_ahead_reference", "verify_backend"]

_PACKAGE = KernelPackage(__name__, __path__)


def kernel_module(device: torch.device | str) -> Any:
    """`kernels` built for ``device``: compiled on CUDA, an interpreted copy elsewhere."""
    return _PACKAGE.module("kernels", device)


def verify_backend(t: torch.Tensor, backend: str | None = None) -> str:
    """``"torch"`` or ``"triton"`` for one call (``backend``, else ``TRTLLM_GLM_VERIFY_STAGE_BACKEND``, else auto: the
    kernel for CUDA tensors)."""
    return kernel_backend(envs.VERIFY_STAGE_BACKEND, [t], backend)


@dataclass
class VerifyBuffers:
    """Where `stage_verify_ahead` writes (int64, contiguous; shapes as in the module docstring)."""

    seq: torch.Tensor
    tok: torch.Tensor
    ids: torch.Tensor
    acc: torch.Tensor

    def check(self, packed: torch.Tensor, drafts: torch.Tensor, W: int, P: int) -> int:
        """Validate a call's shapes; returns ``B``, the real sequences.

        Raises:
            ValueError: naming the argument or buffer whose shape does not fit.
        """
        B = drafts.shape[0] if drafts.dim() == 2 else -1
        if W < 2 or B < 1 or B > P:
            raise ValueError(f"stage_verify_ahead needs 1 <= B <= P sequences of W >= 2 rows, got B={B} P={P} W={W}")
        if drafts.shape != (B, W - 1):
            raise ValueError(f"drafts must be [{B}, {W - 1}], got {tuple(drafts.shape)}")
        if packed.dim() != 2 or packed.shape[0] != B * W or packed.shape[1] < 3:
            raise ValueError(f"packed must be [{B * W}, >= 3], got {tuple(packed.shape)}")
        for name, rows, cols in (("seq", 5, P + 1), ("tok", 3, P * W)):
            t = getattr(self, name)
            if t.dim() != 2 or t.shape[0] != rows or t.shape[1] < cols or t.stride(1) != 1:
                raise ValueError(f"{name} must be [{rows}, >= {cols}] with contiguous rows, got {tuple(t.shape)}")
        for name, n in (("ids", P * W), ("acc", P)):
            t = getattr(self, name)
            if t.dim() != 1 or t.shape[0] < n or not t.is_contiguous():
                raise ValueError(f"{name} must be a contiguous [>= {n}], got {tuple(t.shape)}")
        for name in ("seq", "tok", "ids", "acc"):
            if getattr(self, name).dtype != torch.int64:
                raise ValueError(f"{name} must be int64")
        return B


def stage_verify_ahead_reference(
    packed: torch.Tensor, drafts: torch.Tensor, W: int, P: int, out: VerifyBuffers
) -> None:
    """The torch definition (the module docstring says what is written into ``out``).

    Args:
        packed: ``[B * W, 3]`` round ``n``'s packed results (float64: greedy token, gap, accepted count).
        drafts: ``[B, W - 1]`` int64 the drafts round ``n + 1`` verifies.
        W, P: the verify width and the padded sequence count (``P >= B``).
        out: the buffers written.
    """
    B = out.check(packed, drafts, W, P)
    N = P * W
    dev = packed.device
    rows = packed.view(B, W, -1)
    acc = rows[:, 0, 2].to(torch.int64)
    bonus = rows[:, :, 0].gather(1, (acc - 1).view(B, 1)).view(B).to(torch.int64)
    grid = out.ids[: B * W].view(B, W)
    grid[:, 0].copy_(bonus)
    grid[:, 1:].copy_(drafts)
    seq, tok = out.seq, out.tok
    past = seq[1, :P].clone()
    past[:B] += acc
    seq[1, :P].copy_(past)
    seq[2, :P].fill_(W)
    torch.add(past, W, out=seq[3, :P])
    torch.mul(torch.arange(P + 1, device=dev), W, out=seq[4, : P + 1])
    r = torch.arange(N, device=dev)
    owner = torch.div(r, W, rounding_mode="floor")
    tok[0, :N].copy_(past.index_select(0, owner) + r - owner * W)
    real = owner < B
    tok[1, :N].copy_(torch.where(real, owner, -1))
    tok[2, :N].copy_(real)
    out.acc[:B].copy_(acc)
    out.acc[B:P].zero_()


def stage_verify_ahead(
    packed: torch.Tensor, drafts: torch.Tensor, W: int, P: int, out: VerifyBuffers, backend: str | None = None
) -> None:
    """`stage_verify_ahead_reference`, in one launch where the backend is ``triton`` (`verify_backend`); the same
    values either way (integer arithmetic on exact float64 ids and counts)."""
    if verify_backend(packed, backend) == "torch":
        stage_verify_ahead_reference(packed, drafts, W, P, out)
        return
    B = out.check(packed, drafts, W, P)
    kernel_module(packed.device).stage_verify_ahead(packed, drafts, B, W, P, out)
