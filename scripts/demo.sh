#!/usr/bin/env bash
# Sets everything up and runs Flamefleet locally, end to end, on a real one-node cluster:
#
#   scripts/demo.sh          install prerequisites; start the one-node cluster (kubelet,
#                            containerd, kube-proxy, CoreDNS: scripts/cluster.sh); build and
#                            import the images; helm install Flamefleet from charts/flamefleet;
#                            deploy the demo workload; profile it with
#                            `kubectl profile cpu|heap|runqlat|offcpu` and download real
#                            profiles (printing the top blocking stacks of the off-CPU one);
#                            profile a Python and a Java service with `kubectl profile
#                            cpu` (printing their top functions and methods); let a Go
#                            service grow until its memory limit OOM-kills it, and show the
#                            heap profile a policy's memory trigger took before the kill;
#                            then scale the workloads to 0 (they keep the CPUs busy)
#   scripts/demo.sh down     uninstall Flamefleet and stop the cluster
#
# Run as root (no sudo needed). The cluster keeps running after the demo; the kubeconfig is
# printed at the end. Profiles go to $FLAMEFLEET_DEMO_DIR (default <repo>/.flamefleet/demo).
set -euo pipefail
# shellcheck source=scripts/env.sh
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
require_root "it runs a kubelet and containerd and loads eBPF programs"
cd "$REPO"

RELEASE=flamefleet
SYSTEM_NS=flamefleet-system
DEMO_NS=flamefleet-demo
STORE_NODE_PORT=30808
STORE_DIR=/var/lib/flamefleet/artifacts
DEMO_DIR="${FLAMEFLEET_DEMO_DIR:-$REPO/.flamefleet/demo}"
DURATION="${FLAMEFLEET_DEMO_DURATION:-10s}"
T0=$SECONDS

if [[ "${1:-}" == down ]]; then
  if "$REPO/scripts/cluster.sh" status 2>/dev/null | grep -q "kube-apiserver .*running"; then
    eval "$("$REPO/scripts/tools.sh" paths)"
    KUBECONFIG="$("$REPO/scripts/cluster.sh" env | awk -F= '$1 == "KUBECONFIG" {print $2}')"
    "$HELM" --kubeconfig "$KUBECONFIG" uninstall "$RELEASE" -n "$SYSTEM_NS" --wait 2>/dev/null || true
  fi
  "$REPO/scripts/cluster.sh" down
  exit 0
fi

[[ "${FLAMEFLEET_SKIP_SETUP:-}" == 1 ]] || { step "prerequisites (scripts/setup.sh)"; "$REPO/scripts/setup.sh"; }

step "the one-node cluster (scripts/cluster.sh up)"
"$REPO/scripts/cluster.sh" up
eval "$("$REPO/scripts/cluster.sh" env | sed 's/^/export /')"
eval "$("$REPO/scripts/tools.sh" paths)"
KUBECTL="$FLAMEFLEET_CACHE/bin/kubectl-$(awk '$1 == "k8s.io/kubernetes" && $2 ~ /^v/ {print $2; exit}' "$REPO/e2e/controlplane/go.mod")"
k() { "$KUBECTL" "$@"; }

step "images (release build; imported into the node's containerd) and kubectl profile"
"$REPO/scripts/images.sh" build
"$REPO/scripts/images.sh" import
TAG="$("$REPO/scripts/images.sh" tag)"
cargo build --release --quiet -p kubectl-profile
# kubectl finds plugins on PATH: `kubectl profile` runs kubectl-profile.
mkdir -p "$FLAMEFLEET_CACHE/plugins"
install -m 0755 "$CARGO_TARGET_DIR/release/kubectl-profile" "$FLAMEFLEET_CACHE/plugins/kubectl-profile"
export PATH="$FLAMEFLEET_CACHE/plugins:$PATH"

