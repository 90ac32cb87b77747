"""Fixed-shape layout of the graph-safe KDA step descriptions (`trtllm_glm.kda.static_step` fills them): a bucket's
caps (`StaticKdaCaps`, `width_classes`) and the device views of its description (`StaticKdaStep`). Apart from the
filling so that the layer can name the views without importing what imports it."""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["GRID_ROWS_PER_ROW", "StaticKdaCaps", "StaticKdaStep", "width_classes"]

# The short prefills' verify grid of a bucket of ``T`` rows holds at most this many times ``T`` rows: it bounds the
# memory a captured grid holds (q / k / v, decay, beta, outputs and records: ~0.2 MB a grid row at the real geometry)
# whatever the width class (`width_classes`).
GRID_ROWS_PER_ROW = 2


def width_classes(rows: int, short_limit: int) -> list[int]:
    """The padded widths ``Wc`` a ``rows``-row bucket's verify grids take (one description and one set of graphs
    each): 1, 4, 16, 64 (each a quarter of the next: a sequence's grid rows are at most four times its own, and
    the kernels skip the padding ones) up to ``min(rows, short_limit)``, which is always one. A step takes the
    narrowest class its short prefills fit (width and count: the grid holds ``GRID_ROWS_PER_ROW * rows`` rows, so
    a narrower class holds more sequences). ``short_limit`` 0: ``[0]``, decode rows only."""
    top = min(rows, short_limit)
    if top <= 0:
        return [0]
    out = [w for w in (1, 4, 16) if w < top]
    return [*out, top]


@dataclass(frozen=True)
class StaticKdaCaps:
    """The fixed shape of one bucket's graph-safe KDA step.

    Attributes:
        rows: ``T``, the bucket's padded rows.
        dec: ``Dc``, decode entries (each one width-one row through the decode kernels).
        seqs: ``Ns``, short-prefill sequences of the verify grid (0: steps with a prefill do not qualify).
        width: ``Wc``, the grid's padded rows per sequence.
    """

    rows: int
    dec: int
    seqs: int
    width: int

    @classmethod
    def for_bucket(cls, rows: int, max_seqs: int, width: int) -> StaticKdaCaps:
        """Caps of a ``rows``-row bucket for at most ``max_seqs`` sequences a step, its grid of width class
        ``width`` (`width_classes`; 0: no short prefill)."""
        dec = max(1, min(rows, max_seqs))
        seqs = min(rows, max_seqs, max(1, GRID_ROWS_PER_ROW * rows // width)) if width > 0 else 0
        return cls(rows, dec, seqs, width)

    @property
    def grid(self) -> int:
        """Rows of the verify grid, ``Ns * Wc``."""
        return self.seqs * self.width

    @property
    def out_rows(self) -> int:
        """Rows of the core's output buffer: the ``T`` rows, a sink row per decode entry, one per grid row (every
        index copy then has distinct destinations: deterministic)."""
        return self.rows + self.dec + self.grid

    @property
    def size(self) -> int:
        """int64 entries of the description (`StaticKdaStep`'s layout)."""
        return 3 * self.dec + 2 * self.grid + 4 * self.seqs


class StaticKdaStep:
    """Device views of one bucket's KDA step description (`describe_static_step` fills the host side).

    Layout of ``buf [caps.size]`` int64: ``dec_rows [Dc]`` (row of each decode entry), ``dec_slots [Dc]``,
    ``dec_dst [Dc]`` (output row: its own row, or a sink row for a padding entry), ``grid [Ns * Wc]`` (step row of
    each grid row: a sequence's rows, then its last row repeated), ``dst [Ns * Wc]`` (output row of each grid row: a
    real row its own, the others a sink row each), ``row0 [Ns]``, ``widths [Ns]``, ``slots [Ns]``, ``fresh_i [Ns]``.

    Args:
        caps: the bucket's caps.
        buf: ``[caps.size]`` int64 device buffer (a view of the runner's step buffer; never reallocated).
    """

    def __init__(self, caps: StaticKdaCaps, buf: torch.Tensor) -> None:
        if buf.shape != (caps.size,) or buf.dtype != torch.int64:
            raise ValueError(f"static KDA step of {caps} needs [{caps.size}] int64, got {tuple(buf.shape)}")
        self.caps = caps
        self.buf = buf
        parts = torch.split(buf, [caps.dec] * 3 + [caps.grid] * 2 + [caps.seqs] * 4)
        self.dec_rows, self.dec_slots, self.dec_dst, self.grid, self.dst = parts[:5]
        self.row0, self.widths, self.slots, self.fresh_i = parts[5:]
        # The kernels and references read the flags as bool (as the eager path passes them): made in place once a
        # step from ``fresh_i`` (`refresh`), outside the graphs.
        with torch.inference_mode(False):
            self.fresh = torch.zeros(caps.seqs, dtype=torch.bool, device=buf.device)

    def refresh(self) -> None:
        """Derive the bool flags after the step's copy into ``buf`` (one launch, no allocation)."""
        if self.caps.seqs:
            torch.ne(self.fresh_i, 0, out=self.fresh)
