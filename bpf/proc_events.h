/* SPDX-License-Identifier: (LGPL-2.1 OR BSD-2-Clause) */
/* The process records samplers send user space (bpf/proc_events.bpf.h), exposed by the
 * skeletons. */
#ifndef FLAMEFLEET_PROC_EVENTS_H
#define FLAMEFLEET_PROC_EVENTS_H

#include "targets.h"

/* Why a process notification was sent. */
enum ff_proc_event_kind {
	FF_PROC_FIRST_SEEN = 1,
	FF_PROC_EXEC = 2,
};

/*
 * Ring-buffer record asking user space to snapshot /proc/<tgid>/maps while the
 * process is still alive, so that short-lived processes can be symbolized.
 */
struct ff_proc_event {
	__u32 tgid;
	__u32 kind;
	__u32 target;
	char comm[FF_COMM_LEN];
};

#endif
