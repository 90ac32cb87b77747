"""Backend dispatch: fla-core's Triton KDA kernels on CUDA, the torch references elsewhere.

``import fla`` is lazy and optional: it happens on the first CUDA call only, and a failed import (package
missing, no Triton backend) falls back to the torch reference. ``TRTLLM_GLM_KDA_BACKEND`` = ``torch`` |
``fla`` | ``auto`` (default) overrides the choice; ``fla`` raises if fla-core cannot be used.

Both wrappers take already L2-normalised ``q``/``k`` and log-space ``g`` (we never ask fla to normalise or
apply the gate, so every backend sees identical inputs), FP32 state in the cache layout ``[N, H, K, V]``.
"""

from __future__ import annotations

import functools
import warnings
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import torch

from ... import envs
from ...numerics import batch_invariant
from ...transfer import to_device
from .chunk import chunk_kda
from .recurrent import normalize_cu_seqlens, recurrent_kda_step
from .verify import resolve_verify_backend

__all__ = ["fla_kda_available", "resolve_backend", "kda_prefill", "kda_decode", "kda_decode_inplace"]


@functools.lru_cache(maxsize=1)
def _fla_inplace_decode() -> Any | None:
    """fla's internal decode entry with slot-indexed in-place state (vLLM-style continuous batching).

    Not part of fla's public API, so it is optional: when it is missing we gather/scatter around the public
    ``fused_recurrent_kda`` instead.
    """
    if _fla_kda() is None:
        return None
    try:
        from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd
    except Exception:  # noqa: BLE001
        return None
    return fused_recurrent_kda_fwd


@functools.lru_cache(maxsize=1)
def _fla_kda() -> Any | None:
    try:
        from fla.ops.kda import chunk_kda as fla_chunk_kda
        from fla.ops.kda import fused_recurrent_kda as fla_fused_recurrent_kda
    except Exception:  # noqa: BLE001 - any import-time failure (missing package, Triton init) means "no fla"
        return None
    return fla_chunk_kda, fla_fused_recurrent_kda


def fla_kda_available() -> bool:
    """Whether fla-core's KDA kernels import (does not check for a GPU)."""
    return _fla_kda() is not None


def resolve_backend(device: torch.device, backend: str | None = None) -> str:
    """``"fla"`` or ``"torch"`` for tensors on ``device``.

    Args:
        device: where the inputs live.
        backend: ``"auto"`` / ``None`` (fla on CUDA when it imports), ``"torch"`` or ``"fla"``; ``None`` reads
            ``TRTLLM_GLM_KDA_BACKEND`` first.
    """
    if backend is None:
        backend = envs.KDA_BACKEND.get()
    backend = backend.lower()
    if backend == "torch":
        return "torch"
    if backend not in ("auto", "fla"):
        raise ValueError(f"{envs.KDA_BACKEND.name}/backend must be 'auto', 'torch' or 'fla', got {backend!r}")
    usable = device.type == "cuda" and fla_kda_available()
    if backend == "fla" and not usable:
        raise RuntimeError(
            f"KDA backend 'fla' requested but unusable (device {device}, fla importable: {fla_kda_available()})"
        )
    if device.type == "cuda" and not usable:
        _warn_no_fla()
    return "fla" if usable else "torch"


@functools.lru_cache(maxsize=1)
def _warn_no_fla() -> None:
    # Once per process: on CUDA the torch chunk reference is ~40x slower than fla-core's kernels (an H200 32K
    # prompt of the 4-layer slice: KDA core 1.45 s against 36 ms, the prompt 1.76 s against 0.25 s), a silent loss
    # unless someone says so.
    warnings.warn(
        "trtllm_glm: fla-core is not importable, so KDA prefill on CUDA runs the torch reference (~40x slower); "
        "install it with `pip install fla-core` (the `kernels` extra), or set TRTLLM_GLM_KDA_BACKEND=torch to "
        "choose the reference deliberately",
        RuntimeWarning,
        stacklevel=3,
    )


