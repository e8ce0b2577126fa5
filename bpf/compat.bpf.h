/* SPDX-License-Identifier: (LGPL-2.1 OR BSD-2-Clause) */
/*
 * Kernel-version workarounds, in one place. Each helper names the kernel
 * change it answers; CO-RE relocations pick the right field at load time.
 */
#ifndef FLAMEFLEET_COMPAT_BPF_H
#define FLAMEFLEET_COMPAT_BPF_H

#include <bpf/bpf_core_read.h>
#include <bpf/bpf_helpers.h>

/* libbpf 1.2's bpf_helpers.h has it; older system headers (bench scripts) do not. */
#ifndef bpf_ksym_exists
#define bpf_ksym_exists(sym) (!!(sym))
#endif

/*
 * Linux 5.14, commit 2f064a59a11f ("sched: Change task_struct::state"):
 * task_struct::state became __state.
 */
struct task_struct___pre_5_14 {
	long state;
} __attribute__((preserve_access_index));

static __always_inline long ff_task_state(struct task_struct *t)
{
	if (bpf_core_field_exists(t->__state))
		return BPF_CORE_READ(t, __state);
	return BPF_CORE_READ((struct task_struct___pre_5_14 *)t, state);
}

/* The same for a BTF pointer (tp_btf arguments): a direct load, no helper call. */
static __always_inline long ff_task_state_btf(struct task_struct *t)
{
	if (bpf_core_field_exists(t->__state))
		return t->__state;
	return ((struct task_struct___pre_5_14 *)t)->state;
}

/*
 * Linux 5.5, commit 67c0496e87d1 ("kernfs: convert kernfs_node->id from union
 * kernfs_node_id to u64"): before it the cgroup ID lived in kn->id.id.
 * Returns the ID of the task's cgroup v2 (default hierarchy) cgroup, the same
 * value bpf_get_current_cgroup_id() returns for the current task.
 */
union kernfs_node_id___pre_5_5 {
	struct {
		__u32 ino;
		__u32 generation;
	};
	__u64 id;
} __attribute__((preserve_access_index));

struct kernfs_node___pre_5_5 {
	union kernfs_node_id___pre_5_5 id;
} __attribute__((preserve_access_index));

static __always_inline __u64 ff_kernfs_id(struct kernfs_node *kn)
{
	if (bpf_core_type_exists(union kernfs_node_id___pre_5_5))
		return BPF_CORE_READ((struct kernfs_node___pre_5_5 *)kn, id.id);
	return BPF_CORE_READ(kn, id);
}

static __always_inline __u64 ff_task_cgroup_id(struct task_struct *t)
{
	return ff_kernfs_id(BPF_CORE_READ(t, cgroups, dfl_cgrp, kn));
}

/*
 * Linux 6.1, commit 7f203bc89eb6 ("cgroup: Replace cgroup->ancestor_ids[]
 * with ->ancestors[]"): before it a cgroup kept its ancestors' IDs, after it
 * pointers to them. ff_walk_ancestors() (targets.bpf.h) tests which with
 * bpf_core_field_exists() *outside* its loops, so that no relocation of the
 * missing layout is hoisted into code the verifier must accept.
 */
struct cgroup___pre_6_1 {
	int level;
	__u64 ancestor_ids[];
} __attribute__((preserve_access_index));

#endif
