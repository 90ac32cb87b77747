"""`CompileCounter`: counts Triton JIT compilations (new kernel specialisations) in this process.

A served step that meets a new specialisation stalls while Triton compiles it: `Executor.warm_up` runs every shape at
start-up, and `bench_serve` and the GPU tests count what compiles after it, which must be nothing. Counting uses
Triton's ``jit_post_compile_hook`` (once per new specialisation, compiled or loaded from the disk cache); an
existing hook is kept and still called. Interpreted kernels never compile, so the count stays 0 on the CPU. A leaf:
imports nothing of the package.
"""

from __future__ import annotations

import threading
from types import TracebackType
from typing import Any

__all__ = ["CompileCounter"]

_lock = threading.Lock()
_active: list[CompileCounter] = []
_installed = False
_previous_hook: Any = None


def _hook(*args: Any, **kwargs: Any) -> Any:
    fn = kwargs.get("fn")  # triton's JitFunctionInfo(module, name, jit_function)
    name = f"{getattr(fn, 'module', '?')}.{getattr(fn, 'name', fn)}"
    if kwargs.get("repr"):
        name = f"{getattr(fn, 'module', '?')}.{kwargs['repr']}"
    with _lock:
        for c in _active:
            c.names.append(str(name))
    if _previous_hook is not None:
        return _previous_hook(*args, **kwargs)
    return None


def _install() -> bool:
    """Install the hook once per process; ``False`` where Triton is missing."""
    global _installed, _previous_hook
    if _installed:
        return True
    try:
        from triton import knobs
    except ImportError:  # pragma: no cover - Triton ships with the CUDA stack and the CPU pins alike
        return False
    _previous_hook = knobs.runtime.jit_post_compile_hook
    knobs.runtime.jit_post_compile_hook = _hook
    _installed = True
    return True


class CompileCounter:
    """A context manager recording the Triton kernels compiled while it is open.

    Attributes:
        names: qualified names of the kernels compiled, one entry per new specialisation, in order.
        available: whether Triton's hook could be installed (else nothing is counted).

    Example::

        with CompileCounter() as cc:
            run_some_steps()
        assert cc.count == 0, cc.names
    """

    def __init__(self) -> None:
        self.names: list[str] = []
        self.available = False

    @property
    def count(self) -> int:
        return len(self.names)

    def __enter__(self) -> CompileCounter:
        self.available = _install()
        with _lock:
            _active.append(self)
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        with _lock:
            _active.remove(self)