step "helm install Flamefleet ($RELEASE in $SYSTEM_NS)"
# The store runs as UID 65532 and this node has no storage provisioner: a host directory.
mkdir -p "$STORE_DIR" && chown 65532:65532 "$STORE_DIR"
# Helm installs the chart's CRDs only when absent and never upgrades them: apply them so a
# cluster kept from an earlier checkout gets this one's schema.
k apply --server-side --force-conflicts -f charts/flamefleet/crds/ >/dev/null
reinstall=""
"$HELM" status "$RELEASE" --namespace "$SYSTEM_NS" >/dev/null 2>&1 && reinstall=1
"$HELM" upgrade --install "$RELEASE" charts/flamefleet --namespace "$SYSTEM_NS" --create-namespace \
  --set image.tag="$TAG" --set image.pullPolicy=Never \
  --set store.persistence.type=hostPath --set store.persistence.hostPath="$STORE_DIR" \
  --set store.service.type=NodePort --set store.service.nodePort="$STORE_NODE_PORT" \
  --set store.publicUrl="https://$NODE_IP:$STORE_NODE_PORT/" \
  --set operator.podDisruptionBudget.enabled=false \
  --wait --timeout 5m >/dev/null
# A rerun rebuilds the images under the same tag, and an upgrade with unchanged values rolls
# nothing: restart so every pod runs the images just imported.
restart_all() {
  local ns="$1" obj
  for obj in $(k -n "$ns" get deploy,ds -o name); do
    k -n "$ns" rollout restart "$obj" >/dev/null
    k -n "$ns" rollout status "$obj" --timeout 5m
  done
}
[[ -n "$reinstall" ]] && restart_all "$SYSTEM_NS"
k -n "$SYSTEM_NS" get pods -o wide

step "the demo workloads: a checkout service in C and an inventory service in Go (examples/demo-workload)"
k create namespace "$DEMO_NS" --dry-run=client -o yaml | k apply -f - >/dev/null
sed "s|image: .*checkout-demo:.*|image: flamefleet.local/checkout-demo:$TAG|" examples/demo-workload/deployment.yaml |
  k apply -n "$DEMO_NS" -f - >/dev/null
sed "s|image: .*inventory-demo:.*|image: flamefleet.local/inventory-demo:$TAG|" examples/demo-workload/inventory/deployment.yaml |
  k apply -n "$DEMO_NS" -f - >/dev/null
# A previous demo scaled them to 0 when it finished.
k -n "$DEMO_NS" scale deploy/checkout deploy/inventory --replicas=1 >/dev/null
[[ -n "$reinstall" ]] && restart_all "$DEMO_NS"
k -n "$DEMO_NS" rollout status deploy/checkout --timeout 120s
k -n "$DEMO_NS" rollout status deploy/inventory --timeout 120s

step "profile it: kubectl profile cpu|heap|runqlat|offcpu deploy/checkout --duration $DURATION"
rm -rf "$DEMO_DIR/profiles"
mkdir -p "$DEMO_DIR/profiles"
for type in cpu heap runqlat offcpu; do
  # The off-CPU profile as folded stacks too: its top blocking stacks are printed whole.
  format=svg
  [[ "$type" == offcpu ]] && format=folded
  ( k profile "$type" deploy/checkout -n "$DEMO_NS" --duration "$DURATION" \
      -o "$DEMO_DIR/profiles" --format "$format" >"$DEMO_DIR/$type.log" 2>&1 ||
      { echo "kubectl profile $type failed:"; cat "$DEMO_DIR/$type.log"; exit 1; } ) &
done
# The Go service declares no pprof endpoint: its heap comes from the Go runtime's own profile.
mkdir -p "$DEMO_DIR/profiles/inventory"
( k profile heap deploy/inventory -n "$DEMO_NS" --duration 2s \
    -o "$DEMO_DIR/profiles/inventory" --format svg >"$DEMO_DIR/heap-go.log" 2>&1 ||
    { echo "kubectl profile heap deploy/inventory failed:"; cat "$DEMO_DIR/heap-go.log"; exit 1; } ) &
fail=0
for job in $(jobs -p); do wait "$job" || fail=1; done
((fail == 0)) || die "a capture failed (logs in $DEMO_DIR)"

step "results"
# Files are named after their request (`cpu-xxxxx-<node>.pb.gz`), and the directory was emptied
# above: one match each.
only() { compgen -G "$1" | head -n1; }
for type in cpu heap; do
  echo "--- $type: top functions (go tool pprof -top)"
  go tool pprof -top -nodecount=8 "$(only "$DEMO_DIR/profiles/$type-*-$NODE_NAME.pb.gz")" 2>/dev/null | sed -n '/^ *flat  *flat%/,$p'
