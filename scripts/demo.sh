#!/usr/bin/env bash
# Sets everything up and runs Flamefleet locally, end to end:
#
#   sudo scripts/demo.sh          install prerequisites, build, start a fresh local control
#                                 plane, install the CRDs, apply examples/, then run the main
#                                 job: a demo workload in a pod-shaped cgroup, a node agent and
#                                 the operator as processes, and `kubectl profile cpu|heap|runqlat`
#                                 capturing it and downloading real profiles
#   sudo scripts/demo.sh down     stop the local control plane
#
# The control plane keeps running after the demo; use the kubeconfig it prints. Profiles,
# logs and state go to $FLAMEFLEET_DEMO_DIR (default <repo>/.flamefleet/demo).
set -euo pipefail
# shellcheck source=scripts/env.sh
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
require_root "it installs packages, loads eBPF programs and creates cgroups"
cd "$REPO"
NS=flamefleet-demo
CP="$REPO/scripts/controlplane.sh"
k() { "$CP" kubectl "$@"; }

if [[ "${1:-}" == down ]]; then
  "$CP" down
  exit 0
fi

[[ "${FLAMEFLEET_SKIP_SETUP:-}" == 1 ]] || { step "prerequisites"; "$REPO/scripts/setup.sh"; }

step "build"
cargo build --workspace --bins

step "local control plane (etcd + kube-apiserver, no kubelet), fresh state"
"$CP" down >/dev/null 2>&1 || true
"$CP" up

step "CRDs"
k apply --server-side --field-manager=flamefleet-demo -f crds/
k wait --for=condition=Established --timeout=60s \
  crd/profilerequests.flamefleet.dev crd/samplingpolicies.flamefleet.dev crd/clustersamplingpolicies.flamefleet.dev

step "examples/ validate against the API server (server-side dry run)"
k create namespace "$NS" --dry-run=client -o yaml | k apply -f -
k apply --dry-run=server -n "$NS" -f examples/

step "the API server validates requests itself (this one must be rejected)"
if k apply -n "$NS" -f - <<'YAML' 2>&1; then die "an invalid ProfileRequest was accepted"; fi
apiVersion: flamefleet.dev/v1alpha1
kind: ProfileRequest
metadata: {name: too-long}
spec: {type: cpu, podNames: [web-0], duration: 1h, cpu: {frequencyHz: 5000}}
YAML

KUBECONFIG_PATH="$("$CP" paths | awk -F= '$1 == "KUBECONFIG" {print $2}')"
KUBECTL_PATH="$("$CP" paths | awk -F= '$1 == "KUBECTL" {print $2}')"
DEMO_DIR="${FLAMEFLEET_DEMO_DIR:-$REPO/.flamefleet/demo}"

step "the main job: agent + operator + demo workload, profiled with kubectl profile"
"$CARGO_TARGET_DIR/debug/flamefleet-demo" \
  --kubeconfig "$KUBECONFIG_PATH" \
  --dir "$DEMO_DIR" \
  --bins "$CARGO_TARGET_DIR/debug" \
  --workload "$REPO/examples/demo-workload/checkout.c" \
  --duration "${FLAMEFLEET_DEMO_DURATION:-10s}"

step "kubectl get preq -n $NS"
k get preq -n "$NS"

cat <<EOF2

The local control plane keeps running. Try:
  export KUBECONFIG=$KUBECONFIG_PATH
  $KUBECTL_PATH get preq -n $NS   (or: scripts/controlplane.sh kubectl get preq -A)
  $CARGO_TARGET_DIR/debug/kubectl-profile list -n $NS
Profiles: $DEMO_DIR/profiles
Stop it with: sudo scripts/demo.sh down
EOF2
