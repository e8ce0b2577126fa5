/* SPDX-License-Identifier: (LGPL-2.1 OR BSD-2-Clause) */
/* Types the CPU sampler shares with user space (exposed by its skeleton). */
#ifndef FLAMEFLEET_CPU_SAMPLER_H
#define FLAMEFLEET_CPU_SAMPLER_H

#include "targets.h"

/* Key of the in-kernel sample counts: one entry per distinct stack pair. */
struct cpu_sample_key {
	__u32 target;
	__u32 tgid;
	__u32 pid;
	__u32 pad;
	/* Keys of the stacks in `user_stacks` and `kernel_stacks` (64-bit hashes
	 * of their frames); 0 when none was taken. */
	__u64 user_stack;
	__u64 kernel_stack;
	/* Key of the Python frames in `py_stacks` (python.bpf.h); 0 when none. */
	__u64 py_stack;
	char comm[FF_COMM_LEN];
};

/* Loss counters (one per CPU, summed by user space); never silent. */
struct cpu_drops {
	__u64 counts_full;   /* `counts` map full: sample lost */
	__u64 user_stack;    /* user stack lost (stack map full) */
	__u64 kernel_stack;  /* kernel stack lost (stack map full) */
	__u64 notify;        /* ring buffer full: process not announced */
};

#endif
