"""fla-core KDA kernels (through our wrappers) against the torch references at real GLM-5.3-Flash geometry.

Needs CUDA (tests/conftest.py skips ``gpu`` tests without it) and fla-core (skipped when it does not
import). Run with ``-s`` to see the measured errors.
"""

from __future__ import annotations

import pytest
import torch

from trtllm_glm.cache.manager import KdaLayerState
from trtllm_glm.config import Glm5NextConfig
from trtllm_glm.kda import KdaBatch, KimiDeltaAttention
from trtllm_glm.kda.ops import (
    chunk_kda,
    fla_kda_available,
    kda_decode,
    kda_decode_inplace,
    kda_gate,
    kda_prefill,
    l2_normalize,
    recurrent_kda,
    recurrent_kda_step,
)

pytestmark = pytest.mark.gpu

H, K, V = 64, 128, 128
LB = -5.0
# Max error relative to max |reference|. FP32 inputs; fla's chunked kernels multiply through tensor cores
# (TF32 inputs in places), so they agree to ~1e-3 relative rather than ~1e-6 (the recurrent kernel is ~1e-7).
RTOL = 5e-3


def _need_fla() -> None:
    if not fla_kda_available():
        pytest.skip("fla-core is not importable")


def _inputs(T: int, seed: int, dev: torch.device):
    gen = torch.Generator().manual_seed(seed)

    def r(*s: int) -> torch.Tensor:
        return torch.randn(*s, generator=gen)

    q = l2_normalize(r(T, H, K))
    k = l2_normalize(r(T, H, K))
    v = r(T, H, V)
    A_log = torch.empty(H).uniform_(1.0, 16.0, generator=gen).log()
    g = kda_gate(r(T, H, K) * 2.0, A_log, r(H * K) * 0.1, LB)
    beta = torch.sigmoid(r(T, H))
    return tuple(t.to(dev) for t in (q, k, v, g, beta))


def _report(name: str, got: torch.Tensor, ref: torch.Tensor) -> float:
    """Prints and returns max|got - ref| / max|ref|."""
    err = (got.float() - ref.float()).abs().max().item()
    top = ref.abs().max().item()
    print(f"[kda-gpu] {name}: max|err| = {err:.3e} (max|ref| = {top:.3e}, relative {err / top:.2e})")
    return err / top


def test_fla_chunk_vs_reference_varlen() -> None:
    _need_fla()
    dev = torch.device("cuda")
    lens = [300, 1, 217, 64, 129]
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    q, k, v, g, beta = _inputs(cu[-1], 0, dev)
    S0 = 0.5 * torch.randn(len(lens), H, K, V, generator=torch.Generator().manual_seed(1)).to(dev)
    scale = K**-0.5
    o_ref, S_ref = chunk_kda(q, k, v, g, beta, scale, S0, cu_seqlens=cu, chunk_size=32)
    # The torch chunked reference itself against the token loop on one sequence, at this geometry.
    sl = slice(cu[2], cu[3])
    o_loop, S_loop = recurrent_kda(q[sl], k[sl], v[sl], g[sl], beta[sl], scale, S0[2:3])
    assert _report("torch chunk vs loop (o)", o_ref[sl], o_loop) < 1e-5
    assert _report("torch chunk vs loop (S)", S_ref[2], S_loop[0]) < 1e-5
    S0_before = S0.clone()
    for safe in (LB, None):
        o, S = kda_prefill(q, k, v, g, beta, scale, S0, cu, lower_bound=safe, backend="fla")
        assert torch.equal(S0, S0_before)
        assert _report(f"fla chunk_kda o (lower_bound={safe})", o, o_ref) < RTOL
        assert _report(f"fla chunk_kda final state (lower_bound={safe})", S, S_ref) < RTOL


