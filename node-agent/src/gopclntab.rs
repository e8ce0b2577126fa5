//! Go's own function table (`.gopclntab`), which every Go binary keeps — stripped ones too
//! (`-ldflags="-s -w"` removes the ELF symbol table and DWARF, not this: the runtime needs
//! it for tracebacks, the garbage collector and preemption). It gives, per function, its
//! name, its address range, the stack pointer's offset at every instruction (the pc/sp
//! table), the file and line of every instruction and, through the inline tree, the
//! functions inlined there. The agent reads it for what DWARF and the symbol table would
//! have given: names and lines ([`GoTable::frames`]), unwind rows
//! ([`GoTable::sp_deltas`], see `crate::unwind::table`), and the runtime's functions by
//! name (`capture::heap::goruntime::locate`).
//!
//! No maintained crate reads it (blazesym, gimli and object do not), so it is read here.
//! The format is the one of Go 1.20 and later (magic `0xfffffff1`; the layout of `_func`,
//! `inlinedCall` and the pc-value encoding in `src/runtime/symtab.go`,
//! `src/internal/abi/symtab.go` and `src/cmd/link/internal/ld/pcln.go`), verified for Go
//! 1.23 to 1.26 by the tests that compare it with the symbol table and DWARF of the same
//! program built without `-s -w`.
//!
//! The binary is the workload's, so every offset and length read from it is checked against
//! the section before use, tables and strings are capped ([`MAX_SECTION_BYTES`],
//! [`MAX_NAME_BYTES`], [`MAX_INLINE_DEPTH`]), and every pc-value walk is bounded by its
//! function's size: a malformed table gives fewer names or rows, never a loop, a panic or
//! an unbounded read.

use std::borrow::Cow;

use object::{Object as _, ObjectSection as _, SectionFlags};

use crate::pprof::FrameLine;

/// Largest `.gopclntab` read (a Go program's is a few MiB; the largest Kubernetes binaries'
/// tens of MiB).
pub const MAX_SECTION_BYTES: u64 = 128 << 20;
/// Largest part of the section holding `go:func.*` (inline trees and other function data)
/// kept.
pub const MAX_FUNCDATA_BYTES: u64 = 64 << 20;
/// Longest function or file name read.
pub const MAX_NAME_BYTES: usize = 4096;
/// Most inlined frames named at one address (Go inlines a few levels deep).
pub const MAX_INLINE_DEPTH: usize = 32;
/// Bytes of writable data searched for the runtime's `moduledata` (to find `go:func.*`).
const MAX_MODULEDATA_SCAN: u64 = 32 << 20;
/// Dynamic relocations read to find `moduledata`'s pointers in a position-independent binary.
const MAX_RELOCATIONS: usize = 1 << 22;

/// `pcHeader.magic` of Go 1.20 and later.
const MAGIC_GO120: u32 = 0xffff_fff1;
/// Size of `pcHeader` with 8-byte pointers.
const HEADER_BYTES: usize = 72;
/// Size of `_func` before its pcdata and funcdata offsets.
const FUNC_BYTES: usize = 44;
/// `abi.PCDATA_InlTreeIndex`.
const PCDATA_INL_TREE_INDEX: u32 = 2;
/// `abi.FUNCDATA_InlTree`.
const FUNCDATA_INL_TREE: u32 = 3;
/// Size of `inlinedCall`.
const INLINED_CALL_BYTES: u64 = 16;
/// Offset of `gofunc` (`go:func.*`) in `runtime.moduledata` (Go 1.20 to 1.26: after the
/// pcHeader pointer, six slices, findfunctab, min/max pc and thirteen pairs of section
/// bounds and the rodata start).
const MODULEDATA_GOFUNC: u64 = 320;
/// Offset of `text` in `runtime.moduledata`.
const MODULEDATA_TEXT: u64 = 176;
/// `R_X86_64_RELATIVE`.
const R_X86_64_RELATIVE: u32 = 8;

