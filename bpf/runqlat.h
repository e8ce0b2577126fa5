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

#endif
