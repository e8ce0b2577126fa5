// SPDX-License-Identifier: GPL-2.0
/*
 * Off-CPU time of the tasks of the target cgroups: how long each thread stays
 * blocked (sleeping, waiting on a lock, a pipe, I/O, a futex), attributed to
 * its user and kernel stacks at the moment it blocked, summed per stack in
 * the kernel. One program, on sched_switch:
 *
 * - Switch-out of a thread that blocks (`prev` not runnable, not preempted)
 *   in a target: its user stack is walked then, in the thread's own context
 *   (the CFI walker of unwind.bpf.h: a thread's memory is readable only while
 *   its address space is the current one, so this walk cannot wait for the
 *   block's end), and the block is stamped in task storage with the
 *   scheduler's clock and the thread's run_delay. A CPython thread's Python
 *   frames are read then too (python.bpf.h), as the CPU sampler reads them.
 * - Switch-in of a thread with a stamp: the time it was blocked runs from the
 *   switch-out to its wakeup. The scheduler stamps the wakeup itself
 *   (sched_info.last_queued, set when the task is queued, on the run-queue
 *   clock the switch-out was stamped with) and adds the time it then waits for
 *   a CPU to run_delay; that wait is runqlat's business and is kept apart
 *   (queued_ns). A block shorter than `min_block_ns` is only counted per
 *   target; a longer one gets its kernel stack (walked from the stopped task,
 *   bpf_get_task_stack: it names why the thread blocked) and is added to
 *   `counts`.
 *
 * A Go thread blocks on its scheduler stack (g0) right after a goroutine parked
 * on it: the walk goes on from runtime.mcall to that goroutine's stack
 * (ff_go_park_stitch, unwind.bpf.h), so a channel receive or time.Sleep shows
 * with its Go callers.
 *
 * A switch of threads outside the targets costs two per-CPU cache probes
 * (cgroup serial number and target generation -> target) and no helper call.
 *
 * Needs bpf_loop (5.17) for the walk and task storage (5.11) for the stamps;
 * user space refuses older kernels (KernelFeatures::offcpu_refusal).
 */
#include "vmlinux.h"
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_tracing.h>
#include <bpf/bpf_core_read.h>
#include "compat.bpf.h"
#include "targets.bpf.h"
#include "proc_events.bpf.h"
#include "unwind.bpf.h"
#include "python.bpf.h"
#include "offcpu.h"

#define TASK_RUNNING 0
#define TASK_DEAD 0x80
#define PF_KTHREAD 0x00200000

/* Set before load: blocks shorter than this are counted, not attributed. */
const volatile __u64 min_block_ns = 1000000;
/* Set before load: also record kernel stacks. */
const volatile bool capture_kernel_stacks = true;
/* Set before load: read the Python frames (python.bpf.h) of the processes user space
 * registered, when they block. */
const volatile bool python_frames = false;

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 16384);
	__type(key, struct offcpu_key);
	__type(value, struct offcpu_val);
} counts SEC(".maps");

/* Stack hash -> kernel stack; sized by user space. */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 16384);
	__type(key, __u64);
	__type(value, struct ff_user_stack);
} kernel_stacks SEC(".maps");

/* Blocks below the minimum, per target index. */
struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1024);
	__type(key, __u32);
	__type(value, struct offcpu_short);
} short_blocks SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct offcpu_cpu);
} offcpu_cpus SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_TASK_STORAGE);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, int);
	__type(value, struct offcpu_stamp);
} stamps SEC(".maps");

static __always_inline struct offcpu_cpu *this_cpu(void)
{
	__u32 zero = 0;

	return bpf_map_lookup_elem(&offcpu_cpus, &zero);
}

/* For proc_events.bpf.h: a process record lost to a full ring buffer. */
static __always_inline void ff_proc_event_lost(void)
{
	struct offcpu_cpu *c = this_cpu();

	if (c)
		c->stats.notify += 1;
}

/* The scheduler's clock and stamps, where the kernel has them: the run queue
 * through the task (CONFIG_FAIR_GROUP_SCHED: the per-CPU `runqueues` does not
 * resolve on kernels without CONFIG_KALLSYMS_ALL) and sched_info
 * (CONFIG_SCHED_INFO). Without them the blocked time is read with our own
 * clock from switch-out to switch-in, the run-queue wait included. */
