#!/usr/bin/env bash
# The batch-invariant mode's GPU checks and measurements (issue 31, docs/numerics.md), on one H200 from the repository
# root: the GPU tests (kernels' row invariance at real shapes; speculative == plain and alone == in batch, bit for bit,
# on the 4-layer real slice), the per-kernel cost, and bench_e2e's rows with the mode off and on.
# Results go to ${R:-benchmarks/results} (the date in the file names).
set -euo pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1
R=${R:-benchmarks/results}
D=$(date -u +%Y-%m-%d)
mkdir -p "$R"
# A failing test does not stop the measurements below (the log keeps it).
python -m pytest -q -p no:xdist -m gpu -rf tests/unittest/test_batch_invariant_gpu.py 2>&1 \
  | tee "$R/batch_invariant_gpu_tests_$D.log" || echo "gpu_batch_invariant: some GPU tests failed (see the log)"
python benchmarks/bench_invariant_linear.py --quick --fp8 --json "$R/invariant_linear_h200_$D.json" 2>&1 \
  | tee "$R/invariant_linear_h200_$D.log"
python benchmarks/bench_e2e.py --layers 4 --batch 1 16 --modes plain mtp3 ngram7 --cuda-graphs on \
  --prompt-len 256 --gen 32 --batch-invariant both --json "$R/e2e_batch_invariant_h200_$D.json" 2>&1 \
  | tee "$R/e2e_batch_invariant_h200_$D.log"
grep '\[goal\]' "$R/e2e_batch_invariant_h200_$D.log" | grep batch-invariant
