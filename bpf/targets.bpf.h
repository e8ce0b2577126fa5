/* SPDX-License-Identifier: (LGPL-2.1 OR BSD-2-Clause) */
/*
 * Which tasks every sampler keeps: those in a target cgroup or in any of its
 * descendants, judged live from the task's cgroup ancestry, so a container
 * that starts (or restarts) in a pod during a capture is caught from its first
 * event.
 *
 * `targets` holds only the target cgroups themselves (cgroup v2 ID -> struct
 * ff_target). A lookup walks the task's cgroup and its ancestors, deepest
 * first, and returns the deepest target found (user space folds targets nested
 * inside another capture's target into that capture). The walk's result is
 * cached per cgroup in cgroup-local storage (Linux 6.2+) together with the
 * generation of `targets` it was computed from; user space bumps the
 * generation after every change of `targets`, so a cached answer is never
 * stale and the hot path costs one cgroup-storage lookup. Without cgroup
 * storage (ff_cgrp_cache = false) every lookup walks.
 */
#ifndef FLAMEFLEET_TARGETS_BPF_H
#define FLAMEFLEET_TARGETS_BPF_H

#include "targets.h"
#include "compat.bpf.h"

/* Deepest cgroup level walked (kubelet pods sit at level 3-5; nested
 * runtimes such as kind add a few). Deeper tasks match on their 32 nearest
 * levels only. */
#define FF_MAX_CGROUP_DEPTH 32

/* Set before load: cache lookups in cgroup-local storage (Linux 6.2+). */
const volatile bool ff_cgrp_cache = true;

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 1024);
	__type(key, __u64);
	__type(value, struct ff_target);
} targets SEC(".maps");

/* Element 0: generation of `targets`, bumped by user space after each change. */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, __u64);
} target_generation SEC(".maps");

/* Result of the ancestry walk for one cgroup. */
struct ff_target_cache {
	__u64 generation;
	/* index 0: no target covers this cgroup. */
	struct ff_target target;
};

struct {
	__uint(type, BPF_MAP_TYPE_CGRP_STORAGE);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, int);
	__type(value, struct ff_target_cache);
} target_cache SEC(".maps");

/* The deepest target among `cgrp` and its ancestors, or NULL. */
static __always_inline struct ff_target *ff_walk_ancestors(struct cgroup *cgrp)
{
	int level = BPF_CORE_READ(cgrp, level);
	struct ff_target *t;
	__u64 id;

	if (bpf_core_field_exists(cgrp->ancestors)) {
		for (int i = 0; i < FF_MAX_CGROUP_DEPTH && i <= level; i++) {
			struct cgroup *anc = NULL;

			bpf_core_read(&anc, sizeof(anc), &cgrp->ancestors[level - i]);
			if (!anc)
				break;
			id = ff_kernfs_id(BPF_CORE_READ(anc, kn));
			t = bpf_map_lookup_elem(&targets, &id);
			if (t)
				return t;
		}
		return NULL;
	}
	for (int i = 0; i < FF_MAX_CGROUP_DEPTH && i <= level; i++) {
		struct cgroup___pre_6_1 *old = (void *)cgrp;

		id = 0;
		bpf_core_read(&id, sizeof(id), &old->ancestor_ids[level - i]);
		t = bpf_map_lookup_elem(&targets, &id);
		if (t)
			return t;
	}
	return NULL;
}

/*
 * Copies the target covering `cgrp` into `out`; false when none does. The
 * copy (not a map pointer) is what a cache hit can give, and it is what the
 * programs need: the index and flags.
 */
static __always_inline bool ff_cgroup_target(struct cgroup *cgrp, struct ff_target *out)
{
	struct ff_target_cache *c = NULL;
	struct ff_target *t;
	__u32 zero = 0;
	__u64 *gen, g = 0;

	if (!cgrp)
		return false;
	gen = bpf_map_lookup_elem(&target_generation, &zero);
	if (gen)
		g = *gen;
	if (ff_cgrp_cache) {
		c = bpf_cgrp_storage_get(&target_cache, cgrp, 0, BPF_LOCAL_STORAGE_GET_F_CREATE);
		if (c && c->generation == g) {
			*out = c->target;
			return out->index != 0;
		}
	}
	t = ff_walk_ancestors(cgrp);
	if (t) {
		*out = *t;
	} else {
		out->index = 0;
		out->flags = 0;
	}
	if (c) {
		c->target = *out;
		c->generation = g;
	}
	return out->index != 0;
}

/* The target covering task `p` (a BTF pointer, e.g. a tp_btf argument). */
static __always_inline bool ff_task_target(struct task_struct *p, struct ff_target *out)
{
	return ff_cgroup_target(p->cgroups->dfl_cgrp, out);
}

/* The target covering task `p` for programs whose arguments are not BTF
 * pointers (raw_tp): reads through probe helpers and walks, uncached. */
static __always_inline bool ff_task_target_raw(struct task_struct *p, struct ff_target *out)
{
	struct cgroup *cgrp = BPF_CORE_READ(p, cgroups, dfl_cgrp);
	struct ff_target *t = cgrp ? ff_walk_ancestors(cgrp) : NULL;

	if (!t)
		return false;
	*out = *t;
	return true;
}

/* The target covering the current task. */
static __always_inline bool ff_current_target(struct ff_target *out)
{
	return ff_task_target(bpf_get_current_task_btf(), out);
}

#endif
