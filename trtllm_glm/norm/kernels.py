"""One Triton kernel for the row normalisations of the decode path (`trtllm_glm.norm.row_norm`).

One program per row of ``x`` viewed as ``[A, B, D]`` (no copy of strided views), FP32, the references' order of
operations; optional PDL (``TRTLLM_GLM_PDL``). Agreement to a few FP32 ulps. Details: docs/kernels.md, "Row
normalisations".
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from trtllm_glm.pdl import late_trigger, launch_kwargs, pdl_enter, pdl_leave, use_pdl

__all__ = ["row_norm"]


@triton.jit
def _row_norm_kernel(
    x_ptr,
    w_ptr,
    g_ptr,
    o_ptr,
    B,
    D,
    sxa,
    sxb,
    sga,
    sgb,
    soa,
    sob,
    eps,
    HAS_W: tl.constexpr,
    HAS_GATE: tl.constexpr,
    MEAN: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PDL: tl.constexpr,
    PDL_LATE: tl.constexpr,
):
    # With PDL (`trtllm_glm.pdl`) the projection after the norm launches now (or at the end: ``PDL_LATE``) and
    # starts streaming its weight.
    pdl_enter(PDL, PDL_LATE)
    row = tl.program_id(0)
    a = row // B
    b = row % B
    offs = tl.arange(0, BLOCK_D)
    m = offs < D
    x = tl.load(x_ptr + a * sxa + b * sxb + offs, mask=m, other=0.0).to(tl.float32)
    stat = tl.sum(x * x, axis=0)
    if MEAN:
        stat = stat / D
    y = x * (1.0 / tl.sqrt(stat + eps))
    if HAS_W:
        y = y * tl.load(w_ptr + offs, mask=m, other=0.0).to(tl.float32)
    if HAS_GATE:
        gt = tl.load(g_ptr + a * sga + b * sgb + offs, mask=m, other=0.0).to(tl.float32)
        y = y * (1.0 / (1.0 + tl.exp(-gt)))
    tl.store(o_ptr + a * soa + b * sob + offs, y.to(o_ptr.dtype.element_ty), mask=m)
    pdl_leave(PDL, PDL_LATE)


def _as3d(t: torch.Tensor, what: str, *, copy_ok: bool = True) -> torch.Tensor:
    """``t [..., D]`` as ``[A, B, D]``: leading dims beyond two are merged (a copy only if they must be)."""
    if t.dim() == 0:
        raise ValueError(f"{what} must have at least one dim")
    if t.dim() > 3:
        if copy_ok:
            t = t.reshape(-1, *t.shape[-2:])
        else:
            try:
                t = t.view(-1, *t.shape[-2:])
            except RuntimeError as e:
                raise ValueError(f"{what}'s leading dims cannot be merged without a copy: {e}") from None
    while t.dim() < 3:
        t = t.unsqueeze(0)
    if t.stride(-1) != 1:
        raise ValueError(f"{what}'s last dim must be contiguous, got strides {t.stride()}")
    return t


def row_norm(
    x: torch.Tensor,
    eps: float,
    *,
    weight: torch.Tensor | None = None,
    gate: torch.Tensor | None = None,
    mean: bool = True,
    out_dtype: torch.dtype | None = None,
    out: torch.Tensor | None = None,
    num_warps: int | None = None,
) -> torch.Tensor:
    """``x * rsqrt(mean_or_sum(x^2) + eps) [* weight] [* sigmoid(gate)]`` over the last dim, one launch.

    Args:
        x: ``[..., D]`` any float dtype, last dim contiguous (up to two leading strides are read in place;
            more leading dims are merged, by a copy if their strides need one).
        eps: added to the statistic.
        weight: optional ``[D]`` scale.
        gate: optional gate logits shaped like ``x`` (last dim contiguous).
        mean: divide the sum of squares by ``D`` (RMSNorm) or not (L2 normalisation).
        out_dtype: result dtype (default ``x``'s).
        out: optional preallocated result shaped like ``x`` (last dim contiguous); wins over ``out_dtype``.
        num_warps: warps per row program (default from ``D``).

    Returns:
        ``[..., D]`` in ``out_dtype`` (``out`` when given, else a new contiguous tensor).
    """
    D = x.shape[-1]
    if weight is not None and weight.shape != (D,):
        raise ValueError(f"weight must be [{D}], got {tuple(weight.shape)}")
    if gate is not None and gate.shape != x.shape:
        raise ValueError(f"gate must be shaped like x {tuple(x.shape)}, got {tuple(gate.shape)}")
    if out is None:
        out = torch.empty(x.shape, dtype=out_dtype or x.dtype, device=x.device)
    elif out.shape != x.shape:
        raise ValueError(f"out must be shaped like x {tuple(x.shape)}, got {tuple(out.shape)}")
    if x.numel() == 0:
        return out
    x3, o3 = _as3d(x, "x"), _as3d(out, "out", copy_ok=False)
    g3 = _as3d(gate, "gate") if gate is not None else x3
    w = weight.contiguous() if weight is not None else x3
    A, B = x3.shape[0], x3.shape[1]
    block = triton.next_power_of_2(D)
    warps = num_warps or max(1, min(8, block // 256))
    pdl = use_pdl(x.device)
    _row_norm_kernel[(A * B,)](
        x3, w, g3, o3, B, D,
        x3.stride(0), x3.stride(1), g3.stride(0), g3.stride(1), o3.stride(0), o3.stride(1),
        float(eps),
        HAS_W=weight is not None, HAS_GATE=gate is not None, MEAN=mean, BLOCK_D=block, PDL=pdl,
        PDL_LATE=late_trigger(pdl), num_warps=warps, **launch_kwargs(pdl),
    )  # fmt: skip
    return out
