//! Finding the allocators of target processes: which mapped binaries export
//! allocator entry points (glibc, jemalloc, tcmalloc, mimalloc, a statically
//! linked allocator), and the file offsets where uprobes go.

use std::collections::HashMap;
use std::fs::File;
use std::os::unix::fs::MetadataExt as _;
use std::path::PathBuf;
use std::sync::Arc;

use crate::process::files;

use blazesym::inspect::{Inspector, source::Elf, source::Source};

/// Which BPF entry program handles an entry point (by argument layout).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum EntryKind {
    /// `size` first: `malloc`, `valloc`, `mallocx(size, flags)`, `operator new`.
    Malloc,
    /// `calloc(nmemb, size)`.
    Calloc,
    /// `realloc(ptr, size)`, `rallocx(ptr, size, flags)`.
    Realloc,
    /// `memalign(align, size)`, `aligned_alloc(align, size)`.
    Memalign,
    /// `posix_memalign(&ptr, align, size)`.
    PosixMemalign,
    /// `free(ptr)` and friends (`sdallocx`, `operator delete`).
    Free,
}

impl EntryKind {
    /// Whether the call returns a block (so it also needs a return probe).
    pub fn allocates(self) -> bool {
        self != EntryKind::Free
    }
}

/// Names whose presence makes a binary an allocator (so that, say,
/// libstdc++'s `operator new`, which calls malloc, is not probed twice).
const PRIMARY: &[&str] = &[
    "malloc",
    "tc_malloc",
    "mi_malloc",
    "mallocx",
    "je_malloc",
    "je_mallocx",
    "_rjem_malloc",
    "_rjem_mallocx",
];

/// Every entry point we probe, in order of preference when several names
/// share one address (glibc's `memalign` and `aligned_alloc` do).
pub const ENTRY_POINTS: &[(&str, EntryKind)] = &[
    // glibc, and any allocator that replaces the C API.
    ("malloc", EntryKind::Malloc),
    ("calloc", EntryKind::Calloc),
    ("realloc", EntryKind::Realloc),
    ("free", EntryKind::Free),
    ("posix_memalign", EntryKind::PosixMemalign),
    ("aligned_alloc", EntryKind::Memalign),
    ("memalign", EntryKind::Memalign),
    ("valloc", EntryKind::Malloc),
    ("pvalloc", EntryKind::Malloc),
    ("cfree", EntryKind::Free),
    // jemalloc's non-standard API, plain and with the je_ / _rjem_ (tikv-jemallocator) prefixes.
    ("mallocx", EntryKind::Malloc),
    ("rallocx", EntryKind::Realloc),
    ("dallocx", EntryKind::Free),
    ("sdallocx", EntryKind::Free),
    ("je_malloc", EntryKind::Malloc),
    ("je_calloc", EntryKind::Calloc),
    ("je_realloc", EntryKind::Realloc),
    ("je_free", EntryKind::Free),
    ("je_posix_memalign", EntryKind::PosixMemalign),
    ("je_aligned_alloc", EntryKind::Memalign),
    ("je_mallocx", EntryKind::Malloc),
    ("je_rallocx", EntryKind::Realloc),
    ("je_dallocx", EntryKind::Free),
    ("je_sdallocx", EntryKind::Free),
    ("_rjem_malloc", EntryKind::Malloc),
    ("_rjem_calloc", EntryKind::Calloc),
    ("_rjem_realloc", EntryKind::Realloc),
    ("_rjem_free", EntryKind::Free),
    ("_rjem_posix_memalign", EntryKind::PosixMemalign),
    ("_rjem_aligned_alloc", EntryKind::Memalign),
    ("_rjem_mallocx", EntryKind::Malloc),
    ("_rjem_rallocx", EntryKind::Realloc),
    ("_rjem_dallocx", EntryKind::Free),
    ("_rjem_sdallocx", EntryKind::Free),
    // tcmalloc (gperftools and its C++ operators, which do not call malloc).
    ("tc_malloc", EntryKind::Malloc),
    ("tc_calloc", EntryKind::Calloc),
    ("tc_realloc", EntryKind::Realloc),
    ("tc_free", EntryKind::Free),
    ("tc_free_sized", EntryKind::Free),
    ("tc_memalign", EntryKind::Memalign),
    ("tc_posix_memalign", EntryKind::PosixMemalign),
    ("tc_new", EntryKind::Malloc),
    ("tc_newarray", EntryKind::Malloc),
    ("tc_delete", EntryKind::Free),
    ("tc_deletearray", EntryKind::Free),
    ("_Znwm", EntryKind::Malloc),
    ("_Znam", EntryKind::Malloc),
    ("_ZdlPv", EntryKind::Free),
    ("_ZdaPv", EntryKind::Free),
    ("_ZdlPvm", EntryKind::Free),
    ("_ZdaPvm", EntryKind::Free),
    // mimalloc.
    ("mi_malloc", EntryKind::Malloc),
    ("mi_zalloc", EntryKind::Malloc),
    ("mi_malloc_aligned", EntryKind::Malloc),
    ("mi_calloc", EntryKind::Calloc),
    ("mi_realloc", EntryKind::Realloc),
    ("mi_free", EntryKind::Free),
    ("mi_posix_memalign", EntryKind::PosixMemalign),
];

