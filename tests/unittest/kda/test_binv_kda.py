"""Batch-invariant mode (issue 31), KDA: a decode row has a verify row's bits, a commit a decode chain's state.

CPU, Triton's interpreter (`trtllm_glm.kda.kernels` runs CPU tensors through an interpreted copy by itself).
In the mode the in-place decode runs the verify kernel's step (`kernels.kda_decode_inplace`) wherever verify
runs the Triton kernel, with one launch shape for every batch size. Checked bit for bit (int32 views):

* a row's decode output and new state are the same alone (M = 1) and at any position of a batch of 3 or 8;
* ``W`` verify rows then a commit of ``a`` equal ``W`` decode steps: every verify output equals that step's
  decode output and the committed state the state after ``a`` steps (per sequence, mixed ``a``);
* the short-conv decode / verify / commit kernels likewise (``q, k, v`` and the conv window);
* through the KDA layer (conv, gates and recurrence, kernels forced as CUDA runs them, no gradient as in serving):
  ``W`` verify rows then a commit equal ``W`` decode steps (mixer outputs, recurrent and conv states).

Inputs are fresh seeded random FP32 values (the interpreter's bf16 arithmetic is not IEEE); outputs are
poisoned with NaN first and state slots outside the batch hold NaN that must stay untouched. Geometry is small
but adversarial: ``K``, ``V`` not powers of two, a partial last value block, slots out of order.
"""

from __future__ import annotations

import pytest
import torch

from trtllm_glm.config import Glm5NextConfig
from trtllm_glm.kda import KdaBatch, KimiDeltaAttention
from trtllm_glm.kda import kernels as KK
from trtllm_glm.kda.contract import L2NORM_EPS
from trtllm_glm.kda.ops import kda_gate, l2_normalize
from trtllm_glm.kda.ops import verify as R
from trtllm_glm.kda.ops.backend import kda_decode_inplace
from trtllm_glm.numerics import batch_invariant_mode
from trtllm_glm.state import KdaLayerState

pytest.importorskip("triton")

pytestmark = [
    pytest.mark.cpu_only,
    pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0 to a scalar:DeprecationWarning"),
]

H, K, V = 2, 24, 40  # masked K lanes; V = 40 is two value blocks of 32, the second partial
SCALE = K**-0.5
POOL = 12


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


def _rows(gen: torch.Generator, n: int, *lead: int) -> tuple[torch.Tensor, ...]:
    """``q, k, v, g, beta`` for ``[*lead]`` rows of ``n`` sequences (FP32, q / k normalised, real gates)."""

    def r(*s: int) -> torch.Tensor:
        return torch.randn(n, *lead, *s, generator=gen)

    A_log = torch.empty(H).uniform_(1.0, 16.0, generator=gen).log()
    g = kda_gate(r(H, K) * 2.0, A_log, torch.randn(H * K, generator=gen) * 0.1, -5.0)
    return l2_normalize(r(H, K)), l2_normalize(r(H, K)), r(H, V), g, torch.sigmoid(r(H))


def _pool(gen: torch.Generator, slots: list[int]) -> torch.Tensor:
    """``[POOL, H, K, V]`` state pool: random states at ``slots``, NaN everywhere else (must not be touched)."""
    pool = torch.full((POOL, H, K, V), float("nan"))
    pool[slots] = 0.5 * torch.randn(len(slots), H, K, V, generator=gen)
    return pool


def _decode(pool: torch.Tensor, slots: list[int], q, k, v, g, beta) -> torch.Tensor:
    """One mode decode step through the op (poisoned output buffer checked to be fully written)."""
    out = torch.full((len(slots), H, V), float("nan"))
    o = KK.kernel_module("verify", "cpu").kda_decode_inplace(
        q, k, v, g, beta, SCALE, pool, torch.tensor(slots), out=out
    )
    assert o is out and not o.isnan().any()
    return o


def test_decode_row_same_bits_alone_and_in_any_batch() -> None:
    gen = torch.Generator().manual_seed(310)
    target = _rows(gen, 1)
    target_state = 0.5 * torch.randn(H, K, V, generator=gen)
    with batch_invariant_mode(True):
        pool = torch.full((POOL, H, K, V), float("nan"))
        pool[7] = target_state
        o_alone = _decode(pool, [7], *target)
        s_alone = pool[7].clone()
        for M, at in ((3, 1), (8, 7), (8, 0)):
            others = _rows(gen, M - 1)
            inputs = [torch.cat([o[:at], t, o[at:]]) for t, o in zip(target, others)]
            slots = [s for s in (2, 9, 4, 11, 0, 5, 1, 10) if s != 7][: M - 1]
            slots.insert(at, 7)
            pool = _pool(gen, slots)
            pool[7] = target_state
            o = _decode(pool, slots, *inputs)
            assert torch.equal(_bits(o[at]), _bits(o_alone[0])), f"M={M}: the row's output changed"
            assert torch.equal(_bits(pool[7]), _bits(s_alone)), f"M={M}: the row's new state changed"
            untouched = [s for s in range(POOL) if s not in slots]
            assert pool[untouched].isnan().all()


