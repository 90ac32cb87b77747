"""KimiDeltaAttention over state slots: chunking, decode, batching, slot isolation, verify/commit (CPU)."""

from __future__ import annotations

import pytest
import torch

from trtllm_glm.cache.manager import Glm5NextCacheManager, KdaLayerState
from trtllm_glm.config import Glm5NextConfig
from trtllm_glm.kda import KdaBatch, KdaBatchLike, KimiDeltaAttention

pytestmark = pytest.mark.cpu_only

NUM_SLOTS = 8
ATOL, RTOL = 2e-5, 1e-4


def _config() -> Glm5NextConfig:
    return Glm5NextConfig(
        hidden_size=32,
        kda_num_heads=2,
        kda_head_dim=16,
        kda_short_conv_kernel_size=4,
        kda_gate_low_rank=8,
    )


def _layer(seed: int = 0) -> KimiDeltaAttention:
    layer = KimiDeltaAttention(_config(), kda_idx=0)
    layer.reset_parameters(torch.Generator().manual_seed(seed), std=0.2)
    return layer


def _state(layer: KimiDeltaAttention, seed: int = 0) -> KdaLayerState:
    """State planes poisoned with random values (the layer must not rely on zeroed slots)."""
    gen = torch.Generator().manual_seed(1000 + seed)
    H, K, V, W = layer.num_heads, layer.head_k_dim, layer.head_v_dim, layer.conv_size
    return KdaLayerState(
        recurrent=torch.randn(NUM_SLOTS, H, K, V, generator=gen),
        conv=torch.randn(NUM_SLOTS, layer.conv_dim, W - 1, generator=gen),
    )


def _clone(st: KdaLayerState) -> KdaLayerState:
    return KdaLayerState(recurrent=st.recurrent.clone(), conv=st.conv.clone())


def _hidden(T: int, seed: int) -> torch.Tensor:
    return torch.randn(T, 32, generator=torch.Generator().manual_seed(seed))


def _run(layer, st, hidden, q_lens, past_lens, slots) -> torch.Tensor:
    return layer(hidden, KdaBatch.build(q_lens, past_lens, slots), st)


def _prefill_in_pieces(layer, st, hidden, sizes, slot) -> torch.Tensor:
    outs, past = [], 0
    for n in sizes:
        outs.append(_run(layer, st, hidden[past : past + n], [n], [past], [slot]))
        past += n
    return torch.cat(outs)


def _close(a: torch.Tensor, b: torch.Tensor) -> None:
    torch.testing.assert_close(a, b, atol=ATOL, rtol=RTOL)


def test_weight_names_and_shapes() -> None:
    layer = _layer()
    H, K, D, R, W = 2, 16, 32, 8, 4
    shapes = {n: tuple(p.shape) for n, p in layer.named_parameters()}
    assert shapes == {
        "q_proj.weight": (H * K, D),
        "k_proj.weight": (H * K, D),
        "v_proj.weight": (H * K, D),
        "q_conv1d.weight": (H * K, 1, W),
        "k_conv1d.weight": (H * K, 1, W),
        "v_conv1d.weight": (H * K, 1, W),
        "f_a_proj.weight": (R, D),
        "f_b_proj.weight": (H * K, R),
        "A_log": (H,),
        "dt_bias": (H * K,),
        "b_proj.weight": (H, D),
        "g_a_proj.weight": (R, D),
        "g_b_proj.weight": (H * K, R),
        "o_norm.weight": (K,),
        "o_proj.weight": (D, H * K),
    }
    assert layer.conv_dim == 3 * H * K


def test_reset_parameters_deterministic() -> None:
    a, b, c = _layer(5), _layer(5), _layer(6)
    for (n, p), (_, q), (_, r) in zip(a.named_parameters(), b.named_parameters(), c.named_parameters()):
        assert torch.equal(p, q), n
        if n != "o_norm.weight":
            assert not torch.equal(p, r), n
    assert bool((a.A_log.exp() >= 1).all()) and bool((a.A_log.exp() <= 16).all())


