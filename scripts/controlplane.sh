#!/usr/bin/env bash
# The local control plane: a real etcd and kube-apiserver on loopback, with RBAC, an admin
# client certificate and a kubeconfig. No kubelet, scheduler or controller-manager.
#
#   scripts/controlplane.sh build     build kube-apiserver, etcd and kubectl into the cache
#                                      (skipped when the cached binaries report the pinned version)
#   scripts/controlplane.sh up        start etcd + kube-apiserver in the background, write a kubeconfig
#   scripts/controlplane.sh down      stop them
#   scripts/controlplane.sh status    show whether they run, and the kubeconfig path
#   scripts/controlplane.sh kubectl … run the pinned kubectl against the local control plane
#
# Versions are pinned in e2e/controlplane/go.mod (k8s.io/kubernetes and go.etcd.io/etcd/server/v3).
# Binaries go to $FLAMEFLEET_CACHE/bin (default /var/cache/flamefleet/bin), outside the clone.
# State (certs, etcd data, logs, kubeconfig) goes to $FLAMEFLEET_STATE (default <repo>/.flamefleet/controlplane).
set -euo pipefail

# shellcheck source=scripts/env.sh
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
BIN="$FLAMEFLEET_CACHE/bin"
STATE="${FLAMEFLEET_STATE:-$REPO/.flamefleet/controlplane}"
GOMOD="$REPO/e2e/controlplane/go.mod"

# pinned_version MODULE: the version go.mod requires for MODULE.
pinned_version() {
  awk -v m="$1" '$1 == m && $2 ~ /^v/ { print $2; exit }' "$GOMOD"
}
K8S_VERSION="$(pinned_version k8s.io/kubernetes)"
ETCD_VERSION="$(pinned_version go.etcd.io/etcd/server/v3)"
[[ -n "$K8S_VERSION" && -n "$ETCD_VERSION" ]] || {
  echo "controlplane.sh: cannot read the pinned k8s.io/kubernetes and etcd versions from $GOMOD" >&2
  exit 1
}
APISERVER="$BIN/kube-apiserver-$K8S_VERSION"
ETCD="$BIN/etcd-$ETCD_VERSION"
KUBECTL="$BIN/kubectl-$K8S_VERSION"

# Stamp the Kubernetes version into the binaries (a plain `go build` reports v0.0.0-master,
# which makes kubectl warn about version skew).
k8s_ldflags() {
  local minor="${K8S_VERSION#v1.}"; minor="${minor%%.*}"
  local flags="-s -w"
  for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
    flags+=" -X $pkg.gitVersion=$K8S_VERSION -X $pkg.gitMajor=1 -X $pkg.gitMinor=$minor -X $pkg.gitTreeState=clean"
  done
  echo "$flags"
}

# is_cached BINARY EXPECTED_VERSION_SUBSTRING VERSION_ARGS...
is_cached() {
  local bin="$1" want="$2" out; shift 2
  [[ -x "$bin" ]] || return 1
  out="$("$bin" "$@" 2>/dev/null)" || return 1
  [[ "$out" == *"$want"* ]]
}

cmd_build() {
  command -v go >/dev/null || { echo "controlplane.sh: Go is required to build the control plane; run scripts/setup.sh" >&2; exit 1; }
  mkdir -p "$BIN"
  cd "$REPO/e2e/controlplane"
  local ldflags; ldflags="$(k8s_ldflags)"
  if is_cached "$APISERVER" "Kubernetes $K8S_VERSION" --version; then
    echo "kube-apiserver $K8S_VERSION: cached at $APISERVER"
  else
    echo "building kube-apiserver $K8S_VERSION (first time: several minutes) ..."
    local t0=$SECONDS
    go build -trimpath -ldflags "$ldflags" -o "$APISERVER.tmp" k8s.io/kubernetes/cmd/kube-apiserver
    mv "$APISERVER.tmp" "$APISERVER"
    echo "built $APISERVER in $((SECONDS - t0))s"
  fi
  if is_cached "$KUBECTL" "$K8S_VERSION" version --client; then
    echo "kubectl $K8S_VERSION: cached at $KUBECTL"
  else
    echo "building kubectl $K8S_VERSION ..."
    local t0=$SECONDS
    go build -trimpath -ldflags "$ldflags" -o "$KUBECTL.tmp" k8s.io/kubernetes/cmd/kubectl
    mv "$KUBECTL.tmp" "$KUBECTL"
    echo "built $KUBECTL in $((SECONDS - t0))s"
  fi
  if is_cached "$ETCD" "etcd Version: ${ETCD_VERSION#v}" --version; then
    echo "etcd $ETCD_VERSION: cached at $ETCD"
  else
    echo "building etcd $ETCD_VERSION ..."
    local t0=$SECONDS
    go build -trimpath -ldflags "-s -w" -o "$ETCD.tmp" ./cmd/etcd
    mv "$ETCD.tmp" "$ETCD"
    echo "built $ETCD in $((SECONDS - t0))s"
  fi
}

controlplane_bin() {
  # The Rust side owns certificates, ports, process start and readiness (the same code the
  # tests use); build it once into the cargo target dir.
  cargo build --quiet --manifest-path "$REPO/Cargo.toml" \
    -p flamefleet-e2e --bin flamefleet-controlplane >&2
  echo "$CARGO_TARGET_DIR/debug/flamefleet-controlplane"
}

export FLAMEFLEET_KUBE_APISERVER="$APISERVER" FLAMEFLEET_ETCD="$ETCD"

case "${1:-}" in
  build) cmd_build ;;
  up) "$(controlplane_bin)" up --dir "$STATE" ;;
  down) "$(controlplane_bin)" down --dir "$STATE" ;;
  status) "$(controlplane_bin)" status --dir "$STATE" ;;
  kubectl) shift; exec "$KUBECTL" --kubeconfig "$STATE/kubeconfig" "$@" ;;
  paths) printf 'APISERVER=%s\nETCD=%s\nKUBECTL=%s\nSTATE=%s\nKUBECONFIG=%s\n' "$APISERVER" "$ETCD" "$KUBECTL" "$STATE" "$STATE/kubeconfig" ;;
  *) sed -n '2,16p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 2 ;;
esac
