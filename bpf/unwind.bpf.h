/* SPDX-License-Identifier: (LGPL-2.1 OR BSD-2-Clause) */
/*
 * User-stack walker for code with or without frame pointers (x86-64).
 *
 * Each frame's address is looked up in the process's mappings that have a
 * CFI table (`unwind_procs`), then in that binary's table (`unwind_tables`:
 * a hash of per-binary arrays of 4 KiB pages of sorted rows; two binary
 * searches), unless this CPU's row cache (`unwind_row_cache`) holds the row
 * for that table and address. The row says how to find the caller's stack
 * pointer (CFA), return address (CFA - 8) and frame pointer. Frames without a
 * table (JIT code, a process the agent has not registered yet, a binary over
 * the memory budget) take a frame-pointer step instead, so the walk degrades
 * to what the kernel's frame-pointer walk gives, never to less.
 *
 * The tables and process entries are created by user space and shared by
 * every program including this header (the agent reuses the same map fds in
 * each BPF object). The stack itself goes to `user_stacks`, keyed by a 64-bit
 * hash of its frames (ff_store_stack).
 *
 * The frame loop runs under bpf_loop() (Linux 5.17+) so the verifier checks
 * one frame, not FF_MAX_FRAMES copies of it. So do the searches for a frame's
 * mapping and page: unrolled, each of their paths reached the rest of the frame
 * with its own bounds on lo and hi (the array index makes them precise), and the
 * verifier walked 74k instructions (150 ms) to load the CPU sampler; with them
 * as callbacks it walks about 26k (60 ms). A frame in the same mapping as its
 * callee skips the mapping search.
 */
#ifndef FLAMEFLEET_UNWIND_BPF_H
#define FLAMEFLEET_UNWIND_BPF_H

#include "unwind.h"

#ifndef EEXIST
#define EEXIST 17
#endif
#define FF_BPF_F_INNER_MAP (1U << 12)

/* Page arrays of one binary; their sizes differ, hence BPF_F_INNER_MAP. */
struct ff_unwind_pages {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(map_flags, FF_BPF_F_INNER_MAP);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct ff_unwind_page);
};

/* Table ID -> that binary's pages. Created and filled by user space. */
struct {
	__uint(type, BPF_MAP_TYPE_HASH_OF_MAPS);
	__uint(max_entries, 4096);
	__type(key, __u32);
	__array(values, struct ff_unwind_pages);
} unwind_tables SEC(".maps");

/* tgid -> mappings with tables. Created and filled by user space. */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 1024);
	__type(key, __u32);
	__type(value, struct ff_unwind_proc);
} unwind_procs SEC(".maps");

/* Stack hash -> stack; sized by user space. */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 16384);
	__type(key, __u64);
	__type(value, struct ff_user_stack);
} user_stacks SEC(".maps");

/* State of one walk. Per CPU for programs that cannot be preempted (perf
 * events); per task for those that can (uprobes run with migration, not
 * preemption, disabled: two threads could share a CPU's scratch). */
struct ff_unwind_scratch {
	struct ff_user_stack stack;
	__u64 pc, sp, bp;
	__u32 n;
	__u32 ret0; /* the first pc is a return address (a return probe) */
	/* The bounded walk's search bounds and mapping hint (ff_walk_frames_bounded). */
	__u32 lo, hi, hint, pad;
};

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct ff_unwind_scratch);
} unwind_scratch SEC(".maps");

/* The per-task scratch (task storage, Linux 5.11+), for programs that can be preempted;
 * user space does not create it where ff_unwind_per_task is false. */
struct {
	__uint(type, BPF_MAP_TYPE_TASK_STORAGE);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, int);
	__type(value, struct ff_unwind_scratch);
} unwind_task_scratch SEC(".maps");

/* Set before load: walks use the current task's scratch instead of this CPU's. */
const volatile bool ff_unwind_per_task = false;

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, FF_UW_STAT_MAX);
	__type(key, __u32);
	__type(value, __u64);
} unwind_stats SEC(".maps");

/*
 * Rows found, remembered per CPU by (table, address). A profiler samples hot code at the
 * same few addresses again and again; a hit replaces the table's lookup and both binary
 * searches (over a dozen cache lines, most of them cold at a profiler's rates: each step
 * of the page search reads a line of another page) with one line. Table IDs are not
 * reused while the agent runs and a loaded table never changes, so an entry is never
 * stale. Direct-mapped: a slot keeps the last row hashed to it. One array element per
 * CPU, so that a walk looks it up once and each frame then touches its slot alone. Per
 * CPU, so only walks that cannot be preempted use it (ff_unwind_per_task walks do not),
 * and only under bpf_loop() (the bounded walk of older kernels keeps its verified size).
 */