/// Why a Go function table cannot be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum GoTableError {
    /// The ELF file could not be read.
    #[error("reading the ELF file: {0}")]
    Elf(String),
    /// A section above [`MAX_SECTION_BYTES`].
    #[error(".gopclntab is {0} bytes, above the agent's {MAX_SECTION_BYTES}-byte limit")]
    TooLarge(u64),
    /// Not the layout of Go 1.20 or later.
    #[error(
        ".gopclntab has magic {magic:#x}, pointer size {ptr_size} and pc quantum {quantum}; \
         expected {MAGIC_GO120:#x}, 8 and 1 (Go 1.20 or later on x86-64): older Go versions \
         and other architectures are not read"
    )]
    Format {
        /// `pcHeader.magic`.
        magic: u32,
        /// `pcHeader.ptrSize`.
        ptr_size: u8,
        /// `pcHeader.minLC`.
        quantum: u8,
    },
    /// A header field pointing outside the section.
    #[error(".gopclntab is malformed: {0}")]
    Malformed(String),
}

/// One function of the table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Func {
    /// First instruction (virtual address, as linked).
    pub entry: u64,
    /// One past its last byte (the next function's entry).
    pub end: u64,
    /// Offset of its `_func` record in the section.
    record: usize,
    name_off: i32,
    pcsp: u32,
    pcfile: u32,
    pcln: u32,
    npcdata: u32,
    cu_offset: u32,
    nfuncdata: u8,
}

/// The function table of one Go binary, read into memory ([`GoTable::bytes`]).
#[derive(Debug, Clone)]
pub struct GoTable {
    /// The section's bytes.
    data: Vec<u8>,
    /// Where `runtime.text` is (function entries are offsets from it).
    text_start: u64,
    nfunc: usize,
    funcnametab: usize,
    cutab: usize,
    filetab: usize,
    pctab: usize,
    pclntab: usize,
    /// `go:func.*` (the base of funcdata offsets) and the bytes from there to the end of
    /// its section, when found: inline trees are read there.
    funcdata: Option<(u64, Vec<u8>)>,
}

/// Little-endian `u32` at `at`, if in `data`.
fn u32_at(data: &[u8], at: usize) -> Option<u32> {
    let b = data.get(at..at.checked_add(4)?)?;
    Some(u32::from_le_bytes(b.try_into().ok()?))
}

/// Little-endian `u64` at `at`, if in `data`.
fn u64_at(data: &[u8], at: usize) -> Option<u64> {
    let b = data.get(at..at.checked_add(8)?)?;
    Some(u64::from_le_bytes(b.try_into().ok()?))
}

/// Go's `readvarint` (a `uint32` in at most five bytes) at `at`: the value and the bytes used.
fn varint(data: &[u8], at: usize) -> Option<(u32, usize)> {
    let mut v = 0u32;
    for i in 0..5 {
        let b = *data.get(at.checked_add(i)?)?;
        v |= u32::from(b & 0x7f) << (7 * i);
        if b & 0x80 == 0 {
            return Some((v, i + 1));
        }
    }
    None
}

/// Go's zig-zag decoding of a pc-value delta, on `uint32` as the runtime's `step` does it.
fn zigzag(uv: u32) -> i32 {
    ((uv >> 1) ^ (uv & 1).wrapping_neg()) as i32
}

/// A NUL-terminated string at `at`, within [`MAX_NAME_BYTES`].
fn cstr(data: &[u8], at: usize) -> Option<Cow<'_, str>> {
    let rest = data.get(at..)?;
    let rest = &rest[..rest.len().min(MAX_NAME_BYTES)];
    let len = rest.iter().position(|&b| b == 0)?;
    Some(String::from_utf8_lossy(&rest[..len]))
}

