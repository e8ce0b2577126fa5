//! Opening the files of a profiled process — its executable, its libraries, its perf map —
//! the one way the agent does it.
//!
//! Those files belong to the workload, which may be hostile: it can put a FIFO, a device
//! or a symlink where its binary was, or serve the file from a FUSE mount it controls.
//! A plain `open("/proc/<pid>/root/<path>")` would then block the agent forever on the
//! FIFO, read without end from a device, stall on every FUSE read, or — an absolute
//! symlink being resolved in the *agent's* mount namespace — open another tenant's
//! binary through `/proc/<other pid>/root/...` and name that tenant's functions in the
//! attacker's profile. So every file of a target is opened here:
//!
//! * relative to the process's own root with `openat2(RESOLVE_IN_ROOT |
//!   RESOLVE_NO_MAGICLINKS)`: absolute symlinks and `..` stay inside that root, and no
//!   `/proc` magic link can lead out of it;
//! * `O_NONBLOCK`, so opening a FIFO returns at once;
//! * kept only if `fstat` says it is a regular file, and `fstatfs` that it is not on
//!   FUSE (whose server, in the pod, decides when each read returns);
//! * read with [`read_bounded`], never more than the caller's limit.
//!
//! The executable is opened through `/proc/<pid>/exe` ([`open_exe`]): that link is the
//! kernel's reference to the very file the process runs (even deleted or replaced), not
//! a path the workload can redirect.
//!
//! A library that takes a path rather than a file (blazesym) gets [`fd_path`] of the
//! file opened here: reopening `/proc/self/fd/N` reaches the same inode, already checked.

use std::fs::File;
use std::io::Read as _;
use std::os::fd::AsFd as _;
use std::os::unix::fs::FileTypeExt as _;
use std::path::PathBuf;

use nix::fcntl::{OFlag, OpenHow, ResolveFlag, openat2};

/// `f_type` of FUSE filesystems (`FUSE_SUPER_MAGIC`).
const FUSE_SUPER_MAGIC: i64 = 0x6573_5546;

/// Why a target's file was not opened or read.
#[derive(Debug, thiserror::Error)]
pub enum TargetFileError {
    /// The file could not be opened (missing, no permission, the process is gone).
    #[error("opening {path} in the root of process {pid}: {source}")]
    Open {
        /// The process.
        pid: u32,
        /// The path inside its mount namespace.
        path: String,
        /// The cause.
        source: std::io::Error,
    },
    /// Something other than a regular file is at the path.
    #[error(
        "{path} in the root of process {pid} is a {kind}, not a regular file: not read (a \
         workload that puts a FIFO or a device where its binary was would otherwise block or \
         flood the agent)"
    )]
    NotRegular {
        /// The process.
        pid: u32,
        /// The path inside its mount namespace.
        path: String,
        /// What it is ("FIFO", "character device", ...).
        kind: &'static str,
    },
    /// The file lives on FUSE.
    #[error(
        "{path} in the root of process {pid} is on a FUSE filesystem: not read (its server, \
         in the workload, could stall every read)"
    )]
    Fuse {
        /// The process.
        pid: u32,
        /// The path inside its mount namespace.
        path: String,
    },
    /// The file is larger than the reader accepts.
    #[error("{path} of process {pid} is {size} bytes, above the {limit}-byte limit: not read")]
    TooLarge {
        /// The process.
        pid: u32,
        /// The path inside its mount namespace.
        path: String,
        /// Its size.
        size: u64,
        /// The reader's limit.
        limit: u64,
    },
    /// Reading failed.
    #[error("reading {path} of process {pid}: {source}")]
    Read {
        /// The process.
        pid: u32,
        /// The path inside its mount namespace.
        path: String,
        /// The cause.
        source: std::io::Error,
    },
}

