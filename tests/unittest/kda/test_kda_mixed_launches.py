"""The launches of a mixed (decode + short prefill) KDA step (issue 42): no zero fill of rows every path writes, no
padding masks in a short prefill, one scatter of the verify outputs (`ragged_destinations`), bit for bit the
plain code path's results (CPU)."""

from __future__ import annotations

import random

import pytest
import torch

from tests.kda_helpers import LayerOps, random_kda_state, tiny_kda_layer
from trtllm_glm.kda import KdaBatch, KimiDeltaAttention
from trtllm_glm.kda import layer as layer_mod
from trtllm_glm.kda.layer import ragged_destinations
from trtllm_glm.state import KdaLayerState

pytestmark = pytest.mark.cpu_only

NUM_SLOTS = 8


def _state(layer: KimiDeltaAttention, seed: int) -> KdaLayerState:
    return random_kda_state(layer, NUM_SLOTS, seed, scale=0.1)


@pytest.mark.parametrize("seed", range(6))
def test_ragged_destinations_place_outputs_as_gather_then_scatter(seed: int) -> None:
    """One ``index_copy_`` into ``N`` rows plus sink rows puts every real verify row where the plain path (gather the
    real rows, then scatter them) does; padding rows land in distinct sink rows ``>= N``."""
    rng = random.Random(seed)
    n = rng.randint(1, 6)
    widths = [rng.randint(1, 7) for _ in range(n)]
    gaps = [rng.randint(0, 3) for _ in range(n)]  # other sequences' rows between them
    firsts, row = [], 0
    for w, gap in zip(widths, gaps):
        row += gap
        firsts.append(row)
        row += w
    N, Wm = row + rng.randint(0, 2), max(widths)
    ov = torch.randn(n * Wm, 3, 4)
    src = [i * Wm + j for i, w in enumerate(widths) for j in range(w)]
    dst = [f + j for f, w in zip(firsts, widths) for j in range(w)]
    plain = torch.zeros(N, 3, 4)
    plain.index_copy_(0, torch.tensor(dst), ov.index_select(0, torch.tensor(src)))
    pad = n * Wm - sum(widths)
    every = ragged_destinations(firsts, widths, N)
    assert len(every) == n * Wm and len(set(every)) == n * Wm
    assert sorted(d for d in every if d >= N) == list(range(N, N + pad))
    got = torch.zeros(N + pad, 3, 4)
    got.index_copy_(0, torch.tensor(every), ov)
    assert torch.equal(got[:N], plain)


def _mixed_batch() -> tuple[list[int], list[int], list[int]]:
    # decode, fresh prompt, continuation (ragged widths: padding rows), decode, one-token prompt
    return [1, 5, 3, 1, 1], [6, 0, 4, 9, 0], [3, 0, 5, 1, 6]


def test_mixed_step_issues_no_fill_no_padding_mask_and_one_scatter(monkeypatch) -> None:
    """A mixed step whose sequences tile every row allocates its output without a fill, gathers the short prefills'
    decay and beta with two ``index_select`` (no ``where`` masks, no advanced indexing) and places their outputs with
    one ``index_copy_``."""
    monkeypatch.setenv("TRTLLM_GLM_KDA_SHORT_PREFILL", "8")
    layer = tiny_kda_layer(1)
    q, p, s = _mixed_batch()
    hidden = torch.randn(sum(q), 32, generator=torch.Generator().manual_seed(2))
    mode = LayerOps()
    with mode:
        layer(hidden, KdaBatch.build(q, p, s), _state(layer, 3))
    by = {f: sorted(op for op, g in mode.ops if g == f) for f in ("_forward_o", "_ragged_verify")}
    assert not {"zeros", "zero_", "fill_", "zeros_like"} & set(by["_forward_o"])
    assert by["_ragged_verify"].count("index_select") == 2 and by["_ragged_verify"].count("index_copy_") == 1
    assert not {"where", "index"} & set(by["_ragged_verify"])


