#!/usr/bin/env bash
# Where the off-CPU program's time goes on a switch of threads outside every target (what
# every other pod's switch pays), stage by stage (prints figures; not part of `cargo test`).
# It builds copies of bpf/offcpu.bpf.c's offcpu_switch that return early after each stage,
# loads each one alone with an idle cgroup as its only target, runs `perf bench sched pipe`
# and `perf bench sched messaging` in another cgroup, and prices each with
# kernel.bpf_stats_enabled: run_time_ns / run_cnt of that program (by ID), median over
# interleaved rounds. Stages (cumulative): S0 the empty program (what bpf_stats charges any
# program here: no program goes below it), S1 the per-CPU state and the target generation,
# S2 prev's state and the idle checks, S3 prev's target lookup (when it blocks),
# full = next's target lookup too (the program as shipped; on these workloads nothing more
# runs).
#
# Usage (root): node-agent/benches/offcpu_stages.sh
#   env: ROUNDS=5 VARIANTS="S0 S1 S2 S3 full" WORKLOADS="pipe messaging"
#        VARIANT_SOURCES="a.bpf.c ..." (other versions of the whole program, same rounds)
set -euo pipefail
ROUNDS=${ROUNDS:-5}
WORKLOADS=${WORKLOADS:-"pipe messaging"}
HERE=$(cd "$(dirname "$0")" && pwd)
BPF=$(cd "$HERE/../../bpf" && pwd)
[ "$(id -u)" = 0 ] || { echo "error: run as root (BPF programs, cgroups, bpf stats)" >&2; exit 1; }
for tool in clang cc bpftool perf python3; do
	command -v $tool >/dev/null || { echo "error: $tool not found; run scripts/setup.sh" >&2; exit 1; }
done
WORK=$(mktemp -d)
ROOT=$(awk '$3 == "cgroup2" { print $2; exit }' /proc/mounts)
IDLE="$ROOT/ffbench-offcpu-idle-$$"
BENCH="$ROOT/ffbench-offcpu-bench-$$"
PID=""
STATS_BEFORE=$(cat /proc/sys/kernel/bpf_stats_enabled)
cleanup() {
	if [ -n "$PID" ] && kill "$PID" 2>/dev/null; then wait "$PID" 2>/dev/null || true; fi
	rmdir "$IDLE" "$BENCH" 2>/dev/null || true
	echo "$STATS_BEFORE" > /proc/sys/kernel/bpf_stats_enabled
	rm -rf "$WORK"
}
trap cleanup EXIT

