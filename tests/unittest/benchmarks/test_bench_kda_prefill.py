"""`benchmarks/bench_kda_prefill.py`'s ``legacy`` path (the KDA prefill as it stood before the fused prefill conv,
replicated for the A/B) computes what the layer computes: on the CPU (torch references on both sides) the same
bits, so the benchmark's old-vs-new rows compare the same math."""

from __future__ import annotations

import pytest
import torch

from benchmarks.bench_kda_prefill import _legacy_forward

pytestmark = pytest.mark.cpu_only


@pytest.mark.parametrize("fused", [False, True])
def test_legacy_prefill_equals_the_layer_on_cpu(fused: bool) -> None:
    from trtllm_glm.config import Glm5NextConfig
    from trtllm_glm.kda import KdaBatch, KimiDeltaAttention
    from trtllm_glm.state import KdaLayerState

    cfg = Glm5NextConfig(hidden_size=32, kda_num_heads=2, kda_head_dim=16, kda_short_conv_kernel_size=4,
                         kda_gate_low_rank=8)  # fmt: skip
    layer = KimiDeltaAttention(cfg, 0)
    layer.reset_parameters(torch.Generator().manual_seed(2), 0.2)
    if fused:
        layer.fuse_weights()
    g = torch.Generator().manual_seed(3)
    rec = torch.randn(8, 2, 16, 16, generator=g)
    conv = torch.randn(8, layer.conv_dim, 3, generator=g)
    hidden = torch.randn(20, 32, generator=g)
    batch = KdaBatch.build([7, 2, 11], [5, 0, 3], [5, 1, 6])
    old = KdaLayerState(rec.clone(), conv.clone())
    new = KdaLayerState(rec.clone(), conv.clone())
    out_old = _legacy_forward(layer, hidden, batch, old)
    out_new = layer(hidden, batch, new)
    assert torch.equal(out_old, out_new)
    assert torch.equal(old.conv, new.conv) and torch.equal(old.recurrent, new.recurrent)
    assert not torch.equal(new.conv, conv)  # the step moved the windows
