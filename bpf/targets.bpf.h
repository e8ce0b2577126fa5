/* SPDX-License-Identifier: (LGPL-2.1 OR BSD-2-Clause) */
/*
 * The target map every sampler filters on: cgroup v2 ID -> struct ff_target.
 * User space sizes it with set_max_entries() before load and fills it while
 * the programs run; a sample outside these cgroups costs one hash lookup.
 */
#ifndef FLAMEFLEET_TARGETS_BPF_H
#define FLAMEFLEET_TARGETS_BPF_H

#include "targets.h"

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 1024);
	__type(key, __u64);
	__type(value, struct ff_target);
} targets SEC(".maps");

/* Process notifications for the symbolizer (struct ff_proc_event records). */
struct {
	__uint(type, BPF_MAP_TYPE_RINGBUF);
	__uint(max_entries, 256 * 1024);
} proc_events SEC(".maps");

/* Never written: only makes the record type part of the BTF, so the
 * skeleton generates it for user space. */
struct ff_proc_event ff_proc_event_layout SEC(".bss");

static __always_inline struct ff_target *ff_target_of(__u64 cgroup_id)
{
	return bpf_map_lookup_elem(&targets, &cgroup_id);
}

#endif
