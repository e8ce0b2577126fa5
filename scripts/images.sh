#!/usr/bin/env bash
# Builds Flamefleet's container images here, without a registry or a container engine, and
# imports them into the one-node cluster (scripts/cluster.sh):
#
#   scripts/images.sh build     release-build the binaries, write the image tars
#   scripts/images.sh import    import the tars into the cluster's containerd
#   scripts/images.sh tag       the tag used (the workspace version, or $FLAMEFLEET_IMAGE_TAG)
#   scripts/images.sh sizes     each image's size
#
# Images (tag = the workspace version in Cargo.toml, which the chart defaults to):
#   flamefleet.local/flamefleet-operator  flamefleet-operator and flamefleet-store, user 65532
#   flamefleet.local/flamefleet-agent     flamefleet-agent
#   flamefleet.local/checkout-demo        the demo workload (examples/demo-workload)
#   flamefleet.local/inventory-demo       the Go demo workload (examples/demo-workload/inventory)
# Each holds the binary and exactly the shared libraries it links (scripts/lib/image.sh),
# plus CA certificates; operator/Dockerfile and node-agent/Dockerfile build the same layout
# for a user's own CI. FLAMEFLEET_IMAGE_TAG builds another tag of the same images (the
# upgrade test uses it); FLAMEFLEET_IMAGE_LABEL adds a label (to tell two builds apart).
set -euo pipefail
# shellcheck source=scripts/env.sh
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
# shellcheck source=scripts/lib/image.sh
source "$REPO/scripts/lib/image.sh"

IMAGES="$FLAMEFLEET_CACHE/images"
VERSION="$(awk -F'"' '/^version/ {print $2; exit}' "$REPO/Cargo.toml")"
TAG="${FLAMEFLEET_IMAGE_TAG:-$VERSION}"
REGISTRY=flamefleet.local
NAMES=(flamefleet-operator flamefleet-agent checkout-demo inventory-demo)
REVISION="$(git -C "$REPO" rev-parse --short HEAD 2>/dev/null || echo unknown)"

tar_of() { echo "$IMAGES/$1-$TAG.tar"; }

config() {
  # config ENTRYPOINT_JSON USER: the image config with OCI labels.
  local extra=""
  [[ -n "${FLAMEFLEET_IMAGE_LABEL:-}" ]] && extra=",\"dev.flamefleet.build\":\"$FLAMEFLEET_IMAGE_LABEL\""
  printf '{"Entrypoint":%s,"User":"%s","Env":["PATH=/usr/local/bin:/usr/bin:/bin"],"Labels":{"org.opencontainers.image.title":"flamefleet","org.opencontainers.image.version":"%s","org.opencontainers.image.revision":"%s","org.opencontainers.image.source":"https://example.invalid/flamefleet"%s}}' \
    "$1" "$2" "$VERSION" "$REVISION" "$extra"
}

# strip_debug FILE...: drop DWARF (line tables) from our binaries; symbols stay, so panics
# still name functions. (The demo workload keeps its debug info: it is what gets profiled.)
strip_debug() {
  strip --strip-debug "$@"
}

cmd_build() {
  local t0=$SECONDS
  echo "building release binaries (cargo build --release; the first build takes a while) ..."
  cargo build --release --quiet --manifest-path "$REPO/Cargo.toml" -p flamefleet-operator -p flamefleet-agent
  local out="$CARGO_TARGET_DIR/release" work
  mkdir -p "$IMAGES"

  work="$(mktemp -d)"
  rootfs_base "$work" 65532
  rootfs_add_binary "$work" "$out/flamefleet-operator" /usr/local/bin/flamefleet-operator
  rootfs_add_binary "$work" "$out/flamefleet-store" /usr/local/bin/flamefleet-store
  strip_debug "$work"/usr/local/bin/*
  docker_archive "$work" "$REGISTRY/flamefleet-operator:$TAG" "$(tar_of flamefleet-operator)" \
    "$(config '["/usr/local/bin/flamefleet-operator"]' 65532:65532)"
  rm -rf "$work"

  work="$(mktemp -d)"
  rootfs_base "$work" 65532
  rootfs_add_binary "$work" "$out/flamefleet-agent" /usr/local/bin/flamefleet-agent
  strip_debug "$work"/usr/local/bin/*
  # The agent runs as root (with only the capabilities the chart grants): it reads other
  # processes' /proc entries and loads eBPF programs.
  docker_archive "$work" "$REGISTRY/flamefleet-agent:$TAG" "$(tar_of flamefleet-agent)" \
    "$(config '["/usr/local/bin/flamefleet-agent"]' 0:0)"
  rm -rf "$work"

  work="$(mktemp -d)"
  rootfs_base "$work" 65532
  gcc -O1 -g -fno-omit-frame-pointer -pthread "$REPO/examples/demo-workload/checkout.c" -o "$work/checkout.bin"
  rootfs_add_binary "$work" "$work/checkout.bin" /usr/local/bin/checkout
  rm -f "$work/checkout.bin"
  docker_archive "$work" "$REGISTRY/checkout-demo:$TAG" "$(tar_of checkout-demo)" \
    "$(config '["/usr/local/bin/checkout"]' 65532:65532)"
  rm -rf "$work"

  # A static Go binary with its symbol table (the agent finds the runtime's heap profile
  # through it); standard library only, so the build downloads nothing.
  work="$(mktemp -d)"
  rootfs_base "$work" 65532
  (cd "$REPO/examples/demo-workload/inventory" && CGO_ENABLED=0 GOTOOLCHAIN=local go build -trimpath -o "$work/inventory.bin" .)
  rootfs_add_binary "$work" "$work/inventory.bin" /usr/local/bin/inventory
  rm -f "$work/inventory.bin"
  docker_archive "$work" "$REGISTRY/inventory-demo:$TAG" "$(tar_of inventory-demo)" \
    "$(config '["/usr/local/bin/inventory"]' 65532:65532)"
  rm -rf "$work"
  echo "built images $REGISTRY/{$(IFS=,; echo "${NAMES[*]}")}:$TAG in $((SECONDS - t0))s"
  cmd_sizes
}

cmd_import() {
  local files=() n
  for n in "${NAMES[@]}"; do
    [[ -f "$(tar_of "$n")" ]] || { echo "images.sh: $(tar_of "$n") is missing: run scripts/images.sh build" >&2; exit 1; }
    files+=("$(tar_of "$n")")
  done
  "$REPO/scripts/cluster.sh" import "${files[@]}"
  echo "imported ${NAMES[*]} ($TAG) into the cluster's containerd"
}

cmd_sizes() {
  local n
  for n in "${NAMES[@]}"; do
    [[ -f "$(tar_of "$n")" ]] && printf '  %-22s %s\n' "$n:$TAG" "$(image_size "$(tar_of "$n")")"
  done
}

case "${1:-}" in
  build) cmd_build ;;
  import) cmd_import ;;
  tag) echo "$TAG" ;;
  sizes) cmd_sizes ;;
  *) sed -n '2,20p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 2 ;;
esac
