"""Triton kernel: C4 pooling on its own (`ops.pool_keys`), fp32 out.

The pool writers fuse this with the rotate-quantise chain; on its own it lets the pooling numerics be
compared bit for bit in fp32, before the bf16 rounding would hide an ulp of difference (a fused
multiply-add, another exp, another summation order).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import INDEX_DIM, INTERPRETED, KPOOL, pool4

__all__ = ["pool_keys"]

_BLOCK_M = 16


@triton.jit
def _pool_keys_kernel(key_ptr, gate_ptr, ape_ptr, out_ptr, M, BLOCK_M: tl.constexpr, USE_LIBDEVICE: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    d = tl.arange(0, 128)
    ok = (rows < M)[:, None]
    # Contiguous [M, 4, 128] members: member m of row r at (4 r + m) * 128.
    base = rows.to(tl.int64)[:, None] * 512 + d[None, :]
    k0 = tl.load(key_ptr + base, mask=ok, other=0.0).to(tl.float32)
    k1 = tl.load(key_ptr + base + 128, mask=ok, other=0.0).to(tl.float32)
    k2 = tl.load(key_ptr + base + 256, mask=ok, other=0.0).to(tl.float32)
    k3 = tl.load(key_ptr + base + 384, mask=ok, other=0.0).to(tl.float32)
    g0 = tl.load(gate_ptr + base, mask=ok, other=0.0).to(tl.float32)
    g1 = tl.load(gate_ptr + base + 128, mask=ok, other=0.0).to(tl.float32)
    g2 = tl.load(gate_ptr + base + 256, mask=ok, other=0.0).to(tl.float32)
    g3 = tl.load(gate_ptr + base + 384, mask=ok, other=0.0).to(tl.float32)
    a0 = tl.load(ape_ptr + d).to(tl.float32)[None, :]
    a1 = tl.load(ape_ptr + 128 + d).to(tl.float32)[None, :]
    a2 = tl.load(ape_ptr + 256 + d).to(tl.float32)[None, :]
    a3 = tl.load(ape_ptr + 384 + d).to(tl.float32)[None, :]
    pooled = pool4(k0, k1, k2, k3, g0, g1, g2, g3, a0, a1, a2, a3, USE_LIBDEVICE)
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * 128 + d[None, :], pooled, mask=ok)


def pool_keys(key: torch.Tensor, gate: torch.Tensor, ape: torch.Tensor) -> torch.Tensor:
    """Pool ``[..., 4, 128]`` members exactly as `ops.pool_keys`.

    Args:
        key: ``[..., 4, 128]`` member keys. gate: ``[..., 4, 128]`` gate logits. ape: ``[4, 128]`` bias.

    Returns:
        ``[..., 128]`` fp32 pooled keys.
    """
    if key.shape[-2:] != (KPOOL, INDEX_DIM) or gate.shape != key.shape or ape.shape != (KPOOL, INDEX_DIM):
        raise ValueError(
            f"expected key/gate [..., 4, 128] and ape [4, 128], got {tuple(key.shape)}, {tuple(ape.shape)}"
        )
    lead = key.shape[:-2]
    k = key.reshape(-1, KPOOL, INDEX_DIM).contiguous()
    g = gate.reshape(-1, KPOOL, INDEX_DIM).contiguous()
    out = torch.empty(*lead, INDEX_DIM, dtype=torch.float32, device=key.device)
    m = k.shape[0]
    if m:
        _pool_keys_kernel[(triton.cdiv(m, _BLOCK_M),)](
            k,
            g,
            ape.contiguous(),
            out,
            m,
            BLOCK_M=_BLOCK_M,
            USE_LIBDEVICE=not INTERPRETED,
            enable_fp_fusion=False,
        )
    return out