/// One place to put a uprobe.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EntryPoint {
    /// Symbol name.
    pub symbol: String,
    /// Argument layout.
    pub kind: EntryKind,
    /// Offset of the function in the file.
    pub file_offset: u64,
    /// Offset to attach the uprobes to: the function start, or just past
    /// leading instructions the kernel would single-step (see [`fast_probe_skip`]).
    pub probe_offset: u64,
}

/// A binary (executable or shared object) that exports an allocator.
#[derive(Debug, Clone)]
pub struct AllocatorBinary {
    /// A path that reaches exactly [`Self::file`] (`/proc/self/fd/N`): what the uprobes
    /// attach to, never a path the workload could redirect meanwhile.
    pub path: PathBuf,
    /// The binary, opened inside the process's root (see [`crate::process::files`]).
    pub file: Arc<File>,
    /// The path inside the process's mount namespace, for messages.
    pub name: String,
    /// Device and inode: uprobes attach to the inode, so this identifies it.
    pub dev_ino: (u64, u64),
    /// Entry points found, one per address.
    pub entry_points: Vec<EntryPoint>,
}

/// Error while inspecting a binary.
#[derive(Debug, thiserror::Error)]
#[error("cannot read the symbols of {path}: {reason}")]
pub struct InspectError {
    /// The binary.
    pub path: PathBuf,
    /// The cause.
    pub reason: String,
}

/// A file-backed executable mapping of a process, opened.
#[derive(Debug, Clone)]
pub struct ExecutableFile {
    /// Its path inside the process's mount namespace.
    pub name: String,
    /// The file, opened with [`files::open_mapping`].
    pub file: Arc<File>,
    /// Device and inode of the file opened.
    pub dev_ino: (u64, u64),
}

impl ExecutableFile {
    /// A path reaching exactly this file.
    pub fn path(&self) -> PathBuf {
        files::fd_path(&self.file)
    }
}

/// The files of the executable mappings of a process, one per inode, opened as
/// [`files`] does (a mapped file that is gone, deleted, or not a regular file is left
/// out). Empty when the process is gone.
pub fn executable_files(pid: u32) -> Vec<ExecutableFile> {
    let Ok(maps) = crate::process::maps::executable_mappings(pid) else {
        return Vec::new();
    };
    let mut out: Vec<ExecutableFile> = Vec::new();
    for m in maps.mappings {
        if !m.is_file() || out.iter().any(|f| f.name == m.name) {
            continue;
        }
        let Ok(opened) = files::open_mapping(pid, &m.range, &m.name) else {
            continue;
        };
        let Ok(meta) = opened.file.metadata() else {
            continue;
        };
        let key = (meta.dev(), meta.ino());
        if !out.iter().any(|f| f.dev_ino == key) {
            out.push(ExecutableFile {
                name: m.name.trim_end_matches(" (deleted)").to_owned(),
                file: Arc::new(opened.file),
                dev_ino: key,
            });
        }
    }
    out
}

