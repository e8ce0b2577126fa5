#!/usr/bin/env bash
# A real one-node Kubernetes cluster on this machine: etcd, kube-apiserver,
# kube-controller-manager, kube-scheduler, containerd + runc with the bridge CNI, the kubelet,
# kube-proxy and CoreDNS, all built from the pinned Go modules (scripts/controlplane.sh
# build, scripts/cluster.sh build) and run as root. Pods get real cgroups from the kubelet
# and runc, real container IDs, a pod IP on a bridge, Services through kube-proxy and names
# through cluster DNS.
#
#   scripts/cluster.sh build      build the node's binaries and images (cached)
#   scripts/cluster.sh up         start everything (idempotent; waits for a Ready node, a CoreDNS
#                                 endpoint and DNS answers; keeps a running cluster whose DNS works)
#   scripts/cluster.sh down       stop everything, kill the pods, remove the bridge and rules
#   scripts/cluster.sh status     what runs, and the kubeconfig
#   scripts/cluster.sh kubectl …  the pinned kubectl against this cluster
#   scripts/cluster.sh import F…  import docker-archive image tars into the node's containerd
#   scripts/cluster.sh env        KUBECONFIG, node name and the like, as shell assignments
#   scripts/cluster.sh kubelet stop|start   stop or start the kubelet alone (the fault tier)
#
# The node's layout is detected, not assumed: cgroup v2 alone at /sys/fs/cgroup with systemd
# as PID 1 uses the kubelet's systemd cgroup driver; anything else (this VM: hybrid cgroups,
# no systemd) uses cgroupfs with `failCgroupV1: false`. Nothing here touches a system
# containerd or kubelet: sockets, state and data live under $FLAMEFLEET_CLUSTER_STATE
# (default /var/lib/flamefleet/cluster) and /run/flamefleet.
#
# Two settings this VM needs (see shared notes): containerd's CRI `restrict_oom_score_adj`
# (CAP_SYS_RESOURCE is withheld, so a negative oom_score_adj is refused) and runc (crun
# refuses hybrid cgroups). No registry is reachable: the sandbox (pause) and CoreDNS images
# are built here and imported; pods use `imagePullPolicy: Never`.
set -euo pipefail

# shellcheck source=scripts/env.sh
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
# shellcheck source=scripts/lib/image.sh
source "$REPO/scripts/lib/image.sh"

BIN="$FLAMEFLEET_CACHE/bin"
STATE="${FLAMEFLEET_CLUSTER_STATE:-/var/lib/flamefleet/cluster}"
RUN_DIR=/run/flamefleet
CONTAINERD_ROOT=/var/lib/flamefleet/containerd
CONTAINERD_SOCK="$RUN_DIR/containerd/containerd.sock"
KUBELET_ROOT=/var/lib/flamefleet/kubelet
IMAGES="$FLAMEFLEET_CACHE/images"
KUBECONFIG_ADMIN="$STATE/admin.kubeconfig"
API_PORT="${FLAMEFLEET_CLUSTER_API_PORT:-16443}"
ETCD_PORT=12379
ETCD_PEER_PORT=12380
SERVICE_CIDR=10.96.0.0/16
DNS_IP=10.96.0.10
POD_CIDR=10.244.0.0/24
CLUSTER_CIDR=10.244.0.0/16
BRIDGE=cni0
PAUSE_IMAGE=flamefleet.local/pause:3.10
COREDNS_VERSION="$(awk '$1 == "require" && $2 == "github.com/coredns/coredns" {print $3; exit} $1 == "github.com/coredns/coredns" {print $2; exit}' "$REPO/e2e/cluster/coredns/go.mod")"
COREDNS_IMAGE="flamefleet.local/coredns:$COREDNS_VERSION"
K8S_VERSION="$(awk '$1 == "k8s.io/kubernetes" && $2 ~ /^v/ {print $2; exit}' "$REPO/e2e/controlplane/go.mod")"
ETCD_VERSION="$(awk '$1 == "go.etcd.io/etcd/server/v3" && $2 ~ /^v/ {print $2; exit}' "$REPO/e2e/controlplane/go.mod")"
COMPONENTS=(etcd kube-apiserver kube-controller-manager kube-scheduler containerd kubelet kube-proxy)

