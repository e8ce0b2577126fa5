//! Names of JIT-compiled code from perf maps (`/tmp/perf-<pid>.map`), the
//! format V8 (`node --perf-basic-prof`), the JVM's perf-map agents, .NET and
//! LuaJIT write: one `START SIZE NAME` line (hex) per code object.
//!
//! The file belongs to the profiled process, which may be hostile:
//! * it is opened inside the process's own root (`/proc/<pid>/root`) with
//!   `openat2(RESOLVE_IN_ROOT)`, so a symlink planted at that path cannot
//!   point the agent at the node's files (whose lines would then appear as
//!   function names in a profile the tenant downloads);
//! * only a regular file is read (a FIFO would block the agent), non-blocking,
//!   at most [`MAX_BYTES`];
//! * lines are parsed defensively: malformed ones are skipped, names are cut
//!   at [`MAX_NAME`] bytes, at most [`MAX_ENTRIES`] entries are kept.
//!
//! The pid in the file name is the process's pid in its own PID namespace
//! (the last `NSpid` field of `/proc/<pid>/status`).

use std::fs::File;
use std::io::Read as _;
use std::os::fd::{FromRawFd as _, OwnedFd};

/// Largest perf map read (a long-running V8 process writes a few MiB).
pub const MAX_BYTES: u64 = 64 << 20;
/// Entries kept per process.
pub const MAX_ENTRIES: usize = 1 << 20;
/// Longest name kept, in bytes.
pub const MAX_NAME: usize = 512;

/// One process's JIT symbols, sorted by start address.
#[derive(Debug, Clone, Default)]
pub struct PerfMap {
    entries: Vec<(u64, u64, String)>,
}

impl PerfMap {
    /// Parses perf-map text; malformed lines are skipped.
    pub fn parse(text: &str) -> Self {
        let mut entries = Vec::new();
        for line in text.lines() {
            if entries.len() >= MAX_ENTRIES {
                break;
            }
            let line = line.trim_start();
            let mut parts = line.splitn(3, [' ', '\t']);
            let (Some(start), Some(size), Some(name)) = (parts.next(), parts.next(), parts.next())
            else {
                continue;
            };
            let hex = |s: &str| u64::from_str_radix(s.trim_start_matches("0x"), 16).ok();
            let (Some(start), Some(size)) = (hex(start), hex(size)) else {
                continue;
            };
            let name = name.trim();
            if size == 0 || name.is_empty() {
                continue;
            }
            let mut cut = name.len().min(MAX_NAME);
            while !name.is_char_boundary(cut) {
                cut -= 1;
            }
            entries.push((start, start.saturating_add(size), name[..cut].to_owned()));
        }
        // Stable: of two entries at one address, the later line (newer code) wins below.
        entries.sort_by_key(|e| e.0);
        Self { entries }
    }

    /// Reads the perf map of process `tgid`, if it has one.
    pub fn read(tgid: u32) -> Option<Self> {
        let nspid = ns_pid(tgid).unwrap_or(tgid);
        let file = open_in_root(tgid, &format!("tmp/perf-{nspid}.map"))?;
        let meta = file.metadata().ok()?;
        if !meta.file_type().is_file() {
            return None;
        }
        let mut bytes = Vec::new();
        file.take(MAX_BYTES).read_to_end(&mut bytes).ok()?;
        Some(Self::parse(&String::from_utf8_lossy(&bytes)))
    }

    /// The name of the code object containing `addr`.
    pub fn lookup(&self, addr: u64) -> Option<&str> {
        let i = self.entries.partition_point(|e| e.0 <= addr);
        // Code is replaced in place: the nearest start may be a small stub
        // inside an older, larger object; look a few entries back.
        self.entries[..i]
            .iter()
            .rev()
            .take(8)
            .find(|e| addr < e.1)
            .map(|e| e.2.as_str())
    }

    /// Number of entries.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether there are no entries.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}

/// The pid of `tgid` in its innermost PID namespace.
fn ns_pid(tgid: u32) -> Option<u32> {
    let status = std::fs::read_to_string(format!("/proc/{tgid}/status")).ok()?;
    let line = status.lines().find(|l| l.starts_with("NSpid:"))?;
    line.split_whitespace().last()?.parse().ok()
}

/// Opens `rel` relative to the root directory of process `tgid`, resolving
/// every component (symlinks included) inside that root.
fn open_in_root(tgid: u32, rel: &str) -> Option<File> {
    let root = File::open(format!("/proc/{tgid}/root")).ok()?;
    let path = std::ffi::CString::new(rel).ok()?;
    // SAFETY: open_how is plain data; all-zero is its documented default.
    let mut how: libc::open_how = unsafe { std::mem::zeroed() };
    how.flags = (libc::O_RDONLY | libc::O_NONBLOCK | libc::O_CLOEXEC | libc::O_NOCTTY) as u64;
    how.resolve = libc::RESOLVE_IN_ROOT | libc::RESOLVE_NO_MAGICLINKS;
    // SAFETY: valid dirfd, NUL-terminated path, open_how of the size passed.
    let fd = unsafe {
        libc::syscall(
            libc::SYS_openat2,
            std::os::fd::AsRawFd::as_raw_fd(&root),
            path.as_ptr(),
            &how as *const libc::open_how,
            std::mem::size_of::<libc::open_how>(),
        )
    };
    if fd < 0 {
        return None;
    }
    // SAFETY: the syscall returned a new descriptor we own.
    Some(File::from(unsafe { OwnedFd::from_raw_fd(fd as i32) }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_v8_lines_and_skips_garbage() {
        let m = PerfMap::parse(
            "3a8c0e0c0 1c0 JS:*hot /app/x.js:3:13\n\
             zzz 10 bad\n\
             1000 0 empty\n\
             0x2000 20 Builtin:ArgumentsAdaptor\n\
             3000\n\
             4000 10 \n",
        );
        assert_eq!(m.len(), 2);
        assert_eq!(m.lookup(0x3a8c0e0c0 + 0x10), Some("JS:*hot /app/x.js:3:13"));
        assert_eq!(m.lookup(0x2010), Some("Builtin:ArgumentsAdaptor"));
        assert_eq!(m.lookup(0x2020), None);
        assert_eq!(m.lookup(0x10), None);
    }

    #[test]
    fn long_names_are_cut_on_a_char_boundary() {
        let name = "é".repeat(MAX_NAME);
        let m = PerfMap::parse(&format!("100 10 {name}\n"));
        let got = m.lookup(0x100).unwrap();
        assert!(got.len() <= MAX_NAME && got.starts_with('é'));
    }

    #[test]
    fn symlinks_cannot_escape_the_process_root() {
        // Our own root is "/", so resolution in root still finds /tmp files;
        // what matters is that a dangling absolute symlink resolves inside
        // the root and a FIFO is refused without blocking.
        let dir = tempfile::tempdir_in("/tmp").unwrap();
        let fifo = dir.path().join("fifo");
        let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
        // SAFETY: valid path.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        let rel = fifo.strip_prefix("/").unwrap().to_str().unwrap();
        let f = open_in_root(std::process::id(), rel).expect("opens non-blocking");
        assert!(!f.metadata().unwrap().file_type().is_file());
    }
}
