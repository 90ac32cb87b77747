"""`benchmarks/bench_e2e.py`'s derived numbers: the oracle's expected tokens per round and the goal lines."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from benchmarks.bench_e2e import expected_tokens_per_step, goal_lines

pytestmark = pytest.mark.cpu_only


@pytest.mark.parametrize(
    ("mode", "want"),
    [("oracle0.7k3", 1 + 0.7 + 0.49 + 0.343), ("oracle0.5", 2 - 0.5**7), ("oracle0.9k3+mix", 3.439), ("mtp3", None)],
)
def test_expected_tokens_per_step(mode: str, want: float | None) -> None:
    got = expected_tokens_per_step(mode)
    assert got == pytest.approx(want) if want is not None else got is None


@pytest.mark.parametrize(
    ("mode", "base", "opts", "k", "rate"),
    [
        ("mtp3", "mtp3", {"adaptive": False}, 3, None),
        ("mtp3+adaptive+dv32", "mtp3", {"adaptive": True, "draft_vocab_size": 32}, 3, None),
        ("mtp3+ov", "mtp3", {"adaptive": False, "overlap_rounds": True}, 3, None),
        ("mtp3+ed+os", "mtp3", {"adaptive": False, "early_draft": True}, 3, None),
        ("mtp3+noed+adaptive", "mtp3", {"adaptive": True, "early_draft": False}, 3, None),
        ("mtporacle0.7k3", "mtporacle0.7k3", {"adaptive": False}, 3, 0.7),
        (
            "mtporacle0.7k3+dv64+fp8h",
            "mtporacle0.7k3",
            {"adaptive": False, "draft_vocab_size": 64, "draft_head_fp8": True},
            3,
            0.7,
        ),
        ("mtporacle0.9", "mtporacle0.9", {"adaptive": False}, 3, 0.9),
        ("oracle0.5k2+mix+mc8", "oracle0.5k2", {"adaptive": False}, 2, 0.5),
    ],
)
def test_mode_suffixes(mode: str, base: str, opts: dict, k: int, rate: float | None) -> None:
    from benchmarks.bench_e2e import base_mode, draft_len, mode_options, oracle_rate

    assert (base_mode(mode), mode_options(mode), draft_len(mode), oracle_rate(mode)) == (base, opts, k, rate)
    with pytest.raises(ValueError, match="unknown mode suffix"):
        base_mode(mode + "+fast")


def test_oracle_goal_line_reports_realised_and_expected() -> None:
    row = {"layers": 4, "batch": 1, "mode": "oracle0.7k3", "graphs": True, "step_ms": 2.5,
           "speedup_vs_plain": 1.6, "tokens_per_step": 2.0, "expected_tokens_per_step": 2.533,
           "step_vs_plain": 1.25, "floor_vs_plain": 1.3}  # fmt: skip
    (line,) = goal_lines([row])
    assert "tokens/s vs plain 1.60" in line and "at both floors 1.54" in line
    assert "2.00 tokens per round realised, 2.53 expected: 2.03 vs plain at this step cost, 1.95 at both floors" in line


def test_fp8_goal_lines_compare_with_the_bf16_step_and_report_quality() -> None:
    plain = {"layers": 4, "batch": 1, "mode": "plain", "graphs": True, "env": None, "ratio_to_floor": 1.8,
             "replay_ms": 1.5, "floor_ms": 0.9}  # fmt: skip
    overlap = dict(plain, mode="overlap")
    rows = [dict(plain, weights="bf16", step_ms=1.6), dict(plain, weights="fp8", step_ms=0.96, fp8_skip=["lm_head"],
            replay_ms=1.2, floor_ms=0.6), dict(overlap, weights="bf16", step_ms=1.5),
            dict(overlap, weights="fp8", step_ms=1.2, floor_ms=0.45, fp8_skip=[]),
            {"layers": 4, "mode": "quality", "weights": "fp8", "kl_fp8": 1.5e-4, "argmax_fp8": 0.97,
             "kl_bf16": 2e-5, "argmax_bf16": 0.99}]  # fmt: skip
    lines = goal_lines(rows)
    assert any("plain fp8: fp8 step / bf16 step 0.60 (goal <= 0.6 at batch 1); the graphs alone 0.80, the floors "
               "0.67 (fp8_skip ['lm_head'])" in x for x in lines)  # fmt: skip
    # The overlap scheduler's fp8 row is compared with the bf16 overlap row, not with the plain one.
    assert any("overlap fp8: fp8 step / bf16 step 0.80 (goal <= 0.6 at batch 1); the graphs alone 1.00, the floors "
               "0.50 (fp8_skip [])" in x for x in lines)  # fmt: skip
    assert any("KL(bf16-dequantised || fp8) 1.50e-04, argmax 97.0%; bf16 floor KL(fp32 || bf16) 2.00e-05" in x
               for x in lines)  # fmt: skip


@pytest.mark.parametrize("skip", [["lm_head"], []], ids=["head-bf16", "head-fp8"])
def test_quality_reports_the_fp8_lm_head_beside_the_floor(skip: list[str]) -> None:
    """``--quality``'s row carries the FP8 LM head (issue 44): KL(bf16 || bf16 + FP8 head) beside the floor, the FP8
    trunk with the FP8 head, the head alone; the model's own head is put back after each head swap."""
    import torch

    from benchmarks.bench_e2e import quality
    from trtllm_glm.config import QuantConfig
    from trtllm_glm.models.glm5_next import Glm5NextForCausalLM
    from trtllm_glm.modules.linear import Fp8Linear

    m = Glm5NextForCausalLM.from_pretrained("tiny", dtype="bfloat16")
    m.quantize_fp8_(QuantConfig.block_fp8(128, skip))
    head = m.lm_head
    q = quality(m, 24)
    # Each FP8-head swap put the model's own head back (a float head is the same module; an FP8 one was dequantised
    # with the rest of the model).
    assert (m.lm_head is head) == bool(skip) and not isinstance(m.lm_head, Fp8Linear)
    assert q["positions"] == 24 and q["kl_head_fp8"] > 0 and q["kl_head_fp8_fp32"] > 0
    assert q["kl_fp8_head_fp8"] > 0 and isinstance(q["head_within_floor"], bool)
    if not skip:  # the head was FP8 already: the FP8 path as held is the FP8-head row
        assert q["kl_fp8_head_fp8"] == q["kl_fp8"]
    assert m.lm_head.weight.dtype == torch.float32  # quality's last step: the model in fp32, head float
    (line,) = [x for x in goal_lines([dict(q, layers=4, mode="quality", weights="fp8")]) if "lm_head" in x]
    assert "fp8 lm_head (24 positions): KL(bf16 || bf16 + fp8 head)" in line and "the floor" in line


