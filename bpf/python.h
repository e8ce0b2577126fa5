/* SPDX-License-Identifier: (LGPL-2.1 OR BSD-2-Clause) */
/*
 * Types the Python frame reader (python.bpf.h) shares with user space
 * (node-agent/src/python/), exposed through the skeletons' BTF.
 *
 * User space finds a CPython process's `_PyRuntime` and version and fills its
 * `py_procs` entry with the struct offsets of that version
 * (node-agent/src/python/layouts.rs, generated from the interpreters' own headers).
 * At sample time the BPF side finds the sampled thread's PyThreadState and walks
 * its frame chain, recording two words per frame in a `py_stacks` entry (an
 * ff_user_stack): the code object's address (with FF_PY_LAST_OF_CALL) and the raw
 * instruction position (f_lasti before 3.11, the instruction pointer from 3.11),
 * which user space turns into names, files and lines.
 */
#ifndef FLAMEFLEET_PYTHON_H
#define FLAMEFLEET_PYTHON_H

/* Python frames kept per sample: two words each in an ff_user_stack. */
#define FF_PY_MAX_FRAMES 63

/* Thread states looked at to find the sampled thread's (the interpreter's list). */
#define FF_PY_MAX_THREADS 256

/* Set on a frame's code word when it is the outermost Python frame of one
 * _PyEval_EvalFrameDefault call: user space splices the Python frames up to it in
 * place of that native frame. */
#define FF_PY_LAST_OF_CALL (1ULL << 63)

/* How a version's frames chain. */
enum ff_py_kind {
	FF_PY_FRAME_OBJECTS = 1, /* 3.8-3.10: PyFrameObject.f_back, one eval call per frame */
	FF_PY_IS_ENTRY = 2,      /* 3.11: _PyInterpreterFrame.is_entry ends a call's frames */
	FF_PY_CSTACK_OWNER = 3,  /* 3.12+: a shim frame owned by the C stack ends a call's frames */
};

/* _PyInterpreterFrame.owner of the shim frames (3.12+). */
#define FF_PY_OWNED_BY_CSTACK 3

/* Value of `py_procs` (key: tgid): where the interpreter is, and its layout.
 * An offset of 0xffff means the field does not exist in that version. */
struct ff_py_proc {
	__u64 runtime;                   /* address of _PyRuntime in the process */
	__u32 kind;                      /* enum ff_py_kind */
	__u16 runtime_interpreters_head; /* _PyRuntimeState.interpreters.head */
	__u16 interp_threads_head;       /* PyInterpreterState.tstate_head / threads.head */
	__u16 tstate_next;
	__u16 tstate_thread_id;          /* pthread_self() of the thread: its TLS base */
	__u16 tstate_frame;              /* frame (<3.11), cframe (3.11, 3.12), current_frame (3.13) */
	__u16 cframe_current_frame;      /* _PyCFrame.current_frame (3.11, 3.12) */
	__u16 frame_previous;
	__u16 frame_code;
	__u16 frame_instr;
	__u16 frame_entry;               /* is_entry (3.11) or owner (3.12+) */
};

/* Counters in the per-CPU `py_stats` array. */
enum ff_py_stat {
	FF_PY_SAMPLES = 0,       /* samples (CPU) or switch-outs (off-CPU) of registered Python processes */
	FF_PY_STACKS = 1,        /* of which with Python frames stored */
	FF_PY_NO_THREAD = 2,     /* the thread has no thread state (a thread Python does not know) */
	FF_PY_NO_FRAME = 3,      /* the thread state has no current frame (not running Python) */
	FF_PY_READ_FAILED = 4,   /* a walk stopped at unreadable memory */
	FF_PY_TRUNCATED = 5,     /* stacks cut at FF_PY_MAX_FRAMES */
	FF_PY_STACK_LOST = 6,    /* stack not stored: `py_stacks` full */
	FF_PY_STAT_MAX = 7,
};

#endif
