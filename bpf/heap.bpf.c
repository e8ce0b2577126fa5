// SPDX-License-Identifier: GPL-2.0 OR Apache-2.0
/*
 * Heap allocation sampling with uprobes on the allocator's entry points.
 *
 * Attached by binary path with pid = -1, so every process that maps the allocator is trapped,
 * including ones that start during the capture; the first thing every program does is the
 * target cgroup lookup, so non-target processes leave after one hash lookup.
 *
 * Sampling is byte based, like Go's runtime.MemProfileRate and jemalloc's lg_prof_sample: each
 * thread keeps a countdown of bytes until its next sample. The countdown is re-armed with a draw
 * from an exponential distribution of mean `sample_bytes` — i.e. sample points form a Poisson
 * process over the allocated bytes. We choose that distribution (over a fixed stride) because:
 *   - an allocation of s bytes is then sampled with probability 1 - exp(-s / sample_bytes),
 *     independent of what came before, so user space can undo the bias exactly the way pprof
 *     does for Go (weight 1 / (1 - exp(-s / rate)));
 *   - a fixed stride aliases with periodic allocation patterns (a loop allocating a 96 KiB and a
 *     416 KiB block would always hit the same one);
 *   - memorylessness makes a fresh draw after each sample correct, whatever the sample's size.
 * BPF has no floating point, so user space fills `gap_table` before load with the exponential
 * quantiles at (i + 0.5) / HEAP_GAP_TABLE_SIZE and we index it with bpf_get_prandom_u32().
 *
 * Allocator entry points call each other (glibc realloc(NULL, n) and memalign() call malloc,
 * a C++ operator new wraps malloc), so each thread counts its nesting depth and only the
 * outermost call is accounted. The stack is captured at return, where the walk starts in the
 * caller; at function entry it would skip the immediate caller.
 */
#include "vmlinux.h"
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_tracing.h>
#include "targets.bpf.h"
#include "proc_events.bpf.h"
#include "unwind.bpf.h"
#include "heap.h"

#define EEXIST 17
#define ENOMEM 12

char LICENSE[] SEC("license") = "Dual BSD/GPL";

/* Exponential gaps in bytes, mean sample_bytes; all zero means "sample every allocation". */
const volatile __u64 gap_table[HEAP_GAP_TABLE_SIZE] = {};
/* Set before load: walk user stacks with the node's CFI tables (unwind.bpf.h), as the CPU
 * sampler does; false keeps the kernel's frame-pointer walk (bpf_get_stack). */
const volatile bool cfi_unwind = false;

/* Per-thread sampling state; task storage frees it when the thread exits. */
struct heap_thread {
	__s64 countdown; /* bytes left before the next sample */
	__u64 size;      /* size of the outermost call in progress */
	__u64 old_ptr;   /* realloc: block given back if the call succeeds */
	__u64 memptr;    /* posix_memalign: where the result pointer is written */
	__u64 outer_sp;  /* user stack pointer of the outermost call */
	__u32 target;
	__u32 depth;
	__u8 sampled;
	__u8 armed;
};

struct {
	__uint(type, BPF_MAP_TYPE_TASK_STORAGE);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, int);
	__type(value, struct heap_thread);
} heap_threads SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 16384);
	__type(key, struct heap_agg_key);
	__type(value, struct heap_agg_val);
} heap_agg SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 65536);
	__type(key, struct heap_live_key);
	__type(value, struct heap_live_val);
} heap_live SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, HEAP_STAT_MAX);
	__type(key, __u32);
	__type(value, __u64);
} heap_stats SEC(".maps");

/* Let the skeleton generate Rust twins of the shared types. */
struct heap_agg_key heap_agg_key_type = {};
struct heap_agg_val heap_agg_val_type = {};
struct heap_live_key heap_live_key_type = {};
struct heap_live_val heap_live_val_type = {};

static __always_inline void count(__u32 stat)
{
	__u64 *v = bpf_map_lookup_elem(&heap_stats, &stat);

	if (v)
		*v += 1;
}

static __always_inline __s64 draw_gap(void)
{
	__u32 i = bpf_get_prandom_u32() & (HEAP_GAP_TABLE_SIZE - 1);

	return (__s64)gap_table[i];
}

/* Quarter-octave size class: 4 * floor(log2(size)) + the next two bits of the size. */
static __always_inline __u32 size_class(__u64 size)
{
	__u64 v = size;
	__u32 lg = 0;

	if (size < 4)
		return (__u32)size;
	if (v >> 32) { v >>= 32; lg += 32; }
	if (v >> 16) { v >>= 16; lg += 16; }
	if (v >> 8) { v >>= 8; lg += 8; }
	if (v >> 4) { v >>= 4; lg += 4; }
	if (v >> 2) { v >>= 2; lg += 2; }
	if (v >> 1) { lg += 1; }
	return lg * 4 + (__u32)((size >> (lg - 2)) & 3);
}

