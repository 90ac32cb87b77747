"""CUDA graphs emulated on the CPU, as the speculative tests and `benchmarks/bench_round_host.py` run them: executors
replay padded graph steps eagerly, and the k-pool writes its cache through its (interpreted) Triton kernels, the only
writers that skip padding rows (``row_seq = -1``), and reads through the torch references.

The patches go through the caller's ``setattr`` / ``setenv`` (pytest's ``monkeypatch`` in tests; `emulated_graphs`
undoes its own when its block ends).
"""

from __future__ import annotations

import dataclasses
import os
import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

__all__ = ["KPOOL_WRITES", "emulate_graphs", "emulated_graphs", "kpool_writes_through_kernels"]

# The k-pool ops that write the cache: their Triton kernels skip padding rows (``row_seq = -1``), the torch
# references do not. The others only read (scores, selection, attention): padding rows' outputs are never used.
KPOOL_WRITES = ("write_latent_rows", "update_decode_pools", "update_prefill_pools", "write_prefill_tail")

SetAttr = Callable[[Any, str, Any], None]
SetEnv = Callable[[str, str], None]


def kpool_writes_through_kernels(setattr_: SetAttr, setenv: SetEnv) -> None:
    """The k-pool's cache writes through its Triton kernels (interpreted), without the interpreter's int32 overflow
    checks (slow), and its reads through the torch references (the interpreted read kernels cost ~90 % of a padded
    step's time; their own tests and the GPU tests run them)."""
    from triton.runtime.interpreter import interpreter_builder

    from trtllm_glm.attention.sparse.glm_kpool import dispatch, ops
    from trtllm_glm.attention.sparse.glm_kpool.ops import cache_update

    setattr_(interpreter_builder, "options", dataclasses.replace(interpreter_builder.options, sanitize_overflow=False))
    setenv("TRTLLM_GLM_KPOOL_BACKEND", "triton")
    kernels = dispatch._triton_kernels()
    hybrid = types.SimpleNamespace(**{n: getattr(kernels if n in KPOOL_WRITES else ops, n) for n in dispatch._OP_NAMES})
    setattr_(dispatch, "_triton_kernels", lambda: hybrid)
    # The references validate every row's page on the host; padding rows name no sequence. Read them as a captured
    # graph's replay does: pages looked up with clamped indices (their outputs are never used).
    setattr_(cache_update, "host_checks_allowed", lambda t: False)


def emulate_graphs(setattr_: SetAttr, setenv: SetEnv) -> None:
    """Executors replay padded graph steps eagerly on the CPU (`kpool_writes_through_kernels`)."""
    from trtllm_glm.runtime.executor import Executor

    setattr_(Executor, "_graphs_supported", lambda self: True)
    kpool_writes_through_kernels(setattr_, setenv)


@contextmanager
def emulated_graphs() -> Iterator[None]:
    """`emulate_graphs` inside the block; everything it patched is restored after it."""
    undo: list[Callable[[], None]] = []

    def setattr_(obj: Any, name: str, value: Any) -> None:
        old = obj.__dict__[name] if isinstance(obj, type) and name in obj.__dict__ else getattr(obj, name)
        undo.append(lambda: setattr(obj, name, old))
        setattr(obj, name, value)

    def setenv(name: str, value: str) -> None:
        old = os.environ.get(name)
        undo.append(lambda: os.environ.pop(name, None) if old is None else os.environ.__setitem__(name, old))
        os.environ[name] = value

    try:
        emulate_graphs(setattr_, setenv)
        yield
    finally:
        for fn in reversed(undo):
            fn()