def test_mixed_step_matches_masked_padding_and_each_sequence_alone(monkeypatch) -> None:
    """The short prefill's unmasked padding rows change nothing: outputs and slots bit for bit those of the masked
    path (zero decay and beta on padding rows, as before), and close to each sequence stepped alone (other GEMM
    shapes); rows no sequence covers (a graph bucket's padding) stay o_proj(0)."""
    monkeypatch.setenv("TRTLLM_GLM_KDA_SHORT_PREFILL", "8")
    layer = tiny_kda_layer(4)
    q, p, s = _mixed_batch()
    T = sum(q)
    hidden = torch.randn(T + 2, 32, generator=torch.Generator().manual_seed(5))  # two padding rows at the end
    st = _state(layer, 6)
    masked_st = KdaLayerState(recurrent=st.recurrent.clone(), conv=st.conv.clone())
    alone_st = KdaLayerState(recurrent=st.recurrent.clone(), conv=st.conv.clone())
    with torch.no_grad():
        out = layer(hidden, KdaBatch.build(q, p, s), st)
        ragged = KimiDeltaAttention._ragged_verify
        monkeypatch.setattr(KimiDeltaAttention, "_ragged_verify",
                            lambda *a, mask_padding=True: ragged(*a, mask_padding=True))  # fmt: skip
        masked = layer(hidden, KdaBatch.build(q, p, s), masked_st)
        monkeypatch.setattr(KimiDeltaAttention, "_ragged_verify", ragged)
        row = 0
        for qi, pi, si in zip(q, p, s):
            alone = layer(hidden[row : row + qi], KdaBatch.build([qi], [pi], [si]), alone_st)
            torch.testing.assert_close(out[row : row + qi], alone, atol=2e-5, rtol=1e-4)
            row += qi
        zero_rows = layer._output(hidden[T:], torch.zeros(2, layer.num_heads, layer.head_v_dim))
    assert torch.equal(out, masked)
    assert torch.equal(st.recurrent, masked_st.recurrent) and torch.equal(st.conv, masked_st.conv)
    torch.testing.assert_close(st.recurrent, alone_st.recurrent, atol=2e-5, rtol=1e-4)
    assert torch.equal(out[T:], zero_rows)


@pytest.mark.parametrize("ride", ["0", "512"])
def test_step_plan_built_once_per_step_and_anew_for_new_lists(monkeypatch, ride: str) -> None:
    """The host split of a step's sequences (`_StepPlan`) and the paths' host descriptions are built by the first KDA
    layer and reused by the others while the batch holds the same lists (``AttentionMetadata.prepare`` assigns new
    ones); outputs and states bit for bit those of layers that derive everything themselves. ``ride``:
    ``TRTLLM_GLM_KDA_DECODE_RIDE`` (riding decode rows have no decode path, so no decode host description)."""
    monkeypatch.setenv("TRTLLM_GLM_KDA_SHORT_PREFILL", "8")
    monkeypatch.setenv("TRTLLM_GLM_KDA_DECODE_RIDE", ride)
    paths = ["_decode_host", "_ragged_host", "plan"] if ride == "0" else ["_ragged_host", "plan"]
    builds: list[str] = []
    for name, owner in (("_decode_host", layer_mod), ("_ragged_host", layer_mod)):
        orig = getattr(owner, name)
        monkeypatch.setattr(owner, name, lambda *a, _o=orig, _n=name: (builds.append(_n), _o(*a))[1])
    plan_build = layer_mod._StepPlan.build.__func__
    monkeypatch.setattr(
        layer_mod._StepPlan, "build", classmethod(lambda cls, *a: (builds.append("plan"), plan_build(cls, *a))[1])
    )
    layers = [tiny_kda_layer(20 + i) for i in range(3)]
    q, p, s = _mixed_batch()
    hidden = torch.randn(sum(q), 32, generator=torch.Generator().manual_seed(7))

    def run(batch_of) -> list[tuple[torch.Tensor, KdaLayerState]]:  # noqa: ANN001
        out = []
        for i, layer in enumerate(layers):
            st = _state(layer, 30 + i)
            out.append((layer(hidden, batch_of(i), st), st))
        return out

    ref = run(lambda i: KdaBatch.build(q, p, s))  # no scratch: every layer builds
    assert builds.count("plan") == 3
    builds.clear()
    shared = KdaBatch.build(q, p, s)
    shared.kda_scratch = {}
    got = run(lambda i: shared)
    assert sorted(builds) == paths
    for (a, sa), (b, sb) in zip(got, ref):
        assert torch.equal(a, b) and torch.equal(sa.recurrent, sb.recurrent) and torch.equal(sa.conv, sb.conv)
    # The same values in new lists (a new step described under the same scratch): built anew.
    builds.clear()
    shared.q_lens, shared.past_lens = list(q), list(p)
    run(lambda i: shared)
    assert sorted(builds) == paths
