#!/usr/bin/env bash
# The GPU tests on a CUDA machine without network access that has Python 3.12, torch,
# triton and transformers: installs the wheels `make gpu-wheels` downloaded (carried in
# .wheels) into a scratch directory, then runs every test marked `gpu` that needs no
# operator or cluster package (tests/gpu and tests/runtime; two GPUs add the
# tensor-parallel and all-reduce tests). The demo models are found as `make test-gpu`
# finds them (after `make demo`, or SPECULA_DEMO_DIR).
#
#   bash hack/test-gpu.sh [pytest arguments]
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
WHEELS=${WHEELS:-$ROOT/.wheels}
SITE=${SITE:-$(mktemp -d)}
PY=${PYTHON:-python3}
"$PY" -m pip install --quiet --no-deps --target "$SITE" "$WHEELS"/*.whl
cd "$ROOT"
# test_server_fuzz is the CPU-only HTTP fuzzing (schemathesis): nothing in it is marked gpu.
PYTHONPATH="$SITE:$ROOT${PYTHONPATH:+:$PYTHONPATH}" exec "$PY" -m pytest -m gpu tests/gpu \
  tests/runtime --ignore=tests/runtime/test_server_fuzz.py "$@"
