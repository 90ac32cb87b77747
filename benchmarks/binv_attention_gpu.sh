#!/usr/bin/env bash
# GPU checks of the batch-invariant mode's attention part (issue 31, docs/numerics.md), one H200,
# under 4 minutes warm: the bitwise row-invariance tests, the verify kernel's accuracy tests (its state update is
# now an explicit fma), and the default-vs-mode cost of each changed launch.
#   benchmarks/binv_attention_gpu.sh                 # tests + benchmark (JSON to $OUT, default /tmp)
#   BASE=17ca36a benchmarks/binv_attention_gpu.sh    # also: the new tests against the code before the mode's
#                                                    # fixes (KDA and sparse-MLA tests must fail, indexer pass)
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
rc=0
$PY -m pytest -q -p no:xdist -m gpu tests/unittest/test_binv_attention_gpu.py tests/unittest/test_kda_verify_kernel_gpu.py || rc=1
$PY benchmarks/bench_binv_attention.py --quick --json "${OUT:-/tmp}/bench_binv_attention.json" || rc=1
if [ -n "${BASE:-}" ]; then
  tmp=$(mktemp -d)
  git worktree add -q --detach "$tmp" "$BASE"
  cp tests/unittest/test_binv_attention_gpu.py "$tmp/tests/unittest/"
  echo "== the new tests on $BASE (the fixes removed): failures expected =="
  (cd "$tmp" && PYTHONPATH=$tmp $PY -m pytest -q -p no:xdist -m gpu -rf tests/unittest/test_binv_attention_gpu.py)
  git worktree remove --force "$tmp"
fi
exit $rc
