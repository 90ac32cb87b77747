"""The fused KDA prefill conv kernel (`kda.kernels.conv_prefill`) against its torch reference
(`ops.conv.conv_prefill_reference`: `causal_conv1d_ref` per sequence, SiLU, the q/k L2 norms), on the CPU
interpreter (`trtllm_glm.kda.kernels` runs CPU tensors through an interpreted copy by itself).

Adversarial geometry: sequences of 1 row, fewer rows than the window (``W - 1``), and longer than a row block
(so blocks start inside a sequence and hold the end of one sequence and the start of the next), an empty
sequence, slots out of order in a pool larger than the batch whose other slots hold NaN (they must stay
untouched), fresh sequences whose slots hold NaN (never read, but written), non-power-of-two head dims with
``K != V``, rows taken from a wider tensor (a row stride other than ``C``), and the sequences' rows in ``x`` in
another order with gaps (``row0``). Outputs are allocated poisoned (NaN) so a row the kernel skips fails.
"""

from __future__ import annotations

import pytest
import torch

from trtllm_glm.kda import kernels as KK
from trtllm_glm.kda.ops import conv_prefill, conv_prefill_reference

pytest.importorskip("triton")

pytestmark = [
    pytest.mark.cpu_only,
    pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0 to a scalar:DeprecationWarning"),
]


def _case(
    seed: int,
    lens: list[int],
    H: int,
    K: int,
    V: int,
    W: int,
    *,
    ragged: bool,
    fresh: list[bool] | None,
    x_dtype: torch.dtype = torch.float32,
    state_dtype: torch.dtype = torch.float32,
):
    """A prefill step of ``len(lens)`` sequences; returns ``x, state, weight, slots, cu, kw``."""
    g = torch.Generator().manual_seed(seed)
    n, C = len(lens), H * (2 * K + V)
    cu = [0]
    for length in lens:
        cu.append(cu[-1] + length)
    T = cu[-1]
    kw: dict = {}
    if ragged:
        # Sequences laid out in reverse order in x, one unused row before each (rows nobody may read).
        row0, r = [0] * n, 0
        for j in reversed(range(n)):
            row0[j], r = r + 1, r + 1 + lens[j]
        N = r + 2
        kw = {"row0": torch.tensor(row0), "num_rows": T}
    else:
        N = T
    wide = torch.randn(N, C + 5, generator=g) * 2
    x = wide[:, 3 : 3 + C].to(x_dtype)
    S = n + 5
    state = torch.full((S, C, W - 1), float("nan"), dtype=state_dtype)
    slots = torch.randperm(S, generator=g)[:n]
    fr = fresh or [False] * n
    live = slots[[j for j in range(n) if not fr[j]]]
    state[live] = (torch.randn(len(live), C, W - 1, generator=g) * 2).to(state_dtype)
    weight = torch.randn(C, W, generator=g) / W**0.5
    if fresh is not None:
        kw["fresh"] = torch.tensor(fresh)
    return x, state, weight, slots, torch.tensor(cu), kw


