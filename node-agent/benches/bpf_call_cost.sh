#!/usr/bin/env bash
# What each building block of a scheduler tracer costs on this machine, in one run (prints
# figures; not part of `cargo test`): an empty tp_btf program on sched_switch, and one each
# with BTF loads, bpf_ktime_get_ns, a task-storage get, a cgroup-storage get, a per-CPU
# array lookup and a hash-map update, all attached at once while `perf bench sched pipe`
# runs, priced with kernel.bpf_stats_enabled (run_time_ns / run_cnt). "extra" is a block's
# cost above the empty program, whose own figure is mostly bpf_stats' two clock reads.
# It explains the runqlat figures of capture_overhead (docs/benchmarks.md).
#
# Usage (root): node-agent/benches/bpf_call_cost.sh   env: ROUNDS=3 LOOPS=200000
set -euo pipefail
ROUNDS=${ROUNDS:-3}
LOOPS=${LOOPS:-200000}
HERE=$(cd "$(dirname "$0")" && pwd)
[ "$(id -u)" = 0 ] || { echo "error: run as root (BPF programs, cgroups, bpf stats)" >&2; exit 1; }
for tool in clang cc bpftool perf python3; do
	command -v $tool >/dev/null || { echo "error: $tool not found; run scripts/setup.sh" >&2; exit 1; }
done
WORK=$(mktemp -d)
ROOT=$(awk '$3 == "cgroup2" { print $2; exit }' /proc/mounts)
CG="$ROOT/ffbench-calls-$$"
LOADER=""
STATS_BEFORE=$(cat /proc/sys/kernel/bpf_stats_enabled)
cleanup() {
	# (under set -e: a killed loader's status must not end the cleanup early)
	if [ -n "$LOADER" ] && kill "$LOADER" 2>/dev/null; then wait "$LOADER" 2>/dev/null || true; fi
	rmdir "$CG" 2>/dev/null || true
	echo "$STATS_BEFORE" > /proc/sys/kernel/bpf_stats_enabled
	rm -rf "$WORK"
}
trap cleanup EXIT

bpftool btf dump file /sys/kernel/btf/vmlinux format c > "$WORK/vmlinux.h"
clang -g -O2 -target bpf -D__TARGET_ARCH_x86 -I"$WORK" -c "$HERE/bpf_call_cost/calls.bpf.c" -o "$WORK/calls.bpf.o"
cc -O2 "$HERE/bpf_call_cost/loader.c" -o "$WORK/loader" -lbpf
mkdir "$CG"
echo 1 > /proc/sys/kernel/bpf_stats_enabled
"$WORK/loader" "$WORK/calls.bpf.o" > "$WORK/loader.out" &
LOADER=$!
until grep -q ready "$WORK/loader.out"; do
	kill -0 "$LOADER" 2>/dev/null || { echo "error: the loader exited" >&2; exit 1; }
	sleep 0.1
done

snap() {
	bpftool prog show -j | python3 -c '
import json, sys
for p in json.load(sys.stdin):
    if p.get("name", "").startswith("c_"):
        print(p["name"], p.get("run_time_ns", 0), p.get("run_cnt", 0))'
}
echo "kernel $(uname -r), clocksource $(cat /sys/devices/system/clocksource/clocksource0/current_clocksource), $(nproc) CPUs; perf bench sched pipe -l $LOOPS, $ROUNDS rounds"
for r in $(seq "$ROUNDS"); do
	snap > "$WORK/before"
	(echo $BASHPID > "$CG/cgroup.procs"; exec perf bench sched pipe -l "$LOOPS" > /dev/null)
	snap > "$WORK/after"
	join <(sort "$WORK/before") <(sort "$WORK/after") > "$WORK/round$r"
done
cat "$WORK"/round* | python3 -c '
import sys, statistics
per = {}
for line in sys.stdin:
    name, ns0, c0, ns1, c1 = line.split()
    dc = int(c1) - int(c0)
    if dc > 0:
        per.setdefault(name, []).append((int(ns1) - int(ns0)) / dc)
med = {k: statistics.median(v) for k, v in per.items()}
empty = med.get("c_empty", 0.0)
print("%-16s %8s %8s   (median of rounds)" % ("program", "ns/run", "extra"))
for name in ["c_empty", "c_loads", "c_percpu_array", "c_task_storage", "c_cgrp_storage", "c_ktime", "c_hash_update"]:
    if name in med:
        print("%-16s %8.1f %8.1f" % (name, med[name], med[name] - empty))
'
