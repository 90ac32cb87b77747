"""What a step reads off its final logits: each row's greedy token and the gap between its two best logits.

`greedy_top2_reference` is the torch definition (``torch.argmax``: the first maximum; ``torch.topk(k=2)``: a repeated
maximum has gap 0); `greedy_top2` and `greedy_pack` run it in two Triton launches (`kernels`), with identical
results. `draw_reference` is the definition of drawing sampled rows (temperature, top-k, top-p, inverse CDF at each
row's uniform; `trtllm_glm.runtime.sampling.Sampler` calls it); `sample_rows` runs it, or `kernels.sample_top_k` for
rows whose top-k is 1 .. `SAMPLE_MAX_K`. Backends: ``TRTLLM_GLM_LOGITS_BACKEND``, ``TRTLLM_GLM_SAMPLING_BACKEND``
(docs/settings.md); the CPU runs an interpreted copy (`trtllm_glm.triton_interp`) when triton is forced.
docs/kernels.md, "Greedy id and top-2 gap"; docs/gpu.md, "Decode-step fusions".
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from trtllm_glm import envs
from trtllm_glm.triton_interp import KernelPackage, kernel_backend

__all__ = [
    "GREEDY_FUSE_CAST_ENV",
    "apply_bitmask",
    "LOGITS_BACKEND_ENV",
    "SAMPLE_MAX_K",
    "SAMPLING_BACKEND_ENV",
    "draw_reference",
    "filter_sorted",
    "sample_rows",
    "sampling_backend",
    "greedy_fuse_cast",
    "greedy_pack",
    "greedy_top2",
    "greedy_top2_reference",
    "warm_up_greedy",
    "kernel_module",
    "logits_backend",
]

LOGITS_BACKEND_ENV = envs.LOGITS_BACKEND.name
SAMPLING_BACKEND_ENV = envs.SAMPLING_BACKEND.name
# ``1``: a decode graph's greedy kernel writes the step's FP32 logits as it reads the LM head's output (no
# ``.float()`` launch); ``0``: the cast launches on its own; unset: as ``TRTLLM_GLM_DECODE_FUSE`` (else off). Read per
# call; graphs capture the setting.
GREEDY_FUSE_CAST_ENV = envs.GREEDY_FUSE_CAST.name
# The largest top-k the sampling kernel takes (kernels.SAMPLE_MAX_K; repeated here: importing kernels needs triton).
SAMPLE_MAX_K = 256

_PACKAGE = KernelPackage(__name__, __path__)


def kernel_module(device: torch.device | str) -> Any:
    """`kernels` built for ``device``: compiled on CUDA, an interpreted copy elsewhere."""
    return _PACKAGE.module("kernels", device)


def logits_backend(logits: torch.Tensor, backend: str | None = None) -> str:
    """``"torch"`` or ``"triton"`` for one call (``backend``, else ``TRTLLM_GLM_LOGITS_BACKEND``, else auto:
    the kernels for CUDA tensors)."""
    return kernel_backend(envs.LOGITS_BACKEND, [logits], backend)


def _check(logits: torch.Tensor) -> None:
    if logits.dim() != 2 or logits.shape[1] < 2:
        raise ValueError(f"logits must be [N, V] with V >= 2, got shape {tuple(logits.shape)}")
    if not logits.is_floating_point():
        raise ValueError(f"logits must be a float tensor, got {logits.dtype}")


def greedy_top2_reference(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``logits [N, V]`` -> ``(ids [N] int64, gap [N] fp32)``: the first maximum and ``top1 - top2``."""
    _check(logits)
    top = torch.topk(logits.float(), 2, dim=-1).values
    return torch.argmax(logits, dim=-1), top[:, 0] - top[:, 1]


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """Disallowed tokens' logits set to ``-inf``, in place (the torch definition of a grammar's mask).

    Args:
        logits: ``[N, V]`` float.
        bitmask: ``[N, W]`` int32 with ``W >= ceil(V / 32)`` (any device; copied to ``logits``' device): bit
            ``t % 32`` of word ``t // 32`` set means token ``t`` is allowed.

    Returns:
        ``logits``.
    """
    if logits.dim() != 2 or bitmask.dim() != 2 or bitmask.shape[0] != logits.shape[0]:
        raise ValueError(f"logits [n, V] and bitmask [n, W] expected, got {tuple(logits.shape)} and "
                         f"{tuple(bitmask.shape)}")  # fmt: skip
    n, V = logits.shape
    if bitmask.shape[1] * 32 < V:
        raise ValueError(f"bitmask of {bitmask.shape[1]} words cannot cover a vocabulary of {V}")
    words = bitmask.to(device=logits.device, dtype=torch.int32, non_blocking=True)
    shifts = torch.arange(32, device=logits.device, dtype=torch.int32)
    allowed = ((words.unsqueeze(-1) >> shifts) & 1).view(n, -1)[:, :V].bool()
    return logits.masked_fill_(~allowed, float("-inf"))