def test_fla_chunk_syncs_once_per_batch_layout() -> None:
    """The KDA layers of a step share one batch layout: after the first layer's chunk call, the same offsets
    give fla the same tensors, whose chunk indices it memoises, so the next layers launch without waiting for
    the GPU (before, each layer's call copied fla's host-built indices from pageable memory: a stream sync)."""
    _need_fla()
    dev = torch.device("cuda")
    cu = [0, 37, 38, 140]
    q, k, v, g, beta = _inputs(cu[-1], 3, dev)
    S0 = torch.zeros(len(cu) - 1, H, K, V, device=dev)
    first = kda_prefill(q, k, v, g, beta, K**-0.5, S0, list(cu), lower_bound=LB, backend="fla")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        again = kda_prefill(q, k, v, g, beta, K**-0.5, S0, list(cu), lower_bound=LB, backend="fla")
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(first[0], again[0]) and torch.equal(first[1], again[1])


def test_fla_fused_recurrent_vs_reference() -> None:
    _need_fla()
    dev = torch.device("cuda")
    N = 16
    q, k, v, g, beta = _inputs(N, 2, dev)
    S0 = torch.randn(N, H, K, V, generator=torch.Generator().manual_seed(3)).to(dev)
    o_ref, S_ref = recurrent_kda_step(q, k, v, g, beta, K**-0.5, S0)
    o, S = kda_decode(q, k, v, g, beta, K**-0.5, S0, backend="fla")
    assert _report("fla fused_recurrent_kda o", o, o_ref) < 1e-5
    assert _report("fla fused_recurrent_kda state", S, S_ref) < 1e-5
    # In-place on a slot pool: only the listed slots change.
    pool = torch.randn(N + 5, H, K, V, generator=torch.Generator().manual_seed(4)).to(dev)
    slots = torch.randperm(N + 5, generator=torch.Generator().manual_seed(5))[:N].to(dev)
    pool[slots] = S0
    before = pool.clone()
    o_in = kda_decode_inplace(q, k, v, g, beta, K**-0.5, pool, slots, backend="fla")
    assert _report("fla in-place decode o", o_in, o_ref) < 1e-5
    assert _report("fla in-place decode state", pool[slots], S_ref) < 1e-5
    untouched = torch.ones(N + 5, dtype=torch.bool, device=dev)
    untouched[slots] = False
    assert torch.equal(pool[untouched], before[untouched])


def test_layer_fla_vs_torch_backend() -> None:
    """The layer at real KDA geometry (smaller hidden size) on a mixed decode + prefill + verify batch."""
    _need_fla()
    dev = torch.device("cuda")
    cfg = Glm5NextConfig(hidden_size=1024, kda_num_heads=H, kda_head_dim=K, kda_gate_low_rank=128)
    layer = KimiDeltaAttention(cfg, kda_idx=0, device=dev)
    layer.reset_parameters(torch.Generator().manual_seed(0), std=0.03)
    S = 6
    gen = torch.Generator().manual_seed(4)
    rec0 = 0.5 * torch.randn(S, H, K, V, generator=gen).to(dev)
    conv0 = torch.randn(S, layer.conv_dim, 3, generator=gen).to(dev)
    hidden = torch.randn(1 + 250 + 37 + 1, 1024, generator=gen).to(dev)
    batch = KdaBatch.build([1, 250, 37, 1], [40, 0, 90, 0], [4, 1, 0, 5], device=dev)

    outs, states = {}, {}
    for backend in ("torch", "fla"):
        layer.backend = backend
        st = KdaLayerState(recurrent=rec0.clone(), conv=conv0.clone())
        outs[backend] = layer(hidden, batch, st)
        states[backend] = st
    assert _report("layer out fla vs torch", outs["fla"], outs["torch"]) < RTOL
    assert _report("layer state fla vs torch", states["fla"].recurrent, states["torch"].recurrent) < RTOL
    assert torch.equal(states["fla"].conv, states["torch"].conv)
    # Verify (torch on any device) + commit after the fla step, then a width-one decode on each path.
    st = states["fla"]
    vb = KdaBatch.build([4, 4], [41, 250], [4, 1], device=dev)
    h2 = torch.randn(8, 1024, generator=gen).to(dev)
    before = st.recurrent.clone()
    _, rec = layer.forward_verify(h2, vb, st)
    assert torch.equal(st.recurrent, before)
    layer.commit(rec, [2, 4], st)
    assert bool(torch.isfinite(st.recurrent).all())
    for slot in (2, 3):  # never in a batch
        assert torch.equal(st.recurrent[slot], rec0[slot]) and torch.equal(st.conv[slot], conv0[slot])
    # Width-one round: in-place decode (fla kernel) vs verify(1) + commit(1) (torch records), to rounding.
    one = KdaBatch.build([1], [43], [4], device=dev)
    h3 = torch.randn(1, 1024, generator=gen).to(dev)
    a = KdaLayerState(recurrent=st.recurrent.clone(), conv=st.conv.clone())
    b = KdaLayerState(recurrent=st.recurrent.clone(), conv=st.conv.clone())
    out_d = layer(h3, one, a)
    out_v, rec1 = layer.forward_verify(h3, one, b)
    layer.commit(rec1, [1], b)
    assert _report("width-one decode vs verify+commit(1): out", out_v, out_d) < 1e-5
    assert _report("width-one decode vs verify+commit(1): state", b.recurrent, a.recurrent) < 1e-5
    assert _report("width-one decode vs verify+commit(1): conv", b.conv, a.conv) < 1e-6


