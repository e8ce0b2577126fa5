//! Looking at a workload's ELF file before blazesym parses it.
//!
//! blazesym maps a binary and builds its symbol index and DWARF state in the agent's
//! memory, decompressing compressed sections whole; it also follows the binary's debug
//! links. All of that is the workload's to choose: a sparse file costs its owner nothing on
//! disk yet may declare a symbol table of gigabytes; a zlib-compressed `.debug_info` of a
//! few KiB may declare terabytes; a `.gnu_debuglink` names a file relative to the binary's
//! directory *as the agent sees it*, so `../../proc/<pid>/root/tmp/fifo` would have the
//! agent open (and block on) a FIFO, or read another tenant's debug file. So every binary
//! is first read here with `object`, through a bounded `pread` cache
//! ([`crate::process::files::BoundedReader`]), and [`check`] says:
//!
//! * whether blazesym may parse it at all (symbol tables within [`MAX_SYMBOL_BYTES`]);
//! * whether it may read its DWARF: not when the binary has a debug link (its DWARF is in
//!   another file, which the agent does not look for), compressed DWARF decompressing to
//!   more than [`MAX_DECOMPRESSED_BYTES`], or DWARF beyond [`MAX_DWARF_BYTES`];
//! * what parsing it is likely to cost in memory ([`ElfCheck::cost`]), which the caller
//!   charges to its budget;
//! * its GNU build ID (read here, so nothing else needs to map the file for it), and its
//!   separate debug file when it has a debug link: looked for by build ID alone in the
//!   agent's own debug directories (hex digits name it; nothing of the workload's does).

use std::path::{Path, PathBuf};

use object::{Object as _, ObjectSection as _, ObjectSegment as _};

use crate::process::files::BoundedReader;

/// Largest symbol tables (`.symtab` and `.dynsym` together) of a binary blazesym parses: four
/// million symbols, more than the largest programs have (blazesym's index takes about as
/// much memory as the table).
pub const MAX_SYMBOL_BYTES: u64 = 96 << 20;
/// Most bytes compressed DWARF sections may decompress to (blazesym decompresses them whole,
/// into the agent's memory, when it reads the DWARF).
pub const MAX_DECOMPRESSED_BYTES: u64 = 128 << 20;
/// Most DWARF (`.debug_*`, as stored) whose line tables and inlined functions blazesym
/// reads; beyond it the binary is symbolized from its symbol table alone.
pub const MAX_DWARF_BYTES: u64 = 1 << 30;
/// What one check reads of the file: headers, section names, notes.
const READ_BUDGET: u64 = 16 << 20;
/// Largest single read (the section header table of a binary with 65k sections is 4 MiB).
const MAX_READ: u64 = 8 << 20;

/// What [`check`] found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ElfCheck {
    /// GNU build ID, hex; empty without one.
    pub build_id: String,
    /// Whether blazesym may read the DWARF (line numbers, inlined functions).
    pub debug_syms: bool,
    /// Why not, when the reason is worth a note in the profile (a debug link is not: the
    /// binary's own symbols are used, as for any binary whose debug file is not installed).
    pub no_debug_reason: Option<String>,
    /// Estimated memory blazesym keeps while it holds the binary, in bytes.
    pub cost: u64,
    /// The same when it reads the symbol tables alone.
    pub symbols_cost: u64,
    /// The binary's separate debug file, found by its build ID in the agent's own debug
    /// directories (`/usr/lib/debug/.build-id/…`) when it has a debug link: its DWARF is
    /// read from there, by virtual address ([`Self::virtual_address`]).
    pub debug_file: Option<PathBuf>,
    /// Loadable segments: (file offset, virtual address, size in the file).
    pub segments: Vec<(u64, u64, u64)>,
    /// A Go binary without DWARF (`-ldflags=-w`, with or without `-s`): the size of its
    /// `.gopclntab`, from which it is symbolized instead ([`crate::gopclntab`]).
    pub go_pclntab: Option<u64>,
}

impl ElfCheck {
    /// The virtual address of `file_offset` (in a loadable segment).
    pub fn virtual_address(&self, file_offset: u64) -> Option<u64> {
        self.segments
            .iter()
            .find(|&&(off, _, size)| file_offset >= off && file_offset - off < size)
            .map(|&(off, vaddr, _)| file_offset - off + vaddr)
    }
}

/// The agent's own debug directories (blazesym's defaults), searched by build ID only.
const DEBUG_DIRS: [&str; 2] = ["/usr/lib/debug", "/lib/debug"];

