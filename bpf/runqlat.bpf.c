// SPDX-License-Identifier: GPL-2.0
/*
 * Run-queue latency of the tasks of the target cgroups: the time from
 * becoming runnable (wakeup, new task, preemption) to running, as log2
 * histograms kept in the kernel. Unlike libbpf-tools' runqlat -c, which tests
 * the cgroup of the *current* task (the waker), we attribute each wait to the
 * cgroup of the task that waits.
 *
 * Four program sets; user space loads one (set_autoload) and falls back to
 * the next when the kernel refuses it:
 *
 * 0. hybrid (switch_hybrid, the default): the scheduler's queue stamps as in
 *    1, with the end of a wait read from the clock where the run-queue clock
 *    is stale (after a wakeup preemption). Same accuracy as 2, one program.
 * 1. sched_info (switch_queued): no timestamp of our own and no wakeup
 *    program. The scheduler already stamps every task it queues
 *    (task->sched_info.last_queued, in rq clock, CONFIG_SCHED_INFO) and adds
 *    each wait to task->sched_info.run_delay when the task arrives on a CPU,
 *    in prepare_task_switch(), after the sched_switch tracepoint. So at
 *    sched_switch the wait that ends is the CPU's rq->clock (already
 *    updated by __schedule) minus next's last_queued: one program on one
 *    tracepoint, plain loads, no clock read (bpf_ktime_get_ns is the most
 *    expensive step of a runqlat on a VM, see docs/benchmarks.md). A wait
 *    split by a migration (dequeued on one CPU, queued again on another)
 *    was partly added to run_delay already; task storage keeps run_delay
 *    and pcount as of the task's last arrival we saw, so the wait is the
 *    growth of run_delay since then. This is the kernel's own accounting,
 *    the run_delay of /proc/PID/schedstat.
 * 2. task storage (wakeup_task, wakeup_new_task, switch_task): our own
 *    bpf_ktime_get_ns timestamp at wakeup and preemption, kept in task
 *    storage (Linux 5.11+).
 * 3. hash map (raw tracepoints, start times keyed by thread ID, entries
 *    removed when the thread exits), for kernels without task storage.
 *
 * Everywhere the target lookup is one cgroup-storage hit (targets.bpf.h) and
 * the histogram a per-CPU array slot indexed by the target (no hash map, no
 * atomics). Only per-process histograms, asked for explicitly, use a hash map.
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

/* Per-target histograms: element i belongs to target index i. */
struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1024);
	__type(key, __u32);
	__type(value, struct runqlat_slots);
} target_hists SEC(".maps");

/* Per-process histograms, for targets with FF_TARGET_PER_PROCESS. */
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

/* Adds one wait of `delta` ns to the histogram `s` names. `tgid` and `comm`
 * are only read for per-process histograms. */
static __always_inline void record(const struct runqlat_start *s, __s64 delta, __u32 tgid,
				   const char *comm)
{
	struct runqlat_key key = { .target = s->target };
	struct runqlat_slots *slots;
	struct runqlat_hist *h;
	__u32 slot;

	if (delta < 0)
		return;
	slot = log2_slot((__u64)delta / ((s->flags & FF_TARGET_UNIT_MS) ? 1000000U : 1000U));
	if (!(s->flags & FF_TARGET_PER_PROCESS)) {
		slots = bpf_map_lookup_elem(&target_hists, &key.target);
		if (!slots) {
			count_drop(hists_full);
			return;
		}
		/* Per-CPU element, and tracing programs do not nest on one CPU
		 * for the same tracepoint: a plain increment is exact. */
		slots->slots[slot] += 1;
		return;
	}
	key.tgid = tgid;
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
		bpf_probe_read_kernel_str(h->comm, sizeof(h->comm), comm);
	__sync_fetch_and_add(&h->slots[slot], 1);
}

/* ---- sched_info variant: the scheduler's own timestamps ---- */

/* A task's run_delay and pcount once its last arrival we saw is counted. */
struct runqlat_seen {
	__u64 delay;
	__u64 pcount;
};

