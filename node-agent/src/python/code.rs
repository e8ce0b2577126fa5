//! CPython code objects read from a process's memory: names, file and line table, under
//! byte bounds (the process may be hostile: its objects can claim any length).

use super::PyLayout;
use crate::capture::heap::goruntime::memory::{MemoryError, ProcessMemory};

/// Longest string (name, file) read, in characters; longer ones are cut.
pub const MAX_STRING_CHARS: u64 = 1024;
/// Longest line table read; with a longer one its frames show the function's first line.
pub const MAX_LINE_TABLE: u64 = 256 << 10;

/// What a frame shows of its code object.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PyCode {
    /// `co_qualname` (3.11+) or `co_name`.
    pub name: String,
    /// `co_filename`.
    pub file: String,
    /// `co_firstlineno`.
    pub first_line: i64,
    /// `co_lnotab` (3.8, 3.9) or `co_linetable` (3.10+); empty when too long.
    pub line_table: Vec<u8>,
}

/// Reads the code object at `addr`. `code_type` is the address of the `code` type once one
/// object was checked (later objects need only the same type pointer).
pub(crate) fn read_code(
    mem: &mut ProcessMemory,
    layout: &PyLayout,
    addr: u64,
    code_type: &mut Option<u64>,
) -> Result<PyCode, MemoryError> {
    let ty = mem.u64(addr + 8)?;
    if *code_type != Some(ty) {
        // tp_name follows the type's PyVarObject header in every version.
        let mut name = [0u8; 5];
        let tp_name = mem.u64(ty + 24)?;
        mem.read(tp_name, &mut name)?;
        if &name != b"code\0" {
            return Err(MemoryError::Read {
                pid: 0,
                addr,
                len: 0,
                reason: "not a code object".into(),
            });
        }
        *code_type = Some(ty);
    }
    let field = |mem: &mut ProcessMemory, off: u16| mem.u64(addr + u64::from(off));
    let name_at = if layout.code_qualname != 0 {
        field(mem, layout.code_qualname)?
    } else {
        field(mem, layout.code_name)?
    };
    let name = read_str(mem, layout, name_at)?;
    let file_at = field(mem, layout.code_filename)?;
    let file = read_str(mem, layout, file_at)?;
    let first_line = i64::from(mem.u32(addr + u64::from(layout.code_firstlineno))? as i32);
    let table_at = field(mem, layout.code_linetable)?;
    let size = mem.u64(table_at + u64::from(layout.bytes_size))?;
    let line_table = if size <= MAX_LINE_TABLE {
        let mut t = vec![0u8; size as usize];
        mem.read(table_at + u64::from(layout.bytes_data), &mut t)?;
        t
    } else {
        Vec::new()
    };
    Ok(PyCode {
        name,
        file,
        first_line,
        line_table,
    })
}

/// A `str` object's text: compact strings only (names and file names always are).
fn read_str(mem: &mut ProcessMemory, layout: &PyLayout, addr: u64) -> Result<String, MemoryError> {
    let state = mem.u32(addr + u64::from(layout.unicode_state))?;
    let len = mem.u64(addr + u64::from(layout.unicode_length))?;
    let (kind, compact, ascii) = ((state >> 2) & 7, (state >> 5) & 1, (state >> 6) & 1);
    let chars = len.min(MAX_STRING_CHARS) as usize;
    if compact == 0 {
        return Ok("<str>".into());
    }
    if ascii == 1 {
        let mut b = vec![0u8; chars];
        mem.read(addr + u64::from(layout.unicode_ascii_data), &mut b)?;
        return Ok(String::from_utf8_lossy(&b).into_owned());
    }
    let width = match kind {
        1 | 2 | 4 => kind as usize,
        _ => return Ok("<str>".into()),
    };
    let mut b = vec![0u8; chars * width];
    mem.read(addr + u64::from(layout.unicode_compact_data), &mut b)?;
    Ok(b.chunks_exact(width)
        .map(|c| {
            let mut v = [0u8; 4];
            v[..width].copy_from_slice(c);
            char::from_u32(u32::from_le_bytes(v)).unwrap_or(char::REPLACEMENT_CHARACTER)
        })
        .collect())
}

/// The line of the instruction at `offset` (in 2-byte code units), decoded from the line
/// table of version 3.`minor`; `None` when the table has no line there.
pub fn line_of(minor: u8, table: &[u8], first_line: i64, offset: u64) -> Option<i64> {
    match minor {
        ..=9 => lnotab_line(table, first_line, offset * 2),
        10 => linetable_310(table, first_line, offset * 2),
        _ => locations_line(table, first_line, offset),
    }
}

/// 3.8, 3.9 `co_lnotab`: (bytecode delta, signed line delta) pairs; `addr` in bytes.
fn lnotab_line(table: &[u8], first_line: i64, addr: u64) -> Option<i64> {
    let (mut line, mut at) = (first_line, 0u64);
    for pair in table.chunks_exact(2) {
        at += u64::from(pair[0]);
        if at > addr {
            break;
        }
        line += i64::from(pair[1] as i8);
    }
    Some(line)
}

/// 3.10 `co_linetable`: (bytecode length, signed line delta) pairs, -128 for no line;
/// `addr` in bytes.
fn linetable_310(table: &[u8], first_line: i64, addr: u64) -> Option<i64> {
    let (mut line, mut start) = (first_line, 0u64);
    for pair in table.chunks_exact(2) {
        let end = start + u64::from(pair[0]);
        let delta = pair[1] as i8;
        if delta != -128 {
            line += i64::from(delta);
        }
        if start <= addr && addr < end {
            return (delta != -128).then_some(line);
        }
        start = end;
    }
    None
}

