"""`runtime.prefill_memory`: a prefill chunk's transient buffers, estimated before allocation and checked with the
cache by the executor."""

from __future__ import annotations

import pytest
import torch

import trtllm_glm.models.glm5_next as glm
from trtllm_glm.cache.manager import Glm5NextCacheManager
from trtllm_glm.config import Glm5NextConfig
from trtllm_glm.errors import CheckpointError
from trtllm_glm.models.glm5_next import Glm5NextForCausalLM
from trtllm_glm.runtime.executor import Executor, ExecutorConfig
from trtllm_glm.runtime.prefill_memory import (
    MAX_STEP_ROWS_CUDA,
    check_step_rows,
    prefill_workspace,
    prefill_workspace_bytes,
)

pytestmark = pytest.mark.cpu_only

GIB = 1 << 30


def test_real_geometry_at_one_million_tokens() -> None:
    """8K chunks of GLM-5.3-Flash at a 1M context: the indexer's [8192, 262144] fp32 scores (8 GiB) dominate; the
    total stays a fraction of an H200 and grows with the context and the chunk."""
    cfg = Glm5NextConfig.from_pretrained("glm-5.3-flash")
    ws = prefill_workspace(cfg, 8192, 1 << 20)
    assert ws["sparse_mla"] >= 8192 * (1 << 18) * 4 == 8 * GIB
    assert ws["sparse_mla"] > max(ws["kda"], ws["ffn"])
    assert ws["total"] == ws["hidden"] + ws["sparse_mla"] < 24 * GIB
    # The score width is a power of two: one token past 1M doubles the score matrix.
    assert prefill_workspace(cfg, 8192, (1 << 20) + 4)["sparse_mla"] > ws["sparse_mla"] + 7 * GIB
    assert prefill_workspace_bytes(cfg, 8192, 32768) < prefill_workspace_bytes(cfg, 8192, 1 << 20)
    assert prefill_workspace_bytes(cfg, 4096, 1 << 20) < ws["total"]
    # The MoE's pair buffer is bounded by the slab of FUSED_MAX_ROWS rows whatever the chunk.
    big = prefill_workspace(cfg, 65536, 32768)
    assert big["ffn"] < 8192 * 8 * 4096 * 4 + 65536 * 4096 * 4 + 3 * GIB


def test_executor_refuses_a_cache_plus_workspace_that_cannot_fit(monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = Glm5NextConfig.from_pretrained("tiny")
    model = Glm5NextForCausalLM.from_config(cfg)
    ecfg = ExecutorConfig(tokens_per_block=16, max_tokens=4096, max_batch_size=2, max_num_tokens=256, max_seq_len=2048)
    ex = Executor(model, ecfg)
    kw = dict(num_pages=256, tokens_per_block=16, max_num_requests=2, include_mtp_layer=ex._target_stores_mtp_layer(),
              dtype=ex.dtype)  # fmt: skip
    cache = Glm5NextCacheManager.estimate_bytes(cfg, **kw)
    ws = prefill_workspace_bytes(cfg, 256, 2048, ex.dtype)
    assert ex.workspace_bytes == ws > 0
    # Room for the cache but not for the chunk's workspace: refused up front, naming both.
    monkeypatch.setattr(glm, "free_bytes", lambda device: cache + ws - 1)
    with pytest.raises(CheckpointError, match=r"prefill chunk's workspace .* need about"):
        Executor(model, ecfg)
    monkeypatch.setattr(glm, "free_bytes", lambda device: cache + ws)
    assert Executor(model, ecfg).workspace_bytes == ws


def test_step_rows_past_the_cuda_grid_limit_are_refused() -> None:
    check_step_rows(MAX_STEP_ROWS_CUDA, "cuda")
    check_step_rows(1 << 20, "cpu")  # the CPU path has no grid limit
    with pytest.raises(ValueError, match="max_num_tokens=65536 exceeds 65535"):
        check_step_rows(65536, torch.device("cuda", 0))


def test_batch_invariant_mode_counts_the_attention_split_partials() -> None:
    """The mode fixes the sparse-MLA split count per selection width (11 at the real model's 2,051), so prefill
    rows carry fp32 partials too, `PARTIAL_SLAB_ROWS` rows at a time; the default mode's prefill rows have none.
    (H200 2026-12-04: a mode prompt of 8K allocated 6.4 GiB against an estimate of 3.9 before this was counted.)"""
    from trtllm_glm.attention.sparse.glm_kpool.kernels.sparse_mla import PARTIAL_SLAB_ROWS
    from trtllm_glm.numerics import batch_invariant_mode

    cfg = Glm5NextConfig.from_pretrained("glm-5.3-flash")
    off = prefill_workspace(cfg, 8192, 32768, batch_invariant=False)
    on = prefill_workspace(cfg, 8192, 32768, batch_invariant=True)
    heads, rank = cfg.num_attention_heads, cfg.kv_lora_rank
    assert on["sparse_mla"] - off["sparse_mla"] == PARTIAL_SLAB_ROWS * 11 * heads * (rank + 1) * 4
    assert on["total"] > off["total"]
    # Few rows: the partials of those rows only.
    small = prefill_workspace(cfg, 64, 32768, batch_invariant=True)["sparse_mla"]
    assert small - prefill_workspace(cfg, 64, 32768, batch_invariant=False)["sparse_mla"] == 64 * 11 * heads * 513 * 4
    # Without the argument, the process's mode decides.
    with batch_invariant_mode(True):
        assert prefill_workspace_bytes(cfg, 8192, 32768) == on["total"]
    assert prefill_workspace_bytes(cfg, 8192, 32768) == off["total"]