struct {
	__uint(type, BPF_MAP_TYPE_TASK_STORAGE);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, int);
	__type(value, struct runqlat_seen);
} seen_task SEC(".maps");

SEC("tp_btf/sched_switch")
int BPF_PROG(switch_queued, bool preempt, struct task_struct *prev, struct task_struct *next)
{
	struct runqlat_start s = {};
	struct runqlat_seen *seen;
	struct ff_target t;
	struct rq *rq;
	__u64 queued, now, delay, wait, pcount;

	/* 0 for a task that is not waiting (the idle task, a task put back
	 * without accounting): sched_info_arrive() ignores those too. */
	queued = next->sched_info.last_queued;
	if (!queued || !next->pid || !ff_task_target(next, &t))
		return 0;
	/* next's run queue is this CPU's (set_task_rq() keeps se.cfs_rq on the
	 * task's CPU). Through the task rather than the per-CPU `runqueues`
	 * ksym, which kernels without CONFIG_KALLSYMS_ALL cannot resolve; the
	 * cfs_rq's rq field needs CONFIG_FAIR_GROUP_SCHED, which container
	 * CPU limits need anyway (without it this set fails to load and user
	 * space falls back to the next). */
	rq = next->se.cfs_rq->rq;
	if (!rq)
		return 0;
	now = rq->clock;
	if (now < queued)
		return 0;
	wait = now - queued;
	pcount = next->sched_info.pcount;
	/* run_delay as sched_info_arrive() is about to leave it. */
	delay = next->sched_info.run_delay + wait;
	seen = bpf_task_storage_get(&seen_task, next, 0, BPF_LOCAL_STORAGE_GET_F_CREATE);
	if (seen) {
		/* Consecutive arrivals: the whole wait, including parts spent
		 * queued on another CPU before a migration. Otherwise (first
		 * sight, or arrivals while the task was not a target) only this
		 * CPU's part is known. */
		if (seen->pcount && seen->pcount == pcount && delay >= seen->delay)
			wait = delay - seen->delay;
		seen->delay = delay;
		seen->pcount = pcount + 1;
	}
	s.target = t.index;
	s.flags = t.flags;
	record(&s, (__s64)wait, next->tgid, next->comm);
	return 0;
}

/* ---- hybrid variant (default): the scheduler's stamps, checked ---- */

/* Per-task baselines; a power of two. Threads whose IDs are equal modulo this
 * share a slot (the tag tells them apart; a lost baseline costs only the
 * whole-wait view of one migrated wait). */
#define RUNQLAT_SEEN_SLOTS 32768
/* The clock calibration: at most one sample per CPU per SAMPLE_NS, and the
 * offset is the minimum over an epoch (a stale sample only overstates it). */
#define RUNQLAT_CAL_SAMPLE_NS (500ULL * 1000)
#define RUNQLAT_CAL_EPOCH_NS (4ULL * 1000 * 1000)

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct runqlat_cpu);
} rq_cpu SEC(".maps");

/* Mappable only for its layout: the values of a mappable array start on a page
 * boundary, so each 64-byte slot is one cache line of its own. */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, RUNQLAT_SEEN_SLOTS);
	__uint(map_flags, BPF_F_MMAPABLE);
	__type(key, __u32);
	__type(value, struct runqlat_seen_slot);
} seen_slots SEC(".maps");

_Static_assert(sizeof(struct runqlat_seen_slot) == 64, "one cache line per baseline");

/*
 * The end of a wait on a CPU that was idle, without a clock read: PSI's stamp.
 * __schedule() calls psi_task_switch() just before the sched_switch
 * tracepoint; when `prev` is the idle task it marks `next` on this CPU in
 * each of next's cgroups' PSI groups and stamps their per-CPU state with the
 * same cpu_clock() reading (psi_group_cpu.state_start), on the run-queue
 * clock's time base. So for a task leaving an idle CPU, its cgroup's PSI
 * state on this CPU holds the time of this very switch, a few hundred ns
 * before this program runs. Used only when the group is enabled, marked on
 * CPU, and stamped no earlier than the run-queue clock; checked against the
 * clock once per RUNQLAT_PSI_CHECK_NS per CPU, and abandoned on this CPU
 * after RUNQLAT_PSI_MAX_REJECTS failed checks. Kernels without PSI (or with
 * it off: psi=0, cgroup_disable=pressure) never pass the checks and read the
 * clock as before.
 */
