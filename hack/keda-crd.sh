#!/usr/bin/env bash
# Fetch (or reuse) KEDA's ScaledObject CustomResourceDefinition for the integration
# tests, taken from KEDA's published Go module (config/crd/bases in the module zip
# that the Go module proxy serves), so the API server validates the ScaledObjects
# the operator renders against KEDA's own schema.  Cached outside the repository,
# keyed by version.  Prints the CRD file's path on stdout.
#
# Environment:
#   SPECULA_KEDA_VERSION  KEDA release (default below)
#   SPECULA_CACHE_DIR     cache root (default: ${XDG_CACHE_HOME:-~/.cache}/specula)
set -euo pipefail

KEDA_VERSION="${SPECULA_KEDA_VERSION:-v2.21.0}"
CACHE_ROOT="${SPECULA_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/specula}"
OUT="$CACHE_ROOT/keda/$KEDA_VERSION"
CRD="$OUT/keda.sh_scaledobjects.yaml"

if [[ -s "$CRD" ]]; then
  echo "$CRD"
  exit 0
fi

command -v go >/dev/null || { echo "keda-crd: 'go' is required to download KEDA's module" >&2; exit 1; }
mkdir -p "$OUT"
exec 9>"$OUT/.lock"
flock 9
if [[ -s "$CRD" ]]; then echo "$CRD"; exit 0; fi

# Outside any module, so no go.mod is read or written.
cd "$OUT"
DIR="$(GOFLAGS=-mod=mod GO111MODULE=on go mod download -json "github.com/kedacore/keda/v2@$KEDA_VERSION" \
       | python3 -c 'import json,sys; d=json.load(sys.stdin); print(d.get("Dir") or ""); sys.exit(1 if d.get("Error") else 0)')"
SRC="$DIR/config/crd/bases/keda.sh_scaledobjects.yaml"
[[ -s "$SRC" ]] || { echo "keda-crd: $SRC not found in the module" >&2; exit 1; }
cp "$SRC" "$CRD.tmp"
mv "$CRD.tmp" "$CRD"
echo "$CRD"
