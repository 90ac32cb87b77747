"""Graph-safe descriptions of the KDA steps an admission step is made of (decode rows and short prefills), for the
piecewise CUDA graphs (`trtllm_glm.runtime.piecewise`): KDA layers whose cores are captured inside a segment graph.

A captured core cannot build index tensors from host lists: every per-step value it reads (decode rows and slots,
the short prefills' row grid, first rows, widths, fresh flags, slots and where each output row goes) lives in one
int64 buffer allocated once per bucket, refreshed in place by the runner's single host-to-device copy of the step,
and every kernel grid depends only on the bucket's caps (`StaticKdaCaps`): decode entries ``Dc``, short-prefill
sequences ``Ns``, their padded width ``Wc``. Entries past the step's real ones are no-ops for the state: a padding
short prefill has width 0 (its verify, conv and commit kernels neither store nor fold a row), a padding decode entry
steps the executor's reserved padding slot (the decode kernels always store; nothing real reads that slot, as for
the full decode graphs' padding sequences). Rows past the step's real rows are never read by a real entry.

The arithmetic is `KimiDeltaAttention._forward_o`'s for the same plan (`_StepPlan`: the same kernels on the same
rows, in grids padded to the caps; every kernel works per sequence / row, so the real rows' bits do not change).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from .batch import KdaBatchLike
from .layer import _step_host, _StepPlan
from .static_layout import GRID_ROWS_PER_ROW, StaticKdaCaps, StaticKdaStep, width_classes

__all__ = [
    "GRID_ROWS_PER_ROW",
    "StaticKdaCaps",
    "StaticKdaStep",
    "describe_padding_step",
    "describe_static_step",
    "width_classes",
]


def describe_static_step(
    batch: KdaBatchLike,
    num_rows: int,
    caps: StaticKdaCaps,
    padding_slot: int,
    out: np.ndarray,
    device: torch.device,
) -> bool:
    """Fill ``out [caps.size]`` (the host side of `StaticKdaStep`'s layout) with the KDA step of ``batch``
    (``num_rows`` real rows of a ``caps.rows``-row bucket), or return False when the step does not qualify: a chunk
    over the short-prefill limit (the chunked path), graph padding sequences, or more decode entries, short prefills
    or a wider one than the caps hold. The split between the paths is `_StepPlan`'s, the eager core's own (cached
    for the step's layers: the same object).

    Args:
        batch: the step's layout (host lists; no verify sequences).
        num_rows: ``n``, the step's real rows.
        caps: the bucket's caps.
        padding_slot: the reserved state slot padding decode entries step (and padding sequences name).
        out: int64 host array of at least ``caps.size`` entries.
        device: the layers' device (the plan's key, and its short-prefill limit).
    """
    if getattr(batch, "num_padding_seqs", 0):
        return False
    plan = _step_host(batch, ("plan", num_rows, device), lambda: _StepPlan.build(batch, num_rows, device))
    dec, short = plan.dec, plan.short
    q, cu, slots = batch.q_lens, batch.cu_seqlens, batch.state_slots
    if plan.pre or len(dec) > caps.dec or len(short) > caps.seqs:
        return False
    widths = [q[b] for b in short]
    if widths and max(widths) > caps.width:
        return False
    firsts = [cu[b] for b in short]
    fresh = [int(batch.past_lens[b] == 0) for b in short]
    _fill(caps, [cu[b] for b in dec], [slots[b] for b in dec], firsts, widths, [slots[b] for b in short], fresh,
          padding_slot, out)  # fmt: skip
    return True


def describe_padding_step(caps: StaticKdaCaps, padding_slot: int, out: np.ndarray) -> None:
    """Fill ``out`` with a step of padding entries only (every decode entry on the padding slot, every sequence of
    width 0): what a capture made before any real step (start-up) runs as its warm-up, touching no real slot."""
    _fill(caps, [], [], [], [], [], [], padding_slot, out)


def _fill(
    caps: StaticKdaCaps,
    dec_rows: Sequence[int],
    dec_slots: Sequence[int],
    firsts: Sequence[int],
    widths: Sequence[int],
    slots: Sequence[int],
    fresh: Sequence[int],
    padding_slot: int,
    out: np.ndarray,
) -> None:
    """`StaticKdaStep`'s layout of the given decode entries and short prefills, padded to the caps, into ``out``."""
    T, Dc, Ns, Wc = caps.rows, caps.dec, caps.seqs, caps.width
    o = 0

    def put(vals: Sequence[int], pad: np.ndarray | int, size: int) -> None:
        nonlocal o
        m = len(vals)
        out[o : o + m] = vals
        out[o + m : o + size] = pad if isinstance(pad, int) else pad[m:size]
        o += size

    put(dec_rows, 0, Dc)  # padding entries read row 0 (always a row of the bucket) ...
    put(dec_slots, padding_slot, Dc)  # ... step the padding slot ...
    put(dec_rows, np.arange(T, T + Dc), Dc)  # ... and land in sink rows T + i
    grid: list[int] = []
    dst: list[int] = []
    for j, (f, w) in enumerate(zip(firsts, widths)):
        grid += range(f, f + w)
        grid += [f + w - 1] * (Wc - w)
        dst += range(f, f + w)
        dst += range(T + Dc + j * Wc + w, T + Dc + (j + 1) * Wc)
    put(grid, 0, Ns * Wc)
    put(dst, np.arange(T + Dc, T + Dc + Ns * Wc), Ns * Wc)  # a padding sequence's grid rows: a sink row each
    put(firsts, 0, Ns)
    put(widths, 0, Ns)  # width 0: no row verified, stored or committed
    put(slots, padding_slot, Ns)  # (only read: width 0 stores nothing)
    put(fresh, 0, Ns)
    assert o == caps.size
