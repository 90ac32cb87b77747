"""Speculative verify with records, and commit (torch, any device, FP32).

`kda_verify` runs ``W`` rows from the committed state without touching it and records, per row, the three
things a step adds to the state: the log decay ``g``, the key ``k`` and the correction ``u``. After
acceptance of ``a`` rows `kda_commit` replays ``S <- exp(g_t)[:, None] * S + k_t u_t^T`` for ``t < a``,
which is exactly what the verify pass computed for its own running state, so commit reproduces the state
after row ``a - 1`` without recomputing ``u`` (no re-read of ``v``, ``beta`` or the state).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .conv import _accepted_tensor
from .recurrent import _decay_update, _step

__all__ = ["KdaRecords", "kda_verify", "kda_commit"]


@dataclass
class KdaRecords:
    """Per-row commit records of a verify pass (batched layout ``[N, W, ...]``).

    Attributes:
        g: ``[N, W, H, K]`` FP32 log decay of each row.
        k: ``[N, W, H, K]`` FP32 (L2-normalised) key of each row.
        u: ``[N, W, H, V]`` FP32 delta-rule correction of each row.
    """

    g: torch.Tensor
    k: torch.Tensor
    u: torch.Tensor

    @property
    def width(self) -> int:
        return self.g.shape[1]


def kda_verify(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float,
    state: torch.Tensor,
) -> tuple[torch.Tensor, KdaRecords]:
    """Outputs of ``W`` verify rows from the committed state, plus the records commit needs.

    Accepts one sequence (``q [W, H, K]``, ``state [H, K, V]``) or a batch (``q [N, W, H, K]``,
    ``state [N, H, K, V]``); the records are always batched (``N = 1`` for one sequence).

    Args:
        q: ``[N, W, H, K]`` L2-normalised queries.
        k: ``[N, W, H, K]`` L2-normalised keys.
        v: ``[N, W, H, V]``.
        g: ``[N, W, H, K]`` log decay.
        beta: ``[N, W, H]``.
        scale: query scale.
        state: ``[N, H, K, V]`` committed FP32 state; not modified.

    Returns:
        ``(o [N, W, H, V] FP32, records)`` (``o [W, H, V]`` for one sequence).
    """
    single = state.dim() == 3
    if single:
        q, k, v, g, beta, state = (t.unsqueeze(0) for t in (q, k, v, g, beta, state))
    q, k, v, g, beta = (t.float() for t in (q, k, v, g, beta))
    W = q.shape[1]
    S = state.float()
    outs, us = [], []
    for t in range(W):
        o_t, S, u_t = _step(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], scale, S)
        outs.append(o_t)
        us.append(u_t)
    o = torch.stack(outs, dim=1)
    rec = KdaRecords(g=g.clone(), k=k.clone(), u=torch.stack(us, dim=1))
    return (o[0] if single else o), rec


def kda_commit(
    state: torch.Tensor,
    records: KdaRecords,
    num_accepted: Sequence[int] | torch.Tensor | int,
) -> torch.Tensor:
    """Fold the first ``a`` records of each sequence into the committed state, in place.

    Sequences with ``a = 0`` keep their state bit for bit (rows beyond ``a`` are masked with ``where``, not
    multiplied away).

    Args:
        state: ``[N, H, K, V]`` (or ``[H, K, V]``) FP32 state the verify pass started from; updated in place.
        records: from `kda_verify` on that state.
        num_accepted: ``a`` per sequence in ``0..W`` (list, ``[N]`` integer tensor, or one int).

    Returns:
        ``state`` (the same tensor).
    """
    S = state.unsqueeze(0) if state.dim() == 3 else state
    N, W = records.g.shape[:2]
    a = _accepted_tensor(num_accepted, N, W, S.device)
    # With host counts we can stop at the largest; with a device tensor we replay all W rows (masked).
    if isinstance(num_accepted, int):
        steps = num_accepted
    elif isinstance(num_accepted, torch.Tensor):
        steps = W
    else:
        steps = max((int(x) for x in num_accepted), default=0)
    cur = S.float()
    for t in range(min(steps, W)):
        upd = _decay_update(cur, records.g[:, t], records.k[:, t], records.u[:, t])
        cur = torch.where((a > t).view(N, 1, 1, 1), upd, cur)
    S.copy_(cur)
    return state
