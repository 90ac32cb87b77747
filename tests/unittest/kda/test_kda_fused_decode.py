"""The fused KDA decode step (`kda.kernels.kda_decode_fused`, ``TRTLLM_GLM_KDA_FUSED_DECODE``) on the CPU interpreter.

* The kernel against its torch reference (`ops.decode_fused.kda_decode_fused_reference`): ragged geometry (``K``,
  ``V``, ``R`` not powers of two, a partial last value block, several heads, ``W`` 2..4), slots out of order with
  gaps in a pool larger than the batch whose other slots hold NaN (they must stay NaN and never leak in), rows with
  a stride, FP32 and bf16 activations, block-FP8 low-rank weights; output buffers NaN-filled first; the ``o_proj``
  input, the recurrent output, the conv windows and the recurrent states all compared.
* A `KimiDeltaAttention` layer with the switch off (the unfused path on its kernels, as CUDA dispatches them) and
  on: several decode steps (every sequence decoding, and sequences without a row in the step), FP32 and bf16,
  fused and separate projection weights; outputs and both state pools agree, the fused kernel is the path taken,
  and steps that are not pure decode steps (a prefill chunk among them) stay on the unfused path bit for bit.
* The batch-invariant mode keeps the unfused path (the fused kernel is never launched; bits unchanged).
* The 4-layer tiny model's greedy tokens over a few decode steps are the same with the switch off and on.
* The switch's values, and the kernel compiling for sm_90 at the real geometry.

Inputs are fresh seeded random values (never zeros).
"""

from __future__ import annotations

import pytest
import torch

from trtllm_glm import envs
from trtllm_glm.config import Glm5NextConfig
from trtllm_glm.kda import KdaBatch, KimiDeltaAttention
from trtllm_glm.kda import kernels as KK
from trtllm_glm.kda import layer as L
from trtllm_glm.kda.ops.decode_fused import fused_decode_enabled, kda_decode_fused, kda_decode_fused_reference
from trtllm_glm.numerics import batch_invariant_mode
from trtllm_glm.quant.fp8 import quantize_block_fp8
from trtllm_glm.state import KdaLayerState

pytest.importorskip("triton")

pytestmark = [
    pytest.mark.cpu_only,
    pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0 to a scalar:DeprecationWarning"),
]

# The kernels the CUDA path runs, forced so that the CPU runs them interpreted (the unfused path included).
_KERNELS = ("TRTLLM_GLM_KDA_CONV_BACKEND", "TRTLLM_GLM_KDA_GATE_BACKEND", "TRTLLM_GLM_NORM_BACKEND")