/// Caches, per inode, whether a binary is an allocator and where its entry
/// points are, so rescans of the target cgroups cost one `maps` read each. Each binary is
/// inspected once, so no blazesym inspector (and its file cache, which would tie the
/// finder to one thread) is kept between binaries.
#[derive(Default)]
pub struct AllocatorFinder {
    known: HashMap<(u64, u64), Option<Vec<EntryPoint>>>,
}

impl std::fmt::Debug for AllocatorFinder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AllocatorFinder")
            .field("known", &self.known.len())
            .finish()
    }
}

impl AllocatorFinder {
    /// An empty finder.
    pub fn new() -> Self {
        // blazesym maps the binaries it inspects: see crate::sigbus.
        crate::sigbus::install();
        Self::default()
    }

    /// The allocator binaries mapped by `pid` (empty when it has exited).
    pub fn allocators_of(&mut self, pid: u32) -> Vec<AllocatorBinary> {
        let mut out = Vec::new();
        for f in executable_files(pid) {
            let key = f.dev_ino;
            // A binary we cannot parse — or should not: see elf_check — is not an allocator
            // we can probe. Each is inspected with an inspector of its own, so that what
            // blazesym parsed of it is freed once its entry points are known.
            let known = self.known.entry(key).or_insert_with(|| {
                crate::symbolize::elf_check::check(&f.file)
                    .ok()
                    .and_then(|_| entry_points(&Inspector::new(), &f.path()).ok())
                    .filter(|e| !e.is_empty())
            });
            if let Some(entry_points) = known {
                out.push(AllocatorBinary {
                    path: f.path(),
                    file: f.file.clone(),
                    name: f.name,
                    dev_ino: key,
                    entry_points: entry_points.clone(),
                });
            }
        }
        out
    }
}

/// The allocator entry points a binary defines, one per address; empty when
/// it defines none of the [`PRIMARY`] allocation functions.
pub fn entry_points(
    inspector: &Inspector,
    path: &std::path::Path,
) -> Result<Vec<EntryPoint>, InspectError> {
    let mut elf = Elf::new(path);
    // Exported symbols are all we need; skip DWARF, which can be huge.
    elf.debug_syms = false;
    let src = Source::Elf(elf);
    let names: Vec<&str> = ENTRY_POINTS.iter().map(|(n, _)| *n).collect();
    let found = inspector.lookup(&src, &names).map_err(|e| InspectError {
        path: path.to_path_buf(),
        reason: e.to_string(),
    })?;
    let mut out: Vec<EntryPoint> = Vec::new();
    let mut primary = false;
    for ((name, kind), syms) in ENTRY_POINTS.iter().zip(found) {
        // Undefined (imported) symbols have no address or offset.
        let Some(offset) = syms
            .iter()
            .filter(|s| s.addr != 0)
            .find_map(|s| s.file_offset)
        else {
            continue;
        };
        primary |= PRIMARY.contains(name);
        if out.iter().any(|e| e.file_offset == offset) {
            continue;
        }
        out.push(EntryPoint {
            symbol: (*name).to_string(),
            kind: *kind,
            file_offset: offset,
            probe_offset: offset + fast_probe_skip(&read_code(path, offset)) as u64,
        });
    }
    if !primary {
        out.clear();
    }
    Ok(out)
}

/// The first bytes of the function at `offset` (empty when unreadable).
fn read_code(path: &std::path::Path, offset: u64) -> Vec<u8> {
    use std::os::unix::fs::FileExt as _;
    let mut buf = vec![0u8; 16];
    match File::open(path).and_then(|f| f.read_at(&mut buf, offset)) {
        Ok(n) => {
            buf.truncate(n);
            buf
        }
        Err(_) => Vec::new(),
    }
}

