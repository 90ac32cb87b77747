"""Shared by the speculative tests: a draft-length policy with scripted choices, CUDA graphs emulated on the CPU,
and the lossless check of speculative against plain greedy output."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pytest

from benchmarks.harness.prompts import CODE_OPENINGS
from trtllm_glm.runtime.executor import Executor
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


# The k-pool ops that write the cache: their Triton kernels skip padding rows (``row_seq = -1``), the torch
# references do not. The others only read (scores, selection, attention): padding rows' outputs are never used.
KPOOL_WRITES = ("write_latent_rows", "update_decode_pools", "update_prefill_pools", "write_prefill_tail")


def emulate_graphs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Executors replay padded graph steps eagerly on the CPU (`kpool_writes_through_kernels`)."""
    monkeypatch.setattr(Executor, "_graphs_supported", lambda self: True)
    kpool_writes_through_kernels(monkeypatch)


def kpool_writes_through_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    """The k-pool's cache writes through its Triton kernels (interpreted: the only ones that skip padding rows),
    without the interpreter's int32 overflow checks (slow), and its reads through the torch references (the
    interpreted read kernels cost ~90 % of a padded step's time; their own tests and the GPU tests run them)."""
    import types

    from triton.runtime.interpreter import interpreter_builder

    from trtllm_glm.attention.sparse.glm_kpool import dispatch, ops
    from trtllm_glm.attention.sparse.glm_kpool.ops import cache_update

    monkeypatch.setattr(interpreter_builder, "options",
                        dataclasses.replace(interpreter_builder.options, sanitize_overflow=False))  # fmt: skip
    monkeypatch.setenv("TRTLLM_GLM_KPOOL_BACKEND", "triton")
    kernels = dispatch._triton_kernels()
    hybrid = types.SimpleNamespace(**{n: getattr(kernels if n in KPOOL_WRITES else ops, n) for n in dispatch._OP_NAMES})
    monkeypatch.setattr(dispatch, "_triton_kernels", lambda: hybrid)
    # The references validate every row's page on the host; padding rows name no sequence. Read them as a captured
    # graph's replay does: pages looked up with clamped indices (their outputs are never used).
    monkeypatch.setattr(cache_update, "host_checks_allowed", lambda t: False)


def assert_lossless(refs, tests, skip=()) -> None:  # noqa: ANN001
    """Each test request's tokens are its reference's, or diverge only at a near tie (docs/design.md §7)."""
    for i, (ref, t) in enumerate(zip(refs, tests)):
        if i in skip:
            continue
        assert len(t.output_ids) == len(ref.output_ids)
        d = compare_greedy(ref.output_ids, ref.logit_gaps, t.output_ids)
        assert d is None or d.excused, f"request {i}: {d}"
