"""Triton kernel: expand selected pools to token positions (`ops.expand_selection`).

One program per row; every one of the ``width`` columns is written exactly once, so the output needs no pre-fill
and a persistent selection buffer can be passed as ``out``. Unlike the reference, which raises, ids ``< 0`` or
``>= (pos + 1) // 4`` are dropped and a selection longer than ``width`` is cut; repeated ids are not detected (the
top-k never produces them). docs/kernels.md, "Selection expansion".
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["expand_selection"]

# Larger than any valid pool id; 4 * _BIG + 3 still fits in int32.
_BIG = tl.constexpr(1 << 28)


@triton.jit
def _expand_kernel(
    ids_ptr,
    pos_ptr,
    out_ptr,
    K,
    stride_ids,
    stride_out,
    WIDTH: tl.constexpr,
    KP: tl.constexpr,
    EXTRA: tl.constexpr,
):
    n = tl.program_id(0)
    n64 = n.to(tl.int64)
    pos = tl.load(pos_ptr + n).to(tl.int32)
    n_c = (pos + 1) // 4
    i = tl.arange(0, KP)
    ids = tl.load(ids_ptr + n64 * stride_ids + i, mask=i < K, other=-1).to(tl.int32)
    valid = (ids >= 0) & (ids < n_c)
    n_sel = tl.sum(valid.to(tl.int32), axis=0)
    srt = tl.sort(tl.where(valid, ids, _BIG))
    tok = tl.reshape(4 * srt[:, None] + tl.arange(0, 4)[None, :], (4 * KP,))
    sel_end = 4 * n_sel
    tail_end = sel_end + (pos + 1 - 4 * n_c)
    out_row = out_ptr + n64 * stride_out
    j = tl.arange(0, 4 * KP)
    tail = 4 * n_c + (j - sel_end)
    val = tl.where(j < sel_end, tok, tl.where(j < tail_end, tail, -1))
    tl.store(out_row + j, val, mask=j < WIDTH)
    if EXTRA > 0:
        # Columns past the 4 * KP expanded ones hold at most the tail, then padding.
        jj = 4 * KP + tl.arange(0, EXTRA)
        vv = tl.where(jj < tail_end, 4 * n_c + (jj - sel_end), -1)
        tl.store(out_row + jj, vv, mask=jj < WIDTH)


def expand_selection(
    pool_ids: torch.Tensor, positions: torch.Tensor, width: int, *, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Expand pool ids to token positions; see the package's `expand_selection`.

    Args:
        pool_ids: ``[N, K]`` int pool ids (any order, ``-1`` = none). positions: ``[N]`` int.
        width: output columns. out: optional ``[N, width]`` int32 buffer.

    Returns:
        ``[N, width]`` int32 token positions, ``-1`` padded.
    """
    if pool_ids.dim() != 2 or pool_ids.shape[0] != positions.shape[0]:
        raise ValueError(f"pool_ids must be [N={positions.shape[0]}, K], got {tuple(pool_ids.shape)}")
    n, k = pool_ids.shape
    if pool_ids.stride(-1) != 1:
        pool_ids = pool_ids.contiguous()
    if out is None:
        out = torch.empty(n, width, dtype=torch.int32, device=pool_ids.device)
    elif out.shape != (n, width) or out.dtype != torch.int32 or out.stride(-1) != 1:
        raise ValueError(f"out must be [N={n}, width={width}] int32, got {tuple(out.shape)} {out.dtype}")
    if n == 0 or width == 0:
        return out
    kp = triton.next_power_of_2(max(k, 2))
    _expand_kernel[(n,)](
        pool_ids,
        positions,
        out,
        k,
        pool_ids.stride(0),
        out.stride(0),
        WIDTH=width,
        KP=kp,
        EXTRA=triton.next_power_of_2(width - 4 * kp) if width > 4 * kp else 0,
    )
    return out
