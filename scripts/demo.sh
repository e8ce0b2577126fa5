#!/usr/bin/env bash
# Sets everything up and runs Flamefleet locally:
#
#   sudo scripts/demo.sh          install prerequisites, build, start the local control plane,
#                                 install the CRDs, apply examples/ and show them
#   sudo scripts/demo.sh down     stop the local control plane
#
# The control plane keeps running after the demo; use the kubeconfig it prints.
set -euo pipefail
# shellcheck source=scripts/env.sh
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
require_root "it installs packages and, in later stages, loads eBPF programs"
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

step "local control plane (etcd + kube-apiserver, no kubelet)"
"$CP" up

step "CRDs"
k apply --server-side --field-manager=flamefleet-demo -f crds/
k wait --for=condition=Established --timeout=60s \
  crd/profilerequests.flamefleet.dev crd/samplingpolicies.flamefleet.dev crd/clustersamplingpolicies.flamefleet.dev

step "examples in namespace $NS"
k create namespace "$NS" --dry-run=client -o yaml | k apply -f -
k apply -n "$NS" -f examples/

step "the API server validates requests itself (this one must be rejected)"
if k apply -n "$NS" -f - <<'YAML' 2>&1; then die "an invalid ProfileRequest was accepted"; fi
apiVersion: flamefleet.dev/v1alpha1
kind: ProfileRequest
metadata: {name: too-long}
spec: {type: cpu, podNames: [web-0], duration: 1h, cpu: {frequencyHz: 5000}}
YAML

# Later stages (operator, agents, captures) start here.

step "kubectl get preq,sp -n $NS; kubectl get csp"
k get preq,sp -n "$NS"
k get csp

KUBECONFIG_PATH="$("$CP" paths | awk -F= '$1 == "KUBECONFIG" {print $2}')"
KUBECTL_PATH="$("$CP" paths | awk -F= '$1 == "KUBECTL" {print $2}')"
cat <<EOF2

The local control plane keeps running. Try:
  export KUBECONFIG=$KUBECONFIG_PATH
  $KUBECTL_PATH get preq -n $NS          (or: scripts/controlplane.sh kubectl get preq -n $NS)
Stop it with: sudo scripts/demo.sh down
EOF2
