/* SPDX-License-Identifier: (LGPL-2.1 OR BSD-2-Clause) */
/*
 * Python frames at sample time (python.h describes the records).
 *
 * For a process user space registered in `py_procs`: the sampled thread's
 * PyThreadState is the one whose thread_id (pthread_self(), the thread's TLS base)
 * equals the task's fsbase; it is remembered per thread in `py_threads` and checked
 * again at every use, else looked up in the interpreter's thread list (at most
 * FF_PY_MAX_THREADS entries). From its current frame the chain is walked towards
 * the module's top level, at most FF_PY_MAX_FRAMES frames, each read with
 * bpf_probe_read_user (a bad pointer ends the walk, never the sample). Runs under
 * bpf_loop() (Linux 5.17+); the bounded-loop programs of older kernels record no
 * Python frames.
 *
 * Include after unwind.bpf.h (the per-CPU scratch and ff_store_stack).
 */
#ifndef FLAMEFLEET_PYTHON_BPF_H
#define FLAMEFLEET_PYTHON_BPF_H

#include "python.h"

/* tgid -> the interpreter's address and layout. Created and filled by user space. */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 1024);
	__type(key, __u32);
	__type(value, struct ff_py_proc);
} py_procs SEC(".maps");

/* pid_tgid -> the thread's PyThreadState, checked at every use. */
struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 8192);
	__type(key, __u64);
	__type(value, __u64);
} py_threads SEC(".maps");

/* Stack hash -> Python frames (two words each); sized by user space. */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 16384);
	__type(key, __u64);
	__type(value, struct ff_user_stack);
} py_stacks SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, FF_PY_STAT_MAX);
	__type(key, __u32);
	__type(value, __u64);
} py_stats SEC(".maps");

/* Never written: makes the shared type part of the BTF for the skeleton. */
struct ff_py_proc ff_py_proc_layout SEC(".bss");

static __always_inline void ff_py_count(__u32 stat)
{
	__u64 *v = bpf_map_lookup_elem(&py_stats, &stat);

	if (v)
		*v += 1;
}

struct ff_py_find {
	struct ff_py_proc *p;
	__u64 ts;     /* the thread state at hand */
	__u64 fsbase; /* the sampled thread's */
	__u64 found;
	bool failed;
};

/* One thread state of the interpreter's list. */
static int ff_py_thread_step(__u32 index, void *data)
{
	struct ff_py_find *f = data;
	__u64 id;

	if (!f->ts)
		return 1;
	if (ff_read(&id, f->ts + f->p->tstate_thread_id)) {
		f->failed = true;
		return 1;
	}
	if (id == f->fsbase) {
		f->found = f->ts;
		return 1;
	}
	if (ff_read(&f->ts, f->ts + f->p->tstate_next)) {
		f->failed = true;
		return 1;
	}
	return 0;
}

/* The walk's state. What changes from frame to frame (the frame, the count, the flags)
 * lives in the scratch, map memory whose values the verifier does not track: kept on the
 * stack, each frame count would be a new state and the verifier would walk the callback
 * once per count. */
struct ff_py_walk {
	struct ff_py_proc *p;
	struct ff_unwind_scratch *s; /* pc: the frame at hand, n: frames recorded, bp: flags */
};

/* FF_PY_MAX_FRAMES + 1 is a power of two: a mask of frame indices. */
#define FF_PY_FRAME_MASK 63
#define FF_PY_WALK_FAILED 1
#define FF_PY_WALK_TRUNCATED 2

/* One frame of the chain: record it (a shim frame only ends its call's frames). */
static int ff_py_frame_step(__u32 index, void *data)
{
	struct ff_py_walk *w = data;
	struct ff_py_proc *p = w->p;
	struct ff_unwind_scratch *s = w->s;
	__u64 frame = s->pc, code, instr, prev;
	__u32 n = s->n, at;
	__u8 entry = 0;
	bool last;

	if (!frame)
		return 1;
	if (ff_read(&prev, frame + p->frame_previous)) {
		s->bp |= FF_PY_WALK_FAILED;
		return 1;
	}
	s->pc = prev;
	if (p->kind != FF_PY_FRAME_OBJECTS &&
	    bpf_probe_read_user(&entry, sizeof(entry), (const void *)(frame + p->frame_entry))) {
		s->bp |= FF_PY_WALK_FAILED;
		return 1;
	}
	if (p->kind == FF_PY_CSTACK_OWNER && entry == FF_PY_OWNED_BY_CSTACK) {
		/* The frame recorded last was the outermost of its call. */
		if (n > 0 && n <= FF_PY_MAX_FRAMES)
			s->stack.pcs[2 * ((n - 1) & FF_PY_FRAME_MASK)] |= FF_PY_LAST_OF_CALL;
		return 0;
	}
	if (n >= FF_PY_MAX_FRAMES) {
		s->bp |= FF_PY_WALK_TRUNCATED;
		return 1;
	}
	/* The mask bounds the index for the verifier (n < FF_PY_MAX_FRAMES already). */
	at = 2 * (n & FF_PY_FRAME_MASK);
	if (ff_read(&code, frame + p->frame_code) || ff_read(&instr, frame + p->frame_instr)) {
		s->bp |= FF_PY_WALK_FAILED;
		return 1;
	}
	last = p->kind == FF_PY_FRAME_OBJECTS || (p->kind == FF_PY_IS_ENTRY && entry);
	s->stack.pcs[at] = code | (last ? FF_PY_LAST_OF_CALL : 0);
	/* At most pcs[125]: 2 * 62 + 1. */
	s->stack.pcs[at + 1] = instr;
	s->n = n + 1;
	return 0;
}

