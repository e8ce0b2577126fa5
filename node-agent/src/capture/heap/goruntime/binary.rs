//! Recognizing a Go binary: its Go version from the build info (present even
//! in stripped binaries) and the link-time addresses of the runtime globals
//! the heap profile hangs from (from the symbol table, or in a binary without one from
//! the code of the runtime functions that use them: [`super::locate`]).

use std::path::PathBuf;

use object::{Object as _, ObjectKind, ObjectSection as _, ObjectSegment as _, ObjectSymbol as _};

use crate::process::files::{BoundedReader, TargetFile};

/// Largest single read of the executable (its symbol or string table, or `.gopclntab`): a
/// Go program's are a few MiB.
const MAX_READ: u64 = crate::gopclntab::MAX_SECTION_BYTES;
/// Bytes read from one executable in all (section headers, build info, symbols, names; or
/// Go's function table and the code of a few runtime functions).
const READ_BUDGET: u64 = 256 << 20;

/// The runtime globals read by this source.
pub const SYMBOLS: [&str; 4] = [
    "runtime.mbuckets",
    "runtime.MemProfileRate",
    "runtime.disableMemoryProfiling",
    "runtime.mProfCycle",
];

/// Link-time addresses of the runtime globals (add the load bias for PIE).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GoSymbols {
    /// `runtime.mbuckets` (`atomic.UnsafePointer` to the newest bucket).
    pub mbuckets: u64,
    /// `runtime.MemProfileRate` (`int`).
    pub mem_profile_rate: u64,
    /// `runtime.disableMemoryProfiling` (`bool`, set by the linker).
    pub disable_memory_profiling: u64,
    /// `runtime.mProfCycle` (`uint32`: cycle << 1 | flushed).
    pub mprof_cycle: u64,
}

/// What the build info and symbol table say about a Go executable.
#[derive(Debug, Clone)]
pub struct GoBinary {
    /// The file read (through the process's root).
    pub path: PathBuf,
    /// The Go version as recorded by the toolchain (e.g. `go1.24.0`).
    pub version: String,
    /// The runtime globals, from the symbol table or, without one (`-ldflags=-s`), from the
    /// code ([`super::locate`]); otherwise why they were not found.
    pub symbols: Result<GoSymbols, String>,
    /// Whether they were found from the code (the binary has no symbol table).
    pub from_code: bool,
    /// Position-independent (`-buildmode=pie`): addresses move by a load bias.
    pub pie: bool,
    /// Lowest virtual address of a loadable segment.
    pub min_vaddr: u64,
}