impl GoTable {
    /// Reads the table of an ELF image: `Ok(None)` when it has no `.gopclntab` (not Go).
    pub fn from_elf<'data, R: object::ReadRef<'data>>(
        obj: &object::File<'data, R>,
    ) -> Result<Option<Self>, GoTableError> {
        let Some(section) = obj.section_by_name(".gopclntab") else {
            return Ok(None);
        };
        if section.size() > MAX_SECTION_BYTES {
            return Err(GoTableError::TooLarge(section.size()));
        }
        let data = section
            .data()
            .map_err(|e| GoTableError::Elf(format!(".gopclntab: {e}")))?
            .to_vec();
        let malformed = |what: &str| GoTableError::Malformed(what.to_owned());
        if data.len() < HEADER_BYTES {
            return Err(malformed("shorter than its header"));
        }
        let magic = u32_at(&data, 0).unwrap_or_default();
        let (quantum, ptr_size) = (data[6], data[7]);
        if magic != MAGIC_GO120 || quantum != 1 || ptr_size != 8 {
            return Err(GoTableError::Format {
                magic,
                ptr_size,
                quantum,
            });
        }
        let word = |i: usize| u64_at(&data, 8 + 8 * i).unwrap_or_default();
        let offset = |i: usize, what: &str| {
            usize::try_from(word(i))
                .ok()
                .filter(|&o| o < data.len())
                .ok_or_else(|| GoTableError::Malformed(format!("{what} offset out of the section")))
        };
        let nfunc = usize::try_from(word(0)).unwrap_or(usize::MAX);
        let funcnametab = offset(3, "function name table")?;
        let cutab = offset(4, "compilation unit table")?;
        let filetab = offset(5, "file table")?;
        let pctab = offset(6, "pc-value table")?;
        let pclntab = offset(7, "function table")?;
        // nfunc + 1 entries of 8 bytes each must fit.
        if nfunc == 0 || nfunc >= (data.len() - pclntab) / 8 {
            return Err(GoTableError::Malformed(format!(
                "{nfunc} functions do not fit in the function table"
            )));
        }
        // A position-independent binary has 0 here until the loader relocates it; the
        // runtime's text starts with the .text section.
        let text_start = match word(2) {
            0 => obj
                .section_by_name(".text")
                .map(|s| s.address())
                .ok_or_else(|| malformed("no textStart and no .text section"))?,
            t => t,
        };
        let mut table = Self {
            data,
            text_start,
            nfunc,
            funcnametab,
            cutab,
            filetab,
            pctab,
            pclntab,
            funcdata: None,
        };
        table.funcdata = find_gofunc(obj, section.address(), &table).and_then(|gofunc| {
            let s = obj.sections().find(|s| {
                gofunc >= s.address() && gofunc - s.address() < s.size() && s.file_range().is_some()
            })?;
            let len = (s.address() + s.size() - gofunc).min(MAX_FUNCDATA_BYTES);
            let bytes = s.data_range(gofunc, len).ok()??;
            Some((gofunc, bytes.to_vec()))
        });
        Ok(Some(table))
    }

    /// Memory the table holds, in bytes.
    pub fn bytes(&self) -> u64 {
        (self.data.len() + self.funcdata.as_ref().map_or(0, |f| f.1.len())) as u64
    }

    /// Whether inline trees can be read (`go:func.*` was found).
    pub fn has_inline_trees(&self) -> bool {
        self.funcdata.is_some()
    }

    /// Number of functions.
    pub fn len(&self) -> usize {
        self.nfunc
    }

    /// Whether the table lists no function (never, once read).
    pub fn is_empty(&self) -> bool {
        self.nfunc == 0
    }

    /// The entry offset of functab entry `i` (0..=nfunc).
    fn entry_off(&self, i: usize) -> Option<u32> {
        u32_at(&self.data, self.pclntab.checked_add(i.checked_mul(8)?)?)
    }