@pytest.fixture
def poisoned_empty(monkeypatch):
    """``torch.empty`` of floating tensors filled with NaN (the kernel's outputs must be fully written)."""
    real = torch.empty

    def empty(*args, **kwargs):
        t = real(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", empty)


_CASES = [
    # (lens, H, K, V, W, ragged, fresh, block_t)
    ([1, 2, 9, 5], 2, 6, 10, 4, False, [False, True, False, True], 4),  # 1 and 2 rows: shorter than W - 1
    ([13], 1, 5, 7, 3, False, None, 4),  # one sequence over four blocks, no fresh flags
    ([7, 0, 3, 11], 3, 6, 4, 4, True, [True, False, False, False], 8),  # an empty sequence; x reordered
    ([2, 20, 1], 2, 8, 8, 5, True, None, 8),  # W = 5: the window is wider than the first sequence
    ([6, 6], 1, 16, 12, 2, False, [False, False], 32),  # W = 2, both sequences in one block
    # 300 sequences: beyond the 256 the fixed search depth covers (one more level); lengths 0-3 so that many
    # sequences share a block and some are empty.
    ([(7 * i) % 4 for i in range(300)], 1, 4, 3, 3, True, None, 16),
]


@pytest.mark.parametrize(("lens", "H", "K", "V", "W", "ragged", "fresh", "block_t"), _CASES)
@pytest.mark.parametrize(("x_dtype", "state_dtype"), [(torch.float32, torch.float32), (torch.float16, torch.float16)])
def test_conv_prefill_kernel_matches_reference(
    poisoned_empty, lens, H, K, V, W, ragged, fresh, block_t, x_dtype, state_dtype
) -> None:
    n, T = len(lens), sum(lens)
    x, state, weight, slots, cu, kw = _case(
        sum(lens) * 7 + W, lens, H, K, V, W, ragged=ragged, fresh=fresh, x_dtype=x_dtype, state_dtype=state_dtype
    )
    before = state.clone()
    ref_state, out_state = state.clone(), state.clone()
    want = conv_prefill_reference(x, ref_state, weight, slots, cu, H, K, V, **kw)
    got = KK.conv_prefill(x, out_state, weight, slots, cu, H, K, V, block_t=block_t, **kw)
    for a, b, d in zip(got, want, (K, K, V)):
        assert a.shape == (T, H, d) and a.dtype == torch.float32 and a.is_contiguous()
        assert not a.isnan().any()
        torch.testing.assert_close(a, b, atol=2e-6, rtol=2e-6)
    # q and k heads are unit vectors (up to eps).
    assert torch.allclose(got[0].norm(dim=-1), torch.ones(T, H), atol=1e-4)
    # The windows bit for bit (data movement); slots outside the batch keep their NaN.
    assert torch.equal(out_state.isnan(), ref_state.isnan())
    assert torch.equal(out_state.nan_to_num(0.0).view(torch.uint8), ref_state.nan_to_num(0.0).view(torch.uint8))
    others = torch.ones(state.shape[0], dtype=torch.bool)
    others[slots] = False
    assert torch.equal(out_state[others].isnan(), before[others].isnan()) and out_state[others].isnan().all()
    for j in range(n):
        if lens[j] > 0 or (fresh and fresh[j]):
            assert not out_state[slots[j]].isnan().any()


def test_conv_prefill_kernel_is_the_definition() -> None:
    """One sequence against the definition: row ``t`` is ``silu(sum_w taps[w] * hist[t + w])`` over
    window-then-rows, normalised per q/k head; the new window is the last ``W - 1`` inputs (the old window's
    tail when the sequence is shorter)."""
    H, K, V, W = 1, 4, 4, 4
    for length in (1, 2, 5):
        x, state, weight, slots, cu, _ = _case(length, [length], H, K, V, W, ragged=False, fresh=None)
        hist = torch.cat([state[slots[0]].T, x], dim=0)  # [W - 1 + L, C]
        out = state.clone()
        q, k, v = KK.conv_prefill(x, out, weight, slots, cu, H, K, V, block_t=4)
        y = torch.stack([(hist[t : t + W].T * weight).sum(-1) for t in range(length)])
        y = torch.nn.functional.silu(y)
        qn = y[:, :K] / (y[:, :K].pow(2).sum(-1, keepdim=True) + 1e-6).sqrt()
        torch.testing.assert_close(q[:, 0], qn, atol=2e-6, rtol=2e-6)
        torch.testing.assert_close(v[:, 0], y[:, 2 * K :], atol=2e-6, rtol=2e-6)
        assert torch.equal(out[slots[0]], hist[length:].T)


def test_conv_prefill_dispatch_and_checks(monkeypatch) -> None:
    from trtllm_glm.kda import kernels as kernels_pkg

    x, state, weight, slots, cu, kw = _case(3, [3, 1, 2], 2, 8, 8, 4, ragged=True, fresh=[False, True, False])
    ref = state.clone()
    want = conv_prefill_reference(x, ref, weight, slots, cu, 2, 8, 8, **kw)
    monkeypatch.setenv("TRTLLM_GLM_KDA_CONV_BACKEND", "triton")
    out = state.clone()
    got = conv_prefill(x, out, weight, slots, cu, 2, 8, 8, **kw)  # the interpreted kernel through the dispatch
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=2e-6, rtol=2e-6)
    torch.testing.assert_close(out, ref, equal_nan=True, atol=0, rtol=0)

    def boom(*args, **kwargs):
        raise AssertionError("kernel called")

    # TRTLLM_GLM_KDA_BACKEND=torch (the KDA torch-everything switch) selects the reference.
    monkeypatch.delenv("TRTLLM_GLM_KDA_CONV_BACKEND")
    monkeypatch.setenv("TRTLLM_GLM_KDA_BACKEND", "torch")
    monkeypatch.setattr(kernels_pkg, "conv_prefill", boom)
    conv_prefill(x, state.clone(), weight, slots, cu, 2, 8, 8, **kw)
    monkeypatch.undo()

    with pytest.raises(ValueError, match="num_rows"):
        KK.conv_prefill(x, state, weight, slots, cu, 2, 8, 8, row0=kw["row0"])
    with pytest.raises(ValueError, match="num_rows"):
        conv_prefill_reference(x, state, weight, slots, cu, 2, 8, 8, row0=kw["row0"])
    with pytest.raises(ValueError, match="do not fit"):
        KK.conv_prefill(x, state, weight, slots, cu, 2, 8, 9, **kw)
    with pytest.raises(ValueError, match=r"contiguous \[4\]"):
        KK.conv_prefill(x, state, weight, slots, cu[:3], 2, 8, 8, **kw)
    with pytest.raises(ValueError, match="do not fit x"):
        KK.conv_prefill(x[:4], state, weight, slots, cu, 2, 8, 8, num_rows=6)


def _layer():
    from trtllm_glm.config import Glm5NextConfig
    from trtllm_glm.kda import KimiDeltaAttention

    cfg = Glm5NextConfig(hidden_size=32, kda_num_heads=2, kda_head_dim=16, kda_short_conv_kernel_size=4,
                         kda_gate_low_rank=8)  # fmt: skip
    layer = KimiDeltaAttention(cfg, kda_idx=0)
    layer.reset_parameters(torch.Generator().manual_seed(27), std=0.2)
    return layer


