"""Docstring census of the package: module docstrings by line count and the docstrings' share of its lines.

python scripts/docstring_census.py [PACKAGE_DIR] [N_LONGEST]
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

KINDS = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)


def docstring_lines(node: ast.AST) -> int:
    body = getattr(node, "body", [])
    first = body[0] if body else None
    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
        return first.end_lineno - first.lineno + 1
    return 0


def main() -> None:
    root = Path(sys.argv[1] if len(sys.argv) > 1 else "trtllm_glm")
    n_longest = int(sys.argv[2]) if len(sys.argv) > 2 else 20
    files = sorted(root.rglob("*.py"))
    total = 0
    by_kind = {"module": 0, "class": 0, "function": 0}
    modules = []
    for path in files:
        src = path.read_text(encoding="utf-8")
        total += len(src.splitlines())
        for node in ast.walk(ast.parse(src)):
            if not isinstance(node, KINDS):
                continue
            k = docstring_lines(node)
            if isinstance(node, ast.Module):
                by_kind["module"] += k
                modules.append((k, str(path)))
            else:
                by_kind["class" if isinstance(node, ast.ClassDef) else "function"] += k
    doc = sum(by_kind.values())
    print(f"{len(files)} files, {total} lines, {doc} docstring lines ({100 * doc / total:.1f} %)")
    print("  " + ", ".join(f"{kind} {n} ({100 * n / total:.1f} %)" for kind, n in by_kind.items()))
    print(f"module docstrings over 10 lines: {sum(k > 10 for k, _ in modules)}")
    for k, path in sorted(modules, reverse=True)[:n_longest]:
        print(f"{k:4d}  {path}")


if __name__ == "__main__":
    main()
