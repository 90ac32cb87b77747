"""One Triton kernel for the sigmoid MoE router after its logits (`trtllm_glm.moe.router.fused_route`).

The selection is the reference's bit for bit on CUDA (libdevice ``expf``, IEEE division; ties to the lower expert
id through the packed sort key); NaN experts are selected first, as ``torch.sort`` does. Steps and numerics:
docs/kernels.md, "MoE router".
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

__all__ = ["INTERPRETED", "MAX_EXPERTS", "launch_route"]

# Fixed when this module is imported: `KernelPackage` imports an interpreted copy for CPU tensors, and the
# interpreter cannot call libdevice.
INTERPRETED: bool = bool(triton.knobs.runtime.interpret)
# The expert id sits in the key's low 16 bits; a row of keys also has to fit one program's registers.
MAX_EXPERTS = 8192


@triton.jit
def _sigmoid(x, PRECISE_EXP: tl.constexpr):
    # torch's CUDA sigmoid is `1 / (1 + expf(-x))`: the same expf and an IEEE division keep the scores bitwise
    # equal, so ties and orders match the reference exactly.
    if PRECISE_EXP:
        e = libdevice.exp(-x)
    else:
        e = tl.exp(-x)
    return tl.math.div_rn(1.0, 1.0 + e)


@triton.jit
def _route_kernel(
    logits_ptr,
    bias_ptr,
    ids_ptr,
    w_ptr,
    N,
    E,
    stride_l,
    stride_b,
    stride_i,
    stride_w,
    scaling,
    TOP_K: tl.constexpr,
    NORM: tl.constexpr,
    PRECISE_EXP: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid = tl.program_id(0)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    row_off = rows.to(tl.int64) * stride_l
    cols = tl.arange(0, BLOCK_E)
    col_ok = cols < E
    live = row_ok[:, None] & col_ok[None, :]

    x = tl.load(logits_ptr + row_off[:, None] + cols[None, :], mask=live, other=0.0)
    b = tl.load(bias_ptr + cols * stride_b, mask=col_ok, other=0.0).to(tl.float32)
    choice = _sigmoid(x, PRECISE_EXP) + b[None, :]
    # -0.0 and +0.0 compare equal in the reference's sort but not as bit patterns.
    choice = tl.where(choice == 0.0, 0.0, choice)
    bits = choice.to(tl.int32, bitcast=True)
    # Negative floats order backwards as signed ints: flip their magnitude bits. NaN goes above +inf.
    ordered = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    ordered = tl.where(choice != choice, 0x7FFFFFFF, ordered)
    key = (ordered.to(tl.int64) << 16) | (65535 - cols)[None, :].to(tl.int64)
    # Below every real key (those are >= ordered(-inf) << 16 > -2**47): padding and retired experts.
    dead = tl.full([BLOCK_N, BLOCK_E], -(2**62), tl.int64)
    key = tl.where(live, key, dead)

    kk = tl.arange(0, BLOCK_K)
    ids = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.int64)
    for j in tl.static_range(TOP_K):
        best = tl.max(key, axis=1)
        idx = 65535 - (best & 65535)
        ids = tl.where(kk[None, :] == j, idx[:, None], ids)
        key = tl.where(cols[None, :] == idx[:, None], dead, key)

    sel = row_ok[:, None] & (kk[None, :] < TOP_K)
    xs = tl.load(logits_ptr + row_off[:, None] + ids, mask=sel, other=0.0)
    w = tl.where(sel, _sigmoid(xs, PRECISE_EXP), 0.0)
    if NORM:
        w = tl.math.div_rn(w, tl.sum(w, axis=1)[:, None] + 1e-20)
    w = w * scaling
    rows64 = rows.to(tl.int64)[:, None]
    tl.store(ids_ptr + rows64 * stride_i + kk[None, :], ids, mask=sel)
    tl.store(w_ptr + rows64 * stride_w + kk[None, :], w, mask=sel)


def launch_route(
    logits: torch.Tensor,
    bias: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    top_k: int,
    norm_topk_prob: bool,
    scaling: float,
    *,
    rows_per_program: int = 1,
    num_warps: int | None = None,
) -> None:
    """Launch ``_route_kernel`` on checked arguments (`trtllm_glm.moe.router.fused_route` checks them).

    Args:
        logits: ``[N, E]`` fp32, unit last stride, ``N > 0``.
        bias: ``[E]`` float (upcast to fp32 in the kernel).
        topk_ids: ``[N, top_k]`` int64 output, unit last stride.
        topk_weights: ``[N, top_k]`` fp32 output, unit last stride.
        top_k: experts per row, ``1 <= top_k <= E``.
        norm_topk_prob: divide the weights by their sum (plus ``1e-20``) before scaling.
        scaling: the routed scaling factor.
        rows_per_program: rows per program (a power of two).
        num_warps: warps per program (default from the tile size).
    """
    n, e = logits.shape
    block_e = triton.next_power_of_2(e)
    block_n = rows_per_program
    warps = num_warps or max(1, min(8, block_n * block_e // 128))
    _route_kernel[(triton.cdiv(n, block_n),)](
        logits, bias, topk_ids, topk_weights,
        n, e, logits.stride(0), bias.stride(0), topk_ids.stride(0), topk_weights.stride(0),
        float(scaling),
        TOP_K=top_k, NORM=bool(norm_topk_prob), PRECISE_EXP=not INTERPRETED,
        BLOCK_N=block_n, BLOCK_E=block_e, BLOCK_K=triton.next_power_of_2(top_k),
        num_warps=warps,
    )  # fmt: skip
