#!/usr/bin/env bash
# Installs everything Flamefleet's build, tests and demo need on a Debian machine (12+), as
# root. Idempotent: a second run only checks. Safe without a terminal (CI=true, no stdin).
#
#   scripts/setup.sh
#
# Steps: Debian packages; Go and Rust checks; tracefs/bpffs mounts; kube-apiserver, etcd,
# kubectl, the node's binaries (kubelet, scheduler, controller-manager, kube-proxy, CoreDNS)
# and images, helm and kubeconform, the OpenTelemetry Collector of the export tests, built at
# the pinned versions into $FLAMEFLEET_CACHE (skipped when cached); the extra installers below.
set -euo pipefail

# ---- Debian packages: one per line; add yours here (and say why in a comment) ----
APT_PACKAGES=(
  # build: C/eBPF toolchain, libbpf, protobuf
  clang
  llvm
  gcc
  make
  pkg-config
  libbpf-dev
  libelf-dev
  zlib1g-dev
  protobuf-compiler
  # eBPF and profiling tools (peers in benchmarks, debugging)
  bpftool
  bpftrace
  libbpf-tools
  linux-perf
  python3  # node-agent/benches/heap_overhead.sh: bpftool JSON and the figures
  # node-agent/tests/full_stacks.rs: workloads without frame pointers and JIT code
  g++       # a C++ -O2 binary
  binutils  # objcopy strips .eh_frame for the missing-CFI test
  nodejs    # node --perf-basic-prof: JIT frames named from the perf map
  # node-agent/tests/java_stacks.rs: Java frames of HotSpot 17 (Debian's default java);
  # Temurin 25 comes from scripts/install-temurin.sh
  openjdk-17-jdk-headless
  # control plane: Debian's etcd is a fallback only (we build etcd 3.6 for kube-apiserver 1.34)
  etcd-server
  # the one-node cluster (scripts/cluster.sh): container runtime, OCI runtime (runc: crun
  # refuses hybrid cgroups), pod networking, kube-proxy's iptables and conntrack
  containerd
  runc
  containernetworking-plugins
  iptables
  conntrack
  # the guest kernel tier (node-agent/tests/kernels.rs): Debian's 5.10, 6.1 and 6.12 kernels
  # booted under QEMU (TCG) with busybox as their init; kmod's modprobe/depmod list and index
  # their modules (scripts/guest-kernels.sh downloads the kernels)
  qemu-system-x86
  busybox-static
  kmod
  xz-utils   # 6.12's modules are .ko.xz; busybox's insmod reads plain ELF
  # the fault tier's clock step (e2e/tests/faults.rs): the node's processes see a stepped
  # wall clock through LD_PRELOAD, this machine's clock is never touched
  libfaketime
  # plumbing
  openssl
  git
  ca-certificates
  curl
)

# ---- other installers run after the packages, each idempotent ----
EXTRA_INSTALLERS=(
  scripts/install-s3-test-server.sh
  scripts/guest-kernels.sh
  scripts/install-pythons.sh  # node-agent/tests/python_stacks.rs: CPython 3.8-3.13 (pyenv)
  scripts/install-temurin.sh  # node-agent/tests/java_stacks.rs: Temurin 25 beside Debian's JDK 17
)

# shellcheck source=scripts/env.sh
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
RUST_MIN="$(awk -F'"' '/^rust-version/ {print $2; exit}' "$REPO/Cargo.toml")"
GO_MIN="$(awk '$1 == "go" {print $2; exit}' "$REPO/e2e/controlplane/go.mod")"
export DEBIAN_FRONTEND=noninteractive

version_ge() { [[ "$(printf '%s\n%s\n' "$2" "$1" | sort -V | head -1)" == "$2" ]]; }

require_root "it installs packages and mounts tracefs"

step "Debian packages"
missing=()
for p in "${APT_PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "installing: ${missing[*]}"
  apt-get update -q
  apt-get install -y -q --no-install-recommends "${missing[@]}" </dev/null
else
  echo "all ${#APT_PACKAGES[@]} packages present"
fi

step "Go (>= $GO_MIN)"
if ! command -v go >/dev/null; then
  # Debian's golang-go may be older than go.mod asks for; GOTOOLCHAIN=auto then fetches the
  # right toolchain through the Go module proxy.
  apt-get install -y -q --no-install-recommends golang-go </dev/null || true
fi
command -v go >/dev/null || die "Go not found; install Go >= $GO_MIN (https://go.dev/doc/install) and re-run"
go_have="$(go env GOVERSION)"; go_have="${go_have#go}"
if ! version_ge "$go_have" "$GO_MIN"; then
  export GOTOOLCHAIN=auto
  echo "Go $go_have < $GO_MIN: using GOTOOLCHAIN=auto (downloads go$GO_MIN via the module proxy)"
fi
echo "go $go_have at $(command -v go)"

step "Go toolchains of the versions the Go runtime heap source supports (tests build with each)"
# Idempotent: `go version` under GOTOOLCHAIN downloads a toolchain into the
# module cache once (through the module proxy) and reuses it afterwards.
# Keep in step with TOOLCHAINS in node-agent/tests/heap_goruntime.rs.
for tc in go1.23.12 go1.24.0 go1.25.0; do
  GOTOOLCHAIN="$tc" go version || die "cannot fetch Go toolchain $tc through the module proxy"
done

step "Rust (>= $RUST_MIN, with rustfmt and clippy)"
command -v cargo >/dev/null || die "cargo not found; install Rust >= $RUST_MIN with rustup (https://rustup.rs) and re-run"
rust_have="$(rustc --version | awk '{print $2}')"
version_ge "$rust_have" "$RUST_MIN" || die "rustc $rust_have is older than the workspace's rust-version $RUST_MIN; run: rustup update stable"
for comp in rustfmt clippy; do
  if ! { [[ $comp == rustfmt ]] && rustfmt --version || cargo clippy --version; } >/dev/null 2>&1; then
    command -v rustup >/dev/null || die "$comp missing and no rustup to add it; install the $comp component"
    rustup component add "$comp"
  fi
done
echo "rustc $rust_have at $(command -v rustc)"

step "kernel filesystems (tracefs, bpffs)"
if ! grep -q ' /sys/kernel/tracing tracefs ' /proc/mounts; then
  mount -t tracefs nodev /sys/kernel/tracing && echo "mounted tracefs" || echo "warning: cannot mount tracefs at /sys/kernel/tracing" >&2
else
  echo "tracefs mounted"
fi
if ! grep -q ' /sys/fs/bpf bpf ' /proc/mounts; then
  mount -t bpf bpf /sys/fs/bpf && echo "mounted bpffs" || echo "warning: cannot mount bpffs at /sys/fs/bpf" >&2
else
  echo "bpffs mounted"
fi

step "local control plane binaries (kube-apiserver, etcd, kubectl)"
"$REPO/scripts/controlplane.sh" build

step "one-node cluster binaries and images (kubelet, scheduler, controller-manager, kube-proxy, CoreDNS, pause)"
"$REPO/scripts/cluster.sh" build

step "chart tools (helm, kubeconform)"
"$REPO/scripts/tools.sh" build

step "OpenTelemetry Collector for the export tests (e2e/tests/pipeline_export.rs)"
"$REPO/scripts/otelcol.sh" build

for installer in "${EXTRA_INSTALLERS[@]}"; do
  step "$installer"
  if [[ -x "$REPO/$installer" ]]; then
    "$REPO/$installer"
  else
    die "$installer is listed in EXTRA_INSTALLERS but is missing or not executable"
  fi
done

step "done"
