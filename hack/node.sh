#!/usr/bin/env bash
# Build (or reuse) the node binaries of a real single-node cluster: kubelet,
# kube-scheduler and kube-proxy, from the Go module proxy in the wrapper module that
# hack/control-plane.sh prepares (same Kubernetes release), with the version stamped
# in (so `kubectl version` can parse what the node and the scheduler report).
# Cached outside the repository, keyed by version; a warm run is a no-op.  Prints the
# binary directory on stdout.
#
# Environment: as hack/control-plane.sh (SPECULA_K8S_VERSION, SPECULA_CACHE_DIR).
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
K8S_VERSION="${SPECULA_K8S_VERSION:-v1.34.3}"
CACHE_ROOT="${SPECULA_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/specula}"
OUT="$CACHE_ROOT/node/$K8S_VERSION"
BIN="$OUT/bin"
BINARIES=(kubelet kube-scheduler kube-proxy)

have_all() {
  for b in "${BINARIES[@]}"; do [[ -x "$BIN/$b" ]] || return 1; done
}

if have_all; then
  echo "$BIN"
  exit 0
fi

bash "$HERE/control-plane.sh" >/dev/null
SRC="$CACHE_ROOT/control-plane/$K8S_VERSION/src"
mkdir -p "$BIN"
exec 9>"$OUT/.lock"
flock 9
if have_all; then echo "$BIN"; exit 0; fi

echo "node: building kubelet, kube-scheduler, kube-proxy $K8S_VERSION (a cold kubelet build takes minutes)" >&2
cd "$SRC"
export GOFLAGS=-mod=mod
export CGO_ENABLED=0
major="${K8S_VERSION#v}"; major="${major%%.*}"
minor="${K8S_VERSION#v*.}"; minor="${minor%%.*}"
pkg=k8s.io/component-base/version
ldflags="-s -w -X $pkg.gitVersion=$K8S_VERSION -X $pkg.gitMajor=$major -X $pkg.gitMinor=$minor"
ldflags="$ldflags -X $pkg.gitTreeState=clean"
for b in "${BINARIES[@]}"; do
  go build -trimpath -ldflags "$ldflags" -o "$BIN/$b" "k8s.io/kubernetes/cmd/$b" >&2
done
echo "$K8S_VERSION" > "$OUT/VERSION"
have_all
echo "$BIN"
