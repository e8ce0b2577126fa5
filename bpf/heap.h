/* SPDX-License-Identifier: Apache-2.0 */
/* Types shared by heap.bpf.c and the agent's heap capture engine (through the skeleton). */
#ifndef FLAMEFLEET_HEAP_H
#define FLAMEFLEET_HEAP_H

/* Entries of the exponential gap table (a power of two: the index is a mask of a random u32). */
#define HEAP_GAP_TABLE_SIZE 4096

/* Aggregation key: one row per (target, process, allocation call stack, size class). The size
 * class (quarter of an octave) keeps allocations of very different sizes apart, so that user
 * space can undo the sampling bias with the average size of the row without a large error. */
struct heap_agg_key {
	__u32 target;
	__u32 tgid;
	__u32 size_class;
	__u32 pad;
	/* Key of the user stack in `user_stacks` (a 64-bit hash of its frames, ff_store_stack);
	 * 0 when it was lost (counted in drops). */
	__u64 user_stack;
};

/* Sampled (not yet scaled) totals of one aggregation row. The alloc_* counters only grow:
 * a capture reads their increase over its window. The inuse_* counters are node-wide running
 * totals that user space does not read (a capture's in-use comes from heap_live). */
struct heap_agg_val {
	__u64 alloc_count;
	__u64 alloc_bytes;
	__u64 inuse_count;
	__u64 inuse_bytes;
};

/* A live sampled allocation, by process and address, so that free() can retire it. */
struct heap_live_key {
	__u32 tgid;
	__u32 pad;
	__u64 addr;
};

/* What a live sampled allocation counts against, and when it was made (bpf_ktime_get_ns):
 * captures sharing the sampler count as their in-use only the live allocations made since
 * they started. */
struct heap_live_val {
	struct heap_agg_key agg;
	__u64 size;
	__u64 alloc_ns;
};

/* Counters in the per-CPU `heap_stats` array. */
enum heap_stat {
	HEAP_STAT_CALLS = 0,       /* allocation calls made by target threads */
	HEAP_STAT_SAMPLED = 1,     /* sampled allocations recorded */
	HEAP_STAT_FREED = 2,       /* sampled allocations retired by a free */
	HEAP_DROP_LIVE_FULL = 3,   /* live map full: allocation counted but its free cannot be seen */
	HEAP_DROP_AGG_FULL = 4,    /* aggregation map full: sample lost */
	HEAP_DROP_STACK = 5,       /* user stack not captured (kept with user_stack 0) */
	HEAP_DROP_THREAD_STATE = 6, /* no per-thread state could be created: call not sampled */
	HEAP_DROP_NOTIFY = 7,      /* process notification ring buffer full */
	HEAP_STAT_MAX = 8,
};

#endif /* FLAMEFLEET_HEAP_H */
