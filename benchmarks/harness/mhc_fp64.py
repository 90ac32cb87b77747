"""The mHC weights (`trtllm_glm.modules.mhc.mhc_weights`) in fp64: a yardstick for the fp32 kernels and reference.

Shared by tests/unittest/mhc/test_mhc_kernels.py (interpreter) and test_mhc_kernels_gpu.py (real geometry). Same
operations in the same order as the reference, every one in fp64 (the reference runs in fp32 whatever the
inputs' dtype).
"""

from __future__ import annotations

import torch


def mhc_weights_fp64(
    streams: torch.Tensor,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    *,
    norm_eps: float,
    hc_eps: float,
    sinkhorn_iters: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(pre [N, S], post [N, S], comb [N, S, S])`` in fp64 from ``streams [N, S, D]``, ``fn [(2+S)*S, S*D]``,
    ``base [(2+S)*S]``, ``scale [3]`` (any float dtypes, upcast exactly)."""
    n, s, d = streams.shape
    x = streams.reshape(n, s * d).double()
    x = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + norm_eps)
    mix = x @ fn.double().T
    pre_w, post_w, comb_w = mix.split([s, s, s * s], dim=-1)
    pre_b, post_b, comb_b = base.double().split([s, s, s * s])
    sc = scale.double()
    pre = torch.sigmoid(pre_w * sc[0] + pre_b) + hc_eps
    post = 2.0 * torch.sigmoid(post_w * sc[1] + post_b)
    comb = torch.softmax(comb_w.view(n, s, s) * sc[2] + comb_b.view(s, s), dim=-1) + hc_eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_eps)
    for _ in range(sinkhorn_iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + hc_eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_eps)
    return pre, post, comb
