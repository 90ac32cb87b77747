"""Speculative verify with records, and commit: the torch reference (any device, FP32) and the dispatch.

`kda_verify` runs ``W`` rows from the committed state without touching it and records per row ``g``, ``k`` and
the correction ``u``; `kda_commit` replays ``S <- exp(g_t)[:, None] * S + k_t u_t^T`` for ``t < a``, exactly what
verify computed for its running state (no re-read of ``v``, ``beta`` or the state). CUDA tensors go to
`trtllm_glm.kda.kernels`, other devices to the reference below (``backend=`` or ``TRTLLM_GLM_KDA_VERIFY``:
docs/settings.md). With ``state_slots`` the kernels work on the pool in place; the reference gathers, runs and
(commit) scatters back. Slot tables, ``fresh`` flags and the kernels: docs/kernels.md, "KDA verify and commit".
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch

from ... import envs
from ..contract import KdaRecords
from .conv import _accepted_tensor
from .recurrent import _decay_update, _step

__all__ = ["KdaRecords", "kda_verify", "kda_commit", "resolve_verify_backend"]


@functools.lru_cache(maxsize=1)
def _triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except Exception:  # noqa: BLE001 - any import-time failure means "no Triton"
        return False
    return True


def resolve_verify_backend(device: torch.device, backend: str | None = None) -> str:
    """``"triton"`` or ``"torch"`` for verify/commit on tensors on ``device``.

    Args:
        device: where the inputs live.
        backend: ``"auto"`` / ``None`` (Triton on CUDA when it imports, else torch), ``"torch"`` or
            ``"triton"`` (on the CPU: the interpreter); ``None`` reads ``TRTLLM_GLM_KDA_VERIFY`` first (and,
            when that is unset, ``TRTLLM_GLM_KDA_BACKEND=torch`` means torch).
    """
    if backend is None:
        backend = envs.KDA_VERIFY.get() or ("torch" if envs.KDA_BACKEND.get() == "torch" else "auto")
    backend = backend.lower()
    if backend not in ("auto", "torch", "triton"):
        raise ValueError(f"{envs.KDA_VERIFY.name}/backend must be 'auto', 'torch' or 'triton', got {backend!r}")
    if backend == "triton" and not _triton_available():
        raise RuntimeError("KDA verify backend 'triton' requested but triton does not import")
    if backend == "auto":
        return "triton" if device.type == "cuda" and _triton_available() else "torch"
    return backend


def _gather(state: torch.Tensor, state_slots: torch.Tensor | None, fresh: torch.Tensor | None) -> torch.Tensor:
    """The per-sequence FP32 states the reference works on: ``state[slots]``, zeros where ``fresh``."""
    S = state if state_slots is None else state.index_select(0, state_slots)
    if fresh is not None:
        # torch.where, not a multiply: a never-zeroed slot may hold NaN/inf and must not leak in.
        S = torch.where(fresh.view(-1, *([1] * (S.dim() - 1))), 0.0, S.float())
    return S


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
    widths: torch.Tensor | None = None,
    backend: str | None = None,
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
        state: ``[N, H, K, V]`` committed FP32 state, or with ``state_slots`` the pool ``[S, H, K, V]``; not
            modified.
        state_slots: optional ``[N]`` int64 slot of each sequence in ``state`` (on its device).
        fresh: optional ``[N]`` bool: those sequences start from zeros (their state is not read).
        widths: optional ``[N]`` integer rows of each sequence (``<= W``), for a caller that reads neither outputs
            nor records of the rows past them (they are then unspecified: the kernel skips them, the reference
            computes them).
        backend: see `resolve_verify_backend`.

    Returns:
        ``(o [N, W, H, V] FP32, records)`` (``o [W, H, V]`` for one sequence).
    """
    if resolve_verify_backend(q.device, backend) == "triton":
        from trtllm_glm.kda import kernels

        return kernels.kda_verify(q, k, v, g, beta, scale, state, state_slots=state_slots, fresh=fresh, widths=widths)
    state = _gather(state, state_slots, fresh)
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
    *,
    state_slots: torch.Tensor | None = None,
    fresh: torch.Tensor | None = None,
    backend: str | None = None,
) -> torch.Tensor:
    """Fold the first ``a`` records of each sequence into the committed state, in place.

    Sequences with ``a = 0`` keep their state bit for bit (rows beyond ``a`` are masked with ``where``, not
    multiplied away; the kernel does not store them at all). A fresh sequence's slot is set to its
    zero-started state, so to zeros when ``a = 0``.

    Args:
        state: ``[N, H, K, V]`` (or ``[H, K, V]``) FP32 state the verify pass started from, or with
            ``state_slots`` the pool ``[S, H, K, V]``; updated in place.
        records: from `kda_verify` on that state.
        num_accepted: ``a`` per sequence in ``0..W`` (list, ``[N]`` integer tensor, or one int). A device
            tensor is not synchronised on (the kernel clamps to ``[0, W]``; the reference masks with it).
        state_slots: optional ``[N]`` int64 slot of each sequence in ``state``.
        fresh: optional ``[N]`` bool: start from zeros instead of the slot's contents.
        backend: see `resolve_verify_backend`.

    Returns:
        ``state`` (the same tensor).
    """
    if resolve_verify_backend(state.device, backend) == "triton":
        from trtllm_glm.kda import kernels

        return kernels.kda_commit(state, records, num_accepted, state_slots=state_slots, fresh=fresh)
    if state_slots is not None or fresh is not None:
        S = _gather(state, state_slots, fresh).float()  # a new tensor: index_select / where copy
        _commit_torch(S, records, num_accepted)
        if state_slots is None:
            state.copy_(S)
        else:
            state.index_copy_(0, state_slots, S.to(state.dtype))
        return state
    return _commit_torch(state, records, num_accepted)


def _commit_torch(
    state: torch.Tensor, records: KdaRecords, num_accepted: Sequence[int] | torch.Tensor | int
) -> torch.Tensor:
    """The reference commit on per-sequence states (no slots)."""
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