/// How many bytes of leading instructions to step over before the probe.
///
/// An x86 uprobe on an instruction the kernel cannot emulate is executed
/// out of line with a single-step trap; on virtual machines that trap costs
/// tens of microseconds, paid on every `free()` of every process (glibc's
/// `free` starts with `test %rdi,%rdi`, `memalign` with a RIP-relative
/// `cmpb`). Pushes and branches are emulated and cheap. So we skip leading
/// instructions that only set flags — they change no argument register and
/// not the stack pointer, which the return probe and the nesting check read —
/// and stop at anything else. Recognised, at most two of: `endbr64`,
/// `test r64,r64`, `test r32,r32`, `cmpb $imm8, disp32(%rip)`.
pub fn fast_probe_skip(code: &[u8]) -> usize {
    let mut at = 0;
    for _ in 0..2 {
        let rest = &code[at.min(code.len())..];
        let len = match rest {
            [0xf3, 0x0f, 0x1e, 0xfa, ..] => 4,
            [0x48, 0x85, modrm, ..] if modrm >> 6 == 0b11 => 3,
            [0x85, modrm, ..] if modrm >> 6 == 0b11 => 2,
            [0x80, 0x3d, _, _, _, _, _, ..] => 7,
            _ => break,
        };
        at += len;
    }
    at
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn steps_over_flag_only_prologues_and_nothing_else() {
        // glibc free: test %rdi,%rdi; je ... -> probe the (emulated) je.
        assert_eq!(
            fast_probe_skip(&[0x48, 0x85, 0xff, 0x0f, 0x84, 0xbf, 0, 0, 0]),
            3
        );
        // glibc memalign: cmpb $0,0x...(%rip); je ...
        assert_eq!(
            fast_probe_skip(&[0x80, 0x3d, 0x71, 0x0e, 0x14, 0, 0, 0x74, 0x07]),
            7
        );
        // endbr64; test %edi,%edi; push %rbp
        assert_eq!(
            fast_probe_skip(&[0xf3, 0x0f, 0x1e, 0xfa, 0x85, 0xff, 0x55]),
            6
        );
        // glibc malloc starts with push %r12: probe the start.
        assert_eq!(fast_probe_skip(&[0x41, 0x54, 0x55]), 0);
        // test with a memory operand (mod != 11) is not skipped; nor short code.
        assert_eq!(fast_probe_skip(&[0x48, 0x85, 0x07]), 0);
        assert_eq!(fast_probe_skip(&[0x80, 0x3d, 0]), 0);
        assert_eq!(fast_probe_skip(&[]), 0);
    }

    #[test]
    fn finds_glibc_and_our_linked_jemalloc_in_this_process() {
        let mut finder = AllocatorFinder::new();
        let allocators = finder.allocators_of(std::process::id());
        let libc = allocators
            .iter()
            .find(|a| a.name.contains("libc.so"))
            .unwrap_or_else(|| panic!("expected libc among {allocators:?}"));
        let kinds: Vec<_> = libc
            .entry_points
            .iter()
            .map(|e| e.symbol.as_str())
            .collect();
        for needed in ["malloc", "calloc", "realloc", "free", "posix_memalign"] {
            assert!(kinds.contains(&needed), "{needed} missing from {kinds:?}");
        }
        let mut offsets: Vec<_> = libc.entry_points.iter().map(|e| e.file_offset).collect();
        offsets.sort_unstable();
        offsets.dedup();
        assert_eq!(
            offsets.len(),
            libc.entry_points.len(),
            "one probe per address"
        );
        // Our own executable defines malloc too: it links jemalloc with unprefixed symbols
        // (through flamefleet-selfprof, for /debug/pprof/heap), which replaces the process's
        // malloc. It is found as an allocator of its own, with jemalloc's entry points.
        let exe = std::fs::read_link("/proc/self/exe").unwrap();
        let own = allocators
            .iter()
            .find(|a| std::path::Path::new(&a.name) == exe)
            .unwrap_or_else(|| panic!("expected {} among {allocators:?}", exe.display()));
        let own_symbols: Vec<_> = own.entry_points.iter().map(|e| e.symbol.as_str()).collect();
        for needed in ["malloc", "free", "mallocx"] {
            assert!(
                own_symbols.contains(&needed),
                "{needed} missing from {own_symbols:?}"
            );
        }
    }
}