def greedy_top2(logits: torch.Tensor, *, backend: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's greedy token and top-2 gap (`greedy_top2_reference`; two launches on CUDA).

    Args:
        logits: ``[N, V]`` any float dtype, ``V >= 2``.
        backend: ``"auto"`` / ``"torch"`` / ``"triton"`` (default ``TRTLLM_GLM_LOGITS_BACKEND``).

    Returns:
        ``(ids [N] int64, gap [N] fp32)`` on ``logits``' device.
    """
    _check(logits)
    if logits_backend(logits, backend) == "torch":
        return greedy_top2_reference(logits)
    return kernel_module(logits.device).greedy_top2(_rows_contiguous(logits))


def greedy_fuse_cast() -> bool:
    """Whether `GREEDY_FUSE_CAST_ENV` is ``1`` (``0``: no; unset: as ``TRTLLM_GLM_DECODE_FUSE``, else no).

    Raises:
        ValueError: a value other than ``0`` / ``1``.
    """
    return envs.GREEDY_FUSE_CAST.get()


def greedy_pack(
    logits: torch.Tensor,
    accepted: torch.Tensor | None = None,
    *,
    backend: str | None = None,
    f32_out: torch.Tensor | None = None,
    bitmask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The greedy ids and the ``[N, 3]`` float64 rows ``(id, gap, accepted)`` a step copies to the host once.

    Args:
        logits: ``[N, V]`` any float dtype, ``V >= 2``.
        accepted: optional ``[N]`` integer accepted count of each row's sequence (default 1: no drafts).
        backend: as in `greedy_top2`.
        f32_out: optional ``[N, V]`` fp32 buffer to receive ``logits.float()`` (the kernel writes it while it reads
            the logits: no launch of its own; the reference copies).
        bitmask: optional ``[N, >= ceil(V / 32)]`` int32 on ``logits``' device: each row's choice among the tokens
            its mask allows (`apply_bitmask` on a copy, then the same; the kernel reads the mask as it scans the
            row: no copy of the logits, no launch of its own); not with ``f32_out``.

    Returns:
        ``(ids [N] int64, packed [N, 3] float64)``; token ids and counts are exact in float64.
    """
    _check(logits)
    N = logits.shape[0]
    if accepted is not None and accepted.shape != (N,):
        raise ValueError(f"accepted must be [{N}], got shape {tuple(accepted.shape)}")
    if bitmask is not None and f32_out is not None:
        raise ValueError("greedy_pack: a bitmask and f32_out together are not supported")
    if logits_backend(logits, backend) == "torch":
        if f32_out is not None:
            f32_out.copy_(logits)
        if bitmask is not None:
            logits = apply_bitmask(logits.clone(), bitmask)
        ids, gap = greedy_top2_reference(logits)
        acc = torch.ones_like(ids) if accepted is None else accepted
        return ids, torch.stack([ids.to(torch.float64), gap.to(torch.float64), acc.to(torch.float64)], dim=1)
    packed = torch.empty(N, 3, dtype=torch.float64, device=logits.device)
    ids, _ = kernel_module(logits.device).greedy_top2(
        _rows_contiguous(logits), want_gap=False, packed=packed, accepted=accepted, f32_out=f32_out, bitmask=bitmask
    )
    return ids, packed


def warm_up_greedy(vocab_size: int, max_rows: int, device: torch.device) -> int:
    """Compile every variant of the greedy kernels a step can meet, masked (a grammar's rows) or not, for up to
    ``max_rows`` rows of ``vocab_size`` logits on CUDA (nothing elsewhere). Returns the calls made."""
    if torch.device(device).type != "cuda":
        return 0
    mod = kernel_module(device)
    counts = mod.warm_up_row_counts(max_rows, vocab_size, torch.device(device))
    row = torch.zeros(1, vocab_size, dtype=torch.float32, device=device)
    words = torch.full((1, (vocab_size + 31) // 32), -1, dtype=torch.int32, device=device)
    for n in counts:
        # Every row the same one (stride 0): the kernels' variants, not their memory.
        x, mask = row.expand(n, -1), words.expand(n, -1)
        greedy_pack(x, bitmask=mask, backend="triton")
        greedy_pack(x, backend="triton")
    return 2 * len(counts)


def _rows_contiguous(logits: torch.Tensor) -> torch.Tensor:
    return logits if logits.stride(-1) == 1 else logits.contiguous()


def sampling_backend(logits: torch.Tensor, backend: str | None = None) -> str:
    """``"torch"`` or ``"triton"`` for drawing sampled rows (``backend``, else ``TRTLLM_GLM_SAMPLING_BACKEND``, else
    ``"torch"``: the kernel is opt-in until a GPU A/B; ``"auto"``: the kernel for CUDA logits)."""
    return kernel_backend(envs.SAMPLING_BACKEND, [logits], backend)


def filter_sorted(
    rows: torch.Tensor, rp: torch.Tensor, *, top_k: bool = True, top_p: bool = True
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Temperature, top-k and top-p on ``rows`` ``[R, V]``, all rows at once, no host sync (the reference).

    Every operation is row-wise, so a row's result does not depend on the others in the batch.

    Args:
        rows: ``[R, V]`` logits.
        rp: ``[R, >= 4]`` float64 per row: uniform, temperature, top-p (``inf`` when off), top-k (``inf`` when off).
        top_k / top_p: whether any row asks for that filter (skips masks nobody needs; the result is the same).

    Returns:
        ``(ids [R, V], probs [R, V], keep [R, V])``: each row's tokens in descending order (ties to the lower id),
        the softmax of the top-k (0 past it), and the kept mask (top-k and top-p; a prefix of at least one token:
        token ``j`` stays while the mass strictly before it is ``< top_p``).
    """
    scaled = rows.float() / rp[:, 1:2].float()
    vals, ids = torch.sort(scaled, dim=-1, descending=True, stable=True)
    pos = torch.arange(vals.shape[1], device=vals.device, dtype=torch.float64)
    keep = pos[None, :] < rp[:, 3:4]
    if top_k:
        vals = vals.masked_fill(~keep, -math.inf)
    probs = torch.softmax(vals, dim=-1)
    if top_p:
        c = torch.cumsum(probs, dim=-1)
        before = torch.cat([c.new_zeros(c.shape[0], 1), c[:, :-1]], dim=1)
        keep &= before < rp[:, 2:3]  # the first token always stays: 0 < top_p
    return ids, probs, keep


def draw_reference(rows: torch.Tensor, rp: torch.Tensor, *, top_k: bool = True, top_p: bool = True) -> torch.Tensor:
    """One token per row of ``rows`` ``[R, V]`` at its uniform ``rp[:, 0]`` (`filter_sorted`'s kept mass inverted at
    ``u`` times its total: an fp64 cumulative sum and a search per row, in a fixed number of launches).

    Returns:
        ``[R]`` int64 token ids on ``rows``' device.
    """
    ids, probs, keep = filter_sorted(rows, rp, top_k=top_k, top_p=top_p)
    c = torch.cumsum((probs * keep).double(), dim=-1)
    j = torch.searchsorted(c, rp[:, 0:1] * c[:, -1:], right=True)
    j = torch.minimum(j, keep.sum(dim=-1, keepdim=True) - 1)  # u * total rounding up to the total
    return ids.gather(1, j)[:, 0]


def sample_rows(
    logits: torch.Tensor,
    rp: torch.Tensor,
    out: torch.Tensor,
    *,
    top_k: Sequence[int],
    top_p: bool = True,
    backend: str | None = None,
) -> torch.Tensor:
    """Draw the rows listed in ``rp`` and write their tokens into ``out`` (the other rows are left as they are).

    The kernel (`kernels.sample_top_k`, two launches) when `sampling_backend` picks it and every row's top-k is in
    1 .. `SAMPLE_MAX_K`; else `draw_reference` on the gathered rows and one scatter.

    Args:
        logits: ``[N, V]`` float.
        rp: ``[R, 5]`` float64: uniform, temperature, top-p (``inf`` when off), top-k (``inf`` when off) and the row
            of ``logits`` / ``out``.
        out: ``[N]`` int64.
        top_k: the ``R`` rows' top-k (0: off).
        top_p: whether any row asks for top-p.
        backend: as `sampling_backend`.

    Returns:
        The tokens: ``out``, or a new tensor where the reference drew every row.
    """
    R = rp.shape[0]
    if R == 0:
        return out
    if sampling_backend(logits, backend) == "triton" and all(1 <= k <= SAMPLE_MAX_K for k in top_k):
        kernel_module(logits.device).sample_top_k(_rows_contiguous(logits), rp, out, max(top_k))
        return out
    any_k = any(k > 0 for k in top_k)
    if logits.shape[0] == R:  # every row, in order (`Sampler` lists rows in order)
        return draw_reference(logits, rp, top_k=any_k, top_p=top_p)
    idx = rp[:, 4].to(torch.int64)
    out.index_copy_(0, idx, draw_reference(logits.index_select(0, idx), rp, top_k=any_k, top_p=top_p))
    return out
