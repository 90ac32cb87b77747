"""KDA cores inside the piecewise segment graphs (`trtllm_glm.kda.static_step`, `PiecewiseRunner` with a padding
slot) on the CPU, the runner emulated: admission steps (decode rows with new short prompts of uneven lengths,
continuing short chunks, one-token prompts, slots that differ from request ids and a slot reused right after its
request finished) give the bits of the same runner with every core eager (tokens, logits, hidden, caches), and of
the plain eager forward where no step is padded; a step that does not qualify (a chunk over the short-prefill
limit) falls back in between; the padding rows and entries of a bucket leave every slot but the reserved padding
slot untouched (free slots poisoned with NaN first, idle requests' slots compared bit for bit).

The real capture and replay: ``test_piecewise_gpu.py``.
"""

from __future__ import annotations

import pytest
import torch

from benchmarks.harness.model_harness import ModelHarness
from tests.piecewise_helpers import free_requests, harness_step, run_admissions, slice_harness, slice_model
from trtllm_glm import envs
from trtllm_glm.kda.static_step import StaticKdaCaps, width_classes
from trtllm_glm.runtime.executor import Executor
from trtllm_glm.runtime.piecewise import PIECEWISE_ENV, PiecewiseRunner

pytestmark = pytest.mark.cpu_only

SHORT = 16  # the short-prefill limit the tests set (the CPU default is 0: every prefill chunked)
Step = tuple[list[tuple[int, int]], int, list[int]]  # ([(request, rows)], decode sequences, requests freed before)


@pytest.fixture(autouse=True)
def _short_prefill(monkeypatch) -> None:
    monkeypatch.setenv(envs.KDA_SHORT_PREFILL.name, str(SHORT))
    # (Decode rows riding the short prefills' grid are more grid sequences: the counts below assume the default.)
    monkeypatch.setenv(envs.KDA_DECODE_RIDE.name, "0")


def _admission_steps() -> list[Step]:
    """Rows per step (decode sequences first): a pure short prefill (17 rows, bucket 32), an admission (3 decode rows,
    prompts of 7 and 12), a fallback (a 20-row chunk, over the limit), an admission after request 1 finished (its
    slot reused by request 10), a pure decode step, an admission on a bucket edge (16 rows), a continuing short
    chunk with a one-token prompt."""
    return [
        ([(0, 5), (1, 9), (2, 3)], 0, []),
        ([(0, 1), (1, 1), (2, 1), (3, 7), (4, 12)], 3, []),
        ([(0, 1), (1, 1), (2, 1), (3, 1), (4, 1), (5, 20)], 5, []),
        ([(0, 1), (2, 1), (3, 1), (4, 1), (5, 1), (10, 4), (6, 2)], 5, [1]),
        ([(0, 1), (2, 1), (3, 1), (4, 1), (5, 1), (10, 1), (6, 1)], 7, []),
        ([(0, 1), (2, 1), (7, 14)], 2, []),
        ([(0, 1), (2, 1), (3, 1), (7, 5), (8, 1)], 3, []),
    ]


def _step(h: ModelHarness, runner: PiecewiseRunner | None, rows, nd: int, freed, toks) -> torch.Tensor:
    """One step on ``h`` after freeing ``freed`` (``runner`` None: the plain eager forward)."""
    free_requests(h, freed)
    return harness_step(h, runner, rows, nd, toks)


def _tokens(steps: list[Step], seed: int = 0) -> dict[int, list[int]]:
    g = torch.Generator().manual_seed(seed)
    return {r: torch.randint(0, 264, (64,), generator=g).tolist() for rows, _, _ in steps for r, _ in rows}


def _slots(h: ModelHarness, rids) -> list[int]:
    return h.manager.get_batch_state_slots(list(rids))


def _states(h: ModelHarness) -> tuple[torch.Tensor, torch.Tensor]:
    st = h.manager.state
    return st.kda_recurrent, st.kda_conv


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32) if t.dtype == torch.float32 else t.view(torch.int16)