#define FF_ROW_CACHE_SLOTS 1024

struct ff_row_cache_slot {
	__u32 table; /* 0: empty (table IDs start at 1) */
	__u32 addr;
	struct ff_unwind_row row;
};

struct ff_row_cache {
	struct ff_row_cache_slot slots[FF_ROW_CACHE_SLOTS];
};

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct ff_row_cache);
} unwind_row_cache SEC(".maps");

/* Never written: makes the shared types part of the BTF for the skeleton. */
struct ff_unwind_proc ff_unwind_proc_layout SEC(".bss");
struct ff_unwind_page ff_unwind_page_layout SEC(".bss");
struct ff_user_stack ff_user_stack_layout SEC(".bss");

/*
 * FF_UNWIND_PAGE_ROWS, read from writable data so that the verifier sees an
 * unknown bound: a binary search between constant bounds makes it follow
 * every path with exact values (2^10 of them) instead of merging states.
 */
__u32 ff_page_rows = FF_UNWIND_PAGE_ROWS;

static __always_inline void ff_unwind_count(__u32 stat)
{
	__u64 *v = bpf_map_lookup_elem(&unwind_stats, &stat);

	if (v)
		*v += 1;
}

struct ff_walk {
	struct ff_unwind_scratch *s;
	struct ff_unwind_proc *proc; /* NULL: frame pointers only */
	struct ff_row_cache *rows; /* NULL: every row is searched for */
	__u32 hint; /* index of the last frame's mapping */
	__u32 go_parked; /* the walk went on from a Go thread's scheduler stack */
};

/*
 * Set before load: at Go's runtime.mcall (FF_CFA_GO_MCALL), go on walking the
 * goroutine that parked. A Go thread with nothing to run blocks in the
 * scheduler, on its own stack, right after a goroutine parked on it (a channel
 * receive, a sleep, a lock): for off-CPU time that goroutine's stack says what
 * the thread waits for. For CPU samples it would not (the scheduler's work is
 * not the goroutine's), so there the walk ends at mcall.
 */
const volatile bool ff_go_park_stitch = false;

/* A binary search run by bpf_loop(): lo and hi narrow on `key`. */
struct ff_search {
	void *base; /* the process entry, or a binary's table of pages */
	__u64 key;
	__u32 lo, hi;
};

/* One step of the binary search over a process's mappings: under bpf_loop() the
 * verifier checks it once, not once per path through the unrolled search. */
static int ff_mapping_step(__u32 index, void *data)
{
	struct ff_search *q = data;
	struct ff_unwind_proc *proc = q->base;
	__u32 mid;

	if (q->lo >= q->hi)
		return 1;
	mid = (q->lo + q->hi) / 2;
	if (proc->maps[mid & (FF_UNWIND_MAX_MAPPINGS - 1)].start <= q->key)
		q->lo = mid + 1;
	else
		q->hi = mid;
	return 0;
}

/* The mapping holding `pc`, or NULL. `hint` is the index the previous frame's
 * mapping had: the mappings do not overlap, so when it holds pc it is the answer,
 * and callers in the same binary (most frames) skip the search. */
static __always_inline struct ff_unwind_mapping *ff_find_mapping(struct ff_unwind_proc *proc,
								  __u64 pc, __u32 *hint)
{
	struct ff_search q = { .base = proc, .key = pc, .lo = 0, .hi = proc->count };
	struct ff_unwind_mapping *m;

	if (q.hi > FF_UNWIND_MAX_MAPPINGS)
		q.hi = FF_UNWIND_MAX_MAPPINGS;
	m = &proc->maps[*hint & (FF_UNWIND_MAX_MAPPINGS - 1)];
	if (*hint < q.hi && m->start <= pc && pc < m->end)
		return m;
	/* lo ends as the number of mappings starting at or below pc. */
	bpf_loop(7, ff_mapping_step, &q, 0);
	if (q.lo == 0)
		return NULL;
	*hint = q.lo - 1;
	m = &proc->maps[(q.lo - 1) & (FF_UNWIND_MAX_MAPPINGS - 1)];
	return pc < m->end ? m : NULL;
}

