"""Pool-selection recall of our indexer against the `transformers` reference's float selection.

Shared by tests/integration/test_indexer_keys_parity.py and benchmarks/indexer_keys_fidelity.py. Both sides
are read through forward hooks on the indexers: the reference's ``self_attn.indexer`` returns ``[B, S, width]``
selected token ids of one full forward; ours returns ``[N, width]`` for the rows of one prefill pass (use an
LLM without prefix caching and with the prompt in one chunk, so that one pass covers every row).
"""

from __future__ import annotations

from typing import Any

import torch

from trtllm_glm import LLM, SamplingParams


def pool_sets(sel: torch.Tensor, n_rows: int) -> list[set[int]]:
    """Selected complete pools of rows ``0 .. n_rows-1`` (row ``r`` at position ``r``; open tail excluded)."""
    out = []
    for pos in range(n_rows):
        n_complete = (pos + 1) // 4
        out.append({int(t) // 4 for t in sel[pos].tolist() if t >= 0 and int(t) // 4 < n_complete})
    return out


def recall_counts(ours: torch.Tensor, ref: torch.Tensor, n_rows: int) -> tuple[int, int]:
    """``(reference pools we also selected, reference pools)`` over the prompt rows."""
    hit = total = 0
    for a, b in zip(pool_sets(ours, n_rows), pool_sets(ref, n_rows)):
        hit += len(a & b)
        total += len(b)
    return hit, total


def reference_selections(model: Any, ids: list[int]) -> list[torch.Tensor]:
    """``[S, width]`` selected token ids of every sparse layer of the reference (one full forward)."""
    sel: list[torch.Tensor] = []
    hooks = [
        m.register_forward_hook(lambda _m, _i, o: sel.append(o[0].clone()))
        for n, m in model.named_modules()
        if n.endswith("self_attn.indexer")
    ]
    try:
        with torch.no_grad():
            model(input_ids=torch.tensor([ids]), use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    return sel


def our_selections(llm: LLM, ids: list[int]) -> list[torch.Tensor]:
    """``[len(ids), width]`` selections of every sparse layer of the trunk for the prompt rows."""
    sel: list[torch.Tensor] = []
    hooks = [
        layer.self_attn.indexer.register_forward_hook(lambda _m, _i, o: sel.append(o.clone()))
        for layer in llm.model.model.layers
        if layer.is_sparse
    ]
    try:
        llm.generate(ids, SamplingParams(max_tokens=1))
    finally:
        for h in hooks:
            h.remove()
    return sel


def assert_differences_at_near_ties(
    ids_ref: torch.Tensor, ids_ker: torch.Tensor, s_ref: torch.Tensor, bound: torch.Tensor, rel: float = 2e-5
) -> None:
    """Two top-k pool selections ``[N, k]`` (``-1`` padding) may differ only at near ties of the reference scores
    ``s_ref [N, pools]`` around each row's threshold: within ``rel`` of the error bound ``bound [N, pools]``."""
    s_cpu, tol = s_ref.cpu(), (rel * bound).cpu()
    for r in (ids_ref != ids_ker).any(dim=1).nonzero().flatten().tolist():
        a = {p for p in ids_ref[r].tolist() if p >= 0}
        b = {p for p in ids_ker[r].tolist() if p >= 0}
        thr = min(s_cpu[r, p].item() for p in a)
        for p in a ^ b:
            gap = abs(s_cpu[r, p].item() - thr)
            assert gap <= tol[r, p].item() + tol[r].max().item(), f"row {r} pool {p}: not a near tie ({gap:.3e})"
