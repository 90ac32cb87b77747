"""Triton kernels of the KDA speculative verify pass and its commit, drop-in for `ops.verify`'s references.

`kda_verify` / `kda_commit` take the references' arguments (plus a slot table, ``fresh`` flags and launch knobs)
and return ``KdaRecords``; they allocate only ``o`` and ``u`` and never sync with the host (graph-capturable).
FP32, agreement to FP32 rounding. CPU: an interpreted copy (`trtllm_glm.triton_interp`). Design: ``verify.py``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from trtllm_glm.kda.contract import KdaRecords
from trtllm_glm.triton_interp import KernelPackage

__all__ = [
    "conv_commit_slots",
    "conv_decode",
    "conv_prefill",
    "conv_verify_qkv",
    "kda_gate_beta",
    "kda_verify",
    "kda_commit",
    "kda_decode_inplace",
    "kda_decode_fused",
    "kernel_module",
]

# CPU tensors run an interpreted copy of the same module (trtllm_glm/triton_interp.py).
_PACKAGE = KernelPackage(__name__, __path__)


def kernel_module(name: str, device: torch.device | str) -> Any:
    """The kernel module ``name`` (``"verify"``, ``"conv"``, ``"gate"``, ``"decode_fused"``) for ``device``, for
    launch knobs and tests.

    CUDA devices get the normally imported module (compiled kernels, unless the process runs with
    ``TRITON_INTERPRET=1``); other devices an interpreted copy whose callables run inside
    `trtllm_glm.triton_interp.interpreting`.
    """
    return _PACKAGE.module(name, device)


def kda_verify(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float,
    state: torch.Tensor,
    *,
    state_slots: torch.Tensor | None = None,
    fresh: torch.Tensor | None = None,
    **launch: Any,
) -> tuple[torch.Tensor, KdaRecords]:
    """Triton `ops.verify.kda_verify`: ``W`` rows per sequence from the committed state, which is not written.

    Args:
        q: ``[N, W, H, K]`` (or ``[W, H, K]``) L2-normalised queries (any float dtype and strides).
        k: ``[N, W, H, K]`` L2-normalised keys.
        v: ``[N, W, H, V]``.
        g: ``[N, W, H, K]`` log decay.
        beta: ``[N, W, H]``.
        scale: query scale.
        state: ``[N, H, K, V]`` (or ``[H, K, V]``) committed state, or with ``state_slots`` the pool
            ``[S, H, K, V]``; read as FP32, never modified.
        state_slots: optional ``[N]`` integer slot of each sequence in ``state`` (on its device).
        fresh: optional ``[N]`` bool: those sequences start from zeros (their state is not read).
        **launch: ``out=(o, u)`` persistent output buffers, ``block_v``, ``num_warps``, ``num_stages`` (see
            ``verify.py``).

    Returns:
        ``(o [N, W, H, V] FP32, records)``; ``records.g``/``records.k`` alias ``g``/``k`` when FP32.
    """
    mod = kernel_module("verify", q.device)
    return mod.kda_verify(q, k, v, g, beta, scale, state, state_slots=state_slots, fresh=fresh, **launch)


def kda_commit(
    state: torch.Tensor,
    records: KdaRecords,
    num_accepted: Sequence[int] | torch.Tensor | int,
    *,
    state_slots: torch.Tensor | None = None,
    fresh: torch.Tensor | None = None,
    **launch: Any,
) -> torch.Tensor:
    """Triton `ops.verify.kda_commit`: replay the first ``a`` records of each sequence into its state, in place.

    Args:
        state: ``[N, H, K, V]`` (or ``[H, K, V]``) state the verify pass started from, or with ``state_slots``
            the pool ``[S, H, K, V]``; updated in place (``a = 0`` and not fresh: not written at all).
        records: `KdaRecords` of that verify pass (from either implementation).
        num_accepted: ``a`` per sequence (host list, ``[N]`` device tensor read without a sync, or one int).
        state_slots: optional ``[N]`` integer slot of each sequence in ``state``.
        fresh: optional ``[N]`` bool: start from zeros; the slot is written even when ``a = 0``.
        **launch: ``block_v``, ``num_warps``, ``num_stages``.

    Returns:
        ``state``.
    """
    mod = kernel_module("verify", state.device)
    return mod.kda_commit(state, records, num_accepted, state_slots=state_slots, fresh=fresh, **launch)


def kda_decode_inplace(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float,
    state: torch.Tensor,
    slots: torch.Tensor,
    **launch: Any,
) -> torch.Tensor:
    """One decode row per sequence with the verify kernel's step, the state pool updated in place at ``slots``.

    The batch-invariant mode's decode (`ops.backend.kda_decode_inplace`): the same step function and launch
    shape as `kda_verify`, so a decode row and a verify row of the same inputs give the same bits.

    Args:
        q: ``[n, H, K]`` L2-normalised queries.
        k: ``[n, H, K]`` L2-normalised keys.
        v: ``[n, H, V]``.
        g: ``[n, H, K]`` log decay.
        beta: ``[n, H]``.
        scale: query scale.
        state: ``[S, H, K, V]`` state pool, updated in place at ``slots``.
        slots: ``[n]`` integer slots (distinct for real rows).
        **launch: ``out``, ``block_v``, ``num_warps`` (see ``verify.py``).

    Returns:
        ``o [n, H, V]`` FP32.
    """
    return kernel_module("verify", q.device).kda_decode_inplace(q, k, v, g, beta, scale, state, slots, **launch)


def conv_decode(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    slots: torch.Tensor,
    num_heads: int,
    head_k_dim: int,
    head_v_dim: int,
    eps: float,
    **launch: Any,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Triton `ops.conv.conv_decode_reference` in one launch (``conv.py`` has the kernel design).

    Args:
        x: ``[n, C]`` new conv inputs, ``C = H * (2K + V)``.
        conv_state: ``[S, C, W - 1]`` state pool, updated in place at ``slots``.
        weight: ``[C, W]`` taps.
        slots: ``[n]`` integer state slots.
        num_heads, head_k_dim, head_v_dim: ``H``, ``K``, ``V``.
        eps: added to each q / k head's squared norm.
        **launch: ``num_warps``.

    Returns:
        ``(q [n, H, K], k [n, H, K], v [n, H, V])`` FP32.
    """
    mod = kernel_module("conv", x.device)
    return mod.conv_decode(x, conv_state, weight, slots, num_heads, head_k_dim, head_v_dim, eps, **launch)


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
    **launch: Any,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Triton `ops.conv.conv_prefill_reference` (``conv.py`` has the kernel design), without a host sync.

    Args:
        x: ``[N, C]`` the step's conv inputs, ``C = H * (2K + V)``.
        conv_state: ``[S, C, W - 1]`` state pool, each sequence's slot given its new window in place.
        weight: ``[C, W]`` taps.
        slots: ``[n]`` integer state slots.
        cu_seqlens: ``[n + 1]`` integer offsets of the sequences in the packed output.
        num_heads, head_k_dim, head_v_dim: ``H``, ``K``, ``V``.
        row0: optional ``[n]`` first row of each sequence in ``x`` (with ``num_rows``); ``None``: ``x`` holds
            the packed rows.
        num_rows: packed rows ``T`` (host int; default ``N`` without ``row0``).
        fresh: optional ``[n]`` bool: start from zeros.
        **launch: ``eps``, ``block_t``, ``num_warps``.

    Returns:
        ``(q [T, H, K], k [T, H, K], v [T, H, V])`` FP32, contiguous.
    """
    mod = kernel_module("conv", x.device)
    return mod.conv_prefill(x, conv_state, weight, slots, cu_seqlens, num_heads, head_k_dim, head_v_dim,
                            row0=row0, num_rows=num_rows, fresh=fresh, **launch)  # fmt: skip


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
    **launch: Any,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Triton `ops.conv.conv_verify_qkv_reference` in one launch (``conv.py`` has the kernel design).

    Args:
        x: ``[N, C]`` the verify step's conv inputs, ``C = H * (2K + V)``.
        conv_state: ``[S, C, W - 1]`` state pool, only read (at ``slots``).
        weight: ``[C, W]`` taps.
        slots: ``[n]`` integer state slots.
        num_heads, head_k_dim, head_v_dim: ``H``, ``K``, ``V``.
        width_max: ``Wm``, padded rows per sequence.
        row0, widths: optional ``[n]`` first row and row count of each sequence (both or neither; neither: the
            uniform layout, sequence ``j`` at rows ``j * Wm ..``).
        fresh: optional ``[n]`` bool: start from zeros.
        **launch: ``eps``, ``num_warps``.

    Returns:
        ``(q [n, Wm, H, K], k [n, Wm, H, K], v [n, Wm, H, V])`` FP32, padding rows zero.
    """
    mod = kernel_module("conv", x.device)
    return mod.conv_verify_qkv(x, conv_state, weight, slots, num_heads, head_k_dim, head_v_dim, width_max,
                               row0=row0, widths=widths, fresh=fresh, **launch)  # fmt: skip