/* Whether the current task is in a target cgroup (or below one); the target's index. */
static __always_inline __u32 target_of_current(void)
{
	struct ff_target t;

	return ff_current_target(&t) ? t.index : 0;
}

static __always_inline void ff_proc_event_lost(void)
{
	count(HEAP_DROP_NOTIFY);
}

/* Start of an allocator call: the thread state if this is a target's outermost call.
 * `with_return`: a return probe will run for this call (classic uretprobe), so it counts
 * itself in the depth; a session uprobe decides that later, in its entry. */
static __always_inline struct heap_thread *enter(struct pt_regs *ctx, bool with_return)
{
	struct task_struct *task;
	struct heap_thread *ts;
	__u32 target;
	__u64 sp;

	target = target_of_current();
	if (!target)
		return NULL;
	task = bpf_get_current_task_btf();
	ts = bpf_task_storage_get(&heap_threads, task, 0, BPF_LOCAL_STORAGE_GET_F_CREATE);
	if (!ts) {
		count(HEAP_DROP_THREAD_STATE);
		return NULL;
	}
	sp = PT_REGS_SP(ctx);
	/* A call deeper in the stack than the outermost one is nested inside it. A call at or
	 * above it means a return probe was missed (the kernel skips them past a nesting limit):
	 * start afresh rather than stay stuck. */
	if (ts->depth > 0 && sp < ts->outer_sp) {
		if (with_return)
			ts->depth++;
		return NULL;
	}
	ts->depth = with_return ? 1 : 0;
	ts->outer_sp = sp;
	ts->target = target;
	ts->sampled = 0;
	ts->old_ptr = 0;
	ts->memptr = 0;
	return ts;
}

static __always_inline void account(struct heap_thread *ts, __u64 size)
{
	count(HEAP_STAT_CALLS);
	ts->size = size;
	if (!ts->armed) {
		ts->countdown = draw_gap();
		ts->armed = 1;
	}
	ts->countdown -= (__s64)size;
	if (ts->countdown > 0)
		return;
	/* Memoryless: the distance from the end of this block to the next sample point is a
	 * fresh draw, whatever the size of this block. */
	ts->countdown = draw_gap();
	ts->sampled = 1;
}

/* Retire a live sampled allocation (free, or the old block of a successful realloc). */
static __always_inline void release(__u32 tgid, __u64 addr)
{
	struct heap_live_key lk = { .tgid = tgid, .addr = addr };
	struct heap_live_val *lv, copy;
	struct heap_agg_val *av;

	lv = bpf_map_lookup_elem(&heap_live, &lk);
	if (!lv)
		return;
	copy = *lv;
	/* Only the thread whose delete succeeds subtracts, so racing frees count once. */
	if (bpf_map_delete_elem(&heap_live, &lk))
		return;
	count(HEAP_STAT_FREED);
	av = bpf_map_lookup_elem(&heap_agg, &copy.agg);
	if (av) {
		__sync_fetch_and_sub(&av->inuse_count, 1);
		__sync_fetch_and_sub(&av->inuse_bytes, copy.size);
	}
}

static __always_inline void record(struct pt_regs *ctx, struct heap_thread *ts, __u32 tgid,
				   __u64 addr)
{
	struct heap_agg_val zero = {}, *av;
	struct heap_live_key lk = { .tgid = tgid, .addr = addr };
	struct heap_live_val lv = {};
	struct ff_unwind_scratch *scratch;
	long bytes;

	lv.size = ts->size;
	lv.alloc_ns = bpf_ktime_get_ns();
	lv.agg.target = ts->target;
	lv.agg.tgid = tgid;
	lv.agg.size_class = size_class(ts->size);
	/* The stack-walk scratch is per thread (ff_unwind_per_task, set by user space): uprobe
	 * programs can be preempted, so a per-CPU one could be overwritten mid-walk by another
	 * thread's allocation on the same CPU. */
	scratch = ff_unwind_scratch_get();
	if (cfi_unwind) {
		/* Registers at the return: the walk starts at the call site. */
		lv.agg.user_stack = ff_unwind_user(PT_REGS_IP(ctx), PT_REGS_SP(ctx),
						   PT_REGS_FP(ctx), tgid, true);
	} else if (scratch) {
		/* The kernel's frame-pointer walk, kept like the CFI walk's stacks. */
		bytes = bpf_get_stack(ctx, scratch->stack.pcs, sizeof(scratch->stack.pcs),
				      BPF_F_USER_STACK);
		if (bytes > 0)
			lv.agg.user_stack = ff_store_stack(&user_stacks, &scratch->stack,
							   (__u32)bytes / sizeof(__u64));
	}
	/* Lost (map full, no scratch): the bytes are kept, unattributed. */
	if (!lv.agg.user_stack)
		count(HEAP_DROP_STACK);

	av = bpf_map_lookup_elem(&heap_agg, &lv.agg);
	if (!av) {
		bpf_map_update_elem(&heap_agg, &lv.agg, &zero, BPF_NOEXIST);
		av = bpf_map_lookup_elem(&heap_agg, &lv.agg);
		if (!av) {
			count(HEAP_DROP_AGG_FULL);
			return;
		}
	}
	count(HEAP_STAT_SAMPLED);
	__sync_fetch_and_add(&av->alloc_count, 1);
	__sync_fetch_and_add(&av->alloc_bytes, lv.size);

	/* A block still recorded at this address had its free missed (an entry point we do not
	 * hook): it is gone now, so retire it before tracking the new one. */
	release(tgid, addr);
	if (bpf_map_update_elem(&heap_live, &lk, &lv, BPF_ANY)) {
		/* Its free would be invisible: count the allocation, not its residency. */
		count(HEAP_DROP_LIVE_FULL);
		return;
	}
	__sync_fetch_and_add(&av->inuse_count, 1);
	__sync_fetch_and_add(&av->inuse_bytes, lv.size);

	ff_announce_first(tgid, ts->target);
}

