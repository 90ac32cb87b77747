"""Token-by-token KDA recurrence (torch reference, FP32).

State layout ``[..., H, K, V]`` (key-major, the cache layout). One step per head: ``S <- exp(g)[:, None] * S``;
``u = beta * (v - k @ S)``; ``S <- S + k[:, None] * u[None, :]``; ``o = (scale * q) @ S``. ``q`` and ``k`` are
expected L2-normalised by the caller; ``scale`` (``K^-0.5``) is applied here. docs/design.md §4.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["recurrent_kda_step", "recurrent_kda", "normalize_cu_seqlens"]


def normalize_cu_seqlens(cu_seqlens: Sequence[int] | torch.Tensor | None, total: int) -> list[int]:
    """Host list of cumulative sequence starts; ``None`` means one sequence of ``total`` rows."""
    if cu_seqlens is None:
        return [0, total]
    cu = cu_seqlens.tolist() if isinstance(cu_seqlens, torch.Tensor) else [int(c) for c in cu_seqlens]
    if len(cu) < 1 or cu[0] != 0 or any(b < a for a, b in zip(cu, cu[1:])) or cu[-1] > total:
        raise ValueError(f"cu_seqlens must start at 0, be non-decreasing and end <= {total}, got {cu}")
    return cu


def _decay_update(S: torch.Tensor, g: torch.Tensor, k: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """``exp(g)[:, None] * S + k u^T``; the one expression both the step and commit use, so that a
    width-one verify + commit reproduces a plain decode step bit for bit."""
    S = S * g.exp().unsqueeze(-1)
    return S + k.unsqueeze(-1) * u.unsqueeze(-2)


def _step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float,
    S: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One token for a batch of heads. Shapes ``q, k, g [..., K]``, ``v [..., V]``, ``beta [...]``,
    ``S [..., K, V]`` (all FP32). Returns ``(o [..., V], S_new, u [..., V])``."""
    S_dec = S * g.exp().unsqueeze(-1)
    kS = (k.unsqueeze(-1) * S_dec).sum(-2)
    u = beta.unsqueeze(-1) * (v - kS)
    S_new = S_dec + k.unsqueeze(-1) * u.unsqueeze(-2)
    o = ((q * scale).unsqueeze(-1) * S_new).sum(-2)
    return o, S_new, u


def recurrent_kda_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode token per sequence.

    Args:
        q: ``[N, H, K]`` L2-normalised queries.
        k: ``[N, H, K]`` L2-normalised keys.
        v: ``[N, H, V]`` values.
        g: ``[N, H, K]`` log decay (``<= 0``).
        beta: ``[N, H]`` write strength in ``[0, 1]``.
        scale: query scale (``K^-0.5``).
        state: ``[N, H, K, V]`` FP32 state before the token; not modified.

    Returns:
        ``(o [N, H, V] FP32, new_state [N, H, K, V] FP32)``.
    """
    o, S_new, _ = _step(q.float(), k.float(), v.float(), g.float(), beta.float(), scale, state.float())
    return o, S_new


def recurrent_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float,
    initial_state: torch.Tensor | None = None,
    cu_seqlens: Sequence[int] | torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Naive token loop over a flat variable-length batch (the reference every other path is tested on).

    Args:
        q: ``[T, H, K]`` L2-normalised queries, sequences concatenated.
        k: ``[T, H, K]`` L2-normalised keys.
        v: ``[T, H, V]`` values.
        g: ``[T, H, K]`` log decay.
        beta: ``[T, H]``.
        scale: query scale.
        initial_state: ``[N, H, K, V]`` state before each sequence, or ``None`` for zeros; not modified.
        cu_seqlens: ``N + 1`` row offsets (host list or tensor); ``None`` means a single sequence.

    Returns:
        ``(o [T, H, V] FP32, final_state [N, H, K, V] FP32)``. Rows past ``cu_seqlens[-1]`` are zero.
    """
    T, H, K = q.shape
    V = v.shape[-1]
    cu = normalize_cu_seqlens(cu_seqlens, T)
    N = len(cu) - 1
    q, k, v, g, beta = (t.float() for t in (q, k, v, g, beta))
    o = torch.zeros(T, H, V, dtype=torch.float32, device=q.device)
    if initial_state is None:
        final = torch.zeros(N, H, K, V, dtype=torch.float32, device=q.device)
    else:
        final = initial_state.float().clone()
    for n in range(N):
        S = final[n]
        for t in range(cu[n], cu[n + 1]):
            o[t], S, _ = _step(q[t], k[t], v[t], g[t], beta[t], scale, S)
        final[n] = S
    return o, final