/* One step of the search for the last page whose first row starts at or below
 * the key (base: the table, a map of pages). 1 ends the loop; a missing page sets
 * hi = 0, lo = 0 (nothing found). */
static int ff_page_step(__u32 index, void *data)
{
	struct ff_search *q = data;
	struct ff_unwind_page *page;
	__u32 mid;

	if (q->lo >= q->hi)
		return 1;
	mid = (q->lo + q->hi) / 2;
	page = bpf_map_lookup_elem(q->base, &mid);
	if (!page) {
		q->lo = 0;
		q->hi = 0;
		return 1;
	}
	if (page->rows[0].pc <= q->key)
		q->lo = mid + 1;
	else
		q->hi = mid;
	return 0;
}

/* The row covering `addr` (an ELF virtual address) in a table of `pages`. */
static __always_inline bool ff_find_row(void *table, __u32 pages, __u32 addr,
					struct ff_unwind_row *out)
{
	struct ff_search q = { .base = table, .key = addr, .lo = 0, .hi = pages };
	struct ff_unwind_page *page;
	__u32 lo, hi, mid, i;

	/* Last page whose first row starts at or below addr (2^20 pages max). */
	bpf_loop(20, ff_page_step, &q, 0);
	if (q.lo == 0)
		return false;
	mid = q.lo - 1;
	page = bpf_map_lookup_elem(table, &mid);
	if (!page)
		return false;
	/* Last row at or below addr; rows[0] qualifies, so lo ends >= 1. Inline: with
	 * the page known, this search adds few states. */
	lo = 0;
	/* A mask, not a comparison: a clamp would give one path the constant. */
	hi = ff_page_rows & (2 * FF_UNWIND_PAGE_ROWS - 1);
	for (i = 0; i < 10 && lo < hi; i++) {
		mid = (lo + hi) / 2;
		if (page->rows[mid & (FF_UNWIND_PAGE_ROWS - 1)].pc <= addr)
			lo = mid + 1;
		else
			hi = mid;
	}
	if (lo == 0)
		return false;
	*out = page->rows[(lo - 1) & (FF_UNWIND_PAGE_ROWS - 1)];
	return true;
}

static __always_inline int ff_read(__u64 *dst, __u64 addr)
{
	return bpf_probe_read_user(dst, sizeof(*dst), (const void *)addr);
}

/* The row cache's slot for (table, addr): a multiplicative hash's top bits. */
static __always_inline struct ff_row_cache_slot *ff_row_slot(struct ff_row_cache *rows,
							     __u32 table, __u32 addr)
{
	__u32 i = ((addr ^ (table * 0x9e3779b9U)) * 0x85ebca6bU) >> 22;

	return &rows->slots[i & (FF_ROW_CACHE_SLOTS - 1)];
}

static __always_inline struct ff_unwind_mapping *
ff_find_mapping_bounded(struct ff_unwind_scratch *s, struct ff_unwind_proc *proc, __u64 pc);
static __always_inline bool ff_find_row_bounded(struct ff_unwind_scratch *s, void *table,
						__u32 pages, __u32 addr,
						struct ff_unwind_row *out);

/* One frame: record pc, then compute the caller's pc, sp and bp. 0 = go on.
 * `loops`: search with bpf_loop(); else with bounded loops over state kept in the
 * scratch (kernels without bpf_loop). */
