"""The fused KDA decode conv kernel (`kda.kernels.conv_decode`) against its torch reference, on the CPU
interpreter (`trtllm_glm.kda.kernels` runs CPU tensors through an interpreted copy by itself).

Adversarial geometry: slots that are neither the row index nor contiguous, a pool larger than the batch
whose other slots hold NaN (they must stay untouched and never leak in), non-power-of-two head dims (masked
lanes), ``K != V``, rows taken from a wider tensor (a row stride other than ``C``) and fresh random values.
Outputs of the kernel are fresh allocations; the state pool is the in-place output, compared whole.
"""

from __future__ import annotations

import pytest
import torch

from trtllm_glm.kda import kernels as KK
from trtllm_glm.kda.ops import conv_decode, conv_decode_reference

pytest.importorskip("triton")

pytestmark = [
    pytest.mark.cpu_only,
    pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0 to a scalar:DeprecationWarning"),
]


def _case(seed: int, n: int, H: int, K: int, V: int, W: int, S: int, dtype: torch.dtype = torch.float32):
    g = torch.Generator().manual_seed(seed)
    C = H * (2 * K + V)
    wide = torch.randn(n, C + 5, generator=g) * 2
    x = wide[:, 3 : 3 + C]  # a row stride of C + 5
    state = torch.full((S, C, W - 1), float("nan"), dtype=dtype)
    slots = torch.randperm(S, generator=g)[:n]
    state[slots] = (torch.randn(n, C, W - 1, generator=g) * 2).to(dtype)
    weight = torch.randn(C, W, generator=g) / W**0.5
    return x, state, weight, slots


@pytest.mark.parametrize(
    ("n", "H", "K", "V", "W"), [(1, 2, 8, 8, 4), (5, 3, 6, 10, 4), (7, 2, 16, 12, 2), (3, 1, 5, 7, 3)]
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_conv_decode_kernel_matches_reference(n, H, K, V, W, dtype) -> None:
    x, state, weight, slots = _case(n * 100 + H * 10 + K, n, H, K, V, W, S=n + 4, dtype=dtype)
    ref_state = state.clone()
    q0, k0, v0 = conv_decode_reference(x, ref_state, weight, slots, H, K, V)
    q1, k1, v1 = KK.conv_decode(x, state, weight, slots, H, K, V, 1e-6)
    tol = {"atol": 2e-6, "rtol": 2e-6}
    torch.testing.assert_close(q1, q0, **tol)
    torch.testing.assert_close(k1, k0, **tol)
    torch.testing.assert_close(v1, v0, **tol)
    # Every slot: the batch's shifted windows (the new input last, in the state's dtype), the rest NaN untouched.
    torch.testing.assert_close(state, ref_state, equal_nan=True, atol=0, rtol=0)
    others = torch.ones(state.shape[0], dtype=torch.bool)
    others[slots] = False
    assert state[others].isnan().all()
    assert not state[slots].isnan().any()
    # q and k heads are unit vectors (up to eps).
    assert torch.allclose(q1.norm(dim=-1), torch.ones(n, H), atol=1e-4)


def test_conv_decode_dispatch_and_checks(monkeypatch) -> None:
    x, state, weight, slots = _case(1, 4, 2, 8, 8, 4, S=9)
    ref_state = state.clone()
    want = conv_decode_reference(x, ref_state, weight, slots, 2, 8, 8)
    monkeypatch.setenv("TRTLLM_GLM_KDA_CONV_BACKEND", "triton")
    got = conv_decode(x, state, weight, slots, 2, 8, 8)  # the interpreted kernel through the dispatch
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=2e-6, rtol=2e-6)
    with pytest.raises(ValueError, match="do not fit"):
        KK.conv_decode(x, state, weight, slots, 2, 8, 9, 1e-6)
    with pytest.raises(ValueError, match="unit last stride"):
        KK.conv_decode(x, state.transpose(1, 2).contiguous().transpose(1, 2), weight, slots, 2, 8, 8, 1e-6)
    monkeypatch.setenv("TRTLLM_GLM_KDA_CONV_BACKEND", "bogus")
    with pytest.raises(ValueError, match="backend must be one of"):
        conv_decode(x, state, weight, slots, 2, 8, 8)


