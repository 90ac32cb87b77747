"""Depthwise causal short convolution with SiLU, its one-step update, and its verify/commit pair.

Conventions (same as the ``causal-conv1d`` package): ``weight [C, W]`` where tap ``W - 1`` multiplies the
current input and tap ``0`` the input ``W - 1`` rows back; the state ``[C, W - 1]`` holds the last
``W - 1`` inputs (pre-convolution), oldest first. All math in FP32.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from ...triton_interp import kernel_backend
from .gate import L2NORM_EPS

__all__ = [
    "CONV_BACKEND_ENV",
    "causal_conv1d_ref",
    "causal_conv1d_update",
    "conv_decode",
    "conv_decode_reference",
    "conv_verify",
    "conv_commit",
]

# Picks `conv_decode`'s implementation: auto (the Triton kernel for CUDA tensors), torch or triton.
CONV_BACKEND_ENV = "TRTLLM_GLM_KDA_CONV_BACKEND"


def _conv_windows(xx: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, T: int) -> torch.Tensor:
    """``xx [..., W - 1 + T, C]`` history-then-rows -> SiLU(conv) ``[..., T, C]``."""
    W = weight.shape[-1]
    win = xx.unfold(-2, W, 1)  # [..., T, C, W]
    y = (win * weight.float()).sum(-1)
    if bias is not None:
        y = y + bias.float()
    return F.silu(y)


def causal_conv1d_ref(
    x: torch.Tensor,
    conv_state: torch.Tensor | None,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Short convolution of one sequence's rows, continuing from a conv state.

    Args:
        x: ``[T, C]`` inputs (pre-convolution).
        conv_state: ``[C, W - 1]`` previous inputs (oldest first), or ``None`` for a fresh sequence (zeros);
            not modified.
        weight: ``[C, W]`` depthwise taps.
        bias: ``[C]`` or ``None``.

    Returns:
        ``(y [T, C] FP32 after SiLU, new_state [C, W - 1] FP32)``: the new state holds the last ``W - 1``
        inputs of history-then-``x`` (so it still contains old state entries when ``T < W - 1``).
    """
    T, C = x.shape
    W = weight.shape[-1]
    if conv_state is None:
        conv_state = torch.zeros(C, W - 1, dtype=torch.float32, device=x.device)
    xx = torch.cat([conv_state.float().transpose(0, 1), x.float()], dim=0)  # [W - 1 + T, C]
    y = _conv_windows(xx, weight, bias, T)
    new_state = xx[T:].transpose(0, 1).contiguous()
    return y, new_state


def causal_conv1d_update(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode row per sequence.

    Args:
        x: ``[N, C]`` one input row per sequence.
        conv_state: ``[N, C, W - 1]``; not modified.
        weight: ``[C, W]``.
        bias: ``[C]`` or ``None``.

    Returns:
        ``(y [N, C] FP32, new_state [N, C, W - 1] FP32)`` with the window shifted by one.
    """
    xx = torch.cat([conv_state.float(), x.float().unsqueeze(-1)], dim=-1)  # [N, C, W]
    y = _conv_windows(xx.transpose(-1, -2), weight, bias, 1).squeeze(-2)
    return y, xx[..., 1:].contiguous()


def conv_decode_reference(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    slots: torch.Tensor,
    num_heads: int,
    head_k_dim: int,
    head_v_dim: int,
    eps: float = L2NORM_EPS,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A KDA decode step's front half: each row's short-conv update with SiLU, split into heads, q/k L2 norm.

    Args:
        x: ``[n, C]`` one new conv input row per sequence, ``C = H * (2K + V)`` (channels ``q | k | v``).
        conv_state: ``[S, C, W - 1]`` state pool; the rows' slots are updated in place (window shifted by one,
            the new input last), no other slot is written.
        weight: ``[C, W]`` taps.
        slots: ``[n]`` int64 distinct state slot of each row, on ``conv_state``'s device.
        num_heads, head_k_dim, head_v_dim: ``H``, ``K``, ``V``.
        eps: added to the squared norm of each query / key head.

    Returns:
        ``(q [n, H, K], k [n, H, K], v [n, H, V])`` FP32; ``q`` and ``k`` are ``y / sqrt(sum(y^2) + eps)`` per head.
    """
    n = x.shape[0]
    H, K, V = num_heads, head_k_dim, head_v_dim
    y, new_state = causal_conv1d_update(x, conv_state.index_select(0, slots), weight)
    conv_state.index_copy_(0, slots, new_state.to(conv_state.dtype))
    q, k, v = y.split([H * K, H * K, H * V], dim=-1)
    q, k = (t.reshape(n, H, K) for t in (q, k))
    q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + eps)
    k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + eps)
    return q, k, v.reshape(n, H, V)