static __always_inline int ff_unwind_frame(struct ff_walk *w, const bool loops)
{
	struct ff_unwind_scratch *s = w->s;
	struct ff_unwind_row row = {};
	struct ff_unwind_mapping *m = NULL;
	struct ff_row_cache_slot *slot = NULL;
	__u64 pc, sp, bp, cfa, ra, lookup, g;
	__u32 n, addr, id, kind = FF_CFA_NONE;
	void *table;

	if (!s)
		return 1;
	n = s->n;
	pc = s->pc;
	sp = s->sp;
	bp = s->bp;
	if (pc == 0)
		return 1;
	if (n >= FF_MAX_FRAMES) {
		ff_unwind_count(FF_UW_TRUNCATED);
		return 1;
	}
	s->stack.pcs[n] = pc;
	s->n = n + 1;

	/* A return address points after its call, which may be a function's last
	 * instruction (a noreturn call): look the call itself up. */
	lookup = (n || s->ret0) ? pc - 1 : pc;
	if (w->proc) {
		m = loops ? ff_find_mapping(w->proc, lookup, &w->hint)
			  : ff_find_mapping_bounded(s, w->proc, lookup);
		if (m) {
			/* Read once: user space may rewrite the entry meanwhile. */
			id = m->table;
			addr = (__u32)(lookup - m->bias);
			if (loops && w->rows && lookup - m->bias <= 0xffffffffULL)
				slot = ff_row_slot(w->rows, id, addr);
			if (slot && slot->table == id && slot->addr == addr) {
				row = slot->row;
				kind = row.kind;
			} else {
				table = bpf_map_lookup_elem(&unwind_tables, &id);
				if (!table) {
					ff_unwind_count(FF_UW_TABLE_MISSING);
				} else if (lookup - m->bias <= 0xffffffffULL &&
					   (loops ? ff_find_row(table, m->pages, addr, &row)
						  : ff_find_row_bounded(s, table, m->pages, addr,
									&row))) {
					kind = row.kind;
					if (slot) {
						slot->table = id;
						slot->addr = addr;
						slot->row = row;
					}
				}
			}
		}
	}

	switch (kind & FF_CFA_KIND_MASK) {
	case FF_CFA_NONE:
		/* Frame-pointer step: [bp] = caller's bp, [bp + 8] = return address. */
		if (bp == 0)
			return 1;
		if (ff_read(&ra, bp + 8) || ff_read(&cfa, bp)) {
			ff_unwind_count(FF_UW_READ_FAILED);
			return 1;
		}
		s->sp = bp + 16;
		s->bp = cfa;
		s->pc = ra;
		ff_unwind_count(FF_UW_FRAMES_FP);
		return 0;
	case FF_CFA_RSP:
		cfa = sp + row.cfa_off;
		break;
	case FF_CFA_RBP:
		cfa = bp + row.cfa_off;
		break;
	case FF_CFA_PLT:
		cfa = sp + 8 + ((pc & 15) >= (__u64)row.cfa_off ? 8 : 0);
		break;
	case FF_CFA_DEREF_RBP:
		if (ff_read(&cfa, bp + row.cfa_off)) {
			ff_unwind_count(FF_UW_READ_FAILED);
			return 1;
		}
		break;
	case FF_CFA_END:
		return 1;
	case FF_CFA_GO_MCALL:
		if (!ff_go_park_stitch || w->go_parked || !m)
			return 1;
		/* mcall(fn) called fn(g) with g pushed on the scheduler stack; g.sched
		 * holds the sp and pc gopark (or another caller of mcall) had. */
		if (ff_read(&g, sp + (__s64)row.rbp_off * 8) || !g ||
		    ff_read(&cfa, g + row.cfa_off) || ff_read(&ra, g + row.cfa_off + 8)) {
			ff_unwind_count(FF_UW_READ_FAILED);
			return 1;
		}
		/* The caller is Go runtime code, in the binary mcall is in. */
		if (ra < m->start || ra >= m->end || !cfa)
			return 1;
		w->go_parked = 1;
		ff_unwind_count(FF_UW_GO_PARKED);
		s->sp = cfa;
		s->bp = 0;
		s->pc = ra;
		return 0;
	default:
		ff_unwind_count(FF_UW_UNSUPPORTED);
		return 1;
	}
	if (cfa <= sp) {
		ff_unwind_count(FF_UW_BAD_STEP);
		return 1;
	}
	if (ff_read(&ra, cfa - 8)) {
		ff_unwind_count(FF_UW_READ_FAILED);
		return 1;
	}
	if (row.rbp_off && ff_read(&bp, cfa + (__s64)row.rbp_off * 8)) {
		ff_unwind_count(FF_UW_READ_FAILED);
		return 1;
	}
	if (kind & FF_RBP_LOST)
		bp = 0;
	s->sp = cfa;
	s->bp = bp;
	s->pc = ra;
	ff_unwind_count(FF_UW_FRAMES_CFI);
	return 0;
}

/* One frame per bpf_loop() callback. */
static int ff_unwind_step(__u32 index, void *data)
{
	return ff_unwind_frame(data, true);
}

/*
 * ---- The same walk without bpf_loop (kernels before 5.17) ----
 *
 * Bounded loops, which the verifier follows iteration by iteration. The search
 * bounds live in the scratch (map memory, whose values the verifier does not
 * track): every step then starts from the same verifier state whichever way the
 * last comparison went, so paths merge instead of multiplying. The cost is
 * linear in the frames: about FF_MAX_FRAMES times one frame's instructions.
 */
