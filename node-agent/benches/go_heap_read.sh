#!/usr/bin/env bash
# Benchmark of the Go runtime heap source (root): a Go program with ~16,000 distinct
# allocation stacks, every allocation sampled (MemProfileRate = 1), runs in a cgroup of its
# own; the agent captures its heap with --heap-source goruntime while the program's spinner
# rate is sampled every 100 ms. Prints the read's figures (buckets, bytes, milliseconds, from
# the profile's comments) and the spinner rate before, during and after the capture, so a
# pause of the target would show as a dip at the read. Prints figures; asserts nothing.
#
#   AGENT=$CARGO_TARGET_DIR/release/flamefleet-agent node-agent/benches/go_heap_read.sh [DEPTH]
#
# DEPTH (default 14) gives 2^DEPTH distinct stacks.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
AGENT="${AGENT:?set AGENT to a flamefleet-agent binary}"
DEPTH="${1:-14}"
work="$(mktemp -d)"
root="$(awk '$3 == "cgroup2" {print $2; exit}' /proc/mounts)"
cg="$root/ff-bench-goread-$$"
cleanup() { pkill -f "$work/goheapread" 2>/dev/null || true; sleep 0.2; rmdir "$cg" 2>/dev/null || true; rm -rf "$work"; }
trap cleanup EXIT
(cd "$here/go_heap_read" && CGO_ENABLED=0 GOTOOLCHAIN=local go build -o "$work/goheapread" .)
mkdir "$cg"
(echo "$BASHPID" >"$cg/cgroup.procs"; exec "$work/goheapread" "$DEPTH") >"$work/out" 2>&1 &
for _ in $(seq 100); do grep -q '^ready' "$work/out" && break; sleep 0.1; done
port="$(awk '/^ready/ {print $2}' "$work/out")"
[[ -n "$port" ]] || { cat "$work/out"; exit 1; }
count() { curl -s "127.0.0.1:$port/count"; }
( prev=$(count); for _ in $(seq 80); do sleep 0.1; c=$(count); printf '%s %s\n' "$(date +%s.%N)" "$((c - prev))"; prev=$c; done ) >"$work/rates" &
sampler=$!
sleep 2
start=$(date +%s.%N)
"$AGENT" capture --type heap --heap-source goruntime --cgroup "${cg#"$root"/}" --duration 1s --output "$work/heap.pb.gz" >/dev/null
end=$(date +%s.%N)
wait "$sampler"
echo "capture: $(awk -v a="$start" -v b="$end" 'BEGIN {printf "%.1f", b - a}') s (1 s window, then the read, then symbolization)"
go tool pprof -raw "$work/heap.pb.gz" 2>/dev/null | sed -n 's/^Comment: heap_source goruntime: /read: /p'
echo "spinner iterations per 100 ms (the read happens right after the 1 s window):"
awk -v s="$start" '{printf "  t=%+5.1fs %s\n", $1 - s - 1.0, $2}' "$work/rates" | awk 'NR % 2 == 1'
