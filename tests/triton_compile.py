"""Compile Triton kernels for the H200 (sm_90) on a machine without a GPU (tests only).

Triton's interpreter runs a kernel's Python, not its compilation: a kernel can pass every interpreted CPU test
and still fail to compile on the GPU (a non-constexpr global, a loop-carried value changing type). Compiling for
``GPUTarget("cuda", 90, 32)`` needs no device, only the compiler and ``ptxas`` bundled with triton, so CPU
tests catch those errors too. Each batch compiles in a fresh interpreter: once a process has run interpreted
kernels, triton's code generator is no longer reliable in it (``triton.language`` is patched while
interpreting).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["KernelSpec", "compile_sm90"]


@dataclass
class KernelSpec:
    """One compilation: ``module.kernel`` with a Triton signature (``"*fp32"``, ``"i32"``, ``"fp32"`` ... per
    runtime argument) and the values of its ``tl.constexpr`` parameters."""

    module: str
    kernel: str
    signature: dict[str, str]
    constexprs: dict[str, Any] = field(default_factory=dict)
    num_warps: int = 4


_CHILD = r"""
import importlib, json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
out = []
for s in json.loads(sys.stdin.read()):
    fn = getattr(importlib.import_module(s["module"]), s["kernel"])
    sig = {n: ("constexpr" if n in s["constexprs"] else s["signature"][n]) for n in fn.arg_names}
    try:
        k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=s["constexprs"]),
                           target=GPUTarget("cuda", 90, 32), options={"num_warps": s["num_warps"]})
        out.append({"ok": True, "ptx_lines": k.asm["ptx"].count("\n")})
    except Exception as e:  # reported to the parent
        out.append({"ok": False, "error": f"{type(e).__name__}: {e}"})
print(json.dumps(out))
"""


def compile_sm90(specs: list[KernelSpec]) -> list[dict[str, Any]]:
    """Compile every spec for sm_90 in one fresh Python process.

    Returns:
        One ``{"ok": True, "ptx_lines": n}`` or ``{"ok": False, "error": "..."}`` per spec, in order.
    """
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD],
        input=json.dumps([asdict(s) for s in specs]),
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        check=False,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"the compile process failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])
