#!/usr/bin/env bash
# Where the default runqlat program's time goes, stage by stage, on `perf bench sched pipe`
# (prints figures; not part of `cargo test`). It builds copies of bpf/runqlat.bpf.c's
# switch_hybrid that return early after each stage, loads each one alone (interleaved with
# two references, once per round: libbpf-tools' `runqlat -c` and `runqlat` for all tasks)
# and prices it with kernel.bpf_stats_enabled: run_time_ns over the reference's event
# count, as capture_overhead does. It also prints how many waits each one recorded:
# `runqlat -c` tests the cgroup of the task running at the event, which after a wait that
# ends on an idle CPU is the idle task, so on this workload it skips nearly every wait.
# Stages: S0 the empty program (bpf_stats' own cost), S1 the run queue and queue stamp,
# S2 calibration and the target generation, S3 the target lookup, S4 the end of the wait
# where the run-queue clock is stale (PSI stamp or clock read), S5 the task's counters,
# full = the baseline slot and the histogram (the program as shipped).
#
# Usage (root): node-agent/benches/runqlat_stages.sh
#   env: ROUNDS=5 LOOPS=200000 VARIANTS="S0 ... full" (stages to price)
#        VARIANT_SOURCES="a.bpf.c ..." (other versions of the whole program, same rounds)
set -euo pipefail
ROUNDS=${ROUNDS:-5}
LOOPS=${LOOPS:-200000}
HERE=$(cd "$(dirname "$0")" && pwd)
BPF=$(cd "$HERE/../../bpf" && pwd)
[ "$(id -u)" = 0 ] || { echo "error: run as root (BPF programs, cgroups, bpf stats)" >&2; exit 1; }
for tool in clang cc bpftool perf python3 /usr/sbin/runqlat; do
	command -v $tool >/dev/null || { echo "error: $tool not found; run scripts/setup.sh" >&2; exit 1; }
done
WORK=$(mktemp -d)
ROOT=$(awk '$3 == "cgroup2" { print $2; exit }' /proc/mounts)
CG="$ROOT/ffbench-stages-$$"
PID=""
STATS_BEFORE=$(cat /proc/sys/kernel/bpf_stats_enabled)
cleanup() {
	# (under set -e: a killed tracer's status must not end the cleanup early)
	if [ -n "$PID" ] && kill "$PID" 2>/dev/null; then wait "$PID" 2>/dev/null || true; fi
	rmdir "$CG" 2>/dev/null || true
	echo "$STATS_BEFORE" > /proc/sys/kernel/bpf_stats_enabled
	rm -rf "$WORK"
}
trap cleanup EXIT