@pytest.mark.parametrize("interleaved", [False, True])
def test_layer_prefill_conv_kernel_vs_torch(monkeypatch, interleaved: bool) -> None:
    """The layer's prefill of 8,192 rows in 3 sequences (one fresh), real KDA geometry, bf16 weights and fused
    input GEMM as served: the fused prefill conv kernel against the torch conv path (fla chunk core in both),
    outputs within the fla tolerance and conv windows bit for bit. ``interleaved``: a decode row between the
    chunks (the rows are gathered, ``o`` is filled by index)."""
    _need_fla()
    dev = torch.device("cuda")
    cfg = Glm5NextConfig(hidden_size=1024, kda_num_heads=H, kda_head_dim=K, kda_gate_low_rank=128)
    layer = KimiDeltaAttention(cfg, kda_idx=0, device=dev)
    layer.reset_parameters(torch.Generator().manual_seed(1), std=0.03)
    layer = layer.to(torch.bfloat16)
    layer.A_log.data, layer.dt_bias.data = layer.A_log.data.float(), layer.dt_bias.data.float()
    layer.fuse_weights()
    S = 8
    gen = torch.Generator().manual_seed(6)
    rec0 = 0.5 * torch.randn(S, H, K, V, generator=gen).to(dev)
    conv0 = torch.randn(S, layer.conv_dim, 3, generator=gen).to(dev)
    if interleaved:
        q_lens, past, slots = [4000, 1, 3, 4188], [100, 57, 0, 9], [5, 2, 0, 7]
    else:
        q_lens, past, slots = [4000, 3, 4189], [100, 0, 9], [5, 0, 7]
    hidden = (torch.randn(sum(q_lens), 1024, generator=gen) * 0.5).to(dev, torch.bfloat16)
    batch = KdaBatch.build(q_lens, past, slots, device=dev)
    outs, mixer, states = {}, {}, {}
    for backend in ("torch", "triton"):
        monkeypatch.setenv("TRTLLM_GLM_KDA_CONV_BACKEND", backend)
        st = KdaLayerState(recurrent=rec0.clone(), conv=conv0.clone())
        with torch.no_grad():  # (as `forward` runs: the kernels have no backward)
            inputs = layer._inputs(hidden)
            mixer[backend] = layer._forward_o(hidden, batch, st, inputs)  # o [N, H, V] FP32, before the bf16 output
            outs[backend] = layer._output(hidden, mixer[backend], inputs[3])
        states[backend] = st
    assert _report("layer prefill o: conv kernel vs torch", mixer["triton"], mixer["torch"]) < RTOL
    # The layer's bf16 output: a last-bit flip of a bf16 value near the largest is up to 2^-7 of it.
    assert _report("layer prefill out (bf16): conv kernel vs torch", outs["triton"], outs["torch"]) < 2e-2
    rec_err = _report(
        "layer prefill state: conv kernel vs torch", states["triton"].recurrent, states["torch"].recurrent
    )
    assert rec_err < RTOL
    assert torch.equal(states["triton"].conv, states["torch"].conv)
    for slot in (1, 3, 4, 6):  # never in the batch
        assert torch.equal(states["triton"].recurrent[slot], rec0[slot])
        assert torch.equal(states["triton"].conv[slot], conv0[slot])
