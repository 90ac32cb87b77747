"""`trtllm_glm.triton_interp`'s interpreter shortcuts give what Triton's own interpreted path gives."""

from __future__ import annotations

import pytest
import torch

from trtllm_glm import triton_interp
from trtllm_glm.attention.sparse.glm_kpool import kernels as kpool
from trtllm_glm.moe import kernels as moe

pytestmark = pytest.mark.cpu_only


def _cases(g: torch.Generator):
    """Launches of kernels that call ``tl.sort`` on integers (several rows, duplicates, negatives)."""
    ids = torch.randint(-1, 30, (5, 12), generator=g)
    ids[1, 3:6] = 7  # repeated ids
    pos = torch.randint(0, 130, (5,), generator=g)
    topk = torch.rand(9, 40, generator=g).topk(6, dim=1).indices.to(torch.int32)
    live = torch.tensor([1, 0, 1, 1, 0, 1, 1, 1, 0])
    return [
        lambda: kpool.expand_selection(ids, pos, 64),
        lambda: moe.moe_align(topk, 40, 4),
        lambda: moe.moe_align(topk, 40, 8, live),
    ]


def test_integer_sort_shortcut_matches_tritons_sort(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    fast = triton_interp._sort_ints

    def counted(*args, **kwargs):
        out = fast(*args, **kwargs)
        calls.append(out is not None)
        return out

    monkeypatch.setattr(triton_interp, "_sort_ints", counted)
    got = [c() for c in _cases(torch.Generator().manual_seed(3))]
    assert calls and all(calls)  # every sort took the shortcut
    monkeypatch.setattr(triton_interp, "_sort_ints", lambda *a, **k: None)  # Triton's bitonic network
    want = [c() for c in _cases(torch.Generator().manual_seed(3))]
    for a, b in zip(got, want):
        for x, y in zip(a if isinstance(a, tuple) else (a,), b if isinstance(b, tuple) else (b,)):
            assert torch.equal(x, y)


def test_integer_sort_shortcut_declines_floats_and_descending() -> None:
    import numpy as np
    import triton.language as tl
    from triton.runtime.interpreter import TensorHandle

    def block(data: np.ndarray, dtype) -> tl.core.tensor:
        return tl.core.tensor(TensorHandle(data, dtype), tl.block_type(dtype, list(data.shape)))

    ints = block(np.array([3, -1, 2, 2], dtype=np.int32), tl.int32)
    assert triton_interp._sort_ints(ints).handle.data.tolist() == [-1, 2, 2, 3]
    assert triton_interp._sort_ints(ints, descending=True) is None
    assert triton_interp._sort_ints(block(np.array([0.5, -0.0, 0.0, 1.0], dtype=np.float32), tl.float32)) is None


def test_interpreting_restores_the_interpreter() -> None:
    from triton.runtime import interpreter as interp
    from triton.runtime.jit import JITFunction

    before = (interp._patch_lang, vars(interp.GridExecutor)["__call__"], JITFunction.__call__)
    with triton_interp.interpreting():
        assert interp._patch_lang is not before[0]
        with triton_interp.interpreting():  # nested scopes patch once
            pass
        assert interp._patch_lang is not before[0]
        kpool.expand_selection(torch.zeros(1, 2, dtype=torch.int32), torch.tensor([9]), 8)
    assert (interp._patch_lang, vars(interp.GridExecutor)["__call__"], JITFunction.__call__) == before
