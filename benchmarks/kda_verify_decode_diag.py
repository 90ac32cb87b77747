"""Which KDA stage makes a verify row differ from the decode step of the same row in the batch-invariant mode.

Builds one KDA layer at the real head geometry (bf16 weights), computes a sequence's four verify rows and its
first decode step from the same state, and compares bit for bit: the short conv + SiLU + q/k norms
(`conv_verify_qkv` vs `conv_decode`, also with a strided vs contiguous input) and the recurrence on identical
inputs (`kda_verify` vs `kda_decode_inplace`, strided and contiguous). Prints one line per comparison.

Usage (one GPU; ``--device cpu`` runs the interpreted kernels): ``python -m benchmarks.kda_verify_decode_diag``.
Results: benchmarks/results/kernels/kda_verify_decode_diag_h200_2026-12-03.log.
"""

from __future__ import annotations

import argparse

import torch

from trtllm_glm.config import Glm5NextConfig
from trtllm_glm.kda import KimiDeltaAttention
from trtllm_glm.kda.ops import verify as R
from trtllm_glm.kda.ops.backend import kda_decode_inplace
from trtllm_glm.kda.ops.conv import conv_decode, conv_verify_qkv
from trtllm_glm.numerics import batch_invariant_mode


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.float().contiguous().view(torch.int32), b.float().contiguous().view(torch.int32))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    dev = ap.parse_args().device
    real = Glm5NextConfig.from_pretrained("glm-5.3-flash")
    H, K = real.kda_num_heads, real.kda_head_dim
    V, W = K, 4
    cfg = Glm5NextConfig(hidden_size=1024, kda_num_heads=H, kda_head_dim=K, kda_gate_low_rank=128)
    layer = KimiDeltaAttention(cfg, kda_idx=0, device=dev)
    layer.reset_parameters(torch.Generator().manual_seed(0), std=0.03)
    layer.to(torch.bfloat16)
    gen = torch.Generator().manual_seed(921)
    conv0 = torch.randn(3, layer.conv_dim, 3, generator=gen).to(dev)
    rec0 = (0.5 * torch.randn(3, H, K, V, generator=gen)).to(dev)
    hidden = torch.randn(W, 1024, generator=gen).to(dev, torch.bfloat16)
    slots = torch.tensor([1], device=dev)
    w = layer._conv_weight()
    with batch_invariant_mode(True), torch.no_grad():
        x, g, beta, _ = layer._inputs(hidden)
        qv, kv, vv = conv_verify_qkv(x, conv0.clone(), w, slots, H, K, V, W)
        qd, kd, vd = conv_decode(x[0::W], conv0.clone(), w, slots, H, K, V)
        print("conv row 0 (q, k, v equal):", _same(qv[:, 0], qd), _same(kv[:, 0], kd), _same(vv[:, 0], vd))
        qc, kc, vc = conv_decode(x[0:1].contiguous(), conv0.clone(), w, slots, H, K, V)
        print("conv decode, strided vs contiguous x:", _same(qd, qc), _same(kd, kc), _same(vd, vc))
        o_v, _ = R.kda_verify(qv, kv, vv, g.reshape(1, W, H, K), beta.reshape(1, W, H), layer.scale, rec0.clone(),
                              state_slots=slots)  # fmt: skip
        o_d = kda_decode_inplace(qv[:, 0], kv[:, 0], vv[:, 0], g[0::W], beta[0::W], layer.scale, rec0.clone(), slots)
        print("recurrence row 0 (strided g / beta):", _same(o_v[:, 0], o_d))
        o_c = kda_decode_inplace(*(t.contiguous() for t in (qv[:, 0], kv[:, 0], vv[:, 0], g[0:1], beta[0:1])),
                                 layer.scale, rec0.clone(), slots)  # fmt: skip
        print("recurrence row 0 (contiguous):", _same(o_v[:, 0], o_c))


if __name__ == "__main__":
    main()
