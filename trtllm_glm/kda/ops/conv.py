"""Depthwise causal short convolution with SiLU, its one-step update, and its verify/commit pair.

Conventions (same as the ``causal-conv1d`` package): ``weight [C, W]`` where tap ``W - 1`` multiplies the
current input and tap ``0`` the input ``W - 1`` rows back; the state ``[C, W - 1]`` holds the last
``W - 1`` inputs (pre-convolution), oldest first. All math in FP32.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from ... import envs
from ...triton_interp import kernel_backend
from ..contract import L2NORM_EPS
from ..contract import accepted_tensor as _accepted_tensor

__all__ = [
    "CONV_BACKEND_ENV",
    "causal_conv1d_ref",
    "causal_conv1d_update",
    "conv_decode",
    "conv_decode_reference",
    "conv_verify",
    "conv_commit",
    "conv_verify_qkv",
    "conv_verify_qkv_reference",
    "conv_commit_slots",
    "conv_commit_slots_reference",
    "conv_prefill",
    "conv_prefill_reference",
    "verify_rows",
]

# Picks the implementation of `conv_decode`, `conv_prefill`, `conv_verify_qkv` and `conv_commit_slots`: auto (the
# Triton kernels for CUDA tensors), torch or triton.
CONV_BACKEND_ENV = envs.KDA_CONV_BACKEND.name


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
    if _use_kernel(x, backend):
        from ..kernels import conv_decode as kernel

        return kernel(x, conv_state, weight, slots, num_heads, head_k_dim, head_v_dim, eps)
    return conv_decode_reference(x, conv_state, weight, slots, num_heads, head_k_dim, head_v_dim, eps)


def _host_ints(t: torch.Tensor | Sequence[int]) -> list[int]:
    return [int(v) for v in (t.tolist() if isinstance(t, torch.Tensor) else t)]


def conv_prefill_reference(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    slots: torch.Tensor,
    cu_seqlens: torch.Tensor | Sequence[int],
    num_heads: int,
    head_k_dim: int,
    head_v_dim: int,
    *,
    row0: torch.Tensor | Sequence[int] | None = None,
    num_rows: int | None = None,
    fresh: torch.Tensor | Sequence[bool] | None = None,
    eps: float = L2NORM_EPS,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A KDA prefill step's front half: each sequence's rows convolved from its window (`causal_conv1d_ref`),
    SiLU, split into heads, q/k L2 norm; each sequence's slot gets its new window.

    Args:
        x: ``[N, C]`` conv inputs, ``C = H * (2K + V)`` (channels ``q | k | v``).
        conv_state: ``[S, C, W - 1]`` state pool, updated in place at ``slots`` only (the last ``W - 1`` inputs
            of window-then-rows, rounded to the pool's dtype).
        weight: ``[C, W]`` taps.
        slots: ``[n]`` int64 distinct state slot of each sequence.
        cu_seqlens: ``n + 1`` offsets of the sequences in the packed output (tensor or host list; a device tensor
            is read on the host here: the reference syncs, the kernel does not).
        num_heads, head_k_dim, head_v_dim: ``H``, ``K``, ``V``.
        row0: optional ``n`` first row of each sequence in ``x`` (then give ``num_rows``); ``None``: ``x`` holds
            the packed rows (sequence ``i`` at rows ``cu[i] .. cu[i + 1] - 1``).
        num_rows: packed rows ``T = cu[-1]`` (default ``N`` when ``row0`` is ``None``).
        fresh: optional ``n`` flags: those sequences start from zeros (their slot's contents are not read).
        eps: added to the squared norm of each query / key head.

    Returns:
        ``(q [T, H, K], k [T, H, K], v [T, H, V])`` FP32; ``q`` and ``k`` are ``y / sqrt(sum(y^2) + eps)`` per head.
    """
    if row0 is not None and num_rows is None:
        raise ValueError("conv_prefill: give num_rows (the packed row count) with row0")
    H, K, V = num_heads, head_k_dim, head_v_dim
    T = x.shape[0] if num_rows is None else int(num_rows)
    cu = _host_ints(cu_seqlens)
    starts = cu[:-1] if row0 is None else _host_ints(row0)
    is_fresh = [False] * len(starts) if fresh is None else [bool(f) for f in _host_ints(fresh)]
    slot_list = _host_ints(slots)
    ys = []
    for i, slot in enumerate(slot_list):
        n_i, s = cu[i + 1] - cu[i], starts[i]
        if n_i == 0:  # no rows: the window stays (zeros when fresh)
            if is_fresh[i]:
                conv_state[slot].zero_()
            continue
        prev = None if is_fresh[i] else conv_state[slot]
        y, new_state = causal_conv1d_ref(x[s : s + n_i].float(), prev, weight)
        conv_state[slot].copy_(new_state)
        ys.append(y)
    y = torch.cat(ys, dim=0) if ys else x.new_zeros(0, x.shape[1], dtype=torch.float32)
    if y.shape[0] != T:
        raise ValueError(f"conv_prefill: cu_seqlens cover {y.shape[0]} rows, expected {T}")
    q, k, v = y.split([H * K, H * K, H * V], dim=-1)
    q, k = q.reshape(T, H, K), k.reshape(T, H, K)
    q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + eps)
    k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + eps)
    return q, k, v.reshape(T, H, V)


