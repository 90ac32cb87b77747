"""Shared by the speculative tests: a draft-length policy with scripted choices, CUDA graphs emulated on the CPU,
and the lossless check of speculative against plain greedy output."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pytest

from trtllm_glm.runtime.executor import Executor
from trtllm_glm.runtime.lossless import compare_greedy
from trtllm_glm.speculative.adaptive import AdaptiveDraftPolicy


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
    """Executors replay padded graph steps eagerly on the CPU, through the k-pool's Triton kernels (interpreted:
    the only ones that skip padding rows), without the interpreter's int32 overflow checks (slow)."""
    from triton.runtime.interpreter import interpreter_builder

    monkeypatch.setattr(Executor, "_graphs_supported", lambda self: True)
    monkeypatch.setattr(interpreter_builder, "options",
                        dataclasses.replace(interpreter_builder.options, sanitize_overflow=False))  # fmt: skip
    monkeypatch.setenv("TRTLLM_GLM_KPOOL_BACKEND", "triton")


def assert_lossless(refs, tests, skip=()) -> None:  # noqa: ANN001
    """Each test request's tokens are its reference's, or diverge only at a near tie (docs/design.md §7)."""
    for i, (ref, t) in enumerate(zip(refs, tests)):
        if i in skip:
            continue
        assert len(t.output_ids) == len(ref.output_ids)
        d = compare_greedy(ref.output_ids, ref.logit_gaps, t.output_ids)
        assert d is None or d.excused, f"request {i}: {d}"
