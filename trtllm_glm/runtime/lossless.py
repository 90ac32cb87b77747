"""Lossless checks: compare greedy token sequences under the near-tie rule (docs/design.md §7).

Batched verify and one-at-a-time decode differ by rounding, so two greedy runs may legitimately part
ways where the reference's top-2 logits are (nearly) tied. A divergence counts only if the reference's
top-2 gap at that step exceeds the tolerance.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["Divergence", "compare_greedy", "DEFAULT_TIE_TOLERANCE"]

# fp32 rounding differences between batch shapes are ~1e-5 on logits of order 1; 1e-3 leaves margin
# while still flagging real state corruption (which moves logits by far more).
DEFAULT_TIE_TOLERANCE = 1e-3


@dataclass
class Divergence:
    """Where and how two greedy sequences part ways."""

    index: int
    reference_token: int | None
    test_token: int | None
    reference_gap: float | None
    excused: bool

    def __str__(self) -> str:
        kind = "near tie (excused)" if self.excused else "DIVERGENCE"
        return (
            f"{kind} at output token {self.index}: reference {self.reference_token} vs test {self.test_token} "
            f"(reference top-2 gap {self.reference_gap})"
        )


def compare_greedy(
    reference: Sequence[int],
    reference_gaps: Sequence[float],
    test: Sequence[int],
    tol: float = DEFAULT_TIE_TOLERANCE,
) -> Divergence | None:
    """First difference between a reference greedy run and a test run, or ``None`` if identical.

    Args:
        reference: reference output tokens.
        reference_gaps: the reference's top-2 logit gap at each output token (same length).
        test: output tokens under test.
        tol: gaps at or below this are near ties.

    Returns:
        ``None`` when the sequences are equal, else a `Divergence` whose ``excused`` says whether it
        happened at a near tie.
    """
    if len(reference_gaps) != len(reference):
        raise ValueError(f"{len(reference_gaps)} gaps for {len(reference)} reference tokens")
    n = min(len(reference), len(test))
    for i in range(n):
        if reference[i] != test[i]:
            gap = float(reference_gaps[i])
            return Divergence(i, reference[i], test[i], gap, gap <= tol)
    if len(reference) == len(test):
        return None
    # One run stopped earlier (EOS/stop token); that token itself already compared equal, so this is
    # a length policy difference, which is never excused.
    i = n
    ref_tok = reference[i] if i < len(reference) else None
    test_tok = test[i] if i < len(test) else None
    gap = float(reference_gaps[i]) if i < len(reference_gaps) else None
    return Divergence(i, ref_tok, test_tok, gap, False)
