#!/usr/bin/env bash
# Issue 32 on one H200 (~5-7 min cold, Triton compiles included): the prefill GPU tests, then bench_prefill on
# the 4-layer real slice at 8K / 32K / 128K / 1M tokens (chunks of 8,192; 16 tokens decoded after the 1M prompt).
# Results: benchmarks/results/prefill_{gpu_tests,real4}_h200_<date>.{log,json}. PYTHON overrides the interpreter.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY=${PYTHON:-python}
D=$(date -u +%F)
R=benchmarks/results
# 1) GPU tests: indexer + sparse MLA at a 1M context vs references, a 128K prompt across chunk sizes, the MoE at
#    prefill sizes on the fused path (and its existing decode-size checks).
timeout 200 "$PY" -m pytest -q -s -p no:xdist tests/unittest/test_prefill_gpu.py tests/unittest/test_fused_moe_gpu.py \
  2>&1 | tee "$R/prefill_gpu_tests_h200_$D.log"
# 2) TTFT vs floor, time per op class, compiles during each prompt, peak memory; decode after the 1M prompt; up to
#    32K also the TTFT with the MoE's per-expert loop (what prefill used before: ttft_ms_ab).
timeout 300 "$PY" benchmarks/bench_prefill.py --layers 4 --lens 8192 32768 131072 1048000 --chunks 8192 \
  --decode 16 --profile-kernels 20 --ab-env TRTLLM_GLM_MOE_BACKEND=torch --json "$R/prefill_real4_h200_$D.json" 2>&1 | tee "$R/prefill_real4_h200_$D.log"
