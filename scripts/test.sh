#!/usr/bin/env bash
# Runs every check and every test tier, as root:
#
#   scripts/test.sh                     setup check, fmt, clippy, all tests
#   scripts/test.sh -p flamefleet-api   extra arguments go to `cargo test`
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

# The demo's workloads (scripts/demo.sh scales them to 0 once it has printed its results)
# keep more busy threads than CPUs when running: tests that load this machine on purpose
# (fleet_scale's 5,000 hollow agents) would then measure them too. Stop them first, and say so.
quiet_demo_workloads() {
  "$REPO/scripts/cluster.sh" status 2>/dev/null | grep -q '^kube-apiserver .*running' || return 0
  local busy
  busy="$("$REPO/scripts/cluster.sh" kubectl -n flamefleet-demo get deploy --no-headers \
    -o custom-columns=NAME:.metadata.name,REPLICAS:.spec.replicas 2>/dev/null |
    awk '$2 > 0 {printf "%s ", $1}')" || return 0
  [[ -n "$busy" ]] || return 0
  step "the demo's workloads (${busy% }) run on this machine: scaling them to 0 replicas so that they do not load the tests ($REPO/scripts/cluster.sh kubectl -n flamefleet-demo scale deploy --all --replicas=1 brings them back)"
  "$REPO/scripts/cluster.sh" kubectl -n flamefleet-demo scale deploy --all --replicas=0 >/dev/null
  "$REPO/scripts/cluster.sh" kubectl -n flamefleet-demo wait --for=delete pod --all --timeout=120s >/dev/null 2>&1 || true
}
quiet_demo_workloads

if [[ "${FLAMEFLEET_SKIP_SETUP:-}" != 1 ]]; then
  timed setup "$REPO/scripts/setup.sh"
fi
timed fmt cargo fmt --all --check
timed clippy cargo clippy --workspace --all-targets -- -D warnings
# The tests' output is long, and a CI log may keep only part of it: on failure, each
# panic's first lines are printed again at the end.
run_tests() {
  local log rc=0
  log="$(mktemp /tmp/flamefleet-tests.XXXXXX.log)"
  cargo test --workspace --no-fail-fast "$@" 2>&1 | tee "$log" || rc=$?
  if [[ $rc -ne 0 ]]; then
    step "what failed: each panic's first lines (the whole output: $log)"
    awk '/^---- .* stdout ----$/ {print} /panicked at/ {n = 12; m = 300}
         n > 0 {print; n--; m--; next} m > 0 && /^ *(left|right):/ {print} m > 0 {m--}' "$log" |
      cut -c1-400 | head -n 400
  fi
  return "$rc"
}
timed test run_tests "$@"

step "all checks passed"
printf '  %s\n' "${SUMMARY[@]}"