def conv_prefill(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    slots: torch.Tensor,
    cu_seqlens: torch.Tensor,
    num_heads: int,
    head_k_dim: int,
    head_v_dim: int,
    *,
    row0: torch.Tensor | None = None,
    num_rows: int | None = None,
    fresh: torch.Tensor | None = None,
    eps: float = L2NORM_EPS,
    backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`conv_prefill_reference` in two Triton launches (`trtllm_glm.kda.kernels.conv_prefill`) for CUDA tensors,
    without a host sync (``cu_seqlens``, ``row0``, ``fresh``, ``slots`` device tensors); ``backend`` as in
    `conv_decode`. Same arguments and results (to FP32 rounding; the windows bit for bit) as the reference."""
    if _use_kernel(x, backend):
        from ..kernels import conv_prefill as kernel

        return kernel(x, conv_state, weight, slots, cu_seqlens, num_heads, head_k_dim, head_v_dim,
                      row0=row0, num_rows=num_rows, fresh=fresh, eps=eps)  # fmt: skip
    return conv_prefill_reference(x, conv_state, weight, slots, cu_seqlens, num_heads, head_k_dim, head_v_dim,
                                  row0=row0, num_rows=num_rows, fresh=fresh, eps=eps)  # fmt: skip


def _use_kernel(x: torch.Tensor, backend: str | None) -> bool:
    """Whether a conv op runs its Triton kernel (`kernel_backend` on ``TRTLLM_GLM_KDA_CONV_BACKEND``; without an
    explicit ``backend``, ``TRTLLM_GLM_KDA_BACKEND=torch`` selects the references too)."""
    choice = kernel_backend(envs.KDA_CONV_BACKEND, [x], backend)
    return choice == "triton" and (backend is not None or envs.KDA_BACKEND.get() != "torch")


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


def verify_rows(
    x: torch.Tensor,
    n: int,
    width_max: int,
    row0: torch.Tensor | None = None,
    widths: torch.Tensor | None = None,
) -> torch.Tensor:
    """The verify rows of ``n`` sequences gathered from the step's flat conv inputs, padded to ``width_max``.

    Args:
        x: ``[N, C]`` conv inputs of the step (any float dtype).
        n: sequences.
        width_max: ``Wm``.
        row0: ``[n]`` integer first row of each sequence, or ``None`` for the uniform layout (sequence ``j`` at
            rows ``j * Wm .. j * Wm + Wm - 1``, which ``x`` must hold).
        widths: ``[n]`` integer rows of each sequence; rows at or past it are zeros. ``None``: every row is
            taken (with ``row0``, rows past the sequence are other sequences' or, clamped, the last row of
            ``x``: callers read only rows below the width).

    Returns:
        ``x_rows [n, Wm, C]`` FP32.
    """
    N, C = x.shape
    if row0 is None:
        return x[: n * width_max].float().reshape(n, width_max, C)
    j = torch.arange(width_max, dtype=torch.int64, device=x.device).view(1, width_max)
    if widths is None:
        return x[(row0.view(n, 1).to(torch.int64) + j).clamp(max=max(N - 1, 0))].float()
    w = widths.view(n, 1).to(torch.int64)
    # Padding entries point at the sequence's last row (always a row of x) and are masked to zero.
    idx = row0.view(n, 1).to(torch.int64) + torch.minimum(j, (w - 1).clamp(min=0))
    return torch.where((j < w).unsqueeze(-1), x[idx.clamp(0, max(N - 1, 0))].float(), 0.0)


def conv_verify_qkv_reference(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    slots: torch.Tensor,
    num_heads: int,
    head_k_dim: int,
    head_v_dim: int,
    width_max: int,
    *,
    row0: torch.Tensor | None = None,
    widths: torch.Tensor | None = None,
    fresh: torch.Tensor | None = None,
    eps: float = L2NORM_EPS,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A KDA verify step's front half: each sequence's rows convolved from its committed window (not changed),
    SiLU, split into heads, q/k L2 norm.

    Args:
        x: ``[N, C]`` the step's conv inputs, ``C = H * (2K + V)`` (channels ``q | k | v``).
        conv_state: ``[S, C, W - 1]`` state pool; only read, at ``slots``.
        weight: ``[C, W]`` taps.
        slots: ``[n]`` int64 state slot of each sequence, on ``conv_state``'s device.
        num_heads, head_k_dim, head_v_dim: ``H``, ``K``, ``V``.
        width_max: ``Wm``, the padded rows per sequence.
        row0: ``[n]`` integer first row of each sequence in ``x``; with ``widths``. Both ``None``: the uniform
            layout, sequence ``j`` at rows ``j * Wm .. j * Wm + Wm - 1``.
        widths: ``[n]`` integer rows of each sequence (``1..Wm``); with ``row0``.
        fresh: optional ``[n]`` bool: those sequences start from zeros (their slot's contents are not used).
        eps: added to the squared norm of each query / key head.

    Returns:
        ``(q [n, Wm, H, K], k [n, Wm, H, K], v [n, Wm, H, V])`` FP32; ``q`` and ``k`` are
        ``y / sqrt(sum(y^2) + eps)`` per head; rows past a sequence's width are zeros.
    """
    if (row0 is None) != (widths is None):
        raise ValueError("conv_verify_qkv: give both row0 and widths, or neither (the uniform layout)")
    n, Wm = slots.shape[0], width_max
    H, K, V = num_heads, head_k_dim, head_v_dim
    conv0 = conv_state.index_select(0, slots)
    if fresh is not None:
        # torch.where, not a multiply: a fresh sequence's slot may hold NaN/inf.
        conv0 = torch.where(fresh.view(-1, 1, 1), 0.0, conv0)
    y = conv_verify(verify_rows(x, n, Wm, row0, widths), conv0, weight)
    q, k, v = y.split([H * K, H * K, H * V], dim=-1)
    q, k, v = q.reshape(n, Wm, H, K), k.reshape(n, Wm, H, K), v.reshape(n, Wm, H, V)
    q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + eps)
    k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + eps)
    if widths is not None:
        # Padding rows convolve real rows with zeros: not zero by themselves.
        valid = (torch.arange(Wm, device=x.device).view(1, Wm) < widths.view(n, 1)).view(n, Wm, 1, 1)
        q, k, v = (torch.where(valid, t, 0.0) for t in (q, k, v))
    return q, k, v