def test_layer_decode_with_the_kernel_matches_the_reference(monkeypatch) -> None:
    """The KDA layer's decode rows (mixed with a prefill chunk, slots out of order) give the same outputs and
    state with the conv kernel as with the reference; slots outside the batch are left alone."""
    from trtllm_glm.config import Glm5NextConfig
    from trtllm_glm.kda import KdaBatch, KimiDeltaAttention
    from trtllm_glm.state import KdaLayerState

    cfg = Glm5NextConfig(hidden_size=32, kda_num_heads=2, kda_head_dim=16, kda_short_conv_kernel_size=4,
                         kda_gate_low_rank=8)  # fmt: skip
    layer = KimiDeltaAttention(cfg, kda_idx=0)
    layer.reset_parameters(torch.Generator().manual_seed(7), std=0.2)
    g = torch.Generator().manual_seed(8)
    H, K, V, W = layer.num_heads, layer.head_k_dim, layer.head_v_dim, layer.conv_size
    st = KdaLayerState(recurrent=torch.randn(9, H, K, V, generator=g), conv=torch.randn(9, layer.conv_dim, W - 1,
                                                                                        generator=g))  # fmt: skip
    hidden = torch.randn(6, 32, generator=g)
    batch = KdaBatch.build([1, 1, 1, 3], [5, 2, 9, 4], [7, 0, 4, 2])  # three decode rows, then a chunk
    outs, states = [], []
    for backend in ("torch", "triton"):
        monkeypatch.setenv("TRTLLM_GLM_KDA_CONV_BACKEND", backend)
        s = KdaLayerState(recurrent=st.recurrent.clone(), conv=st.conv.clone())
        outs.append(layer(hidden, batch, s))
        states.append(s)
    torch.testing.assert_close(outs[1], outs[0], atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(states[1].conv, states[0].conv, atol=0, rtol=0)
    torch.testing.assert_close(states[1].recurrent, states[0].recurrent, atol=2e-5, rtol=1e-4)
    untouched = [1, 3, 5, 6, 8]
    assert torch.equal(states[1].conv[untouched], st.conv[untouched])
    assert torch.equal(states[1].recurrent[untouched], st.recurrent[untouched])


# ------------------------------------------------------------------------------------------------------------------
# Speculative verify (`conv_verify_qkv`) and its commit (`conv_commit_slots`)


def _verify_case(
    seed: int,
    widths: list[int],
    H: int,
    K: int,
    V: int,
    W: int,
    S: int,
    *,
    ragged: bool,
    fresh: list[bool] | None = None,
    x_dtype: torch.dtype = torch.float32,
    state_dtype: torch.dtype = torch.float32,
):
    """A verify step of ``len(widths)`` sequences: flat rows ``x`` (a row stride other than ``C``; ragged: the
    sequences' rows in another order than their index, with gaps), a NaN pool larger than the batch whose
    batch slots (out of order) hold random windows, except fresh sequences' (left NaN: never read)."""
    g = torch.Generator().manual_seed(seed)
    n, Wm, C = len(widths), max(widths), H * (2 * K + V)
    if ragged:
        # Sequences laid out in reverse order, one unused row before each (rows nobody may read).
        row0, r = [0] * n, 0
        for j in reversed(range(n)):
            row0[j], r = r + 1, r + 1 + widths[j]
        N = r + 2
    else:
        assert all(w == Wm for w in widths)
        row0, N = [j * Wm for j in range(n)], n * Wm + 3  # trailing rows past the sequences (graph padding)
    wide = torch.randn(N, C + 5, generator=g) * 2
    x = wide[:, 3 : 3 + C].to(x_dtype)
    state = torch.full((S, C, W - 1), float("nan"), dtype=state_dtype)
    slots = torch.randperm(S, generator=g)[:n]
    fr = fresh or [False] * n
    live = slots[[j for j in range(n) if not fr[j]]]
    state[live] = (torch.randn(len(live), C, W - 1, generator=g) * 2).to(state_dtype)
    weight = torch.randn(C, W, generator=g) / W**0.5
    kw = {}
    if ragged:
        kw = {"row0": torch.tensor(row0), "widths": torch.tensor(widths)}
    if fresh is not None:
        kw["fresh"] = torch.tensor(fresh)
    return x, state, weight, slots, kw


_VERIFY_CASES = [
    # (widths, H, K, V, W, ragged, fresh)
    ([4, 4, 4], 2, 8, 8, 4, False, None),
    ([1], 1, 5, 7, 3, False, None),
    ([3, 3], 3, 6, 10, 2, False, [False, False]),
    ([3, 1, 4, 2], 2, 8, 12, 4, True, [False, True, False, True]),
    ([2, 5, 1], 3, 6, 10, 4, True, None),
    ([1, 1], 1, 16, 16, 5, True, [True, False]),
]


@pytest.mark.parametrize(("widths", "H", "K", "V", "W", "ragged", "fresh"), _VERIFY_CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_conv_verify_kernel_matches_reference(widths, H, K, V, W, ragged, fresh, dtype) -> None:
    from trtllm_glm.kda.ops import conv_verify_qkv_reference

    n, Wm = len(widths), max(widths)
    x, state, weight, slots, kw = _verify_case(
        n * 10 + W, widths, H, K, V, W, S=n + 5, ragged=ragged, fresh=fresh, x_dtype=dtype, state_dtype=dtype
    )
    before = state.clone()
    want = conv_verify_qkv_reference(x, state, weight, slots, H, K, V, Wm, **kw)
    got = KK.conv_verify_qkv(x, state, weight, slots, H, K, V, Wm, **kw)
    for a, b, d in zip(got, want, (K, K, V)):
        assert a.shape == (n, Wm, H, d) and a.dtype == torch.float32
        assert not a.isnan().any()
        torch.testing.assert_close(a, b, atol=2e-6, rtol=2e-6)
        for j, w in enumerate(widths):
            assert (a[j, w:] == 0).all()  # padding rows exactly zero (the outputs come from torch.empty)
    # The pool is only read: every slot keeps its bits (NaN included).
    torch.testing.assert_close(state, before, equal_nan=True, atol=0, rtol=0)
    q = got[0]
    for j, w in enumerate(widths):
        assert torch.allclose(q[j, :w].norm(dim=-1), torch.ones(w, H), atol=1e-4)


def test_conv_verify_kernel_without_zero_padding_leaves_padding_rows(monkeypatch) -> None:
    """``zero_padding=False``: the real rows have the zeroing run's bits and the padding rows keep whatever the
    allocation held (here a NaN poison: `torch.empty` replaced by a NaN fill), so nothing is stored there."""
    widths, H, K, V, W = [3, 1, 4, 1], 2, 8, 12, 4
    n, Wm = len(widths), max(widths)
    x, state, weight, slots, kw = _verify_case(
        77, widths, H, K, V, W, S=n + 5, ragged=True, fresh=[False, True, False, False]
    )
    want = KK.conv_verify_qkv(x, state, weight, slots, H, K, V, Wm, **kw)
    empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **k: empty(*a, **k).fill_(float("nan")))
    got = KK.conv_verify_qkv(x, state, weight, slots, H, K, V, Wm, zero_padding=False, **kw)
    monkeypatch.setattr(torch, "empty", empty)
    for a, b in zip(got, want):
        for j, w in enumerate(widths):
            assert torch.equal(a[j, :w], b[j, :w]) and a[j, w:].isnan().all()


def _commit_check(x, state, slots, kw, accepted, Wm) -> None:
    from trtllm_glm.kda.ops import conv_commit_slots_reference

    ref = state.clone()
    conv_commit_slots_reference(ref, x, slots, accepted, Wm, **kw)
    out = state.clone()
    KK.conv_commit_slots(out, x, slots, accepted, Wm, **kw)
    # Bit for bit, NaN positions included: untouched slots stay NaN, a = 0 slots keep their bits.
    assert torch.equal(out.isnan(), ref.isnan())
    assert torch.equal(out.nan_to_num(0.0).view(torch.uint8), ref.nan_to_num(0.0).view(torch.uint8))
    others = torch.ones(state.shape[0], dtype=torch.bool)
    others[slots] = False
    assert out[others].isnan().all()


@pytest.mark.parametrize(("widths", "H", "K", "V", "W", "ragged", "fresh"), _VERIFY_CASES)
@pytest.mark.parametrize(
    ("x_dtype", "state_dtype"),
    [(torch.float32, torch.float32), (torch.float16, torch.float32), (torch.float32, torch.float16),
     (torch.bfloat16, torch.float32)],
)  # fmt: skip
def test_conv_commit_kernel_matches_reference_bitwise(widths, H, K, V, W, ragged, fresh, x_dtype, state_dtype) -> None:
    n, Wm = len(widths), max(widths)
    x, state, weight, slots, kw = _verify_case(
        n * 10 + W + 1, widths, H, K, V, W, S=n + 5, ragged=ragged, fresh=fresh, x_dtype=x_dtype,
        state_dtype=state_dtype,
    )  # fmt: skip
    kw.pop("widths", None)  # the commit needs only each sequence's first row
    g = torch.Generator().manual_seed(n + W)
    mixed = [int(torch.randint(0, w + 1, (), generator=g)) for w in widths]
    for acc in ([0] * n, list(widths), mixed, [min(1, w) for w in widths]):
        _commit_check(x, state, slots, kw, torch.tensor(acc), Wm)
    if fresh is not None and any(fresh):
        # A fresh sequence that accepts nothing gets a zero window (the reference's zeros, not the slot's NaN).
        out = state.clone()
        KK.conv_commit_slots(out, x, slots, torch.zeros(n, dtype=torch.int64), Wm, **kw)
        for j in range(n):
            if fresh[j]:
                assert (out[slots[j]] == 0).all()


def test_conv_commit_kernel_is_the_window_shift() -> None:
    """Against the definition, on one sequence: the window after accepting ``a`` rows is positions
    ``a .. a + W - 2`` of history-then-rows, the stored inputs keeping their bits."""
    x, state, _, slots, kw = _verify_case(5, [5], 1, 4, 4, 4, S=3, ragged=True)
    hist = torch.cat([state[slots[0]], x[kw["row0"][0] : kw["row0"][0] + 5].T], dim=1)
    for a in range(6):
        out = state.clone()
        KK.conv_commit_slots(out, x, slots, torch.tensor([a]), 5, row0=kw["row0"])
        assert torch.equal(out[slots[0]], hist[:, a : a + 3])


def test_conv_verify_commit_dispatch_and_checks(monkeypatch) -> None:
    from trtllm_glm.kda import kernels as kernels_pkg
    from trtllm_glm.kda.ops import (
        conv_commit_slots,
        conv_commit_slots_reference,
        conv_verify_qkv,
        conv_verify_qkv_reference,
    )

    widths = [3, 1, 2]
    x, state, weight, slots, kw = _verify_case(3, widths, 2, 8, 8, 4, S=7, ragged=True, fresh=[False, True, False])
    want = conv_verify_qkv_reference(x, state, weight, slots, 2, 8, 8, 3, **kw)
    monkeypatch.setenv("TRTLLM_GLM_KDA_CONV_BACKEND", "triton")
    got = conv_verify_qkv(x, state, weight, slots, 2, 8, 8, 3, **kw)  # the interpreted kernel through the dispatch
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=2e-6, rtol=2e-6)
    ckw = {"row0": kw["row0"], "fresh": kw["fresh"]}
    ref = state.clone()
    conv_commit_slots_reference(ref, x, slots, torch.tensor([2, 0, 2]), 3, **ckw)
    for acc in ([2, 0, 2], torch.tensor([2, 0, 2])):  # host list (range-checked) or device tensor
        out = state.clone()
        conv_commit_slots(out, x, slots, acc, 3, **ckw)
        torch.testing.assert_close(out, ref, equal_nan=True, atol=0, rtol=0)
    with pytest.raises(ValueError, match="num_accepted must be"):
        conv_commit_slots(state.clone(), x, slots, [4, 0, 0], 3, **ckw)

    # TRTLLM_GLM_KDA_BACKEND=torch (the KDA torch-everything switch) selects the references.
    def boom(*args, **kwargs):
        raise AssertionError("kernel called")

    monkeypatch.delenv("TRTLLM_GLM_KDA_CONV_BACKEND")
    monkeypatch.setenv("TRTLLM_GLM_KDA_BACKEND", "torch")
    monkeypatch.setattr(kernels_pkg, "conv_verify_qkv", boom)
    monkeypatch.setattr(kernels_pkg, "conv_commit_slots", boom)
    conv_verify_qkv(x, state, weight, slots, 2, 8, 8, 3, **kw)
    conv_commit_slots(state.clone(), x, slots, [1, 1, 1], 3, **ckw)
    monkeypatch.undo()

    with pytest.raises(ValueError, match="both row0 and widths"):
        KK.conv_verify_qkv(x, state, weight, slots, 2, 8, 8, 3, row0=kw["row0"])
    with pytest.raises(ValueError, match="cannot hold"):
        KK.conv_verify_qkv(x[:5], state, weight, slots, 2, 8, 8, 3)
    with pytest.raises(ValueError, match="do not fit"):
        KK.conv_verify_qkv(x, state, weight, slots, 2, 8, 9, 3, **kw)
    with pytest.raises(ValueError, match="contiguous"):
        KK.conv_commit_slots(state, x, slots, torch.tensor([1]).expand(3), 3)
    with pytest.raises(ValueError, match="unit last stride"):
        KK.conv_commit_slots(state.transpose(1, 2).contiguous().transpose(1, 2), x, slots, torch.ones(3).long(), 3)


