"""The process-wide numerics mode: batch invariance (issue 31, docs/numerics.md).

With it on, every row's result is independent of the rows sharing its step, of the verify width and of its position:
kernels pick one tile shape and reduction order per weight shape or context length, never per number of rows. The
mode is read where a kernel or launch configuration is chosen (`batch_invariant`); the LLM sets it
(`set_batch_invariant`). It is process-wide, like the kernels' backend variables, because the choice is made deep
inside ops that see tensors, not the engine. ``TRTLLM_GLM_BATCH_INVARIANT`` gives a process's starting value.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from trtllm_glm import envs

__all__ = ["BATCH_INVARIANT_ENV", "batch_invariant", "batch_invariant_mode", "set_batch_invariant"]

BATCH_INVARIANT_ENV = envs.BATCH_INVARIANT.name

_state = {"on": envs.BATCH_INVARIANT.get() is True}


def batch_invariant() -> bool:
    """Whether kernels must give each row the same bits whatever the other rows of the step are."""
    return _state["on"]


def set_batch_invariant(on: bool) -> bool:
    """Set the mode for this process; returns the previous value.

    Raises:
        TypeError: ``on`` is not a bool.
    """
    if not isinstance(on, bool):
        raise TypeError(f"batch_invariant must be a bool, got {on!r}")
    prev = _state["on"]
    _state["on"] = on
    return prev


@contextlib.contextmanager
def batch_invariant_mode(on: bool = True) -> Iterator[None]:
    """The mode set to ``on`` inside the ``with`` block, restored after it (tests and benchmarks)."""
    prev = set_batch_invariant(on)
    try:
        yield
    finally:
        set_batch_invariant(prev)
