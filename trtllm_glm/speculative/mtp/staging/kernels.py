"""Triton kernel of `trtllm_glm.speculative.mtp.staging`: a draft-ahead's inputs in one launch.

One program per catch-up row (``P * W`` of them): it copies its token and hidden row, marks the row padding past its
sequence's accepted count, and the program of a sequence's first row writes the count; the program of the last
accepted row writes ``last_rows`` and the draft hidden. Exact: integer copies, hidden rows copied through fp32 (exact
for 16- and 32-bit floats). CPU: an interpreted copy (`trtllm_glm.triton_interp`).
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

__all__ = ["stage_draft_ahead"]


@triton.jit(do_not_specialize=["n", "P"])
def _stage_kernel(
    tok_ptr,
    tok_stride,
    acc_ptr,
    acc_stride,
    h_ptr,
    h_stride,
    valid_ptr,
    ctok_ptr,
    ch_ptr,
    seq_ptr,
    live_ptr,
    last_ptr,
    dh_ptr,
    slot_ptr,
    n,
    P,
    D,
    W: tl.constexpr,
    BLOCK_D: tl.constexpr,
    RECORD: tl.constexpr,
):
    r = tl.program_id(0)
    j = r // W
    i = r - j * W
    real = j < n
    # Float64 ids and counts (packed results) are exact integers: the cast is exact.
    acc = tl.load(acc_ptr + j.to(tl.int64) * acc_stride, mask=real, other=0).to(tl.int64)
    v = tl.where(real, acc, 0)
    tok = tl.load(tok_ptr + r.to(tl.int64) * tok_stride, mask=real, other=0).to(tl.int64)
    tl.store(ctok_ptr + r, tok)
    if i == 0:
        tl.store(valid_ptr + j, v)
    if i >= v:
        tl.store(seq_ptr + r, -1)
        tl.store(live_ptr + r, 0)
    src = tl.where(real, r, 0).to(tl.int64)
    last = real & (i == v - 1)
    if last:
        tl.store(last_ptr + j, r.to(tl.int64))
    offs = tl.arange(0, BLOCK_D)
    for d0 in range(0, D, BLOCK_D):
        cols = d0 + offs
        ok = cols < D
        x = tl.load(h_ptr + src * h_stride + cols, mask=ok, other=0.0).to(tl.float32)
        tl.store(ch_ptr + r.to(tl.int64) * D + cols, x.to(ch_ptr.dtype.element_ty), mask=ok)
        if RECORD:  # noqa: SIM102 - a constexpr branch around a runtime one (Triton)
            if last:
                slot = tl.load(slot_ptr + j).to(tl.int64)
                tl.store(dh_ptr + slot * D + cols, x.to(dh_ptr.dtype.element_ty), mask=ok)


def stage_draft_ahead(
    tokens: torch.Tensor, hidden: torch.Tensor, accepted: torch.Tensor, n: int, W: int, P: int, out: Any
) -> None:
    """`staging.stage_draft_ahead_reference` in one launch (shapes checked by `staging.StageBuffers.check`).

    Args:
        tokens: ``[n * W]`` (strided), hidden ``[n * W, D]`` (rows contiguous), accepted ``[n]`` (strided).
        n, W, P: real sequences, verify width, padded sequences.
        out: the `staging.StageBuffers` written.
    """
    D = hidden.shape[1]
    record = out.draft_hidden is not None and out.slots is not None
    block = min(1024, triton.next_power_of_2(D))
    _stage_kernel[(P * W,)](
        tokens,
        tokens.stride(0),
        accepted,
        accepted.stride(0),
        hidden,
        hidden.stride(0),
        out.valid,
        out.c_tokens,
        out.c_hidden,
        out.row_seq,
        out.row_live,
        out.last_rows,
        out.draft_hidden if record else out.c_hidden,
        out.slots if record else out.valid,
        n,
        P,
        D,
        W=W,
        BLOCK_D=block,
        RECORD=record,
    )
