#!/usr/bin/env bash
# Build (or reuse) the binaries of a real Kubernetes control plane for the
# integration tests: etcd, kube-apiserver, kube-controller-manager and kubectl.
#
# They are compiled from the Go module proxy through a small wrapper module that
# pins k8s.io/kubernetes and replaces each k8s.io/* staging module (which the
# kubernetes go.mod points at ./staging/...) with its published v0.X.Y release.
# Binaries are cached outside the repository, keyed by version, so a warm run is
# a no-op.  Prints the binary directory on stdout.
#
# Environment:
#   SPECULA_K8S_VERSION   Kubernetes release to build (default below)
#   SPECULA_CACHE_DIR     cache root (default: ${XDG_CACHE_HOME:-~/.cache}/specula)
set -euo pipefail

K8S_VERSION="${SPECULA_K8S_VERSION:-v1.34.3}"
CACHE_ROOT="${SPECULA_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/specula}"
OUT="$CACHE_ROOT/control-plane/$K8S_VERSION"
BIN="$OUT/bin"
BINARIES=(etcd kube-apiserver kube-controller-manager kubectl)

have_all() {
  for b in "${BINARIES[@]}"; do [[ -x "$BIN/$b" ]] || return 1; done
  # Binaries of an older script lack the version stamp; rebuild them.
  grep -q ' stamped$' "$OUT/VERSION" 2>/dev/null
}

if have_all; then
  echo "$BIN"
  exit 0
fi

command -v go >/dev/null || { echo "control-plane: 'go' is required to build Kubernetes binaries" >&2; exit 1; }

mkdir -p "$OUT/src" "$BIN"
exec 9>"$OUT/.lock"
flock 9
if have_all; then echo "$BIN"; exit 0; fi

cd "$OUT/src"
STAGING_VERSION="v0.${K8S_VERSION#v1.}"
# The kubernetes go.mod lists every staging module it replaces with a local path.
KMOD="$(GOFLAGS=-mod=mod go mod download -json "k8s.io/kubernetes@$K8S_VERSION" \
        | python3 -c 'import json,sys; print(json.load(sys.stdin)["GoMod"])')"
mapfile -t STAGING < <(sed -n 's#^[[:space:]]*\(k8s.io/[a-z0-9-]*\) => ./staging/.*#\1#p' "$KMOD")
[[ ${#STAGING[@]} -gt 10 ]] || { echo "control-plane: could not read staging modules from $KMOD" >&2; exit 1; }

{
  echo "module specula.dev/controlplane"
  echo
  echo "go 1.24.0"
  echo
  echo "require k8s.io/kubernetes $K8S_VERSION"
  echo
  for m in "${STAGING[@]}"; do echo "replace $m => $m $STAGING_VERSION"; done
} > go.mod
cat > tools.go <<'GO'
//go:build tools

package controlplane
GO

echo "control-plane: building Kubernetes $K8S_VERSION (cold builds take a while on few cores)" >&2
export GOFLAGS=-mod=mod
export CGO_ENABLED=0
go get "k8s.io/kubernetes@$K8S_VERSION" >&2
# etcd at the version kubernetes itself depends on.
ETCD_VERSION="$(go list -m -f '{{.Version}}' go.etcd.io/etcd/server/v3)"
go get "go.etcd.io/etcd/server/v3@$ETCD_VERSION" >&2
# The version a release build stamps in (without it binaries report v0.0.0-master, which
# `kubectl version` cannot parse).
major="${K8S_VERSION#v}"; major="${major%%.*}"
minor="${K8S_VERSION#v*.}"; minor="${minor%%.*}"
pkg=k8s.io/component-base/version
kflags="-s -w -X $pkg.gitVersion=$K8S_VERSION -X $pkg.gitMajor=$major -X $pkg.gitMinor=$minor"
kflags="$kflags -X $pkg.gitTreeState=clean"
for b in kube-apiserver kube-controller-manager kubectl; do
  go build -trimpath -ldflags "$kflags" -o "$BIN/$b" "k8s.io/kubernetes/cmd/$b" >&2
done
go build -trimpath -ldflags "-s -w" -o "$BIN/etcd" go.etcd.io/etcd/server/v3 >&2
echo "$K8S_VERSION etcd=$ETCD_VERSION stamped" > "$OUT/VERSION"
have_all
echo "$BIN"
