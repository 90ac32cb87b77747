"""Triton kernel of `trtllm_glm.runtime.verify_staging`: a verify launched ahead, described in one launch.

One program (the rows are at most a verify batch, ``P W <= max_num_tokens``): first the per-row description and the
input grid, which read each sequence's old length ``seq[1, j]``; a barrier; then the per-sequence rows, which
overwrite it. Each old length is read before the barrier and written after it, so no row sees a length already moved.
Exact: float64 ids and counts are integers. CPU: an interpreted copy (`trtllm_glm.triton_interp`; sequential, the
barrier a no-op).
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

__all__ = ["stage_verify_ahead"]


@triton.jit(do_not_specialize=["B", "P"])
def _verify_stage_kernel(
    packed_ptr,
    packed_stride,
    drafts_ptr,
    drafts_s0,
    drafts_s1,
    seq_ptr,
    seq_stride,
    tok_ptr,
    tok_stride,
    ids_ptr,
    acc_ptr,
    B,
    P,
    W: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # Per row r = j W + i: position, owner, liveness, and the input token.
    N = P * W
    for r0 in range(0, N, BLOCK):
        r = r0 + tl.arange(0, BLOCK)
        inside = r < N
        j = r // W
        i = r - j * W
        real = inside & (j < B)
        past = tl.load(seq_ptr + seq_stride + j, mask=inside, other=0)
        acc = tl.load(packed_ptr + (j * W).to(tl.int64) * packed_stride + 2, mask=real, other=0.0).to(tl.int64)
        tl.store(tok_ptr + r, past + acc + i, mask=inside)
        tl.store(tok_ptr + tok_stride + r, tl.where(real, j, -1).to(tl.int64), mask=inside)
        tl.store(tok_ptr + 2 * tok_stride + r, real.to(tl.int64), mask=inside)
        # (a real sequence accepted at least its root: acc >= 1, so the bonus row lies inside the sequence)
        bonus_row = (j * W + acc - 1).to(tl.int64)
        bonus = tl.load(packed_ptr + bonus_row * packed_stride, mask=real & (i == 0), other=0.0).to(tl.int64)
        d = tl.load(drafts_ptr + j.to(tl.int64) * drafts_s0 + (i - 1) * drafts_s1, mask=real & (i > 0), other=0)
        tl.store(ids_ptr + r, tl.where(i == 0, bonus, d), mask=real)
    tl.debug_barrier()
    # Per sequence: lengths, widths, cumulative rows and the accepted counts.
    for j0 in range(0, P + 1, BLOCK):
        j = j0 + tl.arange(0, BLOCK)
        seqs = j < P
        real = j < B
        past = tl.load(seq_ptr + seq_stride + j, mask=seqs, other=0)
        acc = tl.load(packed_ptr + (j * W).to(tl.int64) * packed_stride + 2, mask=real, other=0.0).to(tl.int64)
        now = past + acc
        tl.store(seq_ptr + seq_stride + j, now, mask=seqs)
        tl.store(seq_ptr + 2 * seq_stride + j, tl.full([BLOCK], W, tl.int64), mask=seqs)
        tl.store(seq_ptr + 3 * seq_stride + j, now + W, mask=seqs)
        tl.store(seq_ptr + 4 * seq_stride + j, (j * W).to(tl.int64), mask=j <= P)
        tl.store(acc_ptr + j, acc, mask=seqs)


def stage_verify_ahead(packed: torch.Tensor, drafts: torch.Tensor, B: int, W: int, P: int, out: Any) -> None:
    """`verify_staging.stage_verify_ahead_reference` in one launch (shapes checked by `VerifyBuffers.check`).

    Args:
        packed: ``[B * W, >= 3]`` float64 (rows strided), drafts ``[B, W - 1]`` int64 (strided).
        B, W, P: real sequences, verify width, padded sequences.
        out: the `verify_staging.VerifyBuffers` written.
    """
    block = min(1024, triton.next_power_of_2(max(P * W, P + 1)))
    _verify_stage_kernel[(1,)](
        packed,
        packed.stride(0),
        drafts,
        drafts.stride(0),
        drafts.stride(1),
        out.seq,
        out.seq.stride(0),
        out.tok,
        out.tok.stride(0),
        out.ids,
        out.acc,
        B,
        P,
        W=W,
        BLOCK=block,
    )
