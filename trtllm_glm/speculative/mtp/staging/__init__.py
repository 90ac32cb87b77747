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
  rows (``-1`` / ``0``; the other rows keep what `AttentionMetadata.prepare` wrote), as
  `AttentionMetadata.set_valid_rows`;
* ``last_rows [n]``: each sequence's last accepted row ``j W + valid[j] - 1``;
* ``draft_hidden[slots[j]]``: that row's hidden (the draft hidden a restore reads), when given.
"""

from __future__ import annotations

from typing import Any

import torch

from trtllm_glm import envs
from trtllm_glm.triton_interp import KernelPackage, kernel_backend

__all__ = [
    "MTP_STAGE_BACKEND_ENV",
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


def _check(
    tokens: torch.Tensor,
    hidden: torch.Tensor,
    accepted: torch.Tensor,
    W: int,
    P: int,
    valid: torch.Tensor,
    c_tokens: torch.Tensor,
    c_hidden: torch.Tensor,
    row_seq: torch.Tensor,
    row_live: torch.Tensor,
    last_rows: torch.Tensor,
    draft_hidden: torch.Tensor | None,
    slots: torch.Tensor | None,
) -> int:
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
    for name, t, shape in (
        ("valid", valid, (P,)),
        ("c_tokens", c_tokens, (N,)),
        ("c_hidden", c_hidden, (N, D)),
        ("row_seq", row_seq, (N,)),
        ("row_live", row_live, (N,)),
        ("last_rows", last_rows, (n,)),
    ):
        if tuple(t.shape[: len(shape)]) != shape or t.dim() != len(shape):
            raise ValueError(f"{name} must be {list(shape)}, got {tuple(t.shape)}")
    if not c_hidden.is_contiguous():
        raise ValueError("c_hidden must be contiguous")
    if (draft_hidden is None) != (slots is None):
        raise ValueError("draft_hidden and slots go together")
    if draft_hidden is not None and slots is not None:
        if draft_hidden.dim() != 2 or draft_hidden.shape[1] != D or not draft_hidden.is_contiguous():
            raise ValueError(f"draft_hidden must be a contiguous [S, {D}], got {tuple(draft_hidden.shape)}")
        if slots.shape != (n,):
            raise ValueError(f"slots must be [{n}], got {tuple(slots.shape)}")
    return n


def stage_draft_ahead_reference(
    tokens: torch.Tensor,
    hidden: torch.Tensor,
    accepted: torch.Tensor,
    W: int,
    P: int,
    *,
    valid: torch.Tensor,
    c_tokens: torch.Tensor,
    c_hidden: torch.Tensor,
    row_seq: torch.Tensor,
    row_live: torch.Tensor,
    last_rows: torch.Tensor,
    draft_hidden: torch.Tensor | None = None,
    slots: torch.Tensor | None = None,
) -> None:
    """The torch definition (the module docstring says what is written).

    Args:
        tokens: ``[n * W]`` the target's token after each verify row (int64, or the float64 ids of packed results).
        hidden: ``[n * W, D]`` the verify's final hidden rows (rows contiguous).
        accepted: ``[n]`` accepted rows per sequence, each in ``1 .. W`` (int64, or float64 counts).
        W, P: the verify width and the padded sequence count (``P >= n``).
        valid, c_tokens, c_hidden, row_seq, row_live, last_rows: outputs, shapes as in the module docstring
            (``valid``, ``c_tokens``, ``row_seq``, ``row_live``, ``last_rows`` int64).
        draft_hidden: ``[S, D]`` the state owner's draft hidden, with ``slots [n]`` int64 each sequence's state slot;
            None: not recorded.
    """
    n = _check(tokens, hidden, accepted, W, P, valid, c_tokens, c_hidden, row_seq, row_live, last_rows,
               draft_hidden, slots)  # fmt: skip
    N = P * W
    valid[:n].copy_(accepted)
    c_tokens[: n * W].copy_(tokens)
    c_hidden[: n * W].copy_(hidden)
    if n < P:
        valid[n:P].zero_()
        c_tokens[n * W : N].zero_()
        c_hidden[n * W : N].copy_(hidden[:1].expand(N - n * W, -1))
    rows = torch.arange(N, device=hidden.device)
    drop = rows % W >= valid[:P].repeat_interleave(W)
    row_seq.masked_fill_(drop, -1)
    row_live.masked_fill_(drop, 0)
    torch.add(torch.arange(n, device=hidden.device) * W - 1, valid[:n], out=last_rows)
    if draft_hidden is not None and slots is not None:
        draft_hidden.index_copy_(0, slots, hidden.index_select(0, last_rows).to(draft_hidden.dtype))


def stage_draft_ahead(
    tokens: torch.Tensor,
    hidden: torch.Tensor,
    accepted: torch.Tensor,
    W: int,
    P: int,
    *,
    valid: torch.Tensor,
    c_tokens: torch.Tensor,
    c_hidden: torch.Tensor,
    row_seq: torch.Tensor,
    row_live: torch.Tensor,
    last_rows: torch.Tensor,
    draft_hidden: torch.Tensor | None = None,
    slots: torch.Tensor | None = None,
    backend: str | None = None,
) -> None:
    """`stage_draft_ahead_reference`, in one launch where the backend is ``triton`` (`stage_backend`); the same
    values either way (integer copies, and hidden rows copied exactly)."""
    outs = dict(valid=valid, c_tokens=c_tokens, c_hidden=c_hidden, row_seq=row_seq, row_live=row_live,
                last_rows=last_rows, draft_hidden=draft_hidden, slots=slots)  # fmt: skip
    if stage_backend(hidden, backend) == "torch":
        stage_draft_ahead_reference(tokens, hidden, accepted, W, P, **outs)
        return
    n = _check(tokens, hidden, accepted, W, P, valid, c_tokens, c_hidden, row_seq, row_live, last_rows,
               draft_hidden, slots)  # fmt: skip
    kernel_module(hidden.device).stage_draft_ahead(tokens, hidden, accepted, n, W, P, **outs)