#define OFFCPU_SCHED_CLOCK                                                     \
	(bpf_core_field_exists(struct sched_entity, cfs_rq) &&                 \
	 bpf_core_field_exists(struct cfs_rq, rq) &&                           \
	 bpf_core_field_exists(struct sched_info, last_queued) &&              \
	 bpf_core_field_exists(struct sched_info, run_delay))

/* The run-queue clock of this CPU (`p` is on it), or our clock without it. */
static __always_inline __u64 clock_of(struct task_struct *p)
{
	struct rq *rq;

	if (!OFFCPU_SCHED_CLOCK)
		return bpf_ktime_get_ns();
	rq = p->se.cfs_rq->rq;
	return rq ? rq->clock : 0;
}

/*
 * The target covering `p`, through this CPU's cache: plain loads on a hit,
 * the cgroup-storage lookup (or ancestry walk) on a miss. sched_switch runs
 * with interrupts off, so nothing else touches this CPU's slots meanwhile.
 * The cache is keyed by the cgroup's serial number, unique for the kernel's
 * lifetime like its ID but one dependent load nearer (in the cgroup itself;
 * the ID is in its kernfs node): this is every switch's cost.
 */
static __always_inline bool cached_target(struct offcpu_cpu *c, struct task_struct *p,
					  __u64 generation, struct ff_target *out)
{
	struct cgroup *cgrp = p->cgroups->dfl_cgrp;
	struct offcpu_cache_slot *slot;
	__u64 id;

	if (!cgrp)
		return false;
	id = cgrp->self.serial_nr;
	slot = &c->cache[id & (OFFCPU_CACHE_SLOTS - 1)];
	if (slot->cgroup == id && slot->generation == generation) {
		*out = slot->target;
		return out->index != 0;
	}
	ff_cgroup_target(cgrp, out);
	slot->cgroup = id;
	slot->generation = generation;
	slot->target = *out;
	return out->index != 0;
}

/* The user stack of `p` (the current task), from the registers saved at its
 * entry into the kernel. */
static __always_inline __u64 user_stack_of(struct task_struct *p, __u32 tgid)
{
	struct pt_regs *regs = (struct pt_regs *)bpf_task_pt_regs(p);
	__u64 ip, sp, bp;

	if (bpf_probe_read_kernel(&ip, sizeof(ip), &regs->ip) ||
	    bpf_probe_read_kernel(&sp, sizeof(sp), &regs->sp) ||
	    bpf_probe_read_kernel(&bp, sizeof(bp), &regs->bp))
		return 0;
	/* One call site: the walker is verified once. */
	return ff_unwind_user(ip, sp, bp, tgid, false);
}

/* `prev` (the current task) blocks: stamp it and walk its user stack. */
static __always_inline void switch_out(struct offcpu_cpu *c, struct task_struct *prev,
				       __u64 generation)
{
	struct offcpu_stamp *st;
	struct ff_target t;
	__u32 tgid;

	if (!cached_target(c, prev, generation, &t))
		return;
	st = bpf_task_storage_get(&stamps, prev, 0, BPF_LOCAL_STORAGE_GET_F_CREATE);
	if (!st) {
		c->stats.stamp_full += 1;
		return;
	}
	tgid = prev->tgid;
	st->target = t.index;
	st->user_stack = 0;
	st->py_stack = 0;
	if (prev->mm && !(prev->flags & PF_KTHREAD)) {
		st->user_stack = user_stack_of(prev, tgid);
		/* After the user stack (the walks share this CPU's scratch). `prev` is
		 * the current task here; its identity is read from it all the same. */
		if (python_frames)
			st->py_stack = ff_py_walk_stack(((__u64)tgid << 32) | (__u32)prev->pid,
							prev->thread.fsbase);
	}
	if (OFFCPU_SCHED_CLOCK)
		st->run_delay = prev->sched_info.run_delay;
	/* Last: a stamp counts only once it is whole. */
	st->out = clock_of(prev);
	c->stats.blocks += 1;
	ff_announce_first(tgid, t.index);
}

