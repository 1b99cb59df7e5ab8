#!/usr/bin/env bash
# Fetch (or reuse) the Python sources of one vLLM release that define what
# `vllm serve --speculative-config` accepts, for the contract test of the operator's
# vLLM rendering (tests/integration/test_vllm_contract.py).
#
# The release's wheel is downloaded with pip (no dependencies, nothing installed),
# the few files below are extracted, and the wheel is removed; the files are cached
# outside the repository, keyed by version.  Prints the cache directory on stdout.
#
# Usage: hack/vllm-source.sh VERSION      (e.g. 0.33.0; the test passes
#                                          specula.api.render_vllm.VLLM_VERSION)
# Environment:
#   PYTHON             interpreter whose pip downloads the wheel (default python3)
#   SPECULA_CACHE_DIR  cache root (default: ${XDG_CACHE_HOME:-~/.cache}/specula)
set -euo pipefail

VERSION="${1:?usage: hack/vllm-source.sh VERSION}"
PYTHON="${PYTHON:-python3}"
CACHE_ROOT="${SPECULA_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/specula}"
OUT="$CACHE_ROOT/vllm/$VERSION"
FILES=(
  vllm/config/speculative.py
  vllm/v1/spec_decode/dynamic/utils.py
  vllm/engine/arg_utils.py
  vllm/v1/metrics/loggers.py
  vllm/v1/spec_decode/metrics.py
)

have_all() {
  for f in "${FILES[@]}"; do [[ -s "$OUT/$f" ]] || return 1; done
}

if have_all; then
  echo "$OUT"
  exit 0
fi

mkdir -p "$OUT"
exec 9>"$OUT/.lock"
flock 9
if have_all; then echo "$OUT"; exit 0; fi

TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT
echo "vllm-source: downloading the vllm $VERSION wheel (once; a few hundred MB)" >&2
"$PYTHON" -m pip download --quiet --no-deps --only-binary :all: -d "$TMP" "vllm==$VERSION" >&2
WHEEL="$(ls "$TMP"/vllm-*.whl)"
"$PYTHON" - "$WHEEL" "$OUT" "${FILES[@]}" <<'PY'
import sys
import zipfile

wheel, out, *files = sys.argv[1:]
with zipfile.ZipFile(wheel) as z:
    for name in files:
        z.extract(name, out)
PY
have_all
echo "$OUT"