static __always_inline struct ff_unwind_mapping *
ff_find_mapping_bounded(struct ff_unwind_scratch *s, struct ff_unwind_proc *proc, __u64 pc)
{
	struct ff_unwind_mapping *m;
	__u32 count = proc->count, lo, hi, mid;

	if (count > FF_UNWIND_MAX_MAPPINGS)
		count = FF_UNWIND_MAX_MAPPINGS;
	lo = s->hint;
	m = &proc->maps[lo & (FF_UNWIND_MAX_MAPPINGS - 1)];
	if (lo < count && m->start <= pc && pc < m->end)
		return m;
	s->lo = 0;
	s->hi = count;
#pragma clang loop unroll(disable)
	for (int k = 0; k < 7; k++) {
		lo = s->lo;
		hi = s->hi;
		if (lo >= hi)
			break;
		mid = (lo + hi) / 2;
		if (proc->maps[mid & (FF_UNWIND_MAX_MAPPINGS - 1)].start <= pc)
			s->lo = mid + 1;
		else
			s->hi = mid;
	}
	lo = s->lo;
	if (lo == 0)
		return NULL;
	s->hint = lo - 1;
	m = &proc->maps[(lo - 1) & (FF_UNWIND_MAX_MAPPINGS - 1)];
	return pc < m->end ? m : NULL;
}

static __always_inline bool ff_find_row_bounded(struct ff_unwind_scratch *s, void *table,
						__u32 pages, __u32 addr,
						struct ff_unwind_row *out)
{
	struct ff_unwind_page *page;
	__u32 lo, hi, mid;

	s->lo = 0;
	s->hi = pages;
#pragma clang loop unroll(disable)
	for (int k = 0; k < 20; k++) {
		lo = s->lo;
		hi = s->hi;
		if (lo >= hi)
			break;
		mid = (lo + hi) / 2;
		page = bpf_map_lookup_elem(table, &mid);
		if (!page)
			return false;
		if (page->rows[0].pc <= addr)
			s->lo = mid + 1;
		else
			s->hi = mid;
	}
	mid = s->lo;
	if (mid == 0)
		return false;
	mid -= 1;
	page = bpf_map_lookup_elem(table, &mid);
	if (!page)
		return false;
	s->lo = 0;
	s->hi = ff_page_rows & (2 * FF_UNWIND_PAGE_ROWS - 1);
#pragma clang loop unroll(disable)
	for (int k = 0; k < 10; k++) {
		lo = s->lo;
		hi = s->hi;
		if (lo >= hi)
			break;
		mid = (lo + hi) / 2;
		if (page->rows[mid & (FF_UNWIND_PAGE_ROWS - 1)].pc <= addr)
			s->lo = mid + 1;
		else
			s->hi = mid;
	}
	lo = s->lo;
	if (lo == 0)
		return false;
	*out = page->rows[(lo - 1) & (FF_UNWIND_PAGE_ROWS - 1)];
	return true;
}

/*
 * Secret seed of the stack hash, set by user space before load (random per
 * agent process). A tenant controls its own frames; without a secret it could
 * build a stack whose key equals another tenant's, and that tenant's samples
 * would then be counted on the forged frames. With it the keys cannot be
 * predicted, and a hit is compared frame by frame anyway (ff_store_stack).
 */
const volatile __u64 ff_stack_seed = 0;

struct ff_stack_pass {
	struct ff_user_stack *st;
	struct ff_user_stack *old; /* compare pass: the stored stack */
	__u64 h;
	__u32 i; /* the frame at hand: a loaded index, which the verifier bounds (the
		  * callback's own index argument it does not, once clang widens it) */
	bool differs;
};

/* One frame of the hash. Under bpf_loop() the verifier checks this body once
 * instead of FF_MAX_FRAMES inlined copies per call site. */
static int ff_hash_frame(__u32 index, void *data)
{
	struct ff_stack_pass *p = data;
	__u32 i = p->i++;

	if (i >= FF_MAX_FRAMES)
		return 1;
	p->h ^= p->st->pcs[i];
	p->h *= 0xff51afd7ed558ccdULL;
	p->h ^= p->h >> 33;
	return 0;
}

