// SPDX-License-Identifier: GPL-2.0
/*
 * The lead-up ring of CPU/pressure triggers (docs/triggers.md, "The lead-up"):
 * a perf-event program, at a low frequency on every CPU, keeps the last
 * samples of the tasks of watched cgroups in a BPF array used as one ring per
 * CPU (`ring_slots` entries each, entry cpu * ring_slots + head % ring_slots).
 * A CPU writes only its own ring, and perf-event programs do not nest on a
 * CPU, so no lock or atomic is needed. At a fire user space reads the entries
 * of the fired cgroup from the lookback window.
 *
 * Only helpers of Linux 4.18 (bpf_get_stack) and CO-RE reads: loads on every
 * kernel of the guest tier (5.10 has neither bpf_loop nor BTF task pointers).
 * Stacks are the kernel's frame-pointer walk (bpf_get_stack): the innermost
 * frame is exact, callers need frame pointers.
 */
#include "vmlinux.h"
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_tracing.h>
#include <bpf/bpf_core_read.h>
#include "compat.bpf.h"
#include "cpu_ring.h"

/* Cgroup levels walked up from the task's cgroup to find a watched one (a
 * container's cgroup, or the pod's with the task one or two levels down). */
#define FF_RING_DEPTH 4

/* Set before load: entries per CPU (a power of two). */
const volatile __u32 ring_slots = 256;
/* Set before load: also keep kernel stacks. */
const volatile bool ring_kernel_stacks = true;

/* Watched cgroup ID -> 1; sized by user space. */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 1024);
	__type(key, __u64);
	__type(value, __u32);
} watched SEC(".maps");

/* The rings: possible CPUs x ring_slots entries, sized by user space. */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct ring_entry);
} ring SEC(".maps");

/* Each CPU's next slot (wraps); also the count of samples it kept. */
struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, __u64);
} heads SEC(".maps");

/* The watched cgroup among the task's cgroup and its nearest ancestors; 0: none. */
static __always_inline __u64 watched_cgroup(struct task_struct *task)
{
	struct cgroup *cgrp = BPF_CORE_READ(task, cgroups, dfl_cgrp);
	int level;
	__u64 id;

	if (!cgrp)
		return 0;
	level = BPF_CORE_READ(cgrp, level);
	/* Which layout, tested outside the loops (see compat.bpf.h). */
	if (bpf_core_field_exists(cgrp->ancestors)) {
		for (int i = 0; i < FF_RING_DEPTH && i <= level; i++) {
			struct cgroup *anc = NULL;

			bpf_core_read(&anc, sizeof(anc), &cgrp->ancestors[level - i]);
			if (!anc)
				return 0;
			id = ff_kernfs_id(BPF_CORE_READ(anc, kn));
			if (bpf_map_lookup_elem(&watched, &id))
				return id;
		}
		return 0;
	}
	for (int i = 0; i < FF_RING_DEPTH && i <= level; i++) {
		struct cgroup___pre_6_1 *old = (void *)cgrp;

		id = 0;
		bpf_core_read(&id, sizeof(id), &old->ancestor_ids[level - i]);
		if (bpf_map_lookup_elem(&watched, &id))
			return id;
	}
	return 0;
}

/* Whether the sample interrupted user mode (then there is no kernel stack);
 * as the CPU sampler reads it (cpu_sampler.bpf.c). */
static __always_inline bool in_user_mode(struct bpf_perf_event_data *ctx)
{
	__u64 cs = *(volatile __u64 *)((char *)&ctx->regs + __builtin_offsetof(struct pt_regs, cs));

	return (cs & 3) == 3;
}

SEC("perf_event")
int on_ring_sample(struct bpf_perf_event_data *ctx)
{
	struct task_struct *task = (struct task_struct *)bpf_get_current_task();
	struct ring_entry *e;
	__u32 zero = 0, idx;
	__u64 *head, cgroup, id, now;
	long bytes;

	cgroup = watched_cgroup(task);
	if (!cgroup)
		return 0;
	head = bpf_map_lookup_elem(&heads, &zero);
	if (!head)
		return 0;
	idx = bpf_get_smp_processor_id() * ring_slots + (__u32)(*head & (ring_slots - 1));
	e = bpf_map_lookup_elem(&ring, &idx);
	if (!e)
		return 0;
	*head += 1;
	now = bpf_ktime_get_ns();
	e->done = 0;
	asm volatile("" ::: "memory");
	id = bpf_get_current_pid_tgid();
	e->cgroup = cgroup;
	e->tgid = id >> 32;
	e->pid = (__u32)id;
	bpf_get_current_comm(e->comm, sizeof(e->comm));
	bytes = bpf_get_stack(ctx, e->user, sizeof(e->user), BPF_F_USER_STACK);
	e->user_bytes = bytes > 0 ? (__u32)bytes : 0;
	e->kernel_bytes = 0;
	if (ring_kernel_stacks && !in_user_mode(ctx)) {
		bytes = bpf_get_stack(ctx, e->kernel, sizeof(e->kernel), 0);
		e->kernel_bytes = bytes > 0 ? (__u32)bytes : 0;
	}
	asm volatile("" ::: "memory");
	e->stamp = now;
	asm volatile("" ::: "memory");
	e->done = now;
	return 0;
}

char LICENSE[] SEC("license") = "GPL";