/// A regular file of a target process, opened and checked as the module docs say.
#[derive(Debug)]
pub struct TargetFile {
    /// The open file.
    pub file: File,
    /// Its size when opened.
    pub size: u64,
    /// The path as the process sees it (for messages).
    pub path: String,
    /// The process.
    pub pid: u32,
}

impl TargetFile {
    /// Reads the whole file, refusing it when larger than `limit` bytes (at open time or
    /// while reading: it may grow).
    pub fn read_all(&self, limit: u64) -> Result<Vec<u8>, TargetFileError> {
        if self.size > limit {
            return Err(TargetFileError::TooLarge {
                pid: self.pid,
                path: self.path.clone(),
                size: self.size,
                limit,
            });
        }
        let bytes = read_bounded(&self.file, limit).map_err(|source| TargetFileError::Read {
            pid: self.pid,
            path: self.path.clone(),
            source,
        })?;
        if bytes.len() as u64 > limit {
            return Err(TargetFileError::TooLarge {
                pid: self.pid,
                path: self.path.clone(),
                size: bytes.len() as u64,
                limit,
            });
        }
        Ok(bytes)
    }
}

/// Opens `path` (as the process sees it, absolute or not) inside the root directory of
/// process `pid`. A trailing `" (deleted)"` (as `/proc/<pid>/maps` prints unlinked files)
/// is not stripped: the caller decides whether a deleted file's path still means it.
pub fn open_in_root(pid: u32, path: &str) -> Result<TargetFile, TargetFileError> {
    let open_err = |source: std::io::Error| TargetFileError::Open {
        pid,
        path: path.to_owned(),
        source,
    };
    // O_PATH: the root needs no read permission to resolve below it.
    let root = nix::fcntl::open(
        format!("/proc/{pid}/root").as_str(),
        OFlag::O_PATH | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC,
        nix::sys::stat::Mode::empty(),
    )
    .map_err(|e| open_err(e.into()))?;
    let how = OpenHow::new()
        .flags(OFlag::O_RDONLY | OFlag::O_NONBLOCK | OFlag::O_CLOEXEC | OFlag::O_NOCTTY)
        .resolve(ResolveFlag::RESOLVE_IN_ROOT | ResolveFlag::RESOLVE_NO_MAGICLINKS);
    let relative = path.trim_start_matches('/');
    let fd = openat2(
        root.as_fd(),
        if relative.is_empty() { "." } else { relative },
        how,
    )
    .map_err(|e| open_err(e.into()))?;
    checked(pid, path, File::from(fd))
}

/// Opens the executable of process `pid` through `/proc/<pid>/exe`: the file it runs, even
/// when its path was unlinked or replaced since.
pub fn open_exe(pid: u32) -> Result<TargetFile, TargetFileError> {
    let path = format!("/proc/{pid}/exe");
    let file = nix::fcntl::open(
        path.as_str(),
        OFlag::O_RDONLY | OFlag::O_NONBLOCK | OFlag::O_CLOEXEC | OFlag::O_NOCTTY,
        nix::sys::stat::Mode::empty(),
    )
    .map(File::from)
    .map_err(|e| TargetFileError::Open {
        pid,
        path: path.clone(),
        source: e.into(),
    })?;
    checked(pid, &path, file)
}

/// Opens the file of the mapping `range` (`start-end` as in `/proc/<pid>/maps`) through
/// `/proc/<pid>/map_files/`: the very inode mapped. Needs CAP_SYS_ADMIN (which the chart's
/// agent does not hold), so callers fall back to [`open_exe`] or [`open_in_root`].
pub fn open_mapped(pid: u32, range: &str) -> Result<TargetFile, TargetFileError> {
    let path = format!("/proc/{pid}/map_files/{range}");
    let file = nix::fcntl::open(
        path.as_str(),
        OFlag::O_RDONLY | OFlag::O_NONBLOCK | OFlag::O_CLOEXEC | OFlag::O_NOCTTY,
        nix::sys::stat::Mode::empty(),
    )
    .map(File::from)
    .map_err(|e| TargetFileError::Open {
        pid,
        path: path.clone(),
        source: e.into(),
    })?;
    checked(pid, &path, file)
}