@pytest.fixture
def on_kernels(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for var in _KERNELS:
        monkeypatch.setenv(var, "triton")
    monkeypatch.delenv(envs.DECODE_FUSE.name, raising=False)
    monkeypatch.delenv(envs.KDA_BACKEND.name, raising=False)
    return monkeypatch


def _case(seed: int, n: int, H: int, K: int, V: int, R: int, W: int, S: int, slots: list[int], dt: torch.dtype):
    """Random inputs of one decode step; pools NaN outside ``slots``."""
    g = torch.Generator().manual_seed(seed)
    C = H * (2 * K + V)

    def rnd(*shape: int, s: float = 1.0) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * s

    # The projection's output with its columns side by side (x | fa | b | ga), read as strided views.
    y = rnd(n, C + 2 * R + H + 3).to(dt)
    x, fa, b, ga = y[:, :C], y[:, C : C + R], y[:, C + R : C + R + H], y[:, C + R + H : C + 2 * R + H]
    conv = torch.full((S, C, W - 1), float("nan"), dtype=dt)
    state = torch.full((S, H, K, V), float("nan"))
    sl = torch.tensor(slots, dtype=torch.int64)
    conv[sl] = rnd(n, C, W - 1).to(dt)
    state[sl] = rnd(n, H, K, V, s=0.5)
    params = {
        "conv_weight": rnd(C, W, s=W**-0.5).to(dt),
        "f_b": rnd(H * K, R, s=0.4).to(dt),
        "A_log": torch.empty(H).uniform_(0.0, 2.0, generator=g),
        "dt_bias": rnd(H * K, s=0.1),
        "g_b": rnd(H * V, R, s=0.4).to(dt),
        "norm_weight": (1.0 + rnd(V, s=0.2)).to(dt),
    }
    return (x, fa, b, ga), conv, state, sl, params


def _call(fn, rows, conv, state, sl, p, K: int, dt: torch.dtype, **kw):
    x, fa, b, ga = rows
    return fn(x, fa, b, ga, conv, p["conv_weight"], sl, p["f_b"], p["A_log"], p["dt_bias"], -5.0, state, p["g_b"],
              p["norm_weight"], 1e-5, K**-0.5, dt, **kw)  # fmt: skip


def _check_pools(conv, conv_ref, state, state_ref, sl, tol: dict) -> None:
    # The windows are data movement (exact); the recurrent states FP32 sums (rounding). Other slots stay NaN.
    torch.testing.assert_close(conv, conv_ref, equal_nan=True, atol=0, rtol=0)
    torch.testing.assert_close(state, state_ref, equal_nan=True, **tol)
    others = torch.ones(state.shape[0], dtype=torch.bool)
    others[sl] = False
    assert state[others].isnan().all() and conv[others].isnan().all()
    assert not state[sl].isnan().any() and not conv[sl].isnan().any()


GEOMETRIES = [
    # n, H, K, V, R, W, pool, slots (out of order, gaps, pool larger than the batch)
    (3, 2, 8, 12, 6, 4, 9, [7, 2, 0]),
    (4, 3, 6, 40, 10, 3, 10, [9, 8, 7, 6]),  # V = 40: a full and a partial 32-wide value block
    (1, 1, 16, 16, 16, 2, 4, [3]),
    (2, 2, 5, 7, 36, 4, 6, [1, 4]),  # R = 36: two low-rank steps, the second partial
]


@pytest.mark.parametrize(("n", "H", "K", "V", "R", "W", "S", "slots"), GEOMETRIES)
@pytest.mark.parametrize("dt", [torch.float32, torch.bfloat16])
def test_kernel_matches_reference(n, H, K, V, R, W, S, slots, dt) -> None:
    rows, conv, state, sl, p = _case(n * 10 + H, n, H, K, V, R, W, S, slots, dt)
    conv_ref, state_ref = conv.clone(), state.clone()
    y_ref, o_ref = _call(kda_decode_fused_reference, rows, conv_ref, state_ref, sl, p, K, dt)
    # NaN-filled outputs: an element the kernel does not write shows.
    out = (torch.full((n, H * V), float("nan"), dtype=dt), torch.full((n, H, V), float("nan")))
    y, o = _call(KK.kda_decode_fused, rows, conv, state, sl, p, K, dt, out=out)
    assert y is out[0] and o is out[1]
    tol = {"atol": 2e-6, "rtol": 2e-5}
    torch.testing.assert_close(o, o_ref, **tol)
    ytol = tol if dt == torch.float32 else {"atol": 1e-2, "rtol": 1e-2}  # one bf16 rounding of the same value
    torch.testing.assert_close(y.float(), y_ref.float(), **ytol)
    _check_pools(conv, conv_ref, state, state_ref, sl, tol)


def test_kernel_with_block_fp8_low_rank_weights() -> None:
    n, H, K, V, R, W = 2, 2, 8, 12, 12, 4
    rows, conv, state, sl, p = _case(5, n, H, K, V, R, W, 5, [4, 1], torch.float32)
    fq, fs = quantize_block_fp8(p["f_b"], 8)  # 8 x 8 tiles: several per head, a partial last column
    gq, gs = quantize_block_fp8(p["g_b"], 8)
    p8 = {**p, "f_b": fq, "g_b": gq}
    kw = {"f_b_scale": fs, "g_b_scale": gs, "quant_block": 8}
    conv_ref, state_ref = conv.clone(), state.clone()
    y_ref, o_ref = _call(kda_decode_fused_reference, rows, conv_ref, state_ref, sl, p8, K, torch.float32, **kw)
    y, o = _call(KK.kda_decode_fused, rows, conv, state, sl, p8, K, torch.float32, **kw)
    torch.testing.assert_close(y, y_ref, atol=2e-6, rtol=2e-5)
    torch.testing.assert_close(o, o_ref, atol=2e-6, rtol=2e-5)
    _check_pools(conv, conv_ref, state, state_ref, sl, {"atol": 2e-6, "rtol": 2e-5})
    # The scales matter: the dense (unscaled) codes give another result.
    y_codes, _ = _call(kda_decode_fused_reference, rows, conv.clone(), state.clone(), sl, p8, K, torch.float32)
    assert not torch.allclose(y_codes, y, atol=1e-3)
    with pytest.raises(ValueError, match="scale_inv"):
        _call(KK.kda_decode_fused, rows, conv, state, sl, p8, K, torch.float32)


def test_op_dispatch_and_empty_batch() -> None:
    rows, conv, state, sl, p = _case(7, 2, 2, 8, 8, 4, 3, 4, [3, 0], torch.float32)
    a = _call(kda_decode_fused, rows, conv.clone(), state.clone(), sl, p, 8, torch.float32, backend="torch")
    b = _call(kda_decode_fused, rows, conv.clone(), state.clone(), sl, p, 8, torch.float32, backend="triton")
    torch.testing.assert_close(a, b, atol=2e-6, rtol=2e-5)
    with pytest.raises(ValueError, match="backend"):
        _call(kda_decode_fused, rows, conv, state, sl, p, 8, torch.float32, backend="fla")
    empty = tuple(t[:0] for t in rows)
    y, o = _call(KK.kda_decode_fused, empty, conv, state, sl[:0], p, 8, torch.float32)
    assert y.shape == (0, 16) and o.shape == (0, 2, 8)


# ----------------------------------------------------------------------------------------------------------------
# The layer


NUM_SLOTS = 9


def _config() -> Glm5NextConfig:
    return Glm5NextConfig(hidden_size=32, kda_num_heads=2, kda_head_dim=12, kda_short_conv_kernel_size=4,
                          kda_gate_low_rank=8)  # fmt: skip


def _layer(dt: torch.dtype, fused: bool) -> KimiDeltaAttention:
    layer = KimiDeltaAttention(_config(), kda_idx=0)
    layer.reset_parameters(torch.Generator().manual_seed(3), std=0.2)
    layer = layer.to(dt)
    layer.A_log.data, layer.dt_bias.data = layer.A_log.data.float(), layer.dt_bias.data.float()
    if fused:
        layer.fuse_weights()
    return layer.eval()


def _state(layer: KimiDeltaAttention, dt: torch.dtype, live: list[int]) -> KdaLayerState:
    gen = torch.Generator().manual_seed(11)
    H, K, V, W = layer.num_heads, layer.head_k_dim, layer.head_v_dim, layer.conv_size
    st = KdaLayerState(
        recurrent=torch.full((NUM_SLOTS, H, K, V), float("nan")),
        conv=torch.full((NUM_SLOTS, layer.conv_dim, W - 1), float("nan"), dtype=dt),
    )
    st.recurrent[live] = torch.randn(len(live), H, K, V, generator=gen) * 0.5
    st.conv[live] = torch.randn(len(live), layer.conv_dim, W - 1, generator=gen).to(dt)
    return st


def _counting(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    calls = {"fused": 0}
    real = L.kda_decode_fused

    def counting(*a, **k):
        calls["fused"] += 1
        return real(*a, **k)

    monkeypatch.setattr(L, "kda_decode_fused", counting)
    return calls


# Steps of (q_lens, past_lens, slots): every sequence decoding (slots reversed / with gaps), then sequences
# without a row among them (the slots of those with one come from an index built once per step).
_STEPS = [
    ([1, 1, 1], [5, 9, 2], [8, 3, 0]),
    ([1, 1, 1], [6, 10, 3], [8, 3, 0]),
    ([1, 0, 1, 1], [7, 4, 11, 4], [8, 5, 3, 0]),
]


@pytest.mark.parametrize(("dt", "fused"), [(torch.float32, True), (torch.float32, False), (torch.bfloat16, True)])
def test_layer_switch_off_and_on_agree(on_kernels: pytest.MonkeyPatch, dt: torch.dtype, fused: bool) -> None:
    layer = _layer(dt, fused)
    calls = _counting(on_kernels)
    live = [8, 5, 3, 0]
    gen = torch.Generator().manual_seed(21)
    hiddens = [torch.randn(sum(q), 32, generator=gen).to(dt) for q, _, _ in _STEPS]
    runs = {}
    for setting in ("0", "1"):
        on_kernels.setenv(envs.KDA_FUSED_DECODE.name, setting)
        st = _state(layer, dt, live)
        outs = [layer(h, KdaBatch.build(q, p, s), st) for h, (q, p, s) in zip(hiddens, _STEPS)]
        runs[setting] = (outs, st)
    assert calls["fused"] == len(_STEPS)  # only in the switched-on run, once per step
    (o0, s0), (o1, s1) = runs["0"], runs["1"]
    # bf16: the unfused path rounds the low-rank gate products and the mixer output to bf16, the fused one not.
    tol = {"atol": 1e-5, "rtol": 1e-4} if dt == torch.float32 else {"atol": 3e-2, "rtol": 3e-2}
    for a, b in zip(o0, o1):
        assert not b.isnan().any()
        torch.testing.assert_close(b.float(), a.float(), **tol)
    stol = {"atol": 1e-5, "rtol": 1e-4} if dt == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    torch.testing.assert_close(s1.recurrent, s0.recurrent, equal_nan=True, **stol)
    torch.testing.assert_close(s1.conv, s0.conv, equal_nan=True, atol=0, rtol=0)  # the same inputs, moved
    dead = [s for s in range(NUM_SLOTS) if s not in live]
    assert s1.recurrent[dead].isnan().all() and s1.conv[dead].isnan().all()


def test_layer_other_steps_stay_unfused(on_kernels: pytest.MonkeyPatch) -> None:
    """A step with a prefill chunk among decode rows runs the unfused path even with the switch on (bit for bit)."""
    layer = _layer(torch.float32, True)
    calls = _counting(on_kernels)
    hidden = torch.randn(5, 32, generator=torch.Generator().manual_seed(4))
    batch = ([1, 3, 1], [4, 0, 7], [6, 2, 1])
    outs = {}
    for setting in ("0", "1"):
        on_kernels.setenv(envs.KDA_FUSED_DECODE.name, setting)
        st = _state(layer, torch.float32, [6, 2, 1])
        outs[setting] = (layer(hidden, KdaBatch.build(*batch), st), st)
    assert calls["fused"] == 0
    assert torch.equal(outs["0"][0], outs["1"][0])
    assert torch.equal(outs["0"][1].recurrent.nan_to_num(), outs["1"][1].recurrent.nan_to_num())


def test_batch_invariant_mode_keeps_the_unfused_path(on_kernels: pytest.MonkeyPatch) -> None:
    """In the mode a decode step must be a width-one verify + commit bit for bit (the verify path rounds the
    gates through the low-rank GEMMs): with the switch on the fused kernel is not launched and the bits are the
    switch-off bits."""
    layer = _layer(torch.float32, True)
    calls = _counting(on_kernels)
    hidden = torch.randn(3, 32, generator=torch.Generator().manual_seed(5))
    q, p, s = _STEPS[0]
    outs = {}
    with batch_invariant_mode(True):
        for setting in ("0", "1"):
            on_kernels.setenv(envs.KDA_FUSED_DECODE.name, setting)
            assert not fused_decode_enabled(hidden)
            st = _state(layer, torch.float32, s)
            outs[setting] = (layer(hidden, KdaBatch.build(q, p, s), st), st)
    assert calls["fused"] == 0
    assert torch.equal(outs["0"][0], outs["1"][0])
    assert torch.equal(outs["0"][1].recurrent.nan_to_num(), outs["1"][1].recurrent.nan_to_num())
    # Outside the mode the same switch takes the fused path.
    assert fused_decode_enabled(hidden)


def test_switch_values(on_kernels: pytest.MonkeyPatch) -> None:
    x = torch.zeros(1, 4)
    var = envs.KDA_FUSED_DECODE.name
    on_kernels.delenv(var, raising=False)
    assert not fused_decode_enabled(x)  # off by default
    on_kernels.setenv(envs.DECODE_FUSE.name, "1")
    assert fused_decode_enabled(x)  # unset: as TRTLLM_GLM_DECODE_FUSE
    on_kernels.setenv(var, "0")
    assert not fused_decode_enabled(x)
    on_kernels.setenv(var, "1")
    assert fused_decode_enabled(x)
    on_kernels.setenv(envs.KDA_BACKEND.name, "torch")  # the KDA torch-everything switch keeps the references
    assert not fused_decode_enabled(x)
    on_kernels.delenv(envs.KDA_BACKEND.name)
    on_kernels.setenv("TRTLLM_GLM_KDA_CONV_BACKEND", "auto")  # CPU tensors under auto: the references
    assert not fused_decode_enabled(x)
    on_kernels.setenv(var, "yes")
    with pytest.raises(ValueError, match=var):
        fused_decode_enabled(x)


# ----------------------------------------------------------------------------------------------------------------
# The model


def test_tiny_model_greedy_tokens_switch_off_and_on(on_kernels: pytest.MonkeyPatch) -> None:
    """The 4-layer tiny model (KDA x3 + sparse MLA), fused weights, its kernels: two prompts, then three greedy
    decode steps of both; the same tokens with the switch off and on, hidden states within FP32 rounding, and the
    fused kernel taken by every KDA layer of every decode step."""
    from benchmarks.harness.model_harness import ModelHarness
    from trtllm_glm.models.glm5_next import Glm5NextForCausalLM, subset_config

    for var in ("TRTLLM_GLM_MHC_BACKEND",):
        on_kernels.setenv(var, "triton")
    cfg = subset_config(Glm5NextConfig.from_pretrained("tiny"), [0, 1, 2, 3])
    model = Glm5NextForCausalLM.from_config(cfg, seed=3).eval()
    model.fuse_weights()
    calls = _counting(on_kernels)
    runs = {}
    for setting in ("0", "1"):
        on_kernels.setenv(envs.KDA_FUSED_DECODE.name, setting)
        h = ModelHarness(model, max_seq_len=32)
        last = [h.step([(0, [3, 4, 5, 6, 7])])[-1:], h.step([(1, [9, 10, 11])])[-1:]]
        tokens, hiddens = [], []
        for _ in range(3):
            nxt = [int(model.compute_logits(x).argmax(-1)) for x in last]
            tokens.append(nxt)
            hid = h.step([(0, [nxt[0]]), (1, [nxt[1]])], num_decode_seqs=2)
            hiddens.append(hid)
            last = [hid[0:1], hid[1:2]]
        runs[setting] = (tokens, hiddens)
    assert calls["fused"] == 3 * 3  # three decode steps x three KDA layers
    assert runs["0"][0] == runs["1"][0]
    for a, b in zip(runs["0"][1], runs["1"][1]):
        torch.testing.assert_close(b, a, atol=1e-4, rtol=1e-4)


def test_kernel_compiles_for_sm90() -> None:
    """The kernel as a bf16 decode step launches it at the real geometry (K = V = R = 128, W = 4; recorded with two
    heads, compiled with 64), plain and with block-FP8 low-rank weights, compiles for the H200 (the interpreter
    never compiles it)."""
    from tests.triton_compile import compile_sm90, recording

    real = Glm5NextConfig.from_pretrained("glm-5.3-flash")
    H, K, W, R = 2, real.kda_head_dim, real.kda_short_conv_kernel_size, real.kda_gate_low_rank
    dt = torch.bfloat16
    rows, conv, state, sl, p = _case(9, 1, H, K, K, R, W, 3, [2], dt)
    state = state.nan_to_num()
    fq, fs = quantize_block_fp8(p["f_b"].float())
    gq, gs = quantize_block_fp8(p["g_b"].float())
    with recording() as rec:
        _call(KK.kda_decode_fused, rows, conv, state, sl, p, K, dt)
        _call(KK.kda_decode_fused, rows, conv, state, sl, {**p, "f_b": fq, "g_b": gq}, K, dt, f_b_scale=fs,
              g_b_scale=gs)  # fmt: skip
    assert not rec.unsupported
    specs = list(rec.specs.values())
    assert len(specs) == 2 and {s.kernel for s in specs} == {"_decode_fused_kernel"}
    for s in specs:
        s.constexprs["H"] = real.kda_num_heads
    results = compile_sm90(specs)
    assert all(r["ok"] for r in results), results