# The offset tensors of the last few distinct batches. fla memoises its chunk indices by the *identity* of these
# tensors, and builds them on the host and copies them from pageable memory: a stream sync. The KDA layers of a
# step share one batch layout, so handing each the same tensors makes that one sync a step instead of one a layer
# (34 on GLM-5.3-Flash, each draining the GPU's queue before the host may launch on).
_OFFSETS: OrderedDict[tuple[tuple[int, ...], torch.device], tuple[torch.Tensor, torch.Tensor]] = OrderedDict()
_OFFSETS_KEPT = 4


def _offsets(cu: list[int], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cu_seqlens on the host, on device)`` for ``cu``, the same objects for the same offsets and device."""
    key = (tuple(cu), device)
    hit = _OFFSETS.get(key)
    if hit is None:
        # The device copy from pinned memory: a copy from pageable memory would wait for the stream.
        hit = _OFFSETS[key] = (torch.tensor(cu, dtype=torch.int64), to_device(cu, device, torch.int64))
        while len(_OFFSETS) > _OFFSETS_KEPT:
            _OFFSETS.popitem(last=False)
    return hit


def kda_prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float,
    initial_state: torch.Tensor,
    cu_seqlens: Sequence[int] | torch.Tensor,
    *,
    lower_bound: float | None = None,
    backend: str | None = None,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked KDA over a flat variable-length batch (fla ``chunk_kda`` on CUDA, else `chunk_kda`).

    Args:
        q: ``[T, H, K]`` L2-normalised queries.
        k: ``[T, H, K]`` L2-normalised keys.
        v: ``[T, H, V]``.
        g: ``[T, H, K]`` log decay in ``[lower_bound, 0)``.
        beta: ``[T, H]``.
        scale: query scale.
        initial_state: ``[N, H, K, V]`` FP32; not modified.
        cu_seqlens: ``N + 1`` row offsets (host list preferred: no device sync).
        lower_bound: the gate's lower bound; when in ``[-5, 0)`` fla's bounded-gate ("safe gate") path is used.
        backend: see `resolve_backend`.
        chunk_size: chunk of the torch reference (fla uses 64).

    Returns:
        ``(o [T, H, V] FP32, final_state [N, H, K, V] FP32)``.
    """
    if resolve_backend(q.device, backend) == "torch":
        return chunk_kda(q, k, v, g, beta, scale, initial_state, cu_seqlens, chunk_size=chunk_size)
    fla_chunk_kda, _ = _fla_kda()
    cu = normalize_cu_seqlens(cu_seqlens, q.shape[0])
    T = cu[-1]
    cu_cpu, cu_dev = _offsets(cu, q.device)
    safe = lower_bound is not None and -5.0 <= lower_bound < 0.0
    o, final = fla_chunk_kda(
        q=q[:T].float().unsqueeze(0).contiguous(),
        k=k[:T].float().unsqueeze(0).contiguous(),
        v=v[:T].float().unsqueeze(0).contiguous(),
        g=g[:T].float().unsqueeze(0).contiguous(),
        beta=beta[:T].float().unsqueeze(0).contiguous(),
        scale=scale,
        initial_state=initial_state.float().contiguous(),
        output_final_state=True,
        cu_seqlens=cu_dev,
        cu_seqlens_cpu=cu_cpu,
        safe_gate=safe,
        lower_bound=lower_bound if safe else None,
    )
    o = o[0].float()
    if q.shape[0] > T:
        o = torch.cat([o, o.new_zeros(q.shape[0] - T, *o.shape[1:])], dim=0)
    return o, final.float()