#define RUNQLAT_PSI_CHECK_NS (500ULL * 1000)
#define RUNQLAT_PSI_SLACK_NS (50ULL * 1000)
#define RUNQLAT_PSI_MAX_REJECTS 4
#define RUNQLAT_PSI_IDLE_SKIPS 64

extern void *bpf_rdonly_cast(const void *obj, __u32 btf_id) __ksym __weak;

/* Off with --runqlat-clock hybrid-no-psi. */
const volatile bool ff_runqlat_psi = true;

/* Known when the program is loaded, so that on a kernel without PSI (or
 * without bpf_rdonly_cast, Linux 6.2) the code using it is dead and its
 * unresolved relocations never reached. */
#define FF_PSI_USABLE                                                          \
	(ff_runqlat_psi && bpf_ksym_exists(bpf_rdonly_cast) &&                 \
	 bpf_core_field_exists(struct cgroup, psi) &&                          \
	 bpf_core_field_exists(struct psi_group, enabled) &&                   \
	 bpf_core_type_exists(struct psi_group_cpu) &&                         \
	 bpf_core_enum_value_exists(enum psi_states, NR_PSI_STATES))

/* This CPU's per-CPU offset, from our own per-CPU map: its element for this
 * CPU minus the per-CPU address the map keeps for it. */
static __always_inline bool psi_pcpu_off(struct runqlat_cpu *c)
{
	struct bpf_array *arr;
	void *base = NULL;

	if (c->pcpu_state)
		return c->pcpu_state == 1;
	c->pcpu_state = 2;
	if (!FF_PSI_USABLE)
		return false;
	/* The verifier refuses loads past struct bpf_array, where pptrs[] is. */
	arr = bpf_rdonly_cast(&rq_cpu, bpf_core_type_id_kernel(struct bpf_array));
	if (bpf_probe_read_kernel(&base, sizeof(base), &arr->pptrs[0]) || !base)
		return false;
	/* The element's address as a number: stored and read back (a pointer
	 * minus a number stays a pointer to the verifier). */
	c->pcpu_off = (__s64)(long)c;
	c->pcpu_off = *(volatile __s64 *)&c->pcpu_off - (__s64)(long)base;
	c->pcpu_state = 1;
	return true;
}

/* The address of this CPU's PSI state of `cgrp` (0: none to use), for the
 * target cache: computed on a miss, then one load per switch. A cgroup that
 * turns its pressure accounting off later stops stamping, which the stamp
 * check (no earlier than the queue) catches. */
static __always_inline __u64 psi_state_addr(struct runqlat_cpu *c, struct cgroup *cgrp)
{
	struct psi_group *g;

	if (!FF_PSI_USABLE || !psi_pcpu_off(c))
		return 0;
	g = cgrp->psi;
	if (!g || !g->enabled)
		return 0;
	/* A per-CPU address as a number, the same way (see psi_pcpu_off). */
	c->psi_pcpu = (__u64)(long)g->pcpu;
	return *(volatile __u64 *)&c->psi_pcpu + c->pcpu_off;
}

/*
 * The target covering `p`, through this CPU's cache: plain loads on a hit,
 * the cgroup-storage lookup (or ancestry walk) on a miss. Only sched_switch
 * uses it, with interrupts off, so nothing else touches this CPU's slots
 * meanwhile.
 */
static __always_inline bool hybrid_target(struct runqlat_cpu *c, struct task_struct *p,
					  __u64 generation, struct ff_target *out, __u64 *psi)
{
	struct cgroup *cgrp = p->cgroups->dfl_cgrp;
	struct runqlat_cache_slot *slot;
	__u64 id;

	if (!cgrp)
		return false;
	id = cgrp->kn->id;
	slot = &c->cache[id & (RUNQLAT_CACHE_SLOTS - 1)];
	if (slot->cgroup == id && slot->generation == generation) {
		*out = slot->target;
		if (psi)
			*psi = slot->psi;
		return out->index != 0;
	}
	ff_cgroup_target(cgrp, out);
	slot->cgroup = id;
	slot->generation = generation;
	slot->target = *out;
	slot->psi = out->index ? psi_state_addr(c, cgrp) : 0;
	if (psi)
		*psi = slot->psi;
	return out->index != 0;
}