/// The file a mapping of `pid` named `name` in `/proc/<pid>/maps` (at `range`) maps:
/// through `map_files` where the agent may, else `/proc/<pid>/exe` when it is the
/// executable, else the path inside the process's root. A deleted file (`" (deleted)"`)
/// is never looked up by path: whatever is at that path now is not what was mapped.
pub fn open_mapping(pid: u32, range: &str, name: &str) -> Result<TargetFile, TargetFileError> {
    if let Ok(f) = open_mapped(pid, range) {
        return Ok(f);
    }
    let path = name.strip_suffix(" (deleted)");
    let deleted = path.is_some();
    let path = path.unwrap_or(name);
    if is_exe_path(pid, path) {
        return open_exe(pid).map(|mut f| {
            f.path = path.to_owned();
            f
        });
    }
    if deleted {
        return Err(TargetFileError::Open {
            pid,
            path: name.to_owned(),
            source: std::io::Error::new(
                std::io::ErrorKind::NotFound,
                "the mapped file was deleted; its path now names another file, if any",
            ),
        });
    }
    open_in_root(pid, path)
}

/// Whether `path` (without `" (deleted)"`) is the executable of `pid`.
fn is_exe_path(pid: u32, path: &str) -> bool {
    std::fs::read_link(format!("/proc/{pid}/exe"))
        .ok()
        .and_then(|p| p.to_str().map(|s| s.trim_end_matches(" (deleted)") == path))
        .unwrap_or(false)
}

/// Keeps `file` if it is a regular file off FUSE.
fn checked(pid: u32, path: &str, file: File) -> Result<TargetFile, TargetFileError> {
    let meta = file.metadata().map_err(|source| TargetFileError::Open {
        pid,
        path: path.to_owned(),
        source,
    })?;
    let ft = meta.file_type();
    if !ft.is_file() {
        let kind = if ft.is_fifo() {
            "FIFO"
        } else if ft.is_char_device() {
            "character device"
        } else if ft.is_block_device() {
            "block device"
        } else if ft.is_socket() {
            "socket"
        } else if ft.is_dir() {
            "directory"
        } else {
            "special file"
        };
        return Err(TargetFileError::NotRegular {
            pid,
            path: path.to_owned(),
            kind,
        });
    }
    if let Ok(fs) = nix::sys::statfs::fstatfs(&file) {
        #[allow(clippy::unnecessary_cast)] // f_type's width differs between libcs.
        if fs.filesystem_type().0 as i64 == FUSE_SUPER_MAGIC {
            return Err(TargetFileError::Fuse {
                pid,
                path: path.to_owned(),
            });
        }
    }
    Ok(TargetFile {
        size: meta.len(),
        file,
        path: path.to_owned(),
        pid,
    })
}

/// Reads `file` from its current position to the end, but never more than `limit + 1`
/// bytes (so a caller can tell "exactly `limit`" from "more").
pub fn read_bounded(file: &File, limit: u64) -> std::io::Result<Vec<u8>> {
    let mut out = Vec::new();
    file.take(limit.saturating_add(1)).read_to_end(&mut out)?;
    Ok(out)
}

/// A path that reopens exactly `file` (`/proc/self/fd/N`), for libraries that take paths.
/// Valid while `file` stays open.
pub fn fd_path(file: &File) -> PathBuf {
    use std::os::fd::AsRawFd as _;
    PathBuf::from(format!("/proc/self/fd/{}", file.as_raw_fd()))
}