    /// Function `i` of the table.
    pub fn func(&self, i: usize) -> Option<Func> {
        if i >= self.nfunc {
            return None;
        }
        let entry_off = self.entry_off(i)?;
        let end_off = self.entry_off(i + 1)?;
        if end_off <= entry_off {
            return None;
        }
        let func_off = u32_at(&self.data, self.pclntab + i * 8 + 4)?;
        let record = self.pclntab.checked_add(func_off as usize)?;
        let field = |n: usize| u32_at(&self.data, record + 4 * n);
        // The record's own entry must be the table's: anything else is corruption.
        if field(0)? != entry_off {
            return None;
        }
        let nfuncdata = *self.data.get(record + FUNC_BYTES - 1)?;
        let npcdata = field(7)?;
        // Its pcdata and funcdata offsets must be in the section too.
        let tail = (npcdata as usize)
            .checked_add(usize::from(nfuncdata))?
            .checked_mul(4)?;
        if record + FUNC_BYTES + tail > self.data.len() {
            return None;
        }
        Some(Func {
            entry: self.text_start.checked_add(u64::from(entry_off))?,
            end: self.text_start.checked_add(u64::from(end_off))?,
            record,
            name_off: field(1)? as i32,
            pcsp: field(4)?,
            pcfile: field(5)?,
            pcln: field(6)?,
            npcdata,
            cu_offset: field(8)?,
            nfuncdata,
        })
    }

