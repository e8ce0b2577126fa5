#!/usr/bin/env bash
# Full-stack unwinding costs, printed side by side in one run (root):
#  1. BPF run time per CPU sample of the CPU sampler walking user stacks with
#     CFI tables vs the kernel's frame-pointer walk (--frame-pointers-only),
#     on the same frame-pointer-less workload (kernel.bpf_stats_enabled);
#  2. unwind-table memory and build+load time with 200 distinct binaries
#     mapped by processes of the target cgroup (plus libc and ld.so).
# Usage: AGENT=path/to/flamefleet-agent SECS=10 node-agent/benches/unwind_cost.sh
set -euo pipefail

AGENT=${AGENT:-${CARGO_TARGET_DIR:-/var/cache/flamefleet/target}/release/flamefleet-agent}
SECS=${SECS:-10}
BINARIES=${BINARIES:-200}
[ -x "$AGENT" ] || { echo "build the agent first (cargo build --release -p flamefleet-agent) or set AGENT" >&2; exit 1; }
[ "$(id -u)" = 0 ] || { echo "run as root (BPF, cgroups)" >&2; exit 1; }

work=$(mktemp -d)
root=$(awk '$3 == "cgroup2" { print $2; exit }' /proc/mounts)
cg="$root/ff-unwind-bench-$$"
mkdir "$cg"
old_stats=$(sysctl -n kernel.bpf_stats_enabled)
cleanup() {
  echo 1 > "$cg/cgroup.kill" 2>/dev/null || true
  sleep 0.2
  rmdir "$cg" 2>/dev/null || true
  sysctl -qw kernel.bpf_stats_enabled="$old_stats"
  rm -rf "$work"
}
trap cleanup EXIT

cat > "$work/chain.c" <<'EOF'
#include <string.h>
static volatile unsigned long sink;
static char a[1 << 16], b[1 << 16];
__attribute__((noinline)) void leaf(long n) { for (long i = 0; i < n; i++) sink += i * 7; memcpy(b, a, sizeof a); }
__attribute__((noinline)) void f3(long n) { leaf(n); sink++; }
__attribute__((noinline)) void f2(long n) { f3(n); sink++; }
__attribute__((noinline)) void f1(long n) { f2(n); sink++; }
int main(void) { for (;;) f1(100000); }
EOF
gcc -O2 -fomit-frame-pointer -o "$work/chain" "$work/chain.c"
spawn() { sh -c 'echo $$ > "$1/cgroup.procs"; shift; exec "$@"' sh "$cg" "$@" >/dev/null 2>&1 & disown; }
for _ in $(seq "$(nproc)"); do spawn "$work/chain"; done

sysctl -qw kernel.bpf_stats_enabled=1
# Prints "ns_per_sample samples" of the on_cpu_sample program this capture loaded (the
# programs present before it started are left out: bpftool may not know program pids).
measure() {
  local before
  before=$(bpftool -j prog show | python3 -c 'import json, sys; print(" ".join(str(p["id"]) for p in json.load(sys.stdin)))')
  "$AGENT" capture --type cpu --cgroup "$cg" --duration "${SECS}s" --frequency 999 "$@" -o "$work/p.pb.gz" >/dev/null 2>&1 &
  local apid=$!
  sleep $((SECS - 1))
  bpftool -j prog show | python3 -c '
import json, sys
before = set(sys.argv[1].split())
t = n = 0
for p in json.load(sys.stdin):
    if p.get("name") == "on_cpu_sample" and str(p["id"]) not in before:
        t += p.get("run_time_ns", 0); n += p.get("run_cnt", 0)
print(f"{t / max(n, 1):.0f} {n}")' "$before"
  wait "$apid"
}
read -r fp fp_n < <(measure --frame-pointers-only)
read -r cfi cfi_n < <(measure)
echo "BPF run time per sample (user + kernel stack), $(nproc) spinners, -O2 -fomit-frame-pointer, 999 Hz, ${SECS}s:"
printf '  frame-pointer walk (bpf_get_stackid): %6s ns  (%s samples)\n' "$fp" "$fp_n"
printf '  CFI walk (unwind tables):             %6s ns  (%s samples)\n' "$cfi" "$cfi_n"
python3 -c "import sys; print(f'  ratio CFI / frame pointer: {int(sys.argv[1]) / max(int(sys.argv[2]), 1):.2f}x')" "$cfi" "$fp"

# 2. 200 distinct binaries, each a different program (own build ID).
echo 1 > "$cg/cgroup.kill"; sleep 0.3
for i in $(seq "$BINARIES"); do
  {
    echo '#include <unistd.h>'
    echo 'static volatile unsigned long sink;'
    for j in $(seq 40); do
      echo "__attribute__((noinline)) unsigned long f${j}_$i(unsigned long x) { for (int k = 0; k < $((i % 7 + j)); k++) sink += x * $i + k; return sink; }"
    done
    echo "int main(void) { unsigned long s = 0;"
    for j in $(seq 40); do echo "  s += f${j}_$i(s);"; done
    echo "  sink = s; pause(); return 0; }"
  } > "$work/b$i.c"
done
ls "$work"/b*.c | xargs -P "$(nproc)" -I{} sh -c 'gcc -O2 -o "${1%.c}" "$1"' sh {}
for i in $(seq "$BINARIES"); do spawn "$work/b$i"; done
sleep 1
"$AGENT" capture --type cpu --cgroup "$cg" --duration 2s -o "$work/m.pb.gz" >/dev/null 2>&1
echo "unwind tables with $BINARIES distinct binaries running in the target cgroup:"
go tool pprof -comments "$work/m.pb.gz" | grep "unwind tables" | sed 's/^/  /'
echo "  (process entries: a preallocated map of 4,096 x 2,052 B = 8.0 MiB, whatever the count)"