cp "$BPF"/*.h "$BPF/runqlat.bpf.c" "$WORK/"
bpftool btf dump file /sys/kernel/btf/vmlinux format c > "$WORK/vmlinux.h"
# Early returns after each stage of switch_hybrid; each anchor must match exactly once.
python3 - "$WORK/runqlat.bpf.c" <<'PY'
import sys
path = sys.argv[1]
src = open(path).read()
head, body = src.split("int BPF_PROG(switch_hybrid", 1)
stops = [
    ("\t__u32 zero = 0;\n\tstruct rq *rq;\n\tbool stale, have_now;\n",
     "#if STOP == 0\n\treturn next->pid;\n#endif\n"),
    ("\thave_now = !stale;\n\tnow = clock;\n", "#if STOP == 1\n\treturn stale + queued;\n#endif\n"),
    ("\tif (gen)\n\t\tgeneration = *gen;\n",
     "#if STOP == 2\n\treturn stale + queued + generation;\n#endif\n"),
    ("\tif (queued && hybrid_target(c, next, generation, &t, &psi)) {\n",
     "#if STOP == 3\n\t\treturn t.index;\n#endif\n"),
    ("\t\t\t\tnow = hybrid_now(c, clock);\n\t\t\thave_now = true;\n\t\t}\n",
     "#if STOP == 4\n\t\treturn now;\n#endif\n"),
    ("\t\ttag = next->start_time;\n", "#if STOP == 5\n\t\treturn tag + pcount + wait + delay;\n#endif\n"),
]
for anchor, code in stops:
    if body.count(anchor) != 1:
        sys.exit(f"error: bpf/runqlat.bpf.c changed; anchor not found once: {anchor!r}")
    body = body.replace(anchor, anchor + code, 1)
open(path, "w").write(head + "int BPF_PROG(switch_hybrid" + body)
PY
VARIANTS=${VARIANTS:-"S0 S1 S2 S3 S4 S5 full"}
for v in $VARIANTS; do
	stop=${v#S}; [ "$v" = full ] && stop=9
	clang -g -O2 -target bpf -D__TARGET_ARCH_x86 -DSTOP=$stop -I"$WORK" -c "$WORK/runqlat.bpf.c" -o "$WORK/$v.o"
done
# Other versions of the whole program, priced in the same rounds (A/B of a change):
# VARIANT_SOURCES="a.bpf.c b.bpf.c", each a copy of bpf/runqlat.bpf.c.
n=0
for src in ${VARIANT_SOURCES:-}; do
	n=$((n + 1))
	cp "$src" "$WORK/x$n.bpf.c"
	clang -g -O2 -target bpf -D__TARGET_ARCH_x86 -I"$WORK" -c "$WORK/x$n.bpf.c" -o "$WORK/x$n.o"
	VARIANTS="$VARIANTS x$n"
done
cc -O2 "$HERE/runqlat_stages/loader.c" -o "$WORK/loader" -lbpf
mkdir "$CG"
CGID=$(stat -c %i "$CG")
echo 1 > /proc/sys/kernel/bpf_stats_enabled

runs() { # total run_time_ns and run_cnt of the programs named
	bpftool prog show -j | python3 -c '
import json, sys
names = set(sys.argv[1:]); ns = cnt = 0
for p in json.load(sys.stdin):
    if p.get("name", "") in names:
        ns += p.get("run_time_ns", 0); cnt += p.get("run_cnt", 0)
print(ns, cnt)' "$@"
}
work() { (echo $BASHPID > "$CG/cgroup.procs"; exec perf bench sched pipe -l "$LOOPS" > /dev/null); }
started() { # waits for `$1` in file $2 while $PID lives
	until grep -q "$1" "$2"; do
		kill -0 "$PID" 2>/dev/null || { echo "error: $(cat "$2")" >&2; exit 1; }
		sleep 0.05
	done
}
# The waits a libbpf-tools runqlat run recorded: the counts of the histogram it prints on SIGINT.
hist_waits() { awk -F'|' '/\|/ { split($1, a, ":"); n += a[2] } END { print n + 0 }' "$1"; }
echo "kernel $(uname -r), $(nproc) CPUs, clocksource $(cat /sys/devices/system/clocksource/clocksource0/current_clocksource); perf bench sched pipe -l $LOOPS, $ROUNDS rounds"
: > "$WORK/rows"
for r in $(seq "$ROUNDS"); do
	# Two references: `runqlat -c` (the cgroup filter; it tests the task running at the
	# event, so a wait that ends on an idle CPU is skipped) and `runqlat` (all tasks).
	for ref in ref all; do
		if [ $ref = ref ]; then args=(-c "$CG"); else args=(); fi
		stdbuf -oL /usr/sbin/runqlat "${args[@]}" > "$WORK/ref.out" 2>&1 & PID=$!
		started Tracing "$WORK/ref.out"
		read -r a0 c0 < <(runs sched_switch sched_wakeup sched_wakeup_new); work
		read -r a1 c1 < <(runs sched_switch sched_wakeup sched_wakeup_new)
		kill -INT "$PID"; wait "$PID" 2>/dev/null || true; PID=""
		[ $ref = ref ] && events=$((c1 - c0))
		echo "$ref $r $((a1 - a0)) $((c1 - c0)) $((c1 - c0)) $(hist_waits "$WORK/ref.out")" >> "$WORK/rows"
	done
	for v in $VARIANTS; do
		"$WORK/loader" "$CGID" "$WORK/$v.o" > "$WORK/l.out" 2>&1 & PID=$!
		started ready "$WORK/l.out"
		read -r b0 d0 < <(runs switch_hybrid); work; read -r b1 d1 < <(runs switch_hybrid)
		kill "$PID"; wait "$PID" 2>/dev/null || true; PID=""
		echo "$v $r $((b1 - b0)) $((d1 - d0)) $events $(awk '/^waits/ { print $2 }' "$WORK/l.out")" >> "$WORK/rows"
	done
done
python3 - "$WORK/rows" ${VARIANT_SOURCES:-} <<'PY'
import statistics, sys
rows = [l.split() for l in open(sys.argv[1])]
# Per round, each reference's ns per event (its own program runs = scheduler events).
ref = {r[1]: int(r[2]) / int(r[3]) for r in rows if r[0] == "ref"}
refall = {r[1]: int(r[2]) / int(r[3]) for r in rows if r[0] == "all"}
per = {}
for name, rnd, ns, runs, events, waits in rows:
    ns, runs, events, waits = int(ns), int(runs), int(events), int(waits or 0)
    per.setdefault(name, []).append((ns / events, ns / max(runs, 1), ns / events / ref[rnd],
                                     ns / events / refall[rnd], waits))
med = lambda v, i: statistics.median(x[i] for x in v)
print("%-28s %9s %9s %11s %11s %9s" % ("stage (cumulative)", "ns/event", "ns/run",
                                        "ratio (-c)", "ratio (all)", "waits"))
labels = {"ref": "libbpf-tools runqlat -c", "all": "libbpf-tools runqlat",
          "S0": "S0 empty program",
          "S1": "S1 run queue, queue stamp", "S2": "S2 calibration, generation",
          "S3": "S3 target lookup", "S4": "S4 end of wait if stale",
          "S5": "S5 task counters", "full": "full (as shipped)"}
for i, src in enumerate(sys.argv[2:]):
    labels["x%d" % (i + 1)] = src[-28:]
for k in ["ref", "all", "S0", "S1", "S2", "S3", "S4", "S5", "full"] + ["x%d" % (i + 1) for i in range(len(sys.argv) - 2)]:
    if k in per:
        print("%-28s %9.1f %9.1f %11.3f %11.3f %9d" % (labels[k], med(per[k], 0), med(per[k], 1),
                                                      med(per[k], 2), med(per[k], 3), med(per[k], 4)))
for rnd in sorted(ref, key=int):
    row = [r for r in rows if r[1] == rnd and r[0] == "ref"][0]
    full = [r for r in rows if r[1] == rnd and r[0] == "full"]
    print("round %s: runqlat -c %.1f ns/event, %s waits%s" % (
        rnd, ref[rnd], row[5],
        ", full program %.3f of it" % (int(full[0][2]) / int(full[0][4]) / ref[rnd]) if full else ""))
print("waits: the waits each recorded (median over rounds); `runqlat -c` skips those that end"
      " on an idle CPU, `runqlat` also counts other tasks' waits; the stages return before"
      " the histogram, so they record none.")
PY