    /// Every function, in address order (records that do not check out are left out).
    pub fn funcs(&self) -> impl Iterator<Item = Func> + '_ {
        (0..self.nfunc).filter_map(|i| self.func(i))
    }

    /// The function containing virtual address `pc` (as linked).
    pub fn func_at(&self, pc: u64) -> Option<Func> {
        let off = u32::try_from(pc.checked_sub(self.text_start)?).ok()?;
        // Binary search over the entry offsets: the last entry <= off.
        let (mut lo, mut hi) = (0usize, self.nfunc);
        while lo < hi {
            let mid = lo + (hi - lo) / 2;
            if self.entry_off(mid)? <= off {
                lo = mid + 1;
            } else {
                hi = mid;
            }
        }
        let f = self.func(lo.checked_sub(1)?)?;
        (pc < f.end).then_some(f)
    }

    /// The first function named `name` (e.g. `runtime.schedinit`).
    pub fn func_named(&self, name: &str) -> Option<Func> {
        self.funcs()
            .find(|f| self.name_at(f.name_off).as_deref() == Some(name))
    }

    /// A name of the function name table.
    fn name_at(&self, off: i32) -> Option<Cow<'_, str>> {
        let at = self.funcnametab.checked_add(usize::try_from(off).ok()?)?;
        cstr(&self.data, at)
    }

    /// The name of `f`.
    pub fn name(&self, f: &Func) -> Option<Cow<'_, str>> {
        self.name_at(f.name_off)
    }

    /// The value of the pc-value table at `off` (in the pc-value area) for `pc` in `f`; `None`
    /// when the table has no value there (or is malformed).
    fn pcvalue(&self, f: &Func, off: u32, pc: u64) -> Option<i32> {
        if off == 0 || pc < f.entry || pc >= f.end {
            return None;
        }
        let mut at = self.pctab.checked_add(off as usize)?;
        let (mut val, mut cur) = (-1i32, f.entry);
        // Each step covers at least one byte of the function.
        for step in 0..=(f.end - f.entry) {
            let (uv, n) = varint(&self.data, at)?;
            if uv == 0 && step > 0 {
                return None;
            }
            at += n;
            val = val.wrapping_add(zigzag(uv));
            let (pc_delta, n) = varint(&self.data, at)?;
            at += n;
            cur = cur.checked_add(u64::from(pc_delta))?;
            if pc < cur {
                return Some(val);
            }
        }
        None
    }

    /// The stack pointer's offset from its value at entry, in bytes, over `f`: `(pc, delta)`
    /// runs in address order, each up to the next (the last up to the end of the function's
    /// code, returned second). Go's `.debug_frame` is generated from this very table.
    pub fn sp_deltas(&self, f: &Func) -> (Vec<(u64, i32)>, u64) {
        let mut runs = Vec::new();
        let Some(mut at) = self
            .pctab
            .checked_add(f.pcsp as usize)
            .filter(|_| f.pcsp != 0)
        else {
            return (runs, f.entry);
        };
        let (mut val, mut cur) = (-1i32, f.entry);
        for step in 0..=(f.end - f.entry) {
            let Some((uv, n)) = varint(&self.data, at) else {
                break;
            };
            if uv == 0 && step > 0 {
                break;
            }
            at += n;
            val = val.wrapping_add(zigzag(uv));
            let Some((pc_delta, n)) = varint(&self.data, at) else {
                break;
            };
            at += n;
            let next = cur.saturating_add(u64::from(pc_delta)).min(f.end);
            if next > cur {
                runs.push((cur, val));
            }
            cur = next;
            if cur >= f.end {
                break;
            }
        }
        (runs, cur)
    }

    /// The file of file number `fileno` of `f`'s compilation unit.
    fn file(&self, f: &Func, fileno: i32) -> Option<Cow<'_, str>> {
        let index = f.cu_offset.checked_add(u32::try_from(fileno).ok()?)? as usize;
        let off = u32_at(&self.data, self.cutab.checked_add(index.checked_mul(4)?)?)?;
        if off == u32::MAX {
            return None;
        }
        cstr(&self.data, self.filetab.checked_add(off as usize)?)
    }

    /// Offset `i` of `f`'s pcdata (`table` < npcdata), 0 when absent.
    fn pcdata_off(&self, f: &Func, table: u32) -> u32 {
        if table >= f.npcdata {
            return 0;
        }
        u32_at(&self.data, f.record + FUNC_BYTES + 4 * table as usize).unwrap_or(0)
    }

    /// The address of `f`'s funcdata `i`, when it has one and `go:func.*` is known.
    fn funcdata(&self, f: &Func, i: u32) -> Option<u64> {
        if i >= u32::from(f.nfuncdata) {
            return None;
        }
        let at = f.record + FUNC_BYTES + 4 * (f.npcdata as usize + i as usize);
        let off = u32_at(&self.data, at)?;
        if off == u32::MAX {
            return None;
        }
        let (base, _) = self.funcdata.as_ref()?;
        base.checked_add(u64::from(off))
    }

    /// `inlinedCall` `index` of the inline tree at `tree`: (name offset, parent pc offset).
    fn inlined_call(&self, tree: u64, index: i32) -> Option<(i32, i32)> {
        let (base, bytes) = self.funcdata.as_ref()?;
        let at = tree
            .checked_sub(*base)?
            .checked_add(u64::try_from(index).ok()?.checked_mul(INLINED_CALL_BYTES)?)?;
        let at = usize::try_from(at).ok()?;
        Some((u32_at(bytes, at + 4)? as i32, u32_at(bytes, at + 8)? as i32))
    }

    /// The frames at virtual address `pc` (as linked), innermost inlined function first and
    /// the containing function last, with file and line; empty when no function contains it.
    pub fn frames(&self, pc: u64) -> Vec<FrameLine> {
        let Some(f) = self.func_at(pc) else {
            return Vec::new();
        };
        let tree = self.funcdata(&f, FUNCDATA_INL_TREE);
        let inl = self.pcdata_off(&f, PCDATA_INL_TREE_INDEX);
        let mut out = Vec::new();
        let mut at = pc;
        loop {
            let file = self
                .pcvalue(&f, f.pcfile, at)
                .and_then(|n| self.file(&f, n))
                .map(Cow::into_owned)
                .unwrap_or_default();
            let line = self.pcvalue(&f, f.pcln, at).map_or(0, i64::from);
            let inlined = match tree {
                Some(tree) if out.len() < MAX_INLINE_DEPTH => self
                    .pcvalue(&f, inl, at)
                    .filter(|&i| i >= 0)
                    .and_then(|i| self.inlined_call(tree, i)),
                _ => None,
            };
            let Some((name_off, parent_pc)) = inlined else {
                out.push(FrameLine {
                    function: self.name(&f).map(Cow::into_owned).unwrap_or_default(),
                    file,
                    line,
                });
                return out;
            };
            out.push(FrameLine {
                function: self
                    .name_at(name_off)
                    .map(Cow::into_owned)
                    .unwrap_or_default(),
                file,
                line,
            });
            // The call site in the function it was inlined into.
            match u64::try_from(parent_pc)
                .ok()
                .and_then(|p| f.entry.checked_add(p))
                .filter(|&p| p < f.end)
            {
                Some(p) => at = p,
                None => {
                    out.push(FrameLine {
                        function: self.name(&f).map(Cow::into_owned).unwrap_or_default(),
                        file: String::new(),
                        line: 0,
                    });
                    return out;
                }
            }
        }
    }
}

