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
# In a process group of its own (setsid), so that stopping it reaches cargo's rustc
# processes too, not just the loop.
setsid bash -c '
  while :; do
    rm -rf "$1"
    CARGO_TARGET_DIR="$1" nice -n 5 cargo build --release --workspace >/dev/null 2>&1 || true
  done' load "$LOAD_TARGET" &
LOAD=$!
stop_load() {
  kill -TERM -- "-$LOAD" 2>/dev/null || true
  # Until every process of the group has exited, something may still write there.
  while kill -0 -- "-$LOAD" 2>/dev/null; do sleep 0.2; done
  # The exit status stays the runs' verdict, whatever the cleanup finds.
  rm -rf "$LOAD_TARGET" || printf 'could not remove %s; remove it by hand\n' "$LOAD_TARGET" >&2
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
