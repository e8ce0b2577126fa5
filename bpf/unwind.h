/* SPDX-License-Identifier: (LGPL-2.1 OR BSD-2-Clause) */
/*
 * Types the user-stack unwinder (unwind.bpf.h) shares with user space
 * (node-agent/src/unwind/), exposed through the skeletons' BTF.
 *
 * The agent turns each mapped binary's DWARF CFI (.eh_frame, .debug_frame)
 * into a compact table: sorted rows of (address, how to find the caller's
 * stack pointer, return address and frame pointer), 8 bytes each, in pages of
 * FF_UNWIND_PAGE_ROWS rows. One table per binary (by build ID), shared by
 * every process mapping it; each process gets a short sorted list of its
 * mappings that have a table.
 */
#ifndef FLAMEFLEET_UNWIND_H
#define FLAMEFLEET_UNWIND_H

/* Frames kept per user stack (as the kernel's stack-trace maps). */
#define FF_MAX_FRAMES 127

/* Rows per table page: a page is one 4 KiB array element. */
#define FF_UNWIND_PAGE_ROWS 512

/* Mappings with a table kept per process; beyond, frames walk by frame pointer. */
#define FF_UNWIND_MAX_MAPPINGS 64

/* How the canonical frame address (CFA: the caller's stack pointer) is found. */
enum ff_cfa_kind {
	FF_CFA_NONE = 0,        /* no CFI covers the address: walk by frame pointer */
	FF_CFA_RSP = 1,         /* CFA = rsp + cfa_off */
	FF_CFA_RBP = 2,         /* CFA = rbp + cfa_off */
	FF_CFA_PLT = 3,         /* PLT stub: CFA = rsp + 8 + ((rip & 15) >= cfa_off ? 8 : 0) */
	FF_CFA_DEREF_RBP = 4,   /* stack realignment: CFA = *(rbp + cfa_off) */
	FF_CFA_END = 5,         /* return address undefined: outermost frame */
	FF_CFA_UNSUPPORTED = 6, /* a rule the BPF walker cannot evaluate: stop */
	/* Go's runtime.mcall, at the bottom of a thread's scheduler (g0) stack: the
	 * goroutine it switched away from is at sp + 8 * rbp_off, its saved sp and
	 * pc at that goroutine + cfa_off (g.sched). Off-CPU walks continue on the
	 * goroutine's stack (ff_go_park_stitch); others end here. */
	FF_CFA_GO_MCALL = 7,
};

/* `kind` bit: after this frame the caller's rbp is unknown (saved out of range). */
#define FF_RBP_LOST 0x10
#define FF_CFA_KIND_MASK 0x0f

/* One unwind rule, valid from `pc` up to the next row's `pc`. */
struct ff_unwind_row {
	__u32 pc;      /* ELF virtual address (binaries' text lies below 4 GiB) */
	__s16 cfa_off; /* see enum ff_cfa_kind */
	__u8 kind;     /* enum ff_cfa_kind | FF_RBP_LOST */
	__s8 rbp_off;  /* caller's rbp saved at CFA + 8 * rbp_off; 0: rbp unchanged */
};

/* One element of a table's inner array map. Unused rows of the last page have
 * pc = 0xffffffff. */
struct ff_unwind_page {
	struct ff_unwind_row rows[FF_UNWIND_PAGE_ROWS];
};

/* A process's executable mapping that has a table. */
struct ff_unwind_mapping {
	__u64 start;    /* first address */
	__u64 end;      /* one past the last address */
	__u64 bias;     /* runtime address - ELF virtual address */
	__u32 table;    /* key in `unwind_tables` (never reused while the agent runs) */
	__u32 pages;    /* pages in that table */
};

/* Value of `unwind_procs` (key: tgid): mappings sorted by `start`. */
struct ff_unwind_proc {
	__u32 count;
	__u32 flags;
	struct ff_unwind_mapping maps[FF_UNWIND_MAX_MAPPINGS];
};

/* A user stack, leaf first, zero-terminated when shorter than FF_MAX_FRAMES. */
struct ff_user_stack {
	__u64 pcs[FF_MAX_FRAMES];
};

/* Counters in the per-CPU `unwind_stats` array. */
enum ff_unwind_stat {
	FF_UW_STACKS = 0,        /* user stacks walked */
	FF_UW_FRAMES_CFI = 1,    /* frames unwound with a CFI table */
	FF_UW_FRAMES_FP = 2,     /* frames unwound by frame pointer */
	FF_UW_NO_PROC = 3,       /* stacks of processes with no tables (yet): frame pointers only */
	FF_UW_UNSUPPORTED = 4,   /* stacks stopped at a CFI rule the walker cannot evaluate */
	FF_UW_READ_FAILED = 5,   /* stacks stopped at unreadable stack memory */
	FF_UW_TRUNCATED = 6,     /* stacks cut at FF_MAX_FRAMES */
	FF_UW_TABLE_MISSING = 7, /* frames whose table was evicted: frame pointer used */
	FF_UW_STACK_LOST = 8,    /* stack not stored: `user_stacks` full */
	FF_UW_BAD_STEP = 9,      /* stacks stopped because the stack pointer did not grow */
	FF_UW_GO_PARKED = 10,    /* stacks continued on the goroutine that parked (FF_CFA_GO_MCALL) */
	FF_UW_STAT_MAX = 11,
};

#endif
