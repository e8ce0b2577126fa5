/* SPDX-License-Identifier: (LGPL-2.1 OR BSD-2-Clause) */
/*
 * Types every Flamefleet sampler shares with user space. The skeletons expose
 * them (libbpf-cargo generates Rust types from BTF), so user space never keeps
 * a hand-written #[repr(C)] copy.
 */
#ifndef FLAMEFLEET_TARGETS_H
#define FLAMEFLEET_TARGETS_H

#define FF_COMM_LEN 16

/* Value of the `targets` map (key: cgroup v2 ID, the cgroup directory's inode). */
struct ff_target {
	/* Index user space assigned to this cgroup; never reused while loaded. */
	__u32 index;
	/* FF_TARGET_* flags. */
	__u32 flags;
};

/* runqlat: keep one histogram per process instead of one per target. */
#define FF_TARGET_PER_PROCESS 1u
/* runqlat: histogram unit is milliseconds instead of microseconds. */
#define FF_TARGET_UNIT_MS 2u

#endif