/* A calibration sample: `clock` is the run-queue clock, just updated. */
static __always_inline void hybrid_calibrate(struct runqlat_cpu *c, __u64 clock, __u64 ktime)
{
	__s64 cand = (__s64)(ktime - clock);

	if (!c->epoch_start || clock - c->epoch_start >= RUNQLAT_CAL_EPOCH_NS) {
		c->offset = c->epoch_start ? c->epoch_min : cand;
		c->epoch_min = cand;
		c->epoch_start = clock;
	} else if (cand < c->epoch_min) {
		c->epoch_min = cand;
	}
}

/* `ktime` on the run-queue clock's time base (this CPU must be calibrated). */
static __always_inline __u64 hybrid_convert(struct runqlat_cpu *c, __u64 ktime)
{
	return ktime - (c->offset < c->epoch_min ? c->offset : c->epoch_min);
}

/* Now, on the run-queue clock's time base, when the clock itself is stale. */
static __always_inline __u64 hybrid_now(struct runqlat_cpu *c, __u64 clock)
{
	__u64 ktime = bpf_ktime_get_ns(), now;

	c->clock_reads += 1;
	if (!c->epoch_start) {
		c->uncalibrated += 1;
		return clock;
	}
	now = hybrid_convert(c, ktime);
	return now > clock ? now : clock;
}

static __always_inline bool psi_now(struct runqlat_cpu *c, __u64 gc_addr, __u64 clock,
				    __u64 *out)
{
	struct psi_group_cpu *gc;
	__u64 stamp, now, ktime;

	if (!FF_PSI_USABLE || !gc_addr || c->pcpu_state != 1)
		return false;
	gc = bpf_rdonly_cast((void *)gc_addr, bpf_core_type_id_kernel(struct psi_group_cpu));
	if (!gc || !(gc->state_mask & (1U << bpf_core_enum_value(enum psi_states, NR_PSI_STATES))))
		return false;
	stamp = gc->state_start;
	if (stamp < clock)
		return false;
	if (clock - c->last_psi_check >= RUNQLAT_PSI_CHECK_NS) {
		c->last_psi_check = clock;
		c->psi_checks += 1;
		ktime = bpf_ktime_get_ns();
		if (c->epoch_start) {
			now = hybrid_convert(c, ktime);
			if (stamp > now + RUNQLAT_PSI_SLACK_NS || stamp + RUNQLAT_PSI_SLACK_NS < now) {
				c->psi_rejects += 1;
				c->clock_reads += 1;
				if (c->psi_rejects >= RUNQLAT_PSI_MAX_REJECTS)
					c->pcpu_state = 2;
				*out = now > clock ? now : clock;
				return true;
			}
		}
		/* A checked stamp is also the best calibration sample there is: a
		 * fresh reading of the run-queue clock's source, a few hundred ns
		 * before this one (the run-queue clock itself was updated before
		 * the pick of the next task, idle balancing included). */
		hybrid_calibrate(c, stamp, ktime);
	}
	c->psi_stamps += 1;
	c->psi_recent = RUNQLAT_PSI_IDLE_SKIPS;
	*out = stamp;
	return true;
}

static __always_inline struct runqlat_seen_slot *seen_slot(struct task_struct *p)
{
	__u32 i = (__u32)p->pid & (RUNQLAT_SEEN_SLOTS - 1);

	return bpf_map_lookup_elem(&seen_slots, &i);
}

