"""The indexer writes its rows of the selection buffer whole (no -1 fill and copy, two launches per sparse layer and
step): the reference `expand_selection` takes ``out`` as the kernel does, and a step's hidden states do not depend on
what the buffer held before (CPU)."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from trtllm_glm import LLM, SamplingParams
from trtllm_glm.attention.sparse.glm_kpool import ops as R
from trtllm_glm.attention.sparse.glm_kpool.indexer import GlmKpoolIndexer
from trtllm_glm.config import Glm5NextConfig
from trtllm_glm.models.glm5_next import Glm5NextForCausalLM
from trtllm_glm.runtime.executor import Executor

pytestmark = pytest.mark.cpu_only

_FORWARD, _INDEXER = Executor._forward, GlmKpoolIndexer.forward  # the originals (each run patches its own spies)


def test_reference_expand_selection_writes_out_whole() -> None:
    g = torch.Generator().manual_seed(0)
    positions = torch.randint(0, 90, (9,), generator=g)
    ids = R.select_topk_pools(torch.randn(9, 30, generator=g), positions, 4)
    ref = R.expand_selection(ids, positions, 19)
    out = torch.randint(-5, 1000, (9, 19), generator=g, dtype=torch.int32)
    got = R.expand_selection(ids, positions, 19, out=out)
    assert got.data_ptr() == out.data_ptr() and torch.equal(got, ref)
    with pytest.raises(ValueError, match="out must be"):
        R.expand_selection(ids, positions, 19, out=torch.empty(9, 18, dtype=torch.int32))


class _Fills(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        self.n += func.overloadpacket.__name__ == "fill_"
        return func(*args, **(kwargs or {}))


def _steps(monkeypatch, poison: bool) -> tuple[list[torch.Tensor], int]:
    """Hidden states of a few mixed steps of the tiny model (prefills next to decodes), and the ``fill_`` ops its
    indexers issued; ``poison``: the selection buffer is overwritten with garbage before every step."""
    model = Glm5NextForCausalLM.from_config(Glm5NextConfig.from_pretrained("tiny"), seed=1, dtype="float32")
    llm = LLM(model, device="cpu")
    ex = llm.executor
    hidden: list[torch.Tensor] = []
    fills = _Fills()
    forward, indexer = _FORWARD, _INDEXER

    def spy(self, plan):  # noqa: ANN001, ANN202
        if poison:
            self.meta.selection_buf.fill_(12345)
        h = forward(self, plan)
        hidden.append(h.clone())
        return h

    def counted(self, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        with fills:
            return indexer(self, *args, **kwargs)

    monkeypatch.setattr(Executor, "_forward", spy)
    monkeypatch.setattr(GlmKpoolIndexer, "forward", counted)
    p = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    ex.add_request(list(range(3, 40)), p)
    ex.step()
    ex.add_request(list(range(50, 61)), p)
    while ex.has_work:
        ex.step()
    return hidden, fills.n


def test_selection_needs_no_fill(monkeypatch) -> None:
    ref, _ = _steps(monkeypatch, poison=False)
    got, fills = _steps(monkeypatch, poison=True)
    assert len(got) == len(ref) and all(torch.equal(a, b) for a, b in zip(got, ref))
    assert fills == 0