static __always_inline void add_counts(struct offcpu_cpu *c, struct offcpu_key *key,
				       __u64 blocked, __u64 queued)
{
	struct offcpu_val *v, one = { .blocked_ns = blocked, .blocks = 1, .queued_ns = queued };

	v = bpf_map_lookup_elem(&counts, key);
	if (!v) {
		if (!bpf_map_update_elem(&counts, key, &one, BPF_NOEXIST))
			return;
		/* Another CPU may have inserted the key meanwhile. */
		v = bpf_map_lookup_elem(&counts, key);
		if (!v) {
			c->stats.counts_full += 1;
			return;
		}
	}
	__sync_fetch_and_add(&v->blocked_ns, blocked);
	__sync_fetch_and_add(&v->blocks, 1);
	__sync_fetch_and_add(&v->queued_ns, queued);
}

/* `next` runs again: if it was blocked, account the block. */
static __always_inline void switch_in(struct offcpu_cpu *c, struct task_struct *next,
				      __u64 generation)
{
	struct offcpu_key key = {};
	struct offcpu_short *sh;
	struct offcpu_stamp *st;
	struct ff_unwind_scratch *s;
	struct ff_target t;
	__u64 out, now, queued_at, delay, blocked, queued = 0;
	long bytes;

	if (!cached_target(c, next, generation, &t))
		return;
	st = bpf_task_storage_get(&stamps, next, 0, 0);
	if (!st || !st->out)
		return;
	out = st->out;
	st->out = 0;
	if (st->target != t.index) {
		/* The target it blocked in was released (and maybe added again
		 * under a new index): its capture is over. */
		c->stats.stale += 1;
		return;
	}
	now = clock_of(next);
	blocked = now > out ? now - out : 0;
	if (OFFCPU_SCHED_CLOCK) {
		queued_at = next->sched_info.last_queued;
		delay = next->sched_info.run_delay - st->run_delay;
		/* Woken at queued_at (on the run-queue clock, as `out`); the
		 * run-queue waits before a migration are already in run_delay. */
		if (queued_at && queued_at >= out + delay) {
			blocked = queued_at - out - delay;
			queued = delay + (now > queued_at ? now - queued_at : 0);
		}
	}
	if (blocked < min_block_ns) {
		sh = bpf_map_lookup_elem(&short_blocks, &t.index);
		if (sh) {
			/* Per-CPU, and sched_switch does not nest on a CPU. */
			sh->blocked_ns += blocked;
			sh->blocks += 1;
			sh->queued_ns += queued;
		}
		c->stats.short_blocks += 1;
		return;
	}
	c->stats.walked += 1;
	key.target = t.index;
	key.tgid = next->tgid;
	key.pid = next->pid;
	key.user_stack = st->user_stack;
	key.py_stack = st->py_stack;
	__builtin_memcpy(key.comm, next->comm, sizeof(key.comm));
	if (capture_kernel_stacks) {
		/* The stopped task's stack, as it blocked: __schedule() and its
		 * callers, down to the system call. */
		s = ff_unwind_percpu_scratch();
		if (s) {
			bytes = bpf_get_task_stack(next, s->stack.pcs, sizeof(s->stack.pcs), 0);
			if (bytes > 0) {
				key.kernel_stack = ff_store_stack(&kernel_stacks, &s->stack,
								  (__u32)bytes / sizeof(__u64));
				if (!key.kernel_stack)
					c->stats.kernel_stack += 1;
			}
		}
	}
	add_counts(c, &key, blocked, queued);
}

SEC("tp_btf/sched_switch")
int BPF_PROG(offcpu_switch, bool preempt, struct task_struct *prev, struct task_struct *next)
{
	struct offcpu_cpu *c = this_cpu();
	__u32 zero = 0;
	__u64 *gen, generation = 0;
	long state;

	if (!c)
		return 0;
	gen = bpf_map_lookup_elem(&target_generation, &zero);
	if (gen)
		generation = *gen;
	/* Blocking, not preempted and not exiting (TASK_DEAD never runs again);
	 * a runnable task waits in the run queue, which is runqlat's. */
	state = ff_task_state_btf(prev);
	if (!preempt && state != TASK_RUNNING && !(state & TASK_DEAD) && prev->pid)
		switch_out(c, prev, generation);
	if (next->pid)
		switch_in(c, next, generation);
	return 0;
}

char LICENSE[] SEC("license") = "GPL";