/*
 * sched_switch only. The scheduler stamps a task when it queues it
 * (sched_info.last_queued, on the run-queue clock) and __schedule() updates
 * that clock before picking `next`, except after a wakeup preemption (a
 * wakeup that found the CPU busy or idle and asked for a reschedule): then the
 * clock still reads the time of that wakeup. That is the case where the
 * scheduler's own accounting reads a wait short, by the time from the wakeup
 * to the switch. It is recognised by `prev` being the idle task or by the
 * clock still equal to next's queue stamp, and only then is the clock read
 * (bpf_ktime_get_ns, on this CPU's calibration). One program, no wakeup hook,
 * no helper call on a warm path with a current clock.
 *
 * A wait split by a migration (dequeued on one CPU, queued again on another)
 * is whole: run_delay already holds the part before the migration, and the
 * task's baseline from its last arrival tells how much of it is this wait's.
 * A task preempted while the clock was stale gets a queue stamp that early;
 * its baseline remembers by how much (`fix`).
 */
SEC("tp_btf/sched_switch")
int BPF_PROG(switch_hybrid, bool preempt, struct task_struct *prev, struct task_struct *next)
{
	struct runqlat_seen_slot *seen;
	struct runqlat_start s = {};
	struct runqlat_cpu *c;
	struct ff_target t;
	__u64 queued, clock, now, wait, delay, pcount, tag, generation = 0, *gen, psi = 0;
	__u32 zero = 0;
	struct rq *rq;
	bool stale, have_now;

	c = bpf_map_lookup_elem(&rq_cpu, &zero);
	if (!c)
		return 0;
	/* To idle: no wait ends, and no task is preempted (a preempted task
	 * stays runnable, so idle would not be picked). Half of all switches on
	 * a mostly idle node. While PSI stamps are in use on this CPU their
	 * checks calibrate the clock, so nothing is left to do: each stamp used
	 * allows the next RUNQLAT_PSI_IDLE_SKIPS switches to idle to return here.
	 * Elsewhere (PSI off, or no longer used here) a calibration sample is
	 * taken when one is due, as before. */
	if (!next->pid && c->psi_recent) {
		c->psi_recent -= 1;
		return 0;
	}
	/* This CPU's run queue (see switch_queued). */
	rq = next->se.cfs_rq->rq;
	if (!rq)
		return 0;
	clock = rq->clock;
	if (!next->pid) {
		if (prev->pid && clock - c->last_sample >= RUNQLAT_CAL_SAMPLE_NS) {
			c->last_sample = clock;
			hybrid_calibrate(c, clock, bpf_ktime_get_ns());
		}
		return 0;
	}
	queued = next->sched_info.last_queued;
	stale = !prev->pid || clock == queued;
	have_now = !stale;
	now = clock;
	if (!stale && clock - c->last_sample >= RUNQLAT_CAL_SAMPLE_NS) {
		c->last_sample = clock;
		hybrid_calibrate(c, clock, bpf_ktime_get_ns());
	}
	gen = bpf_map_lookup_elem(&target_generation, &zero);
	if (gen)
		generation = *gen;

	if (queued && hybrid_target(c, next, generation, &t, &psi)) {
		if (!have_now) {
			if (prev->pid || !psi_now(c, psi, clock, &now))
				now = hybrid_now(c, clock);
			have_now = true;
		}
		/* What the kernel adds to run_delay at this arrival. */
		delay = next->sched_info.run_delay + (clock > queued ? clock - queued : 0);
		wait = now > queued ? now - queued : 0;
		pcount = next->sched_info.pcount;
		tag = next->start_time;
		seen = seen_slot(next);
		if (seen) {
			if (seen->tag == tag && seen->pcount == pcount && delay >= seen->delay &&
			    delay - seen->delay <= clock - next->sched_info.last_arrival) {
				__u64 whole = delay - seen->delay + (now - clock);

				if (whole > wait + 1000)
					c->split += 1;
				wait = whole;
				wait = wait > seen->fix ? wait - seen->fix : 0;
			}
			seen->tag = tag;
			seen->pcount = pcount + 1;
			seen->delay = delay;
			seen->fix = 0;
		}
		c->waits += 1;
		if (!prev->pid)
			c->after_idle += 1;
		s.target = t.index;
		s.flags = t.flags;
		record(&s, (__s64)wait, next->tgid, next->comm);
	}

	/* prev preempted on a stale clock: the kernel stamps it with that clock,
	 * not with now. Only a wakeup preemption leaves the clock stale, and only
	 * then does a running prev get here. */
	if (stale && prev->pid && ff_task_state_btf(prev) == TASK_RUNNING &&
	    hybrid_target(c, prev, generation, &t, NULL)) {
		if (!have_now)
			now = hybrid_now(c, clock);
		seen = seen_slot(prev);
		if (seen) {
			tag = prev->start_time;
			pcount = prev->sched_info.pcount;
			if (seen->tag != tag || seen->pcount != pcount) {
				seen->tag = tag;
				seen->pcount = pcount;
				seen->delay = prev->sched_info.run_delay;
			}
			seen->fix = now - clock;
		}
	}
	return 0;
}

