"""Manifold-constrained hyper-connections (mHC): ``hc_mult`` parallel residual streams ``[N, S, D]`` that every
block reads through a learned collapse and writes through a learned expansion plus a doubly-stochastic mix.

The functions below are the plain torch reference (any device, FP32), in the reference's (``transformers``
``Glm5NextTextHyperConnection``) order of operations, kept exactly so that logits match it to FP32 rounding.
`mhc_block` runs one block through them or through the Triton kernels of `trtllm_glm.mhc`
(``TRTLLM_GLM_MHC_BACKEND``); `mhc_pre_norm` is one residual site as the fused decode path runs it
(``TRTLLM_GLM_MHC_FUSE=1``), `mhc_pre_norm_reference` its torch definition. The equations: docs/model.md, "mHC per
block"; the kernels: docs/kernels.md, "mHC"; the fused sites: docs/gpu.md, "Decode-step fusions".
"""

from __future__ import annotations

import torch

from .. import envs
from ..linear import model_linear
from ..triton_interp import kernel_backend

__all__ = [
    "mhc_weights",
    "mhc_collapse",
    "mhc_expand",
    "mhc_block",
    "mhc_block_pre",
    "mhc_block_post",
    "mhc_backend",
    "mhc_fuse",
    "mhc_pre_norm",
    "mhc_pre_norm_reference",
    "mhc_post_mean_norm",
    "mhc_post_mean_norm_reference",
    "MHC_BACKEND_ENV",
    "MHC_FUSE_ENV",
]

MHC_BACKEND_ENV = envs.MHC_BACKEND.name
# ``1``: the model runs each residual site as `mhc_pre_norm` (the previous block's expand fused with this block's
# projection, the block's input RMSNorm fused with the finishing kernel) where mHC runs its kernels; ``0``: the separate
# launches; unset: as ``TRTLLM_GLM_DECODE_FUSE`` (else off). Read per call, so that one process can A/B it.
MHC_FUSE_ENV = envs.MHC_FUSE.name


def mhc_fuse() -> bool:
    """Whether `MHC_FUSE_ENV` asks for the fused residual sites (``"1"``; ``"0"``: no; unset: as
    ``TRTLLM_GLM_DECODE_FUSE``, else no).

    Raises:
        ValueError: a value other than ``0`` / ``1``.
    """
    return envs.MHC_FUSE.get()


