"""Triton KDA verify / commit kernels on CUDA at real GLM-5.3-Flash KDA geometry (64 heads, K = V = 128).

Needs CUDA (tests/conftest.py skips ``gpu`` tests without it). bf16 and FP32 inputs against the FP32 torch
reference (`kda.ops.verify`, on the same upcast values), slot-indexed state pools with fresh sequences,
mixed accepted counts, a CUDA-graph capture + replay of verify + commit against eager runs, the layer with
the kernels against the layer with the reference and, when fla-core imports, its ``fused_recurrent_kda``
over the same rows as an independent check. Run with ``-s`` to see the measured errors.
"""

from __future__ import annotations

import pytest
import torch

from trtllm_glm.config import Glm5NextConfig
from trtllm_glm.kda import KdaBatch, KimiDeltaAttention
from trtllm_glm.kda import kernels as KK
from trtllm_glm.kda.ops import fla_kda_available, kda_gate, l2_normalize
from trtllm_glm.kda.ops import verify as R
from trtllm_glm.state import KdaLayerState

pytestmark = pytest.mark.gpu

_REAL = Glm5NextConfig.from_pretrained("glm-5.3-flash")
H = _REAL.kda_num_heads
K = V = _REAL.kda_head_dim
SCALE = K**-0.5
# Max error relative to max |reference|: FP32 math on both sides, only the K-reduction order differs.
RTOL = 2e-5


def _report(name: str, got: torch.Tensor, ref: torch.Tensor) -> float:
    """Prints and returns max|got - ref| / max|ref|."""
    err = (got.float() - ref.float()).abs().max().item()
    top = ref.float().abs().max().item()
    print(f"[kda-verify-gpu] {name}: max|err| = {err:.3e} (max|ref| = {top:.3e}, relative {err / top:.2e})")
    return err / top


