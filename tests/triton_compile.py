"""Compile Triton kernels for the H200 (sm_90) on a machine without a GPU (tests only).

Triton's interpreter runs a kernel's Python, not its compilation: a kernel can pass every interpreted CPU test
and still fail to compile on the GPU (a non-constexpr global, a loop-carried value changing type). Compiling for
``GPUTarget("cuda", 90, 32)`` needs no device, only the compiler and ``ptxas`` bundled with triton, so CPU
tests catch those errors too. Each batch compiles in a fresh interpreter: once a process has run interpreted
kernels, triton's code generator is no longer reliable in it (``triton.language`` is patched while
interpreting).
"""

from __future__ import annotations

import contextlib
import inspect
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

__all__ = ["KernelSpec", "LaunchRecorder", "compile_sm90", "recording"]


@dataclass
class KernelSpec:
    """One compilation: ``module.kernel`` with a Triton signature (``"*fp32"``, ``"i32"``, ``"fp32"`` ... per
    runtime argument) and the values of its ``tl.constexpr`` parameters."""

    module: str
    kernel: str
    signature: dict[str, str]
    constexprs: dict[str, Any] = field(default_factory=dict)
    num_warps: int = 4

    @property
    def key(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)


_CHILD = r"""
import importlib, json, sys
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
def value(v):
    return getattr(tl, v["tl_dtype"]) if isinstance(v, dict) else v
out = []
req = json.loads(sys.stdin.read())
for s in req["specs"]:
    fn = getattr(importlib.import_module(s["module"]), s["kernel"])
    consts = {k: value(v) for k, v in s["constexprs"].items()}
    sig = {n: ("constexpr" if n in consts else s["signature"][n]) for n in fn.arg_names}
    try:
        k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts),
                           target=GPUTarget("cuda", 90, 32), options={"num_warps": s["num_warps"]})
        out.append({"ok": True, "ptx_lines": k.asm["ptx"].count("\n"), **({"ptx": k.asm["ptx"]} if req["ptx"] else {})})
    except Exception as e:  # reported to the parent
        out.append({"ok": False, "error": f"{type(e).__name__}: {e}"})
print(json.dumps(out))
"""


def compile_sm90(specs: list[KernelSpec], ptx: bool = False) -> list[dict[str, Any]]:
    """Compile every spec for sm_90 in one fresh Python process (through ``ptxas``).

    Returns:
        One ``{"ok": True, "ptx_lines": n}`` (with ``"ptx"``: the PTX text, if ``ptx``) or ``{"ok": False,
        "error": "..."}`` per spec, in order.
    """
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD],
        input=json.dumps({"specs": [asdict(s) for s in specs], "ptx": ptx}),
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        check=False,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"the compile process failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


_PTR = {
    torch.float32: "*fp32",
    torch.float16: "*fp16",
    torch.bfloat16: "*bf16",
    torch.float64: "*fp64",
    torch.int64: "*i64",
    torch.int32: "*i32",
    torch.int16: "*i16",
    torch.int8: "*i8",
    torch.uint8: "*u8",
    torch.bool: "*i1",
    torch.float8_e4m3fn: "*fp8e4nv",
    torch.float8_e5m2: "*fp8e5",
}


class LaunchRecorder:
    """The distinct kernel launches seen while `recording`, as `KernelSpec` (argument types, not values, except
    the ``tl.constexpr`` parameters'), and any launch whose arguments it could not describe."""

    def __init__(self) -> None:
        self.specs: dict[str, KernelSpec] = {}
        self.unsupported: list[str] = []

    def record(self, interpreted: Any, args: tuple, kwargs: dict[str, Any]) -> None:
        from triton.runtime.jit import _normalize_ty

        fn = interpreted.fn
        names = interpreted.arg_names
        ann = {n: _normalize_ty(t) for n, t in fn.__annotations__.items()}
        bound = inspect.signature(fn).bind_partial(*args, **{k: v for k, v in kwargs.items() if k in names})
        bound.apply_defaults()
        sig: dict[str, str] = {}
        consts: dict[str, Any] = {}
        where = f"{fn.__module__}.{fn.__name__}"
        for n in names:
            v = bound.arguments.get(n)
            if ann.get(n) == "constexpr" or v is None:
                consts[n] = _constexpr_value(v, where, n)
            elif isinstance(v, torch.Tensor):
                sig[n] = _PTR[v.dtype]
            elif isinstance(v, bool):
                sig[n] = "i1"
            elif isinstance(v, int):
                sig[n] = "i32" if -(2**31) <= v < 2**31 else "i64"
            elif isinstance(v, float):
                sig[n] = "fp32"
            else:
                raise TypeError(f"{where}: argument {n!r} of type {type(v).__name__}")
        # Interpreted copies of kernel modules are imported under aliases (`trtllm_glm.triton_interp`, the MoE's
        # own): name the module by its file instead.
        path = fn.__code__.co_filename.replace(os.sep, "/")
        module = fn.__module__
        if "/trtllm_glm/" in path and path.endswith(".py"):
            module = "trtllm_glm." + path.rsplit("/trtllm_glm/", 1)[1][: -len(".py")].replace("/", ".")
        spec = KernelSpec(module, fn.__name__, sig, consts, int(kwargs.get("num_warps", 4)))
        self.specs.setdefault(spec.key, spec)


def _constexpr_value(v: Any, where: str, name: str) -> Any:
    import triton.language as tl

    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, tl.dtype):
        return {"tl_dtype": str(v).replace("tl.", "")}
    if isinstance(v, tl.constexpr):
        return _constexpr_value(v.value, where, name)
    raise TypeError(f"{where}: constexpr {name!r} of type {type(v).__name__}")


@contextlib.contextmanager
def recording() -> Iterator[LaunchRecorder]:
    """Record every interpreted kernel launch made inside the scope (`LaunchRecorder`)."""
    from triton.runtime.interpreter import InterpretedFunction

    rec = LaunchRecorder()
    original = InterpretedFunction.run

    def run(self: Any, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> Any:
        try:
            rec.record(self, args, kwargs)
        except Exception as e:  # noqa: BLE001 - reported by the caller, never breaks the launch itself
            rec.unsupported.append(f"{type(e).__name__}: {e}")
        return original(self, *args, grid=grid, warmup=warmup, **kwargs)

    InterpretedFunction.run = run  # type: ignore[method-assign]
    try:
        yield rec
    finally:
        InterpretedFunction.run = original  # type: ignore[method-assign]
