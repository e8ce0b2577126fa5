# Building container images without a registry or a container engine, as root on this
# machine: a root filesystem directory becomes a one-layer docker-archive tar (the format
# `docker save` writes and `ctr images import` reads). Sourced by scripts/images.sh and
# scripts/cluster.sh.
#
# Why not docker/podman/buildah: no engine runs here and no registry is reachable, so
# nothing could be pulled FROM anyway; our images hold one binary and the exact shared
# libraries it links (a distroless layout), which a tar describes completely. The
# Dockerfiles next to the crates build the same layout for users' CI.
# shellcheck shell=bash

# rootfs_add_binary ROOTFS BINARY DEST: copies BINARY to ROOTFS/DEST with every shared
# library `ldd` resolves for it (and the dynamic loader), at their absolute paths.
rootfs_add_binary() {
  local rootfs="$1" bin="$2" dest="$3" lib
  install -D -m 0755 "$bin" "$rootfs$dest"
  # ldd prints "name => /path (addr)" and the loader as "/lib64/ld-linux-x86-64.so.2 (addr)".
  while read -r lib; do
    [[ -n "$lib" && -e "$lib" ]] || continue
    # 0755: the dynamic loader must be executable (the kernel opens it with exec permission).
    install -D -m 0755 "$(readlink -f "$lib")" "$rootfs$lib"
  done < <(ldd "$bin" 2>/dev/null | awk '/=> \// { print $3 } /^\t\// { print $1 }')
}

# rootfs_add_system_libs ROOTFS FILE...: copies every shared library under /lib or /usr/lib
# that `ldd` resolves for the FILEs (and the dynamic loader) to ROOTFS at the same paths;
# libraries found elsewhere (a runtime's own, next to its binaries) are left to the caller.
rootfs_add_system_libs() {
  local rootfs="$1" lib
  shift
  while read -r lib; do
    case "$lib" in /lib/* | /lib64/* | /usr/lib/*) ;; *) continue ;; esac
    [[ -e "$lib" && ! -e "$rootfs$lib" ]] || continue
    install -D -m 0755 "$(readlink -f "$lib")" "$rootfs$lib"
  done < <(for f in "$@"; do ldd "$f" 2>/dev/null; done |
    awk '/=> \// { print $3 } /^\t\// { print $1 }' | sort -u)
}

# rootfs_base ROOTFS UID: the few files every image needs: /etc/passwd and /etc/group with
# root and `nonroot` (UID), /tmp, CA certificates (for HTTPS to S3 stores).
rootfs_base() {
  local rootfs="$1" uid="$2"
  mkdir -p "$rootfs/etc" "$rootfs/tmp" "$rootfs/etc/ssl/certs"
  chmod 1777 "$rootfs/tmp"
  printf 'root:x:0:0:root:/root:/sbin/nologin\nnonroot:x:%s:%s:nonroot:/home/nonroot:/sbin/nologin\n' "$uid" "$uid" >"$rootfs/etc/passwd"
  printf 'root:x:0:\nnonroot:x:%s:\n' "$uid" >"$rootfs/etc/group"
  if [[ -f /etc/ssl/certs/ca-certificates.crt ]]; then
    cp /etc/ssl/certs/ca-certificates.crt "$rootfs/etc/ssl/certs/"
  fi
}

# docker_archive ROOTFS REF OUT.tar CONFIG_JSON: writes a docker-archive of ROOTFS tagged REF
# (e.g. flamefleet.local/flamefleet-agent:0.1.0). CONFIG_JSON is the image's "config" object
# (Entrypoint, User, Env, Labels, ...). Deterministic: same inputs, same image ID.
docker_archive() {
  local rootfs="$1" ref="$2" out="$3" config="$4"
  local work; work="$(mktemp -d)"
  chmod 0755 "$rootfs"
  tar --sort=name --owner=0 --group=0 --numeric-owner --mtime=@0 \
    -C "$rootfs" -cf "$work/layer.tar" .
  local diff_id; diff_id="$(sha256sum "$work/layer.tar" | cut -d' ' -f1)"
  printf '{"architecture":"amd64","os":"linux","config":%s,"rootfs":{"type":"layers","diff_ids":["sha256:%s"]},"history":[{"created_by":"scripts/lib/image.sh"}]}' \
    "$config" "$diff_id" >"$work/config.json"
  local config_id; config_id="$(sha256sum "$work/config.json" | cut -d' ' -f1)"
  mv "$work/config.json" "$work/$config_id.json"
  printf '[{"Config":"%s.json","RepoTags":["%s"],"Layers":["layer.tar"]}]' "$config_id" "$ref" >"$work/manifest.json"
  mkdir -p "$(dirname "$out")"
  tar --owner=0 --group=0 --numeric-owner --mtime=@0 -C "$work" -cf "$out.tmp" \
    manifest.json "$config_id.json" layer.tar
  mv "$out.tmp" "$out"
  rm -rf "$work"
}

# image_size OUT.tar: the archive's size, human readable.
image_size() {
  du -h "$1" | cut -f1
}
