"""The sigmoid MoE router after its logits: the torch reference and a one-launch Triton kernel.

`route_reference` is the routing math of `trtllm_glm.modules.ffn.MoEGate` (~10 small kernels on CUDA, one a radix
sort); `fused_route` does the same for ``n_group == 1`` in one launch (`router_kernels`), with the same tie rule
(equal biased scores: lower id first) and id order. `route` dispatches through `router_backend`
(``TRTLLM_GLM_ROUTER_BACKEND``). The CPU runs an interpreted copy of `router_kernels`
(`trtllm_glm.triton_interp.KernelPackage`); importing this module needs only torch. (`trtllm_glm.moe.kernels` keeps
its own interpreted copy: its relative imports would not resolve under the alias package.) docs/kernels.md, "MoE
router".
"""

from __future__ import annotations

import os
from typing import Any

import torch

from trtllm_glm import envs
from trtllm_glm.triton_interp import KernelPackage, kernel_backend

__all__ = ["ROUTER_BACKEND_ENV", "fused_route", "kernel_module", "route", "route_reference", "router_backend"]

ROUTER_BACKEND_ENV = envs.ROUTER_BACKEND.name

_PACKAGE = KernelPackage(__package__ or "trtllm_glm.moe", [os.path.dirname(os.path.abspath(__file__))])


def kernel_module(device: torch.device | str) -> Any:
    """`router_kernels` built for ``device``: compiled on CUDA, an interpreted copy elsewhere."""
    return _PACKAGE.module("router_kernels", device)


