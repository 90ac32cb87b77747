"""A new attention backend is one module: this file holds a whole one (a dense paged attention: its layer, cache
layout and dispatch, the slot-table metadata) and runs the tiny model's executor on it with no other file changed
(docs/architecture.md, "Attention backends")."""

from __future__ import annotations

import math
from types import ModuleType
from typing import Any

import pytest
import torch
from torch import nn

from trtllm_glm.attention.interface import AttentionBackend, PagedPlane
from trtllm_glm.attention.registry import get_attention_backend, register_attention_backend
from trtllm_glm.attention.sparse.glm_kpool.metadata import GlmKpoolMetadata
from trtllm_glm.config import Glm5NextConfig
from trtllm_glm.models.glm5_next import Glm5NextForCausalLM
from trtllm_glm.runtime.executor import Executor, ExecutorConfig
from trtllm_glm.runtime.sampling import SamplingParams

pytestmark = pytest.mark.cpu_only


def dense_paged_attention(
    q: torch.Tensor, kv: torch.Tensor, positions: torch.Tensor, row_seq: torch.Tensor, table: torch.Tensor, P: int
) -> torch.Tensor:
    """Row ``i`` attends every cached row ``0 .. positions[i]`` of its sequence: ``q [N, R]``, ``kv [num_pages, P,
    R]``, ``table [B, W]`` page ids -> ``[N, R]`` (the toy's one op; a backend's kernels would sit beside it)."""
    t = torch.arange(table.shape[1] * P, device=q.device)  # [T] every position the table can hold
    pages = table[row_seq][:, t // P].clamp(min=0)  # [N, T]
    keys = kv[pages, t % P]  # [N, T, R]
    scores = (keys @ q.unsqueeze(-1)).squeeze(-1) / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(t[None, :] > positions[:, None], float("-inf"))
    return (scores.softmax(-1).unsqueeze(-1) * keys).sum(1)


class DenseLayer(nn.Module):
    """``x [N, D]`` -> write this step's rows into the paged ``kv`` plane, attend densely, project back."""

    def __init__(self, config: Glm5NextConfig, ops: ModuleType) -> None:
        super().__init__()
        D, R = config.hidden_size, config.kv_lora_rank
        self.q_proj, self.kv_proj, self.o_proj = (
            nn.Linear(D, R, bias=False),
            nn.Linear(D, R, bias=False),
            nn.Linear(R, D, bias=False),
        )
        self.ops = ops

    def reset_parameters(self, generator: torch.Generator, std: float) -> None:
        for lin in (self.q_proj, self.kv_proj, self.o_proj):
            with torch.no_grad():
                lin.weight.copy_(torch.empty(lin.weight.shape).normal_(0.0, std, generator=generator))

    def forward(self, x: torch.Tensor, meta: GlmKpoolMetadata, cache: dict[str, Any]) -> torch.Tensor:
        P, kv, pos, seq = cache["tokens_per_block"], cache["kv"], meta.positions_t, meta.row_seq_t
        table = meta.slot_table_t
        kv[table[seq, pos // P].long(), pos % P] = self.kv_proj(x).to(kv.dtype)
        return self.o_proj(self.ops.dense_paged_attention(self.q_proj(x), kv, pos, seq, table, P))


class DenseBackend(AttentionBackend):
    """Its metadata (the slot tables of `GlmKpoolMetadata`), one ``kv`` plane of ``[P, kv_lora]`` per page, its
    layer and its ops (this module: a torch op only)."""

    name = "test_dense"
    Metadata = GlmKpoolMetadata
    plane_names = ("kv",)

    def paged_planes(
        self,
        config: Glm5NextConfig,
        *,
        tokens_per_block: int,
        dtype: torch.dtype,
        indexer_key_dtype: torch.dtype,
        latent_dtype: torch.dtype | None = None,
    ) -> tuple[PagedPlane, ...]:
        if latent_dtype not in (None, dtype):  # its op reads the plane as it is: no FP8 format
            raise ValueError(f"the test_dense backend stores kv in the model dtype, not {latent_dtype}")
        return (PagedPlane("kv", (tokens_per_block, config.kv_lora_rank), dtype),)

    def layer_cache(self, manager: Any, layer: int) -> dict[str, Any]:
        return {"kv": manager.planes["kv"][layer], "tokens_per_block": manager.tokens_per_block}

    def make_layer(self, config: Glm5NextConfig, layer_idx: int) -> nn.Module:
        return DenseLayer(config, self.ops(torch.device("cpu")))

    def ops(self, device: torch.device) -> ModuleType:
        import sys

        return sys.modules[__name__]


BACKEND = register_attention_backend(DenseBackend())


def generate(tokens_per_block: int, chunk: int | None) -> tuple[list[list[int]], Executor]:
    config = Glm5NextConfig.from_pretrained("tiny")
    model = Glm5NextForCausalLM(config, attention_backend="test_dense")
    model.reset_parameters(0)
    model.eval()
    cfg = ExecutorConfig(tokens_per_block=tokens_per_block, max_tokens=128, max_batch_size=2, max_num_tokens=32,
                         max_seq_len=64, prefill_chunk_size=chunk)  # fmt: skip
    ex = Executor(model, cfg)
    reqs = [ex.add_request(p, SamplingParams(max_tokens=5, ignore_eos=True)) for p in ([3, 1, 4, 1, 5, 9, 2], [7, 7])]
    ex.run_until_done()
    return [r.output_ids for r in reqs], ex


def test_a_new_backend_runs_the_model() -> None:
    """The model builds its sparse layers from the backend, the manager allocates its plane, the executor its
    metadata; greedy outputs do not depend on the page size or the prefill chunks (the paged gather is right)."""
    assert get_attention_backend("test_dense") is BACKEND
    out, ex = generate(tokens_per_block=4, chunk=3)
    assert set(ex.manager.planes) == {"kv"} and "latent" not in ex.manager.planes and type(ex.meta) is GlmKpoolMetadata
    sparse = [layer.self_attn for layer in ex.model.model.layers if layer.is_sparse]
    assert sparse and all(isinstance(m, DenseLayer) for m in sparse)
    assert ex.manager.planes["kv"].abs().sum() > 0  # the layers wrote their rows
    assert all(len(o) == 5 for o in out)
    assert generate(tokens_per_block=16, chunk=None)[0] == out


def test_registry_refuses_a_second_backend_of_one_name() -> None:
    with pytest.raises(ValueError, match="already registered"):
        register_attention_backend(DenseBackend())
    with pytest.raises(ValueError, match="unknown attention backend"):
        get_attention_backend("no_such_backend")