def test_torchrun_two_ranks_build_their_shares_and_rank0_reports(tmp_path: Path) -> None:
    """The multi-GPU path on the CPU: 2 gloo ranks (TP=2, EP=2), each drawing its own FP8 share; rank 0's rows
    carry the world and the busiest rank's floor, and the speculative row is lossless against plain."""
    import json
    import os
    import subprocess

    from trtllm_glm.distributed.process_group import free_port

    root = Path(__file__).resolve().parents[3]
    out = tmp_path / "rows.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
           "-m", "benchmarks.bench_e2e", "--preset", "tiny", "--device", "cpu", "--dtype", "float32", "--layers", "4",
           "--batch", "2",
           "--modes", "plain", "oracle0.7k3", "--gen", "8", "--prompt-len", "12", "--tp", "2", "--ep", "2",
           "--weights", "fp8", "--oracle-passes", "2", "--json", str(out)]  # fmt: skip
    env = dict(
        os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])
    )
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(out.read_text())
    assert [r["mode"] for r in rows] == ["plain", "oracle0.7k3"]
    for r in rows:
        assert (r["world_size"], r["tp"], r["ep"], r["weights"]) == (2, 2, 2, "fp8")
        assert r["floor_gb"] > 0 and r["build_s"] > 0
    assert rows[1]["vs_plain"]["diverged"] == 0
    # Only rank 0 prints rows.
    assert proc.stdout.count('"mode": "plain"') == 1