/// The separate debug file of build ID `build_id` (hex) in [`DEBUG_DIRS`], if one is there
/// and passes [`check`]: the agent's own files, named by hex digits only.
fn build_id_debug_file(build_id: &str) -> Option<(PathBuf, ElfCheck)> {
    if build_id.len() < 4 || !build_id.bytes().all(|b| b.is_ascii_hexdigit()) {
        return None;
    }
    let (dir, file) = build_id.split_at(2);
    DEBUG_DIRS.iter().find_map(|root| {
        let path = Path::new(root)
            .join(".build-id")
            .join(dir)
            .join(format!("{file}.debug"));
        let opened = std::fs::File::open(&path).ok()?;
        if !opened.metadata().ok()?.is_file() {
            return None;
        }
        let checked = check_file(&opened, false).ok()?;
        let path = if checked.debug_syms {
            decompressed(&path).unwrap_or(path)
        } else {
            path
        };
        Some((path, checked))
    })
}

/// Most bytes of the agent's own debug files kept decompressed in memory, all together.
const MAX_KEPT_DECOMPRESSED: u64 = 256 << 20;

/// The agent's own debug files with compressed DWARF, decompressed once, by path: each
/// kept as an in-memory file (`memfd`, its `/proc/self/fd` path), or `None` when it has no
/// compressed DWARF or could not be kept.
static DECOMPRESSED: std::sync::Mutex<Option<KeptCopies>> = std::sync::Mutex::new(None);

/// Bytes kept, and the copy of each debug file (`None`: none made, or none to make).
type KeptCopies = (
    u64,
    std::collections::HashMap<PathBuf, Option<std::fs::File>>,
);

/// A copy of the debug file at `path` (one of the agent's own, in [`DEBUG_DIRS`]) with its
/// compressed DWARF sections decompressed, made once per agent and kept in memory (within
/// [`MAX_KEPT_DECOMPRESSED`]). blazesym decompresses a compressed section whole every time
/// a symbolizer loads the file, and the agent makes one symbolizer per capture: for a
/// distribution's debug files (Debian compresses them: libc's `.debug_info` is 2 MiB of
/// zlib) that was the largest part of a continuous profile's CPU cost after each window,
/// paid whenever a capture met an address of the library it had not symbolized before.
/// Uncompressed, blazesym maps the sections and reads only what a lookup needs.
fn decompressed(path: &Path) -> Option<PathBuf> {
    let mut kept = DECOMPRESSED
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let (bytes, files) = kept.get_or_insert_with(Default::default);
    if let Some(file) = files.get(path) {
        return file.as_ref().map(crate::process::files::fd_path);
    }
    let copy = std::fs::read(path)
        .ok()
        .and_then(|data| decompress_sections(&data))
        .filter(|data| bytes.saturating_add(data.len() as u64) <= MAX_KEPT_DECOMPRESSED)
        .and_then(|data| {
            let file = memory_file(&data).ok()?;
            *bytes += data.len() as u64;
            Some(file)
        });
    let out = copy.as_ref().map(crate::process::files::fd_path);
    files.insert(path.to_path_buf(), copy);
    out
}

/// An in-memory file holding `data`.
fn memory_file(data: &[u8]) -> std::io::Result<std::fs::File> {
    use std::io::Write as _;
    use std::os::fd::FromRawFd as _;
    // SAFETY: the name is a NUL-terminated string; the flags are valid.
    let fd = unsafe { libc::memfd_create(c"flamefleet-debug".as_ptr(), libc::MFD_CLOEXEC) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: memfd_create returned a new descriptor that nothing else owns.
    let mut file = unsafe { std::fs::File::from_raw_fd(fd) };
    file.write_all(data)?;
    Ok(file)
}

/// `SHF_COMPRESSED` of elf.h.
const SHF_COMPRESSED: u64 = 0x800;

/// `data` (a little-endian 64-bit ELF file) with its compressed DWARF sections
/// (`SHF_COMPRESSED`, those blazesym loads) decompressed: each appended at the end, its
/// section header pointed at it and its flag cleared; the rest of the file unchanged.
/// `None` when nothing was compressed or the file is not such an ELF file.
fn decompress_sections(data: &[u8]) -> Option<Vec<u8>> {
    use object::read::elf::{ElfFile64, FileHeader as _};
    let elf = ElfFile64::<object::LittleEndian>::parse(data).ok()?;
    let header = elf.elf_header();
    let endian = object::LittleEndian;
    let shoff = usize::try_from(header.e_shoff(endian)).ok()?;
    let shentsize = usize::from(header.e_shentsize(endian));
    if shentsize < 64 {
        return None;
    }
    let mut out = data.to_vec();
    let mut changed = false;
    for section in elf.sections() {
        let name = section.name().unwrap_or("");
        if !is_loaded_dwarf(name) || name.starts_with(".zdebug") {
            continue;
        }
        let Ok(range) = section.compressed_file_range() else {
            continue;
        };
        if range.format == object::CompressionFormat::None {
            continue;
        }
        let Ok(plain) = section.uncompressed_data() else {
            return None;
        };
        out.resize(out.len().next_multiple_of(8), 0);
        let offset = out.len() as u64;
        out.extend_from_slice(&plain);
        let at = shoff.checked_add(section.index().0.checked_mul(shentsize)?)?;
        let entry = out.get_mut(at..at + 64)?;
        let flags = u64::from_le_bytes(entry[8..16].try_into().ok()?) & !SHF_COMPRESSED;
        entry[8..16].copy_from_slice(&flags.to_le_bytes());
        entry[24..32].copy_from_slice(&offset.to_le_bytes());
        entry[32..40].copy_from_slice(&(plain.len() as u64).to_le_bytes());
        entry[48..56].copy_from_slice(&1u64.to_le_bytes());
        changed = true;
    }
    changed.then_some(out)
}

/// Why a binary is not handed to blazesym.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ElfCheckError {
    /// Not an ELF file `object` can read within the bounds.
    #[error("not a readable ELF file: {0}")]
    Parse(String),
    /// Beyond a limit.
    #[error("{what} is {bytes} bytes, above the agent's {limit}-byte limit: not symbolized")]
    TooLarge {
        /// What.
        what: &'static str,
        /// Its size.
        bytes: u64,
        /// The limit.
        limit: u64,
    },
}

