#!/usr/bin/env bash
# Creates (or reuses) ./.venv with the pinned CPU stack and installs trtllm_glm in editable mode.
# Idempotent: a second run only checks that the pins are satisfied.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --disable-pip-version-check -r requirements/ci.txt
.venv/bin/python -m pip install -q --disable-pip-version-check --no-deps -e .