SEC("uprobe")
int BPF_KPROBE(malloc_enter, __u64 size)
{
	struct heap_thread *ts = enter(ctx, true);

	if (ts)
		account(ts, size);
	return 0;
}

SEC("uprobe")
int BPF_KPROBE(calloc_enter, __u64 nmemb, __u64 size)
{
	struct heap_thread *ts = enter(ctx, true);

	if (ts)
		account(ts, nmemb * size);
	return 0;
}

SEC("uprobe")
int BPF_KPROBE(realloc_enter, __u64 ptr, __u64 size)
{
	struct heap_thread *ts = enter(ctx, true);

	if (!ts)
		return 0;
	ts->old_ptr = ptr;
	account(ts, size);
	return 0;
}

/* memalign(align, size) and aligned_alloc(align, size). */
SEC("uprobe")
int BPF_KPROBE(memalign_enter, __u64 align, __u64 size)
{
	struct heap_thread *ts = enter(ctx, true);

	if (ts)
		account(ts, size);
	return 0;
}

SEC("uprobe")
int BPF_KPROBE(posix_memalign_enter, __u64 memptr, __u64 align, __u64 size)
{
	struct heap_thread *ts = enter(ctx, true);

	if (!ts)
		return 0;
	ts->memptr = memptr;
	account(ts, size);
	return 0;
}

/* Return of an allocating call: pointer in the return register, or for posix_memalign a
 * status code and the pointer behind memptr. */
static __always_inline void on_return(struct pt_regs *ctx)
{
	struct heap_thread *ts;
	__u64 rc = PT_REGS_RC(ctx), addr = rc;
	__u32 tgid;

	ts = bpf_task_storage_get(&heap_threads, bpf_get_current_task_btf(), 0, 0);
	if (!ts || ts->depth == 0)
		return;
	if (--ts->depth > 0)
		return;
	tgid = bpf_get_current_pid_tgid() >> 32;
	if (ts->memptr) {
		addr = 0;
		if ((int)rc == 0)
			bpf_probe_read_user(&addr, sizeof(addr), (void *)ts->memptr);
	}
	/* realloc gave the old block back unless it failed (NULL for a non-zero size). */
	if (ts->old_ptr && (addr || ts->size == 0))
		release(tgid, ts->old_ptr);
	if (ts->sampled && addr)
		record(ctx, ts, tgid, addr);
}

/* Return of every allocating entry point with classic probes. */
SEC("uretprobe")
int BPF_KRETPROBE(alloc_exit)
{
	if (target_of_current())
		on_return(ctx);
	return 0;
}

extern bool bpf_session_is_return(void) __ksym __weak;

/*
 * malloc-like entry points as one session uprobe (Linux 6.13+): the entry asks for the
 * return probe only when the call is sampled, so the ~1 us return trap is paid by sampled
 * calls alone. A call nested in an unsampled one is then accounted on its own (e.g. the
 * malloc inside glibc memalign), which only matters for entry points that wrap malloc;
 * those keep the classic probes. User space falls back to malloc_enter + alloc_exit when
 * this program does not load.
 */
SEC("uprobe.session")
int malloc_session(struct pt_regs *ctx)
{
	struct heap_thread *ts;

	if (bpf_session_is_return()) {
		on_return(ctx);
		return 0;
	}
	ts = enter(ctx, false);
	if (!ts)
		return 1;
	account(ts, PT_REGS_PARM1(ctx));
	if (!ts->sampled)
		return 1;
	ts->depth = 1;
	return 0;
}

SEC("uprobe")
int BPF_KPROBE(free_enter, __u64 ptr)
{
	if (!ptr || !target_of_current())
		return 0;
	release(bpf_get_current_pid_tgid() >> 32, ptr);
	return 0;
}
