/* SPDX-License-Identifier: (LGPL-2.1 OR BSD-2-Clause) */
/* Types runqlat shares with user space (exposed by its skeleton). */
#ifndef FLAMEFLEET_RUNQLAT_H
#define FLAMEFLEET_RUNQLAT_H

#include "targets.h"

/* log2 slots; slot i counts latencies in [2^i, 2^(i+1)) units (slot 0: [0, 2)). */
#define RUNQLAT_SLOTS 27

/* Per-process histograms (FF_TARGET_PER_PROCESS): one per (target, process). */
struct runqlat_key {
	__u32 target;
	__u32 tgid;
};

struct runqlat_hist {
	__u64 slots[RUNQLAT_SLOTS];
	char comm[FF_COMM_LEN];
};

/* Per-target histogram, one per CPU (element = target index). */
struct runqlat_slots {
	__u64 slots[RUNQLAT_SLOTS];
};

/* When a task became runnable, and for which target. */
struct runqlat_start {
	__u64 ts;
	__u32 target;
	__u32 flags;
};

/* Loss counters (one per CPU, summed by user space); never silent. */
struct runqlat_drops {
	__u64 hists_full;  /* histogram map full (or target index beyond it): event lost */
	__u64 start_full;  /* start map full (hash fallback) or no task storage: event lost */
};

/*
 * Hybrid variant (the default): per-CPU state. The cache maps a cgroup to the
 * target covering it (or none) without a helper call; the calibration turns
 * bpf_ktime_get_ns() into the run-queue clock's time base; the counters say
 * how often the run-queue clock could not be used (bpf/runqlat.bpf.c).
 */
#define RUNQLAT_CACHE_SLOTS 16

struct runqlat_cache_slot {
	__u64 cgroup;     /* cgroup ID; 0: empty */
	__u64 generation; /* of the target map, when this slot was filled */
	struct ff_target target;
	__u64 psi;        /* this CPU's PSI state of the cgroup (runqlat.bpf.c); 0: none */
};

struct runqlat_cpu {
	struct runqlat_cache_slot cache[RUNQLAT_CACHE_SLOTS];
	__s64 offset;      /* ktime - rq clock: minimum of the last full epoch */
	__s64 epoch_min;   /* minimum of the current epoch */
	__u64 epoch_start; /* rq clock when the current epoch began; 0: never sampled */
	__u64 last_sample; /* rq clock of the last calibration sample */
	__u64 waits;        /* waits recorded */
	__u64 after_idle;   /* of those, ended on a CPU that was idle (prev the idle task) */
	__u64 clock_reads;  /* waits whose end was read from the clock (rq clock stale) */
	__u64 uncalibrated; /* of those, before this CPU had a calibration sample */
	__u64 split;        /* waits split by a migration, counted whole */
	__u64 psi_stamps;   /* waits after idle whose end was PSI's switch stamp (no clock read) */
	__u64 psi_checks;   /* PSI stamps checked against the clock */
	__u64 psi_rejects;  /* of those, too far from it: the clock was used */
	__s64 pcpu_off;     /* this CPU's per-CPU offset (pcpu_state 1) */
	__u32 pcpu_state;   /* 0: not known yet, 1: known, 2: unusable (PSI stamps off) */
	__u32 psi_recent;   /* switches to idle that may still skip calibration (see switch_hybrid) */
	__u64 last_psi_check; /* rq clock of the last check */
	__u64 psi_pcpu;       /* scratch: a per-CPU address as a number */
};

/* Per-task baseline of the hybrid variant, in a direct-mapped array indexed by
 * thread ID (tagged with the task's start time). One cache line per slot: the
 * threads of one process have neighbouring IDs and run on different CPUs, and
 * two baselines in one line made every arrival of either thread pull the line
 * from the other CPU (on `perf bench sched pipe` that alone cost more than the
 * rest of the program). */
struct runqlat_seen_slot {
	__u64 tag;    /* task start time; 0: empty */
	__u64 pcount; /* sched_info.pcount expected at the task's next arrival */
	__u64 delay;  /* sched_info.run_delay as of the task's last arrival */
	__u64 fix;    /* ns by which the kernel's queue stamp of this wait is early */
	__u64 pad[4]; /* to 64 bytes */
};

#endif
