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
#include "python.bpf.h"
#include "cpu_sampler.h"

#define EEXIST 17
#define ENOMEM 12

/* Set before load: also capture kernel stacks. */
const volatile bool capture_kernel_stacks = true;
/* Set before load: walk user stacks with CFI tables (unwind.bpf.h); false
 * keeps the kernel's frame-pointer walk (bpf_get_stack). */
const volatile bool cfi_unwind = true;
/* Set before load: read Python frames (python.bpf.h) of the processes user space
 * registered; needs the CFI walk's program set. */
const volatile bool python_frames = true;

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

/* Counts one sample of `key` and announces its process the first time. */
static __always_inline void count_sample(struct cpu_sample_key *key)
{
	__u64 one = 1, *n;

	n = bpf_map_lookup_elem(&counts, key);
	if (n) {
		__sync_fetch_and_add(n, 1);
	} else if (bpf_map_update_elem(&counts, key, &one, BPF_NOEXIST)) {
		/* Another CPU may have inserted the key meanwhile. */
		n = bpf_map_lookup_elem(&counts, key);
		if (n)
			__sync_fetch_and_add(n, 1);
		else
			count_drop(counts_full);
	}

	ff_announce_first(key->tgid, key->target);
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
	return ff_unwind_user(ip, sp, bp, tgid, false);
}

SEC("perf_event")
int on_cpu_sample(struct bpf_perf_event_data *ctx)
{
	struct cpu_sample_key key = {};
	struct ff_target t;
	__u64 id;
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
		/* After the user stack (the scratch is free again), before the kernel's. */
		if (python_frames)
			key.py_stack = ff_py_walk_stack(id, bpf_get_current_task_btf()->thread.fsbase);
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
	count_sample(&key);
	return 0;
}

/*
 * ---- Kernels without bpf_loop (5.17), bpf_get_current_task_btf (5.11) or
 * bpf_task_pt_regs (5.15): Linux 5.10 ----
 *
 * The same samples and keys: the task is read through probe helpers, the target
 * found by walking its cgroup's ancestry (no cgroup storage there either), the
 * user registers of a task sampled in the kernel found at the top of its kernel
 * stack, and stacks walked and hashed with bounded loops (unwind.bpf.h).
 * User space loads these programs instead of the ones above
 * (KernelFeatures::frame_walk).
 */

/*
 * The user registers of a task sampled in the kernel, where bpf_task_pt_regs
 * (5.15) is missing: kernel entry saved them at the top of the task's kernel
 * stack (task_pt_regs()), THREAD_SIZE above its base less
 * TOP_OF_KERNEL_STACK_PADDING. Neither is in the kernel's BTF. On x86-64
 * THREAD_SIZE is 16 KiB, 32 KiB with KASAN; the padding is 0, 16 bytes with
 * FRED (6.9+, where this path runs only when forced). The candidates are tried
 * in that order and one is taken only if its frame holds user-mode segment
 * selectors (__USER_CS or __USER32_CS, and __USER_DS), which other stack words
 * are unlikely to; beyond a 16 KiB stack lies a guard page (VMAP_STACK), where
 * the read fails. Fills s->pc/sp/bp; false when no candidate matched.
 */
#define FF_USER_CS 0x33
#define FF_USER32_CS 0x23
#define FF_USER_DS 0x2b

/* The end of struct pt_regs on x86-64: what the CPU pushes on entry. */
struct ff_entry_frame {
	__u64 ip, cs, flags, sp, ss;
};

static __always_inline bool user_regs_at_stack_top(struct task_struct *task,
						   struct ff_unwind_scratch *s)
{
	__u64 stack = (__u64)BPF_CORE_READ(task, stack);
	struct ff_entry_frame f;
	struct pt_regs *regs;

	if (!stack)
		return false;
#pragma unroll
	for (int i = 0; i < 4; i++) {
		__u64 size = (i & 2) ? 32768 : 16384, pad = (i & 1) ? 16 : 0;
		__u64 cs;

		regs = (struct pt_regs *)(stack + size - pad - sizeof(struct pt_regs));
		if (bpf_probe_read_kernel(&f, sizeof(f), &regs->ip))
			continue;
		cs = f.cs & 0xffff;
		if ((cs != FF_USER_CS && cs != FF_USER32_CS) || (f.ss & 0xffff) != FF_USER_DS)
			continue;
		if (bpf_probe_read_kernel(&s->bp, sizeof(s->bp), &regs->bp))
			return false;
		s->pc = f.ip;
		s->sp = f.sp;
		return true;
	}
	return false;
}

