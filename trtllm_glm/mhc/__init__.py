"""Fused mHC (manifold-constrained hyper-connections) kernels for the CUDA decode path.

`kernels` runs one block in three launches instead of ~60 (`mhc_pre`: RMS, mixing logits, Sinkhorn, collapse;
`mhc_post`: expand) and `mhc_pre_norm` a residual site in two instead of four (``TRTLLM_GLM_MHC_FUSE=1``). The torch
reference is `trtllm_glm.modules.mhc`, which dispatches here (``TRTLLM_GLM_MHC_BACKEND``). CUDA tensors go to the
compiled kernels, the CPU to an interpreted copy (`trtllm_glm.triton_interp`); importing this package needs only
torch. docs/kernels.md, "mHC"; docs/gpu.md, "Decode-step fusions".
"""

from __future__ import annotations

from typing import Any

import torch

from trtllm_glm.triton_interp import KernelPackage

__all__ = ["mhc_pre", "mhc_post", "mhc_pre_norm", "mhc_post_mean_norm", "post_mix_partials", "kernel_module"]

_PACKAGE = KernelPackage(__name__, __path__)


def kernel_module(device: torch.device | str) -> Any:
    """`kernels` built for ``device``: compiled on CUDA, an interpreted copy elsewhere."""
    return _PACKAGE.module("kernels", device)


def mhc_pre(
    streams: torch.Tensor,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    *,
    norm_eps: float,
    hc_eps: float,
    sinkhorn_iters: int,
    **launch: Any,
) -> tuple[torch.Tensor, ...]:
    """Fused weights + Sinkhorn + collapse of one block (`kernels.mhc_pre`).

    Args:
        streams: ``[N, S, D]`` residual streams.
        fn: ``[(2 + S) * S, S * D]`` projection.
        base: ``[(2 + S) * S]`` bias.
        scale: ``[3]`` logit scales.
        norm_eps: RMS epsilon.
        hc_eps: mHC epsilon.
        sinkhorn_iters: Sinkhorn iterations.
        **launch: ``return_pre``, ``out``, ``split``, ``block_n``, ``block_k``, ``block_d``, ``num_warps``,
            ``path`` (``"auto"`` / ``"fma"`` / ``"tc"``), ``mma`` (``"split3"`` / ``"split3_chain"`` /
            ``"tf32x3"`` / ``"bf16x6"``).

    Returns:
        ``(x_in [N, D] streams' dtype, post [N, S] fp32, comb [N, S, S] fp32)`` (``pre`` after ``x_in`` with
        ``return_pre=True``).
    """
    mod = kernel_module(streams.device)
    return mod.mhc_pre(
        streams, fn, base, scale, norm_eps=norm_eps, hc_eps=hc_eps, sinkhorn_iters=sinkhorn_iters, **launch
    )


def mhc_post(
    streams: torch.Tensor, block_out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor, **launch: Any
) -> torch.Tensor:
    """Fused expand (`kernels.mhc_post`): ``[N, S, D]`` = ``post ⊗ block_out + combᵀ @ streams``.

    Args:
        streams: ``[N, S, D]``.
        block_out: ``[N, D]``.
        post: ``[N, S]`` fp32.
        comb: ``[N, S, S]`` fp32.
        **launch: ``out``, ``block_d``, ``num_warps``.

    Returns:
        New streams ``[N, S, D]`` in the streams' dtype.
    """
    return kernel_module(streams.device).mhc_post(streams, block_out, post, comb, **launch)


def mhc_pre_norm(
    streams: torch.Tensor,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    norm_weight: torch.Tensor,
    *,
    norm_eps: float,
    hc_eps: float,
    sinkhorn_iters: int,
    rms_eps: float,
    prev: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    **launch: Any,
) -> tuple[torch.Tensor, ...]:
    """A residual site (`kernels.mhc_pre_norm`): ``prev``'s expand (if given), this block's weights and collapse,
    and the block's input RMSNorm in two launches.

    Returns:
        ``(streams [N, S, D], x [N, D], post [N, S] fp32, comb [N, S, S] fp32)`` (``x_in`` after them with
        ``return_x_in=True``).
    """
    return kernel_module(streams.device).mhc_pre_norm(
        streams, fn, base, scale, norm_weight, norm_eps=norm_eps, hc_eps=hc_eps, sinkhorn_iters=sinkhorn_iters,
        rms_eps=rms_eps, prev=prev, **launch,
    )  # fmt: skip


def post_mix_partials(
    streams: torch.Tensor,
    block_out: torch.Tensor,
    post: torch.Tensor,
    comb: torch.Tensor,
    fn: torch.Tensor,
    **launch: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One block's expand and the next block's projection partials in one launch (`kernels.post_mix_partials`)."""
    return kernel_module(streams.device).post_mix_partials(streams, block_out, post, comb, fn, **launch)


def mhc_post_mean_norm(
    streams: torch.Tensor,
    block_out: torch.Tensor,
    post: torch.Tensor,
    comb: torch.Tensor,
    norm_weight: torch.Tensor,
    *,
    rms_eps: float,
    **launch: Any,
) -> torch.Tensor:
    """The last block's expand, the stream mean and the final RMSNorm in one launch (`kernels.mhc_post_mean_norm`)."""
    return kernel_module(streams.device).mhc_post_mean_norm(
        streams, block_out, post, comb, norm_weight, rms_eps=rms_eps, **launch
    )
