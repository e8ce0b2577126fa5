#!/usr/bin/env bash
# Runs the whole suite (scripts/test.sh) several times in a row while the machine also
# builds: the check that the tests synchronize on signals, not on time, and pass on a
# loaded 2-core machine. Not part of scripts/test.sh (it takes hours).
#
#   scripts/suite-under-load.sh [RUNS]      default 5
#
# The load is a release build of the workspace from scratch, in its own target directory
# ($FLAMEFLEET_CACHE/load-target), started again whenever it finishes, for as long as the
# suite runs. Each run's output goes to $FLAMEFLEET_CACHE/suite-under-load/run-N.log; the
# summary says which runs passed. Exits non-zero when any run failed.
set -euo pipefail
# shellcheck source=scripts/env.sh
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
require_root "scripts/test.sh needs root"
cd "$REPO"

RUNS="${1:-5}"
[[ "$RUNS" =~ ^[1-9][0-9]*$ ]] || die "RUNS must be a positive number, found '$RUNS'"
LOGS="$FLAMEFLEET_CACHE/suite-under-load"
LOAD_TARGET="$FLAMEFLEET_CACHE/load-target"
mkdir -p "$LOGS"

# The suite's own build first, without the load, so that every run tests the same binaries.
step "building the suite's binaries"
cargo test --workspace --no-run >"$LOGS/build.log" 2>&1 || die "the build failed: $LOGS/build.log"

step "starting the load: release builds from scratch in $LOAD_TARGET, one after another"
(
  trap 'exit 0' TERM
  while :; do
    rm -rf "$LOAD_TARGET"
    CARGO_TARGET_DIR="$LOAD_TARGET" nice -n 5 cargo build --release --workspace >/dev/null 2>&1 || true
  done
) &
LOAD=$!
stop_load() {
  pkill -TERM -P "$LOAD" 2>/dev/null || true
  kill -TERM "$LOAD" 2>/dev/null || true
  wait "$LOAD" 2>/dev/null || true
  # The killed cargo's rustc processes may still write for a moment: a failed removal
  # must not turn the runs' verdict into a failure (the exit status is the runs').
  for _ in 1 2 3 4 5; do
    rm -rf "$LOAD_TARGET" 2>/dev/null && return 0
    sleep 1
  done
  printf 'could not remove %s; remove it by hand\n' "$LOAD_TARGET" >&2
  return 0
}
trap stop_load EXIT

declare -a RESULTS=()
failed=0
for i in $(seq "$RUNS"); do
  step "suite run $i of $RUNS (log: $LOGS/run-$i.log)"
  t0=$SECONDS
  if FLAMEFLEET_SKIP_SETUP=1 "$REPO/scripts/test.sh" >"$LOGS/run-$i.log" 2>&1; then
    verdict=passed
  else
    verdict=FAILED
    failed=$((failed + 1))
  fi
  summary=$(grep -E '^test result:' "$LOGS/run-$i.log" |
    awk '{p += $4; f += $6; ig += $8} END {printf "%d passed, %d failed, %d ignored", p, f, ig}')
  RESULTS+=("$(printf 'run %d: %s in %ds (%s)' "$i" "$verdict" $((SECONDS - t0)) "$summary")")
  printf '  %s\n' "${RESULTS[-1]}"
done

step "summary: $((RUNS - failed)) of $RUNS runs passed while a release build ran"
printf '  %s\n' "${RESULTS[@]}"
[[ $failed -eq 0 ]]
