/* SPDX-License-Identifier: (LGPL-2.1 OR BSD-2-Clause) */
/*
 * Process events, the same for every sampler that records user stacks: a process of a
 * target cgroup is announced to user space the first time the sampler records it, and
 * again when it execs (its mappings change). User space snapshots /proc/<tgid>/maps while
 * the process lives, so that a short-lived process can still be symbolized, and loads its
 * unwind tables before most of its stacks are walked (capture/process_tracker.rs consumes
 * the records).
 *
 * A program including this header defines ff_proc_event_lost(), which counts a record lost
 * to a full ring buffer in the program's own drop counters, and calls ff_announce_first()
 * where it records a process; user space attaches ff_proc_on_exec and consumes
 * proc_events. Nothing here needs more than Linux 5.8 (ring buffer) and 5.5 (tp_btf).
 */
#ifndef FLAMEFLEET_PROC_EVENTS_BPF_H
#define FLAMEFLEET_PROC_EVENTS_BPF_H

#include <bpf/bpf_helpers.h>
#include <bpf/bpf_tracing.h>
#include "proc_events.h"
#include "targets.bpf.h"

/* Defined by the including program: counts one record lost to a full ring buffer. */
static __always_inline void ff_proc_event_lost(void);

/* Process records for user space (struct ff_proc_event). */
struct {
	__uint(type, BPF_MAP_TYPE_RINGBUF);
	__uint(max_entries, 256 * 1024);
} proc_events SEC(".maps");

/* Never written: only makes the record type part of the BTF, so the skeleton generates it
 * for user space. */
struct ff_proc_event ff_proc_event_layout SEC(".bss");

/* Processes already announced; LRU, so it never fills up (a process evicted from it is
 * announced again, which costs one more snapshot). */
struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 16384);
	__type(key, __u32);
	__type(value, __u8);
} ff_seen_tgids SEC(".maps");

/* Sends one record: the current task's process `tgid`, of target `target`. */
static __always_inline void ff_announce(__u32 tgid, __u32 target, __u32 kind)
{
	struct ff_proc_event *e = bpf_ringbuf_reserve(&proc_events, sizeof(*e), 0);

	if (!e) {
		ff_proc_event_lost();
		return;
	}
	e->tgid = tgid;
	e->kind = kind;
	e->target = target;
	bpf_get_current_comm(e->comm, sizeof(e->comm));
	bpf_ringbuf_submit(e, 0);
}

/* Announces the current task's process `tgid` unless it was announced already. Called for
 * every sample, so it looks the process up before it inserts it: an update of an LRU map
 * takes a free node off the LRU lists, under their locks, before it finds the key there
 * and puts the node back, while a lookup takes no lock. */
static __always_inline void ff_announce_first(__u32 tgid, __u32 target)
{
	__u8 yes = 1;

	if (bpf_map_lookup_elem(&ff_seen_tgids, &tgid))
		return;
	if (bpf_map_update_elem(&ff_seen_tgids, &tgid, &yes, BPF_NOEXIST) == 0)
		ff_announce(tgid, target, FF_PROC_FIRST_SEEN);
}

/* A process of a target replaced its image: announce the new one, and forget it so that
 * its next record announces it again, once its shared libraries are mapped. Execs are
 * rare, so the target is found by the uncached walk through probe reads: the one hook
 * loads on every kernel (5.10 has neither bpf_get_current_task_btf nor cgroup storage). */
SEC("tp_btf/sched_process_exec")
int BPF_PROG(ff_proc_on_exec, struct task_struct *p, pid_t old_pid, struct linux_binprm *bprm)
{
	struct ff_target t;
	__u32 tgid;

	if (!ff_task_target_raw((struct task_struct *)bpf_get_current_task(), &t))
		return 0;
	tgid = bpf_get_current_pid_tgid() >> 32;
	bpf_map_delete_elem(&ff_seen_tgids, &tgid);
	ff_announce(tgid, t.index, FF_PROC_EXEC);
	return 0;
}

#endif