/* One frame of the comparison with the stored stack. */
static int ff_compare_frame(__u32 index, void *data)
{
	struct ff_stack_pass *p = data;
	__u32 i = p->i++;

	if (i >= FF_MAX_FRAMES)
		return 1;
	if (p->st->pcs[i] != p->old->pcs[i]) {
		p->differs = true;
		return 1;
	}
	return 0;
}

/*
 * Stores the first `n` frames of `st` in `map` (a hash map from a keyed 64-bit
 * hash of the frames to the frames, as `user_stacks`) and returns the key; 0
 * when there is nothing to store, the map is full, or another stack holds the
 * key (a collision is refused, never counted on the other stack's frames).
 * Equal stacks share one entry, and unlike a stack-trace map (whose ID is a
 * bucket index) two stacks fight over a key only at the odds of a 64-bit
 * collision.
 */
static __always_inline __u64 ff_store_stack(void *map, struct ff_user_stack *st, __u32 n)
{
	struct ff_stack_pass p = {};
	struct ff_user_stack *old;
	long err;

	if (n == 0 || n > FF_MAX_FRAMES)
		return 0;
	/* The stored stack ends at its first 0 (frames past n are stale). */
	if (n < FF_MAX_FRAMES)
		st->pcs[n] = 0;
	p.st = st;
	p.h = (ff_stack_seed ^ 0x9e3779b97f4a7c15ULL) + n;
	bpf_loop(n, ff_hash_frame, &p, 0);
	if (p.h == 0)
		p.h = 1;
	old = bpf_map_lookup_elem(map, &p.h);
	if (!old) {
		err = bpf_map_update_elem(map, &p.h, st, BPF_NOEXIST);
		if (!err)
			return p.h;
		if (err != -EEXIST)
			return 0;
		/* Another CPU stored this key meanwhile: check it like a hit. */
		old = bpf_map_lookup_elem(map, &p.h);
		if (!old)
			return 0;
	}
	p.old = old;
	p.i = 0;
	/* n + 1 compares the terminating 0 as well, where there is one. */
	bpf_loop(n < FF_MAX_FRAMES ? n + 1 : n, ff_compare_frame, &p, 0);
	return p.differs ? 0 : p.h;
}

/* This CPU's scratch, for programs that cannot be preempted. */
static __always_inline struct ff_unwind_scratch *ff_unwind_percpu_scratch(void)
{
	__u32 zero = 0;

	return bpf_map_lookup_elem(&unwind_scratch, &zero);
}

/* The scratch walks use: the current task's (ff_unwind_per_task) or this CPU's. */
static __always_inline struct ff_unwind_scratch *ff_unwind_scratch_get(void)
{
	if (ff_unwind_per_task)
		return bpf_task_storage_get(&unwind_task_scratch, bpf_get_current_task_btf(), 0,
					    BPF_LOCAL_STORAGE_GET_F_CREATE);
	return ff_unwind_percpu_scratch();
}

/*
 * The walk itself, from the registers in the scratch's pc, sp and bp: a global
 * function, so the verifier checks it once, on its own, rather than once per
 * state its caller reaches it in; and its caller goes on from a single state
 * (an unknown key) instead of one per way the walk can end.
 *
 * It looks the scratch up itself rather than taking it as an argument: a
 * pointer argument of a global function is plain memory to the verifier, and
 * before Linux 6.2 (6.1 included) bpf_map_update_elem() refuses plain memory
 * as the value to store, which ff_store_stack() passes it.
 */
__noinline __u64 ff_walk_user_stack(__u32 tgid)
{
	struct ff_unwind_scratch *s = ff_unwind_scratch_get();
	struct ff_walk w = {};
	__u32 n, zero = 0;
	__u64 h;

	if (!s)
		return 0;
	s->n = 0;
	w.s = s;
	w.proc = bpf_map_lookup_elem(&unwind_procs, &tgid);
	if (!ff_unwind_per_task)
		w.rows = bpf_map_lookup_elem(&unwind_row_cache, &zero);
	ff_unwind_count(FF_UW_STACKS);
	if (!w.proc)
		ff_unwind_count(FF_UW_NO_PROC);
	bpf_loop(FF_MAX_FRAMES + 1, ff_unwind_step, &w, 0);

	n = s->n;
	h = ff_store_stack(&user_stacks, &s->stack, n);
	if (!h && n > 0 && n <= FF_MAX_FRAMES)
		ff_unwind_count(FF_UW_STACK_LOST);
	return h;
}

