#!/usr/bin/env bash
# Wheels for `pytest -m gpu` on a CUDA machine without network access that already has
# Python 3.12, torch, triton and transformers: the packages below, at the versions of the
# project's virtual environment (`make setup`), downloaded without their dependencies
# (the list closes over what the tests import beyond the preinstalled stack).
#
#   bash hack/gpu-wheels.sh [DEST]        (default DEST: .wheels)
#
# On the GPU machine, `bash hack/test-gpu.sh` installs them and runs the GPU tests.
# The wheels are for CPython 3.12 on x86_64 Linux, whatever Python runs this script.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
DEST=${1:-$ROOT/.wheels}
PY=${PYTHON:-$ROOT/.venv/bin/python}
PACKAGES=(
  pydantic pydantic_core annotated_types typing_inspection typing_extensions
  fastapi starlette annotated_doc uvicorn click h11 anyio idna sniffio
  prometheus_client pyyaml packaging
  pytest pluggy iniconfig pygments pytest_timeout
  openai httpx2 httpcore2 truststore jiter httpx httpcore certifi
  speculators opentelemetry_api hs_connectors datasets dill multiprocess loguru
)
mkdir -p "$DEST"
rm -f "$DEST"/*.whl  # wheels of other versions would clash at install
pins=$("$PY" - "${PACKAGES[@]}" <<'PYEOF'
import importlib.metadata as md
import sys
print(" ".join(f"{name}=={md.version(name)}" for name in sys.argv[1:]))
PYEOF
)
# shellcheck disable=SC2086
"$PY" -m pip download --quiet --no-deps --only-binary :all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform manylinux_2_28_x86_64 -d "$DEST" $pins
echo "gpu-wheels: $(ls "$DEST"/*.whl | wc -l) wheels in $DEST"
