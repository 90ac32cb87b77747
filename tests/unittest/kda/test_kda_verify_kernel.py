"""Triton KDA verify / commit kernels against the torch reference (`kda.ops.verify`), on the CPU interpreter.

Like the glm_kpool kernel tests this module does not set ``TRITON_INTERPRET``: `trtllm_glm.kda.kernels`
runs CPU tensors through an interpreted copy of its kernels by itself. The interpreter's bf16 arithmetic is
not IEEE, so numerics are checked in FP32 and FP16 (the kernels upcast right after loading).

Inputs are fresh seeded random values; verify outputs are poisoned with NaN first (``out=``), so an element
left unwritten shows; state slots outside the batch and fresh sequences' slots hold NaN / sentinel values
that must neither leak in nor be overwritten. Geometry is tiny but adversarial: several value blocks per
head, non-power-of-two ``K``/``V`` (masked lanes), strided views like the layer's split of the conv output.
"""

from __future__ import annotations

import pytest
import torch

from trtllm_glm.kda import kernels as KK
from trtllm_glm.kda.ops import kda_gate, l2_normalize, recurrent_kda_step
from trtllm_glm.kda.ops import verify as R

pytest.importorskip("triton")

pytestmark = [
    pytest.mark.cpu_only,
    # The interpreter passes scalars as 1-element arrays; a run-time loop bound converts one with int(),
    # which numpy >= 1.25 flags as deprecated. Harmless here (numpy is pinned below 2.4).
    pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0 to a scalar:DeprecationWarning"),
]

TOL = {"atol": 2e-6, "rtol": 2e-6}


def _inputs(seed: int, N: int, W: int, H: int, K: int, V: int, *, strided: bool = False):
    """Delta-rule inputs ``q, k, v, g, beta`` (FP32) and a random committed state ``[N, H, K, V]``.

    ``strided``: q/k/v are views of one ``[N, W, H*(2K+V)]`` conv output (as the layer's `_split` makes
    them, before its L2 norm copies q/k) and g a transposed-storage view, so every stride differs from
    the contiguous one.
    """
    gen = torch.Generator().manual_seed(seed)

    def r(*s: int) -> torch.Tensor:
        return torch.randn(*s, generator=gen)

    if strided:
        y = r(N, W, H * (2 * K + V))
        q, k, v = y.split([H * K, H * K, H * V], dim=-1)
        q, k, v = q.reshape(N, W, H, K), k.reshape(N, W, H, K), v.reshape(N, W, H, V)
        q = q / q.norm(dim=-1, keepdim=True)  # still a fresh tensor; k stays a strided view, normalised below
        k.div_(k.norm(dim=-1, keepdim=True))
    else:
        q, k, v = l2_normalize(r(N, W, H, K)), l2_normalize(r(N, W, H, K)), r(N, W, H, V)
    A_log = torch.empty(H).uniform_(1.0, 16.0, generator=gen).log()
    g = kda_gate(r(N, W, H, K) * 2.0, A_log, r(H * K) * 0.1, -5.0)
    if strided:
        g = g.transpose(1, 2).contiguous().transpose(1, 2)  # [N, W, H, K] view of [N, H, W, K] storage
    beta = torch.sigmoid(r(N, W, H))
    state = 0.5 * r(N, H, K, V)
    return q, k, v, g, beta, state


