"""Decode rows riding the short prefills' verify grid (issue 42, `TRTLLM_GLM_KDA_DECODE_RIDE`): in a mixed step with
short prefills, the width-one decode rows are verified and committed with them (one recurrent path, no decode conv /
recurrence launches, index copy or host plan of their own) instead of taking the in-place decode step.

A riding decode row is a width-one verify + commit: the reference's arithmetic is the decode step's (`_step`, and the
commit's `_decay_update` is the step's state update), so with the torch references (the CPU) outputs and states are
bit for bit those of the decode path; with the kernels in the batch-invariant mode too (the decode runs the verify
kernel's step); outside it the decode kernel rounds differently from the verify step (fla on CUDA), so results agree
to rounding (greedy tokens may differ only at near ties, docs/design.md §7).

Geometry is adversarial: slots not ``0..n-1`` and out of order, decode rows interleaved with prompts, a fresh
one-token prompt beside decode rows (the same width, a different start state), a chunk over the short limit (the
chunked path beside the ride), rows past the sequences (a piecewise bucket's padding), a NaN-poisoned fresh slot.
"""

from __future__ import annotations

import pytest
import torch

from tests.kda_helpers import LayerOps, random_kda_state, tiny_kda_layer
from trtllm_glm.kda import KdaBatch, KimiDeltaAttention
from trtllm_glm.numerics import batch_invariant_mode
from trtllm_glm.state import KdaLayerState

pytestmark = [
    pytest.mark.cpu_only,
    pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0 to a scalar:DeprecationWarning"),
]

NUM_SLOTS = 12
# (past tokens, rows this step, slot): decode, fresh 5-row prompt, decode, fresh one-token prompt, continuation of 3,
# a 12-row chunk (over the short limit of 8: the chunked path), decode, decode.
SPECS = [(6, 1, 9), (0, 5, 2), (9, 1, 0), (0, 1, 7), (4, 3, 11), (3, 12, 4), (2, 1, 5), (7, 1, 3)]
PAD_ROWS = 3  # rows no sequence covers (a piecewise bucket)


def _state(layer: KimiDeltaAttention, seed: int) -> KdaLayerState:
    st = random_kda_state(layer, NUM_SLOTS, seed, scale=0.3)
    for p, _, s in SPECS:
        if p == 0:  # a fresh sequence's slot is never read
            st.recurrent[s], st.conv[s] = float("nan"), float("inf")
    return st


def _clone(st: KdaLayerState) -> KdaLayerState:
    return KdaLayerState(recurrent=st.recurrent.clone(), conv=st.conv.clone())


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


_PATHS = ("_decode", "_short_prefill", "_prefill")


@pytest.fixture
def paths(monkeypatch) -> list[str]:  # noqa: ANN001
    """The recurrent paths `KimiDeltaAttention` runs, in call order (spies on its three path methods)."""
    seen: list[str] = []
    for name in _PATHS:
        orig = getattr(KimiDeltaAttention, name)
        monkeypatch.setattr(KimiDeltaAttention, name,
                            lambda self, *a, _o=orig, _n=name: (seen.append(_n), _o(self, *a))[1])  # fmt: skip
    return seen


def _step(layers, hidden, specs, states, ride: str, monkeypatch, paths: list[str]) -> tuple[list, list[str]]:  # noqa: ANN001
    """One mixed step through every layer (one shared per-step scratch, as the model's layers share it); returns
    the outputs and which recurrent paths ran."""
    monkeypatch.setenv("TRTLLM_GLM_KDA_DECODE_RIDE", ride)
    paths.clear()
    batch = KdaBatch.build([n for _, n, _ in specs], [p for p, _, _ in specs], [s for _, _, s in specs])
    batch.kda_scratch = {}
    with torch.no_grad():
        outs = [layer(hidden, batch, st) for layer, st in zip(layers, states)]
    return outs, list(paths)


def _compare(monkeypatch, paths: list[str], exact: bool) -> None:
    layers = [tiny_kda_layer(3 + i) for i in range(2)]
    T = sum(n for _, n, _ in SPECS)
    hidden = torch.randn(T + PAD_ROWS, 32, generator=torch.Generator().manual_seed(8))
    base = [_state(layer, 40 + i) for i, layer in enumerate(layers)]
    st_off, st_on = [_clone(s) for s in base], [_clone(s) for s in base]
    out_off, paths_off = _step(layers, hidden, SPECS, st_off, "0", monkeypatch, paths)
    out_on, paths_on = _step(layers, hidden, SPECS, st_on, "512", monkeypatch, paths)
    assert paths_off == ["_prefill", "_decode", "_short_prefill"] * 2
    assert paths_on == ["_prefill", "_short_prefill"] * 2  # no decode path: the decode rows rode
    used = {s for _, _, s in SPECS}
    for a, b, sa, sb, s0 in zip(out_on, out_off, st_on, st_off, base):
        if exact:
            assert torch.equal(_bits(a), _bits(b))
            assert torch.equal(_bits(sa.recurrent), _bits(sb.recurrent)) and torch.equal(_bits(sa.conv), _bits(sb.conv))
        else:
            torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-4)
            torch.testing.assert_close(sa.recurrent, sb.recurrent, atol=2e-5, rtol=1e-4)
            assert torch.equal(sa.conv, sb.conv)  # data movement only
        for s in set(range(NUM_SLOTS)) - used:  # other slots untouched
            assert torch.equal(_bits(sa.recurrent[s]), _bits(s0.recurrent[s])) and torch.equal(sa.conv[s], s0.conv[s])


