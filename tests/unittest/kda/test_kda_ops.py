"""KDA ops: gate, recurrence, chunked prefill, short convolution, verify/commit records (CPU, FP32)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from trtllm_glm.kda.ops import (
    causal_conv1d_ref,
    causal_conv1d_update,
    chunk_kda,
    conv_commit,
    conv_verify,
    kda_commit,
    kda_decode,
    kda_decode_inplace,
    kda_gate,
    kda_prefill,
    kda_verify,
    l2_normalize,
    recurrent_kda,
    recurrent_kda_step,
    resolve_backend,
)

pytestmark = pytest.mark.cpu_only

LB = -5.0


def _inputs(gen: torch.Generator, T: int, H: int = 3, K: int = 16, V: int = 24, lead: tuple[int, ...] = ()):
    """Random KDA inputs with realistic ranges: unit q/k, safe-gate decay, beta in (0, 1)."""

    def r(*s: int) -> torch.Tensor:
        return torch.randn(*lead, *s, generator=gen)

    q = l2_normalize(r(T, H, K))
    k = l2_normalize(r(T, H, K))
    v = r(T, H, V)
    A_log = torch.empty(H).uniform_(1.0, 16.0, generator=gen).log()
    g = kda_gate(r(T, H, K) * 2.0, A_log, torch.randn(H * K, generator=gen) * 0.1, LB)
    beta = torch.sigmoid(r(T, H))
    return q, k, v, g, beta


def _close(a: torch.Tensor, b: torch.Tensor, atol: float = 2e-5, rtol: float = 1e-5) -> None:
    torch.testing.assert_close(a, b, atol=atol, rtol=rtol)


# --------------------------------------------------------------------------------------------------
# Gate
def test_gate_formula_and_range() -> None:
    gen = torch.Generator().manual_seed(1)
    H, K = 4, 8
    g_raw = torch.randn(10, H, K, generator=gen) * 5
    A_log = torch.randn(H, generator=gen)
    dt_bias = torch.randn(H * K, generator=gen)
    g = kda_gate(g_raw, A_log, dt_bias, LB)
    ref = torch.empty_like(g)
    for h in range(H):
        ref[:, h] = LB / (1 + torch.exp(-math.exp(A_log[h].item()) * (g_raw[:, h] + dt_bias[h * K : (h + 1) * K])))
    _close(g, ref, atol=1e-6, rtol=1e-6)
    assert g.dtype == torch.float32
    assert bool((g <= 0).all()) and bool((g >= LB).all())


def test_l2_normalize_unit_norm() -> None:
    x = torch.randn(5, 3, 16, generator=torch.Generator().manual_seed(2))
    _close(l2_normalize(x).norm(dim=-1), torch.ones(5, 3), atol=1e-5, rtol=0)


# --------------------------------------------------------------------------------------------------
# Recurrence and chunked prefill
def test_recurrent_step_matches_loop() -> None:
    gen = torch.Generator().manual_seed(3)
    T, H, K, V = 6, 2, 16, 16
    q, k, v, g, beta = _inputs(gen, T, H, K, V)
    S0 = torch.randn(1, H, K, V, generator=gen)
    o_ref, S_ref = recurrent_kda(q, k, v, g, beta, K**-0.5, S0)
    S = S0.clone()
    for t in range(T):
        o_t, S = recurrent_kda_step(q[t : t + 1], k[t : t + 1], v[t : t + 1], g[t : t + 1], beta[t : t + 1], K**-0.5, S)
        assert torch.equal(o_t[0], o_ref[t])
    assert torch.equal(S, S_ref)


def test_recurrent_delta_rule_by_hand() -> None:
    """One head, one token, written out with explicit loops (guards the state orientation [K, V])."""
    gen = torch.Generator().manual_seed(4)
    K, V = 4, 3
    q, k, v, g, beta = _inputs(gen, 1, 1, K, V)
    S = torch.randn(1, 1, K, V, generator=gen)
    o, S1 = recurrent_kda_step(q[:1], k[:1], v[:1], g[:1], beta[:1], 0.7, S)
    Sd = [[S[0, 0, i, j].item() * math.exp(g[0, 0, i].item()) for j in range(V)] for i in range(K)]
    kS = [sum(k[0, 0, i].item() * Sd[i][j] for i in range(K)) for j in range(V)]
    u = [beta[0, 0].item() * (v[0, 0, j].item() - kS[j]) for j in range(V)]
    Sn = [[Sd[i][j] + k[0, 0, i].item() * u[j] for j in range(V)] for i in range(K)]
    on = [sum(0.7 * q[0, 0, i].item() * Sn[i][j] for i in range(K)) for j in range(V)]
    _close(S1[0, 0], torch.tensor(Sn), atol=1e-5, rtol=1e-5)
    _close(o[0, 0], torch.tensor(on), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("chunk_size", [16, 64, 7])
@pytest.mark.parametrize("T", [1, 5, 16, 17, 63, 64, 65, 130])
def test_chunk_equals_recurrence(T: int, chunk_size: int) -> None:
    gen = torch.Generator().manual_seed(100 + T)
    H, K, V = 3, 16, 24
    q, k, v, g, beta = _inputs(gen, T, H, K, V)
    S0 = torch.randn(1, H, K, V, generator=gen)
    o_ref, S_ref = recurrent_kda(q, k, v, g, beta, K**-0.5, S0)
    o, S = chunk_kda(q, k, v, g, beta, K**-0.5, S0, chunk_size=chunk_size)
    _close(o, o_ref)
    _close(S, S_ref)


def test_chunk_varlen_equals_per_sequence() -> None:
    gen = torch.Generator().manual_seed(5)
    H, K, V = 2, 16, 16
    lens = [9, 0, 33, 1, 20]
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    q, k, v, g, beta = _inputs(gen, cu[-1], H, K, V)
    S0 = torch.randn(len(lens), H, K, V, generator=gen)
    o, S = chunk_kda(q, k, v, g, beta, K**-0.5, S0, cu_seqlens=torch.tensor(cu), chunk_size=16)
    o_r, S_r = recurrent_kda(q, k, v, g, beta, K**-0.5, S0, cu_seqlens=cu)
    _close(o, o_r)
    _close(S, S_r)
    for n in range(len(lens)):
        sl = slice(cu[n], cu[n + 1])
        o1, S1 = chunk_kda(q[sl], k[sl], v[sl], g[sl], beta[sl], K**-0.5, S0[n : n + 1], chunk_size=16)
        _close(o[sl], o1)
        _close(S[n], S1[0])
    assert torch.equal(S[1], S0[1])  # empty sequence keeps its state


def test_chunk_strong_decay_is_finite() -> None:
    """Gates at the lower bound over long chunks must not overflow (cumulative decay down to -320)."""
    gen = torch.Generator().manual_seed(6)
    T, H, K, V = 70, 2, 16, 16
    q, k, v, _, beta = _inputs(gen, T, H, K, V)
    g = torch.full((T, H, K), LB)
    g[::3] = -1e-4
    S0 = torch.randn(1, H, K, V, generator=gen)
    o, S = chunk_kda(q, k, v, g, beta, K**-0.5, S0, chunk_size=64)
    o_r, S_r = recurrent_kda(q, k, v, g, beta, K**-0.5, S0)
    assert bool(torch.isfinite(o).all()) and bool(torch.isfinite(S).all())
    _close(o, o_r)
    _close(S, S_r)


def test_inputs_not_modified() -> None:
    gen = torch.Generator().manual_seed(7)
    q, k, v, g, beta = _inputs(gen, 20, 2, 16, 16)
    S0 = torch.randn(1, 2, 16, 16, generator=gen)
    S0c = S0.clone()
    chunk_kda(q, k, v, g, beta, 0.25, S0, chunk_size=8)
    recurrent_kda(q, k, v, g, beta, 0.25, S0)
    recurrent_kda_step(q[:1], k[:1], v[:1], g[:1], beta[:1], 0.25, S0)
    assert torch.equal(S0, S0c)


def test_fla_naive_agrees() -> None:
    naive = pytest.importorskip("fla.ops.kda.naive")
    gen = torch.Generator().manual_seed(8)
    T, H, K, V = 48, 2, 16, 32
    q, k, v, g, beta = _inputs(gen, T, H, K, V)
    S0 = torch.randn(1, H, K, V, generator=gen)
    o_ref, S_ref = recurrent_kda(q, k, v, g, beta, K**-0.5, S0)
    o_f, S_f = naive.naive_recurrent_kda(q[None], k[None], v[None], g[None], beta[None], K**-0.5, S0, True)
    _close(o_f[0], o_ref)
    _close(S_f, S_ref)
    o_c, S_c = naive.naive_chunk_kda(q[None], k[None], v[None], g[None], beta[None], K**-0.5, S0, True, chunk_size=16)
    o, S = chunk_kda(q, k, v, g, beta, K**-0.5, S0, chunk_size=16)
    _close(o_c[0], o, atol=1e-4, rtol=1e-4)
    _close(S_c, S, atol=1e-4, rtol=1e-4)


def test_backend_dispatch_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu = torch.device("cpu")
    assert resolve_backend(cpu) == "torch"
    assert resolve_backend(cpu, "auto") == "torch"
    with pytest.raises(RuntimeError):
        resolve_backend(cpu, "fla")
    with pytest.raises(ValueError):
        resolve_backend(cpu, "triton")
    monkeypatch.setenv("TRTLLM_GLM_KDA_BACKEND", "torch")
    assert resolve_backend(cpu) == "torch"
    gen = torch.Generator().manual_seed(9)
    q, k, v, g, beta = _inputs(gen, 12, 2, 16, 16)
    S0 = torch.randn(2, 2, 16, 16, generator=gen)
    o, S = kda_prefill(q, k, v, g, beta, 0.25, S0, [0, 5, 12], lower_bound=LB)
    o_r, S_r = recurrent_kda(q, k, v, g, beta, 0.25, S0, cu_seqlens=[0, 5, 12])
    _close(o, o_r)
    _close(S, S_r)
    od, Sd = kda_decode(q[:2], k[:2], v[:2], g[:2], beta[:2], 0.25, S0)
    od_r, Sd_r = recurrent_kda_step(q[:2], k[:2], v[:2], g[:2], beta[:2], 0.25, S0)
    assert torch.equal(od, od_r) and torch.equal(Sd, Sd_r)
    pool = torch.randn(5, 2, 16, 16, generator=gen)
    pool[3], pool[0] = S0[0], S0[1]
    before = pool.clone()
    oi = kda_decode_inplace(q[:2], k[:2], v[:2], g[:2], beta[:2], 0.25, pool, torch.tensor([3, 0]))
    assert torch.equal(oi, od_r) and torch.equal(pool[3], Sd_r[0]) and torch.equal(pool[0], Sd_r[1])
    for s in (1, 2, 4):
        assert torch.equal(pool[s], before[s])


def test_cuda_without_fla_warns_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """On CUDA a missing fla-core silently cost ~40x in KDA prefill (the torch reference): one warning per process
    says so; an explicit ``torch`` choice and the CPU stay silent."""
    import warnings

    from trtllm_glm.kda.ops import backend as B

    monkeypatch.setattr(B, "_fla_kda", lambda: None)
    B._warn_no_fla.cache_clear()
    monkeypatch.delenv("TRTLLM_GLM_KDA_BACKEND", raising=False)
    cuda = torch.device("cuda", 0)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert resolve_backend(torch.device("cpu")) == "torch"
        assert resolve_backend(cuda, "torch") == "torch"
        assert not seen
        assert resolve_backend(cuda) == "torch"
        assert resolve_backend(cuda, "auto") == "torch"
    assert len(seen) == 1 and issubclass(seen[0].category, RuntimeWarning)
    assert "fla-core is not importable" in str(seen[0].message)
    B._warn_no_fla.cache_clear()


# --------------------------------------------------------------------------------------------------
# Short convolution
def _conv_reference(hist: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
    """F.conv1d over history ++ x (depthwise), SiLU; hist [C, W-1], x [T, C] -> [T, C]."""
    xx = torch.cat([hist, x.T], dim=1).unsqueeze(0)  # [1, C, W-1+T]
    y = F.conv1d(xx, weight.unsqueeze(1), bias, groups=weight.shape[0])
    return F.silu(y[0].T)


@pytest.mark.parametrize("T", [1, 2, 3, 9])
def test_conv_matches_conv1d(T: int) -> None:
    gen = torch.Generator().manual_seed(10 + T)
    C, W = 12, 4
    x = torch.randn(T, C, generator=gen)
    hist = torch.randn(C, W - 1, generator=gen)
    weight = torch.randn(C, W, generator=gen)
    bias = torch.randn(C, generator=gen)
    y, new = causal_conv1d_ref(x, hist, weight, bias)
    _close(y, _conv_reference(hist, x, weight, bias), atol=1e-5, rtol=1e-5)
    xx = torch.cat([hist, x.T], dim=1)
    assert torch.equal(new, xx[:, -(W - 1) :])
    y0, new0 = causal_conv1d_ref(x, None, weight)
    _close(y0, _conv_reference(torch.zeros(C, W - 1), x, weight, None), atol=1e-5, rtol=1e-5)
    assert new0.shape == (C, W - 1)


def test_conv_split_and_update_equal_one_pass() -> None:
    gen = torch.Generator().manual_seed(11)
    T, C, W = 13, 10, 4
    x = torch.randn(T, C, generator=gen)
    weight = torch.randn(C, W, generator=gen)
    y_ref, st_ref = causal_conv1d_ref(x, None, weight)
    ys, st = [], None
    for s, e in [(0, 2), (2, 3), (3, 8)]:
        y, st = causal_conv1d_ref(x[s:e], st, weight)
        ys.append(y)
    assert st is not None
    st_b = st.unsqueeze(0)
    for t in range(8, T):
        y, st_b = causal_conv1d_update(x[t : t + 1], st_b, weight)
        ys.append(y)
    _close(torch.cat(ys), y_ref, atol=1e-6, rtol=1e-6)
    assert torch.equal(st_b[0], st_ref)


@pytest.mark.parametrize("Wv", [1, 2, 4, 6])
def test_conv_verify_commit_shift_exact(Wv: int) -> None:
    gen = torch.Generator().manual_seed(12 + Wv)
    N, C, W = 3, 8, 4
    state = torch.randn(N, C, W - 1, generator=gen)
    x = torch.randn(N, Wv, C, generator=gen)
    weight = torch.randn(C, W, generator=gen)
    before = state.clone()
    y = conv_verify(x, state, weight)
    assert torch.equal(state, before)
    # Verify outputs equal one-row-at-a-time updates.
    st = state.clone()
    for t in range(Wv):
        y_t, st = causal_conv1d_update(x[:, t], st, weight)
        _close(y[:, t], y_t, atol=1e-6, rtol=1e-6)
    # Commit a rows: the window ends at row a-1 (bit-exact data movement), for every a and mixed a.
    for a in range(0, Wv + 1):
        st = state.clone()
        conv_commit(st, x, [a] * N)
        for n in range(N):
            full = torch.cat([state[n], x[n].T], dim=1)
            assert torch.equal(st[n], full[:, a : a + W - 1])
    mixed = [Wv, 0, min(1, Wv)]
    st = state.clone()
    conv_commit(st, x, torch.tensor(mixed))
    for n in range(N):
        assert torch.equal(st[n], torch.cat([state[n], x[n].T], dim=1)[:, mixed[n] : mixed[n] + W - 1])
    # Unbatched form.
    st1 = state[0].clone()
    conv_commit(st1, x[0], 1)
    assert torch.equal(st1, torch.cat([state[0], x[0].T], dim=1)[:, 1:W])
    with pytest.raises(ValueError):
        conv_commit(state.clone(), x, [Wv + 1] * N)


# --------------------------------------------------------------------------------------------------
# Verify records / commit
@pytest.mark.parametrize("W", [1, 3, 6])
def test_verify_commit_equals_sequential_steps(W: int) -> None:
    gen = torch.Generator().manual_seed(20 + W)
    N, H, K, V = 3, 2, 16, 16
    q, k, v, g, beta = _inputs(gen, W, H, K, V, lead=(N,))
    state = torch.randn(N, H, K, V, generator=gen)
    before = state.clone()
    o, rec = kda_verify(q, k, v, g, beta, K**-0.5, state)
    assert torch.equal(state, before)
    assert rec.width == W and rec.u.shape == (N, W, H, V)
    seq_states = [state.clone()]
    S = state.clone()
    for t in range(W):
        o_t, S = recurrent_kda_step(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], K**-0.5, S)
        assert torch.equal(o[:, t], o_t)
        seq_states.append(S)
    for a in range(0, W + 1):
        st = state.clone()
        kda_commit(st, rec, [a] * N)
        # Same expression as the step: exact, not just close.
        assert torch.equal(st, seq_states[a]), a
    mixed = [W, 0, 1]
    st = state.clone()
    kda_commit(st, rec, torch.tensor(mixed))
    for n in range(N):
        assert torch.equal(st[n], seq_states[mixed[n]][n])


def test_verify_width_one_equals_decode_step() -> None:
    gen = torch.Generator().manual_seed(30)
    H, K, V = 2, 16, 16
    q, k, v, g, beta = _inputs(gen, 1, H, K, V)
    state = torch.randn(H, K, V, generator=gen)
    o, rec = kda_verify(q, k, v, g, beta, K**-0.5, state)  # unbatched: [W, H, ...] and [H, K, V]
    assert o.shape == (1, H, V)
    st = state.clone()
    kda_commit(st, rec, 1)
    o_d, S_d = recurrent_kda_step(q, k, v, g, beta, K**-0.5, state.unsqueeze(0))
    torch.testing.assert_close(o, o_d, atol=1e-6, rtol=0)
    torch.testing.assert_close(st, S_d[0], atol=1e-6, rtol=0)


def test_verify_then_chunk_continuation() -> None:
    """Commit of a rows, then a chunked prefill, equals one recurrence over both parts."""
    gen = torch.Generator().manual_seed(31)
    H, K, V, W, a, T2 = 2, 16, 16, 5, 3, 19
    q, k, v, g, beta = _inputs(gen, W + T2, H, K, V)
    S0 = torch.randn(1, H, K, V, generator=gen)
    _, rec = kda_verify(q[:W], k[:W], v[:W], g[:W], beta[:W], K**-0.5, S0[0])
    st = S0[0].clone()
    kda_commit(st, rec, a)
    sl = slice(W, W + T2)
    o2, S2 = chunk_kda(q[sl], k[sl], v[sl], g[sl], beta[sl], K**-0.5, st.unsqueeze(0), chunk_size=8)
    idx = torch.cat([torch.arange(a), torch.arange(W, W + T2)])
    o_r, S_r = recurrent_kda(q[idx], k[idx], v[idx], g[idx], beta[idx], K**-0.5, S0)
    _close(o2, o_r[a:])
    _close(S2, S_r)


def test_prefill_offsets_are_shared_per_layout() -> None:
    """`kda_prefill` hands fla the same offset tensors for the same layout (fla memoises its chunk indices by
    tensor identity: one host-built copy a step, not one a layer); another layout gets its own, with its values."""
    from trtllm_glm.kda.ops.backend import _offsets

    dev = torch.device("cpu")
    a = _offsets([0, 3, 9], dev)
    assert _offsets([0, 3, 9], dev)[0] is a[0] and _offsets([0, 3, 9], dev)[1] is a[1]
    b = _offsets([0, 4, 9], dev)
    assert b[0] is not a[0] and b[0].tolist() == [0, 4, 9] and b[1].tolist() == [0, 4, 9]
    for n in range(10):  # a bounded memo: old layouts are dropped
        _offsets([0, n + 20], dev)
    assert _offsets([0, 3, 9], dev)[0] is not a[0]