/// The DWARF sections blazesym loads (gimli's `Dwarf`), compressed ones decompressed whole
/// when it loads them. Not `.debug_frame`: that is the unwinder's, read with its own
/// bounds.
fn is_loaded_dwarf(name: &str) -> bool {
    let name = name
        .strip_prefix(".debug_")
        .or_else(|| name.strip_prefix(".zdebug_"));
    name.is_some_and(|n| n != "frame")
}

/// Checks `file` (a workload's binary, opened with [`crate::process::files`]).
pub fn check(file: &std::fs::File) -> Result<ElfCheck, ElfCheckError> {
    check_file(file, true)
}

/// [`check`]; `follow`: whether to look for a separate debug file by build ID.
fn check_file(file: &std::fs::File, follow: bool) -> Result<ElfCheck, ElfCheckError> {
    let reader = BoundedReader::new(file, MAX_READ, READ_BUDGET)
        .map_err(|e| ElfCheckError::Parse(e.to_string()))?;
    let obj = object::File::parse(&reader).map_err(|e| ElfCheckError::Parse(e.to_string()))?;
    let (mut symbols, mut dwarf, mut dwarf_decompressed) = (0u64, 0u64, 0u64);
    let mut debug_link = false;
    let (mut gopclntab, mut debug_info) = (None, false);
    for section in obj.sections() {
        let name = section.name().unwrap_or("");
        let range = section.compressed_file_range().ok();
        let compressed = range.filter(|r| r.format != object::CompressionFormat::None);
        let size = range.map_or(section.size(), |r| r.uncompressed_size);
        match name {
            // Their string tables stay in the mapped file (page cache, reclaimable).
            ".symtab" | ".dynsym" => symbols = symbols.saturating_add(size),
            ".gnu_debuglink" | ".gnu_debugaltlink" => debug_link = true,
            ".gopclntab" => gopclntab = Some(size),
            n if is_loaded_dwarf(n) => {
                debug_info |= n.ends_with("debug_info");
                dwarf = dwarf.saturating_add(size);
                if compressed.is_some() {
                    dwarf_decompressed = dwarf_decompressed.saturating_add(size);
                }
            }
            _ => {}
        }
    }
    if symbols > MAX_SYMBOL_BYTES {
        return Err(ElfCheckError::TooLarge {
            what: "its symbol tables",
            bytes: symbols,
            limit: MAX_SYMBOL_BYTES,
        });
    }
    // A debug link names the file with the DWARF; the agent does not follow it (the name is
    // the workload's), and the binary's own symbols are what is left, as for any binary
    // whose debug file is not installed: no note.
    let no_debug_reason = if debug_link {
        None
    } else if dwarf_decompressed > MAX_DECOMPRESSED_BYTES {
        Some(format!(
            "its compressed DWARF decompresses to {dwarf_decompressed} bytes, above the agent's \
             {MAX_DECOMPRESSED_BYTES}-byte limit; symbols only"
        ))
    } else if dwarf > MAX_DWARF_BYTES {
        Some(format!(
            "its DWARF is {dwarf} bytes, above the agent's {MAX_DWARF_BYTES}-byte limit; \
             symbols only"
        ))
    } else {
        None
    };
    let build_id: String = obj
        .build_id()
        .ok()
        .flatten()
        .map(|id| id.iter().map(|b| format!("{b:02x}")).collect())
        .unwrap_or_default();
    let segments = obj
        .segments()
        .map(|s| {
            let (offset, size) = s.file_range();
            (offset, s.address(), size)
        })
        .collect();
    // The separate debug file, by build ID only: the debug link's name is not followed.
    let debug_file = if debug_link && follow {
        build_id_debug_file(&build_id)
    } else {
        None
    };
    let debug_syms = (!debug_link && no_debug_reason.is_none())
        || debug_file.as_ref().is_some_and(|(_, c)| c.debug_syms);
    // blazesym's symbol index is about as large as the symbol tables; decompressed DWARF
    // is held whole; parsed DWARF (units, line programs, inlined functions of the units
    // looked up) is a fraction of its size.
    let cost = match &debug_file {
        Some((_, c)) if debug_syms => symbols.saturating_add(c.cost),
        _ if debug_syms => symbols
            .saturating_add(dwarf_decompressed)
            .saturating_add(dwarf / 8),
        _ => symbols,
    };
    Ok(ElfCheck {
        build_id,
        debug_syms,
        no_debug_reason,
        cost,
        symbols_cost: symbols,
        debug_file: debug_file.filter(|_| debug_syms).map(|(p, _)| p),
        segments,
        go_pclntab: gopclntab.filter(|_| !debug_info),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn own_binary_passes_with_its_build_id_and_dwarf() {
        let exe = crate::process::files::open_exe(std::process::id()).unwrap();
        let c = check(&exe.file).unwrap();
        assert_eq!(c.build_id.len(), 40, "{c:?}");
        assert!(c.cost > 0);
    }

    /// A debug file with zlib-compressed DWARF (as distributions ship them) decompresses
    /// into a file with the same DWARF uncompressed, which blazesym symbolizes the same:
    /// function, file and line.
    #[test]
    fn compressed_debug_sections_are_decompressed_once_into_a_kept_copy() {
        use object::ObjectSymbol as _;
        let dir = tempfile::tempdir().unwrap();
        let src = dir.path().join("f.c");
        std::fs::write(
            &src,
            "__attribute__((noinline)) int ff_compressed(int x) { return x * 3 + 1; }\n\
             int main(int c, char **v) { (void)v; return ff_compressed(c); }\n",
        )
        .unwrap();
        let bin = dir.path().join("f");
        let out = std::process::Command::new("cc")
            .args(["-O1", "-g", "-gz=zlib", "-o"])
            .arg(&bin)
            .arg(&src)
            .output()
            .expect("running cc (install gcc)");
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let data = std::fs::read(&bin).unwrap();
        let plain = decompress_sections(&data).expect("compressed DWARF found");
        let (before, after) = (
            object::File::parse(&*data).unwrap(),
            object::File::parse(&*plain).unwrap(),
        );
        let mut compared = 0;
        for s in before.sections() {
            let name = s.name().unwrap();
            if !is_loaded_dwarf(name) {
                continue;
            }
            let t = after.section_by_name(name).unwrap();
            let range = t.compressed_file_range().unwrap();
            assert_eq!(range.format, object::CompressionFormat::None, "{name}");
            assert_eq!(s.uncompressed_data().unwrap(), t.data().unwrap(), "{name}");
            compared += 1;
        }
        assert!(compared >= 3, "DWARF sections compared: {compared}");
        // Kept once: the second call answers the same path without reading the file.
        let kept = decompressed(&bin).expect("kept");
        assert_eq!(decompressed(&bin), Some(kept.clone()));
        let sym = blazesym::symbolize::Symbolizer::builder()
            .enable_code_info(true)
            .build();
        let func = after
            .symbols()
            .find(|s| s.name() == Ok("ff_compressed"))
            .unwrap();
        let found = sym
            .symbolize_single(
                &blazesym::symbolize::source::Source::Elf(blazesym::symbolize::source::Elf::new(
                    &kept,
                )),
                blazesym::symbolize::Input::VirtOffset(object::ObjectSymbol::address(&func)),
            )
            .unwrap();
        let found = found.as_sym().expect("symbolized");
        assert_eq!(found.name, "ff_compressed");
        assert!(
            found.code_info.as_ref().is_some_and(|c| c.line.is_some()),
            "line from the decompressed DWARF: {found:?}"
        );
        // Nothing compressed: nothing to keep.
        assert!(decompress_sections(&plain).is_none());
        assert!(decompress_sections(b"\x7fELF not really").is_none());
    }

    #[test]
    fn garbage_is_an_error() {
        let mut f = tempfile::tempfile().unwrap();
        std::io::Write::write_all(&mut f, b"\x7fELF not really").unwrap();
        assert!(matches!(check(&f), Err(ElfCheckError::Parse(_))));
    }
}
