//! Whether a process runs CPython, which version, and where its `_PyRuntime` is: from the
//! interpreter's binary (`libpython3.N.so`, or a `python3.N` executable that links it in),
//! its dynamic symbols and, from 3.11, `Py_Version`.

use std::sync::Arc;

use object::{Object as _, ObjectSection as _, ObjectSegment as _, ObjectSymbol};

use crate::process::ProcessMaps;
use crate::process::files::BoundedReader;
use crate::process::{Binary, MappedRange};

/// Largest single read of a binary while looking for the interpreter's symbols.
const MAX_READ: u64 = 64 << 20;
/// Bytes read from one binary at most.
const READ_BUDGET: u64 = 128 << 20;

/// A CPython interpreter found in a binary.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Interpreter {
    /// 3.`minor`.
    pub minor: u8,
    /// Where the version came from (`Py_Version` or the file name), for the summary.
    pub version_hex: Option<u32>,
    /// ELF virtual address of `_PyRuntime`.
    pub runtime_vaddr: u64,
}

/// The binary of `maps` that holds the interpreter, and the mapping it is at: a
/// `libpython3.N` first, else an executable named `python3.N` (statically linked).
pub fn interpreter_binary(maps: &ProcessMaps) -> Option<(&MappedRange, &Arc<Binary>)> {
    let find = |pred: fn(&str) -> bool| {
        maps.ranges.iter().find_map(|r| {
            let bin = r.binary.as_ref()?;
            pred(bin.path.rsplit('/').next().unwrap_or("")).then_some((r, bin))
        })
    };
    find(|n| n.starts_with("libpython3")).or_else(|| find(|n| n.starts_with("python")))
}

/// The 3.`minor` in a file name such as `libpython3.12.so.1.0` or `python3.9`.
pub fn minor_from_name(name: &str) -> Option<u8> {
    let at = name.find("python3.")? + "python3.".len();
    let digits: String = name[at..]
        .chars()
        .take_while(char::is_ascii_digit)
        .collect();
    digits.parse().ok()
}

/// Why a binary was not taken as an interpreter.
#[derive(Debug, thiserror::Error)]
pub enum DetectError {
    /// The binary could not be opened or parsed.
    #[error("reading {path}: {reason}")]
    Read {
        /// The binary.
        path: String,
        /// The cause.
        reason: String,
    },
    /// No `_PyRuntime` symbol.
    #[error(
        "{path} has no _PyRuntime symbol (expected in every CPython 3.8+ interpreter's \
         dynamic symbols): its Python frames cannot be read"
    )]
    NoRuntime {
        /// The binary.
        path: String,
    },
    /// No version found.
    #[error(
        "the CPython version of {path} is unknown (no Py_Version symbol, no python3.N in the \
         file name)"
    )]
    NoVersion {
        /// The binary.
        path: String,
    },
}

/// Inspects the interpreter binary `bin` (mapped in `tgid`).
pub fn inspect(bin: &Binary, tgid: u32) -> Result<Interpreter, DetectError> {
    let err = |reason: String| DetectError::Read {
        path: bin.path.clone(),
        reason,
    };
    let file = bin.open(tgid).map_err(|e| err(e.to_string()))?;
    let reader =
        BoundedReader::new(&file, MAX_READ, READ_BUDGET).map_err(|e| err(e.to_string()))?;
    let elf = object::File::parse(&reader).map_err(|e| err(e.to_string()))?;
    // Both are exported: the full symbol table (ten times larger) is read only for an
    // interpreter that does not export _PyRuntime.
    let (mut runtime, mut version) = runtime_symbols(elf.dynamic_symbols());
    if runtime.is_none() {
        (runtime, version) = runtime_symbols(elf.symbols());
    }
    let Some(runtime_vaddr) = runtime else {
        return Err(DetectError::NoRuntime {
            path: bin.path.clone(),
        });
    };
    // Py_Version (3.11+) is a const in .rodata: read it from the file.
    let version_hex = version.and_then(|addr| {
        elf.sections().find_map(|s| {
            let data = s.data_range(addr, 4).ok()??;
            Some(u32::from_le_bytes(data.try_into().ok()?))
        })
    });
    let name = bin.path.rsplit('/').next().unwrap_or("");
    let minor = version_hex
        .filter(|v| v >> 24 == 3)
        .map(|v| ((v >> 16) & 0xff) as u8)
        .or_else(|| minor_from_name(name))
        .ok_or_else(|| DetectError::NoVersion {
            path: bin.path.clone(),
        })?;
    Ok(Interpreter {
        minor,
        version_hex,
        runtime_vaddr,
    })
}

/// The addresses of `_PyRuntime` and `Py_Version` among `symbols`.
fn runtime_symbols<'data, S: ObjectSymbol<'data>>(
    symbols: impl Iterator<Item = S>,
) -> (Option<u64>, Option<u64>) {
    let (mut runtime, mut version) = (None, None);
    for sym in symbols {
        match sym.name() {
            Ok("_PyRuntime") => runtime = runtime.or(Some(sym.address())),
            Ok("Py_Version") => version = version.or(Some(sym.address())),
            _ => {}
        }
    }
    (runtime, version)
}

/// The load bias of `bin` in the process (runtime address less ELF virtual address), from
/// its mapping `range`: the PT_LOAD segment holding the mapping's file offset.
pub fn load_bias(bin: &Binary, tgid: u32, range: &MappedRange) -> Option<u64> {
    let file = bin.open(tgid).ok()?;
    let reader = BoundedReader::new(&file, MAX_READ, READ_BUDGET).ok()?;
    let elf = object::File::parse(&reader).ok()?;
    elf.segments().find_map(|s| {
        let (off, size) = s.file_range();
        (off <= range.offset && range.offset < off + size)
            .then(|| range.start.wrapping_sub(s.address() + (range.offset - off)))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions_from_names() {
        assert_eq!(minor_from_name("libpython3.12.so.1.0"), Some(12));
        assert_eq!(minor_from_name("python3.8"), Some(8));
        assert_eq!(minor_from_name("python3"), None);
        assert_eq!(minor_from_name("python3.x"), None);
    }
}
