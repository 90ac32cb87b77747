"""`benchmarks/bench_prefill.py`'s derived numbers: the FLOP count behind the compute floor, the time per op class
(host clock on the CPU) and the goal lines."""

from __future__ import annotations

import time

import pytest
import torch

from benchmarks.bench_prefill import (
    goal_lines,
    install_class_timer,
    make_llm,
    prompt_ids,
    timed_prompt,
)
from benchmarks.harness.floors import pool_rows, prefill_flops, selected_rows
from trtllm_glm.config import Glm5NextConfig
from trtllm_glm.models.glm5_next import Glm5NextForCausalLM, subset_config

pytestmark = pytest.mark.cpu_only


def test_pair_counts_match_brute_force() -> None:
    for n in range(0, 41):
        assert pool_rows(n) == sum((t + 1) // 4 for t in range(n))
        for w in (1, 5, 16):
            assert selected_rows(n, w) == sum(min(t + 1, w) for t in range(n))


def test_flops_count_every_trunk_matrix_and_top_k_experts() -> None:
    cfg = subset_config(Glm5NextConfig.from_pretrained("glm-5.3-flash"), [0, 1, 2, 3])
    cfg.num_nextn_predict_layers = 0
    with torch.device("meta"):
        m = Glm5NextForCausalLM(cfg)
    n = 1000
    f = prefill_flops(cfg, m, n)
    mats = sum(p.numel() for name, p in m.model.layers.named_parameters() if p.dim() >= 2 and ".experts." not in name)
    weights = f["kda_proj"] + f["mla_proj"] + f["mlp"] + f["other_gemm"] - 2 * cfg.vocab_size * cfg.hidden_size
    assert weights == pytest.approx(2 * n * mats)
    assert f["moe_routed"] == 2 * n * 8 * 3 * 4096 * 2048  # one MoE layer (3), top-8 of 288
    assert f["indexer_score"] == 2 * 32 * 128 * pool_rows(n)
    assert f["sparse_mla"] == 4 * 64 * 512 * selected_rows(n, 2048)
    # ~2.7 GFLOP per prompt token for this slice at short contexts (the rough count said ~2.3).
    assert 2.5e9 < sum(f.values()) / n < 3.0e9


def test_class_timer_attributes_a_prompt_on_the_cpu() -> None:
    cfg = Glm5NextConfig.from_pretrained("small")
    model = Glm5NextForCausalLM.from_config(cfg, seed=0, dtype="float32", device="cpu")
    timer = install_class_timer(model, "cpu")
    llm = make_llm(model, 200, 64, 16, graphs=False)
    try:
        t0 = time.perf_counter()
        with timer.timing():
            row = timed_prompt(llm, prompt_ids(150, cfg.vocab_size, 0), 0, "cpu")
        wall = (time.perf_counter() - t0) * 1e3
        got = timer.totals()
    finally:
        llm.shutdown()
        timer.remove()
    assert {"kda_core", "kda_layer", "indexer_score", "topk", "sparse_mla", "moe", "mla_layer", "other"} <= set(got)
    assert all(v >= 0 for v in got.values())
    assert sum(got.values()) <= wall and row["ttft_ms"] <= wall
    # An empty timing block records nothing (earlier ranges are dropped).
    with timer.timing():
        pass
    assert timer.totals() == {}


def test_goal_lines() -> None:
    rows = [
        {"impl": "ours", "layers": 4, "prompt_len": 32768, "chunk": 8192, "ttft_ms": 300.0,
         "compute_floor_ms": 120.0, "ratio": 2.5},
        {"impl": "ours", "layers": 4, "prompt_len": 131072, "chunk": 8192, "ttft_ms": 2000.0,
         "compute_floor_ms": 500.0, "ratio": 4.0},
        {"impl": "ours", "layers": 4, "prompt_len": 1048000, "chunk": 8192, "ttft_ms": 30000.0,
         "compute_floor_ms": 5300.0, "ratio": 5.66, "peak_gib": 60.0, "decode_ms_per_token": 9.5},
    ]  # fmt: skip
    a, b, c = goal_lines(rows)
    rows[1].update(transient_gib=7.0, est_workspace_gib=6.0)
    assert any("[check] 131072 tokens" in line and "undercounts" in line for line in goal_lines(rows))
    assert "32768 tokens" in a and "2.50x" in a and "MET" in a and "NOT MET" not in a
    assert "131072 tokens" in b and "NOT MET" in b
    assert "1048000 tokens" in c and "30.0 s" in c and "9.5 ms/token" in c
