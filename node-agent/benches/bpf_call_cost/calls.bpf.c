// SPDX-License-Identifier: GPL-2.0
/*
 * One program per building block of a scheduler-event tracer, all on
 * sched_switch at once, so that bpf_stats prices each against the empty
 * program in the same run (run by ../bpf_call_cost.sh, not by the agent).
 */
#include "vmlinux.h"
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_tracing.h>

struct {
	__uint(type, BPF_MAP_TYPE_TASK_STORAGE);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, int);
	__type(value, __u64);
} task_st SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_CGRP_STORAGE);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, int);
	__type(value, __u64);
} cgrp_st SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 4);
	__type(key, __u32);
	__type(value, __u64);
} pcpu SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 10240);
	__type(key, __u32);
	__type(value, __u64);
} hash SEC(".maps");

volatile __u64 sink;

SEC("tp_btf/sched_switch")
int BPF_PROG(c_empty, bool preempt, struct task_struct *prev, struct task_struct *next)
{
	return 0;
}

SEC("tp_btf/sched_switch")
int BPF_PROG(c_loads, bool preempt, struct task_struct *prev, struct task_struct *next)
{
	sink = next->pid + prev->__state + next->cgroups->dfl_cgrp->kn->id;
	return 0;
}

SEC("tp_btf/sched_switch")
int BPF_PROG(c_ktime, bool preempt, struct task_struct *prev, struct task_struct *next)
{
	sink = bpf_ktime_get_ns();
	return 0;
}

SEC("tp_btf/sched_switch")
int BPF_PROG(c_task_storage, bool preempt, struct task_struct *prev, struct task_struct *next)
{
	__u64 *v = bpf_task_storage_get(&task_st, next, 0, BPF_LOCAL_STORAGE_GET_F_CREATE);

	if (v)
		*v += 1;
	return 0;
}

SEC("tp_btf/sched_switch")
int BPF_PROG(c_cgrp_storage, bool preempt, struct task_struct *prev, struct task_struct *next)
{
	__u64 *v = bpf_cgrp_storage_get(&cgrp_st, next->cgroups->dfl_cgrp, 0,
					BPF_LOCAL_STORAGE_GET_F_CREATE);

	if (v)
		*v += 1;
	return 0;
}

SEC("tp_btf/sched_switch")
int BPF_PROG(c_percpu_array, bool preempt, struct task_struct *prev, struct task_struct *next)
{
	__u32 key = 1;
	__u64 *v = bpf_map_lookup_elem(&pcpu, &key);

	if (v)
		*v += 1;
	return 0;
}

SEC("tp_btf/sched_switch")
int BPF_PROG(c_hash_update, bool preempt, struct task_struct *prev, struct task_struct *next)
{
	__u32 key = next->pid;
	__u64 one = 1;

	bpf_map_update_elem(&hash, &key, &one, BPF_ANY);
	return 0;
}

char LICENSE[] SEC("license") = "GPL";
