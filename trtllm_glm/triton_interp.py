"""Running Triton kernels on CPU tensors through Triton's interpreter, next to compiled ones on CUDA.

Every kernel package serves CUDA tensors from its normally imported modules and every other device from an
*interpreted copy* of the same source (`KernelPackage.module`), launched inside `interpreting`; the choice depends
neither on the process environment nor on import order, so a CPU test and a GPU test can share one process. Triton is
imported lazily, on the first interpreted call. The two shortcuts that keep interpreted launches cheap (checked by
tests/unittest/house/test_triton_interp.py) and the interpreter's numerics: docs/kernels.md, "Kernels on the CPU".
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import sys
import threading
import types
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from trtllm_glm import envs

__all__ = ["InterpretedModule", "KernelPackage", "interpreting", "kernel_backend"]

_lock = threading.RLock()
_depth = 0
_fns: dict[int, Any] = {}


def kernel_backend(var: envs.Backend, tensors: Sequence[torch.Tensor | None], backend: str | None) -> str:
    """``"torch"`` or ``"triton"`` for one call of a fused op with a torch reference (devices and flags only).

    ``backend`` (default: the variable ``var``, e.g. `envs.NORM_BACKEND`): ``"torch"``, the reference;
    ``"triton"``, the kernel on any device (the CPU runs it through Triton's interpreter); ``"auto"``, the
    kernel for CUDA tensors when no gradient is needed (kernels have no backward), the reference otherwise.

    Args:
        var: the op's backend variable (its ``op`` names the op in messages).
        tensors: the call's inputs (``None`` entries are skipped); the first one's device decides.
        backend: overrides the environment.

    Raises:
        ValueError: an unknown backend name.
        RuntimeError: ``"triton"`` forced while a gradient is needed.
    """
    choice = var.get() if backend is None else var.check(backend)
    ts = [t for t in tensors if t is not None]
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in ts)
    if choice == "auto":
        return "triton" if ts and ts[0].is_cuda and not needs_grad else "torch"
    if choice == "triton" and needs_grad:
        raise RuntimeError(f"{var.op}: the triton backend has no backward; run under torch.no_grad() or use 'torch'")
    return choice


@contextlib.contextmanager
def interpreting() -> Iterator[None]:
    """Run interpreted launches, letting compiled-mode ``@triton.jit`` helpers be called from them.

    When triton was imported without ``TRITON_INTERPRET``, the standard library's jit functions are
    compiled-mode objects whose ``__call__`` only raises. Inside this scope that ``__call__`` runs the
    function through the interpreter instead, which is exactly what importing triton under
    ``TRITON_INTERPRET=1`` would have produced. Compiled kernels never go through ``__call__`` (the code
    generator inlines nested jit functions itself), so the patch cannot change them; it is undone when the
    outermost scope exits. The lock serialises interpreted launches, which patch ``triton.language``
    globally anyway.
    """
    global _depth
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    with _lock:
        original = JITFunction.__call__
        undo_patch_once = None
        if _depth == 0:
            sort_jit = _standard_sort()

            def _call(self: Any, *args: Any, **kwargs: Any) -> Any:
                if self is sort_jit:
                    fast = _sort_ints(*args, **kwargs)
                    if fast is not None:
                        return fast
                fn = _fns.get(id(self))
                if fn is None:
                    fn = _fns[id(self)] = InterpretedFunction(self.fn)
                return fn(*args, **kwargs)

            JITFunction.__call__ = _call  # type: ignore[method-assign]
            undo_patch_once = _patch_lang_once_per_launch()
        _depth += 1
        try:
            yield
        finally:
            _depth -= 1
            if _depth == 0:
                JITFunction.__call__ = original  # type: ignore[method-assign]
                if undo_patch_once is not None:
                    undo_patch_once()


def _standard_sort() -> Any:
    """``triton.language.standard.sort`` (the jit function ``tl.sort`` names), or ``None``."""
    try:
        from triton.language import standard
    except ImportError:
        return None
    return getattr(standard, "sort", None)


def _sort_ints(x: Any, dim: Any = None, descending: Any = False) -> Any:
    """``tl.sort`` of an integer tensor under the interpreter as one numpy sort, or ``None`` to run Triton's.

    Triton's ``tl.sort`` is a bitonic network of ~``log2(n)^2`` compare-and-swap stages, each a dozen
    interpreted ops with a Python-level xor reduction: most of an interpreted launch of the kernels that sort
    (the pool expansion, the MoE expert sort). Integers have one sorted order whatever the algorithm, so the
    result is identical; floats (NaN, signed zeros) and anything unexpected take Triton's own path.
    """
    import numpy as np
    import triton.language as tl
    from triton.runtime.interpreter import TensorHandle

    unwrap = tl.core._unwrap_if_constexpr
    dim, descending = unwrap(dim), unwrap(descending)
    if not isinstance(x, tl.core.tensor) or not x.type.is_block() or not x.dtype.is_int() or descending:
        return None
    if dim is not None and dim not in (len(x.shape) - 1, -1):
        return None
    return tl.core.tensor(TensorHandle(np.sort(x.handle.data, axis=-1), x.handle.dtype), x.type)


def _patch_lang_once_per_launch() -> Any:
    """Make the interpreter patch ``triton.language`` once per launch, not again at every device-function call.

    Triton's interpreter (3.6) re-runs ``_patch_lang`` (an ``inspect.getmembers`` walk of ``tl``, ``tl.tensor``
    and ``tl.math``) each time a kernel calls a ``@triton.jit`` helper; in kernels whose loops call helpers
    (the pool top-k's threshold search) that walk was ~half of the interpreted time. A re-walk of modules the
    launch has already patched changes nothing (patched members are no longer builtins, so none is wrapped
    again), so it is skipped; a helper whose globals reach a module the launch has not patched yet (the
    standard library's ``core``) still gets the full walk. Returns the undo, or ``None`` when this Triton has
    not the internals this relies on (then nothing is changed).
    """
    try:
        from triton.runtime import interpreter as interp
    except ImportError:
        return None
    patch_lang, grid_call = getattr(interp, "_patch_lang", None), vars(interp.GridExecutor).get("__call__")
    if patch_lang is None or grid_call is None or not hasattr(interp, "_LangPatchScope"):
        return None
    import inspect

    launches: list[set[int]] = []  # per running launch: ids of the language modules it has patched
    seen: dict[int, frozenset[int]] = {}  # id(function globals) -> ids of the triton modules they hold

    def _langs(fn: Any) -> frozenset[int]:
        g = fn.__globals__
        langs = seen.get(id(g))
        if langs is None:
            langs = seen[id(g)] = frozenset(
                id(v) for v in g.values() if inspect.ismodule(v) and v.__name__.startswith("triton.")
            )
        return langs

    def _patch_lang(fn: Any) -> Any:
        if launches:
            langs = _langs(fn)
            if langs <= launches[-1]:
                return interp._LangPatchScope()
            launches[-1].update(langs)
        return patch_lang(fn)

    def _grid_call(self: Any, *args: Any, **kwargs: Any) -> Any:
        launches.append(set())  # the launch's own `_patch_lang(kernel)` comes first and walks in full
        try:
            return grid_call(self, *args, **kwargs)
        finally:
            launches.pop()

    interp._patch_lang = _patch_lang
    interp.GridExecutor.__call__ = _grid_call  # type: ignore[method-assign]

    def undo() -> None:
        interp._patch_lang = patch_lang
        interp.GridExecutor.__call__ = grid_call  # type: ignore[method-assign]

    return undo


class InterpretedModule:
    """Proxy of an interpreted kernel module: calling any of its callables enters `interpreting`."""

    def __init__(self, module: types.ModuleType) -> None:
        self._module = module

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._module, name)
        if not callable(attr) or isinstance(attr, type):
            return attr

        @functools.wraps(attr)
        def call(*args: Any, **kwargs: Any) -> Any:
            with interpreting():
                return attr(*args, **kwargs)

        return call


class KernelPackage:
    """The kernel modules of one package, compiled for CUDA and interpreted for every other device.

    Args:
        name: the package's module name (``__name__`` of its ``__init__``).
        path: the package's ``__path__``.
    """

    def __init__(self, name: str, path: Sequence[str]) -> None:
        self.name = name
        self.path = list(path)
        self._alias = f"{name}._interpreted"
        self._loaded: dict[tuple[str, bool], Any] = {}

    def _alias_package(self) -> types.ModuleType:
        """A package alias over the same directory whose submodules are imported with the interpreter on."""
        pkg = sys.modules.get(self._alias)
        if pkg is None:
            pkg = types.ModuleType(self._alias)
            pkg.__path__ = list(self.path)  # type: ignore[attr-defined]
            pkg.__package__ = self._alias
            sys.modules[self._alias] = pkg
        return pkg

    def module(self, name: str, device: torch.device | str) -> Any:
        """Kernel module ``name`` built for ``device``: the imported module on CUDA (compiled, unless the
        process runs with ``TRITON_INTERPRET=1``), else the interpreted copy behind an `InterpretedModule`."""
        interpret = torch.device(device).type != "cuda"
        key = (name, interpret)
        mod = self._loaded.get(key)
        if mod is not None:
            return mod
        if not interpret:
            mod = importlib.import_module(f"{self.name}.{name}")
        else:
            import triton

            self._alias_package()
            # triton.jit decides between compiled and interpreted functions when a module is imported; the
            # knob scope restores the previous setting (and TRITON_INTERPRET) afterwards. Relative imports of
            # the copy (helpers beside it) resolve inside the alias package, so they are interpreted too.
            with triton.knobs.runtime.scope():
                triton.knobs.runtime.interpret = True
                mod = InterpretedModule(importlib.import_module(f"{self._alias}.{name}"))
        self._loaded[key] = mod
        return mod
