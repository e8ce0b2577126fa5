// SPDX-License-Identifier: GPL-2.0
/*
 * CPU sampler: runs on a perf event (cpu-clock or cycles) on every CPU, keeps
 * only samples whose cgroup is in `targets`, and counts them per
 * (target, tgid, pid, user stack, kernel stack, comm) in kernel memory.
 */
#include "vmlinux.h"
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_tracing.h>
#include <bpf/bpf_core_read.h>
#include "compat.bpf.h"
#include "targets.bpf.h"
#include "unwind.bpf.h"
#include "cpu_sampler.h"

#define EEXIST 17
#define ENOMEM 12

/* Set before load: also capture kernel stacks. */
const volatile bool kernel_stacks = true;
/* Set before load: walk user stacks with CFI tables (unwind.bpf.h); false
 * keeps the kernel's frame-pointer walk (bpf_get_stackid). */
const volatile bool cfi_unwind = true;

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 10240);
	__type(key, struct cpu_sample_key);
	__type(value, __u64);
} counts SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_STACK_TRACE);
	__uint(max_entries, 16384);
	__uint(key_size, sizeof(__u32));
	__uint(value_size, 127 * sizeof(__u64));
} stacks SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct cpu_drops);
} drops SEC(".maps");

/* Processes already announced to user space; LRU so it never fills up. */
struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 16384);
	__type(key, __u32);
	__type(value, __u8);
} seen_tgids SEC(".maps");

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

static __always_inline void announce(__u32 tgid, __u32 target, __u32 kind)
{
	struct ff_proc_event *e;

	e = bpf_ringbuf_reserve(&proc_events, sizeof(*e), 0);
	if (!e) {
		count_drop(notify);
		return;
	}
	e->tgid = tgid;
	e->kind = kind;
	e->target = target;
	bpf_get_current_comm(e->comm, sizeof(e->comm));
	bpf_ringbuf_submit(e, 0);
}

/* -EFAULT means "no stack of this kind" (a kernel thread has no user
 * stack): not a loss. Collisions (-EEXIST) and a full map (-ENOMEM) are. */
static __always_inline bool stack_lost(long id)
{
	return id == -EEXIST || id == -ENOMEM;
}

/* The user registers at the sample: the interrupted ones, or, when the CPU
 * was in the kernel, those saved at the task's kernel entry. */
static __always_inline __u64 user_stack_of(struct bpf_perf_event_data *ctx, __u32 tgid)
{
	struct task_struct *task = bpf_get_current_task_btf();
	struct pt_regs *regs;
	__u64 cs, ip, sp, bp;

	if (!task->mm)
		return 0;
	/* pt_regs.cs is a 16-bit field on recent kernels, but the context only
	 * allows 8-byte reads: read its whole word. */
	cs = *(volatile __u64 *)((char *)&ctx->regs + __builtin_offsetof(struct pt_regs, cs));
	if ((cs & 3) == 3) {
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
	struct ff_target *t;
	__u64 id, one = 1, *n;
	__u8 yes = 1;

	t = ff_target_of(bpf_get_current_cgroup_id());
	if (!t)
		return 0;

	id = bpf_get_current_pid_tgid();
	key.target = t->index;
	key.tgid = id >> 32;
	key.pid = (__u32)id;
	if (cfi_unwind) {
		key.user_stack_id = -1;
		key.user_stack = user_stack_of(ctx, key.tgid);
	} else {
		key.user_stack_id = bpf_get_stackid(ctx, &stacks, BPF_F_USER_STACK);
		if (stack_lost(key.user_stack_id))
			count_drop(user_stack);
	}
	key.kernel_stack_id = kernel_stacks ? bpf_get_stackid(ctx, &stacks, 0) : -1;
	if (stack_lost(key.kernel_stack_id))
		count_drop(kernel_stack);
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

	if (bpf_map_update_elem(&seen_tgids, &key.tgid, &yes, BPF_NOEXIST) == 0)
		announce(key.tgid, key.target, FF_PROC_FIRST_SEEN);
	return 0;
}

/* A process in a target cgroup replaced its image: announce the new one. */
SEC("tp_btf/sched_process_exec")
int BPF_PROG(on_exec, struct task_struct *p, pid_t old_pid, struct linux_binprm *bprm)
{
	struct ff_target *t = ff_target_of(bpf_get_current_cgroup_id());
	__u32 tgid;

	if (!t)
		return 0;
	tgid = bpf_get_current_pid_tgid() >> 32;
	/* Shared libraries are not mapped yet: forget the process so that its
	 * first sample announces it again, with its libraries. */
	bpf_map_delete_elem(&seen_tgids, &tgid);
	announce(tgid, t->index, FF_PROC_EXEC);
	return 0;
}

char LICENSE[] SEC("license") = "GPL";