static __always_inline __u64 fp_stack_bounded(struct bpf_perf_event_data *ctx, void *map,
					      __u64 flags, bool *lost)
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
	s->n = (__u32)bytes / sizeof(__u64);
	key = ff_store_stack_bounded(map, s);
	*lost = key == 0;
	return key;
}

/* The sample being taken on this CPU while its user stack is walked over tail
 * calls (perf-event programs do not nest on a CPU). */
struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct cpu_sample_key);
} cpu_pending SEC(".maps");

/* Slot 0: cpu_walk_compat, which takes FF_BOUNDED_FRAMES frames and tail-calls
 * itself until the stack is walked. Filled by user space after load (libbpf
 * would fill a statically initialised slot even where these programs are not
 * loaded). */
struct {
	__uint(type, BPF_MAP_TYPE_PROG_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, __u32);
} cpu_walk_progs SEC(".maps");

/* The end of a sample whose user stack was walked: store it and count. */
static __always_inline void finish_walk(struct ff_unwind_scratch *s)
{
	struct cpu_sample_key *key;
	__u32 zero = 0;

	key = bpf_map_lookup_elem(&cpu_pending, &zero);
	if (!key)
		return;
	key->user_stack = ff_walk_end_bounded(s);
	count_sample(key);
}

SEC("perf_event")
int cpu_walk_compat(struct bpf_perf_event_data *ctx)
{
	struct ff_unwind_scratch *s = ff_unwind_percpu_scratch();
	struct cpu_sample_key *key;
	__u32 zero = 0;

	key = bpf_map_lookup_elem(&cpu_pending, &zero);
	if (!s || !key)
		return 0;
	if (!ff_walk_frames_bounded(s, key->tgid))
		bpf_tail_call(ctx, &cpu_walk_progs, 0);
	/* Done, or out of tail calls (the stack is kept as far as it got). */
	finish_walk(s);
	return 0;
}

SEC("perf_event")
int on_cpu_sample_compat(struct bpf_perf_event_data *ctx)
{
	struct task_struct *task = (struct task_struct *)bpf_get_current_task();
	struct ff_unwind_scratch *s;
	struct cpu_sample_key *key;
	struct ff_target t;
	__u32 zero = 0;
	bool lost = false, user_mode;
	__u64 id;

	if (!ff_task_target_raw(task, &t))
		return 0;
	key = bpf_map_lookup_elem(&cpu_pending, &zero);
	s = ff_unwind_percpu_scratch();
	if (!key || !s)
		return 0;
	__builtin_memset(key, 0, sizeof(*key));
	id = bpf_get_current_pid_tgid();
	key->target = t.index;
	key->tgid = id >> 32;
	key->pid = (__u32)id;
	bpf_get_current_comm(key->comm, sizeof(key->comm));
	user_mode = in_user_mode(ctx);
	/* The kernel stack first here: the user walk is the last use of the scratch. */
	if (capture_kernel_stacks && !user_mode) {
		key->kernel_stack = fp_stack_bounded(ctx, &kernel_stacks, 0, &lost);
		if (lost)
			count_drop(kernel_stack);
	}
	if (!BPF_CORE_READ(task, mm)) {
		count_sample(key);
		return 0;
	}
	if (!cfi_unwind) {
		key->user_stack = fp_stack_bounded(ctx, &user_stacks, BPF_F_USER_STACK, &lost);
		if (lost)
			count_drop(user_stack);
		count_sample(key);
		return 0;
	}
	if (user_mode) {
		s->pc = ctx->regs.ip;
		s->sp = ctx->regs.sp;
		s->bp = ctx->regs.bp;
	} else if (!user_regs_at_stack_top(task, s)) {
		s->pc = 0;
	}
	s->ret0 = 0;
	ff_walk_begin_bounded(s, key->tgid);
	bpf_tail_call(ctx, &cpu_walk_progs, 0);
	/* The tail call failed: count the sample without its user stack. */
	s->n = 0;
	finish_walk(s);
	return 0;
}

char LICENSE[] SEC("license") = "GPL";
