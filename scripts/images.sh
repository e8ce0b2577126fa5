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
#   flamefleet.local/orders-demo          the Go OOM demo workload (examples/demo-workload/orders)
#   flamefleet.local/catalog-demo         the Python demo workload (examples/demo-workload/catalog):
#                                         pyenv's CPython 3.12 and the few modules it loads
#   flamefleet.local/ledger-demo          the Java demo workload (examples/demo-workload/ledger):
#                                         OpenJDK 17 jlinked to java.base
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
NAMES=(flamefleet-operator flamefleet-agent checkout-demo inventory-demo orders-demo catalog-demo ledger-demo)
# The demo's runtimes: scripts/setup.sh installs both (scripts/install-pythons.sh, Debian's
# openjdk-17-jdk-headless).
PYTHON_VERSION=3.12.1
JDK=/usr/lib/jvm/java-17-openjdk-amd64
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

# jre_java_base: the path of a Java runtime holding only java.base, jlinked from $JDK
# (34 MB against the JDK's 300), kept in $FLAMEFLEET_CACHE/jre per JDK build: jlink takes
# ~7 s, and the real-node test builds the images twice.
jre_java_base() {
  local release out
  [[ -x "$JDK/bin/jlink" && -x "$JDK/bin/javac" ]] ||
    die "$JDK/bin/jlink or javac is missing: scripts/setup.sh installs openjdk-17-jdk-headless"
  release="$(sed -n 's/^JAVA_RUNTIME_VERSION="\(.*\)"$/\1/p' "$JDK/release")"
  [[ -n "$release" ]] || die "no JAVA_RUNTIME_VERSION in $JDK/release"
  out="$FLAMEFLEET_CACHE/jre/java.base-$release"
  if [[ ! -x "$out/bin/java" ]]; then
    rm -rf "$out.tmp"
    mkdir -p "$(dirname "$out")"
    "$JDK/bin/jlink" --add-modules java.base --compress=2 --strip-debug --no-header-files --no-man-pages \
      --output "$out.tmp" >&2
    mv "$out.tmp" "$out"
  fi
  echo "$out"
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
  work="$(mktemp -d)"
  rootfs_base "$work" 65532
  (cd "$REPO/examples/demo-workload/orders" && CGO_ENABLED=0 GOTOOLCHAIN=local go build -trimpath -o "$work/orders.bin" .)
  rootfs_add_binary "$work" "$work/orders.bin" /usr/local/bin/orders
  rm -f "$work/orders.bin"
  docker_archive "$work" "$REGISTRY/orders-demo:$TAG" "$(tar_of orders-demo)" \
    "$(config '["/usr/local/bin/orders"]' 65532:65532)"
  rm -rf "$work"
  # CPython as the official python images ship it (a shared libpython, which the agent
  # finds _PyRuntime in), with only what the interpreter loads at startup: the
  # encodings it needs, and os.py, the file by which it finds its standard library under
  # /usr/local/lib/python3.12 (most of what it imports at startup is frozen into it).
  # catalog.py imports nothing else. Debug info goes (symbols and .eh_frame stay: the
  # agent names and unwinds the interpreter's native frames with them): 11 MB.
  local py_minor="${PYTHON_VERSION%.*}" py_home
  py_home="${PYENV_ROOT:-/root/.pyenv}/versions/$PYTHON_VERSION"
  [[ -x "$py_home/bin/python$py_minor" && -f "$py_home/lib/libpython$py_minor.so.1.0" ]] ||
    die "CPython $PYTHON_VERSION (with libpython) is missing at $py_home: scripts/install-pythons.sh builds it"
  work="$(mktemp -d)"
  rootfs_base "$work" 65532
  install -D -m 0755 "$py_home/bin/python$py_minor" "$work/usr/local/bin/python$py_minor"
  ln -s "python$py_minor" "$work/usr/local/bin/python3"
  # Where the loader looks when the binary's RUNPATH (pyenv's directory) is not there.
  install -D -m 0755 "$py_home/lib/libpython$py_minor.so.1.0" \
    "$work/usr/lib/x86_64-linux-gnu/libpython$py_minor.so.1.0"
  rootfs_add_system_libs "$work" "$py_home/bin/python$py_minor" "$py_home/lib/libpython$py_minor.so.1.0"
  strip_debug "$work/usr/local/bin/python$py_minor" "$work/usr/lib/x86_64-linux-gnu/libpython$py_minor.so.1.0"
  local stdlib="$work/usr/local/lib/python$py_minor"
  mkdir -p "$stdlib/encodings" "$stdlib/lib-dynload"
  cp "$py_home/lib/python$py_minor/os.py" "$stdlib/"
  for f in __init__ aliases utf_8 ascii latin_1; do
    cp "$py_home/lib/python$py_minor/encodings/$f.py" "$stdlib/encodings/"
  done
  install -D -m 0644 "$REPO/examples/demo-workload/catalog/catalog.py" "$work/app/catalog.py"
  docker_archive "$work" "$REGISTRY/catalog-demo:$TAG" "$(tar_of catalog-demo)" \
    "$(config '["/usr/local/bin/python3","/app/catalog.py"]' 65532:65532)"
  rm -rf "$work"

  # Debian's OpenJDK 17, jlinked to java.base, and Ledger compiled by its javac. The JVM runs
  # with -XX:+PreserveFramePointer (the callers of compiled frames are walked by frame
  # pointer) and as root in its container: the chart's agent attaches (to ask for the perf
  # map naming compiled frames) only to JVMs of its own user unless
  # agent.javaAttachOtherUsers is set (docs/capture.md, "Java frames").
  local jre
  jre="$(jre_java_base)"
  work="$(mktemp -d)"
  rootfs_base "$work" 65532
  mkdir -p "$work/opt"
  cp -a "$jre" "$work/opt/java"
  rootfs_add_system_libs "$work" "$jre/bin/java" "$jre"/lib/*.so "$jre"/lib/server/libjvm.so
  "$JDK/bin/javac" --release 17 -d "$work/app" "$REPO/examples/demo-workload/ledger/Ledger.java"
  docker_archive "$work" "$REGISTRY/ledger-demo:$TAG" "$(tar_of ledger-demo)" \
    "$(config '["/opt/java/bin/java","-XX:+PreserveFramePointer","-cp","/app","dev.flamefleet.demo.Ledger"]' 0:0)"
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
