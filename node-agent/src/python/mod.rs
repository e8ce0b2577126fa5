//! Python frames in CPU samples, for CPython 3.8 to 3.13, with nothing in the profiled
//! process (no code change, restart or sidecar).
//!
//! - [`detect`]: whether a process runs CPython (its `libpython3.N.so` or `python3.N`
//!   executable), which version, and where its `_PyRuntime` is.
//! - [`layouts`]: the struct offsets of each version, generated from the interpreters' own
//!   headers (`scripts/python-offsets.sh`).
//! - [`PythonRegistry`]: the node's `py_procs` and `py_threads` maps (shared by the
//!   samplers' BPF objects like the unwind tables), filled as processes are tracked; at
//!   sample time `bpf/python.bpf.h` walks the sampled thread's frame chain into
//!   `py_stacks`, two words per frame (code object, instruction position).
//! - [`code`]: those code objects read back from the process's memory (names, file, line
//!   table), bounded, and cached per process.
//! - [`splice`]: the Python frames put in place of the native interpreter-loop frames
//!   (`_PyEval_EvalFrameDefault`) they ran in, so that native code called from Python
//!   shows under the Python function that called it.

pub mod code;
pub mod detect;
mod layouts;

use std::collections::HashMap;
use std::os::fd::AsFd as _;
use std::sync::{Arc, Mutex, PoisonError, Weak};

use libbpf_rs::{MapCore, MapFlags, MapHandle, MapType};

use crate::bpf::cpu_sampler::types::ff_py_proc;
use crate::capture::heap::goruntime::memory::ProcessMemory;
use crate::pprof::{Frame, FrameLine};
use crate::process::ProcessMaps;
use crate::process::handle::ProcessHandle;
pub use code::PyCode;

/// Python processes the node reads frames of at once (the `py_procs` map's size).
pub const MAX_PROCESSES: u32 = 1024;
/// Threads whose thread state the BPF side remembers (`py_threads`, least recently used
/// first out).
pub const MAX_THREADS: u32 = 8192;
/// Code objects remembered per process (a few hundred bytes each); beyond, new ones are
/// read again at every capture.
pub const MAX_CODES_PER_PROCESS: usize = 16_384;
/// Bytes of a process's memory read per capture to resolve its code objects.
pub const READ_BUDGET: u64 = 8 << 20;
/// Interpreter binaries whose inspection is remembered.
const MAX_BINARIES: usize = 64;

/// The `FF_PY_LAST_OF_CALL` bit of bpf/python.h.
const LAST_OF_CALL: u64 = 1 << 63;

/// The struct offsets of one CPython minor version (see bpf/python.h); 0xffff for a field
/// the version lacks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[allow(missing_docs)]
pub struct PyLayout {
    pub minor: u8,
    pub runtime_interpreters_head: u16,
    pub interp_threads_head: u16,
    pub tstate_next: u16,
    pub tstate_thread_id: u16,
    pub tstate_frame: u16,
    pub cframe_current_frame: u16,
    pub frame_previous: u16,
    pub frame_code: u16,
    pub frame_instr: u16,
    pub frame_entry: u16,
    pub frame_owner: u16,
    pub code_adaptive: u16,
    pub code_qualname: u16,
    pub code_linetable: u16,
    pub code_filename: u16,
    pub code_name: u16,
    pub code_firstlineno: u16,
    pub bytes_size: u16,
    pub bytes_data: u16,
    pub unicode_state: u16,
    pub unicode_length: u16,
    pub unicode_ascii_data: u16,
    pub unicode_compact_data: u16,
}

impl PyLayout {
    /// The layout of 3.`minor`, if supported.
    pub fn of(minor: u8) -> Option<&'static Self> {
        layouts::LAYOUTS.iter().find(|l| l.minor == minor)
    }

    /// How the version's frames chain (`enum ff_py_kind`).
    fn kind(&self) -> u32 {
        match self.minor {
            ..=10 => 1,
            11 => 2,
            _ => 3,
        }
    }

    fn bpf_entry(&self, runtime: u64) -> ff_py_proc {
        ff_py_proc {
            runtime,
            kind: self.kind(),
            runtime_interpreters_head: self.runtime_interpreters_head,
            interp_threads_head: self.interp_threads_head,
            tstate_next: self.tstate_next,
            tstate_thread_id: self.tstate_thread_id,
            tstate_frame: self.tstate_frame,
            cframe_current_frame: self.cframe_current_frame,
            frame_previous: self.frame_previous,
            frame_code: self.frame_code,
            frame_instr: self.frame_instr,
            frame_entry: self.frame_entry,
        }
    }
}