def mhc_weights(
    streams: torch.Tensor,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    *,
    norm_eps: float,
    hc_eps: float,
    sinkhorn_iters: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The pre / post / comb weights of one block.

    Args:
        streams: ``[N, S, D]`` residual streams (any float dtype).
        fn: ``[(2 + S) * S, S * D]`` projection.
        base: ``[(2 + S) * S]`` bias.
        scale: ``[3]`` scales of the pre, post and comb logits.
        norm_eps: epsilon of the weightless RMS norm over the flattened streams.
        hc_eps: floor added to pre and comb and to every Sinkhorn denominator.
        sinkhorn_iters: Sinkhorn iterations (>= 1).

    Returns:
        ``(pre [N, S], post [N, S], comb [N, S, S])`` FP32; ``comb[n, j, s]`` is the weight of input
        stream ``j`` in output stream ``s``.
    """
    n, s, d = streams.shape
    x = streams.reshape(n, s * d).float()
    x = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + norm_eps)
    mix = model_linear(x, fn.float())  # row-invariant in the batch-invariant mode
    pre_w, post_w, comb_w = mix.split([s, s, s * s], dim=-1)
    b = base.float()
    pre_b, post_b, comb_b = b.split([s, s, s * s])
    sc = scale.float()
    pre = torch.sigmoid(pre_w * sc[0] + pre_b) + hc_eps
    post = 2.0 * torch.sigmoid(post_w * sc[1] + post_b)
    comb = torch.softmax(comb_w.view(n, s, s) * sc[2] + comb_b.view(s, s), dim=-1) + hc_eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_eps)
    for _ in range(sinkhorn_iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + hc_eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_eps)
    return pre, post, comb


def mhc_collapse(streams: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """Block input ``[N, D]`` = ``sum_s pre[:, s] * streams[:, s]`` (FP32 products, cast to the streams' dtype)."""
    return (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)


def mhc_expand(streams: torch.Tensor, block_out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """New streams ``[N, S, D]`` = ``post ⊗ block_out + combᵀ @ streams``, in the streams' dtype.

    The weights are cast to the streams' dtype first, as the reference does in bf16 models.
    """
    dt = streams.dtype
    return post.to(dt).unsqueeze(-1) * block_out.to(dt).unsqueeze(-2) + torch.matmul(
        comb.to(dt).transpose(-1, -2), streams
    )


def mhc_backend(streams: torch.Tensor, *params: torch.Tensor, backend: str | None = None) -> str:
    """``"torch"`` or ``"triton"`` for one `mhc_block` call (a decision from devices and flags only).

    ``backend`` (default: ``TRTLLM_GLM_MHC_BACKEND``, else ``"auto"``): ``"torch"``, the reference functions;
    ``"triton"``, the fused kernels on any device (the CPU runs them through Triton's interpreter);
    ``"auto"``, the kernels for CUDA streams when no gradient is needed (they have no backward), the
    reference otherwise (the CPU, training).

    Args:
        streams: ``[N, S, D]`` residual streams.
        *params: the block's ``fn``, ``base``, ``scale`` (their ``requires_grad`` matters under autograd).
        backend: overrides the environment.

    Returns:
        ``"torch"`` or ``"triton"``.
    """
    return kernel_backend(envs.MHC_BACKEND, (streams, *params), backend)


def mhc_block_pre(
    streams: torch.Tensor,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    *,
    norm_eps: float,
    hc_eps: float,
    sinkhorn_iters: int,
    backend: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The half of `mhc_block` before its block: ``(x_in [N, D] streams' dtype, post [N, S], comb [N, S, S])``.

    ``backend`` is a resolved `mhc_backend` choice (``"torch"`` or ``"triton"``); pass the same one to
    `mhc_block_post`. Row-wise: each row's outputs depend on that row alone (the CUDA-graph padding rows of
    `trtllm_glm.runtime.piecewise` cannot reach real rows).
    """
    kw = {"norm_eps": norm_eps, "hc_eps": hc_eps, "sinkhorn_iters": sinkhorn_iters}
    if backend == "triton":
        from trtllm_glm import mhc as kernels

        return kernels.mhc_pre(streams, fn, base, scale, **kw)
    pre, post, comb = mhc_weights(streams, fn, base, scale, **kw)
    return mhc_collapse(streams, pre), post, comb


def mhc_block_post(
    streams: torch.Tensor, block_out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor, *, backend: str
) -> torch.Tensor:
    """The half of `mhc_block` after its block: new streams ``[N, S, D]`` from the block's ``[N, D]`` output and
    `mhc_block_pre`'s ``post`` / ``comb`` (``backend``: the choice the pre half was run with)."""
    if backend == "triton":
        from trtllm_glm import mhc as kernels

        return kernels.mhc_post(streams, block_out, post, comb)
    return mhc_expand(streams, block_out, post, comb)


def mhc_block(
    streams: torch.Tensor,
    block,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    *,
    norm_eps: float,
    hc_eps: float,
    sinkhorn_iters: int,
    backend: str | None = None,
) -> torch.Tensor:
    """One whole mHC-wrapped block: ``block`` maps the collapsed ``[N, D]`` input to its ``[N, D]`` output.

    ``backend`` (default from ``TRTLLM_GLM_MHC_BACKEND``, see `mhc_backend`) picks the reference functions or
    the fused kernels (`trtllm_glm.mhc.mhc_pre` before the block, `trtllm_glm.mhc.mhc_post` after it). The
    same as `mhc_block_pre`, ``block``, `mhc_block_post` (the piecewise CUDA graphs run the halves apart).
    """
    b = mhc_backend(streams, fn, base, scale, backend=backend)
    x_in, post, comb = mhc_block_pre(
        streams, fn, base, scale, norm_eps=norm_eps, hc_eps=hc_eps, sinkhorn_iters=sinkhorn_iters, backend=b
    )
    return mhc_block_post(streams, block(x_in), post, comb, backend=b)


def mhc_pre_norm_reference(
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
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The torch definition of a fused residual site: ``(streams, rms_norm(collapse), post, comb)``.

    Args:
        streams: ``[N, S, D]`` this block's input streams, or with ``prev`` the previous block's.
        fn / base / scale / norm_eps / hc_eps / sinkhorn_iters: this block's mHC (`mhc_weights`).
        norm_weight: ``[D]`` the block's input RMSNorm weight, ``rms_eps`` its epsilon.
        prev: ``(block_out, post, comb)`` of the previous block: ``streams`` are first expanded (`mhc_expand`).

    Returns:
        ``(streams [N, S, D], x [N, D], post [N, S], comb [N, S, S])``: this block's input streams, its normed
        input (streams' dtype) and its weights (fp32).
    """
    if prev is not None:
        streams = mhc_expand(streams, *prev)
    pre, post, comb = mhc_weights(
        streams, fn, base, scale, norm_eps=norm_eps, hc_eps=hc_eps, sinkhorn_iters=sinkhorn_iters
    )
    x_in = mhc_collapse(streams, pre)
    xf = x_in.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + rms_eps)
    return streams, (xf * norm_weight.float()).to(x_in.dtype), post, comb


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
    backend: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A residual site, ``backend`` (a resolved `mhc_backend` choice) picking the two-launch kernels
    (`trtllm_glm.mhc.mhc_pre_norm`) or `mhc_pre_norm_reference`. Row-wise, as `mhc_block_pre`."""
    kw = dict(norm_eps=norm_eps, hc_eps=hc_eps, sinkhorn_iters=sinkhorn_iters, rms_eps=rms_eps, prev=prev)
    if backend == "triton":
        from trtllm_glm import mhc as kernels

        return kernels.mhc_pre_norm(streams, fn, base, scale, norm_weight, **kw)
    return mhc_pre_norm_reference(streams, fn, base, scale, norm_weight, **kw)


def mhc_post_mean_norm_reference(
    streams: torch.Tensor,
    block_out: torch.Tensor,
    post: torch.Tensor,
    comb: torch.Tensor,
    norm_weight: torch.Tensor,
    *,
    rms_eps: float,
) -> torch.Tensor:
    """The model's end as torch defines it: ``rms_norm(mhc_expand(...).mean(dim=1))`` ``[N, D]``."""
    h = mhc_expand(streams, block_out, post, comb).mean(dim=1)
    xf = h.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + rms_eps)
    return (xf * norm_weight.float()).to(h.dtype)


def mhc_post_mean_norm(
    streams: torch.Tensor,
    block_out: torch.Tensor,
    post: torch.Tensor,
    comb: torch.Tensor,
    norm_weight: torch.Tensor,
    *,
    rms_eps: float,
    backend: str,
) -> torch.Tensor:
    """The fused sites' end: the last block's expand, the stream mean and the final norm (``backend`` as
    `mhc_pre_norm`: one launch, `trtllm_glm.mhc.mhc_post_mean_norm`, or `mhc_post_mean_norm_reference`)."""
    if backend == "triton":
        from trtllm_glm import mhc as kernels

        return kernels.mhc_post_mean_norm(streams, block_out, post, comb, norm_weight, rms_eps=rms_eps)
    return mhc_post_mean_norm_reference(streams, block_out, post, comb, norm_weight, rms_eps=rms_eps)
