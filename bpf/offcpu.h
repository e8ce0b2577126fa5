/* SPDX-License-Identifier: (LGPL-2.1 OR BSD-2-Clause) */
/* Types the off-CPU sampler shares with user space (exposed by its skeleton). */
#ifndef FLAMEFLEET_OFFCPU_H
#define FLAMEFLEET_OFFCPU_H

#include "targets.h"

/* Key of the in-kernel off-CPU totals: one entry per thread and stack pair. */
struct offcpu_key {
	__u32 target;
	__u32 tgid;
	__u32 pid;
	__u32 pad;
	/* Keys of the stacks in `user_stacks` and `kernel_stacks` (64-bit hashes
	 * of their frames); 0 when none was taken. */
	__u64 user_stack;
	__u64 kernel_stack;
	/* Key in `py_stacks` of the Python frames it blocked in (python.h); 0
	 * for a thread not running Python code. */
	__u64 py_stack;
	char comm[FF_COMM_LEN];
};

/* What a thread's blocks under one key added up to. */
struct offcpu_val {
	__u64 blocked_ns; /* blocked: from switching out to being woken */
	__u64 blocks;     /* number of blocks */
	__u64 queued_ns;  /* after the wakeup, runnable and waiting for a CPU */
};

/* A thread that blocked, until it runs again (task storage). */
struct offcpu_stamp {
	__u64 out;        /* clock at the switch-out; 0: no block pending */
	__u64 run_delay;  /* sched_info.run_delay at the switch-out */
	__u64 user_stack; /* key in `user_stacks` of the stack it blocked with */
	__u64 py_stack;   /* key in `py_stacks` of its Python frames then */
	__u32 target;     /* target index when it blocked */
	__u32 pad;
};

/* Per-CPU counters (summed by user space); the drops are never silent. */
struct offcpu_stats {
	__u64 blocks;       /* blocks of target threads: switch-outs stamped */
	__u64 walked;       /* of those ended, at or above the minimum: stacks recorded */
	__u64 short_blocks; /* of those ended, below the minimum: only counted */
	__u64 stale;        /* ended after their target left (capture over): ignored */
	__u64 counts_full;  /* `counts` map full: a walked block lost */
	__u64 stamp_full;   /* no task storage could be had: block lost */
	__u64 kernel_stack; /* kernel stack lost (stack map full) */
	__u64 notify;       /* ring buffer full: process not announced */
};

/* Per-target totals of the blocks below the minimum (per-CPU array, element =
 * target index). */
struct offcpu_short {
	__u64 blocked_ns;
	__u64 blocks;
	__u64 queued_ns;
};

/* The per-CPU cache mapping a cgroup to the target covering it. */
#define OFFCPU_CACHE_SLOTS 16

struct offcpu_cache_slot {
	__u64 cgroup;     /* cgroup serial number (css.serial_nr, never reused) */
	__u64 generation; /* of the target map when the slot was filled */
	struct ff_target target;
};

struct offcpu_cpu {
	struct offcpu_cache_slot cache[OFFCPU_CACHE_SLOTS];
	struct offcpu_stats stats;
};

#endif