def _inputs(N: int, W: int, seed: int, dev: torch.device, dtype: torch.dtype):
    gen = torch.Generator().manual_seed(seed)

    def r(*s: int) -> torch.Tensor:
        return torch.randn(*s, generator=gen)

    q = l2_normalize(r(N, W, H, K))
    k = l2_normalize(r(N, W, H, K))
    v = r(N, W, H, V)
    A_log = torch.empty(H).uniform_(1.0, 16.0, generator=gen).log()
    g = kda_gate(r(N, W, H, K) * 2.0, A_log, r(H * K) * 0.1, -5.0)
    beta = torch.sigmoid(r(N, W, H))
    return tuple(t.to(device=dev, dtype=dtype) for t in (q, k, v, g, beta))


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("W", [1, 4, 8])
def test_verify_commit_vs_reference(W: int, dtype: torch.dtype) -> None:
    dev = torch.device("cuda")
    N, S = 8, 13
    q, k, v, g, beta = _inputs(N, W, 10 + W, dev, dtype)
    gen = torch.Generator().manual_seed(W)
    pool = (0.5 * torch.randn(S, H, K, V, generator=gen)).to(dev)
    slots = torch.randperm(S, generator=gen)[:N].to(dev)
    fresh = torch.zeros(N, dtype=torch.bool, device=dev)
    fresh[1] = fresh[5] = True
    pool[slots[1]] = float("nan")  # a fresh sequence's slot must not be read
    before = pool.clone()

    o, rec = R.kda_verify(q, k, v, g, beta, SCALE, pool, state_slots=slots, fresh=fresh)  # auto: Triton on CUDA
    assert torch.equal(_bits(pool), _bits(before))
    f32 = [t.float() for t in (q, k, v, g, beta)]
    o_ref, rec_ref = R.kda_verify(*f32, SCALE, pool, state_slots=slots, fresh=fresh, backend="torch")
    assert _report(f"verify o W={W} {dtype}", o, o_ref) < RTOL
    assert _report(f"verify u W={W} {dtype}", rec.u, rec_ref.u) < RTOL
    assert rec.g.dtype == torch.float32 and torch.equal(rec.g, rec_ref.g) and torch.equal(rec.k, rec_ref.k)
    # Launch shapes (value block, warps, row-loop prefetch) change the schedule, not the math.
    for kw in ({"num_stages": 1}, {"block_v": 16, "num_warps": 2}, {"block_v": 64, "num_warps": 8}):
        o_kw, rec_kw = KK.kda_verify(q, k, v, g, beta, SCALE, pool, state_slots=slots, fresh=fresh, **kw)
        assert _report(f"verify o W={W} {dtype} {kw}", o_kw, o_ref) < RTOL
        assert _report(f"verify u W={W} {dtype} {kw}", rec_kw.u, rec_ref.u) < RTOL

    a = torch.tensor([W, 0, 1, 0, W, W // 2, min(2, W), W], device=dev)
    got = pool.clone()
    R.kda_commit(got, rec, a, state_slots=slots, fresh=fresh)
    ref = pool.clone()
    R.kda_commit(ref, rec_ref, a, state_slots=slots, fresh=fresh, backend="torch")
    assert _report(f"commit state W={W} {dtype}", got[slots], ref[slots]) < RTOL
    got_kw = pool.clone()
    KK.kda_commit(got_kw, rec, a, state_slots=slots, fresh=fresh, block_v=16, num_warps=2, num_stages=1)
    assert _report(f"commit state W={W} {dtype} bv16 w2 s1", got_kw[slots], ref[slots]) < RTOL
    assert torch.equal(got[slots[1]], torch.zeros(H, K, V, device=dev))  # fresh, a = 0: zeroed
    assert torch.equal(_bits(got[slots[3]]), _bits(pool[slots[3]]))  # a = 0: bit-identical
    others = torch.ones(S, dtype=torch.bool, device=dev)
    others[slots] = False
    assert torch.equal(_bits(got[others]), _bits(pool[others]))


def test_cuda_graph_capture_replay_matches_eager() -> None:
    dev = torch.device("cuda")
    N, W, S = 16, 8, 20
    q, k, v, g, beta = (t.clone() for t in _inputs(N, W, 1, dev, torch.float32))
    gen = torch.Generator().manual_seed(2)
    pool0 = (0.5 * torch.randn(S, H, K, V, generator=gen)).to(dev)
    pool = pool0.clone()
    slots = torch.randperm(S, generator=gen)[:N].to(dev)
    fresh = torch.zeros(N, dtype=torch.bool, device=dev)
    a = torch.randint(0, W + 1, (N,), generator=gen).to(dev)
    o_buf = torch.empty(N, W, H, V, device=dev)
    u_buf = torch.empty(N, W, H, V, device=dev)

    def step() -> None:
        _, rec = KK.kda_verify(q, k, v, g, beta, SCALE, pool, state_slots=slots, fresh=fresh, out=(o_buf, u_buf))
        KK.kda_commit(pool, rec, a, state_slots=slots, fresh=fresh)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # compile outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for rnd in range(3):
        # New inputs and acceptance in the same buffers: nothing host-side may be baked into the graph.
        new = _inputs(N, W, 100 + rnd, dev, torch.float32)
        for dst, src in zip((q, k, v, g, beta), new):
            dst.copy_(src)
        a.copy_(torch.randint(0, W + 1, (N,), generator=gen).to(dev))
        fresh.copy_(torch.rand(N, generator=gen).to(dev) < 0.25)
        pool.copy_(pool0)
        graph.replay()
        torch.cuda.synchronize()
        o_g, u_g, pool_g = o_buf.clone(), u_buf.clone(), pool.clone()
        pool.copy_(pool0)
        o_e, rec_e = KK.kda_verify(q, k, v, g, beta, SCALE, pool, state_slots=slots, fresh=fresh)
        KK.kda_commit(pool, rec_e, a, state_slots=slots, fresh=fresh)
        assert torch.equal(o_g, o_e) and torch.equal(u_g, rec_e.u) and torch.equal(pool_g, pool), rnd
        pool.copy_(pool0)
        o_r, rec_r = R.kda_verify(q, k, v, g, beta, SCALE, pool, state_slots=slots, fresh=fresh, backend="torch")
        R.kda_commit(pool, rec_r, a, state_slots=slots, fresh=fresh, backend="torch")
        assert _report(f"graph replay {rnd} o", o_g, o_r) < RTOL
        assert _report(f"graph replay {rnd} state", pool_g, pool) < RTOL


def test_layer_kernels_vs_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    """The layer's verify + commit through the kernels (default on CUDA) and through the reference."""
    dev = torch.device("cuda")
    cfg = Glm5NextConfig(hidden_size=1024, kda_num_heads=H, kda_head_dim=K, kda_gate_low_rank=128)
    layer = KimiDeltaAttention(cfg, kda_idx=0, device=dev)
    layer.reset_parameters(torch.Generator().manual_seed(0), std=0.03)
    S = 6
    gen = torch.Generator().manual_seed(4)
    rec0 = 0.5 * torch.randn(S, H, K, V, generator=gen).to(dev)
    rec0[1] = float("nan")  # slot of the fresh sequence below
    conv0 = torch.randn(S, layer.conv_dim, 3, generator=gen).to(dev)
    batch = KdaBatch.build([4, 3, 1, 4], [41, 0, 7, 250], [4, 1, 0, 5], device=dev)
    hidden = torch.randn(12, 1024, generator=gen).to(dev)
    outs, states = {}, {}
    for backend in ("torch", "triton"):
        monkeypatch.setenv("TRTLLM_GLM_KDA_VERIFY", backend)
        st = KdaLayerState(recurrent=rec0.clone(), conv=conv0.clone())
        out, rec = layer.forward_verify(hidden, batch, st)
        assert torch.equal(_bits(st.recurrent), _bits(rec0))
        layer.commit(rec, [2, 0, 1, 4], st)
        outs[backend], states[backend] = out, st
    assert _report("layer verify out", outs["triton"], outs["torch"]) < 1e-4
    live = [4, 1, 0, 5]
    assert _report("layer committed state", states["triton"].recurrent[live], states["torch"].recurrent[live]) < 1e-4
    assert torch.equal(states["triton"].recurrent[1], torch.zeros(H, K, V, device=dev))
    for slot in (2, 3):
        assert torch.equal(_bits(states["triton"].recurrent[slot]), _bits(rec0[slot]))


def test_vs_fla_fused_recurrent() -> None:
    """Independent check: fla's recurrent kernel over the W rows equals verify's outputs and commit(a = W)."""
    if not fla_kda_available():
        pytest.skip("fla-core is not importable")
    from fla.ops.kda import fused_recurrent_kda

    dev = torch.device("cuda")
    N, W = 4, 6
    q, k, v, g, beta = _inputs(N, W, 7, dev, torch.float32)
    S0 = (0.5 * torch.randn(N, H, K, V, generator=torch.Generator().manual_seed(8))).to(dev)
    o_f, S_f = fused_recurrent_kda(
        q=q, k=k, v=v, g=g, beta=beta, scale=SCALE, initial_state=S0.clone(), output_final_state=True
    )
    o, rec = KK.kda_verify(q, k, v, g, beta, SCALE, S0)
    st = S0.clone()
    KK.kda_commit(st, rec, W)
    assert _report("verify o vs fla", o, o_f) < 1e-5
    assert _report("commit(W) state vs fla", st, S_f) < 1e-5
