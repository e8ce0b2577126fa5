// SPDX-License-Identifier: GPL-2.0
/*
 * Run-queue latency of the tasks of the target cgroups: the time from
 * becoming runnable (wakeup, new task, preemption) to running, as log2
 * histograms kept in the kernel. Unlike libbpf-tools' runqlat -c, which tests
 * the cgroup of the *current* task (the waker), we attribute each wait to the
 * cgroup of the task that waits.
 *
 * The start timestamp lives in task storage where the kernel has it (5.11+);
 * user space disables one of the two program sets with set_autoload(false).
 */
#include "vmlinux.h"
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_tracing.h>
#include <bpf/bpf_core_read.h>
#include "compat.bpf.h"
#include "targets.bpf.h"
#include "runqlat.h"

#define TASK_RUNNING 0

struct {
	__uint(type, BPF_MAP_TYPE_TASK_STORAGE);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, int);
	__type(value, struct runqlat_start);
} start_task SEC(".maps");

/* Fallback for kernels without task storage: thread ID -> start. */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 10240);
	__type(key, __u32);
	__type(value, struct runqlat_start);
} start_hash SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 10240);
	__type(key, struct runqlat_key);
	__type(value, struct runqlat_hist);
} hists SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct runqlat_drops);
} drops SEC(".maps");

static const struct runqlat_hist zero_hist;

static __always_inline struct runqlat_drops *drop_counters(void)
{
	__u32 zero = 0;

	return bpf_map_lookup_elem(&drops, &zero);
}

#define count_drop(field)                                  \
	do {                                               \
		struct runqlat_drops *d__ = drop_counters(); \
		if (d__)                                   \
			d__->field += 1;                   \
	} while (0)

static __always_inline __u32 log2_slot(__u64 v)
{
	__u32 r = 0;

	/* Unrolled binary search; the verifier accepts it on every kernel. */
	if (v >> 32) { v >>= 32; r += 32; }
	if (v >> 16) { v >>= 16; r += 16; }
	if (v >> 8) { v >>= 8; r += 8; }
	if (v >> 4) { v >>= 4; r += 4; }
	if (v >> 2) { v >>= 2; r += 2; }
	if (v >> 1) { r += 1; }
	return r < RUNQLAT_SLOTS ? r : RUNQLAT_SLOTS - 1;
}

/* Fills `s` when `p` belongs to a target; returns false otherwise. */
static __always_inline bool start_of(struct task_struct *p, struct runqlat_start *s)
{
	struct ff_target *t;

	if (!BPF_CORE_READ(p, pid))
		return false;
	t = ff_target_of(ff_task_cgroup_id(p));
	if (!t)
		return false;
	s->ts = bpf_ktime_get_ns();
	s->target = t->index;
	s->flags = t->flags;
	return true;
}

static __always_inline void record(struct task_struct *next, struct runqlat_start *s)
{
	struct runqlat_key key = { .target = s->target };
	struct runqlat_hist *h;
	__s64 delta = bpf_ktime_get_ns() - s->ts;

	if (delta < 0)
		return;
	if (s->flags & FF_TARGET_PER_PROCESS)
		key.tgid = BPF_CORE_READ(next, tgid);
	h = bpf_map_lookup_elem(&hists, &key);
	if (!h) {
		bpf_map_update_elem(&hists, &key, &zero_hist, BPF_NOEXIST);
		h = bpf_map_lookup_elem(&hists, &key);
		if (!h) {
			count_drop(hists_full);
			return;
		}
	}
	if (!h->comm[0])
		bpf_probe_read_kernel_str(h->comm, sizeof(h->comm), next->comm);
	delta /= (s->flags & FF_TARGET_UNIT_MS) ? 1000000U : 1000U;
	__sync_fetch_and_add(&h->slots[log2_slot(delta)], 1);
}

/* ---- task storage variant ---- */

static __always_inline void enqueue_task(struct task_struct *p)
{
	struct runqlat_start s, *slot;

	if (!start_of(p, &s))
		return;
	slot = bpf_task_storage_get(&start_task, p, 0, BPF_LOCAL_STORAGE_GET_F_CREATE);
	if (slot)
		*slot = s;
	else
		count_drop(start_full);
}

SEC("tp_btf/sched_wakeup")
int BPF_PROG(wakeup_task, struct task_struct *p)
{
	enqueue_task(p);
	return 0;
}

SEC("tp_btf/sched_wakeup_new")
int BPF_PROG(wakeup_new_task, struct task_struct *p)
{
	enqueue_task(p);
	return 0;
}

SEC("tp_btf/sched_switch")
int BPF_PROG(switch_task, bool preempt, struct task_struct *prev, struct task_struct *next)
{
	struct runqlat_start *s;

	if (ff_task_state(prev) == TASK_RUNNING)
		enqueue_task(prev);
	s = bpf_task_storage_get(&start_task, next, 0, 0);
	if (!s || !s->ts)
		return 0;
	record(next, s);
	s->ts = 0;
	return 0;
}

/* ---- hash-map fallback ---- */

static __always_inline void enqueue_hash(struct task_struct *p)
{
	struct runqlat_start s;
	__u32 pid = BPF_CORE_READ(p, pid);

	if (!start_of(p, &s))
		return;
	if (bpf_map_update_elem(&start_hash, &pid, &s, BPF_ANY))
		count_drop(start_full);
}

SEC("raw_tp/sched_wakeup")
int BPF_PROG(wakeup_hash, struct task_struct *p)
{
	enqueue_hash(p);
	return 0;
}

SEC("raw_tp/sched_wakeup_new")
int BPF_PROG(wakeup_new_hash, struct task_struct *p)
{
	enqueue_hash(p);
	return 0;
}

SEC("raw_tp/sched_switch")
int BPF_PROG(switch_hash, bool preempt, struct task_struct *prev, struct task_struct *next)
{
	struct runqlat_start *s;
	__u32 pid;

	if (ff_task_state(prev) == TASK_RUNNING)
		enqueue_hash(prev);
	pid = BPF_CORE_READ(next, pid);
	s = bpf_map_lookup_elem(&start_hash, &pid);
	if (!s)
		return 0;
	record(next, s);
	bpf_map_delete_elem(&start_hash, &pid);
	return 0;
}

char LICENSE[] SEC("license") = "GPL";