def test_caps_and_classes() -> None:
    assert width_classes(32, 0) == [0] and width_classes(32, 64) == [1, 4, 16, 32] and width_classes(4, 64) == [1, 4]
    assert width_classes(512, 64) == [1, 4, 16, 64] and width_classes(1, 64) == [1]
    c = StaticKdaCaps.for_bucket(512, 64, 64)
    assert (c.dec, c.seqs, c.width, c.grid) == (64, 16, 64, 1024)  # the grid holds at most 2 T rows
    assert StaticKdaCaps.for_bucket(64, 64, 16).seqs == 8 and StaticKdaCaps.for_bucket(64, 64, 0).seqs == 0
    c = StaticKdaCaps.for_bucket(16, 8, 4)
    assert c.size == 3 * 8 + 2 * 32 + 4 * 8 and c.out_rows == 16 + 8 + 32


def test_kda_inside_segments_matches_kda_eager() -> None:
    """Every step on twin caches: the runner with KDA inside the segments against the same runner with every core
    eager (the same padded buckets): tokens, logits, hidden and every real slot bit for bit; the KDA cores ran inside
    the segments in each qualifying step (one eager core a step: the sparse layer) and eagerly in the fallback."""
    model = slice_model()
    steps = _admission_steps()
    toks = _tokens(steps)
    (ha, pad_a), (hb, pad_b) = slice_harness(model), slice_harness(model)
    eager_cores = PiecewiseRunner(model, max_num_tokens=48, emulate=True)
    # The sparse cores eager (the path of steps whose sparse cores do not qualify: `test_piecewise_sparse.py`).
    inside = PiecewiseRunner(model, max_num_tokens=48, emulate=True, padding_slot=pad_b, sparse_inside=False)
    assert inside._fused_segments == [(0, 3), (4, 4)]
    n_sparse = sum(lay.is_sparse for lay in model.model.layers)
    for i, (rows, nd, freed) in enumerate(steps):
        before = inside.stats.eager_cores, inside.stats.kda_steps
        # The same padding rows in both: the eager cores leave their output's padding rows as the last step left
        # them, the inside ones zero, and the CPU MoE computes dead rows too (their values pick the experts' row
        # counts, which move the real rows' rounding).
        for r in (eager_cores, inside):
            for buf in r._carry.values():
                buf.zero_()
        want = _step(ha, eager_cores, rows, nd, freed, toks)
        have = _step(hb, inside, rows, nd, freed, toks)
        assert torch.equal(have, want), f"step {i}: hidden bits differ"
        lw, lh = model.compute_logits(want), model.compute_logits(have)
        assert torch.equal(lh, lw) and torch.equal(lh.argmax(-1), lw.argmax(-1)), f"step {i}: logits differ"
        fallback = i == 2  # a 20-row chunk: the chunked path, cores eager
        cores = inside.stats.eager_cores - before[0]
        assert cores == (len(model.model.layers) if fallback else n_sparse), f"step {i}: {cores} eager cores"
        assert inside.stats.kda_steps - before[1] == (0 if fallback else 1)
        if i == 3:  # request 10 took the slot request 1 left (the slots differ from the ids)
            assert _slots(hb, [10]) == [2] and _slots(hb, [0, 2]) == [1, 3]
    real = [s for s in range(ha.manager.state.kda_recurrent.shape[1]) if s != pad_a]
    assert pad_a == pad_b == 0
    for a, b in zip(_states(ha), _states(hb)):
        assert torch.equal(a[:, real], b[:, real])
    assert inside.stats.steps == len(steps) and inside.stats.kda_steps == len(steps) - 1