/* The PyThreadState of thread `pid_tgid` (whose TLS base is `fsbase`), or 0. */
static __always_inline __u64 ff_py_thread_state(struct ff_py_proc *p, __u64 pid_tgid,
						__u64 fsbase)
{
	struct ff_py_find f = { .p = p, .fsbase = fsbase };
	__u64 *cached, interp, tid;

	cached = bpf_map_lookup_elem(&py_threads, &pid_tgid);
	if (cached && *cached && !ff_read(&tid, *cached + p->tstate_thread_id) && tid == fsbase)
		return *cached;
	if (ff_read(&interp, p->runtime + p->runtime_interpreters_head) || !interp ||
	    ff_read(&f.ts, interp + p->interp_threads_head)) {
		ff_py_count(FF_PY_READ_FAILED);
		return 0;
	}
	bpf_loop(FF_PY_MAX_THREADS, ff_py_thread_step, &f, 0);
	if (f.failed)
		ff_py_count(FF_PY_READ_FAILED);
	if (f.found)
		bpf_map_update_elem(&py_threads, &pid_tgid, &f.found, BPF_ANY);
	return f.found;
}

/*
 * Walks the Python frames of thread `pid_tgid` (the current task; `fsbase` its
 * thread.fsbase), when user space registered its process as a Python one, into
 * `py_stacks` and returns the stack's key; 0 when none was stored (counted). The caller
 * passes the task's identity rather than this reading the current task's, so that what
 * the walk looks for is the task the caller means. Uses this CPU's unwind scratch: call
 * it after the user stack was stored. A global function: verified once, on its own.
 */
__noinline __u64 ff_py_walk_stack(__u64 pid_tgid, __u64 fsbase)
{
	struct ff_unwind_scratch *s = ff_unwind_percpu_scratch();
	__u32 tgid = pid_tgid >> 32;
	struct ff_py_proc *p = bpf_map_lookup_elem(&py_procs, &tgid);
	struct ff_py_walk w = {};
	__u64 ts, frame, h;
	__u32 n;

	if (!p || !s)
		return 0;
	ff_py_count(FF_PY_SAMPLES);
	ts = ff_py_thread_state(p, pid_tgid, fsbase);
	if (!ts) {
		ff_py_count(FF_PY_NO_THREAD);
		return 0;
	}
	if (ff_read(&frame, ts + p->tstate_frame) ||
	    (p->cframe_current_frame != 0xffff && frame &&
	     ff_read(&frame, frame + p->cframe_current_frame))) {
		ff_py_count(FF_PY_READ_FAILED);
		return 0;
	}
	if (!frame) {
		ff_py_count(FF_PY_NO_FRAME);
		return 0;
	}
	w.p = p;
	w.s = s;
	s->pc = frame;
	s->n = 0;
	s->bp = 0;
	bpf_loop(FF_PY_MAX_FRAMES * 2, ff_py_frame_step, &w, 0);
	if (s->bp & FF_PY_WALK_FAILED)
		ff_py_count(FF_PY_READ_FAILED);
	if (s->bp & FF_PY_WALK_TRUNCATED)
		ff_py_count(FF_PY_TRUNCATED);
	n = s->n;
	if (n == 0 || n > FF_PY_MAX_FRAMES)
		return 0;
	h = ff_store_stack(&py_stacks, &s->stack, 2 * n);
	if (h)
		ff_py_count(FF_PY_STACKS);
	else
		ff_py_count(FF_PY_STACK_LOST);
	return h;
}

#endif
