#!/usr/bin/env bash
# Installs the S3-compatible server the artifact-store tests run against
# (s3s-fs from crates.io), cached outside the repository. Idempotent: does
# nothing when the pinned version is already installed. 0.14.1 is the newest
# s3s-fs whose minimum Rust (1.92) our toolchain (1.95) meets.
#
# The tests look for the binary at $FLAMEFLEET_S3S_FS, or else at
# /var/cache/flamefleet/s3s-fs/bin/s3s-fs (the default root below).
set -euo pipefail

S3S_FS_VERSION="${S3S_FS_VERSION:-0.14.1}"
S3S_FS_ROOT="${S3S_FS_ROOT:-/var/cache/flamefleet/s3s-fs}"
BIN="$S3S_FS_ROOT/bin/s3s-fs"

if [[ -x "$BIN" ]] && "$BIN" --version 2>/dev/null | grep -q "$S3S_FS_VERSION"; then
    echo "s3s-fs $S3S_FS_VERSION already installed at $BIN"
    exit 0
fi

mkdir -p "$S3S_FS_ROOT"
# A private target dir so this build never touches the workspace's.
CARGO_TARGET_DIR="$S3S_FS_ROOT/build" nice -n 15 cargo install --locked \
    s3s-fs --version "$S3S_FS_VERSION" --features binary --root "$S3S_FS_ROOT"
rm -rf "$S3S_FS_ROOT/build"
"$BIN" --version
echo "s3s-fs installed at $BIN"