done
echo "--- heap of the Go inventory service, read from the Go runtime (go tool pprof -top)"
go tool pprof -top -nodecount=5 -sample_index=inuse_space "$(only "$DEMO_DIR/profiles/inventory/heap-*-$NODE_NAME.pb.gz")" 2>/dev/null | sed -n '/^ *flat  *flat%/,$p'
echo "--- runqlat: run-queue latency of the checkout pod (histogram with p50/p90/p99: runqlat-*.svg)"
sed -n '1,30p' "$(only "$DEMO_DIR/profiles/runqlat-*-$NODE_NAME.txt")"
echo "--- offcpu: where the checkout pod's threads wait, top blocking stacks (ms blocked; root first, down to the kernel function that waited)"
# Folded: "frame;frame;... nanoseconds" (frame names may hold spaces: the value is last).
awk '{ v = $NF; sub(/ [0-9]+$/, ""); printf "%s\t%s\n", v, $0 }' \
  "$(only "$DEMO_DIR/profiles/offcpu-*-$NODE_NAME.folded")" |
  sort -t"$(printf '\t')" -k1,1nr | head -n5 | awk -F'\t' '{ printf "%8.0f ms  %s\n", $1 / 1e6, $2 }'

# The checkout service keeps more busy threads than CPUs (that is what its runqlat shows),
# and catalog and ledger below a core each: left running they would load this machine for
# as long as the cluster stays up, and slow down what runs next (the next services here;
# scripts/test.sh measures this machine too). Once their results are printed, each is
# stopped: scaled to 0 replicas, its Deployment kept.
stop_apps() {
  step "stopping $* (scaled to 0 replicas; the cluster keeps running)"
  local app deploys=() apps
  for app in "$@"; do deploys+=("deploy/$app"); done
  apps="$(IFS=,; echo "$*")"
  k -n "$DEMO_NS" scale "${deploys[@]}" --replicas=0 >/dev/null
  k -n "$DEMO_NS" wait --for=delete pod -l "app in ($apps)" --timeout=120s >/dev/null 2>&1 || true
}
stop_apps checkout inventory

step "a Python and a Java service: kubectl profile cpu deploy/catalog and deploy/ledger --duration $DURATION"
# catalog (CPython 3.12) and ledger (OpenJDK 17) each burn CPU in three functions 5:3:2;
# nothing in them is for Flamefleet (docs/capture.md, "Python frames", "Java frames").
for app in catalog ledger; do
  sed "s|image: .*$app-demo:.*|image: flamefleet.local/$app-demo:$TAG|" "examples/demo-workload/$app/deployment.yaml" |
    k apply -n "$DEMO_NS" -f - >/dev/null
done
k -n "$DEMO_NS" scale deploy/catalog deploy/ledger --replicas=1 >/dev/null
for app in catalog ledger; do
  k -n "$DEMO_NS" rollout status "deploy/$app" --timeout 120s
  # Each prints "<app>: serving" once warm (the JVM: once its three methods are compiled).
  for _ in $(seq 120); do
    k -n "$DEMO_NS" logs "deploy/$app" 2>/dev/null | grep -q "^$app: serving" && break
    sleep 1
  done
done
for app in catalog ledger; do
  mkdir -p "$DEMO_DIR/profiles/$app"
  ( k profile cpu "deploy/$app" -n "$DEMO_NS" --duration "$DURATION" \
      -o "$DEMO_DIR/profiles/$app" --format svg >"$DEMO_DIR/cpu-$app.log" 2>&1 ||
      { echo "kubectl profile cpu deploy/$app failed:"; cat "$DEMO_DIR/cpu-$app.log"; exit 1; } ) &
done
fail=0
for job in $(jobs -p); do wait "$job" || fail=1; done
((fail == 0)) || die "a capture failed (logs in $DEMO_DIR)"
# -show keeps the service's own frames: each sample counts for the innermost of them (the
# native interpreter and JIT frames under them are folded into it).
echo "--- cpu of the Python catalog service: top Python functions (go tool pprof -top -show '^catalog\.')"
go tool pprof -top -nodecount=5 -show '^catalog\.' "$(only "$DEMO_DIR/profiles/catalog/cpu-*-$NODE_NAME.pb.gz")" 2>/dev/null | sed -n '/^ *flat  *flat%/,$p'
echo "--- cpu of the Java ledger service: top Java methods (go tool pprof -top -show '^dev\.flamefleet\.demo\.')"
go tool pprof -top -nodecount=5 -show '^dev\.flamefleet\.demo\.' "$(only "$DEMO_DIR/profiles/ledger/cpu-*-$NODE_NAME.pb.gz")" 2>/dev/null | sed -n '/^ *flat  *flat%/,$p'
stop_apps catalog ledger