say() { printf '%s cluster: %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
bin() { echo "$BIN/$1-$K8S_VERSION"; }
kctl() { "$(bin kubectl)" --kubeconfig "$KUBECONFIG_ADMIN" "$@"; }

host_ip() {
  # The address the default route leaves from (no packet is sent).
  ip -4 route get 1.1.1.1 2>/dev/null | awk '{for (i = 1; i < NF; i++) if ($i == "src") {print $(i + 1); exit}}'
}

node_name() {
  local n; n="$(hostname | tr '[:upper:]' '[:lower:]')"
  [[ "$n" =~ ^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$ ]] || n=flamefleet-node
  echo "$n"
}

# cgroup_driver: systemd on a pure cgroup v2 host booted by systemd, else cgroupfs.
cgroup_driver() {
  local pure_v2=false
  if awk '$2 == "/sys/fs/cgroup" && $3 == "cgroup2" {found = 1} END {exit !found}' /proc/mounts; then
    pure_v2=true
  fi
  if $pure_v2 && [[ "$(cat /proc/1/comm 2>/dev/null)" == systemd ]]; then
    echo systemd
  else
    echo cgroupfs
  fi
}

cgroup_v1_present() {
  awk '$3 == "cgroup" {found = 1} END {exit !found}' /proc/mounts
}

pid_of() {
  local f="$STATE/$1.pid"
  [[ -f "$f" ]] || return 1
  local pid; pid="$(cat "$f")"
  [[ -n "$pid" ]] && kill -0 "$pid" 2>/dev/null && echo "$pid"
}

running() { pid_of "$1" >/dev/null; }

# start NAME CMD...: runs CMD detached (own session), log in $STATE/NAME.log, pid file.
start() {
  local name="$1"; shift
  if running "$name"; then return 0; fi
  # 9>&-: the daemon must not inherit (and so hold) the cluster lock.
  setsid "$@" </dev/null >>"$STATE/$name.log" 2>&1 9>&- &
  echo $! >"$STATE/$name.pid"
}

stop() {
  local name="$1" pid
  pid="$(pid_of "$name")" || { rm -f "$STATE/$name.pid"; return 0; }
  kill -TERM "$pid" 2>/dev/null || true
  for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
  kill -KILL "$pid" 2>/dev/null || true
  rm -f "$STATE/$name.pid"
}

# wait_for WHAT SECONDS CMD...: polls CMD every 0.5 s until it succeeds.
wait_for() {
  local what="$1" secs="$2"; shift 2
  local deadline=$((SECONDS + secs))
  until "$@" >/dev/null 2>&1; do
    if ((SECONDS > deadline)); then
      say "timed out after ${secs}s waiting for $what"
      return 1
    fi
    sleep 0.5
  done
}

# ---- build ----------------------------------------------------------------------------

cmd_build() {
  "$REPO/scripts/controlplane.sh" build
  command -v go >/dev/null || { echo "cluster.sh: Go is required; run scripts/setup.sh" >&2; exit 1; }
  local flags="-s -w" minor="${K8S_VERSION#v1.}"; minor="${minor%%.*}"
  for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
    flags+=" -X $pkg.gitVersion=$K8S_VERSION -X $pkg.gitMajor=1 -X $pkg.gitMinor=$minor -X $pkg.gitTreeState=clean"
  done
  mkdir -p "$BIN"
  local c
  for c in kubelet kube-controller-manager kube-scheduler kube-proxy; do
    if [[ -x "$(bin "$c")" ]] && "$(bin "$c")" --version 2>/dev/null | grep -q "Kubernetes $K8S_VERSION"; then
      echo "$c $K8S_VERSION: cached"
      continue
    fi
    local t0=$SECONDS
    (cd "$REPO/e2e/controlplane" && go build -trimpath -ldflags "$flags" -o "$(bin "$c").tmp" "k8s.io/kubernetes/cmd/$c")
    mv "$(bin "$c").tmp" "$(bin "$c")"
    echo "built $c in $((SECONDS - t0))s"
  done
  local coredns="$BIN/coredns-$COREDNS_VERSION"
  if [[ -x "$coredns" ]]; then
    echo "coredns $COREDNS_VERSION: cached"
  else
    local t0=$SECONDS
    (cd "$REPO/e2e/cluster/coredns" && go build -trimpath -ldflags "-s -w" -o "$coredns.tmp" .)
    mv "$coredns.tmp" "$coredns"
    echo "built coredns in $((SECONDS - t0))s"
  fi
  build_node_images
}

build_node_images() {
  mkdir -p "$IMAGES"
  local pause_tar="$IMAGES/pause-3.10.tar"
  if [[ ! -f "$pause_tar" ]]; then
    local work; work="$(mktemp -d)"
    # The sandbox's only process: sleep in pause(2), reap children, exit on TERM/INT.
    cat >"$work/pause.c" <<'C'
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>
static void quit(int sig) { (void)sig; _exit(0); }
static void reap(int sig) { (void)sig; while (waitpid(-1, 0, WNOHANG) > 0) {} }
int main(void) {
  signal(SIGINT, quit);
  signal(SIGTERM, quit);
  signal(SIGCHLD, reap);
  for (;;) pause();
}
C
    gcc -O2 -static -o "$work/pause" "$work/pause.c"
    mkdir -p "$work/rootfs"
    install -D -m 0755 "$work/pause" "$work/rootfs/pause"
    docker_archive "$work/rootfs" "$PAUSE_IMAGE" "$pause_tar" '{"Entrypoint":["/pause"],"User":"65535:65535"}'
    rm -rf "$work"
    echo "built the pause image ($(image_size "$pause_tar"))"
  fi
  local coredns_tar="$IMAGES/coredns-$COREDNS_VERSION.tar"
  if [[ ! -f "$coredns_tar" ]]; then
    local work; work="$(mktemp -d)"
    rootfs_base "$work" 65532
    rootfs_add_binary "$work" "$BIN/coredns-$COREDNS_VERSION" /coredns
    docker_archive "$work" "$COREDNS_IMAGE" "$coredns_tar" '{"Entrypoint":["/coredns"]}'
    rm -rf "$work"
    echo "built the CoreDNS image ($(image_size "$coredns_tar"))"
  fi
}

# ---- certificates and kubeconfigs (openssl; ECDSA P-256) -------------------------------

# cert NAME CN ORG USAGE [SANS]: a key and a certificate signed by the cluster CA.
cert() {
  local name="$1" cn="$2" org="$3" usage="$4" sans="${5:-}"
  local dir="$STATE/pki" subj="/CN=$cn"
  [[ -n "$org" ]] && subj="/O=$org$subj"
  openssl ecparam -name prime256v1 -genkey -noout -out "$dir/$name.key" 2>/dev/null
  openssl req -new -key "$dir/$name.key" -subj "$subj" -out "$dir/$name.csr" 2>/dev/null
  {
    echo "keyUsage=critical,digitalSignature,keyEncipherment"
    echo "extendedKeyUsage=$usage"
    [[ -n "$sans" ]] && echo "subjectAltName=$sans"
  } >"$dir/$name.ext"
  openssl x509 -req -in "$dir/$name.csr" -CA "$dir/ca.crt" -CAkey "$dir/ca.key" \
    -CAcreateserial -days 365 -sha256 -extfile "$dir/$name.ext" -out "$dir/$name.crt" 2>/dev/null
  rm -f "$dir/$name.csr" "$dir/$name.ext"
}

# kubeconfig NAME USER: $STATE/NAME.kubeconfig authenticating with pki/NAME.{crt,key}.
kubeconfig() {
  local name="$1" user="$2" server="https://$HOST_IP:$API_PORT"
  cat >"$STATE/$name.kubeconfig" <<EOF
apiVersion: v1
kind: Config
clusters:
- name: flamefleet
  cluster: {server: "$server", certificate-authority: "$STATE/pki/ca.crt"}
users:
- name: "$user"
  user: {client-certificate: "$STATE/pki/$name.crt", client-key: "$STATE/pki/$name.key"}
contexts:
- name: flamefleet
  context: {cluster: flamefleet, user: "$user", namespace: default}
current-context: flamefleet
EOF
}

make_pki() {
  mkdir -p "$STATE/pki"
  local dir="$STATE/pki"
  openssl ecparam -name prime256v1 -genkey -noout -out "$dir/ca.key" 2>/dev/null
  openssl req -x509 -new -key "$dir/ca.key" -subj "/CN=flamefleet-cluster-ca" -days 3650 -sha256 \
    -addext "basicConstraints=critical,CA:true" -addext "keyUsage=critical,keyCertSign,cRLSign,digitalSignature" \
    -out "$dir/ca.crt" 2>/dev/null
  cert apiserver kube-apiserver "" serverAuth \
    "DNS:localhost,DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc,DNS:kubernetes.default.svc.cluster.local,DNS:$NODE,IP:127.0.0.1,IP:$HOST_IP,IP:10.96.0.1"
  cert apiserver-kubelet-client kube-apiserver-kubelet-client system:masters clientAuth
  cert admin flamefleet-admin system:masters clientAuth
  cert controller-manager system:kube-controller-manager "" clientAuth
  cert scheduler system:kube-scheduler "" clientAuth
  cert kube-proxy system:kube-proxy "" clientAuth
  cert kubelet "system:node:$NODE" system:nodes clientAuth
  cert kubelet-serving "$NODE" "" serverAuth "DNS:$NODE,IP:$HOST_IP,IP:127.0.0.1"
  openssl ecparam -name prime256v1 -genkey -noout -out "$dir/sa.key" 2>/dev/null
  openssl ec -in "$dir/sa.key" -pubout -out "$dir/sa.pub" 2>/dev/null
  kubeconfig admin flamefleet-admin
  kubeconfig controller-manager system:kube-controller-manager
  kubeconfig scheduler system:kube-scheduler
  kubeconfig kube-proxy system:kube-proxy
  kubeconfig kubelet "system:node:$NODE"
  cp "$STATE/admin.kubeconfig" "$KUBECONFIG_ADMIN" 2>/dev/null || true
}

# ---- components ------------------------------------------------------------------------

start_control_plane() {
  start etcd "$BIN/etcd-$ETCD_VERSION" --name flamefleet --data-dir "$STATE/etcd" \
    --listen-client-urls "http://127.0.0.1:$ETCD_PORT" --advertise-client-urls "http://127.0.0.1:$ETCD_PORT" \
    --listen-peer-urls "http://127.0.0.1:$ETCD_PEER_PORT" --initial-advertise-peer-urls "http://127.0.0.1:$ETCD_PEER_PORT" \
    --initial-cluster "flamefleet=http://127.0.0.1:$ETCD_PEER_PORT" --log-level warn
  local p="$STATE/pki"
  start kube-apiserver "$(bin kube-apiserver)" \
    --etcd-servers "http://127.0.0.1:$ETCD_PORT" \
    --bind-address 0.0.0.0 --advertise-address "$HOST_IP" --secure-port "$API_PORT" \
    --tls-cert-file "$p/apiserver.crt" --tls-private-key-file "$p/apiserver.key" \
    --client-ca-file "$p/ca.crt" \
    --kubelet-client-certificate "$p/apiserver-kubelet-client.crt" --kubelet-client-key "$p/apiserver-kubelet-client.key" \
    --authorization-mode Node,RBAC --enable-admission-plugins NodeRestriction \
    --service-account-issuer https://kubernetes.default.svc.cluster.local \
    --service-account-key-file "$p/sa.pub" --service-account-signing-key-file "$p/sa.key" \
    --service-cluster-ip-range "$SERVICE_CIDR" --endpoint-reconciler-type lease \
    --profiling=false --v=1
  wait_for "kube-apiserver /readyz" 120 kctl get --raw /readyz
  start kube-controller-manager "$(bin kube-controller-manager)" \
    --kubeconfig "$STATE/controller-manager.kubeconfig" \
    --authentication-kubeconfig "$STATE/controller-manager.kubeconfig" \
    --authorization-kubeconfig "$STATE/controller-manager.kubeconfig" \
    --service-account-private-key-file "$p/sa.key" --root-ca-file "$p/ca.crt" \
    --use-service-account-credentials=true --cluster-name flamefleet \
    --controllers '*,-csrsigning' --leader-elect=false --bind-address 127.0.0.1 --v=1
  start kube-scheduler "$(bin kube-scheduler)" \
    --kubeconfig "$STATE/scheduler.kubeconfig" \
    --authentication-kubeconfig "$STATE/scheduler.kubeconfig" \
    --authorization-kubeconfig "$STATE/scheduler.kubeconfig" \
    --leader-elect=false --bind-address 127.0.0.1 --v=1
}

start_containerd() {
  mkdir -p "$RUN_DIR/containerd" "$CONTAINERD_ROOT" "$STATE/cni/net.d"
  local systemd_cgroup=false
  [[ "$DRIVER" == systemd ]] && systemd_cgroup=true
  cat >"$STATE/containerd.toml" <<EOF
version = 2
root = "$CONTAINERD_ROOT"
state = "$RUN_DIR/containerd/state"
[grpc]
  address = "$CONTAINERD_SOCK"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "$PAUSE_IMAGE"
  # This VM withholds CAP_SYS_RESOURCE: a negative oom_score_adj would be refused.
  restrict_oom_score_adj = true
  [plugins."io.containerd.grpc.v1.cri".containerd]
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = $systemd_cgroup
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "/usr/lib/cni"
    conf_dir = "$STATE/cni/net.d"
EOF
  cat >"$STATE/cni/net.d/10-flamefleet.conflist" <<EOF
{
  "cniVersion": "1.0.0",
  "name": "flamefleet",
  "plugins": [
    {"type": "bridge", "bridge": "$BRIDGE", "isGateway": true, "ipMasq": true, "hairpinMode": true,
     "ipam": {"type": "host-local", "ranges": [[{"subnet": "$POD_CIDR"}]], "routes": [{"dst": "0.0.0.0/0"}]}},
    {"type": "portmap", "capabilities": {"portMappings": true}}
  ]
}
EOF
  start containerd containerd --config "$STATE/containerd.toml"
  wait_for "containerd" 60 ctr -a "$CONTAINERD_SOCK" version
  import_images "$IMAGES/pause-3.10.tar" "$IMAGES/coredns-$COREDNS_VERSION.tar"
}

import_images() {
  local tar
  for tar in "$@"; do
    [[ -f "$tar" ]] || { say "missing image $tar: run scripts/cluster.sh build"; return 1; }
    ctr -a "$CONTAINERD_SOCK" -n k8s.io images import --no-unpack=false "$tar" >/dev/null
  done
}

start_node() {
  local p="$STATE/pki" fail_v1=true
  cgroup_v1_present && fail_v1=false
  mkdir -p "$KUBELET_ROOT"
  cat >"$STATE/kubelet.yaml" <<EOF
apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
authentication:
  anonymous: {enabled: false}
  webhook: {enabled: true}
  x509: {clientCAFile: "$p/ca.crt"}
authorization: {mode: Webhook}
cgroupDriver: $DRIVER
failCgroupV1: $fail_v1
failSwapOn: false
clusterDNS: ["$DNS_IP"]
clusterDomain: cluster.local
containerRuntimeEndpoint: "unix://$CONTAINERD_SOCK"
podCIDR: "$POD_CIDR"
tlsCertFile: "$p/kubelet-serving.crt"
tlsPrivateKeyFile: "$p/kubelet-serving.key"
readOnlyPort: 0
healthzBindAddress: 127.0.0.1
# A test node on a small disk: never evict for disk, never collect our imported images.
evictionHard: {memory.available: "100Mi", nodefs.available: "1%", imagefs.available: "1%", nodefs.inodesFree: "1%"}
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
serializeImagePulls: false
EOF
  start_kubelet
  modprobe br_netfilter 2>/dev/null || true
  sysctl -qw net.bridge.bridge-nf-call-iptables=1 2>/dev/null || true
  sysctl -qw net.ipv4.ip_forward=1 2>/dev/null || true
  cat >"$STATE/kube-proxy.yaml" <<EOF
apiVersion: kubeproxy.config.k8s.io/v1alpha1
kind: KubeProxyConfiguration
clientConnection: {kubeconfig: "$STATE/kube-proxy.kubeconfig"}
mode: iptables
clusterCIDR: "$CLUSTER_CIDR"
hostnameOverride: "$NODE"
metricsBindAddress: 127.0.0.1:10249
healthzBindAddress: 127.0.0.1:10256
# Leave the host's conntrack sysctls alone.
conntrack: {maxPerCore: 0, tcpEstablishedTimeout: 0s, tcpCloseWaitTimeout: 0s}
EOF
  start kube-proxy "$(bin kube-proxy)" --config "$STATE/kube-proxy.yaml" --v=1
}

# start_kubelet: the kubelet with the configuration start_node wrote.
start_kubelet() {
  start kubelet "$(bin kubelet)" --config "$STATE/kubelet.yaml" --kubeconfig "$STATE/kubelet.kubeconfig" \
    --root-dir "$KUBELET_ROOT" --hostname-override "$NODE" --node-ip "$HOST_IP" --v=1
}

node_ready() {
  [[ "$(kctl get node "$NODE" -o 'jsonpath={.status.conditions[?(@.type=="Ready")].status}' 2>/dev/null)" == True ]]
}

deploy_dns() {
  kctl apply -f - >/dev/null <<EOF
apiVersion: v1
kind: ServiceAccount
metadata: {name: coredns, namespace: kube-system}
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRole
metadata: {name: "system:coredns"}
rules:
- apiGroups: [""]
  resources: [services, pods, namespaces]
  verbs: [list, watch]
- apiGroups: [discovery.k8s.io]
  resources: [endpointslices]
  verbs: [list, watch]
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRoleBinding
metadata: {name: "system:coredns"}
roleRef: {apiGroup: rbac.authorization.k8s.io, kind: ClusterRole, name: "system:coredns"}
subjects: [{kind: ServiceAccount, name: coredns, namespace: kube-system}]
---
apiVersion: v1
kind: ConfigMap
metadata: {name: coredns, namespace: kube-system}
data:
  Corefile: |
    .:53 {
        errors
        health :8080
        ready :8181
        kubernetes cluster.local in-addr.arpa ip6.arpa {
            pods insecure
            fallthrough in-addr.arpa ip6.arpa
        }
        forward . /etc/resolv.conf
        cache 30
        loop
        reload
        loadbalance
    }
---
apiVersion: apps/v1
kind: Deployment
metadata: {name: coredns, namespace: kube-system, labels: {k8s-app: kube-dns}}
spec:
  replicas: 1
  selector: {matchLabels: {k8s-app: kube-dns}}
  template:
    metadata: {labels: {k8s-app: kube-dns}}
    spec:
      serviceAccountName: coredns
      dnsPolicy: Default
      containers:
      - name: coredns
        image: "$COREDNS_IMAGE"
        imagePullPolicy: Never
        args: ["-conf", "/etc/coredns/Corefile"]
        ports:
        - {name: dns, containerPort: 53, protocol: UDP}
        - {name: dns-tcp, containerPort: 53, protocol: TCP}
        # kubeadm's probe timings (a 1 s timeout fails on a loaded 2-core machine: CoreDNS
        # restarted 6 times in 30 minutes at load 13-16, its endpoint gone each time and
        # every in-cluster name unresolvable), and a CPU request so that it keeps its share
        # of the node against best-effort pods.
        readinessProbe: {httpGet: {path: /ready, port: 8181}, periodSeconds: 2, timeoutSeconds: 5, failureThreshold: 5}
        livenessProbe: {httpGet: {path: /health, port: 8080}, initialDelaySeconds: 60, timeoutSeconds: 5, failureThreshold: 5}
        resources:
          requests: {cpu: 100m, memory: 70Mi}
          limits: {memory: 170Mi}
        securityContext:
          allowPrivilegeEscalation: false
          readOnlyRootFilesystem: true
          capabilities: {drop: [ALL], add: [NET_BIND_SERVICE]}
        volumeMounts: [{name: config, mountPath: /etc/coredns, readOnly: true}]
      volumes: [{name: config, configMap: {name: coredns}}]
---
apiVersion: v1
kind: Service
metadata: {name: kube-dns, namespace: kube-system, labels: {k8s-app: kube-dns}}
spec:
  clusterIP: "$DNS_IP"
  selector: {k8s-app: kube-dns}
  ports:
  - {name: dns, port: 53, protocol: UDP}
  - {name: dns-tcp, port: 53, protocol: TCP}
EOF
}

# dns_answers NAME: asks the cluster DNS (through the kube-dns Service, so kube-proxy too)
# for NAME's A record.
dns_answers() {
  python3 - "$DNS_IP" "$1" <<'PY'
import random, socket, struct, sys
server, name = sys.argv[1], sys.argv[2]
qid = random.randrange(65536)
q = struct.pack(">HHHHHH", qid, 0x0100, 1, 0, 0, 0)
q += b"".join(bytes([len(p)]) + p.encode() for p in name.split(".")) + b"\0" + struct.pack(">HH", 1, 1)
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.settimeout(1)
s.sendto(q, (server, 53))
data = s.recv(512)
rid, flags, _, an = struct.unpack(">HHHH", data[:8])
sys.exit(0 if rid == qid and flags & 0xF == 0 and an > 0 else 1)
PY
}

# dns_endpoints: the kube-dns Service has a ready endpoint. Until it has, kube-proxy rejects
# packets to the Service's address (the sender gets EPERM at once): no DNS check can pass,
# and a CoreDNS pod that is restarting says nothing about the cluster being broken.
dns_endpoints() {
  [[ -n "$(kctl -n kube-system get endpointslices -l kubernetes.io/service-name=kube-dns \
    -o 'jsonpath={.items[*].endpoints[?(@.conditions.ready==true)].addresses[0]}' 2>/dev/null)" ]]
}

# wait_dns SECONDS: waits (at most SECONDS, saying so) for CoreDNS's endpoints, then up to
# 30 s for the cluster DNS to answer through kube-proxy (its rules follow the endpoints).
wait_dns() {
  local secs="$1" t0=$SECONDS
  if ! dns_endpoints; then
    say "waiting up to ${secs}s for CoreDNS endpoints (kube-proxy rejects DNS until there is one)"
    wait_for "CoreDNS endpoints" "$secs" dns_endpoints || return 1
    say "CoreDNS has an endpoint after $((SECONDS - t0))s"
  fi
  wait_for "cluster DNS answers" 30 dns_answers kubernetes.default.svc.cluster.local
}

# ---- commands --------------------------------------------------------------------------

# write_env: $STATE/env, what tests and scripts need to reach the node (`cluster.sh env`).
write_env() {
  {
    echo "KUBECONFIG=$KUBECONFIG_ADMIN"
    echo "NODE_NAME=$NODE"
    echo "NODE_IP=$HOST_IP"
    echo "CGROUP_DRIVER=$DRIVER"
    echo "CONTAINERD_SOCK=$CONTAINERD_SOCK"
    echo "CLUSTER_DNS=$DNS_IP"
  } >"$STATE/env"
}

all_running() {
  local c
  for c in "${COMPONENTS[@]}"; do running "$c" || return 1; done
}

cmd_up() {
  require_root "it runs containerd, the kubelet and kube-proxy"
  mkdir -p "$STATE" "$RUN_DIR"
  exec 9>"$RUN_DIR/cluster.lock"
  flock 9
  HOST_IP="$(host_ip)"; NODE="$(node_name)"; DRIVER="$(cgroup_driver)"
  [[ -n "$HOST_IP" ]] || { echo "cluster.sh: no IPv4 default route: cannot pick the node's address" >&2; exit 1; }
  # A running cluster is kept unless its DNS stays broken: CoreDNS restarting (no endpoint
  # for a while) or one lost UDP answer on a loaded machine must not make `up` tear down a
  # running cluster (and every installation on it) to start afresh.
  if all_running && node_ready && wait_dns 120; then
    # This checkout's CoreDNS settings (an unchanged Deployment is left as it runs).
    deploy_dns
    wait_for "CoreDNS" 180 kctl -n kube-system rollout status deploy/coredns --timeout 5s || { kctl -n kube-system get pods -o wide >&2; exit 1; }
    wait_dns 60 || exit 1
    write_env
    say "already up: node $NODE; KUBECONFIG=$KUBECONFIG_ADMIN"
    return 0
  fi
  local t0=$SECONDS
  for tool in "$(bin kube-apiserver)" "$(bin kubelet)" "$(bin kube-proxy)" "$BIN/etcd-$ETCD_VERSION" "$IMAGES/pause-3.10.tar"; do
    [[ -e "$tool" ]] || { echo "cluster.sh: $tool is missing: run scripts/cluster.sh build (scripts/setup.sh does)" >&2; exit 1; }
  done
  cmd_down_locked quiet
  mkdir -p "$STATE"
  say "node $NODE at $HOST_IP, cgroup driver $DRIVER, API server https://$HOST_IP:$API_PORT"
  make_pki
  start_control_plane
  start_containerd
  start_node
  wait_for "node $NODE to be Ready" 180 node_ready || { tail -20 "$STATE/kubelet.log" >&2; exit 1; }
  deploy_dns
  wait_for "CoreDNS" 180 kctl -n kube-system rollout status deploy/coredns --timeout 5s || { kctl -n kube-system get pods -o wide >&2; exit 1; }
  wait_dns 60 || exit 1
  write_env
  say "up in $((SECONDS - t0))s: node $NODE Ready, DNS at $DNS_IP; KUBECONFIG=$KUBECONFIG_ADMIN"
}

# kill_pods: SIGKILL every process in the node's pod cgroups, in every hierarchy.
kill_pods() {
  local root dir
  for root in /sys/fs/cgroup /sys/fs/cgroup/unified /sys/fs/cgroup/pids /sys/fs/cgroup/cpu,cpuacct /sys/fs/cgroup/memory; do
    for dir in "$root/kubepods" "$root/kubepods.slice"; do
      [[ -d "$dir" ]] || continue
      find "$dir" -name cgroup.procs -exec cat {} + 2>/dev/null | xargs -r kill -KILL 2>/dev/null || true
    done
  done
}

cmd_down_locked() {
  local quiet="${1:-}"
  stop kubelet
  kill_pods
  stop kube-proxy
  if [[ -x "$(bin kube-proxy)" ]]; then "$(bin kube-proxy)" --cleanup >/dev/null 2>&1 || true; fi
  # containerd's shims outlive it; they belong to this containerd when their -address is ours.
  pkill -KILL -f "containerd-shim-runc-v2 .*-address $CONTAINERD_SOCK" 2>/dev/null || true
  stop containerd
  stop kube-scheduler
  stop kube-controller-manager
  stop kube-apiserver
  stop etcd
  # Mounts left by pods and snapshots, deepest first.
  awk -v a="$KUBELET_ROOT" -v b="$RUN_DIR/containerd" -v c="$CONTAINERD_ROOT" \
    'index($2, a) == 1 || index($2, b) == 1 || index($2, c) == 1 {print $2}' /proc/mounts |
    sort -r | while read -r m; do umount -l "$m" 2>/dev/null || true; done
  ip link del "$BRIDGE" 2>/dev/null || true
  rm -rf /var/lib/cni/networks/flamefleet /var/lib/cni/results 2>/dev/null || true
  # Fresh cluster state on the next `up` (the containerd image store is kept: imports are slow).
  rm -rf "$STATE/etcd" "$STATE/pki" "$KUBELET_ROOT" "$RUN_DIR/containerd/state"
  [[ -n "$quiet" ]] || say "down"
}

cmd_down() {
  require_root "it stops the node's processes"
  mkdir -p "$RUN_DIR"
  exec 9>"$RUN_DIR/cluster.lock"
  flock 9
  cmd_down_locked
}

# cmd_kubelet stop|start: the fault tier's kubelet restart (e2e/tests/real_node_faults). The
# pods keep running while it is stopped, as on any node whose kubelet restarts; `start`
# uses the running node's configuration and does not wait (the caller waits on the node's
# Ready condition).
cmd_kubelet() {
  require_root "it stops and starts the node's kubelet"
  [[ -f "$STATE/env" && -f "$STATE/kubelet.yaml" ]] || { echo "cluster.sh: the node is not up (scripts/cluster.sh up)" >&2; exit 1; }
  case "${1:-}" in
    stop) stop kubelet ;;
    start)
      HOST_IP="$(awk -F= '$1 == "NODE_IP" {print $2}' "$STATE/env")"
      NODE="$(awk -F= '$1 == "NODE_NAME" {print $2}' "$STATE/env")"
      start_kubelet ;;
    *) echo "usage: scripts/cluster.sh kubelet stop|start" >&2; exit 2 ;;
  esac
}

cmd_status() {
  local c
  for c in "${COMPONENTS[@]}"; do
    if running "$c"; then printf '%-24s running (pid %s)\n' "$c" "$(pid_of "$c")"; else printf '%-24s stopped\n' "$c"; fi
  done
  if [[ -f "$KUBECONFIG_ADMIN" ]] && running kube-apiserver; then
    kctl get nodes -o wide 2>/dev/null || true
    echo "KUBECONFIG=$KUBECONFIG_ADMIN"
  fi
}

case "${1:-}" in
  build) cmd_build ;;
  up) cmd_up ;;
  down) cmd_down ;;
  status) cmd_status ;;
  kubectl) shift; kctl "$@" ;;
  import) shift; import_images "$@" ;;
  env) cat "$STATE/env" ;;
  kubelet) shift; cmd_kubelet "$@" ;;
  *) sed -n '2,21p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 2 ;;
esac