/*
 * Walks the user stack of `tgid` from (ip, sp, bp), stores it in
 * `user_stacks` and returns its key; 0 when no stack was stored (counted).
 * `ip_is_return`: ip is a return address (registers at a return probe), so
 * its frame is looked up at the call like every caller's.
 */
static __always_inline __u64 ff_unwind_user(__u64 ip, __u64 sp, __u64 bp, __u32 tgid,
					    bool ip_is_return)
{
	struct ff_unwind_scratch *s = ff_unwind_scratch_get();

	if (!s)
		return 0;
	s->pc = ip;
	s->sp = sp;
	s->bp = bp;
	s->ret0 = ip_is_return;
	return ff_walk_user_stack(tgid);
}

/*
 * ff_store_stack() with bounded loops (kernels without bpf_loop); the same keys.
 * Stores the first s->n frames of s->stack. The frame count is read from the
 * scratch again after the hash loop: a loop that stops at `n` leaves each exit
 * with its own bounds on n, and carried into the comparison loop they would
 * make the verifier walk it once per exit.
 */
static __always_inline __u64 ff_store_stack_bounded(void *map, struct ff_unwind_scratch *s)
{
	struct ff_user_stack *old, *st = &s->stack;
	__u32 n = s->n;
	__u64 h;
	long err;

	if (n == 0 || n > FF_MAX_FRAMES)
		return 0;
	if (n < FF_MAX_FRAMES)
		st->pcs[n] = 0;
	h = (ff_stack_seed ^ 0x9e3779b97f4a7c15ULL) + n;
#pragma clang loop unroll(disable)
	for (__u32 i = 0; i < FF_MAX_FRAMES; i++) {
		if (i >= s->n)
			break;
		h ^= st->pcs[i];
		h *= 0xff51afd7ed558ccdULL;
		h ^= h >> 33;
	}
	if (h == 0)
		h = 1;
	old = bpf_map_lookup_elem(map, &h);
	if (!old) {
		err = bpf_map_update_elem(map, &h, st, BPF_NOEXIST);
		if (!err)
			return h;
		if (err != -EEXIST)
			return 0;
		old = bpf_map_lookup_elem(map, &h);
		if (!old)
			return 0;
	}
	/* s->n + 1 compares the terminating 0 as well, where there is one. */
#pragma clang loop unroll(disable)
	for (__u32 i = 0; i < FF_MAX_FRAMES; i++) {
		if (i > s->n)
			break;
		if (st->pcs[i] != old->pcs[i])
			return 0;
	}
	return h;
}

/* Frames one program of the bounded walk takes before it tail-calls the next:
 * each frame costs the verifier ~13k instructions (its searches), and the
 * kernel allows 32 tail calls in a row, so 8 frames a program reach
 * FF_MAX_FRAMES in 16 calls while each program verifies in ~110k. */
#define FF_BOUNDED_FRAMES 8

/*
 * Up to FF_BOUNDED_FRAMES frames of the bounded walk, from the state in the
 * scratch (registers, frame count, mapping hint). Returns true when the walk is
 * over (outermost frame reached, a failed step, or FF_MAX_FRAMES).
 */
static __always_inline bool ff_walk_frames_bounded(struct ff_unwind_scratch *s, __u32 tgid)
{
	struct ff_walk w = {};

	w.s = s;
	w.proc = bpf_map_lookup_elem(&unwind_procs, &tgid);
#pragma clang loop unroll(disable)
	for (int i = 0; i < FF_BOUNDED_FRAMES; i++) {
		if (ff_unwind_frame(&w, false))
			return true;
	}
	return false;
}

/* Starts a bounded walk of `tgid` from the registers in the scratch. */
static __always_inline void ff_walk_begin_bounded(struct ff_unwind_scratch *s, __u32 tgid)
{
	s->n = 0;
	s->hint = 0;
	ff_unwind_count(FF_UW_STACKS);
	if (!bpf_map_lookup_elem(&unwind_procs, &tgid))
		ff_unwind_count(FF_UW_NO_PROC);
}

/* Stores the walked stack; its key, 0 when lost (counted). */
static __always_inline __u64 ff_walk_end_bounded(struct ff_unwind_scratch *s)
{
	__u64 h = ff_store_stack_bounded(&user_stacks, s);

	if (!h && s->n > 0 && s->n <= FF_MAX_FRAMES)
		ff_unwind_count(FF_UW_STACK_LOST);
	return h;
}

#endif