step "a triggered heap profile taken before an OOM kill: the Go orders service grows until its 128 MiB limit"
# policy.yaml: at 60% of the limit, the agent reads the Go heap at once and the operator makes
# it a ProfileRequest owned by the policy (docs/triggers.md). POST /leak starts the growth.
sed "s|image: .*orders-demo:.*|image: flamefleet.local/orders-demo:$TAG|" examples/demo-workload/orders/deployment.yaml |
  k apply -n "$DEMO_NS" -f - >/dev/null
k apply -n "$DEMO_NS" -f examples/demo-workload/orders/policy.yaml >/dev/null
k -n "$DEMO_NS" scale deploy/orders --replicas=1 >/dev/null
k -n "$DEMO_NS" rollout status deploy/orders --timeout 120s
pod="$(k -n "$DEMO_NS" get pod -l app=orders --field-selector=status.phase=Running -o jsonpath='{.items[0].metadata.name}')"
uid="$(k -n "$DEMO_NS" get pod "$pod" -o jsonpath='{.metadata.uid}')"
ip="$(k -n "$DEMO_NS" get pod "$pod" -o jsonpath='{.status.podIP}')"
# The agent watches the pod once the operator sends it the policy's watch set.
for _ in $(seq 60); do
  [[ "$(k -n "$DEMO_NS" get samplingpolicy orders-oom -o jsonpath='{.status.triggers[0].watchedPods}')" -ge 1 ]] 2>/dev/null && break
  sleep 1
done
curl -fsS -X POST "http://$ip:8080/leak?pause=20ms"
run=""
for _ in $(seq 120); do
  run="$(k -n "$DEMO_NS" get preq -l "flamefleet.dev/trigger-pod-uid=$uid" -o jsonpath='{.items[?(@.status.phase=="Succeeded")].metadata.name}')"
  [[ -n "$run" ]] && break
  sleep 1
done
[[ -n "$run" ]] || die "no triggered run of $pod finished (k -n $DEMO_NS get preq; k -n $DEMO_NS describe samplingpolicy orders-oom)"
for _ in $(seq 60); do
  [[ "$(k -n "$DEMO_NS" get pod "$pod" -o jsonpath='{.status.containerStatuses[0].lastState.terminated.reason}')" == OOMKilled ]] && break
  sleep 1
done
echo "--- $pod: $(k -n "$DEMO_NS" get pod "$pod" -o jsonpath='last termination {.status.containerStatuses[0].lastState.terminated.reason}, restarts {.status.containerStatuses[0].restartCount}')"
echo "--- $run: $(k -n "$DEMO_NS" get preq "$run" -o jsonpath='{.status.trigger.reason}; heap {.status.trigger.heapAtFire}')"
rm -rf "$DEMO_DIR/profiles/orders" && mkdir -p "$DEMO_DIR/profiles/orders"
k profile get "$run" -n "$DEMO_NS" -o "$DEMO_DIR/profiles/orders" --format svg >"$DEMO_DIR/heap-orders.log" 2>&1 ||
  { cat "$DEMO_DIR/heap-orders.log"; die "kubectl profile get $run failed"; }
echo "--- heap of the orders service before its OOM kill (go tool pprof -top -sample_index=inuse_space)"
go tool pprof -top -nodecount=5 -sample_index=inuse_space "$(only "$DEMO_DIR/profiles/orders/*.pb.gz")" 2>/dev/null | sed -n '/^ *flat  *flat%/,$p'
k profile list -n "$DEMO_NS"
stop_apps orders

cat <<EOF

Done in $((SECONDS - T0))s. Profiles and flame graphs (SVG): $DEMO_DIR/profiles
The cluster keeps running; the demo workloads are scaled to 0 so that they stop using the
CPUs. Look around:
  export KUBECONFIG=$KUBECONFIG PATH=$FLAMEFLEET_CACHE/plugins:\$PATH
  $KUBECTL get preq -n $DEMO_NS
  $KUBECTL scale deploy/checkout deploy/inventory deploy/catalog deploy/ledger -n $DEMO_NS --replicas=1
  $KUBECTL profile list sp/orders-oom -n $DEMO_NS
  $KUBECTL profile cpu deploy/checkout -n $DEMO_NS --duration 30s
  $KUBECTL profile list -n $DEMO_NS
Stop everything: scripts/demo.sh down
EOF
