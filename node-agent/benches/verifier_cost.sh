#!/usr/bin/env bash
# What the kernel's verifier does to load each of the agent's BPF programs (prints figures;
# not part of `cargo test`). Compiles bpf/*.bpf.c as the build does, then loads each
# program alone with the verifier's statistics on: the object's load time (libbpf's BTF
# work, map creation and the verifier), the verifier's own time, the instructions it
# processed and the states it kept. The first capture of a kind after an idle spell waits
# for this load (the agent logs it: "cpu sampler loaded ms=").
#
# Usage (root): node-agent/benches/verifier_cost.sh [OBJECT...]   default: every object
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
BPF=$(cd "$HERE/../../bpf" && pwd)
[ "$(id -u)" = 0 ] || { echo "error: run as root (loading BPF programs)" >&2; exit 1; }
for tool in clang cc bpftool llvm-objdump; do
	command -v $tool >/dev/null || { echo "error: $tool not found; run scripts/setup.sh" >&2; exit 1; }
done
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
cp "$BPF"/*.h "$BPF"/*.bpf.c "$WORK/"
bpftool btf dump file /sys/kernel/btf/vmlinux format c > "$WORK/vmlinux.h"
cc -O2 "$HERE/verifier_cost/loader.c" -o "$WORK/loader" -lbpf
objects=("$@")
[ ${#objects[@]} -gt 0 ] || objects=(cpu_sampler runqlat heap)
echo "kernel $(uname -r); one program per load, verifier statistics (log level 4)"
for o in "${objects[@]}"; do
	clang -g -O2 -target bpf -D__TARGET_ARCH_x86 -Wall -Werror -I"$WORK" -c "$WORK/$o.bpf.c" -o "$WORK/$o.o"
	echo "$o.bpf.c:"
	# Programs are the object's executable sections' function symbols.
	for p in $(llvm-objdump -t "$WORK/$o.o" | awk '$2 == "g" && $3 == "F" && $4 !~ /^\.text/ { print $NF }'); do
		printf '  '
		"$WORK/loader" "$WORK/$o.o" "$p"
	done
done