def test_batch_invariant_goal_lines() -> None:
    """Issue 31: the mode's plain step against the default plain step, and its speculative rows' divergences."""
    base = {"layers": 4, "batch": 1, "graphs": True, "env": None, "weights": "bf16", "ratio_to_floor": 1.5,
            "replay_ms": 1.0, "floor_ms": 1.0}  # fmt: skip
    rows = [
        {**base, "mode": "plain", "step_ms": 10.0, "batch_invariant": False},
        {**base, "mode": "plain", "step_ms": 10.5, "batch_invariant": True},
        {
            **base,
            "mode": "mtp3",
            "step_ms": 12.0,
            "batch_invariant": True,
            "vs_plain": {"identical": 1, "near_tie": 0, "diverged": 0, "gaps": []},
        },  # fmt: skip
        {
            **base,
            "mode": "ngram7",
            "step_ms": 12.0,
            "batch_invariant": True,
            "vs_plain": {"identical": 0, "near_tie": 1, "diverged": 0, "gaps": [0.01]},
        },  # fmt: skip
    ]
    lines = [x for x in goal_lines(rows) if "batch-invariant" in x]
    assert lines[0].endswith("step / default plain step 1.050 (goal <= 1.10)")
    assert "1 identical to plain, 0 near ties, 0 diverged (goal: all identical) OK" in lines[1]
    assert lines[2].endswith("MISSED")
    # The default-mode goals still compare with the default plain step.
    assert any("plain bf16: step / floor 1.50" in x for x in goal_lines(rows))


def test_fp8_floors_on_the_meta_device() -> None:
    """`benchmarks/fp8_floors.py`: FP8 floors below bf16's, lower still with the LM head in FP8, and the LM head's
    share of the FP8 floor shrinking with the batch (more experts reached)."""
    from benchmarks.fp8_floors import floors

    kept = [floors(4, b, ["lm_head"], 64, "tiny", 4000.0) for b in (1, 16)]
    quantised = floors(4, 1, [], 64, "tiny", 4000.0)
    assert all(0 < r["fp8_ms"] < r["bf16_ms"] for r in kept)
    assert quantised["fp8_ms"] < kept[0]["fp8_ms"] and quantised["bf16_ms"] == kept[0]["bf16_ms"]
    assert kept[1]["lm_head_share_fp8"] < kept[0]["lm_head_share_fp8"]


def test_mtp_oracle_mode_drafts_through_the_mtp_layer(monkeypatch) -> None:
    """``mtporacleAkK``: every round runs the real MTP layer (catch-up and chained steps), yet the proposed
    drafts are the oracle's: all accepted at A = 1, none at A = 0, and the output is plain greedy's."""
    import torch

    from benchmarks.bench_e2e import run_case
    from trtllm_glm.models.glm5_next import Glm5NextForCausalLM

    torch.manual_seed(0)
    model = Glm5NextForCausalLM.from_pretrained("tiny", layers=[0, 1, 2, 3], dtype="float32").eval()
    plain = run_case(model, "plain", 2, 12, 16, "cpu")
    rows = []
    orig = model.mtp_forward

    def counted(tokens, *a, **k):
        rows.append(int(tokens.shape[0]))
        return orig(tokens, *a, **k)

    monkeypatch.setattr(model, "mtp_forward", counted)
    for acc in (1.0, 0.0):
        rows.clear()
        r = run_case(model, f"mtporacle{acc}k3", 2, 12, 16, "cpu", continuation=plain["outputs"])
        assert r["outputs"] == plain["outputs"]
        # Random weights accept nothing: the acceptance is the oracle's. Every round drafted through the MTP
        # layer: a catch-up and two chained steps per round.
        assert r["mean_accepted"] > 3.0 if acc == 1.0 else r["mean_accepted"] == 1.0
        steps = round(2 * 16 / r["tokens_per_step"])  # decode steps timed (2 requests, 16 tokens each, fewer timed)
        assert len(rows) >= 2 * steps
        assert r["drafter_proposals"] > 0 and not r["adaptive"] and not r["overlap"]
        # Interpreted kernels never compile: nothing counted inside the timed steps on the CPU.
        assert r["timed_compiles"] == 0 and r["timed_compile_names"] == []


