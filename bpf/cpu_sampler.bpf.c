// SPDX-License-Identifier: GPL-2.0
/*
 * CPU sampler: runs on a perf event (cpu-clock or cycles) on every CPU, keeps
 * only samples whose cgroup is in `targets`, and counts them per
 * (target, tgid, pid, user stack, kernel stack, comm) in kernel memory.
 *
 * Stacks are kept in hash maps keyed by a 64-bit hash of their frames
 * (ff_store_stack), not in a stack-trace map: a stack-trace map is a table of
 * buckets indexed by a 32-bit hash, without chaining, and refuses a stack
 * whose bucket another stack holds (-EEXIST), so under load it loses stacks
 * long before it is full.
 */
#include "vmlinux.h"
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_tracing.h>
#include <bpf/bpf_core_read.h>
#include "compat.bpf.h"
#include "targets.bpf.h"
#include "proc_events.bpf.h"
#include "unwind.bpf.h"
#include "cpu_sampler.h"

#define EEXIST 17
#define ENOMEM 12

/* Set before load: also capture kernel stacks. */
const volatile bool capture_kernel_stacks = true;
/* Set before load: walk user stacks with CFI tables (unwind.bpf.h); false
 * keeps the kernel's frame-pointer walk (bpf_get_stack). */
const volatile bool cfi_unwind = true;

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 10240);
	__type(key, struct cpu_sample_key);
	__type(value, __u64);
} counts SEC(".maps");

/* Stack hash -> kernel stack; sized by user space. */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 16384);
	__type(key, __u64);
	__type(value, struct ff_user_stack);
} kernel_stacks SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct cpu_drops);
} drops SEC(".maps");

static __always_inline struct cpu_drops *drop_counters(void)
{
	__u32 zero = 0;

	return bpf_map_lookup_elem(&drops, &zero);
}

#define count_drop(field)                                  \
	do {                                               \
		struct cpu_drops *d__ = drop_counters();   \
		if (d__)                                   \
			d__->field += 1;                   \
	} while (0)

static __always_inline void ff_proc_event_lost(void)
{
	count_drop(notify);
}

/*
 * Copies a stack the kernel walks by frame pointers (the kernel stack, or with
 * BPF_F_USER_STACK the user one) into this CPU's scratch and stores it in
 * `map`; returns its key, 0 when there is no such stack (a sample taken in
 * user mode has no kernel stack, a kernel thread no user stack). Counts a
 * stack that was taken but could not be stored as lost (`lost`).
 */
static __always_inline __u64 fp_stack(struct bpf_perf_event_data *ctx, void *map, __u64 flags,
				      bool *lost)
{
	struct ff_unwind_scratch *s = ff_unwind_percpu_scratch();
	long bytes;
	__u64 key;

	*lost = false;
	if (!s)
		return 0;
	bytes = bpf_get_stack(ctx, s->stack.pcs, sizeof(s->stack.pcs), flags);
	if (bytes <= 0)
		return 0;
	key = ff_store_stack(map, &s->stack, (__u32)bytes / sizeof(__u64));
	*lost = key == 0;
	return key;
}

/* Whether the sample interrupted user mode (then there is no kernel stack).
 * pt_regs.cs is a 16-bit field on recent kernels, but the context only allows
 * 8-byte reads: read its whole word. */
static __always_inline bool in_user_mode(struct bpf_perf_event_data *ctx)
{
	__u64 cs = *(volatile __u64 *)((char *)&ctx->regs + __builtin_offsetof(struct pt_regs, cs));

	return (cs & 3) == 3;
}

/* The user registers at the sample: the interrupted ones, or, when the CPU
 * was in the kernel, those saved at the task's kernel entry. */
static __always_inline __u64 user_stack_of(struct bpf_perf_event_data *ctx, __u32 tgid,
					   bool user_mode)
{
	struct task_struct *task = bpf_get_current_task_btf();
	struct pt_regs *regs;
	__u64 ip, sp, bp;

	if (!task->mm)
		return 0;
	if (user_mode) {
		ip = ctx->regs.ip;
		sp = ctx->regs.sp;
		bp = ctx->regs.bp;
	} else {
		/* Read with a helper, not loads: clang would otherwise merge the two
		 * branches into one load at a variable context offset, which the
		 * verifier refuses. */
		regs = (struct pt_regs *)bpf_task_pt_regs(task);
		if (bpf_probe_read_kernel(&ip, sizeof(ip), &regs->ip) ||
		    bpf_probe_read_kernel(&sp, sizeof(sp), &regs->sp) ||
		    bpf_probe_read_kernel(&bp, sizeof(bp), &regs->bp))
			return 0;
	}
	/* One call site: the walker is verified once. */
	return ff_unwind_user(ff_unwind_percpu_scratch(), ip, sp, bp, tgid, false);
}

SEC("perf_event")
int on_cpu_sample(struct bpf_perf_event_data *ctx)
{
	struct cpu_sample_key key = {};
	struct ff_target t;
	__u64 id, one = 1, *n;
	bool lost = false, user_mode;

	if (!ff_current_target(&t))
		return 0;

	id = bpf_get_current_pid_tgid();
	key.target = t.index;
	key.tgid = id >> 32;
	key.pid = (__u32)id;
	user_mode = in_user_mode(ctx);
	/* The user stack first: both walks use this CPU's scratch in turn. */
	if (cfi_unwind) {
		key.user_stack = user_stack_of(ctx, key.tgid, user_mode);
	} else {
		key.user_stack = fp_stack(ctx, &user_stacks, BPF_F_USER_STACK, &lost);
		if (lost)
			count_drop(user_stack);
	}
	if (capture_kernel_stacks && !user_mode) {
		key.kernel_stack = fp_stack(ctx, &kernel_stacks, 0, &lost);
		if (lost)
			count_drop(kernel_stack);
	}
	bpf_get_current_comm(key.comm, sizeof(key.comm));

	n = bpf_map_lookup_elem(&counts, &key);
	if (n) {
		__sync_fetch_and_add(n, 1);
	} else if (bpf_map_update_elem(&counts, &key, &one, BPF_NOEXIST)) {
		/* Another CPU may have inserted the key meanwhile. */
		n = bpf_map_lookup_elem(&counts, &key);
		if (n)
			__sync_fetch_and_add(n, 1);
		else
			count_drop(counts_full);
	}

	ff_announce_first(key.tgid, key.target);
	return 0;
}

char LICENSE[] SEC("license") = "GPL";
