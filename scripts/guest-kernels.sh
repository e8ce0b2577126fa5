#!/usr/bin/env bash
# Downloads the Debian kernels the guest test tier boots under QEMU (node-agent/tests/kernels.rs)
# and unpacks each into $FLAMEFLEET_CACHE/guest-kernels/<release>/ (boot/vmlinuz-*,
# boot/config-*, lib/modules/<release>/ with modules.dep). Idempotent: a kernel already
# unpacked is only checked.
#
# The packages come from Debian's archive through apt with a private sources list, so the
# machine's own apt configuration is neither read nor changed; nothing is installed.
#
#   scripts/guest-kernels.sh
set -euo pipefail
# shellcheck source=scripts/env.sh
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"

# suite:package. Keep in step with DEBIAN_KERNELS in e2e/src/guest.rs and the tier in
# node-agent/tests/kernels.rs.
KERNELS=(
  bullseye:linux-image-5.10.0-32-amd64
  bookworm:linux-image-6.1.0-50-amd64
  bookworm-backports:linux-image-6.12.95+deb12-amd64
)
# Where 6.1.0-50 comes from: bookworm's point releases and its security suite.
SUITES=(bullseye bullseye-updates bookworm bookworm-updates bookworm-backports)
SECURITY_SUITES=(bullseye-security bookworm-security)

ROOT="$FLAMEFLEET_CACHE/guest-kernels"
mkdir -p "$ROOT"

release_of() { local p="$1"; echo "${p#linux-image-}"; }

missing=()
for k in "${KERNELS[@]}"; do
  pkg="${k#*:}"
  rel="$(release_of "$pkg")"
  if [[ -f "$ROOT/$rel/boot/vmlinuz-$rel" && -f "$ROOT/$rel/lib/modules/$rel/modules.dep" ]]; then
    echo "kernel $rel present in $ROOT/$rel"
  else
    missing+=("$pkg")
  fi
done
((${#missing[@]})) || exit 0

command -v dpkg-deb >/dev/null || die "dpkg-deb not found (Debian's dpkg)"
command -v depmod >/dev/null || die "depmod not found; install Debian's kmod package"

APT="$ROOT/.apt"
mkdir -p "$APT/lists/partial" "$APT/archives/partial"
{
  for s in "${SUITES[@]}"; do echo "deb http://deb.debian.org/debian $s main"; done
  for s in "${SECURITY_SUITES[@]}"; do echo "deb http://deb.debian.org/debian-security $s main"; done
} >"$APT/sources.list"
apt_opts=(
  -o "Dir::Etc::SourceList=$APT/sources.list"
  -o Dir::Etc::SourceParts=/dev/null
  -o "Dir::State::Lists=$APT/lists"
  -o "Dir::Cache::Archives=$APT/archives"
  -o "Dir::Cache=$APT"
  -o APT::Get::List-Cleanup=0
  # The download lands in a root-owned cache, which apt's sandbox user cannot write.
  -o APT::Sandbox::User=root
)
echo "fetching the package lists of ${SUITES[*]} ${SECURITY_SUITES[*]}"
apt-get "${apt_opts[@]}" update -q >/dev/null

for pkg in "${missing[@]}"; do
  rel="$(release_of "$pkg")"
  work="$ROOT/.download-$rel"
  rm -rf "$work" && mkdir -p "$work"
  # The newest version of the package in any suite listed (each kernel ABI is one package).
  (cd "$work" && apt-get "${apt_opts[@]}" download -q "$pkg") ||
    die "cannot download $pkg from Debian's archive (see above); it may have left the suite: update KERNELS"
  deb="$(ls "$work"/*.deb)"
  dest="$ROOT/$rel.partial"
  rm -rf "$dest" && mkdir -p "$dest"
  dpkg-deb -x "$deb" "$dest"
  # Debian 12's kernels compress modules with xz; busybox's insmod in the guest reads plain
  # ELF only.
  find "$dest/lib/modules" -name '*.ko.xz' -exec xz -d {} +
  depmod -b "$dest" "$rel"
  [[ -f "$dest/boot/vmlinuz-$rel" ]] || die "$deb holds no boot/vmlinuz-$rel"
  grep -q '^CONFIG_DEBUG_INFO_BTF=y' "$dest/boot/config-$rel" ||
    die "$pkg was built without BTF (CONFIG_DEBUG_INFO_BTF); the agent cannot run on it"
  rm -rf "${ROOT:?}/$rel" && mv "$dest" "$ROOT/$rel"
  rm -rf "$work"
  echo "kernel $rel unpacked in $ROOT/$rel ($(du -sh "$ROOT/$rel" | cut -f1))"
done