def conv_commit_slots(
    conv_state: torch.Tensor,
    x: torch.Tensor,
    slots: torch.Tensor,
    accepted: torch.Tensor,
    width_max: int,
    *,
    row0: torch.Tensor | None = None,
    fresh: torch.Tensor | None = None,
    **launch: Any,
) -> torch.Tensor:
    """Triton `ops.conv.conv_commit_slots_reference` in one launch, in place (``conv.py`` has the design).

    Args:
        conv_state: ``[S, C, W - 1]`` state pool, updated at ``slots``.
        x: ``[N, C]`` the verify step's conv inputs.
        slots: ``[n]`` integer state slots.
        accepted: ``[n]`` integer device tensor of accepted rows.
        width_max: ``Wm`` of the verify step.
        row0: optional ``[n]`` first row of each sequence (``None``: the uniform layout).
        fresh: optional ``[n]`` bool: start from zeros.
        **launch: ``block_c``, ``num_warps``.

    Returns:
        ``conv_state``.
    """
    mod = kernel_module("conv", conv_state.device)
    return mod.conv_commit_slots(conv_state, x, slots, accepted, width_max, row0=row0, fresh=fresh, **launch)


def kda_gate_beta(
    g_raw: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, lower_bound: float, **launch: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton `ops.gate.kda_gate_beta_reference` in one launch (``gate.py`` has the kernel design).

    Args:
        g_raw: ``[N, H * K]`` gate logits.
        b: ``[N, H]`` beta logits.
        A_log: ``[H]`` per-head log rate.
        dt_bias: ``[H * K]`` per-channel bias.
        lower_bound: negative bound of the log decay.
        **launch: ``block``, ``num_warps``.

    Returns:
        ``(g [N, H, K], beta [N, H])`` FP32.
    """
    return kernel_module("gate", g_raw.device).kda_gate_beta(g_raw, b, A_log, dt_bias, lower_bound, **launch)


def kda_decode_fused(
    x: torch.Tensor,
    fa: torch.Tensor,
    b: torch.Tensor,
    ga: torch.Tensor,
    conv_state: torch.Tensor,
    conv_weight: torch.Tensor,
    slots: torch.Tensor,
    f_b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    lower_bound: float,
    state: torch.Tensor,
    g_b: torch.Tensor,
    norm_weight: torch.Tensor,
    norm_eps: float,
    scale: float,
    out_dtype: torch.dtype,
    **launch: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton `ops.decode_fused.kda_decode_fused_reference`: a KDA decode step from the input projection's row
    to ``o_proj``'s input in one launch (``decode_fused.py`` has the kernel design; same arguments).

    Args:
        x: ``[n, C]`` conv inputs; fa / ga: ``[n, R]`` the gates' low-rank inputs; b: ``[n, H]`` beta logits.
        conv_state: ``[S, C, W - 1]`` and state: ``[S, H, K, V]`` pools, updated in place at ``slots [n]``.
        conv_weight: ``[C, W]`` taps; f_b: ``[H * K, R]``; g_b: ``[H * V, R]``; A_log: ``[H]``; dt_bias:
            ``[H * K]``; norm_weight: ``[V]``.
        lower_bound, norm_eps, scale: the gate's bound, the norm's epsilon, the query scale.
        out_dtype: dtype of the ``o_proj`` input.
        **launch: ``f_b_scale``, ``g_b_scale``, ``quant_block`` (block-FP8 low-rank weights), ``l2_eps``,
            ``block_v``, ``num_warps``.

    Returns:
        ``(y [n, H * V] out_dtype, o [n, H, V] FP32)``.
    """
    mod = kernel_module("decode_fused", x.device)
    return mod.kda_decode_fused(x, fa, b, ga, conv_state, conv_weight, slots, f_b, A_log, dt_bias, lower_bound,
                                state, g_b, norm_weight, norm_eps, scale, out_dtype, **launch)  # fmt: skip