cp "$BPF"/*.h "$BPF/offcpu.bpf.c" "$WORK/"
bpftool btf dump file /sys/kernel/btf/vmlinux format c > "$WORK/vmlinux.h"
# Early returns after each stage of offcpu_switch; each anchor must match exactly once.
python3 - "$WORK/offcpu.bpf.c" <<'PY'
import sys
path = sys.argv[1]
src = open(path).read()
head, body = src.split("int BPF_PROG(offcpu_switch", 1)
stops = [
    ("{\n", "#if STOP == 0\n\treturn 0;\n#endif\n"),
    ("\t\tgeneration = *gen;\n", "#if STOP == 1\n\treturn generation;\n#endif\n"),
    ("\tstate = ff_task_state_btf(prev);\n",
     "#if STOP == 2\n\treturn (!preempt && state != TASK_RUNNING && !(state & TASK_DEAD) && prev->pid) + next->pid;\n#endif\n"),
    ("\t\tswitch_out(c, prev, generation);\n", "#if STOP == 3\n\treturn 0;\n#endif\n"),
]
for anchor, code in stops:
    if body.count(anchor) < 1:
        sys.exit(f"error: bpf/offcpu.bpf.c changed; anchor not found: {anchor!r}")
    body = body.replace(anchor, anchor + code, 1)
open(path, "w").write(head + "int BPF_PROG(offcpu_switch" + body)
PY
VARIANTS=${VARIANTS:-"S0 S1 S2 S3 full"}
for v in $VARIANTS; do
	stop=${v#S}; [ "$v" = full ] && stop=9
	clang -g -O2 -target bpf -D__TARGET_ARCH_x86 -DSTOP=$stop -I"$WORK" -c "$WORK/offcpu.bpf.c" -o "$WORK/$v.o"
done
n=0
for src in ${VARIANT_SOURCES:-}; do
	n=$((n + 1))
	cp "$src" "$WORK/x$n.bpf.c"
	clang -g -O2 -target bpf -D__TARGET_ARCH_x86 -I"$WORK" -c "$WORK/x$n.bpf.c" -o "$WORK/x$n.o"
	VARIANTS="$VARIANTS x$n"
done
cc -O2 "$HERE/offcpu_stages/loader.c" -o "$WORK/loader" -lbpf
mkdir "$IDLE" "$BENCH"
CGID=$(stat -c %i "$IDLE")
echo 1 > /proc/sys/kernel/bpf_stats_enabled

runs() { # run_time_ns and run_cnt of program ID $1
	bpftool prog show id "$1" -j | python3 -c '
import json, sys
p = json.load(sys.stdin)
print(p.get("run_time_ns", 0), p.get("run_cnt", 0))'
}
work() {
	case $1 in
	pipe) (echo $BASHPID > "$BENCH/cgroup.procs"; exec perf bench sched pipe -l 100000 > /dev/null) ;;
	messaging) (echo $BASHPID > "$BENCH/cgroup.procs"; exec perf bench sched messaging -p -g 2 -l 200 > /dev/null 2>&1) ;;
	esac
}
echo "kernel $(uname -r), $(nproc) CPUs, clocksource $(cat /sys/devices/system/clocksource/clocksource0/current_clocksource), $ROUNDS rounds; $(uptime)"
: > "$WORK/rows"
for r in $(seq "$ROUNDS"); do
	for w in $WORKLOADS; do
		for v in $VARIANTS; do
			rm -f "$WORK/l.out"
			"$WORK/loader" "$CGID" "$WORK/$v.o" > "$WORK/l.out" 2>&1 & PID=$!
			until grep -q "^ready [0-9]" "$WORK/l.out" 2>/dev/null; do
				kill -0 "$PID" 2>/dev/null || { echo "error: $(cat "$WORK/l.out")" >&2; exit 1; }
				sleep 0.05
			done
			id=$(awk '/^ready/ { print $2 }' "$WORK/l.out")
			read -r a0 c0 < <(runs "$id"); work "$w"; read -r a1 c1 < <(runs "$id")
			kill "$PID"; wait "$PID" 2>/dev/null || true; PID=""
			echo "$w $v $r $((a1 - a0)) $((c1 - c0))" >> "$WORK/rows"
		done
	done
done
python3 - "$WORK/rows" ${VARIANT_SOURCES:-} <<'PY'
import statistics, sys
rows = [l.split() for l in open(sys.argv[1])]
per = {}
for w, v, r, ns, runs in rows:
    per.setdefault((w, v), []).append(int(ns) / max(int(runs), 1))
labels = {"S0": "S0 empty program (floor)", "S1": "S1 per-CPU state, generation",
          "S2": "S2 prev state, idle checks", "S3": "S3 prev's target lookup",
          "full": "full (as shipped)"}
for i, src in enumerate(sys.argv[2:]):
    labels["x%d" % (i + 1)] = src[-28:]
order = ["S0", "S1", "S2", "S3", "full"] + ["x%d" % (i + 1) for i in range(len(sys.argv) - 2)]
for w in dict.fromkeys(r[0] for r in rows):
    floor = statistics.median(per[(w, "S0")]) if (w, "S0") in per else None
    print("\nperf bench sched %s: ns per program run (median; over the floor)" % w)
    for k in order:
        if (w, k) in per:
            m = statistics.median(per[(w, k)])
            over = "  %+6.1f" % (m - floor) if floor is not None and k != "S0" else ""
            print("  %-30s %7.1f%s   rounds: %s" % (labels[k], m, over,
                  " ".join("%.1f" % x for x in per[(w, k)])))
PY
