"""C4 pooling of indexer keys: a learned per-channel softmax over the 4 members of a pool."""

from __future__ import annotations

import torch

__all__ = ["KPOOL", "pool_keys"]

KPOOL = 4


def _exp(x: torch.Tensor) -> torch.Tensor:
    # fp32 exp through fp64: torch's vectorised and scalar fp32 exp paths can differ by an ulp, which
    # would make the same pool come out differently in decode (one pool) and prefill (many pools).
    return torch.exp(x.to(torch.float64)).to(torch.float32)


def pool_keys(key: torch.Tensor, gate: torch.Tensor, ape: torch.Tensor) -> torch.Tensor:
    """Pool 4 member keys per channel with softmax weights over ``gate + ape``.

    Per channel ``d``: ``l[m] = gate[m, d] + ape[m, d]``, ``mx = max_m l[m]``, ``e[m] = exp(l[m] - mx)``,
    ``den = ((e[0] + e[1]) + e[2]) + e[3]``, ``w[m] = e[m] / den`` and
    ``pooled = ((w[0] k[0] + w[1] k[1]) + w[2] k[2]) + w[3] k[3]``, each op in fp32 in exactly this order.
    ``exp`` is fp32 exp evaluated through fp64 (correctly rounded in practice); a kernel's fp32 exp may
    differ from it by an ulp.

    Args:
        key: ``[..., 4, 128]`` member keys, member ``m`` at position ``4p + m`` (computed as fp32).
        gate: ``[..., 4, 128]`` member gate logits.
        ape: ``[4, 128]`` learned position bias per member.

    Returns:
        ``[..., 128]`` fp32 pooled keys.
    """
    if key.shape[-2] != KPOOL or key.shape != gate.shape or ape.shape != key.shape[-2:]:
        raise ValueError(
            f"pool_keys expects key/gate [..., {KPOOL}, D] and ape [{KPOOL}, D], got "
            f"{tuple(key.shape)}, {tuple(gate.shape)}, {tuple(ape.shape)}"
        )
    key = key.to(torch.float32)
    logits = gate.to(torch.float32) + ape.to(torch.float32)
    mx = logits.amax(dim=-2, keepdim=True)
    e = _exp(logits - mx)
    den = ((e[..., 0, :] + e[..., 1, :]) + e[..., 2, :]) + e[..., 3, :]
    w = e / den.unsqueeze(-2)
    wk = w * key
    return ((wk[..., 0, :] + wk[..., 1, :]) + wk[..., 2, :]) + wk[..., 3, :]