def test_batch_protocol() -> None:
    b = KdaBatch.build([3, 1], [0, 7], [4, 2])
    assert isinstance(b, KdaBatchLike)
    assert b.cu_seqlens == [0, 3, 4] and b.state_slots_t.tolist() == [4, 2]


def test_manager_state_is_compatible() -> None:
    cfg = _config()
    mgr = Glm5NextCacheManager(cfg, num_pages=2, tokens_per_block=4, max_num_requests=3, num_kda_layers=1)
    layer = KimiDeltaAttention(cfg, kda_idx=0)
    st = mgr.kda_layer_state(layer.kda_idx)
    slot = mgr.add_request(7, num_tokens=5)
    out = _run(layer, st, _hidden(5, 1), [5], [0], [slot])
    assert out.shape == (5, 32) and bool(torch.isfinite(out).all())
    assert float(mgr.kda_recurrent[0, slot].abs().sum()) > 0


@pytest.mark.parametrize("piece", [1, 3, 7, 23])
def test_prefill_pieces_equal_one_pass(piece: int) -> None:
    layer = _layer()
    T, slot = 23, 3
    hidden = _hidden(T, 2)
    st_ref = _state(layer)
    out_ref = _run(layer, st_ref, hidden, [T], [0], [slot])
    st = _state(layer)
    sizes = [piece] * (T // piece) + ([T % piece] if T % piece else [])
    out = _prefill_in_pieces(layer, st, hidden, sizes, slot)
    _close(out, out_ref)
    _close(st.recurrent[slot], st_ref.recurrent[slot])
    _close(st.conv[slot], st_ref.conv[slot])


def test_prefill_then_decode_equals_full_prefill() -> None:
    layer = _layer(1)
    P, D_, slot = 10, 8, 5
    hidden = _hidden(P + D_, 3)
    st_ref = _state(layer, 1)
    out_ref = _run(layer, st_ref, hidden, [P + D_], [0], [slot])
    st = _state(layer, 2)  # a differently poisoned slot: must not matter for a fresh sequence
    outs = [_run(layer, st, hidden[:P], [P], [0], [slot])]
    for t in range(P, P + D_):
        outs.append(_run(layer, st, hidden[t : t + 1], [1], [t], [slot]))
    _close(torch.cat(outs), out_ref)
    _close(st.recurrent[slot], st_ref.recurrent[slot])
    _close(st.conv[slot], st_ref.conv[slot])


def test_batch_equals_each_sequence_alone() -> None:
    layer = _layer(2)
    # (prior tokens already committed, rows this step, slot): decode, fresh prefill, continuation, 1-token prompt,
    # another decode.
    specs = [(6, 1, 5), (0, 9, 2), (4, 5, 0), (0, 1, 7), (3, 1, 1)]
    hid = [_hidden(p + n, 10 + i) for i, (p, n, _) in enumerate(specs)]
    st = _state(layer, 3)
    for i, (p, _, s) in enumerate(specs):
        if p:
            _run(layer, st, hid[i][:p], [p], [0], [s])
    st_alone = _clone(st)
    alone = [_run(layer, st_alone, hid[i][p:], [n], [p], [s]) for i, (p, n, s) in enumerate(specs)]
    hidden = torch.cat([hid[i][p:] for i, (p, _, _) in enumerate(specs)])
    out = _run(layer, st, hidden, [n for _, n, _ in specs], [p for p, _, _ in specs], [s for _, _, s in specs])
    _close(out, torch.cat(alone))
    for _, _, s in specs:
        _close(st.recurrent[s], st_alone.recurrent[s])
        _close(st.conv[s], st_alone.conv[s])


def test_other_slots_untouched_and_poison_ignored() -> None:
    layer = _layer(3)
    st = _state(layer, 4)
    hidden = _hidden(9, 20)
    used = [6, 1, 3]
    prior = _clone(st)
    # Poison a fresh sequence's slot with NaN/inf: its output must be the clean-state output.
    st.recurrent[1] = float("nan")
    st.conv[1] = float("inf")
    batch = KdaBatch.build([1, 5, 3], [4, 0, 2], used)
    out = layer(hidden, batch, st)
    assert bool(torch.isfinite(out).all())
    assert bool(torch.isfinite(st.recurrent[1]).all()) and bool(torch.isfinite(st.conv[1]).all())
    for s in range(NUM_SLOTS):
        if s not in used:
            assert torch.equal(st.recurrent[s], prior.recurrent[s]), s
            assert torch.equal(st.conv[s], prior.conv[s]), s
    clean = _state(layer, 5)
    out_clean = _run(layer, clean, hidden[1:6], [5], [0], [1])
    _close(out[1:6], out_clean)
    _close(st.recurrent[1], clean.recurrent[1])
    # Verify + commit also touch nothing else.
    prior = _clone(st)
    vb = KdaBatch.build([3, 2], [5, 7], [6, 3])
    _, rec = layer.forward_verify(_hidden(5, 21), vb, st)
    assert torch.equal(st.recurrent, prior.recurrent) and torch.equal(st.conv, prior.conv)
    layer.commit(rec, [2, 1], st)
    for s in range(NUM_SLOTS):
        if s not in (6, 3):
            assert torch.equal(st.recurrent[s], prior.recurrent[s]), s
            assert torch.equal(st.conv[s], prior.conv[s]), s


def test_duplicate_slots_rejected() -> None:
    layer = _layer()
    with pytest.raises(ValueError):
        _run(layer, _state(layer), _hidden(2, 0), [1, 1], [3, 3], [2, 2])


@pytest.mark.parametrize("W", [1, 2, 4])
def test_verify_commit_equals_sequential_decode(W: int) -> None:
    layer = _layer(4)
    P, slot = 11, 4
    hidden = _hidden(P + W, 30 + W)
    base = _state(layer, 6)
    _run(layer, base, hidden[:P], [P], [0], [slot])
    # Reference: decode the W rows one by one, remembering every intermediate state.
    seq = _clone(base)
    dec_out, states = [], [_clone(seq)]
    for j in range(W):
        dec_out.append(_run(layer, seq, hidden[P + j : P + j + 1], [1], [P + j], [slot]))
        states.append(_clone(seq))
    for a in range(1, W + 1):
        st = _clone(base)
        out, rec = layer.forward_verify(hidden[P:], KdaBatch.build([W], [P], [slot]), st)
        assert torch.equal(st.recurrent, base.recurrent) and torch.equal(st.conv, base.conv)
        _close(out, torch.cat(dec_out))
        layer.commit(rec, [a], st)
        _close(st.recurrent[slot], states[a].recurrent[slot])
        _close(st.conv[slot], states[a].conv[slot])
        # The conv window after commit is exactly the last W-1 conv inputs up to row a-1 (shift is a copy).
        hist = torch.cat([base.conv[slot], rec.x_rows[0].T], dim=1)
        assert torch.equal(st.conv[slot], hist[:, a : a + layer.conv_size - 1])
        # Decoding continues identically from the committed state.
        nxt = _hidden(1, 99)
        o1 = _run(layer, st, nxt, [1], [P + a], [slot])
        o2 = _run(layer, states[a], nxt, [1], [P + a], [slot])
        _close(o1, o2)


def test_width_one_decode_equals_verify_commit_one() -> None:
    layer = _layer(5)
    P, slot = 7, 2
    hidden = _hidden(P + 1, 40)
    a = _state(layer, 7)
    _run(layer, a, hidden[:P], [P], [0], [slot])
    b = _clone(a)
    out_d = _run(layer, a, hidden[P:], [1], [P], [slot])
    out_v, rec = layer.forward_verify(hidden[P:], KdaBatch.build([1], [P], [slot]), b)
    layer.commit(rec, [1], b)
    torch.testing.assert_close(out_v, out_d, atol=1e-6, rtol=0)
    torch.testing.assert_close(b.recurrent, a.recurrent, atol=1e-6, rtol=0)
    torch.testing.assert_close(b.conv, a.conv, atol=1e-6, rtol=0)


def test_verify_commit_batch_mixed_widths() -> None:
    """Several sequences (different widths, one fresh) verified together, each committing a different a."""
    layer = _layer(6)
    specs = [(9, 4, 0, 3), (5, 2, 6, 2), (0, 3, 3, 1), (12, 1, 5, 1)]  # (past, width, slot, accepted)
    hid = [_hidden(p + w, 50 + i) for i, (p, w, _, _) in enumerate(specs)]
    st = _state(layer, 8)
    for i, (p, _, s, _) in enumerate(specs):
        if p:
            _run(layer, st, hid[i][:p], [p], [0], [s])
    ref = _clone(st)
    ref_out = []
    for i, (p, w, s, a) in enumerate(specs):
        outs = []
        tmp = _clone(ref)
        if p == 0:
            # A fresh sequence's rows decode from zero state: a one-row prefill, then decodes.
            tmp.recurrent[s] = 0.0
            tmp.conv[s] = 0.0
        for j in range(w):
            outs.append(_run(layer, tmp, hid[i][p + j : p + j + 1], [1], [p + j], [s]))
            if j + 1 == a:
                ref.recurrent[s] = tmp.recurrent[s]
                ref.conv[s] = tmp.conv[s]
        ref_out.append(torch.cat(outs))
    hidden = torch.cat([hid[i][p:] for i, (p, _, _, _) in enumerate(specs)])
    batch = KdaBatch.build([w for _, w, _, _ in specs], [p for p, _, _, _ in specs], [s for _, _, s, _ in specs])
    out, rec = layer.forward_verify(hidden, batch, st)
    _close(out, torch.cat(ref_out))
    layer.commit(rec, [a for *_, a in specs], st)
    _close(st.recurrent, ref.recurrent)
    _close(st.conv, ref.conv)
    with pytest.raises(ValueError):
        layer.commit(rec, [5, 1, 1, 1], st)


def test_fused_weights_same_outputs_names_and_loads() -> None:
    """`fuse_weights` re-homes the input projections and conv taps into one storage each: outputs of prefill,
    decode and verify stay those of the separate weights (to FP32 rounding), names / shapes / state_dict do
    not change, an in-place load writes through the views, a replaced parameter falls back to the separate
    path, and a cast re-fuses."""
    ref = _layer(11)
    fused = _layer(11)
    fused.fuse_weights()
    assert fused._in_fused is not None and fused._in_fused.intact() and fused._conv_fused.intact()
    assert fused.q_proj.weight.data_ptr() == fused._in_fused.weight.data_ptr()
    assert {k: v.shape for k, v in fused.state_dict().items()} == {k: v.shape for k, v in ref.state_dict().items()}
    assert all(torch.equal(fused.state_dict()[k], v) for k, v in ref.state_dict().items())
    st_r, st_f = _state(ref, 3), _state(ref, 3)
    hidden = _hidden(7, 30)
    for q_lens, past in (([4, 3], [0, 2]), ([1, 1], [4, 5])):  # prefill chunks, then decode rows
        _close(_run(fused, st_f, hidden[: sum(q_lens)], q_lens, past, [5, 2]),
               _run(ref, st_r, hidden[: sum(q_lens)], q_lens, past, [5, 2]))  # fmt: skip
    _close(st_f.recurrent, st_r.recurrent)
    _close(st_f.conv, st_r.conv)
    vb = KdaBatch.build([3], [6], [5])
    o_f, _ = fused.forward_verify(hidden[:3], vb, _clone(st_f))
    o_r, _ = ref.forward_verify(hidden[:3], vb, _clone(st_r))
    _close(o_f, o_r)
    # An in-place load (load_state_dict copies into the parameters) reaches the fused storage.
    other = _layer(12)
    fused.load_state_dict(other.state_dict())
    assert fused._in_fused.intact()
    assert torch.equal(fused._in_fused.weight[: fused.q_proj.weight.shape[0]], other.q_proj.weight)
    st_a, st_b = _state(ref, 4), _state(ref, 4)
    _close(_run(fused, st_a, hidden[:2], [1, 1], [3, 3], [0, 1]), _run(other, st_b, hidden[:2], [1, 1], [3, 3], [0, 1]))
    # A replaced parameter: that group is no longer fused, and the separate path is used (still correct).
    fused.k_proj.weight = torch.nn.Parameter(other.k_proj.weight.clone() * 2)
    other.k_proj.weight = torch.nn.Parameter(other.k_proj.weight.clone() * 2)
    assert not fused._in_fused.intact()
    st_a, st_b = _state(ref, 5), _state(ref, 5)
    _close(_run(fused, st_a, hidden[:2], [1, 1], [3, 3], [0, 1]), _run(other, st_b, hidden[:2], [1, 1], [3, 3], [0, 1]))
    fused.fuse_weights()  # rebuilt from the current parameters
    assert fused._in_fused.intact() and torch.equal(fused.k_proj.weight, other.k_proj.weight)
    # A cast gives new storage: the layer fuses again, and no longer holds the old tensors.
    old_ptr = fused._in_fused.weight.data_ptr()
    fused.to(torch.float64)
    assert fused._in_fused.intact() and fused._in_fused.weight.dtype == torch.float64
    assert fused._in_fused.weight.data_ptr() != old_ptr and fused._conv_fused.intact()
    assert fused.q_proj.weight.dtype == torch.float64


def test_fuse_weights_is_idempotent() -> None:
    layer = _layer(1)
    layer.fuse_weights()
    ptrs = (layer._in_fused.weight.data_ptr(), layer._conv_fused.weight.data_ptr())
    layer.fuse_weights()  # graphs captured on the first storage stay valid
    assert (layer._in_fused.weight.data_ptr(), layer._conv_fused.weight.data_ptr()) == ptrs


@pytest.mark.parametrize("ride", ["0", "512"])
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_short_prefill_through_the_verify_kernels(monkeypatch, backend: str, ride: str) -> None:
    """``TRTLLM_GLM_KDA_SHORT_PREFILL``: prefill chunks up to the limit run the verify recurrence then commit every
    row (the admission step's cheap path); the outputs and the states equal the chunked path's, in a batch mixing
    decode rows, a fresh prompt over a NaN-poisoned slot, a continuation, a one-token prompt and a chunk over the
    limit (which stays on the chunked path); other slots are untouched. ``triton``: the kernels, interpreted.
    ``ride``: ``TRTLLM_GLM_KDA_DECODE_RIDE``, the decode rows on their own path (0) or in the verify grid."""
    monkeypatch.setenv("TRTLLM_GLM_KDA_DECODE_RIDE", ride)
    monkeypatch.setenv("TRTLLM_GLM_KDA_VERIFY", backend)
    monkeypatch.setenv("TRTLLM_GLM_KDA_CONV_BACKEND", backend)
    layer = _layer(4)
    # (prior tokens, rows this step, slot): decode, fresh 9-row prompt, continuation of 5, one-token prompt,
    # a 12-row chunk (over the limit of 10), another decode.
    specs = [(6, 1, 5), (0, 9, 2), (4, 5, 0), (0, 1, 7), (3, 12, 4), (3, 1, 1)]
    hid = [_hidden(p + n, 30 + i) for i, (p, n, _) in enumerate(specs)]
    st = _state(layer, 6)
    for i, (p, _, s) in enumerate(specs):
        if p:
            _run(layer, st, hid[i][:p], [p], [0], [s])
    st.recurrent[2] = float("nan")  # the fresh prompt's slot: never read
    st.conv[7] = float("inf")
    hidden = torch.cat([hid[i][p:] for i, (p, _, _) in enumerate(specs)])
    args = ([n for _, n, _ in specs], [p for p, _, _ in specs], [s for _, _, s in specs])
    st_ref = _clone(st)
    monkeypatch.delenv("TRTLLM_GLM_KDA_SHORT_PREFILL", raising=False)
    ref = _run(layer, st_ref, hidden, *args)
    calls: list[list[int]] = []
    short = KimiDeltaAttention._short_prefill

    def spy(self, x, g, beta, o, batch, seqs, *rest):  # noqa: ANN001, ANN202
        calls.append(list(seqs))
        return short(self, x, g, beta, o, batch, seqs, *rest)

    monkeypatch.setattr(KimiDeltaAttention, "_short_prefill", spy)
    monkeypatch.setenv("TRTLLM_GLM_KDA_SHORT_PREFILL", "10")
    prior = _clone(st)
    out = _run(layer, st, hidden, *args)
    # The fresh prompt, the continuation, the one-token prompt (and, riding, the decode rows); not the 12-row chunk.
    assert calls == ([[1, 2, 3]] if ride == "0" else [[0, 1, 2, 3, 5]])
    _close(out, ref)
    for s in range(NUM_SLOTS):
        if s in args[2]:
            _close(st.recurrent[s], st_ref.recurrent[s])
            _close(st.conv[s], st_ref.conv[s])
        else:
            assert torch.equal(st.recurrent[s], prior.recurrent[s]) and torch.equal(st.conv[s], prior.conv[s])
    monkeypatch.setenv("TRTLLM_GLM_KDA_SHORT_PREFILL", "some")
    with pytest.raises(ValueError, match="TRTLLM_GLM_KDA_SHORT_PREFILL"):
        _run(layer, _clone(st), hidden, *args)


def test_step_indices_built_once_for_every_layer_of_a_step(monkeypatch) -> None:
    """A mixed step's row indices, slots and commit counts (decode rows out of order, short prefills) are built by
    its first KDA layer and reused by the others when the batch carries a per-step scratch (``kda_scratch``, as
    ``AttentionMetadata`` does): outputs and states bit for bit those of layers that build their own; a batch whose
    slots changed does not reuse them. (Decode rows on their own path: ``TRTLLM_GLM_KDA_DECODE_RIDE=0``.)"""
    monkeypatch.setenv("TRTLLM_GLM_KDA_SHORT_PREFILL", "10")
    monkeypatch.setenv("TRTLLM_GLM_KDA_DECODE_RIDE", "0")
    layers = [_layer(11 + i) for i in range(3)]
    specs = [(6, 1, 5), (0, 9, 2), (4, 5, 0), (3, 12, 4), (3, 1, 1)]  # decode, prompts (one over the limit), decode
    hidden = torch.cat([_hidden(n, 50 + i) for i, (_, n, _) in enumerate(specs)])
    q, p, s = [n for _, n, _ in specs], [x for x, _, _ in specs], [x for _, _, x in specs]
    builds: list[str] = []
    for name in ("_ragged_index", "_decode_index"):
        orig = getattr(KimiDeltaAttention, name)
        monkeypatch.setattr(KimiDeltaAttention, name,
                            lambda self, *a, _o=orig, _n=name: (builds.append(_n), _o(self, *a))[1])  # fmt: skip

    def run(batches) -> tuple[list[torch.Tensor], list[KdaLayerState]]:  # noqa: ANN001
        outs, states = [], []
        for i, (layer, batch) in enumerate(zip(layers, batches)):
            st = _state(layer, 20 + i)
            outs.append(layer(hidden, batch, st))
            states.append(st)
        return outs, states

    ref_out, ref_st = run([KdaBatch.build(q, p, s) for _ in layers])
    assert sorted(builds) == ["_decode_index"] * 3 + ["_ragged_index"] * 3
    builds.clear()
    shared = KdaBatch.build(q, p, s)
    shared.kda_scratch = {}
    out, st = run([shared] * len(layers))
    assert sorted(builds) == ["_decode_index", "_ragged_index"]  # the first layer's, reused by the other two
    for a, b, sa, sb in zip(out, ref_out, st, ref_st):
        assert torch.equal(a, b) and torch.equal(sa.recurrent, sb.recurrent) and torch.equal(sa.conv, sb.conv)
    # Other slots under the same scratch: built anew, not taken from the cache.
    builds.clear()
    s2 = [7, 3, 6, 4, 0]
    moved = KdaBatch.build(q, p, s2)
    moved.kda_scratch = shared.kda_scratch
    st = _state(layers[0], 20)
    got = layers[0](hidden, moved, st)
    ref_st2 = _state(layers[0], 20)
    assert torch.equal(got, layers[0](hidden, KdaBatch.build(q, p, s2), ref_st2)) and sorted(builds) == [
        "_decode_index", "_decode_index", "_ragged_index", "_ragged_index"]  # fmt: skip
    assert torch.equal(st.recurrent, ref_st2.recurrent) and torch.equal(st.conv, ref_st2.conv)
