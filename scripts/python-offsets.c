/*
 * Prints the CPython struct offsets the agent's Python frame reader needs, for the
 * interpreter whose headers it is compiled against (scripts/python-offsets.sh compiles it
 * once per version, with -DPy_BUILD_CORE for the internal headers).
 */
#define Py_BUILD_CORE 1
#include <Python.h>
#include <stddef.h>
#include <stdio.h>
#if PY_VERSION_HEX >= 0x030B0000
#include <internal/pycore_frame.h>
#endif
#if PY_VERSION_HEX < 0x03090000
#include <internal/pycore_pystate.h>
#else
#include <internal/pycore_runtime.h>
#include <internal/pycore_interp.h>
#endif
#if PY_VERSION_HEX < 0x030B0000
#include <frameobject.h>
#endif

#define P(name, value) printf("    " #name ": %lu,\n", (unsigned long)(value))

int main(void)
{
	printf("PyLayout {\n");
	printf("    minor: %d,\n", PY_MINOR_VERSION);
	P(runtime_interpreters_head, offsetof(_PyRuntimeState, interpreters.head));
#if PY_VERSION_HEX >= 0x030B0000
	P(interp_threads_head, offsetof(PyInterpreterState, threads.head));
#else
	P(interp_threads_head, offsetof(PyInterpreterState, tstate_head));
#endif
	P(tstate_next, offsetof(PyThreadState, next));
	P(tstate_thread_id, offsetof(PyThreadState, thread_id));
#if PY_VERSION_HEX >= 0x030D0000
	P(tstate_frame, offsetof(PyThreadState, current_frame));
	P(cframe_current_frame, 0xffff);
#elif PY_VERSION_HEX >= 0x030B0000
	P(tstate_frame, offsetof(PyThreadState, cframe));
	P(cframe_current_frame, offsetof(_PyCFrame, current_frame));
#else
	P(tstate_frame, offsetof(PyThreadState, frame));
	P(cframe_current_frame, 0xffff);
#endif
#if PY_VERSION_HEX >= 0x030B0000
	P(frame_previous, offsetof(_PyInterpreterFrame, previous));
#if PY_VERSION_HEX >= 0x030D0000
	P(frame_code, offsetof(_PyInterpreterFrame, f_executable));
	P(frame_instr, offsetof(_PyInterpreterFrame, instr_ptr));
#else
	P(frame_code, offsetof(_PyInterpreterFrame, f_code));
	P(frame_instr, offsetof(_PyInterpreterFrame, prev_instr));
#endif
#if PY_VERSION_HEX >= 0x030C0000
	P(frame_entry, offsetof(_PyInterpreterFrame, owner));
#else
	P(frame_entry, offsetof(_PyInterpreterFrame, is_entry));
#endif
	P(frame_owner, offsetof(_PyInterpreterFrame, owner));
	P(code_adaptive, offsetof(PyCodeObject, co_code_adaptive));
	P(code_qualname, offsetof(PyCodeObject, co_qualname));
	P(code_linetable, offsetof(PyCodeObject, co_linetable));
#else
	P(frame_previous, offsetof(PyFrameObject, f_back));
	P(frame_code, offsetof(PyFrameObject, f_code));
	P(frame_instr, offsetof(PyFrameObject, f_lasti));
	P(frame_entry, 0xffff);
	P(frame_owner, 0xffff);
	P(code_adaptive, 0);
	P(code_qualname, 0);
#if PY_VERSION_HEX >= 0x030A0000
	P(code_linetable, offsetof(PyCodeObject, co_linetable));
#else
	P(code_linetable, offsetof(PyCodeObject, co_lnotab));
#endif
#endif
	P(code_filename, offsetof(PyCodeObject, co_filename));
	P(code_name, offsetof(PyCodeObject, co_name));
	P(code_firstlineno, offsetof(PyCodeObject, co_firstlineno));
	P(bytes_size, offsetof(PyVarObject, ob_size));
	P(bytes_data, offsetof(PyBytesObject, ob_sval));
	P(unicode_state, offsetof(PyASCIIObject, state));
	P(unicode_length, offsetof(PyASCIIObject, length));
	P(unicode_ascii_data, sizeof(PyASCIIObject));
	P(unicode_compact_data, sizeof(PyCompactUnicodeObject));
	printf("},\n");
	return 0;
}