/// The BPF side's counters (`py_stats`, `enum ff_py_stat`), summed over CPUs.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PyStats {
    /// Samples (CPU) or blocking switch-outs (off-CPU) of registered Python processes.
    pub samples: u64,
    /// Of which with Python frames stored.
    pub stacks: u64,
    /// Samples of threads with no thread state (threads Python does not know).
    pub no_thread: u64,
    /// Samples of threads not running Python code (no current frame).
    pub no_frame: u64,
    /// Walks stopped at unreadable memory.
    pub read_failed: u64,
    /// Stacks cut at the frame bound.
    pub truncated: u64,
    /// Stacks not stored (`py_stacks` full).
    pub stack_lost: u64,
}

impl PyStats {
    /// Reads the per-CPU `py_stats` array of a BPF object.
    pub fn read(map: &impl MapCore) -> Self {
        let mut v = [0u64; 7];
        for (i, total) in v.iter_mut().enumerate() {
            *total = crate::bpf::per_cpu::<u64>(map, i as u32)
                .unwrap_or_default()
                .into_iter()
                .sum();
        }
        Self {
            samples: v[0],
            stacks: v[1],
            no_thread: v[2],
            no_frame: v[3],
            read_failed: v[4],
            truncated: v[5],
            stack_lost: v[6],
        }
    }

    /// The counts since `before`.
    pub fn since(self, before: Self) -> Self {
        let d = |a: u64, b: u64| a.saturating_sub(b);
        Self {
            samples: d(self.samples, before.samples),
            stacks: d(self.stacks, before.stacks),
            no_thread: d(self.no_thread, before.no_thread),
            no_frame: d(self.no_frame, before.no_frame),
            read_failed: d(self.read_failed, before.read_failed),
            truncated: d(self.truncated, before.truncated),
            stack_lost: d(self.stack_lost, before.stack_lost),
        }
    }

    /// A line for the capture's summary when frame chains were cut or unreadable (a
    /// process's memory changing under the walk, or a hostile one); `None` otherwise.
    pub fn damage(&self) -> Option<String> {
        (self.truncated > 0 || self.read_failed > 0).then(|| {
            format!(
                "python: {} frame chains cut at {MAX_FRAMES} frames (a longer or looping \
                 chain), {} stopped at unreadable memory",
                self.truncated, self.read_failed
            )
        })
    }

    /// A CPU profile's comment.
    pub fn comment(&self) -> String {
        self.comment_of("samples")
    }

    /// A profile's comment, counting `what` (samples, blocks).
    pub fn comment_of(&self, what: &str) -> String {
        format!(
            "python: {} {what} of Python processes, {} with Python frames; no thread state {}, \
             not in Python {}, unreadable {}, truncated at {} frames {}, stacks lost {}",
            self.samples,
            self.stacks,
            self.no_thread,
            self.no_frame,
            self.read_failed,
            MAX_FRAMES,
            self.truncated,
            self.stack_lost
        )
    }
}

/// Python frames kept per sample (`FF_PY_MAX_FRAMES`).
pub const MAX_FRAMES: usize = 63;

/// One Python frame of a sample, resolved.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct PyFrame {
    /// `module.function` (`module.Class.method` from 3.11).
    pub function: String,
    /// The code's file.
    pub file: String,
    /// The line executing, 0 when unknown.
    pub line: i64,
    /// The outermost Python frame of one native `_PyEval_EvalFrameDefault` call.
    pub last_of_call: bool,
}

/// Whether the frames of one Python process are read, for the capture's summary.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PyProcessStatus {
    /// Process ID.
    pub pid: u32,
    /// `3.N`, or what is known of the version.
    pub version: String,
    /// Why its frames are not read; `None` when they are.
    pub not_read: Option<String>,
}

impl std::fmt::Display for PyProcessStatus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.not_read {
            None => write!(
                f,
                "python {} (pid {}): Python frames read",
                self.version, self.pid
            ),
            Some(why) => write!(
                f,
                "python {} (pid {}): native frames only: {why}",
                self.version, self.pid
            ),
        }
    }
}

/// Why the registry could not be set up.
#[derive(Debug, thiserror::Error)]
#[error("creating the Python frame maps ({what}): {source}")]
pub struct PythonError {
    /// What was being done.
    pub what: &'static str,
    /// The cause.
    pub source: libbpf_rs::Error,
}

struct Reader {
    layout: &'static PyLayout,
    process: Arc<ProcessHandle>,
    codes: HashMap<u64, Option<Arc<PyCode>>>,
    code_type: Option<u64>,
}

