"""Chunked (WY / UT-transform) KDA for prefill (torch reference, FP32).

Every exponential is of a non-positive number, so nothing overflows however strong the decay; the ``[C, C, K]``
pairwise decay is formed explicitly (a reference, not a kernel). The last chunk is padded with zero rows, which
leave the state unchanged. The derivation: docs/prefill.md, "The chunked form".
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .recurrent import normalize_cu_seqlens

__all__ = ["chunk_kda"]


def _chunk_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float,
    S0: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One chunk, all heads. ``q, k, g [H, C, K]``, ``v [H, C, V]``, ``beta [H, C]``, ``S0 [H, K, V]``.

    Returns ``(o [H, C, V], S_end [H, K, V])``."""
    C = q.shape[1]
    G = g.cumsum(1)  # [H, C, K]
    # Pairwise decay exp(G_t - G_j) for j <= t; the upper triangle is masked to -inf *before* exp so that
    # large positive differences never produce inf (inf * 0 would be NaN).
    causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    diff = G.unsqueeze(2) - G.unsqueeze(1)  # [H, t, j, K]
    decay = diff.masked_fill(~causal[None, :, :, None], float("-inf")).exp()
    kd = decay * k.unsqueeze(1)  # [H, t, j, K]: k_j scaled by the decay from j to t
    A_kk = torch.einsum("htk,htjk->htj", k, kd).tril(-1)  # strictly lower
    A_qk = torch.einsum("htk,htjk->htj", q * scale, kd)  # lower incl. diagonal (decay is 0 above)

    eye = torch.eye(C, dtype=q.dtype, device=q.device)
    L = eye + beta.unsqueeze(-1) * A_kk  # [H, C, C] unit lower triangular
    eG = G.exp()
    rhs = torch.cat([beta.unsqueeze(-1) * v, beta.unsqueeze(-1) * (k * eG)], dim=-1)
    sol = torch.linalg.solve_triangular(L, rhs, upper=False, unitriangular=True)
    V = v.shape[-1]
    U, W = sol[..., :V], sol[..., V:]
    u = U - W @ S0  # [H, C, V]

    o = (q * scale * eG) @ S0 + A_qk @ u
    G_last = G[:, -1:, :]  # [H, 1, K]
    k_end = k * (G_last - G).exp()  # [H, C, K]
    S_end = G_last.transpose(1, 2).exp() * S0 + k_end.transpose(1, 2) @ u
    return o, S_end


def chunk_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float,
    initial_state: torch.Tensor | None = None,
    cu_seqlens: Sequence[int] | torch.Tensor | None = None,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked KDA over a flat variable-length batch; equals `recurrent_kda` to FP32 rounding.

    Args:
        q: ``[T, H, K]`` L2-normalised queries, sequences concatenated.
        k: ``[T, H, K]`` L2-normalised keys.
        v: ``[T, H, V]`` values.
        g: ``[T, H, K]`` log decay (``<= 0``).
        beta: ``[T, H]``.
        scale: query scale.
        initial_state: ``[N, H, K, V]`` state before each sequence, or ``None`` for zeros; not modified.
        cu_seqlens: ``N + 1`` row offsets (host list or tensor); ``None`` means a single sequence.
        chunk_size: tokens per chunk (any positive size; 16..64 is sensible). Lengths need not be multiples.

    Returns:
        ``(o [T, H, V] FP32, final_state [N, H, K, V] FP32)``. Rows past ``cu_seqlens[-1]`` are zero.
    """
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
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
    C = chunk_size
    for n in range(N):
        bos, eos = cu[n], cu[n + 1]
        L = eos - bos
        if L == 0:
            continue
        S = final[n]
        for s in range(0, L, C):
            e = min(s + C, L)
            pad = C - (e - s)
            # [rows, H, D] -> [H, C, D], zero-padded at the end (padding rows are exact no-ops).
            qc, kc, vc, gc = (
                torch.nn.functional.pad(t[bos + s : bos + e].transpose(0, 1), (0, 0, 0, pad)) for t in (q, k, v, g)
            )
            bc = torch.nn.functional.pad(beta[bos + s : bos + e].transpose(0, 1), (0, pad))
            oc, S = _chunk_forward(qc, kc, vc, gc, bc, scale, S)
            o[bos + s : bos + e] = oc[:, : e - s].transpose(0, 1)
        final[n] = S
    return o, final