def test_kda_inside_segments_bits_without_padding() -> None:
    """Buckets on every step's row count (no padding row): the step is the plain eager forward's bit for bit, the
    KDA cores computed on grids padded to the caps inside the segments."""
    model = slice_model()
    steps = _admission_steps()
    toks = _tokens(steps, seed=1)
    (ha, _), (hb, pad) = slice_harness(model), slice_harness(model)
    sizes = sorted({sum(n for _, n in rows) for rows, _, _ in steps})
    runner = PiecewiseRunner(model, max_num_tokens=48, buckets=sizes, emulate=True, padding_slot=pad)
    inside = []
    for i, (rows, nd, freed) in enumerate(steps):
        k0 = runner.stats.kda_steps
        want = _step(ha, None, rows, nd, freed, toks)
        have = _step(hb, runner, rows, nd, freed, toks)
        assert torch.equal(model.compute_logits(have), model.compute_logits(want)), f"step {i}: logits differ"
        assert torch.equal(have, want), f"step {i}: hidden bits differ"
        inside.append(runner.stats.kda_steps - k0)
    # Step 0 falls back too here: three prompts up to 9 rows in the 17-row bucket need the 16-wide class, whose grid
    # (2 T rows) holds two sequences.
    assert inside == [0, 1, 0, 1, 1, 1, 1]
    for a, b in zip(_states(ha), _states(hb)):
        assert torch.equal(a[:, 1:], b[:, 1:])


def test_padding_rows_and_entries_touch_no_slot() -> None:
    """Before each step the free slots and the carry buffers are poisoned with NaN and the idle requests' slots
    saved: after it, the free and idle slots hold the same bits (only the step's own slots and the padding slot
    change) and the real rows are finite."""
    model = slice_model()
    steps = _admission_steps()
    toks = _tokens(steps, seed=2)
    h, pad = slice_harness(model)
    runner = PiecewiseRunner(model, max_num_tokens=48, emulate=True, padding_slot=pad)
    S = h.manager.state.kda_recurrent.shape[1]
    for i, (rows, nd, freed) in enumerate(steps):
        for rid in freed:  # (freed here, so that its slot is poisoned as a free one)
            h.manager.free_request(rid)
            del h.lengths[rid]
        live = set(_slots(h, list(h.lengths)))
        for buf in runner._carry.values():
            if buf.is_floating_point():
                buf.fill_(float("nan"))
        for t in _states(h):
            t[:, [s for s in range(S) if s not in live and s != pad]] = float("nan")
        saved = [_bits(t).clone() for t in _states(h)]
        out = _step(h, runner, rows, nd, [], toks)
        assert torch.isfinite(out).all(), f"step {i}: a real row read padding"
        stepped = set(_slots(h, [r for r, _ in rows]))
        untouched = [s for s in range(S) if s != pad and s not in stepped]
        assert len(untouched) >= 12 - 1 - len(rows)
        for t, old in zip(_states(h), saved):
            assert torch.equal(_bits(t)[:, untouched], old[:, untouched]), f"step {i}: a slot outside the step changed"
    assert runner.stats.kda_steps == len(steps) - 1


def test_executor_runs_admissions_with_kda_inside(monkeypatch) -> None:
    """The executor (piecewise on, the short-prefill path on): prompts admitted into decoding requests run their KDA
    cores inside the segments, and every request's greedy tokens are the eager executor's (the bits are compared
    above: padded buckets move the CPU's rounding of the token-wise parts, with or without KDA inside)."""
    monkeypatch.setattr(Executor, "_graphs_supported", lambda self: True)
    monkeypatch.delenv(PIECEWISE_ENV, raising=False)
    model = slice_model()
    _, ref = run_admissions(model, False)
    ex, got = run_admissions(model, True)
    assert ex.piecewise is not None and ex.piecewise.padding_slot is not None
    for a, b in zip(ref, got):
        assert a.output_ids == b.output_ids, f"request {a.request_id}"
    assert ex.piecewise.stats.kda_steps >= 2  # the first prompts' step and the admission