def conv_verify_qkv(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    slots: torch.Tensor,
    num_heads: int,
    head_k_dim: int,
    head_v_dim: int,
    width_max: int,
    *,
    row0: torch.Tensor | None = None,
    widths: torch.Tensor | None = None,
    fresh: torch.Tensor | None = None,
    eps: float = L2NORM_EPS,
    zero_padding: bool = True,
    backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`conv_verify_qkv_reference`, in one Triton launch (`trtllm_glm.kda.kernels.conv_verify_qkv`) for CUDA
    tensors; ``backend`` as in `conv_decode`. Same arguments and results as the reference, except that with
    ``zero_padding=False`` the rows past a sequence's width are unspecified (the kernel leaves them unwritten, the
    reference zeroes them): for a caller that never reads them."""
    if _use_kernel(x, backend):
        from ..kernels import conv_verify_qkv as kernel

        return kernel(x, conv_state, weight, slots, num_heads, head_k_dim, head_v_dim, width_max,
                      row0=row0, widths=widths, fresh=fresh, eps=eps, zero_padding=zero_padding)  # fmt: skip
    return conv_verify_qkv_reference(x, conv_state, weight, slots, num_heads, head_k_dim, head_v_dim, width_max,
                                     row0=row0, widths=widths, fresh=fresh, eps=eps)  # fmt: skip


def conv_commit_slots_reference(
    conv_state: torch.Tensor,
    x: torch.Tensor,
    slots: torch.Tensor,
    accepted: torch.Tensor,
    width_max: int,
    *,
    row0: torch.Tensor | None = None,
    fresh: torch.Tensor | None = None,
) -> torch.Tensor:
    """The commit of a verify step's conv windows: each sequence's window re-based on its accepted rows, in place.

    The window of a sequence that accepted ``a`` rows becomes the last ``W - 1`` entries of
    ``window ++ rows[:a]`` (`conv_commit`), its window read as zeros when it is fresh; ``a = 0`` leaves it as it
    is (zeros when fresh). Rows are rounded to the state's dtype through FP32. Pure data movement: bit-exact.

    Args:
        conv_state: ``[S, C, W - 1]`` state pool, updated in place at ``slots`` only.
        x: ``[N, C]`` the verify step's conv inputs (any float dtype).
        slots: ``[n]`` int64 distinct state slot of each sequence, on ``conv_state``'s device.
        accepted: ``[n]`` integer tensor, ``a`` in ``0..width`` per sequence.
        width_max: ``Wm`` of the verify step (the uniform layout's row stride).
        row0: optional ``[n]`` integer first row of each sequence in ``x`` (``None``: the uniform layout, sequence
            ``j`` at row ``j * Wm``).
        fresh: optional ``[n]`` bool: start those windows from zeros.

    Returns:
        ``conv_state``.
    """
    n = slots.shape[0]
    cs = conv_state.index_select(0, slots)
    if fresh is not None:
        cs = torch.where(fresh.view(-1, 1, 1), 0.0, cs)
    # Rows at or past a sequence's accepted count are never read, so no width mask is needed.
    conv_commit(cs, verify_rows(x, n, width_max, row0), accepted)
    conv_state.index_copy_(0, slots, cs)
    return conv_state


def conv_commit_slots(
    conv_state: torch.Tensor,
    x: torch.Tensor,
    slots: torch.Tensor,
    accepted: Sequence[int] | torch.Tensor | int,
    width_max: int,
    *,
    row0: torch.Tensor | None = None,
    fresh: torch.Tensor | None = None,
    backend: str | None = None,
) -> torch.Tensor:
    """`conv_commit_slots_reference`, in one Triton launch (`trtllm_glm.kda.kernels.conv_commit_slots`) for CUDA
    tensors; ``backend`` as in `conv_decode`.

    ``accepted`` may also be a host list or one int (range-checked against ``width_max``, then copied to the
    device); a device tensor is used as it is, without a sync. Otherwise the reference's arguments and result.
    """
    # (contiguous: a one-element tensor is expanded to n, and the kernel reads a unit stride)
    a = _accepted_tensor(accepted, slots.shape[0], width_max, conv_state.device).contiguous()
    if _use_kernel(conv_state, backend):
        from ..kernels import conv_commit_slots as kernel

        return kernel(conv_state, x, slots, a, width_max, row0=row0, fresh=fresh)
    return conv_commit_slots_reference(conv_state, x, slots, a, width_max, row0=row0, fresh=fresh)
