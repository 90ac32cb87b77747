"""Triton kernel of the KDA decode step's front half: short-conv update, SiLU, q/k L2 norm, in one launch.

`conv_decode` is a drop-in for the reference `trtllm_glm.kda.ops.conv.conv_decode_reference`, which a decode
step ran as a dozen small launches per KDA layer (gather of the conv states, the window concatenation, the
tap products and their sum, SiLU, the state scatter, two row norms, a copy of ``v``).

``_conv_decode_kernel``, grid ``(n, H)``: one program per (decode row, head) covers the head's ``K`` query,
``K`` key and ``V`` value channels (the conv state's channel order is ``q | k | v``, head-major within each).
For each channel it loads the ``W - 1`` stored inputs (oldest first) of the row's state slot and the new input,
computes ``silu(sum_w window[w] * weight[c, w])`` in FP32 (taps in order, oldest first), L2-normalises the
query and key rows of the head (``y / sqrt(sum(y^2) + eps)``), stores ``q``, ``k``, ``v`` and writes the
shifted window back into the slot (the newest input last, cast to the state's dtype). Heads own disjoint
channels, so programs never touch each other's state, and each program reads its window before writing it.
Rows sharing a slot (only the padding rows of a CUDA-graph step do) race on that slot's garbage, which no
real row reads.

Numerics: the same FP32 operations as the reference; the tap sum and the norm's sum of squares may round in
another order (agreement to FP32 rounding). The wrapper allocates only the outputs and never synchronises with
the host: graph-capturable. Under Triton's interpreter (CPU tests) bf16 arithmetic is not IEEE, so inputs are
upcast right after loading and CPU tests check FP32 / FP16.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["conv_decode"]


@triton.jit
def _conv_channels(
    x_ptr,
    state_ptr,
    w_ptr,
    row,
    slot,
    ch,
    mask,
    stride_xn,
    stride_ss,
    stride_sc,
    stride_wc,
    W: tl.constexpr,
):
    """SiLU(conv) of channels ``ch`` of one row; shifts the slot's window in place. Returns FP32 ``[BLOCK]``."""
    xv = tl.load(x_ptr + row * stride_xn + ch, mask=mask, other=0.0).to(tl.float32)
    sbase = state_ptr + slot * stride_ss + ch * stride_sc
    acc = tl.zeros_like(xv)
    prev = tl.load(sbase, mask=mask, other=0.0).to(tl.float32)
    for w in tl.static_range(W - 1):
        acc += prev * tl.load(w_ptr + ch * stride_wc + w, mask=mask, other=0.0).to(tl.float32)
        if w + 1 < W - 1:
            nxt = tl.load(sbase + w + 1, mask=mask, other=0.0).to(tl.float32)
        else:
            nxt = xv
        # The window moves one to the left: entry w takes what entry w + 1 held (the newest input last).
        tl.store(sbase + w, nxt.to(state_ptr.dtype.element_ty), mask=mask)
        prev = nxt
    acc += xv * tl.load(w_ptr + ch * stride_wc + (W - 1), mask=mask, other=0.0).to(tl.float32)
    return acc / (1.0 + tl.exp(-acc))


@triton.jit
def _conv_decode_kernel(
    x_ptr,
    state_ptr,
    w_ptr,
    slots_ptr,
    q_ptr,
    k_ptr,
    v_ptr,
    stride_xn,
    stride_ss,
    stride_sc,
    stride_wc,
    eps,
    H: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    W: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
):
    row = tl.program_id(0)
    h = tl.program_id(1)
    slot = tl.load(slots_ptr + row).to(tl.int64)
    row64 = row.to(tl.int64)
    kk = tl.arange(0, BK)
    km = kk < K
    vv = tl.arange(0, BV)
    vm = vv < V

    q = _conv_channels(x_ptr, state_ptr, w_ptr, row64, slot, h * K + kk, km, stride_xn, stride_ss, stride_sc,
                       stride_wc, W)  # fmt: skip
    q = tl.where(km, q, 0.0)
    q = q / tl.sqrt(tl.sum(q * q, axis=0) + eps)
    tl.store(q_ptr + (row64 * H + h) * K + kk, q, mask=km)

    k = _conv_channels(x_ptr, state_ptr, w_ptr, row64, slot, H * K + h * K + kk, km, stride_xn, stride_ss,
                       stride_sc, stride_wc, W)  # fmt: skip
    k = tl.where(km, k, 0.0)
    k = k / tl.sqrt(tl.sum(k * k, axis=0) + eps)
    tl.store(k_ptr + (row64 * H + h) * K + kk, k, mask=km)

    v = _conv_channels(x_ptr, state_ptr, w_ptr, row64, slot, 2 * H * K + h * V + vv, vm, stride_xn, stride_ss,
                       stride_sc, stride_wc, W)  # fmt: skip
    tl.store(v_ptr + (row64 * H + h) * V + vv, v, mask=vm)


def conv_decode(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    slots: torch.Tensor,
    num_heads: int,
    head_k_dim: int,
    head_v_dim: int,
    eps: float,
    *,
    num_warps: int = 1,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Triton `conv_decode_reference` (same arguments and results; the state is updated in place).

    Args:
        x: ``[n, C]`` one new conv input row per sequence (any float dtype, unit last stride), ``C = H * (2K + V)``.
        conv_state: ``[S, C, W - 1]`` state pool (unit last stride), updated in place at ``slots`` only.
        weight: ``[C, W]`` taps (unit last stride).
        slots: ``[n]`` integer state slot of each row, distinct for real rows.
        num_heads, head_k_dim, head_v_dim: ``H``, ``K``, ``V``.
        eps: added to the squared norm of each query / key head.
        num_warps: warps per program (tuning only).

    Returns:
        ``(q [n, H, K], k [n, H, K], v [n, H, V])`` FP32, contiguous; ``q`` and ``k`` L2-normalised per head.
    """
    n, C = x.shape
    H, K, V = num_heads, head_k_dim, head_v_dim
    Wm1 = conv_state.shape[-1]
    if C != H * (2 * K + V) or conv_state.shape[1] != C or weight.shape != (C, Wm1 + 1):
        raise ValueError(
            f"conv_decode: x {tuple(x.shape)}, conv_state {tuple(conv_state.shape)}, weight {tuple(weight.shape)} "
            f"do not fit H={H}, K={K}, V={V}"
        )
    if Wm1 < 1 or slots.shape != (n,):
        raise ValueError(f"conv_decode: need W >= 2 and [n] slots, got state {tuple(conv_state.shape)}, "
                         f"slots {tuple(slots.shape)}")  # fmt: skip
    if n and (x.stride(1) != 1 or conv_state.stride(2) != 1 or weight.stride(1) != 1):
        raise ValueError("conv_decode: x, conv_state and weight need a unit last stride")
    dev = x.device
    q = torch.empty(n, H, K, dtype=torch.float32, device=dev)
    k = torch.empty(n, H, K, dtype=torch.float32, device=dev)
    v = torch.empty(n, H, V, dtype=torch.float32, device=dev)
    if n == 0:
        return q, k, v
    _conv_decode_kernel[(n, H)](
        x, conv_state, weight, slots, q, k, v,
        x.stride(0), conv_state.stride(0), conv_state.stride(1), weight.stride(0), eps,
        H=H, K=K, V=V, W=Wm1 + 1, BK=triton.next_power_of_2(K), BV=triton.next_power_of_2(V), num_warps=num_warps,
    )  # fmt: skip
    return q, k, v
