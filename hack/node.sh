#!/usr/bin/env bash
# Prepare this machine to run a real single-node cluster (specula/devcluster):
#  1. install the Debian packages a node needs, where any is missing: containerd,
#     runc, the CNI plugins, iptables, conntrack, and buildah and debootstrap for
#     images (needs root and apt-get; exit status 3 says the machine cannot);
#  2. build (or reuse) kubelet, kube-scheduler and kube-proxy from the Go module proxy
#     in the wrapper module that hack/control-plane.sh prepares (same Kubernetes
#     release), with the version stamped in (so `kubectl version` can parse what the
#     node and the scheduler report).
# Binaries are cached outside the repository, keyed by version; a warm run is a no-op.
# Prints the binary directory on stdout.
#
# Environment: as hack/control-plane.sh (SPECULA_K8S_VERSION, SPECULA_CACHE_DIR).
set -euo pipefail

# command -> Debian package
declare -A PACKAGES=(
  [containerd]=containerd [runc]=runc [iptables]=iptables [conntrack]=conntrack
  [buildah]=buildah [debootstrap]=debootstrap [/usr/lib/cni/bridge]=containernetworking-plugins
)
missing=()
for cmd in "${!PACKAGES[@]}"; do
  if [[ "$cmd" == /* ]]; then [[ -x "$cmd" ]] && continue; else command -v "$cmd" >/dev/null && continue; fi
  missing+=("${PACKAGES[$cmd]}")
done
if [[ ${#missing[@]} -gt 0 ]]; then
  if [[ $(id -u) -ne 0 ]] || ! command -v apt-get >/dev/null; then
    echo "node: missing ${missing[*]}, and installing them needs root and apt-get" >&2
    exit 3
  fi
  echo "node: apt-get install ${missing[*]}" >&2
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq >&2
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >&2
fi

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
