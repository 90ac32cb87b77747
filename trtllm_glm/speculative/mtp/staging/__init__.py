"""The inputs of an MTP draft launched from a verify round still on the device, written in one launch.

A draft launched before the host reads its verify round back (`MTPDrafter.draft_ahead`: an early draft, a round
launched ahead) takes everything from the verify's outputs on the device: each sequence's accepted count, the
target's token after each verify row, the verify's final hidden rows. `stage_draft_ahead_reference` is the torch
definition, ten small launches; `stage_draft_ahead` runs it, or `kernels.stage_draft_ahead` in one launch on CUDA
(``TRTLLM_GLM_MTP_STAGE_BACKEND``; the CPU runs an interpreted copy when triton is forced: `trtllm_glm.triton_interp`).
At batch 1 the fused MTP round is bound by the GPU's timeline (docs/speculation.md, "Where an MTP round's time goes"),
and each of those launches sat on it between the verify graph and the draft graph.

What it writes, for ``n`` real sequences of ``W`` verify rows padded to ``P`` sequences:

* ``valid [P]``: sequence ``j``'s accepted count (``accepted[j]``), 0 for padding sequences;
* ``c_tokens [P * W]`` / ``c_hidden [P * W, D]``: the catch-up's input rows, the verify's rows in order (padding
  rows: token 0 and the hidden of row 0, finite and never read);
* ``row_seq [P * W]`` / ``row_live [P * W]``: rows at offset ``>= valid[j]`` inside their sequence become padding
  rows (``-1`` / ``0``; the other rows keep what `AttentionMetadata.prepare` wrote), as `prepare`'s host
  ``valid_q_lens`` would make them;
* ``last_rows [n]``: each sequence's last accepted row ``j W + valid[j] - 1``;
* ``draft_hidden[slots[j]]``: that row's hidden (the draft hidden a restore reads), when given.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from trtllm_glm import envs
from trtllm_glm.triton_interp import KernelPackage, kernel_backend

__all__ = [
    "MTP_STAGE_BACKEND_ENV",
    "StageBuffers",
    "kernel_module",
    "stage_backend",
    "stage_draft_ahead",
    "stage_draft_ahead_reference",
]

MTP_STAGE_BACKEND_ENV = envs.MTP_STAGE_BACKEND.name

_PACKAGE = KernelPackage(__name__, __path__)


def kernel_module(device: torch.device | str) -> Any:
    """`kernels` built for ``device``: compiled on CUDA, an interpreted copy elsewhere."""
    return _PACKAGE.module("kernels", device)


def stage_backend(hidden: torch.Tensor, backend: str | None = None) -> str:
    """``"torch"`` or ``"triton"`` for one call (``backend``, else ``TRTLLM_GLM_MTP_STAGE_BACKEND``, else auto: the
    kernel for CUDA tensors)."""
    return kernel_backend(envs.MTP_STAGE_BACKEND, [hidden], backend)


@dataclass
class StageBuffers:
    """Where `stage_draft_ahead` writes (shapes as in the module docstring; integer buffers int64, contiguous).

    ``draft_hidden [S, D]`` (the state owner's draft hidden) and ``slots [n]`` (int64, each sequence's state slot) go
    together; None: nothing recorded.
    """

    valid: torch.Tensor
    c_tokens: torch.Tensor
    c_hidden: torch.Tensor
    row_seq: torch.Tensor
    row_live: torch.Tensor
    last_rows: torch.Tensor
    draft_hidden: torch.Tensor | None = None
    slots: torch.Tensor | None = None

    def check(self, tokens: torch.Tensor, hidden: torch.Tensor, accepted: torch.Tensor, W: int, P: int) -> int:
        """Validate a call's shapes; returns ``n``, the real sequences.

        Raises:
            ValueError: naming the argument or buffer whose shape does not fit.
        """
        n = accepted.shape[0] if accepted.dim() == 1 else -1
        if n < 1 or W < 1 or n > P:
            raise ValueError(f"stage_draft_ahead needs 1 <= n <= P sequences of W >= 1 rows, got n={n} P={P} W={W}")
        N = P * W
        if tokens.shape != (n * W,) or hidden.dim() != 2 or hidden.shape[0] != n * W:
            raise ValueError(
                f"{n} sequences of {W} rows need tokens [{n * W}] and hidden [{n * W}, D], got "
                f"{tuple(tokens.shape)} and {tuple(hidden.shape)}"
            )
        D = hidden.shape[1]
        if hidden.stride(1) != 1:
            raise ValueError("hidden rows must be contiguous")
        shapes = {"valid": (P,), "c_tokens": (N,), "c_hidden": (N, D), "row_seq": (N,), "row_live": (N,),
                  "last_rows": (n,)}  # fmt: skip
        for name, shape in shapes.items():
            t = getattr(self, name)
            if tuple(t.shape) != shape or not t.is_contiguous():
                raise ValueError(f"{name} must be a contiguous {list(shape)}, got {tuple(t.shape)}")
        dh, slots = self.draft_hidden, self.slots
        if (dh is None) != (slots is None):
            raise ValueError("draft_hidden and slots go together")
        if dh is not None and slots is not None:
            if dh.dim() != 2 or dh.shape[1] != D or not dh.is_contiguous():
                raise ValueError(f"draft_hidden must be a contiguous [S, {D}], got {tuple(dh.shape)}")
            if slots.shape != (n,):
                raise ValueError(f"slots must be [{n}], got {tuple(slots.shape)}")
        return n


def stage_draft_ahead_reference(
    tokens: torch.Tensor, hidden: torch.Tensor, accepted: torch.Tensor, W: int, P: int, out: StageBuffers
) -> None:
    """The torch definition (the module docstring says what is written into ``out``).

    Args:
        tokens: ``[n * W]`` the target's token after each verify row (int64, or the float64 ids of packed results).
        hidden: ``[n * W, D]`` the verify's final hidden rows (rows contiguous).
        accepted: ``[n]`` accepted rows per sequence, each in ``1 .. W`` (int64, or float64 counts).
        W, P: the verify width and the padded sequence count (``P >= n``).
        out: the buffers written.
    """
    n = out.check(tokens, hidden, accepted, W, P)
    N = P * W
    out.valid[:n].copy_(accepted)
    out.c_tokens[: n * W].copy_(tokens)
    out.c_hidden[: n * W].copy_(hidden)
    if n < P:
        out.valid[n:P].zero_()
        out.c_tokens[n * W : N].zero_()
        out.c_hidden[n * W : N].copy_(hidden[:1].expand(N - n * W, -1))
    drop = torch.arange(N, device=hidden.device) % W >= out.valid.repeat_interleave(W)
    out.row_seq.masked_fill_(drop, -1)
    out.row_live.masked_fill_(drop, 0)
    torch.add(torch.arange(n, device=hidden.device) * W - 1, out.valid[:n], out=out.last_rows)
    if out.draft_hidden is not None and out.slots is not None:
        rows = hidden.index_select(0, out.last_rows).to(out.draft_hidden.dtype)
        out.draft_hidden.index_copy_(0, out.slots, rows)


def stage_draft_ahead(
    tokens: torch.Tensor,
    hidden: torch.Tensor,
    accepted: torch.Tensor,
    W: int,
    P: int,
    out: StageBuffers,
    backend: str | None = None,
) -> None:
    """`stage_draft_ahead_reference`, in one launch where the backend is ``triton`` (`stage_backend`); the same
    values either way (integer copies, and hidden rows copied exactly)."""
    if stage_backend(hidden, backend) == "torch":
        stage_draft_ahead_reference(tokens, hidden, accepted, W, P, out)
        return
    n = out.check(tokens, hidden, accepted, W, P)
    kernel_module(hidden.device).stage_draft_ahead(tokens, hidden, accepted, n, W, P, out)
