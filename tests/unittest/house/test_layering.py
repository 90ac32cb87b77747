"""The package's dependency direction (docs/architecture.md, "Package map"): `state/` imports nothing
above `config` / `errors`; `linear/` and `quant/` (kernel packages the modules and the attention call) import
only `triton_interp` and `numerics` (the mode switch); `envs` (the settings registry) imports nothing of
the package, so every room may read it;
`speculative/` (its registry and the MTP package included) never imports `runtime/`, `serve/` or `cli`; nothing below
the runtime imports `runtime/` (module-level or lazily)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.cpu_only

PKG = Path(__file__).resolve().parents[3] / "trtllm_glm"
ENVS = "trtllm_glm.envs"


def imported(path: Path) -> set[str]:
    """Absolute ``trtllm_glm.*`` modules a file imports anywhere (also inside functions); ``from pkg import mod``
    counts as ``pkg.mod`` when ``mod`` is a module."""
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
            for a in node.names:
                sub = PKG.parent.joinpath(*mod.split("."), a.name)
                out.add(f"{mod}.{a.name}" if sub.with_suffix(".py").exists() or sub.is_dir() else mod)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return {m for m in out if m == "trtllm_glm" or m.startswith("trtllm_glm.")}


def files(sub: str) -> list[Path]:
    return sorted((PKG / sub).rglob("*.py"))


@pytest.mark.parametrize(
    ("sub", "allowed"),
    [
        ("state", ("trtllm_glm.config", "trtllm_glm.errors", "trtllm_glm.triton_interp", "trtllm_glm.state", ENVS)),
        ("linear", ("trtllm_glm.triton_interp", "trtllm_glm.numerics", "trtllm_glm.linear", ENVS)),
        # The layers import distributed/: it stays below them (the process machinery lives in runtime/ranks.py).
        (
            "distributed",
            ("trtllm_glm.config", "trtllm_glm.errors", "trtllm_glm.numerics", "trtllm_glm.distributed", ENVS),
        ),
        # trtllm_glm.pdl: launch helpers that import only the settings registry (test below).
        ("quant", ("trtllm_glm.triton_interp", "trtllm_glm.numerics", "trtllm_glm.pdl", "trtllm_glm.quant", ENVS)),
    ],
)
def test_leaf_packages(sub: str, allowed: tuple[str, ...]) -> None:
    for f in files(sub):
        bad = {m for m in imported(f) if not m.startswith(allowed)}
        assert not bad, f"{f.relative_to(PKG)} imports {bad}"


def test_launch_helpers_are_a_leaf() -> None:
    """Kernel modules of every layer import `trtllm_glm.pdl`: it imports nothing of the package but the settings."""
    assert imported(PKG / "pdl.py") <= {ENVS}


def test_settings_registry_is_a_leaf() -> None:
    """Every room reads its environment variables through `trtllm_glm.envs`: it imports nothing of the package."""
    assert imported(PKG / "envs.py") == set()


def test_graph_capture_is_a_leaf() -> None:
    """`trtllm_glm.graph_capture` (every CUDA-graph capture of the package) imports nothing of the package but the
    settings registry (a leaf itself: `TRTLLM_GLM_GRAPH_UPLOAD`)."""
    assert imported(PKG / "graph_capture.py") <= {"trtllm_glm.envs"}


@pytest.mark.parametrize(
    "sub", ["state", "linear", "quant", "distributed", "attention", "kda", "cache", "models", "speculative"]
)
def test_nothing_below_the_runtime_imports_it(sub: str) -> None:
    above = ("trtllm_glm.runtime", "trtllm_glm.serve", "trtllm_glm.cli")
    for f in files(sub):
        bad = {m for m in imported(f) if m.startswith(above)}
        assert not bad, f"{f.relative_to(PKG)} imports {bad}"


def test_speculation_registry_loads_no_drafter() -> None:
    """`speculative/registry.py` imports only the config classes at module level (drafters and their builders lazily,
    context types for type checking only): the CLI builds ``--speculative``'s choices from it without torch."""
    tree = ast.parse((PKG / "speculative" / "registry.py").read_text())
    top = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
    assert {(n.level, n.module) for n in top if isinstance(n, ast.ImportFrom) and n.level} == {(1, "config")}


def test_mtp_graphs_reach_the_runner_through_a_protocol() -> None:
    """MTP's CUDA graphs live beside MTP (`speculative/mtp/`) and see the target's graph runner as
    `speculative.context.TargetGraphRunner`, never `runtime.cuda_graph`."""
    assert "trtllm_glm.speculative.context" in imported(PKG / "speculative" / "mtp" / "graphs.py")
    assert not (PKG / "runtime" / "mtp_graphs.py").exists()


