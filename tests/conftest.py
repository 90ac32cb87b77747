"""Shared pytest set-up: markers, CUDA skipping, and the server tests' optional dependencies.

Layout: ``tests/unittest/<area>/`` mirrors the package's rooms (a ``*_gpu.py`` twin beside its CPU file),
``tests/integration/`` runs the whole stack (``integration/serve/``: a real server or engine process). Every folder
is a package (``__init__.py``), so test files may share a name across folders; shared helpers live at ``tests/``
and are imported as ``tests.<helper>`` (the repository root is on ``sys.path`` through pytest's ``pythonpath``),
a GPU twin imports its CPU twin relatively (``from .test_grammar import ...``)."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

# The server tests need the `serve` extra (and the official `openai` client). Where it is not installed
# (e.g. a GPU machine set up for the kernels) they are not collected, so `pytest -m gpu tests` works there.
# CI installs everything and sets TRTLLM_GLM_REQUIRE_SERVE=1: a missing package is then an error, never a
# silently skipped suite.
_SERVE_DEPS = ("fastapi", "uvicorn", "httpx", "prometheus_client", "yaml", "openai", "llguidance", "zmq", "msgspec")
_missing = [m for m in _SERVE_DEPS if importlib.util.find_spec(m) is None]
collect_ignore_glob = ["unittest/serve/*", "integration/serve/*"] if _missing else []
if _missing and os.environ.get("TRTLLM_GLM_REQUIRE_SERVE") == "1":
    raise RuntimeError(f"TRTLLM_GLM_REQUIRE_SERVE=1 but the serve extra is incomplete: missing {_missing}")

# Test tensors are tiny: intra-op threads only add OpenMP spin-waits, and with pytest-xdist (one worker
# per core) they oversubscribe the cores and slow every step down by orders of magnitude.
torch.set_num_threads(1)


# Modules whose tests start first: collected late, the soak (~2.5 min on 2 cores) ran alone at the end of the suite on
# one of the two workers, the other idle.
_FIRST = ("tests/integration/test_soak.py",)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    items.sort(key=lambda item: not item.nodeid.startswith(_FIRST))  # stable: the rest keep their order
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


# Kernels the CPU tests ran through Triton's interpreter are also compiled for the H200 (sm_90, no GPU needed):
# the interpreter never compiles, so a kernel can pass every interpreted test and fail to build on the GPU.
# Per test module, the distinct launches (argument types and constexpr values) are compiled in a fresh process
# at teardown; a failure errors the module's last test. TRTLLM_GLM_SKIP_COMPILE_CHECK=1 turns it off.
_COMPILED: set[str] = set()


@pytest.fixture(autouse=True, scope="module")
def _interpreted_kernels_compile_for_sm90():
    if torch.cuda.is_available() or os.environ.get("TRTLLM_GLM_SKIP_COMPILE_CHECK") == "1":
        yield
        return
    from tests.triton_compile import compile_sm90, recording

    with recording() as rec:
        yield
    new = [s for k, s in rec.specs.items() if k not in _COMPILED]
    problems = [f"launch not described: {u}" for u in dict.fromkeys(rec.unsupported)]
    if new:
        for spec, res in zip(new, compile_sm90(new)):
            _COMPILED.add(spec.key)
            if not res["ok"]:
                problems.append(f"{spec.module}.{spec.kernel} {spec.constexprs}: {res['error'][:2000]}")
    if problems:
        pytest.fail("kernels that do not compile for sm_90:\n" + "\n".join(problems), pytrace=False)
