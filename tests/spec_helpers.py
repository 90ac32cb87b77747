"""Shared by the speculative tests: a draft-length policy with scripted choices, CUDA graphs emulated on the CPU,
and the lossless check of speculative against plain greedy output."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from benchmarks.harness import graph_emulation
from benchmarks.harness.prompts import CODE_OPENINGS
from trtllm_glm.runtime.lossless import compare_greedy
from trtllm_glm.speculative.adaptive import AdaptiveDraftPolicy

# The speculative tests' prompts (the trained small preset continues them well: its drafts are accepted).
SNIPPETS = CODE_OPENINGS


class Scripted(AdaptiveDraftPolicy):
    """A policy whose every choice comes from ``script(i)`` (the i-th choice): the rounds are fixed, not timed."""

    def __init__(self, k: int, script: Callable[[int], int]) -> None:
        super().__init__(k, clock=lambda: 0.0)
        self.script = script
        self.i = 0

    def choose(self, batch_size: int) -> int:
        k = self.script(self.i)
        self.i += 1
        return self._pick(k)


def emulate_graphs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Executors replay padded graph steps eagerly on the CPU (`benchmarks.harness.graph_emulation`)."""
    graph_emulation.emulate_graphs(monkeypatch.setattr, monkeypatch.setenv)


def kpool_writes_through_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    """The k-pool's cache writes through its interpreted Triton kernels, its reads through the references
    (`benchmarks.harness.graph_emulation.kpool_writes_through_kernels`)."""
    graph_emulation.kpool_writes_through_kernels(monkeypatch.setattr, monkeypatch.setenv)


def assert_lossless(refs, tests, skip=()) -> None:  # noqa: ANN001
    """Each test request's tokens are its reference's, or diverge only at a near tie (docs/design.md §7)."""
    for i, (ref, t) in enumerate(zip(refs, tests)):
        if i in skip:
            continue
        assert len(t.output_ids) == len(ref.output_ids)
        d = compare_greedy(ref.output_ids, ref.logit_gaps, t.output_ids)
        assert d is None or d.excused, f"request {i}: {d}"