struct Proc {
    status: PyProcessStatus,
    /// The interpreter binary's path and where it is mapped: an exec (a new address
    /// space) registers again.
    binary: (String, u64),
    reader: Option<Reader>,
}

#[derive(Default)]
struct State {
    procs: HashMap<u32, Proc>,
    /// Inspections by binary (build ID or path).
    binaries: HashMap<String, Result<detect::Interpreter, String>>,
}

/// The node's Python processes and their BPF entries (see the module docs).
pub struct PythonRegistry {
    procs: MapHandle,
    threads: MapHandle,
    state: Mutex<State>,
}

impl std::fmt::Debug for PythonRegistry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PythonRegistry")
            .field("processes", &self.lock().procs.len())
            .finish()
    }
}

static SHARED: Mutex<Weak<PythonRegistry>> = Mutex::new(Weak::new());

impl PythonRegistry {
    /// The node's registry: the running one, or a new one.
    pub fn shared() -> Result<Arc<Self>, PythonError> {
        let mut slot = SHARED.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(r) = slot.upgrade() {
            return Ok(r);
        }
        let r = Arc::new(Self::new()?);
        *slot = Arc::downgrade(&r);
        Ok(r)
    }

    fn new() -> Result<Self, PythonError> {
        let opts = libbpf_rs::libbpf_sys::bpf_map_create_opts {
            sz: std::mem::size_of::<libbpf_rs::libbpf_sys::bpf_map_create_opts>() as _,
            ..Default::default()
        };
        let procs = MapHandle::create(
            MapType::Hash,
            Some("py_procs"),
            4,
            std::mem::size_of::<ff_py_proc>() as u32,
            MAX_PROCESSES,
            &opts,
        )
        .map_err(|source| PythonError {
            what: "py_procs",
            source,
        })?;
        let threads = MapHandle::create(
            MapType::LruHash,
            Some("py_threads"),
            8,
            8,
            MAX_THREADS,
            &opts,
        )
        .map_err(|source| PythonError {
            what: "py_threads",
            source,
        })?;
        Ok(Self {
            procs,
            threads,
            state: Mutex::new(State::default()),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Points a BPF object's `py_procs` and `py_threads` at the registry's (before load).
    pub fn share_maps(
        &self,
        procs: &mut libbpf_rs::OpenMapMut<'_>,
        threads: &mut libbpf_rs::OpenMapMut<'_>,
    ) -> Result<(), PythonError> {
        procs
            .reuse_fd(self.procs.as_fd())
            .map_err(|source| PythonError {
                what: "sharing py_procs",
                source,
            })?;
        threads
            .reuse_fd(self.threads.as_fd())
            .map_err(|source| PythonError {
                what: "sharing py_threads",
                source,
            })
    }

    /// Looks at a process's snapshot: a CPython process of a supported version gets its
    /// BPF entry; another version gets a status saying why its frames are not read; a
    /// process that is not (or no longer, after an exec) Python loses its entry.
    pub fn register(&self, tgid: u32, maps: &ProcessMaps) {
        let Some((range, bin)) = detect::interpreter_binary(maps) else {
            if self.lock().procs.remove(&tgid).is_some() {
                let _ = self.procs.delete(&tgid.to_ne_bytes());
            }
            return;
        };
        if self
            .lock()
            .procs
            .get(&tgid)
            .is_some_and(|p| p.binary.0 == bin.path && p.binary.1 == range.start)
        {
            return;
        }
        let key = if bin.build_id.is_empty() {
            format!("path:{}", bin.path)
        } else {
            format!("build-id:{}", bin.build_id)
        };
        let cached = self.lock().binaries.get(&key).cloned();
        let found = cached.unwrap_or_else(|| {
            let found = detect::inspect(bin, tgid).map_err(|e| e.to_string());
            let mut st = self.lock();
            if st.binaries.len() >= MAX_BINARIES {
                st.binaries.clear();
            }
            st.binaries.insert(key, found.clone());
            found
        });
        let mut status = PyProcessStatus {
            pid: tgid,
            version: "3.?".into(),
            not_read: None,
        };
        let reader = match found {
            Err(why) => {
                status.not_read = Some(why);
                None
            }
            Ok(interp) => {
                status.version = format!("3.{}", interp.minor);
                self.reader_for(tgid, bin, range, &interp)
                    .map_err(|why| status.not_read = Some(why))
                    .ok()
            }
        };
        let mut st = self.lock();
        if !st.procs.contains_key(&tgid) && st.procs.len() >= MAX_PROCESSES as usize {
            st.procs
                .retain(|_, p| p.reader.as_ref().is_none_or(|r| r.process.is_alive()));
        }
        let reader = match reader {
            Some(r) if st.procs.len() >= MAX_PROCESSES as usize => {
                drop(r);
                status.not_read = Some(format!(
                    "{MAX_PROCESSES} Python processes are read on this node already"
                ));
                None
            }
            r => r,
        };
        if reader.is_none() {
            let _ = self.procs.delete(&tgid.to_ne_bytes());
        }
        st.procs.insert(
            tgid,
            Proc {
                status,
                binary: (bin.path.clone(), range.start),
                reader,
            },
        );
    }

    /// Checks the interpreter in the process and writes its BPF entry.
    fn reader_for(
        &self,
        tgid: u32,
        bin: &crate::process::Binary,
        range: &crate::process::MappedRange,
        interp: &detect::Interpreter,
    ) -> Result<Reader, String> {
        let layout = PyLayout::of(interp.minor).ok_or_else(|| {
            format!(
                "CPython 3.{} is not supported (3.8 to 3.13 are)",
                interp.minor
            )
        })?;
        let bias = detect::load_bias(bin, tgid, range)
            .ok_or_else(|| format!("{}: no load segment holds its mapping", bin.path))?;
        let runtime = interp.runtime_vaddr.wrapping_add(bias);
        let process = Arc::new(ProcessHandle::open(tgid).map_err(|e| e.to_string())?);
        if interp.minor >= 13 {
            // 3.13's _PyRuntime starts with its debug offsets: a cookie and the version.
            let mut mem = ProcessMemory::of(process.clone(), 64);
            let mut cookie = [0u8; 8];
            mem.read(runtime, &mut cookie).map_err(|e| e.to_string())?;
            let version = mem.u64(runtime + 8).map_err(|e| e.to_string())?;
            if &cookie != b"xdebugpy" || (version >> 16) & 0xffff != 0x0300 | 13 {
                return Err(format!(
                    "_PyRuntime of {} does not start with 3.13's debug offsets (cookie {:?}, \
                     version {version:#x})",
                    bin.path,
                    String::from_utf8_lossy(&cookie)
                ));
            }
        }
        let entry = layout.bpf_entry(runtime);
        self.procs
            .update(
                &tgid.to_ne_bytes(),
                crate::bpf::as_bytes(&entry),
                MapFlags::ANY,
            )
            .map_err(|e| format!("writing its py_procs entry: {e}"))?;
        Ok(Reader {
            layout,
            process,
            codes: HashMap::new(),
            code_type: None,
        })
    }

    /// The status of `tgid`, when it is a Python process.
    pub fn status(&self, tgid: u32) -> Option<PyProcessStatus> {
        self.lock().procs.get(&tgid).map(|p| p.status.clone())
    }

    /// Resolves the Python frames of a `py_stacks` entry of `tgid` (leaf first), reading
    /// the code objects not cached yet from the process's memory.
    pub fn resolve(&self, tgid: u32, words: &[u64]) -> Vec<PyFrame> {
        let mut st = self.lock();
        let Some(reader) = st.procs.get_mut(&tgid).and_then(|p| p.reader.as_mut()) else {
            return Vec::new();
        };
        let mut mem = ProcessMemory::of(reader.process.clone(), READ_BUDGET);
        let layout = reader.layout;
        let mut out = Vec::with_capacity(words.len() / 2);
        for pair in words.chunks_exact(2) {
            let code_addr = pair[0] & !LAST_OF_CALL;
            if code_addr == 0 {
                break;
            }
            let code = match reader.codes.get(&code_addr) {
                Some(c) => c.clone(),
                None => {
                    let c = code::read_code(&mut mem, layout, code_addr, &mut reader.code_type)
                        .ok()
                        .map(Arc::new);
                    if reader.codes.len() < MAX_CODES_PER_PROCESS {
                        reader.codes.insert(code_addr, c.clone());
                    }
                    c
                }
            };
            let last_of_call = pair[0] & LAST_OF_CALL != 0;
            let Some(code) = code else {
                out.push(PyFrame {
                    function: format!("[python code {code_addr:#x}]"),
                    file: String::new(),
                    line: 0,
                    last_of_call,
                });
                continue;
            };
            let offset = instruction_offset(layout, code_addr, pair[1]);
            let line = offset
                .and_then(|o| code::line_of(layout.minor, &code.line_table, code.first_line, o))
                .unwrap_or(code.first_line);
            out.push(PyFrame {
                function: code::qualified_name(&code.file, &code.name),
                file: code.file.clone(),
                line,
                last_of_call,
            });
        }
        out
    }
}

/// The instruction a frame executes, in code units from the start of its bytecode:
/// `f_lasti` before 3.11 (bytes before 3.10), the instruction pointer from 3.11.
fn instruction_offset(layout: &PyLayout, code: u64, raw: u64) -> Option<u64> {
    match layout.minor {
        ..=10 => {
            let lasti = u64::try_from(raw as u32 as i32).ok()?;
            Some(if layout.minor <= 9 { lasti / 2 } else { lasti })
        }
        _ => {
            let start = code + u64::from(layout.code_adaptive);
            raw.checked_sub(start).map(|b| b / 2)
        }
    }
}

/// The name of the interpreter loop's native frames.
const EVAL_FRAME: &str = "_PyEval_EvalFrameDefault";

/// `native` (a symbolized user stack, leaf first) with the Python frames `py` (leaf
/// first) in place of the interpreter-loop frames they ran in: each
/// `_PyEval_EvalFrameDefault` frame, leaf to root, takes the Python frames up to the next
/// one marked [`PyFrame::last_of_call`]. Python frames left over (a native walk that
/// stopped early) go below the last native frame.
pub fn splice(native: Vec<Frame>, py: &[PyFrame]) -> Vec<Frame> {
    if py.is_empty() {
        return native;
    }
    let frame_of = |p: &PyFrame| Frame {
        address: 0,
        mapping: None,
        lines: vec![FrameLine {
            function: p.function.clone(),
            file: p.file.clone(),
            line: p.line,
        }],
    };
    let mut groups = py.split_inclusive(|p| p.last_of_call);
    let mut out = Vec::with_capacity(native.len() + py.len());
    for f in native {
        if f.lines.iter().any(|l| l.function.starts_with(EVAL_FRAME))
            && let Some(group) = groups.next()
        {
            out.extend(group.iter().map(frame_of));
        } else {
            out.push(f);
        }
    }
    for group in groups {
        out.extend(group.iter().map(frame_of));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn native(name: &str) -> Frame {
        Frame {
            address: 1,
            mapping: None,
            lines: vec![FrameLine {
                function: name.into(),
                file: String::new(),
                line: 0,
            }],
        }
    }

    fn py(name: &str, last: bool) -> PyFrame {
        PyFrame {
            function: name.into(),
            file: "m.py".into(),
            line: 1,
            last_of_call: last,
        }
    }

    fn names(frames: &[Frame]) -> Vec<&str> {
        frames
            .iter()
            .map(|f| f.lines[0].function.as_str())
            .collect()
    }

    #[test]
    fn python_frames_replace_their_interpreter_loops() {
        let stack = vec![
            native("deflate"),
            native("zlib_compress"),
            native(EVAL_FRAME),
            native("PyObject_Call"),
            native(EVAL_FRAME),
            native("main"),
        ];
        let frames = [
            py("m.inner", false),
            py("m.outer", true),
            py("m.<module>", true),
        ];
        let out = splice(stack, &frames);
        assert_eq!(
            names(&out),
            [
                "deflate",
                "zlib_compress",
                "m.inner",
                "m.outer",
                "PyObject_Call",
                "m.<module>",
                "main"
            ]
        );
    }

    #[test]
    fn leftover_python_frames_go_below_the_native_ones() {
        let out = splice(
            vec![native(EVAL_FRAME)],
            &[py("m.f", true), py("m.<module>", true)],
        );
        assert_eq!(names(&out), ["m.f", "m.<module>"]);
        assert_eq!(names(&splice(vec![native("x")], &[])), ["x"]);
    }

    #[test]
    fn every_supported_version_has_a_layout() {
        for minor in 8..=13 {
            let l = PyLayout::of(minor).expect("layout");
            assert_eq!(l.minor, minor);
            assert!(l.code_filename != 0 && l.frame_code != 0xffff);
        }
        assert!(PyLayout::of(7).is_none());
        assert!(PyLayout::of(14).is_none());
    }

    #[test]
    fn instruction_offsets() {
        let l38 = PyLayout::of(8).unwrap();
        assert_eq!(instruction_offset(l38, 0, 10), Some(5));
        assert_eq!(instruction_offset(l38, 0, u64::from(u32::MAX)), None);
        let l312 = PyLayout::of(12).unwrap();
        let code = 0x1000;
        let start = code + u64::from(l312.code_adaptive);
        assert_eq!(instruction_offset(l312, code, start + 8), Some(4));
        assert_eq!(instruction_offset(l312, code, start - 2), None);
    }
}