def test_mtp_oracle_mode_rows(tmp_path: Path) -> None:
    """The benchmark's command line on the tiny preset: rows name mode, K, acceptance and the overlap setting."""
    import json
    import os
    import subprocess

    root = Path(__file__).resolve().parents[3]
    out = tmp_path / "rows.json"
    cmd = [sys.executable, "-m", "benchmarks.bench_e2e", "--preset", "tiny", "--device", "cpu", "--dtype", "float32",
           "--layers", "4",
           "--batch", "2", "--modes", "plain", "mtporacle0.7k3", "mtporacle0.7k3+adaptive", "mtporacle0.7k3+dv64",
           "mtporacle0.7k3+fp8h",
           "--gen", "8",
           "--prompt-len", "12", "--oracle-passes", "2", "--json", str(out)]  # fmt: skip
    env = dict(
        os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])
    )
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {r["mode"]: r for r in json.loads(out.read_text())}
    fixed, adaptive = rows["mtporacle0.7k3"], rows["mtporacle0.7k3+adaptive"]
    for r in (fixed, adaptive):
        assert (r["K"], r["acceptance"], r["overlap"], r["drafter"]) == (3, 0.7, False, "mtp+oracle")
        assert r["vs_plain"]["diverged"] == 0 and r["expected_tokens_per_step"] == pytest.approx(2.533)
    assert not fixed["adaptive"] and adaptive["adaptive"] and sum(adaptive["adaptive_k"].values()) > 0
    st = adaptive["adaptive_state"]
    assert fixed["adaptive_state"] is None and 0 < st["acceptance"] <= 1 and st["chosen_head"]
    assert sum(adaptive["adaptive_k"].values()) >= len(st["chosen_head"])
    assert set(st["costs_ms"]) <= {"0", "1", "2", "3"}
    # Random weights ship no ranking: under the oracle the restricted head is timed with the first N ids.
    dv = rows["mtporacle0.7k3+dv64"]
    assert dv["draft_vocab_size"] == 64 and fixed["draft_vocab_size"] is None and dv["vs_plain"]["diverged"] == 0
    assert not dv["draft_head_fp8"] and rows["mtporacle0.7k3+fp8h"]["draft_head_fp8"]
    assert rows["mtporacle0.7k3+fp8h"]["draft_vocab_size"] is None
    assert rows["plain"]["K"] == 0 and rows["plain"]["acceptance"] is None


def test_fp8_latent_quality_rows(tmp_path: Path) -> None:
    """``--latent-dtype fp8 --quality`` on the tiny preset (index_topk 16, prompt 40): the plain case runs on the FP8
    latent cache and the quality row reports KL(model dtype || FP8 latent) beside the fp32 || model-dtype floor."""
    import json
    import os
    import subprocess

    root = Path(__file__).resolve().parents[3]
    out = tmp_path / "rows.json"
    cmd = [sys.executable, "-m", "benchmarks.bench_e2e", "--preset", "tiny", "--device", "cpu", "--dtype", "bfloat16",
           "--layers", "4", "--batch", "1", "--modes", "plain", "--gen", "4", "--prompt-len", "40",
           "--latent-dtype", "fp8", "--quality", "--json", str(out)]  # fmt: skip
    env = dict(
        os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])
    )
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {r["mode"]: r for r in json.loads(out.read_text())}
    q = rows["latent_quality"]
    assert (q["prompt_len"], q["index_topk"], q["selecting_rows"]) == (40, 16, 24)
    # The FP8 latent moves the logits (a cache that ignored the option would give exactly 0) but little.
    assert 0 < q["kl_latent_fp8_fp32"] < q["kl_floor"] and q["argmax_latent_fp8_fp32"] > 0.9
    assert q["kl_floor"] > 0 and q["kl_latent_fp8"] < 10 * q["kl_floor"] and q["argmax_latent_fp8"] > 0.5
    assert "fp8 latent quality (40 tokens, index_topk 16)" in proc.stdout
    bad = subprocess.run([*cmd[:3], "--trained", "--quality"], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert bad.returncode != 0 and "add --latent-dtype fp8" in bad.stderr
