/* SPDX-License-Identifier: (LGPL-2.1 OR BSD-2-Clause) */
/* Types the lead-up ring shares with user space (exposed by its skeleton). */
#ifndef FLAMEFLEET_CPU_RING_H
#define FLAMEFLEET_CPU_RING_H

/* Frames kept per sample: the user stack's innermost 32, the kernel's 16. */
#define FF_RING_USER_FRAMES 32
#define FF_RING_KERNEL_FRAMES 16

/*
 * One sample of a watched cgroup's task (440 bytes). `stamp` and `done` make
 * a torn read visible: the writer clears `done`, fills the entry, writes
 * `stamp` and last `done`, so an entry read while it was rewritten has
 * stamp != done (or done == 0) and is skipped.
 */
struct ring_entry {
	/* bpf_ktime_get_ns() at the sample (CLOCK_MONOTONIC); 0: never written. */
	__u64 stamp;
	/* The watched cgroup covering the task (its own cgroup or an ancestor). */
	__u64 cgroup;
	__u32 tgid;
	__u32 pid;
	/* Bytes of `user` and `kernel` filled (8 per frame). */
	__u32 user_bytes;
	__u32 kernel_bytes;
	char comm[16];
	__u64 user[FF_RING_USER_FRAMES];
	__u64 kernel[FF_RING_KERNEL_FRAMES];
	/* Equal to `stamp` once the entry is complete. */
	__u64 done;
};

#endif