/// An ELF parser's view of a target's file (`object::ReadRef`): reads go through
/// `object`'s `ReadCache` (`pread`, no mapping: a workload truncating its file cannot
/// fault the agent), and every read is bounded — none larger than `max_read` bytes, all
/// together at most `budget` bytes. The file's size bounds nothing: a sparse file costs its
/// owner no disk, yet its section headers may claim gigabytes.
pub struct BoundedReader {
    cache: object::read::ReadCache<File>,
    max_read: u64,
    left: std::cell::Cell<u64>,
}

impl std::fmt::Debug for BoundedReader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BoundedReader")
            .field("max_read", &self.max_read)
            .field("left", &self.left.get())
            .finish()
    }
}

impl BoundedReader {
    /// Reads `file` (a duplicate of its descriptor) with the given bounds.
    pub fn new(file: &File, max_read: u64, budget: u64) -> std::io::Result<Self> {
        Ok(Self {
            cache: object::read::ReadCache::new(file.try_clone()?),
            max_read,
            left: std::cell::Cell::new(budget),
        })
    }

    /// Bytes still allowed.
    pub fn left(&self) -> u64 {
        self.left.get()
    }
}

impl<'a> object::ReadRef<'a> for &'a BoundedReader {
    fn len(self) -> Result<u64, ()> {
        (&self.cache).len()
    }

    fn read_bytes_at(self, offset: u64, size: u64) -> Result<&'a [u8], ()> {
        if size > self.max_read || size > self.left.get() {
            return Err(());
        }
        // Counted even when the cache holds the range already: an overestimate.
        self.left.set(self.left.get() - size);
        (&self.cache).read_bytes_at(offset, size)
    }

    fn read_bytes_at_until(
        self,
        range: std::ops::Range<u64>,
        delimiter: u8,
    ) -> Result<&'a [u8], ()> {
        // `object` reads at most 4 KiB for one string; count that much.
        let cost = 4096.min(range.end.saturating_sub(range.start));
        if cost > self.left.get() {
            return Err(());
        }
        self.left.set(self.left.get() - cost);
        (&self.cache).read_bytes_at_until(range, delimiter)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mkfifo(path: &std::path::Path) {
        nix::unistd::mkfifo(path, nix::sys::stat::Mode::from_bits_truncate(0o600)).expect("mkfifo");
    }

    #[test]
    fn a_fifo_is_refused_without_blocking() {
        let dir = tempfile::tempdir_in("/tmp").unwrap();
        let fifo = dir.path().join("fifo");
        mkfifo(&fifo);
        let e = open_in_root(std::process::id(), fifo.to_str().unwrap()).unwrap_err();
        assert!(
            matches!(e, TargetFileError::NotRegular { kind: "FIFO", .. }),
            "{e}"
        );
        assert!(
            e.to_string().contains("is a FIFO, not a regular file"),
            "{e}"
        );
    }

    #[test]
    fn absolute_symlinks_and_dotdot_stay_inside_the_root() {
        // A process whose root is a directory of ours: chroot in a child, then the parent
        // opens paths "in its root" as the agent would.
        let dir = tempfile::tempdir_in("/tmp").unwrap();
        let root = dir.path().join("root");
        std::fs::create_dir_all(root.join("app")).unwrap();
        std::fs::write(root.join("app/own"), b"inside").unwrap();
        std::fs::write(dir.path().join("outside"), b"outside").unwrap();
        let outside = dir.path().join("outside");
        std::os::unix::fs::symlink(&outside, root.join("app/abs")).unwrap();
        std::os::unix::fs::symlink("../../../outside", root.join("app/up")).unwrap();
        std::os::unix::fs::symlink("/proc/1/root/etc/hostname", root.join("app/magic")).unwrap();
        let mut cmd = {
            use std::os::unix::ffi::OsStrExt as _;
            use std::os::unix::process::CommandExt as _;
            let root = std::ffi::CString::new(root.as_os_str().as_bytes()).unwrap();
            let mut c = std::process::Command::new("/bin/sleep");
            c.arg("60");
            // SAFETY: chroot(2) only, between fork and exec, on memory prepared before.
            unsafe {
                c.pre_exec(move || {
                    if libc::chroot(root.as_ptr()) == 0 {
                        Ok(())
                    } else {
                        Err(std::io::Error::last_os_error())
                    }
                });
            }
            c
        };
        // The exec happens after the chroot: give the new root a sleep to run.
        std::fs::create_dir_all(root.join("bin")).unwrap();
        std::fs::copy("/bin/sleep", root.join("bin/sleep")).unwrap();
        for lib in ldd_libs("/bin/sleep") {
            let dst = root.join(lib.trim_start_matches('/'));
            std::fs::create_dir_all(dst.parent().unwrap()).unwrap();
            std::fs::copy(&lib, dst).unwrap();
        }
        let mut child = cmd.spawn().expect("sleep in a chroot");
        let pid = child.id();
        let read = |p: &str| {
            open_in_root(pid, p)
                .and_then(|f| f.read_all(1 << 10))
                .map(|b| String::from_utf8_lossy(&b).into_owned())
        };
        assert_eq!(read("/app/own").unwrap(), "inside");
        // The absolute symlink and the climbing one resolve inside the root, where
        // nothing of that name exists; the magic link is refused.
        assert!(read("/app/abs").is_err());
        assert!(read("/app/up").is_err());
        assert!(read("/app/magic").is_err());
        let _ = child.kill();
        let _ = child.wait();
    }

    fn ldd_libs(bin: &str) -> Vec<String> {
        let out = std::process::Command::new("ldd").arg(bin).output().unwrap();
        String::from_utf8_lossy(&out.stdout)
            .split_whitespace()
            .filter(|w| w.starts_with('/'))
            .map(str::to_owned)
            .collect()
    }

    #[test]
    fn reads_are_bounded() {
        let dir = tempfile::tempdir_in("/tmp").unwrap();
        let p = dir.path().join("big");
        std::fs::write(&p, vec![7u8; 4096]).unwrap();
        let f = open_in_root(std::process::id(), p.to_str().unwrap()).unwrap();
        assert_eq!(f.size, 4096);
        assert!(matches!(
            f.read_all(100),
            Err(TargetFileError::TooLarge { size: 4096, .. })
        ));
        assert_eq!(f.read_all(4096).unwrap().len(), 4096);
    }

    #[test]
    fn an_elf_reader_refuses_reads_beyond_its_bounds() {
        use object::ReadRef as _;
        let dir = tempfile::tempdir_in("/tmp").unwrap();
        let p = dir.path().join("sparse");
        let f = File::create(&p).unwrap();
        // A sparse gigabyte: free for its owner.
        f.set_len(1 << 30).unwrap();
        let f = open_in_root(std::process::id(), p.to_str().unwrap()).unwrap();
        let r = BoundedReader::new(&f.file, 1 << 20, 3 << 20).unwrap();
        assert_eq!((&r).len(), Ok(1 << 30));
        assert!((&r).read_bytes_at(0, 2 << 20).is_err(), "above max_read");
        for i in 0..3 {
            assert!((&r).read_bytes_at(i << 20, 1 << 20).is_ok());
        }
        assert!((&r).read_bytes_at(5 << 20, 1).is_err(), "budget spent");
    }

    #[test]
    fn a_deleted_mapping_is_not_looked_up_by_path() {
        let e = open_mapping(std::process::id(), "0-1", "/tmp/nothing-here (deleted)");
        // Our own exe is not that path; the deleted path is not opened.
        assert!(
            e.unwrap_err().to_string().contains("was deleted"),
            "deleted paths are not opened"
        );
        // Our executable is reached through /proc/<pid>/exe.
        let exe = std::fs::read_link("/proc/self/exe").unwrap();
        let f = open_mapping(std::process::id(), "0-1", exe.to_str().unwrap()).unwrap();
        assert!(f.size > 0);
    }
}
