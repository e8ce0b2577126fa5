#!/usr/bin/env bash
# Runs every check and every test tier, as root:
#
#   sudo scripts/test.sh                 setup check, fmt, clippy, all tests
#   sudo scripts/test.sh -p flamefleet-api   extra arguments go to `cargo test`
#
# FLAMEFLEET_SKIP_SETUP=1 skips scripts/setup.sh. CARGO_TARGET_DIR defaults to
# $FLAMEFLEET_CACHE/target (outside the clone). Tests that need root, eBPF or the API
# server fail (never skip) when their prerequisite is missing.
set -euo pipefail
# shellcheck source=scripts/env.sh
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
require_root "the tests load eBPF programs, create cgroups and start a local kube-apiserver"
cd "$REPO"

declare -a SUMMARY=()
timed() {
  local name="$1"; shift
  step "$name"
  local t0=$SECONDS
  "$@"
  SUMMARY+=("$(printf '%-8s %4ss' "$name" $((SECONDS - t0)))")
}

if [[ "${FLAMEFLEET_SKIP_SETUP:-}" != 1 ]]; then
  timed setup "$REPO/scripts/setup.sh"
fi
timed fmt cargo fmt --all --check
timed clippy cargo clippy --workspace --all-targets -- -D warnings
timed test cargo test --workspace --no-fail-fast "$@"

step "all checks passed"
printf '  %s\n' "${SUMMARY[@]}"