/// 3.11+ location table (CPython's Objects/locations.md): entries of a header byte (bit 7
/// set, a 4-bit code, the entry's length in code units less one) and the code's operands.
fn locations_line(table: &[u8], first_line: i64, offset: u64) -> Option<i64> {
    let mut at = 0usize;
    let mut next = || {
        let b = table.get(at).copied();
        at += 1;
        b
    };
    fn varint(next: &mut impl FnMut() -> Option<u8>) -> Option<u64> {
        let mut b = next()?;
        let mut v = u64::from(b & 63);
        let mut shift = 6;
        while b & 64 != 0 && shift < 64 {
            b = next()?;
            v |= u64::from(b & 63) << shift;
            shift += 6;
        }
        Some(v)
    }
    fn svarint(next: &mut impl FnMut() -> Option<u8>) -> Option<i64> {
        let v = varint(next)?;
        Some(if v & 1 != 0 {
            -((v >> 1) as i64)
        } else {
            (v >> 1) as i64
        })
    }
    let (mut line, mut start) = (first_line, 0u64);
    while let Some(head) = next() {
        let code = (head >> 3) & 15;
        let len = u64::from(head & 7) + 1;
        let delta = match code {
            15 => 0,
            14 => {
                let d = svarint(&mut next)?;
                for _ in 0..3 {
                    varint(&mut next)?;
                }
                d
            }
            13 => svarint(&mut next)?,
            10..=12 => {
                next()?;
                next()?;
                i64::from(code) - 10
            }
            _ => {
                next()?;
                0
            }
        };
        line += delta;
        if start <= offset && offset < start + len {
            return (code != 15).then_some(line);
        }
        start += len;
    }
    None
}

/// `module.function` for a code object of `file`: the module is the file's stem (a
/// package's `__init__.py` gives the package), frozen modules keep their dotted name.
pub fn qualified_name(file: &str, name: &str) -> String {
    if let Some(frozen) = file
        .strip_prefix("<frozen ")
        .and_then(|f| f.strip_suffix('>'))
    {
        return format!("{frozen}.{name}");
    }
    let path = std::path::Path::new(file);
    let stem = path.file_stem().and_then(|s| s.to_str()).unwrap_or(file);
    let module = if stem == "__init__" {
        path.parent()
            .and_then(|p| p.file_name())
            .and_then(|s| s.to_str())
            .unwrap_or(stem)
    } else {
        stem
    };
    if module.is_empty() {
        name.to_owned()
    } else {
        format!("{module}.{name}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lnotab_lines() {
        // Line 10 at 0, +2 lines at byte 6, +1 at byte 10.
        let t = [6, 2, 4, 1];
        assert_eq!(lnotab_line(&t, 10, 0), Some(10));
        assert_eq!(lnotab_line(&t, 10, 6), Some(12));
        assert_eq!(lnotab_line(&t, 10, 8), Some(12));
        assert_eq!(lnotab_line(&t, 10, 12), Some(13));
        // 3.9 as the interpreter stores f_lasti: in bytes; line_of takes code units.
        assert_eq!(line_of(9, &t, 10, 3), Some(12));
    }

    #[test]
    fn linetable_310_lines() {
        // 4 bytes at line 5 (+0 from 5), 6 bytes without a line, 2 bytes at line 7.
        let t = [4, 0, 6, 0x80, 2, 2];
        assert_eq!(linetable_310(&t, 5, 0), Some(5));
        assert_eq!(linetable_310(&t, 5, 5), None);
        assert_eq!(linetable_310(&t, 5, 10), Some(7));
        assert_eq!(linetable_310(&t, 5, 12), None);
    }

    #[test]
    fn location_table_lines() {
        // Entry 1: code 13 (no columns), 2 units, line +1 (svarint 2).
        // Entry 2: code 11 (one-line form, +1), 3 units, two column bytes.
        // Entry 3: code 15 (no location), 1 unit.
        // Entry 4: code 14 (long form), 1 unit, line -1 (svarint 3), three varints.
        // Entry 5: short form (code 0), 1 unit, one column byte: same line.
        let t = [
            0x80 | (13 << 3) | 1,
            2,
            0x80 | (11 << 3) | 2,
            4,
            9,
            0x80 | (15 << 3),
            0x80 | (14 << 3),
            3,
            0,
            1,
            1,
            0x80,
            7,
        ];
        assert_eq!(locations_line(&t, 20, 0), Some(21));
        assert_eq!(locations_line(&t, 20, 1), Some(21));
        assert_eq!(locations_line(&t, 20, 2), Some(22));
        assert_eq!(locations_line(&t, 20, 4), Some(22));
        assert_eq!(locations_line(&t, 20, 5), None);
        assert_eq!(locations_line(&t, 20, 6), Some(21));
        assert_eq!(locations_line(&t, 20, 7), Some(21));
        assert_eq!(locations_line(&t, 20, 8), None);
        // A table cut inside an entry ends the decoding.
        assert_eq!(locations_line(&t[..1], 20, 0), None);
    }

    #[test]
    fn names() {
        assert_eq!(qualified_name("/app/burn.py", "f"), "burn.f");
        assert_eq!(qualified_name("/app/pkg/__init__.py", "C.m"), "pkg.C.m");
        assert_eq!(
            qualified_name("<frozen importlib._bootstrap>", "_find"),
            "importlib._bootstrap._find"
        );
        assert_eq!(qualified_name("<string>", "<module>"), "<string>.<module>");
    }
}