@pytest.mark.parametrize("W", [1, 4])
def test_verify_then_commit_equals_decode_steps(W: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Ops level (`ops.verify` forced to the kernel, as CUDA runs it): verify rows == decode steps, bitwise."""
    monkeypatch.setenv("TRTLLM_GLM_KDA_VERIFY", "triton")
    gen = torch.Generator().manual_seed(311 + W)
    slots = [5, 0, 9]
    n = len(slots)
    q, k, v, g, beta = _rows(gen, n, W)
    pool = _pool(gen, slots)
    accepted = [W, min(2, W), 0]
    with batch_invariant_mode(True):
        o_ver, rec = R.kda_verify(q, k, v, g, beta, SCALE, pool, state_slots=torch.tensor(slots))
        committed = pool.clone()
        R.kda_commit(committed, rec, torch.tensor(accepted), state_slots=torch.tensor(slots))
        steps = pool.clone()
        after = {}
        for t in range(W + 1):
            for j, a in enumerate(accepted):
                if a == t:
                    after[j] = steps[slots[j]].clone()
            if t == W:
                break
            o_t = kda_decode_inplace(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], SCALE, steps, torch.tensor(slots))
            assert torch.equal(_bits(o_ver[:, t]), _bits(o_t)), f"verify row {t} differs from decode step {t}"
    for j, s in enumerate(slots):
        assert torch.equal(_bits(committed[s]), _bits(after[j])), f"seq {j}: commit of {accepted[j]} rows differs"
    untouched = [s for s in range(POOL) if s not in slots]
    assert committed[untouched].isnan().all() and steps[untouched].isnan().all()


def test_conv_verify_rows_equal_decode_steps_and_commit_window() -> None:
    """The short conv: verify rows' ``q, k, v`` == decode steps' bitwise; the committed window == the steps'."""
    gen = torch.Generator().manual_seed(320)
    Hc, Kc, Vc, Wconv, W = 2, 12, 20, 4, 3
    C = Hc * (2 * Kc + Vc)
    slots = [3, 0]
    n = len(slots)
    conv = KK.kernel_module("conv", "cpu")
    weight = torch.randn(C, Wconv, generator=gen)
    x = torch.randn(n * W, C, generator=gen)
    state = torch.full((6, C, Wconv - 1), float("nan"))
    state[slots] = torch.randn(n, C, Wconv - 1, generator=gen)
    st = torch.tensor(slots)
    with batch_invariant_mode(True):
        qv, kv, vv = conv.conv_verify_qkv(x, state, weight, st, Hc, Kc, Vc, W)
        committed = state.clone()
        accepted = torch.tensor([W, 1])
        conv.conv_commit_slots(committed, x, st, accepted, W)
        steps = state.clone()
        windows = {}
        for t in range(W):
            q, k, v = conv.conv_decode(x[t::W].contiguous(), steps, weight, st, Hc, Kc, Vc, L2NORM_EPS)
            for name, a, b in (("q", qv[:, t], q), ("k", kv[:, t], k), ("v", vv[:, t], v)):
                assert torch.equal(_bits(a), _bits(b)), f"conv verify row {t} {name} differs from decode"
            windows[t + 1] = steps.clone()
    for j, s in enumerate(slots):
        assert torch.equal(_bits(committed[s]), _bits(windows[int(accepted[j])][s]))


def test_conv_and_gate_rows_same_alone_and_in_batch() -> None:
    """The conv decode / verify and the gate kernels: one program per row, a launch shape from shapes alone."""
    gen = torch.Generator().manual_seed(321)
    Hc, Kc, Vc, Wconv, W = 2, 12, 20, 4, 3
    C = Hc * (2 * Kc + Vc)
    conv, gate = KK.kernel_module("conv", "cpu"), KK.kernel_module("gate", "cpu")
    weight = torch.randn(C, Wconv, generator=gen)
    window = torch.randn(C, Wconv - 1, generator=gen)
    x_t = torch.randn(W, C, generator=gen)
    g_t, b_t = torch.randn(1, Hc * Kc, generator=gen), torch.randn(1, Hc, generator=gen)
    A_log, dt_bias = torch.randn(Hc, generator=gen), torch.randn(Hc * Kc, generator=gen)

    def run(M: int, at: int) -> tuple[torch.Tensor, ...]:
        x = torch.randn(M * W, C, generator=gen)
        x[at * W : (at + 1) * W] = x_t
        state = torch.randn(M + 2, C, Wconv - 1, generator=gen)
        slots = torch.randperm(M + 2, generator=gen)[:M]
        state[slots[at]] = window
        with batch_invariant_mode(True):
            qv, kv, vv = conv.conv_verify_qkv(x, state, weight, slots, Hc, Kc, Vc, W)
            qd, kd, vd = conv.conv_decode(x[::W].contiguous(), state, weight, slots, Hc, Kc, Vc, L2NORM_EPS)
            gr, br = torch.randn(M, Hc * Kc, generator=gen), torch.randn(M, Hc, generator=gen)
            gr[at], br[at] = g_t[0], b_t[0]
            g, beta = gate.kda_gate_beta(gr, br, A_log, dt_bias, -5.0)
        return qv[at], kv[at], vv[at], qd[at], kd[at], vd[at], state[slots[at]], g[at], beta[at]

    alone = run(1, 0)
    for M, at in ((3, 2), (8, 4)):
        for i, (a, b) in enumerate(zip(run(M, at), alone)):
            assert torch.equal(_bits(a), _bits(b)), f"M={M}: output {i} of the row changed"


@pytest.mark.parametrize("M", [1, 3])
def test_layer_verify_commit_equals_decode_steps(M: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The layer's verify then commit against its decode steps, bitwise, with the conv and verify kernels forced (as
    CUDA runs them under no_grad; with a gradient `auto` takes the torch references, which no serving path does).
    Without the mode the decode kernel's rounding differs from the verify step's (this test fails then)."""
    monkeypatch.setenv("TRTLLM_GLM_KDA_VERIFY", "triton")
    monkeypatch.setenv("TRTLLM_GLM_KDA_CONV_BACKEND", "triton")
    cfg = Glm5NextConfig(hidden_size=64, kda_num_heads=H, kda_head_dim=16, kda_gate_low_rank=16)
    layer = KimiDeltaAttention(cfg, kda_idx=0)
    layer.reset_parameters(torch.Generator().manual_seed(0), std=0.1)
    kd = cfg.kda_head_dim
    gen = torch.Generator().manual_seed(920 + M)
    W, S = 4, M + 2
    slots = torch.randperm(S, generator=gen)[:M].tolist()
    past = torch.randint(5, 400, (M,), generator=gen).tolist()
    rec0 = torch.full((S, H, kd, kd), float("nan"))
    rec0[slots] = 0.5 * torch.randn(M, H, kd, kd, generator=gen)
    conv0 = torch.full((S, layer.conv_dim, 3), float("nan"))
    conv0[slots] = torch.randn(M, layer.conv_dim, 3, generator=gen)
    hidden = torch.randn(M * W, 64, generator=gen)
    a = torch.randint(0, W + 1, (M,), generator=gen).tolist()
    with batch_invariant_mode(True), torch.no_grad():
        inputs = layer._inputs(hidden)
        st_v = KdaLayerState(recurrent=rec0.clone(), conv=conv0.clone())
        o_v, records = layer._verify_o(hidden, KdaBatch.build([W] * M, past, slots), st_v, inputs)
        records.commit(a, st_v)
        st_d = KdaLayerState(recurrent=rec0.clone(), conv=conv0.clone())
        exp_rec, exp_conv = rec0.clone(), conv0.clone()
        for t in range(W):
            step = tuple(x[t::W] for x in inputs[:3]) + (None,)
            o_t = layer._forward_o(hidden[t::W], KdaBatch.build([1] * M, [p + t for p in past], slots), st_d, step)
            assert torch.equal(_bits(o_v[t::W]), _bits(o_t)), f"M={M}: verify row {t} differs from decode step {t}"
            for j, s in enumerate(slots):
                if a[j] == t + 1:
                    exp_rec[s], exp_conv[s] = st_d.recurrent[s], st_d.conv[s]
    assert torch.equal(_bits(st_v.recurrent), _bits(exp_rec)), f"M={M}: committed recurrent states differ"
    assert torch.equal(_bits(st_v.conv), _bits(exp_conv)), f"M={M}: committed conv windows differ"