def _spec_layer():
    from trtllm_glm.config import Glm5NextConfig
    from trtllm_glm.kda import KimiDeltaAttention

    cfg = Glm5NextConfig(hidden_size=32, kda_num_heads=2, kda_head_dim=16, kda_short_conv_kernel_size=4,
                         kda_gate_low_rank=8)  # fmt: skip
    layer = KimiDeltaAttention(cfg, kda_idx=0)
    layer.reset_parameters(torch.Generator().manual_seed(17), std=0.2)
    return layer


@pytest.mark.parametrize(
    ("q_lens", "past_lens", "slots", "verify", "accepted", "as_tensor"),
    [
        # A uniform verify step (views, no fresh sequence), slots out of order, counts on the "device".
        ([3, 3, 3], [5, 2, 9], [7, 0, 4], [0, 1, 2], [3, 0, 2], True),
        # Mixed widths, a fresh sequence, a width-one decode and a prefill chunk beside them (host counts).
        ([4, 1, 2, 3, 5], [6, 3, 0, 0, 8], [2, 5, 3, 8, 1], [0, 2, 4], [2, 1, 0, 3, 5], False),
    ],
)
def test_layer_verify_commit_with_the_kernels_matches_the_reference(
    monkeypatch, q_lens, past_lens, slots, verify, accepted, as_tensor
) -> None:
    """`forward_spec` + `commit` give the same outputs and state planes with the conv kernels as with the torch
    references; slots outside the batch are left alone and verify leaves the planes unchanged."""
    from trtllm_glm.kda import KdaBatch
    from trtllm_glm.state import KdaLayerState

    layer = _spec_layer()
    g = torch.Generator().manual_seed(18)
    H, K, V, W = layer.num_heads, layer.head_k_dim, layer.head_v_dim, layer.conv_size
    st = KdaLayerState(recurrent=torch.randn(10, H, K, V, generator=g), conv=torch.randn(10, layer.conv_dim, W - 1,
                                                                                         generator=g))  # fmt: skip
    hidden = torch.randn(sum(q_lens), 32, generator=g)
    batch = KdaBatch.build(q_lens, past_lens, slots)
    outs, states = [], []
    for backend in ("torch", "triton"):
        monkeypatch.setenv("TRTLLM_GLM_KDA_CONV_BACKEND", backend)
        s = KdaLayerState(recurrent=st.recurrent.clone(), conv=st.conv.clone())
        out, rec = layer.forward_spec(hidden, batch, s, verify)
        acc = torch.tensor(accepted) if as_tensor else accepted
        rec.commit(acc, s)
        outs.append(out)
        states.append(s)
    torch.testing.assert_close(outs[1], outs[0], atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(states[1].conv, states[0].conv, atol=0, rtol=0)
    torch.testing.assert_close(states[1].recurrent, states[0].recurrent, atol=2e-5, rtol=1e-4)
    untouched = [s for s in range(10) if s not in slots]
    assert torch.equal(states[1].conv[untouched], st.conv[untouched])
    assert torch.equal(states[1].recurrent[untouched], st.recurrent[untouched])
