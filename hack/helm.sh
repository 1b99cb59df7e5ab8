#!/usr/bin/env bash
# Build (or reuse) the Helm 3 CLI used by the chart tests.
#
# Compiled from the Go module proxy (`go install helm.sh/helm/v3/cmd/helm@VERSION`)
# with the version ldflags a release build sets, so `helm version` reports the
# release.  Cached outside the repository, keyed by version, so a warm run is a
# no-op.  Prints the binary directory on stdout.
#
# Environment:
#   SPECULA_HELM_VERSION  Helm release to build (default below)
#   SPECULA_CACHE_DIR     cache root (default: ${XDG_CACHE_HOME:-~/.cache}/specula)
set -euo pipefail

HELM_VERSION="${SPECULA_HELM_VERSION:-v3.19.5}"
CACHE_ROOT="${SPECULA_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/specula}"
OUT="$CACHE_ROOT/helm/$HELM_VERSION"
BIN="$OUT/bin"

if [[ -x "$BIN/helm" ]]; then
  echo "$BIN"
  exit 0
fi

command -v go >/dev/null || { echo "helm: 'go' is required to build Helm" >&2; exit 1; }

mkdir -p "$BIN"
exec 9>"$OUT/.lock"
flock 9
if [[ -x "$BIN/helm" ]]; then echo "$BIN"; exit 0; fi

echo "helm: building Helm $HELM_VERSION (a cold build takes a while on few cores)" >&2
# Build into a scratch GOBIN and move the binary in last, so an interrupted build
# never leaves a half-written helm that a later run would take as cached.
TMP_BIN="$(mktemp -d "$OUT/build.XXXXXX")"
trap 'rm -rf "$TMP_BIN"' EXIT
PKG=helm.sh/helm/v3
# The variables Helm's own Makefile sets.  Without them `helm version` reports a dev
# build, and `helm template`/`helm lint` assume Kubernetes v1.20, which fails charts
# that declare a newer kubeVersion.  Like that Makefile, the Kubernetes version is one
# major above the k8s.io/client-go module version Helm is built with (v0.34 -> 1.34).
HELM_GOMOD="$(GOFLAGS=-mod=mod go mod download -json "$PKG@$HELM_VERSION" \
  | python3 -c 'import json,sys; print(json.load(sys.stdin)["GoMod"])')"
CLIENT_GO="$(sed -n 's#^[[:space:]]*k8s.io/client-go v\([0-9]*\)\.\([0-9]*\)\..*#\1 \2#p' "$HELM_GOMOD")"
read -r K8S_MAJOR K8S_MINOR <<<"$CLIENT_GO"
[[ -n "${K8S_MINOR:-}" ]] || { echo "helm: no k8s.io/client-go version in $HELM_GOMOD" >&2; exit 1; }
K8S_MAJOR=$((K8S_MAJOR + 1))
LDFLAGS="-s -w -X $PKG/internal/version.version=$HELM_VERSION -X $PKG/internal/version.gitTreeState=clean"
for p in pkg/lint/rules pkg/chartutil; do
  LDFLAGS+=" -X $PKG/$p.k8sVersionMajor=$K8S_MAJOR -X $PKG/$p.k8sVersionMinor=$K8S_MINOR"
done
CGO_ENABLED=0 GOFLAGS=-mod=mod GOBIN="$TMP_BIN" \
  go install -trimpath -ldflags "$LDFLAGS" "$PKG/cmd/helm@$HELM_VERSION" >&2
mv "$TMP_BIN/helm" "$BIN/helm"
echo "$HELM_VERSION" > "$OUT/VERSION"
"$BIN/helm" version --short >&2
echo "$BIN"