def kda_decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float,
    state: torch.Tensor,
    *,
    backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode token per sequence (fla ``fused_recurrent_kda`` on CUDA, else `recurrent_kda_step`).

    Args:
        q: ``[N, H, K]`` L2-normalised queries.
        k: ``[N, H, K]`` L2-normalised keys.
        v: ``[N, H, V]``.
        g: ``[N, H, K]`` log decay.
        beta: ``[N, H]``.
        scale: query scale.
        state: ``[N, H, K, V]`` FP32; not modified.
        backend: see `resolve_backend`.

    Returns:
        ``(o [N, H, V] FP32, new_state [N, H, K, V] FP32)``.
    """
    if resolve_backend(q.device, backend) == "torch":
        return recurrent_kda_step(q, k, v, g, beta, scale, state)
    _, fla_fused_recurrent_kda = _fla_kda()
    # fla's [B, T, ...] layout with B = N sequences of T = 1 token each.
    o, final = fla_fused_recurrent_kda(
        q=q.float().unsqueeze(1).contiguous(),
        k=k.float().unsqueeze(1).contiguous(),
        v=v.float().unsqueeze(1).contiguous(),
        g=g.float().unsqueeze(1).contiguous(),
        beta=beta.float().unsqueeze(1).contiguous(),
        scale=scale,
        initial_state=state.float().contiguous(),
        output_final_state=True,
    )
    return o[:, 0].float(), final.float()


def kda_decode_inplace(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float,
    state: torch.Tensor,
    slots: torch.Tensor,
    *,
    backend: str | None = None,
) -> torch.Tensor:
    """One decode token per sequence, updating the state pool in place at ``slots`` only.

    In the batch-invariant mode (`trtllm_glm.numerics.batch_invariant`), wherever `ops.verify` runs its Triton
    kernel (CUDA by default), this runs that kernel's step instead of fla's (`kernels.kda_decode_inplace`).
    On CUDA with fla the kernel reads and writes ``state[slots[n]]`` directly (no gather/scatter copies of
    the ``[H, K, V]`` states, which would double the memory traffic of a decode step); elsewhere it gathers,
    steps with the torch reference and scatters back. Slots not listed are never written.

    Args:
        q: ``[n, H, K]`` L2-normalised queries.
        k: ``[n, H, K]`` L2-normalised keys.
        v: ``[n, H, V]``.
        g: ``[n, H, K]`` log decay.
        beta: ``[n, H]``.
        scale: query scale.
        state: ``[S, H, K, V]`` FP32 state pool (e.g. ``KdaLayerState.recurrent``), updated in place.
        slots: ``[n]`` int64 distinct slot of each sequence, on ``state``'s device.
        backend: see `resolve_backend`.

    Returns:
        ``o [n, H, V]`` FP32.
    """
    resolved = resolve_backend(q.device, backend)
    if batch_invariant() and (backend or "").lower() != "torch" and resolve_verify_backend(q.device) == "triton":
        # Batch-invariant mode: wherever verify runs the Triton kernel, decode runs its step too (one row, the
        # state stored back), so a decode row has a verify row's bits and K decode steps leave the state a
        # K-row commit leaves (fla's decode kernel rounds differently).
        from trtllm_glm.kda import kernels

        return kernels.kda_decode_inplace(q, k, v, g, beta, scale, state, slots)
    fwd = _fla_inplace_decode() if resolved == "fla" else None
    per_slot_contiguous = state.dim() == 4 and state[0].is_contiguous() and state.dtype == torch.float32
    if fwd is None or not per_slot_contiguous:
        S = state.index_select(0, slots)
        o, S_new = kda_decode(q, k, v, g, beta, scale, S, backend=backend)
        state.index_copy_(0, slots, S_new.to(state.dtype))
        return o
    o, _ = fwd(
        q=q.float().unsqueeze(1).contiguous(),
        k=k.float().unsqueeze(1).contiguous(),
        v=v.float().unsqueeze(1).contiguous(),
        g=g.float().unsqueeze(1).contiguous(),
        beta=beta.float().unsqueeze(1).contiguous(),
        scale=scale,
        initial_state=state,
        inplace_final_state=True,
        ssm_state_indices=slots.to(torch.int64).contiguous(),
    )
    return o[:, 0].float()