def route_reference(
    logits: torch.Tensor,
    bias: torch.Tensor,
    top_k: int,
    norm_topk_prob: bool,
    scaling: float,
    n_group: int = 1,
    topk_group: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Route rows from their router logits (torch; differentiable in ``logits``).

    The bias steers *which* experts are chosen; the combine weights come from the unbiased sigmoid scores.

    Args:
        logits: ``[N, E]`` router logits (fp32; other dtypes are upcast first).
        bias: ``[E]`` ``e_score_correction_bias`` (upcast to fp32).
        top_k: experts per row.
        norm_topk_prob: normalise the ``top_k`` weights to sum to one (plus ``1e-20``) before scaling.
        scaling: ``routed_scaling_factor``, multiplies the final weights.
        n_group: expert groups; with ``n_group > 1`` only the ``topk_group`` groups whose two best biased
            scores sum highest are eligible (DeepSeek-V3 group-limited routing).
        topk_group: groups kept per row.

    Returns:
        ``(topk_ids, topk_weights)``: ``[N, top_k]`` int64 expert ids ordered by biased score (descending,
        ties to the lower id; a NaN score sorts above every number) and ``[N, top_k]`` fp32 weights.
    """
    scores = torch.sigmoid(logits.float())
    choice = scores + bias.float()
    if n_group > 1:
        n = choice.shape[0]
        grouped = choice.view(n, n_group, -1)
        group_score = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(-1)
        keep = torch.sort(group_score, dim=-1, descending=True, stable=True).indices[:, :topk_group]
        mask = torch.zeros_like(group_score, dtype=torch.bool).scatter_(1, keep, True)
        choice = choice.masked_fill(~mask[:, :, None].expand_as(grouped).reshape(n, -1), float("-inf"))
    # torch.topk does not specify tie order; a stable descending sort keeps lower ids first.
    _, order = torch.sort(choice, dim=-1, descending=True, stable=True)
    topk_ids = order[:, :top_k]
    weights = scores.gather(1, topk_ids)
    if norm_topk_prob:
        # The epsilon only matters if every selected sigmoid underflowed to zero.
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return topk_ids, weights * float(scaling)


def router_backend(*tensors: torch.Tensor | None, backend: str | None = None) -> str:
    """``"torch"`` or ``"triton"`` for one routing call (decided from devices and flags only).

    ``backend`` (default: ``TRTLLM_GLM_ROUTER_BACKEND``, else ``"auto"``): ``"torch"``, `route_reference`;
    ``"triton"``, the kernel on any device (the CPU runs it through Triton's interpreter); ``"auto"``, the
    kernel for CUDA tensors when no gradient is needed (it has no backward), the reference otherwise.

    Args:
        *tensors: the call's inputs (``None`` entries are skipped); the first one's device decides.
        backend: overrides the environment.
    """
    return kernel_backend(envs.ROUTER_BACKEND, tensors, backend)


def fused_route(
    logits: torch.Tensor,
    bias: torch.Tensor,
    top_k: int,
    norm_topk_prob: bool,
    scaling: float,
    *,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
    rows_per_program: int | None = None,
    num_warps: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`route_reference` for ``n_group == 1`` in one kernel launch (no sort, no host sync).

    Same ids as the reference, in the same order (descending biased score, equal scores to the lower id,
    NaN first), and the same weights up to the order of the normalising sum. Nothing here reads tensor
    values on the host and the outputs are allocated with ``torch.empty``, so the call can be captured in a
    CUDA graph.

    Args:
        logits: ``[N, E]`` fp32 router logits, unit last stride (any row stride).
        bias: ``[E]`` float ``e_score_correction_bias`` (fp32, bf16 or fp16; upcast in the kernel).
        top_k: experts per row, ``1 <= top_k <= E``.
        norm_topk_prob: normalise the ``top_k`` weights to sum to one (plus ``1e-20``) before scaling.
        scaling: ``routed_scaling_factor``.
        out: optional ``(topk_ids [N, top_k] int64, topk_weights [N, top_k] fp32)`` buffers, unit last
            stride, on ``logits``' device; written and returned.
        rows_per_program: rows per kernel program, a power of two (tuning only). Default: 1 on CUDA (a row
            per program spreads a decode batch over the SMs); elsewhere up to 16, since the interpreter runs
            the programs one after another at a fixed cost each.
        num_warps: warps per program (tuning only; default from the tile size).

    Returns:
        ``(topk_ids, topk_weights)``: ``[N, top_k]`` int64 and ``[N, top_k]`` fp32.

    Raises:
        ValueError: on a wrong dtype, shape, layout, device, ``top_k`` or ``rows_per_program``.
    """
    if logits.dtype != torch.float32:
        raise ValueError(f"logits must be float32, got {logits.dtype}")
    if logits.dim() != 2:
        raise ValueError(f"logits must be [N, E], got shape {tuple(logits.shape)}")
    n, e = logits.shape
    if e == 0 or (n > 0 and logits.stride(1) != 1):
        raise ValueError(f"logits must have E > 0 and a unit last stride, got shape {tuple(logits.shape)} "
                         f"strides {logits.stride()}")  # fmt: skip
    if bias.shape != (e,) or not bias.is_floating_point():
        raise ValueError(f"bias must be a float [{e}] tensor, got {bias.dtype} {tuple(bias.shape)}")
    if bias.device != logits.device:
        raise ValueError(f"bias is on {bias.device}, logits on {logits.device}")
    if not 1 <= top_k <= e:
        raise ValueError(f"top_k must be in [1, {e}], got {top_k}")
    if rows_per_program is None:
        rows_per_program = 1 if logits.is_cuda else min(16, 1 << max(n - 1, 0).bit_length())
    if rows_per_program < 1 or rows_per_program & (rows_per_program - 1):
        raise ValueError(f"rows_per_program must be a power of two, got {rows_per_program}")
    mod = kernel_module(logits.device)
    if e > mod.MAX_EXPERTS:
        raise ValueError(f"fused_route handles at most {mod.MAX_EXPERTS} experts, got {e}")
    if out is None:
        topk_ids = torch.empty(n, top_k, dtype=torch.int64, device=logits.device)
        topk_weights = torch.empty(n, top_k, dtype=torch.float32, device=logits.device)
    else:
        topk_ids, topk_weights = out
        for t, dtype, what in ((topk_ids, torch.int64, "ids"), (topk_weights, torch.float32, "weights")):
            if t.shape != (n, top_k) or t.dtype != dtype or t.device != logits.device:
                raise ValueError(f"out {what} must be [{n}, {top_k}] {dtype} on {logits.device}, "
                                 f"got {tuple(t.shape)} {t.dtype} on {t.device}")  # fmt: skip
            if n > 0 and top_k > 1 and t.stride(1) != 1:
                raise ValueError(f"out {what} must have a unit last stride, got strides {t.stride()}")
    if n == 0:
        return topk_ids, topk_weights
    mod.launch_route(
        logits, bias, topk_ids, topk_weights, top_k, norm_topk_prob, scaling,
        rows_per_program=rows_per_program, num_warps=num_warps,
    )  # fmt: skip
    return topk_ids, topk_weights


def route(
    logits: torch.Tensor,
    bias: torch.Tensor,
    top_k: int,
    norm_topk_prob: bool,
    scaling: float,
    n_group: int = 1,
    topk_group: int = 1,
    *,
    backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Route rows: `fused_route` when `router_backend` says ``"triton"`` and ``n_group == 1``, else
    `route_reference` (group-limited routing has no kernel).

    Args:
        logits: ``[N, E]`` fp32 router logits.
        bias: ``[E]`` correction bias.
        top_k, norm_topk_prob, scaling, n_group, topk_group: as in `route_reference`.
        backend: ``"auto"`` / ``"torch"`` / ``"triton"`` (default: ``TRTLLM_GLM_ROUTER_BACKEND``, else auto).

    Returns:
        ``(topk_ids [N, top_k] int64, topk_weights [N, top_k] fp32)``.
    """
    if router_backend(logits, bias, backend=backend) == "triton" and n_group == 1:
        return fused_route(logits, bias, top_k, norm_topk_prob, scaling)
    return route_reference(logits, bias, top_k, norm_topk_prob, scaling, n_group, topk_group)