def _poisoned_out(N: int, W: int, H: int, V: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.full((N, W, H, V), float("nan")), torch.full((N, W, H, V), float("nan"))


def _bits(t: torch.Tensor) -> torch.Tensor:
    """Bit pattern, so that NaN sentinels compare equal to themselves."""
    return t.view(torch.int32)


# ------------------------------------------------------------------------------------------------
# Verify
@pytest.mark.parametrize(
    ("W", "H", "K", "V", "block_v", "strided"),
    [
        (1, 2, 16, 16, 8, False),
        (3, 2, 16, 16, 8, True),
        (8, 1, 16, 16, 16, False),
        (5, 2, 12, 20, 8, True),  # masked lanes in K and a partial last value block
    ],
)
def test_verify_matches_reference(W: int, H: int, K: int, V: int, block_v: int, strided: bool) -> None:
    N = 3
    q, k, v, g, beta, state = _inputs(10 + W, N, W, H, K, V, strided=strided)
    before = state.clone()
    out = _poisoned_out(N, W, H, V)
    o, rec = KK.kernel_module("verify", "cpu").kda_verify(q, k, v, g, beta, K**-0.5, state, out=out, block_v=block_v)
    assert o is out[0] and rec.u is out[1]
    assert torch.equal(_bits(state), _bits(before))  # the committed state is only read
    o_ref, rec_ref = R.kda_verify(q, k, v, g, beta, K**-0.5, state, backend="torch")
    torch.testing.assert_close(o, o_ref, **TOL)
    torch.testing.assert_close(rec.u, rec_ref.u, **TOL)
    # Records g/k are the FP32 inputs themselves (no copy), with the reference's values.
    assert rec.g is g and rec.k is k
    assert torch.equal(rec.g, rec_ref.g) and torch.equal(rec.k, rec_ref.k)
    assert rec.width == W


def test_verify_fp16_inputs_and_unbatched() -> None:
    W, H, K, V = 4, 2, 16, 16
    q, k, v, g, beta, state = _inputs(3, 2, W, H, K, V)
    q, k, v, g, beta = (t.half() for t in (q, k, v, g, beta))
    o, rec = R.kda_verify(q, k, v, g, beta, K**-0.5, state, backend="triton")
    o_ref, rec_ref = R.kda_verify(q, k, v, g, beta, K**-0.5, state, backend="torch")
    torch.testing.assert_close(o, o_ref, **TOL)
    torch.testing.assert_close(rec.u, rec_ref.u, **TOL)
    # Non-FP32 inputs are upcast once so the records keep their FP32 contract.
    assert rec.g.dtype == rec.k.dtype == torch.float32 and torch.equal(rec.g, rec_ref.g)
    # One unbatched sequence: [W, H, *] inputs and a [H, K, V] state.
    o1, rec1 = R.kda_verify(q[1], k[1], v[1], g[1], beta[1], K**-0.5, state[1], backend="triton")
    assert o1.shape == (W, H, V) and rec1.u.shape == (1, W, H, V)
    torch.testing.assert_close(o1, o_ref[1], **TOL)


def test_verify_bf16_inputs_load() -> None:
    """bf16 loads and their upcast (the interpreter's bf16 arithmetic is never used)."""
    W, H, K, V = 2, 1, 16, 16
    q, k, v, g, beta, state = _inputs(4, 2, W, H, K, V)
    q, k, v, g, beta = (t.bfloat16() for t in (q, k, v, g, beta))
    o, rec = R.kda_verify(q, k, v, g, beta, K**-0.5, state, backend="triton")
    o_ref, rec_ref = R.kda_verify(q, k, v, g, beta, K**-0.5, state, backend="torch")
    torch.testing.assert_close(o, o_ref, **TOL)
    torch.testing.assert_close(rec.u, rec_ref.u, **TOL)


def test_verify_slots_and_fresh() -> None:
    """Slot-indexed verify: the pool is only read, fresh slots (NaN here) are never read."""
    N, W, H, K, V = 3, 3, 2, 16, 16
    q, k, v, g, beta, state = _inputs(5, N, W, H, K, V)
    pool = torch.full((7, H, K, V), float("nan"))
    slots = torch.tensor([5, 0, 3])
    fresh = torch.tensor([False, True, False])
    pool[5], pool[3] = state[0], state[2]
    before = pool.clone()
    out = _poisoned_out(N, W, H, V)
    o, rec = KK.kda_verify(q, k, v, g, beta, K**-0.5, pool, state_slots=slots, fresh=fresh, out=out, block_v=8)
    assert torch.equal(_bits(pool), _bits(before))
    S0 = torch.stack([state[0], torch.zeros(H, K, V), state[2]])
    o_ref, rec_ref = R.kda_verify(q, k, v, g, beta, K**-0.5, S0, backend="torch")
    torch.testing.assert_close(o, o_ref, **TOL)
    torch.testing.assert_close(rec.u, rec_ref.u, **TOL)
    # The reference's slot path (gather + where) agrees with the explicit gather.
    o_ref2, _ = R.kda_verify(q, k, v, g, beta, K**-0.5, pool, state_slots=slots, fresh=fresh, backend="torch")
    assert torch.equal(o_ref2, o_ref)


def test_verify_widths_run_each_sequence_own_rows_only() -> None:
    """``widths``: each sequence's rows below its width have the bits of the unbounded run (the same steps), the rows
    past it are not written (the NaN poison stays), on a slot pool with a fresh sequence; a commit of the widths
    leaves the states the unbounded run's commit leaves (the padding rows' records are never read)."""
    N, W, H, K, V = 4, 5, 2, 12, 20
    q, k, v, g, beta, state = _inputs(21, N, W, H, K, V, strided=True)
    pool = torch.full((9, H, K, V), float("nan"))
    slots, fresh = torch.tensor([6, 1, 8, 3]), torch.tensor([False, False, True, False])
    for j, s in enumerate(slots.tolist()):
        if not fresh[j]:
            pool[s] = state[j]
    widths = torch.tensor([1, 5, 3, 1])
    full = _poisoned_out(N, W, H, V)
    o_all, rec_all = KK.kda_verify(q, k, v, g, beta, K**-0.5, pool, state_slots=slots, fresh=fresh, out=full, block_v=8)
    part = _poisoned_out(N, W, H, V)
    o, rec = KK.kda_verify(
        q, k, v, g, beta, K**-0.5, pool, state_slots=slots, fresh=fresh, widths=widths, out=part, block_v=8
    )
    for j, w in enumerate(widths.tolist()):
        assert torch.equal(_bits(o[j, :w]), _bits(o_all[j, :w])) and torch.equal(
            _bits(rec.u[j, :w]), _bits(rec_all.u[j, :w])
        )
        assert torch.isnan(o[j, w:]).all() and torch.isnan(rec.u[j, w:]).all()
    pool_all, pool_part = pool.clone(), pool.clone()
    KK.kda_commit(pool_all, rec_all, widths, state_slots=slots, fresh=fresh)
    KK.kda_commit(pool_part, rec, widths, state_slots=slots, fresh=fresh)
    assert torch.equal(_bits(pool_part), _bits(pool_all))
    with pytest.raises(ValueError, match="widths"):
        KK.kda_verify(q, k, v, g, beta, K**-0.5, pool, state_slots=slots, widths=widths[:2])


# ------------------------------------------------------------------------------------------------
# Commit
@pytest.mark.parametrize("W", [1, 4])
def test_commit_matches_reference_every_a(W: int) -> None:
    """Uniform a in 0..W and mixed a (host list and device tensor); a = 0 is bit-exact."""
    N, H, K, V = 3, 2, 16, 16
    q, k, v, g, beta, state = _inputs(20 + W, N, W, H, K, V)
    _, rec = R.kda_verify(q, k, v, g, beta, K**-0.5, state, backend="torch")
    mod = KK.kernel_module("verify", "cpu")
    cases: list[list[int]] = [[a] * N for a in range(W + 1)] + [[W, 0, min(1, W)]]
    for a in cases:
        for as_tensor in (False, True):
            got = state.clone()
            mod.kda_commit(got, rec, torch.tensor(a) if as_tensor else a, block_v=8)
            ref = state.clone()
            R.kda_commit(ref, rec, a, backend="torch")
            torch.testing.assert_close(got, ref, **TOL)
            for n in range(N):
                if a[n] == 0:
                    assert torch.equal(_bits(got[n]), _bits(state[n])), (a, n)


def test_commit_slots_fresh_and_untouched() -> None:
    """Slot-indexed commit: other slots keep their bits (NaN sentinels included), a = 0 is not stored,
    a fresh sequence's slot (NaN before) becomes its zero-started state, even at a = 0."""
    N, W, H, K, V = 4, 3, 2, 12, 20
    q, k, v, g, beta, state = _inputs(30, N, W, H, K, V)
    fresh = torch.tensor([False, True, False, True])
    S0 = torch.where(fresh.view(-1, 1, 1, 1), 0.0, state)
    _, rec = R.kda_verify(q, k, v, g, beta, K**-0.5, S0, backend="torch")
    pool = torch.full((9, H, K, V), float("nan"))
    pool[2] = 7.0
    slots = torch.tensor([6, 1, 4, 8])
    for n in (0, 2):
        pool[slots[n]] = state[n]
    a = torch.tensor([2, 0, 0, 3])
    got = pool.clone()
    KK.kda_commit(got, rec, a, state_slots=slots, fresh=fresh, block_v=8)
    ref = pool.clone()
    R.kda_commit(ref, rec, a, state_slots=slots, fresh=fresh, backend="torch")
    torch.testing.assert_close(got[slots], ref[slots], **TOL)
    assert torch.equal(got[1], torch.zeros(H, K, V))  # fresh, a = 0
    assert torch.equal(_bits(got[4]), _bits(pool[4]))  # a = 0: untouched
    others = torch.ones(9, dtype=torch.bool)
    others[slots] = False
    assert torch.equal(_bits(got[others]), _bits(pool[others]))


def test_commit_device_counts_clamped_and_single_int() -> None:
    """Counts beyond W (device tensor, never synchronised on) act as W; one int applies to all."""
    N, W, H, K, V = 2, 3, 1, 16, 16
    q, k, v, g, beta, state = _inputs(40, N, W, H, K, V)
    _, rec = R.kda_verify(q, k, v, g, beta, K**-0.5, state, backend="torch")
    got = state.clone()
    KK.kda_commit(got, rec, torch.tensor([W + 5, -1]))
    ref = state.clone()
    R.kda_commit(ref, rec, [W, 0], backend="torch")
    torch.testing.assert_close(got, ref, **TOL)
    assert torch.equal(_bits(got[1]), _bits(state[1]))
    got = state.clone()
    KK.kda_commit(got, rec, 2)
    ref = state.clone()
    R.kda_commit(ref, rec, 2, backend="torch")
    torch.testing.assert_close(got, ref, **TOL)
    with pytest.raises(ValueError):
        KK.kda_commit(state.clone(), rec, [W + 1, 0])  # host counts are range-checked like the reference


def test_kernel_verify_commit_chain_equals_steps() -> None:
    """Kernel verify then kernel commit (a = W, unbatched) equals W decode steps of the reference."""
    W, H, K, V = 3, 2, 16, 16
    q, k, v, g, beta, state = _inputs(50, 1, W, H, K, V)
    q, k, v, g, beta, state = (t[0] for t in (q, k, v, g, beta, state))
    o, rec = R.kda_verify(q, k, v, g, beta, K**-0.5, state, backend="triton")
    st = state.clone()
    R.kda_commit(st, rec, W, backend="triton")
    S = state.unsqueeze(0)
    for t in range(W):
        o_t, S = recurrent_kda_step(q[t : t + 1], k[t : t + 1], v[t : t + 1], g[t : t + 1], beta[t : t + 1], K**-0.5, S)
        torch.testing.assert_close(o[t : t + 1], o_t, **TOL)
    torch.testing.assert_close(st, S[0], **TOL)


# ------------------------------------------------------------------------------------------------
# Dispatch
def test_dispatch_env_and_argument(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu = torch.device("cpu")
    monkeypatch.delenv("TRTLLM_GLM_KDA_VERIFY", raising=False)
    monkeypatch.delenv("TRTLLM_GLM_KDA_BACKEND", raising=False)
    assert R.resolve_verify_backend(cpu) == "torch"  # CPU keeps the reference by default
    assert R.resolve_verify_backend(cpu, "triton") == "triton"
    assert R.resolve_verify_backend(torch.device("cuda"), "auto") == "triton"
    monkeypatch.setenv("TRTLLM_GLM_KDA_BACKEND", "torch")
    assert R.resolve_verify_backend(torch.device("cuda")) == "torch"
    monkeypatch.setenv("TRTLLM_GLM_KDA_VERIFY", "triton")
    assert R.resolve_verify_backend(cpu) == "triton"  # the specific switch wins
    monkeypatch.setenv("TRTLLM_GLM_KDA_VERIFY", "fla")
    with pytest.raises(ValueError):
        R.resolve_verify_backend(cpu)
    # The env switch reaches the public functions: records of a forced-kernel verify alias the inputs.
    monkeypatch.setenv("TRTLLM_GLM_KDA_VERIFY", "triton")
    q, k, v, g, beta, state = _inputs(60, 1, 1, 1, 16, 16)
    _, rec = R.kda_verify(q, k, v, g, beta, 0.25, state)
    assert rec.g is g
    monkeypatch.setenv("TRTLLM_GLM_KDA_VERIFY", "torch")
    _, rec = R.kda_verify(q, k, v, g, beta, 0.25, state)
    assert rec.g is not g