def conv_decode(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    slots: torch.Tensor,
    num_heads: int,
    head_k_dim: int,
    head_v_dim: int,
    eps: float = L2NORM_EPS,
    *,
    backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`conv_decode_reference`, in one Triton launch (`trtllm_glm.kda.kernels.conv_decode`) for CUDA tensors.

    ``backend`` (default ``TRTLLM_GLM_KDA_CONV_BACKEND``, else auto): ``"torch"``, ``"triton"`` (on the CPU
    through Triton's interpreter) or ``"auto"``; ``TRTLLM_GLM_KDA_BACKEND=torch`` (the KDA torch-everything
    switch) also selects the reference. Same arguments and results as the reference.
    """
    choice = kernel_backend("KDA conv", CONV_BACKEND_ENV, [x], backend)
    if choice == "triton" and (backend is not None or os.environ.get("TRTLLM_GLM_KDA_BACKEND") != "torch"):
        from ..kernels import conv_decode as kernel

        return kernel(x, conv_state, weight, slots, num_heads, head_k_dim, head_v_dim, eps)
    return conv_decode_reference(x, conv_state, weight, slots, num_heads, head_k_dim, head_v_dim, eps)


def conv_verify(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Convolution outputs of ``Wv`` verify rows from the committed state, which is left unchanged.

    Args:
        x: ``[N, Wv, C]`` (or ``[Wv, C]``) verify rows.
        conv_state: ``[N, C, W - 1]`` (or ``[C, W - 1]``) committed window; not modified.
        weight: ``[C, W]``.
        bias: ``[C]`` or ``None``.

    Returns:
        ``y [N, Wv, C]`` (or ``[Wv, C]``) FP32 after SiLU.
    """
    Wv = x.shape[-2]
    xx = torch.cat([conv_state.float().transpose(-1, -2), x.float()], dim=-2)
    return _conv_windows(xx, weight, bias, Wv)


def conv_commit(
    conv_state: torch.Tensor,
    x_rows: torch.Tensor,
    num_accepted: Sequence[int] | torch.Tensor | int,
) -> torch.Tensor:
    """Re-base the conv window, in place, so that it ends at verify row ``a - 1`` (the convolution shift).

    The window after accepting ``a`` rows is the last ``W - 1`` entries of ``state ++ x_rows[:a]``; ``a = 0``
    leaves the state as it is. Pure data movement, so the result is bit-exact.

    Args:
        conv_state: ``[N, C, W - 1]`` (or ``[C, W - 1]``) committed window, updated in place.
        x_rows: ``[N, Wv, C]`` (or ``[Wv, C]``) the verify rows' conv inputs.
        num_accepted: ``a`` per sequence in ``0..Wv`` (list, ``[N]`` integer tensor, or one int).

    Returns:
        ``conv_state`` (the same tensor).
    """
    squeeze = conv_state.dim() == 2
    cs = conv_state.unsqueeze(0) if squeeze else conv_state
    xr = x_rows.unsqueeze(0) if squeeze else x_rows
    N, C, Wm1 = cs.shape
    Wv = xr.shape[1]
    a = _accepted_tensor(num_accepted, N, Wv, cs.device)
    xx = torch.cat([cs, xr.to(cs.dtype).transpose(1, 2)], dim=-1)  # [N, C, W - 1 + Wv]
    # Window of sequence n is xx[n, :, a_n : a_n + W - 1].
    idx = (a.view(N, 1) + torch.arange(Wm1, device=cs.device).view(1, Wm1)).view(N, 1, Wm1).expand(N, C, Wm1)
    cs.copy_(torch.gather(xx, 2, idx))
    return conv_state


def _accepted_tensor(
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