@pytest.mark.parametrize(
    ("q_lens", "past_lens", "slots", "row0", "N"),
    [
        ([11], [0], [3], None, None),  # one fresh sequence filling the step: the chunk output is o
        ([5, 1, 2], [7, 0, 0], [6, 0, 2], None, None),  # back to back, a one-row fresh prompt: views of x, g, beta
        ([4, 1, 3, 1, 2], [0, 9, 5, 4, 0], [1, 7, 4, 0, 8], None, None),  # decode rows between chunks: gathered rows
        ([3, 4], [2, 0], [9, 5], [0, 4, 8], 9),  # a padding row between the chunks and one after (o rows zero)
        ([6], [3], [2], [0], 8),  # trailing padding rows after one chunk
    ],
)
def test_layer_prefill_with_the_kernel_matches_the_reference(monkeypatch, q_lens, past_lens, slots, row0, N) -> None:
    """The KDA layer gives the same outputs and state planes with the prefill conv kernel as with the torch
    reference (chunk rows back to back or not, with decode rows beside them); other slots are left alone."""
    from trtllm_glm.kda import KdaBatch
    from trtllm_glm.state import KdaLayerState

    layer = _layer()
    g = torch.Generator().manual_seed(28)
    H, K, V, W = layer.num_heads, layer.head_k_dim, layer.head_v_dim, layer.conv_size
    st = KdaLayerState(recurrent=torch.randn(10, H, K, V, generator=g), conv=torch.randn(10, layer.conv_dim, W - 1,
                                                                                         generator=g))  # fmt: skip
    hidden = torch.randn(N or sum(q_lens), 32, generator=g)
    batch = KdaBatch.build(q_lens, past_lens, slots)
    if row0 is not None:  # rows covered by no sequence (padding) between or after the chunks
        batch.cu_seqlens = row0
    outs, states = [], []
    for backend in ("torch", "triton"):
        monkeypatch.setenv("TRTLLM_GLM_KDA_CONV_BACKEND", backend)
        s = KdaLayerState(recurrent=st.recurrent.clone(), conv=st.conv.clone())
        outs.append(layer(hidden, batch, s))
        states.append(s)
    torch.testing.assert_close(outs[1], outs[0], atol=2e-5, rtol=1e-4)
    covered = torch.zeros(hidden.shape[0], dtype=torch.bool)
    for b, n in enumerate(q_lens):
        covered[batch.cu_seqlens[b] : batch.cu_seqlens[b] + n] = True
    zero_rows = layer.o_proj(torch.zeros(1, layer.o_proj.in_features))
    assert torch.equal(outs[1][~covered], zero_rows.expand(int((~covered).sum()), -1))
    torch.testing.assert_close(states[1].conv, states[0].conv, atol=0, rtol=0)
    torch.testing.assert_close(states[1].recurrent, states[0].recurrent, atol=2e-5, rtol=1e-4)
    untouched = [s for s in range(10) if s not in slots]
    assert torch.equal(states[1].conv[untouched], st.conv[untouched])
    assert torch.equal(states[1].recurrent[untouched], st.recurrent[untouched])


def test_conv_prefill_batch_invariant_and_equal_to_decode_steps() -> None:
    """Batch-invariant mode: a sequence's prefill rows and window have the same bits alone and behind another
    sequence (other packed offsets, other row-block positions), and, under the interpreter, the bits of the
    same rows fed one by one through the decode kernel (same tap order, SiLU and norm)."""
    from trtllm_glm.numerics import batch_invariant_mode

    H, K, V, W, L = 2, 24, 40, 4, 9
    C = H * (2 * K + V)
    g = torch.Generator().manual_seed(31)
    xs, window, weight = torch.randn(L, C, generator=g) * 2, torch.randn(C, W - 1, generator=g), torch.randn(C, W)
    with batch_invariant_mode(True):
        alone = torch.full((6, C, W - 1), float("nan"))
        alone[4] = window
        a = KK.conv_prefill(xs, alone, weight, torch.tensor([4]), torch.tensor([0, L]), H, K, V, block_t=4)
        batched = torch.full((6, C, W - 1), float("nan"))
        batched[4], batched[1] = window, torch.randn(C, W - 1, generator=g)
        x = torch.cat([torch.randn(5, C, generator=g), xs])
        b = KK.conv_prefill(x, batched, weight, torch.tensor([1, 4]), torch.tensor([0, 5, 5 + L]), H, K, V, block_t=4)
        for u, w in zip(a, b):
            assert torch.equal(u.view(torch.int32), w[5:].view(torch.int32))
        assert torch.equal(alone[4], batched[4])
        dec = torch.full((6, C, W - 1), float("nan"))
        dec[4] = window
        for t in range(L):
            d = KK.conv_decode(xs[t : t + 1], dec, weight, torch.tensor([4]), H, K, V, 1e-6)
            for u, w in zip(a, d):
                assert torch.equal(u[t].view(torch.int32), w[0].view(torch.int32))
        assert torch.equal(dec[4], alone[4])