def module_graph() -> dict[str, set[str]]:
    """``module -> modules it imports`` over the package's files, every import statement counted (lazy ones
    too); ``from pkg import name`` points at the submodule ``pkg.name`` when there is one."""
    mods: dict[str, Path] = {}
    for f in PKG.rglob("*.py"):
        name = ".".join(f.relative_to(PKG.parent).with_suffix("").parts)
        mods[name.removesuffix(".__init__")] = f
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for m, f in mods.items():
        parts = m.split(".")
        base = parts if f.name == "__init__.py" else parts[:-1]
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ImportFrom):
                full = ".".join(base[: len(base) - node.level + 1] + ([node.module] if node.module else [])) \
                    if node.level else (node.module or "")  # fmt: skip
                for a in node.names:
                    t = f"{full}.{a.name}" if f"{full}.{a.name}" in mods else full
                    if t in mods and t != m:
                        graph[m].add(t)
            elif isinstance(node, ast.Import):
                graph[m].update(a.name for a in node.names if a.name in mods and a.name != m)
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected sets of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    x = stack.pop()
                    on.discard(x)
                    comp.append(x)
                    if x == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


# Circles tolerated for now: none (runtime/prefix_cache.py names what it needs of the executor as `PrefixHost`).
KNOWN_CIRCLES: list[list[str]] = []


def test_no_import_circles() -> None:
    """Imports run one way between the package's modules (lazy imports inside functions count too)."""
    found = [c for c in circles(module_graph()) if c not in KNOWN_CIRCLES]
    assert not found, "import circles: " + "; ".join(" <-> ".join(c) for c in found)


@pytest.mark.parametrize(
    ("sub", "forbidden"),
    [
        # Activations and the fused MoE are kernel packages the modules call, never the other way round.
        ("act", ("trtllm_glm.modules", "trtllm_glm.moe", "trtllm_glm.models")),
        ("moe", ("trtllm_glm.modules", "trtllm_glm.models")),
        # KDA kernels share names with their references through kda/contract.py, not by importing them.
        ("kda/kernels", ("trtllm_glm.kda.ops", "trtllm_glm.kda.layer")),
        # The runtime (LLM API, its async engine) sits below the server and the CLI.
        ("runtime", ("trtllm_glm.serve", "trtllm_glm.cli")),
        # Attention backends sit below the cache manager, which allocates the planes they declare.
        ("attention", ("trtllm_glm.cache", "trtllm_glm.models")),
        # So does the KDA backend: the manager's state owner allocates the slot planes it declares.
        ("kda", ("trtllm_glm.cache", "trtllm_glm.models", "trtllm_glm.attention")),
    ],
)
def test_imports_run_downward(sub: str, forbidden: tuple[str, ...]) -> None:
    for f in files(sub):
        bad = {m for m in imported(f) if m.startswith(forbidden)}
        assert not bad, f"{f.relative_to(PKG)} imports {bad}"


def test_circle_finder_finds_a_circle() -> None:
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_compile_counter_is_a_leaf() -> None:
    """`trtllm_glm.jit_compiles` (counting Triton compiles for the warm-up and the benchmarks) imports nothing of
    the package."""
    assert imported(PKG / "jit_compiles.py") == set()


@pytest.mark.parametrize("path", ["runtime/executor.py", "models/glm5_next.py", "cache/manager.py"])
def test_runtime_and_model_ask_the_attention_backend(path: str) -> None:
    """The executor, the model and the cache manager get the metadata class, the layers and the planes from the
    attention backend (`attention.registry`), never by a backend's names (the manager re-exports the k-pool's
    `KpoolLayerCache` from its layout module only)."""
    bad = {m for m in imported(PKG / path) if m.startswith("trtllm_glm.attention.sparse")}
    allowed = {"trtllm_glm.attention.sparse.glm_kpool.cache_layout"} if path == "cache/manager.py" else set()
    assert bad <= allowed, bad


@pytest.mark.parametrize("path", ["runtime/executor.py", "models/glm5_next.py", "cache/manager.py"])
def test_runtime_and_model_ask_the_kda_backend(path: str) -> None:
    """The model builds its KDA layers and the cache manager its KDA slot planes from `kda.backend.KdaBackend`, never
    by the layer's or the ops' names; the state owner allocates what the backend declares (`state.SlotPlane`)."""
    bad = {m for m in imported(PKG / path) if m.startswith("trtllm_glm.kda")}
    assert bad <= {"trtllm_glm.kda.backend"}, bad


def test_attention_interface_is_light() -> None:
    """`attention/interface.py` (what every backend implements) imports only the config and the base metadata."""
    assert imported(PKG / "attention" / "interface.py") == {"trtllm_glm.config", "trtllm_glm.attention.metadata"}