/// Why a binary could not be inspected.
#[derive(Debug, thiserror::Error)]
pub enum BinaryError {
    /// The file could not be opened.
    #[error("opening {path}: {source}")]
    Open {
        /// The file.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// The file is not a readable ELF file.
    #[error("parsing {path} as ELF: {reason}")]
    Elf {
        /// The file.
        path: PathBuf,
        /// The cause.
        reason: String,
    },
    /// A `.go.buildinfo` section that does not decode.
    #[error("{path}: malformed Go build info: {reason}")]
    BuildInfo {
        /// The file.
        path: PathBuf,
        /// The cause.
        reason: String,
    },
}

const BUILDINFO_MAGIC: &[u8] = b"\xff Go buildinf:";
/// Bytes of `.go.buildinfo` read: header (32) + varint + version (≤ 256).
const BUILDINFO_READ: u64 = 512;

/// The Go version recorded in a `.go.buildinfo` section (Go 1.18+ inline
/// format); `Ok(None)` for the pointer format of older toolchains.
pub fn buildinfo_version(data: &[u8]) -> Result<Option<String>, String> {
    if data.len() < 32 || !data.starts_with(BUILDINFO_MAGIC) {
        return Err(format!(
            "expected the magic {BUILDINFO_MAGIC:?} and 32 header bytes, found {} bytes",
            data.len()
        ));
    }
    let flags = data[15];
    if flags & 2 == 0 {
        return Ok(None);
    }
    let rest = &data[32..];
    let (len, used) = uvarint(rest).ok_or("truncated version length")?;
    let len = usize::try_from(len).map_err(|_| "version length out of range")?;
    let bytes = rest
        .get(used..used.saturating_add(len))
        .filter(|_| len <= 256)
        .ok_or_else(|| format!("version string of {len} bytes does not fit"))?;
    let version = std::str::from_utf8(bytes).map_err(|e| format!("version is not UTF-8: {e}"))?;
    Ok(Some(version.to_owned()))
}

/// Go's `binary.Uvarint`: the value and the number of bytes used.
fn uvarint(data: &[u8]) -> Option<(u64, usize)> {
    let mut value = 0u64;
    for (i, &b) in data.iter().enumerate().take(10) {
        value |= u64::from(b & 0x7f) << (7 * i);
        if b & 0x80 == 0 {
            return Some((value, i + 1));
        }
    }
    None
}

/// Inspects `file` (a target's executable, opened with [`crate::process::files`]): `Ok(None)`
/// when it is not a Go binary (no `.go.buildinfo`), otherwise its version and runtime
/// symbols. Reads are bounded (the file is the workload's): a symbol table larger than
/// a Go program's ever is fails the inspection.
pub fn inspect(file: &TargetFile) -> Result<Option<GoBinary>, BinaryError> {
    let path = PathBuf::from(&file.path);
    let path = path.as_path();
    let reader = BoundedReader::new(&file.file, MAX_READ, READ_BUDGET).map_err(|source| {
        BinaryError::Open {
            path: path.to_path_buf(),
            source,
        }
    })?;
    let elf = object::File::parse(&reader).map_err(|e| BinaryError::Elf {
        path: path.to_path_buf(),
        reason: e.to_string(),
    })?;
    let Some(section) = elf.section_by_name(".go.buildinfo") else {
        return Ok(None);
    };
    // The header and version sit at the start: read no more than that, so a
    // crafted section size cannot make the agent read a huge file.
    let len = section.size().min(BUILDINFO_READ);
    let data = section
        .data_range(section.address(), len)
        .map_err(|e| BinaryError::BuildInfo {
            path: path.to_path_buf(),
            reason: e.to_string(),
        })?
        .unwrap_or_default();
    let version = buildinfo_version(data)
        .map_err(|reason| BinaryError::BuildInfo {
            path: path.to_path_buf(),
            reason,
        })?
        .unwrap_or_else(|| "go1.17 or older (pre-1.18 build info)".into());
    let mut found = [None; 4];
    if let Some(symtab) = elf.section_by_name(".symtab")
        && symtab.size() > MAX_READ
    {
        return Err(BinaryError::Elf {
            path: path.to_path_buf(),
            reason: format!(
                "its symbol table is {} bytes, above the {MAX_READ}-byte limit",
                symtab.size()
            ),
        });
    }
    for sym in elf.symbols() {
        if let Ok(name) = sym.name()
            && let Some(i) = SYMBOLS.iter().position(|s| *s == name)
        {
            found[i] = Some(sym.address());
        }
    }
    let (symbols, from_code) = match found {
        [
            Some(mbuckets),
            Some(mem_profile_rate),
            Some(disable_memory_profiling),
            Some(mprof_cycle),
        ] => (
            Ok(GoSymbols {
                mbuckets,
                mem_profile_rate,
                disable_memory_profiling,
                mprof_cycle,
            }),
            false,
        ),
        _ => (
            match crate::gopclntab::GoTable::from_elf(&elf) {
                Ok(Some(table)) => super::locate::locate(&elf, &table),
                Ok(None) => Err("it has no .gopclntab either".to_owned()),
                Err(e) => Err(e.to_string()),
            },
            true,
        ),
    };
    let min_vaddr = elf.segments().map(|s| s.address()).min().unwrap_or(0);
    Ok(Some(GoBinary {
        path: path.to_path_buf(),
        version,
        symbols,
        from_code,
        pie: elf.kind() == ObjectKind::Dynamic,
        min_vaddr,
    }))
}

/// The load bias of a PIE executable in `pid`: where its first page is
/// mapped minus its link-time address. 0 for fixed-address executables.
pub fn load_bias(pid: u32, bin: &GoBinary) -> Option<u64> {
    if !bin.pie {
        return Some(0);
    }
    let exe = std::fs::read_link(format!("/proc/{pid}/exe")).ok()?;
    let exe = exe.to_str()?.trim_end_matches(" (deleted)").to_owned();
    let first = crate::process::maps::mappings(pid, |m| {
        m.offset == 0 && m.name.trim_end_matches(" (deleted)") == exe
    })
    .ok()?;
    let start = first.mappings.first()?.start;
    start.checked_sub(bin.min_vaddr & !0xfff)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn buildinfo(version: &str, flags: u8) -> Vec<u8> {
        let mut d = BUILDINFO_MAGIC.to_vec();
        d.push(8);
        d.push(flags);
        d.resize(32, 0);
        d.push(version.len() as u8);
        d.extend_from_slice(version.as_bytes());
        d.push(0);
        d
    }

    #[test]
    fn decodes_the_inline_build_info() {
        assert_eq!(
            buildinfo_version(&buildinfo("go1.24.0", 2)).unwrap(),
            Some("go1.24.0".into())
        );
        assert_eq!(buildinfo_version(&buildinfo("go1.16", 0)).unwrap(), None);
        assert!(buildinfo_version(b"\x7fELF").is_err());
        let mut truncated = buildinfo("go1.24.0", 2);
        truncated.truncate(36);
        assert!(buildinfo_version(&truncated).is_err());
    }

    #[test]
    fn a_rust_binary_is_not_go() {
        let me = crate::process::files::open_exe(std::process::id()).unwrap();
        assert!(inspect(&me).unwrap().is_none());
    }
}
