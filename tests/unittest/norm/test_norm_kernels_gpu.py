"""The fused row-normalisation kernel (compiled, CUDA) at the real GLM-5.3-Flash sizes against the torch
references: RMSNorm over D = 4096 / 1536 / 512 in bf16, the KDA gated norm over [N, 64, 128] heads, and the
L2 normalisation of per-head views of the conv output. Outputs are poisoned with NaN first. Needs CUDA
(tests/conftest.py skips ``gpu`` tests without it).
"""

from __future__ import annotations

import pytest
import torch

from trtllm_glm.kda.ops.gate import L2NORM_EPS
from trtllm_glm.norm import row_norm

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def _ref(x, eps, weight=None, gate=None, mean=True, out_dtype=None):
    xf = x.float()
    stat = (xf * xf).mean(-1, keepdim=True) if mean else (xf * xf).sum(-1, keepdim=True)
    y = xf * torch.rsqrt(stat + eps)
    if weight is not None:
        y = y * weight.float()
    if gate is not None:
        y = y * torch.sigmoid(gate.float())
    return y.to(out_dtype or x.dtype)


@pytest.mark.parametrize("n", [1, 16, 128, 2048])
@pytest.mark.parametrize("d", [4096, 1536, 512])
def test_rms_norm_bf16(n: int, d: int) -> None:
    g = torch.Generator(device="cuda").manual_seed(n * d)
    x = (torch.randn(n, d, device="cuda", generator=g) * 3).to(torch.bfloat16)
    w = (1 + 0.2 * torch.randn(d, device="cuda", generator=g)).to(torch.bfloat16)
    out = torch.full_like(x, float("nan"))
    got = row_norm(x, 1e-5, weight=w, out=out)
    ref = _ref(x, 1e-5, weight=w)
    assert not torch.isnan(got).any()
    # One bf16 ulp where an FP32 value sits on a rounding boundary (the sums run in another order).
    torch.testing.assert_close(got.float(), ref.float(), rtol=8e-3, atol=1e-2)


@pytest.mark.parametrize("n", [1, 16, 128])
def test_gated_and_l2_norms(n: int) -> None:
    H, K = 64, 128
    g = torch.Generator(device="cuda").manual_seed(n)
    o = torch.randn(n, H, K, device="cuda", generator=g)
    gate = torch.randn(n, H, K, device="cuda", generator=g).to(torch.bfloat16)
    w = (1 + 0.2 * torch.randn(K, device="cuda", generator=g)).to(torch.bfloat16)
    got = row_norm(o, 1e-5, weight=w, gate=gate, out_dtype=torch.float32)
    torch.testing.assert_close(got, _ref(o, 1e-5, weight=w, gate=gate, out_dtype=torch.float32), rtol=1e-5, atol=1e-5)
    y = torch.randn(n, 3 * H * K, device="cuda", generator=g)
    q = y[:, : H * K].view(n, H, K)
    out = torch.full((n, H, K), float("nan"), device="cuda")
    got = row_norm(q, L2NORM_EPS, mean=False, out_dtype=torch.float32, out=out)
    torch.testing.assert_close(got, _ref(q, L2NORM_EPS, mean=False), rtol=1e-5, atol=1e-6)
