"""The package's dependency direction (docs/architecture.md, "Package map"): `state/` imports nothing
above `config` / `errors`; `linear/` (a kernel package the modules and the attention call) imports only
`triton_interp`; `speculative/` never imports `runtime/`, `serve/` or `cli`; nothing below the runtime imports
`runtime/` (module-level or lazily)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.cpu_only

PKG = Path(__file__).resolve().parents[2] / "trtllm_glm"


def imported(path: Path) -> set[str]:
    """Absolute ``trtllm_glm.*`` modules a file imports anywhere (also inside functions)."""
    parts = list(path.relative_to(PKG.parent).with_suffix("").parts)
    pkg = parts[:-1]  # the package a relative import starts from (the same for __init__.py)
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg[: len(pkg) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            out.add(mod)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return {m for m in out if m == "trtllm_glm" or m.startswith("trtllm_glm.")}


def files(sub: str) -> list[Path]:
    return sorted((PKG / sub).rglob("*.py"))


@pytest.mark.parametrize(
    ("sub", "allowed"),
    [
        ("state", ("trtllm_glm.config", "trtllm_glm.errors", "trtllm_glm.triton_interp", "trtllm_glm.state")),
        ("linear", ("trtllm_glm.triton_interp", "trtllm_glm.linear")),
    ],
)
def test_leaf_packages(sub: str, allowed: tuple[str, ...]) -> None:
    for f in files(sub):
        bad = {m for m in imported(f) if not m.startswith(allowed)}
        assert not bad, f"{f.relative_to(PKG)} imports {bad}"


@pytest.mark.parametrize("sub", ["state", "linear", "attention", "kda", "cache", "models", "speculative"])
def test_nothing_below_the_runtime_imports_it(sub: str) -> None:
    above = ("trtllm_glm.runtime", "trtllm_glm.serve", "trtllm_glm.cli")
    for f in files(sub):
        bad = {m for m in imported(f) if m.startswith(above)}
        assert not bad, f"{f.relative_to(PKG)} imports {bad}"


def _module(path: Path) -> str:
    parts = list(path.relative_to(PKG.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def test_runtime_modules_import_one_way() -> None:
    """No import circle among `runtime/`'s modules (lazy and TYPE_CHECKING imports count: issue 33 found
    `executor` <-> `prefix_cache`; the prefix cache now names what it needs as the `PrefixHost` protocol)."""
    mods = {_module(f): f for f in files("runtime")}
    edges = {m: {t for t in imported(f) if t in mods and t != m} for m, f in mods.items()}
    assert "trtllm_glm.runtime.executor" not in edges["trtllm_glm.runtime.prefix_cache"]

    def reaches(src: str, dst: str) -> bool:
        seen, todo = set(), [src]
        while todo:
            for t in edges[todo.pop()]:
                if t == dst:
                    return True
                if t not in seen:
                    seen.add(t)
                    todo.append(t)
        return False

    circles = sorted(m for m in mods if reaches(m, m))
    assert not circles, f"import circle through {circles}"