def test_riding_decode_rows_equal_the_decode_path_bitwise_torch_references(monkeypatch, paths: list[str]) -> None:
    """The torch references (the CPU's path): outputs (padding rows included) and states bit for bit."""
    monkeypatch.setenv("TRTLLM_GLM_KDA_SHORT_PREFILL", "8")
    for var in ("TRTLLM_GLM_KDA_VERIFY", "TRTLLM_GLM_KDA_CONV_BACKEND"):
        monkeypatch.setenv(var, "torch")
    _compare(monkeypatch, paths, exact=True)


def test_riding_decode_rows_equal_the_decode_path_bitwise_invariant_kernels(monkeypatch, paths: list[str]) -> None:
    """The conv and verify kernels forced (interpreted, as CUDA runs them) in the batch-invariant mode, where the
    decode runs the verify kernel's step: bit for bit."""
    pytest.importorskip("triton")
    monkeypatch.setenv("TRTLLM_GLM_KDA_SHORT_PREFILL", "8")
    for var in ("TRTLLM_GLM_KDA_VERIFY", "TRTLLM_GLM_KDA_CONV_BACKEND"):
        monkeypatch.setenv(var, "triton")
    with batch_invariant_mode(True):
        _compare(monkeypatch, paths, exact=True)


def test_riding_decode_rows_close_to_the_decode_path_kernels(monkeypatch, paths: list[str]) -> None:
    """The kernels outside the batch-invariant mode (the decode step then is not the verify kernel's): equal to
    rounding, the conv windows exactly."""
    pytest.importorskip("triton")
    monkeypatch.setenv("TRTLLM_GLM_KDA_SHORT_PREFILL", "8")
    for var in ("TRTLLM_GLM_KDA_VERIFY", "TRTLLM_GLM_KDA_CONV_BACKEND"):
        monkeypatch.setenv(var, "triton")
    with batch_invariant_mode(False):
        _compare(monkeypatch, paths, exact=False)


@pytest.mark.parametrize(("ride", "rides"), [("0", False), ("7", False), ("8", True)])
def test_ride_bounded_by_the_padding_it_adds(monkeypatch, paths: list[str], ride: str, rides: bool) -> None:
    """Two decode rows beside a 5-row prompt add 2 * 4 = 8 padding rows to the verify grid: they ride only within
    the budget; a step without short prefills (decode rows and a long chunk) keeps the decode path whatever it is."""
    monkeypatch.setenv("TRTLLM_GLM_KDA_SHORT_PREFILL", "8")
    layer = tiny_kda_layer(5)
    specs = [(6, 1, 3), (0, 5, 1), (2, 1, 0)]
    hidden = torch.randn(7, 32, generator=torch.Generator().manual_seed(2))
    _, ran = _step([layer], hidden, specs, [_state(layer, 6)], ride, monkeypatch, paths)
    assert ran == (["_short_prefill"] if rides else ["_decode", "_short_prefill"])
    long = [(6, 1, 3), (0, 12, 1)]
    hidden = torch.randn(13, 32, generator=torch.Generator().manual_seed(3))
    _, ran = _step([layer], hidden, long, [_state(layer, 6)], "512", monkeypatch, paths)
    assert ran == ["_prefill", "_decode"]
    # A one-token prompt adds no padding rows: the decode rows ride it unless riding is off ("0" is off).
    one = [(6, 1, 3), (0, 1, 1)]
    hidden = torch.randn(2, 32, generator=torch.Generator().manual_seed(4))
    _, ran = _step([layer], hidden, one, [_state(layer, 6)], ride, monkeypatch, paths)
    assert ran == (["_decode", "_short_prefill"] if ride == "0" else ["_short_prefill"])


def test_riding_step_issues_fewer_ops_and_no_padding_mask(monkeypatch) -> None:
    """The layer's own ops in a riding step: fewer than with the decode path beside the verify (no decode output copy,
    no decode index) and no padding mask for the grid's padding rows (a short prefill never masks: the mask is
    built only where it is read)."""
    monkeypatch.setenv("TRTLLM_GLM_KDA_SHORT_PREFILL", "8")
    for var in ("TRTLLM_GLM_KDA_VERIFY", "TRTLLM_GLM_KDA_CONV_BACKEND"):
        monkeypatch.setenv(var, "torch")
    layer = tiny_kda_layer(7)
    specs = [(6, 1, 3), (0, 5, 1), (2, 1, 0)]
    batch_args = ([n for _, n, _ in specs], [p for p, _, _ in specs], [s for _, _, s in specs])
    hidden = torch.randn(7, 32, generator=torch.Generator().manual_seed(2))
    counts = {}
    for ride in ("0", "512"):
        monkeypatch.setenv("TRTLLM_GLM_KDA_DECODE_RIDE", ride)
        mode = LayerOps()
        with mode, torch.no_grad():
            layer(hidden, KdaBatch.build(*batch_args), _state(layer, 4))
        counts[ride] = mode.own()
    assert len(counts["512"]) < len(counts["0"])
    assert "lt" not in counts["512"] and "arange" not in counts["512"]
