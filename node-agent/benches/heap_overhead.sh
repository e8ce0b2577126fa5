#!/usr/bin/env bash
# Heap profiler overhead, all in one run (prints figures; not part of `cargo test`):
#   - throughput of malloc_bench.c in a cgroup with no profiler,
#   - with a bcc-memleak-style bpftrace script (uprobes on malloc/free, user stack on every
#     allocation, every live allocation tracked) filtered to the same cgroup,
#   - with `flamefleet-agent capture --type heap` at the default sampling (512 KiB),
# for each WORK level (arithmetic rounds between allocations; 0 = pure allocator loop), plus
# the per-call BPF cost from kernel.bpf_stats_enabled (run_time_ns / run_cnt).
#
# Usage (root): node-agent/benches/heap_overhead.sh
#   env: SECS=5 (per run), WORKS="0 2000 50000", AGENT=path/to/flamefleet-agent (default: release
#        build, built if missing), CARGO_TARGET_DIR as usual.
#        PEER_AGENT=path/to/another/flamefleet-agent (e.g. built from an earlier commit):
#        measured beside AGENT, the two in turn for ROUNDS rounds (default 3; without
#        PEER_AGENT, 1), medians printed; its rows say `old`.
set -euo pipefail

SECS=${SECS:-5}
WORKS=${WORKS:-"0 2000 50000"}
PEER_AGENT=${PEER_AGENT:-}
ROUNDS=${ROUNDS:-$([ -n "$PEER_AGENT" ] && echo 3 || echo 1)}
HERE=$(cd "$(dirname "$0")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
TARGET=${CARGO_TARGET_DIR:-$REPO/target}
AGENT=${AGENT:-$TARGET/release/flamefleet-agent}
[ "$(id -u)" = 0 ] || { echo "error: run as root (uprobes, cgroups, bpf stats)" >&2; exit 1; }
for tool in cc bpftrace bpftool python3; do
	command -v $tool >/dev/null || { echo "error: $tool not found; run scripts/setup.sh" >&2; exit 1; }
done
if [ ! -x "$AGENT" ]; then
	(cd "$REPO" && cargo build --release -p flamefleet-agent)
fi

ROOT=$(awk '$3 == "cgroup2" { print $2; exit }' /proc/mounts)
[ -n "$ROOT" ] || { echo "error: no cgroup2 mount in /proc/mounts" >&2; exit 1; }
TMP=$(mktemp -d)
CG=$ROOT/ff-heap-bench-$$
LIBC=$(ldd /bin/true | awk '/libc.so/ { print $3 }')
mkdir "$CG"
HOLDER=
cleanup() {
	[ -n "$HOLDER" ] && kill "$HOLDER" 2>/dev/null || true
	[ -n "${BT:-}" ] && kill "$BT" 2>/dev/null || true
	[ -n "${AP:-}" ] && kill "$AP" 2>/dev/null || true
	sleep 0.5
	rmdir "$CG" 2>/dev/null || true
	rm -rf "$TMP"
}
trap cleanup EXIT

cc -O2 -g -fno-omit-frame-pointer -o "$TMP/malloc_bench" "$HERE/malloc_bench.c"

# One run of the benchmark inside the cgroup; prints operations per CPU second
# (robust to other load on the machine; uprobe handling is charged to the process).
bench() {
	sh -c "echo \$\$ > $CG/cgroup.procs; exec $TMP/malloc_bench $SECS $1" 2>/dev/null | awk '{ print $2 }'
}

# The IDs of the BPF programs loaded now.
prog_ids() { bpftool prog show -j | python3 -c 'import json, sys; print(",".join(str(p["id"]) for p in json.load(sys.stdin)))'; }

# Sum of run_time_ns and run_cnt, "ns cnt", over the uprobe programs (type kprobe) not among
# the IDs $1: the ones the tracer loaded since (other programs on the machine stay out).
bpf_totals() {
	bpftool prog show -j | python3 -c '
import json, sys
old = {int(i) for i in sys.argv[1].split(",") if i}
ns = cnt = 0
for p in json.load(sys.stdin):
    if p["id"] not in old and p.get("type") == "kprobe":
        ns += p.get("run_time_ns", 0); cnt += p.get("run_cnt", 0)
print(ns, cnt)' "$1"
}

per_call() { # before_ns before_cnt after_ns after_cnt
	python3 -c "import sys; n=$3-$1; c=$4-$2; print(f'{n/c:.0f}' if c else 'n/a')"
}

sysctl -q kernel.bpf_stats_enabled=1
declare -A BASE PEER OURS OLD

echo "== baseline (no profiler)"
for w in $WORKS; do BASE[$w]=$(bench "$w"); echo "work=$w ops/cpu-s=${BASE[$w]}"; done

echo "== peer: bpftrace memleak-style (every malloc/free traced, ustack per allocation)"
cat >"$TMP/memleak.bt" <<EOF
uprobe:$LIBC:malloc /cgroup == cgroupid("$CG")/ { @size[tid] = arg0; }
uretprobe:$LIBC:malloc /@size[tid]/ {
	@bytes[retval] = @size[tid]; @stack[retval] = ustack; delete(@size[tid]);
}
uprobe:$LIBC:free /cgroup == cgroupid("$CG")/ { delete(@bytes[arg0]); delete(@stack[arg0]); }
EOF
IDS=$(prog_ids)
BPFTRACE_MAP_KEYS_MAX=65536 bpftrace "$TMP/memleak.bt" >"$TMP/bt.out" 2>&1 &
BT=$!
for _ in $(seq 100); do grep -q Attaching "$TMP/bt.out" 2>/dev/null && break; sleep 0.2; done
sleep 1
read -r b_ns b_cnt < <(bpf_totals "$IDS")
for w in $WORKS; do PEER[$w]=$(bench "$w"); echo "work=$w ops/cpu-s=${PEER[$w]}"; done
read -r a_ns a_cnt < <(bpf_totals "$IDS")
PEER_NS=$(per_call "$b_ns" "$b_cnt" "$a_ns" "$a_cnt")
kill -INT "$BT"; wait "$BT" 2>/dev/null || true; BT=
echo "peer BPF cost per call: ${PEER_NS} ns"

# A process in the cgroup from the start, so its allocator is probed before the runs.
sh -c "echo \$\$ > $CG/cgroup.procs; exec sleep 100000" &
HOLDER=$!
NW=$(echo $WORKS | wc -w)
declare -A RUNS NS
# One capture by agent $1 (label $2) over a run of each WORK: appends the ops per CPU second
# to RUNS[$2,work] and the BPF ns per program run to NS[$2].
ours() {
	local ids
	ids=$(prog_ids)
	# --force: an allocator microbenchmark is exactly what the overhead guard refuses.
	"$1" capture --type heap --force --cgroup "$CG" --duration "$((SECS * NW + 6))s" -o "$TMP/heap.pb.gz" --text \
		>"$TMP/agent.out" 2>&1 &
	AP=$!
	sleep 3
	read -r b_ns b_cnt < <(bpf_totals "$ids")
	for w in $WORKS; do
		local ops
		ops=$(bench "$w")
		echo "$2 work=$w ops/cpu-s=$ops"
		RUNS[$2,$w]="${RUNS[$2,$w]:-} $ops"
	done
	read -r a_ns a_cnt < <(bpf_totals "$ids")
	local ns
	ns=$(per_call "$b_ns" "$b_cnt" "$a_ns" "$a_cnt")
	NS[$2]="${NS[$2]:-} $ns"
	wait "$AP"; AP=
	echo "$2 BPF cost per call: $ns ns"
	sed 's/^/  agent: /' "$TMP/agent.out"
}
median() { python3 -c "import statistics, sys; v = [float(x) for x in sys.argv[1:] if x != 'n/a']; print(f'{statistics.median(v):.0f}' if v else 'n/a')" "$@"; }
echo "== ours: flamefleet-agent capture --type heap (default sampling, 512 KiB)${PEER_AGENT:+, and old: $PEER_AGENT, in turn}, $ROUNDS round(s)"
for _ in $(seq "$ROUNDS"); do
	ours "$AGENT" ours
	if [ -n "$PEER_AGENT" ]; then ours "$PEER_AGENT" old; fi
done
kill "$HOLDER" 2>/dev/null || true; HOLDER=
for w in $WORKS; do
	OURS[$w]=$(median ${RUNS[ours,$w]})
	if [ -n "$PEER_AGENT" ]; then OLD[$w]=$(median ${RUNS[old,$w]}); fi
done
OURS_NS=$(median ${NS[ours]})
if [ -n "$PEER_AGENT" ]; then OLD_NS=$(median ${NS[old]}); fi
sysctl -q kernel.bpf_stats_enabled=0

echo "== results: ops per CPU second, loss vs. baseline, CPU time added per operation (malloc+free, us)"
echo "   ratio = peer's added time / ours (how many times cheaper per allocation we are)"
printf "%-6s %11s %11s %7s %9s %11s %7s %9s %7s\n" work base_ops peer_ops peer% peer_us+ ours_ops ours% ours_us+ ratio
for w in $WORKS; do
	python3 -c "
b, p, o = ${BASE[$w]}, ${PEER[$w]}, ${OURS[$w]}
pl, ol = (1 - p / b) * 100, (1 - o / b) * 100
pa, oa = (1 / p - 1 / b) * 1e6, (1 / o - 1 / b) * 1e6
r = f'{pa / oa:7.1f}' if oa > 0 else '    n/a'
print(f'{$w:<6} {b:11.0f} {p:11.0f} {pl:6.1f}% {pa:9.2f} {o:11.0f} {ol:6.1f}% {oa:9.2f} {r}')"
done
echo "BPF ns per program run (kernel.bpf_stats_enabled): peer ${PEER_NS}, ours ${OURS_NS} (median of $ROUNDS)"
if [ -n "$PEER_AGENT" ]; then
	echo "== ours vs old ($PEER_AGENT), medians of $ROUNDS rounds in turn: ops per CPU second, CPU time added per operation (us)"
	printf "%-6s %11s %11s %9s %11s %9s\n" work base_ops ours_ops ours_us+ old_ops old_us+
	for w in $WORKS; do
		python3 -c "
b, o, p = ${BASE[$w]}, ${OURS[$w]}, ${OLD[$w]}
print(f'{$w:<6} {b:11.0f} {o:11.0f} {(1 / o - 1 / b) * 1e6:9.2f} {p:11.0f} {(1 / p - 1 / b) * 1e6:9.2f}')"
	done
	echo "BPF ns per program run: ours ${OURS_NS} (rounds:${NS[ours]}), old ${OLD_NS} (rounds:${NS[old]})"
fi