/* ---- task storage variant (BTF tracepoints) ---- */

static __always_inline void enqueue_task(struct task_struct *p, __u64 now)
{
	struct runqlat_start *s;
	struct ff_target t;

	if (!p->pid || !ff_task_target(p, &t))
		return;
	s = bpf_task_storage_get(&start_task, p, 0, BPF_LOCAL_STORAGE_GET_F_CREATE);
	if (!s) {
		count_drop(start_full);
		return;
	}
	s->ts = now;
	s->target = t.index;
	s->flags = t.flags;
}

SEC("tp_btf/sched_wakeup")
int BPF_PROG(wakeup_task, struct task_struct *p)
{
	enqueue_task(p, bpf_ktime_get_ns());
	return 0;
}

SEC("tp_btf/sched_wakeup_new")
int BPF_PROG(wakeup_new_task, struct task_struct *p)
{
	enqueue_task(p, bpf_ktime_get_ns());
	return 0;
}

SEC("tp_btf/sched_switch")
int BPF_PROG(switch_task, bool preempt, struct task_struct *prev, struct task_struct *next)
{
	struct runqlat_start *s;
	__u64 ts, now = 0;

	/* One clock read serves both ends of the switch. */
	if (ff_task_state_btf(prev) == TASK_RUNNING) {
		now = bpf_ktime_get_ns();
		enqueue_task(prev, now);
	}
	s = bpf_task_storage_get(&start_task, next, 0, 0);
	if (!s || !s->ts)
		return 0;
	ts = s->ts;
	s->ts = 0;
	if (!now)
		now = bpf_ktime_get_ns();
	record(s, now - ts, next->tgid, next->comm);
	return 0;
}

/* ---- hash-map fallback (raw tracepoints) ---- */

static __always_inline void enqueue_hash(struct task_struct *p)
{
	struct runqlat_start s;
	struct ff_target t;
	__u32 pid = BPF_CORE_READ(p, pid);

	if (!pid || !ff_task_target_raw(p, &t))
		return;
	s.ts = bpf_ktime_get_ns();
	s.target = t.index;
	s.flags = t.flags;
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
	struct runqlat_start *s, copy;
	__u32 pid;

	if (ff_task_state(prev) == TASK_RUNNING)
		enqueue_hash(prev);
	pid = BPF_CORE_READ(next, pid);
	s = bpf_map_lookup_elem(&start_hash, &pid);
	if (!s)
		return 0;
	copy = *s;
	bpf_map_delete_elem(&start_hash, &pid);
	record(&copy, bpf_ktime_get_ns() - copy.ts, BPF_CORE_READ(next, tgid),
	       (const char *)__builtin_preserve_access_index(&next->comm));
	return 0;
}

/*
 * A thread that was woken while running (a signal, say) and then exits is
 * never switched in again: without this its start entry would stay until the
 * map fills. Task storage needs no such hook (it is freed with the task).
 */
SEC("raw_tp/sched_process_exit")
int BPF_PROG(exit_hash, struct task_struct *p)
{
	__u32 pid = BPF_CORE_READ(p, pid);

	bpf_map_delete_elem(&start_hash, &pid);
	return 0;
}

char LICENSE[] SEC("license") = "GPL";