/// Where `go:func.*` is (the base of funcdata offsets): read from the runtime's
/// `moduledata`, found as the record in writable data that points at the pc header and
/// agrees with it (its function name table and text start). In a position-independent
/// binary those pointers are 0 in the file and set by `R_X86_64_RELATIVE` relocations,
/// whose addends are read instead.
fn find_gofunc<'data, R: object::ReadRef<'data>>(
    obj: &object::File<'data, R>,
    header: u64,
    table: &GoTable,
) -> Option<u64> {
    use std::collections::HashMap;
    let mut relocated: HashMap<u64, u64> = HashMap::new();
    if let Some(relocs) = obj.dynamic_relocations() {
        for (at, r) in relocs.take(MAX_RELOCATIONS) {
            if r.flags()
                == (object::RelocationFlags::Elf {
                    r_type: R_X86_64_RELATIVE,
                })
            {
                relocated.insert(at, r.addend() as u64);
            }
        }
    }
    let writable = |s: &object::Section<'data, '_, R>| match s.flags() {
        SectionFlags::Elf { sh_flags } => sh_flags & u64::from(object::elf::SHF_WRITE) != 0,
        _ => false,
    };
    let sections: Vec<_> = obj
        .sections()
        .filter(|s| writable(s) && s.file_range().is_some())
        .collect();
    let word = |addr: u64| -> Option<u64> {
        if let Some(&v) = relocated.get(&addr) {
            return Some(v);
        }
        let s = sections
            .iter()
            .find(|s| addr >= s.address() && addr + 8 <= s.address() + s.size())?;
        let b = s.data_range(addr, 8).ok()??;
        Some(u64::from_le_bytes(b.try_into().ok()?))
    };
    let funcnametab = header + table.funcnametab as u64;
    let agrees = |md: u64| {
        word(md) == Some(header)
            && word(md + 8) == Some(funcnametab)
            && word(md + MODULEDATA_TEXT) == Some(table.text_start)
    };
    // Relocated pointers first (PIE), then a scan of the data as stored.
    let mut found = relocated
        .iter()
        .filter(|&(_, &v)| v == header)
        .map(|(&at, _)| at)
        .find(|&md| agrees(md));
    let mut scanned = 0u64;
    for s in &sections {
        if found.is_some() || scanned >= MAX_MODULEDATA_SCAN {
            break;
        }
        let len = s.size().min(MAX_MODULEDATA_SCAN - scanned);
        scanned += len;
        let Ok(Some(data)) = s.data_range(s.address(), len) else {
            continue;
        };
        found = data
            .chunks_exact(8)
            .enumerate()
            .filter(|(_, w)| u64::from_le_bytes((*w).try_into().unwrap_or_default()) == header)
            .map(|(i, _)| s.address() + 8 * i as u64)
            .find(|&md| agrees(md));
    }
    word(found? + MODULEDATA_GOFUNC).filter(|&g| g != 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn varints_and_strings_stay_in_bounds() {
        assert_eq!(varint(&[0x05], 0), Some((5, 1)));
        assert_eq!(varint(&[0x80, 0x01], 0), Some((128, 2)));
        assert_eq!(varint(&[0x80, 0x80], 0), None);
        assert_eq!(varint(&[0xff; 8], 0), None);
        assert_eq!(varint(&[], usize::MAX), None);
        assert_eq!((zigzag(0), zigzag(1), zigzag(2), zigzag(3)), (0, -1, 1, -2));
        // A frame of 1 GiB (runtime.call1073741824) keeps its sign.
        assert_eq!(zigzag(0x8000_0010), 0x4000_0008);
        assert_eq!(cstr(b"main.f\0rest", 0).as_deref(), Some("main.f"));
        assert_eq!(cstr(b"no end", 0), None);
        assert_eq!(cstr(b"x\0", 9), None);
        let long = vec![b'a'; MAX_NAME_BYTES + 10];
        assert_eq!(cstr(&long, 0), None);
    }

    /// A table of one function `f` at 0x1000..0x1010 whose pc/sp table is `pcsp`.
    fn one_function(pcsp: &[u8]) -> GoTable {
        let mut data = vec![0u8; HEADER_BYTES];
        let pclntab = data.len();
        // functab: (0, 16), (0x10, -)
        data.extend_from_slice(&0u32.to_le_bytes());
        data.extend_from_slice(&16u32.to_le_bytes());
        data.extend_from_slice(&0x10u32.to_le_bytes());
        data.extend_from_slice(&0u32.to_le_bytes());
        let mut record = [0u8; FUNC_BYTES];
        record[16..20].copy_from_slice(&1u32.to_le_bytes());
        data.extend_from_slice(&record);
        let pctab = data.len();
        data.push(0);
        data.extend_from_slice(pcsp);
        data.extend_from_slice(b"f\0");
        GoTable {
            funcnametab: data.len() - 2,
            cutab: 0,
            filetab: 0,
            pctab,
            pclntab,
            data,
            text_start: 0x1000,
            nfunc: 1,
            funcdata: None,
        }
    }

    #[test]
    fn decodes_a_pc_sp_table() {
        // From -1: +1 (0) for 4 bytes, +8 (8) for 8 bytes, -8 (0) for 4 bytes, end.
        let t = one_function(&[0x02, 4, 0x10, 8, 0x0f, 4, 0]);
        let f = t.func_at(0x1004).expect("the function");
        assert_eq!((f.entry, f.end), (0x1000, 0x1010));
        assert_eq!(t.name(&f).as_deref(), Some("f"));
        assert_eq!(
            t.sp_deltas(&f),
            (vec![(0x1000, 0), (0x1004, 8), (0x100c, 0)], 0x1010)
        );
        assert_eq!(t.pcvalue(&f, 1, 0x1005), Some(8));
        assert_eq!(t.pcvalue(&f, 1, 0x1010), None);
        assert_eq!(t.func_at(0x1010), None);
        assert_eq!(t.func_at(0xfff), None);
    }

    #[test]
    fn a_malformed_pc_sp_table_ends_within_the_function() {
        // A delta past the function's end, then a table running off the section.
        let t = one_function(&[0x02, 0xff, 0x7f]);
        let f = t.func(0).unwrap();
        assert_eq!(t.sp_deltas(&f), (vec![(0x1000, 0)], 0x1010));
        // A varint that runs on into the bytes after it (here the name): clamped to the end.
        let t = one_function(&[0x02, 0x80]);
        let f = t.func(0).unwrap();
        assert_eq!(t.sp_deltas(&f), (vec![(0x1000, 0)], 0x1010));
        assert_eq!(t.frames(0x1004).len(), 1);
    }
}
