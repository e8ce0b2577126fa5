//! Compact unwind tables from a binary's DWARF CFI (`.eh_frame`, and
//! `.debug_frame` for what `.eh_frame` lacks, e.g. Go functions), or for a Go binary
//! without `.debug_frame` (`-ldflags=-w`) from its pc/sp tables ([`crate::gopclntab`]).
//!
//! gimli evaluates the CFI programs; this module reduces each row to the three
//! things the BPF walker needs on x86-64 — where the caller's stack pointer
//! (CFA) is, that the return address sits at CFA − 8, and where the caller's
//! rbp was saved — in 8 bytes (`struct ff_unwind_row` in `bpf/unwind.h`).
//! Consecutive rows with the same rule are merged.
//!
//! The input is untrusted (any binary a tenant maps): the file is read with
//! `pread` through a bounded cache rather than mapped (a tenant truncating its own
//! library would otherwise SIGBUS the agent), section sizes are capped before
//! anything is decompressed, every malformed entry is skipped and counted, and
//! what a build keeps is capped too: a highly compressible `.debug_frame` of
//! millions of identical FDEs is a few KiB on disk, but each FDE kept costs
//! memory ([`MAX_BUILD_BYTES`]).

use std::fs::File;
use std::time::Instant;

use gimli::{
    BaseAddresses, CfaRule, CieOrFde, DebugFrame, EhFrame, LittleEndian, Register, RegisterRule,
    UnwindContext, UnwindSection, X86_64,
};
use object::{Object as _, ObjectSection as _, ObjectSegment as _};

use crate::gopclntab::GoTable;

/// Largest CFI section read, after decompression (`.eh_frame` of the largest binaries is
/// a few tens of MiB).
pub const MAX_SECTION_BYTES: u64 = 64 << 20;
/// Bytes of file one build reads in all: both sections as stored, and the headers.
const MAX_READ_BYTES: u64 = 2 * MAX_SECTION_BYTES + (16 << 20);
/// Most memory one build keeps for the entries it reads before merging them (24 bytes
/// per FDE, 8 per row): about a million FDEs, several times what the largest programs have.
pub const MAX_BUILD_BYTES: u64 = 32 << 20;

/// `enum ff_cfa_kind` of `bpf/unwind.h`.
pub mod kind {
    /// No CFI for this address: frame-pointer step.
    pub const NONE: u8 = 0;
    /// CFA = rsp + off.
    pub const RSP: u8 = 1;
    /// CFA = rbp + off.
    pub const RBP: u8 = 2;
    /// PLT stub expression; off is the threshold of `rip & 15`.
    pub const PLT: u8 = 3;
    /// CFA = *(rbp + off) (stack realignment).
    pub const DEREF_RBP: u8 = 4;
    /// Outermost frame (return address undefined).
    pub const END: u8 = 5;
    /// Rule the walker cannot evaluate.
    pub const UNSUPPORTED: u8 = 6;
    /// Go's `runtime.mcall`: the goroutine it switched away from is at sp + 8 × rbp_off,
    /// its saved sp and pc at that goroutine + off.
    pub const GO_MCALL: u8 = 7;
    /// Flag: rbp cannot be recovered after this frame.
    pub const RBP_LOST: u8 = 0x10;
}

/// One row of a compact table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Row {
    /// ELF virtual address where the rule starts.
    pub pc: u32,
    /// CFA offset (meaning depends on the kind).
    pub cfa_off: i16,
    /// `kind::*`, possibly with `kind::RBP_LOST`.
    pub kind: u8,
    /// Caller's rbp at CFA + 8 × this; 0: unchanged.
    pub rbp_off: i8,
}

impl Row {
    fn none(pc: u32) -> Self {
        Self {
            pc,
            cfa_off: 0,
            kind: kind::NONE,
            rbp_off: 0,
        }
    }

    fn same_rule(&self, other: &Self) -> bool {
        (self.cfa_off, self.kind, self.rbp_off) == (other.cfa_off, other.kind, other.rbp_off)
    }

    /// The 8 bytes of `struct ff_unwind_row` (little endian, as on x86-64).
    pub fn to_bytes(self) -> [u8; 8] {
        let mut b = [0u8; 8];
        b[..4].copy_from_slice(&self.pc.to_le_bytes());
        b[4..6].copy_from_slice(&self.cfa_off.to_le_bytes());
        b[6] = self.kind;
        b[7] = self.rbp_off.to_le_bytes()[0];
        b
    }
}

/// A loadable segment: how file offsets map to virtual addresses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Segment {
    /// File offset of the segment.
    pub offset: u64,
    /// Its virtual address.
    pub vaddr: u64,
    /// Its size in the file.
    pub filesz: u64,
}

/// What was learnt from one binary.
#[derive(Debug, Clone, Default)]
pub struct BinaryTable {
    /// Sorted rows, merged.
    pub rows: Vec<Row>,
    /// Loadable segments, to compute a mapping's load bias.
    pub segments: Vec<Segment>,
    /// FDEs read.
    pub fdes: u64,
    /// Entries skipped as malformed or out of range (the table covers the rest).
    pub skipped: u64,
    /// A Go binary (its `.debug_frame` omits rbp; Go's ABI fixes it at CFA − 16).
    pub go: bool,
}

/// Why a binary has no table.
#[derive(Debug, thiserror::Error)]
pub enum TableError {
    /// Not an ELF file we can read.
    #[error("not a readable ELF file: {0}")]
    Parse(String),
    /// Another architecture than x86-64.
    #[error("unwinding {0:?} binaries is not supported (x86-64 only)")]
    Architecture(object::Architecture),
    /// Neither `.eh_frame` nor `.debug_frame` has usable entries.
    #[error("no usable CFI (.eh_frame / .debug_frame) in the binary")]
    NoCfi,
    /// A section above [`MAX_SECTION_BYTES`].
    #[error("{section} is {size} bytes, above the {MAX_SECTION_BYTES}-byte limit")]
    TooLarge {
        /// Section name.
        section: &'static str,
        /// Its (uncompressed) size.
        size: u64,
    },
    /// The build gave up ([`GiveUp`]).
    #[error("the table build gave up before it finished (deadline, or the unwinder stopped)")]
    Deadline,
    /// More entries than a build keeps.
    #[error(
        "{fdes} CFI entries with {rows} rows read and more to come: above the \
         {MAX_BUILD_BYTES}-byte limit of one table build (frames there walk by frame pointer)"
    )]
    TooManyEntries {
        /// FDEs read when the limit was reached.
        fdes: u64,
        /// Their rows.
        rows: u64,
    },
}

const RSP: Register = X86_64::RSP;
const RBP: Register = X86_64::RBP;
const RA: Register = X86_64::RA;

/// `DW_OP_breg7 8; DW_OP_breg16 0; DW_OP_lit15; DW_OP_and; DW_OP_lit{10,11};
/// DW_OP_ge; DW_OP_lit3; DW_OP_shl; DW_OP_plus`: the CFA of a PLT entry
/// (binutils' lazy-binding stubs), which depends on where in the 16-byte stub
/// rip is.
fn plt_threshold(expr: &[u8]) -> Option<i16> {
    match expr {
        [
            0x77,
            0x08,
            0x80,
            0x00,
            0x3f,
            0x1a,
            lit,
            0x2a,
            0x33,
            0x24,
            0x22,
        ] if (0x30..=0x4f).contains(lit) => Some(i16::from(*lit - 0x30)),
        _ => None,
    }
}

/// `DW_OP_breg6 off; DW_OP_deref`: CFA saved below rbp (GCC's stack realignment).
fn deref_rbp(expr: &[u8]) -> Option<i16> {
    let [0x76, rest @ ..] = expr else {
        return None;
    };
    let mut r = gimli::EndianSlice::new(rest, LittleEndian);
    let off = gimli::Reader::read_sleb128(&mut r).ok()?;
    (r.slice() == [0x06]).then_some(i16::try_from(off).ok()?)
}

/// When a build gives up ([`TableError::Deadline`]): at a deadline, or when its owner stops.
#[derive(Debug, Clone, Copy, Default)]
pub struct GiveUp<'a> {
    /// Give up after this instant.
    pub deadline: Option<Instant>,
    /// Give up once this is set.
    pub stop: Option<&'a std::sync::atomic::AtomicBool>,
}

impl GiveUp<'_> {
    fn now(&self) -> bool {
        self.deadline.is_some_and(|d| Instant::now() >= d)
            || self
                .stop
                .is_some_and(|s| s.load(std::sync::atomic::Ordering::Relaxed))
    }
}

/// Builds the table of a binary opened with [`crate::process::files`], reading it through a
/// bounded cache; [`TableError::Deadline`] if `give_up` says so before it is done.
pub fn build_from_file(file: &File, give_up: GiveUp<'_>) -> Result<BinaryTable, TableError> {
    let reader = crate::process::files::BoundedReader::new(file, MAX_SECTION_BYTES, MAX_READ_BYTES)
        .map_err(|e| TableError::Parse(e.to_string()))?;
    build_until(&reader, give_up)
}

/// The FDEs read so far: each one's address range and rows, all rows in one vector (one
/// allocation for millions of FDEs, not one each), within a limit of bytes.
struct Fdes<'a> {
    /// (start, end, first row, row count).
    index: Vec<(u64, u64, u32, u32)>,
    rows: Vec<Row>,
    limit: u64,
    give_up: GiveUp<'a>,
}

impl<'a> Fdes<'a> {
    fn new(limit: u64, give_up: GiveUp<'a>) -> Self {
        Self {
            index: Vec::new(),
            rows: Vec::new(),
            limit,
            give_up,
        }
    }

    /// Whether to give up (looked at every 4,096 FDEs).
    fn overrun(&self) -> bool {
        self.index.len().is_multiple_of(4096) && self.give_up.now()
    }

    fn full(&self) -> bool {
        (self.index.len() * 24 + self.rows.len() * 8) as u64 > self.limit
    }

    fn too_many(&self) -> TableError {
        TableError::TooManyEntries {
            fdes: self.index.len() as u64,
            rows: self.rows.len() as u64,
        }
    }

    fn rows_of(&self, i: usize) -> &[Row] {
        let (_, _, first, n) = self.index[i];
        &self.rows[first as usize..first as usize + n as usize]
    }
}

/// Builds the table of an ELF image (anything object can read).
pub fn build<'data, R: object::ReadRef<'data>>(data: R) -> Result<BinaryTable, TableError> {
    build_until(data, GiveUp::default())
}

/// [`build`], giving up with [`TableError::Deadline`] when `give_up` says so.
fn build_until<'data, R: object::ReadRef<'data>>(
    data: R,
    give_up: GiveUp<'_>,
) -> Result<BinaryTable, TableError> {
    let obj = object::File::parse(data).map_err(|e| TableError::Parse(e.to_string()))?;
    if obj.architecture() != object::Architecture::X86_64 {
        return Err(TableError::Architecture(obj.architecture()));
    }
    let mut out = BinaryTable {
        go: obj.section_by_name(".gopclntab").is_some()
            || obj.section_by_name(".go.buildinfo").is_some(),
        segments: obj
            .segments()
            .map(|s| {
                let (offset, filesz) = s.file_range();
                Segment {
                    offset,
                    vaddr: s.address(),
                    filesz,
                }
            })
            .collect(),
        ..BinaryTable::default()
    };
    // FDEs of .eh_frame first, so that they win overlaps.
    let mut fdes = Fdes::new(MAX_BUILD_BYTES, give_up);
    let text = obj.section_by_name(".text").map_or(0, |s| s.address());
    if let Some(section) = obj.section_by_name(".eh_frame") {
        let data = section_bytes(&section, ".eh_frame", give_up)?;
        let eh = EhFrame::new(&data, LittleEndian);
        let bases = BaseAddresses::default()
            .set_eh_frame(section.address())
            .set_text(text);
        read_fdes(&eh, &bases, &mut out, &mut fdes)?;
    }
    let eh_count = fdes.index.len();
    let mut go_table = None;
    if let Some(section) = obj.section_by_name(".debug_frame") {
        let data = section_bytes(&section, ".debug_frame", give_up)?;
        let mut df = DebugFrame::new(&data, LittleEndian);
        df.set_address_size(8);
        read_fdes(&df, &BaseAddresses::default(), &mut out, &mut fdes)?;
    } else if out.go {
        // A Go binary stripped of DWARF (`-ldflags=-w`): its pc/sp tables, from which the
        // linker would have written .debug_frame.
        go_table = GoTable::from_elf(&obj).ok().flatten();
        if let Some(table) = &go_table {
            read_go_functions(table, &mut out, &mut fdes)?;
        }
    }
    // Of .debug_frame, only what .eh_frame does not cover (a cgo binary has both).
    let mut covered: Vec<(u64, u64)> = fdes.index[..eh_count].iter().map(|f| (f.0, f.1)).collect();
    covered.sort_unstable();
    let mut order: Vec<u32> = (0..eh_count as u32).collect();
    for (i, f) in fdes.index.iter().enumerate().skip(eh_count) {
        let at = covered.partition_point(|c| c.0 < f.1);
        if at > 0 && covered[at - 1].1 > f.0 {
            continue;
        }
        order.push(i as u32);
    }
    drop(covered);
    if order.is_empty() {
        return Err(TableError::NoCfi);
    }
    out.fdes = order.len() as u64;
    order.sort_by_key(|&i| fdes.index[i as usize].0);
    // Concatenate in address order and merge rows that repeat the previous rule.
    let mut merged: Vec<Row> = Vec::new();
    let mut prev_end = 0u64;
    for i in order {
        let (start, end, _, _) = fdes.index[i as usize];
        if start < prev_end {
            // Overlapping FDEs: the earlier one's rows stand.
            out.skipped += 1;
            continue;
        }
        // A gap between functions has no CFI: the end row of the previous FDE stays
        // only if this one does not start right there.
        if let Some(last) = merged.last()
            && u64::from(last.pc) == start
            && last.kind == kind::NONE
        {
            merged.pop();
        }
        for &r in fdes.rows_of(i as usize) {
            push_merged(&mut merged, r);
        }
        if let Ok(end32) = u32::try_from(end) {
            push_merged(&mut merged, Row::none(end32));
        }
        prev_end = end;
    }
    if out.go
        && let Some((start, end)) = symbol_range(&obj, "runtime.mcall").or_else(|| {
            let f = go_table.as_ref()?.func_named("runtime.mcall")?;
            Some((u32::try_from(f.entry).ok()?, u32::try_from(f.end).ok()?))
        })
    {
        merged = with_go_mcall(merged, start, end);
    }
    out.rows = merged;
    Ok(out)
}

/// Where `g.sched` (a `gobuf`: sp, then pc) sits in Go's `runtime.g`. The fields before it
/// (`stack`, `stackguard0`, `stackguard1`, `_panic`, `_defer`, `m`) and gobuf's first two
/// have not moved since Go 1.4; the runtime's comment says debuggers hard-code them.
const GO_G_SCHED: i16 = 0x38;

/// The address range of the ELF symbol `name`, if the binary has a symbol table.
fn symbol_range<'data, R: object::ReadRef<'data>>(
    obj: &object::File<'data, R>,
    name: &str,
) -> Option<(u32, u32)> {
    use object::ObjectSymbol as _;
    let sym = obj.symbols().find(|s| s.name() == Ok(name))?;
    let start = u32::try_from(sym.address()).ok()?;
    let end = u32::try_from(sym.address().checked_add(sym.size())?).ok()?;
    (end > start).then_some((start, end))
}

/// `rows` with `[start, end)` (Go's `runtime.mcall`) covered by one [`kind::GO_MCALL`] row:
/// there, on a thread's scheduler stack, the caller is not above on this stack but is the
/// goroutine mcall switched away from (Go 1.17 to 1.26: mcall pushes it right before
/// calling fn, so it is at the walker's sp once fn's frame is unwound).
fn with_go_mcall(rows: Vec<Row>, start: u32, end: u32) -> Vec<Row> {
    let at_end = rows.iter().rev().find(|r| r.pc <= end).copied();
    let mut out: Vec<Row> = rows.iter().copied().filter(|r| r.pc < start).collect();
    out.push(Row {
        pc: start,
        cfa_off: GO_G_SCHED,
        kind: kind::GO_MCALL,
        rbp_off: 0,
    });
    if !rows.iter().any(|r| r.pc == end) {
        out.push(at_end.map_or(Row::none(end), |r| Row { pc: end, ..r }));
    }
    out.extend(rows.iter().copied().filter(|r| r.pc >= end));
    out
}

/// The rows of every function of a Go binary's pc/sp table ([`GoTable::sp_deltas`]), as
/// Go's linker writes them into `.debug_frame`: CFA = rsp + the stack pointer's offset + 8
/// (the return address), the caller's rbp at CFA − 16 once the frame has one.
fn read_go_functions(
    table: &GoTable,
    out: &mut BinaryTable,
    fdes: &mut Fdes<'_>,
) -> Result<(), TableError> {
    for f in table.funcs() {
        let (runs, end) = table.sp_deltas(&f);
        let (Ok(_), Ok(_)) = (u32::try_from(f.entry), u32::try_from(end)) else {
            out.skipped += 1;
            continue;
        };
        let first = fdes.rows.len();
        for (pc, delta) in runs {
            // As gimli's rows from .debug_frame: any offset that fits, the rest unsupported.
            let cfa_off = delta.checked_add(8).and_then(|c| i16::try_from(c).ok());
            let row = match cfa_off {
                Some(cfa_off) => Row {
                    pc: pc as u32,
                    cfa_off,
                    kind: kind::RSP,
                    rbp_off: if cfa_off >= 16 { -2 } else { 0 },
                },
                _ => Row {
                    pc: pc as u32,
                    cfa_off: 0,
                    kind: kind::UNSUPPORTED,
                    rbp_off: 0,
                },
            };
            fdes.rows.push(row);
            if fdes.full() {
                return Err(fdes.too_many());
            }
        }
        if fdes.overrun() {
            return Err(TableError::Deadline);
        }
        let n = fdes.rows.len() - first;
        if n > 0 {
            let (Ok(first), Ok(n)) = (u32::try_from(first), u32::try_from(n)) else {
                return Err(fdes.too_many());
            };
            fdes.index.push((f.entry, end, first, n));
            if fdes.full() {
                return Err(fdes.too_many());
            }
        }
    }
    Ok(())
}

/// Appends `r` unless it repeats the previous row's rule; a row at the previous row's
/// address replaces it.
fn push_merged(merged: &mut Vec<Row>, r: Row) {
    match merged.last_mut() {
        Some(last) if last.pc == r.pc => *last = r,
        Some(last) if last.same_rule(&r) => {}
        _ => merged.push(r),
    }
}

fn section_bytes<'data, R: object::ReadRef<'data>>(
    section: &object::Section<'data, '_, R>,
    name: &'static str,
    give_up: GiveUp<'_>,
) -> Result<std::borrow::Cow<'data, [u8]>, TableError> {
    let size = section
        .compressed_file_range()
        .map_or(section.size(), |r| r.uncompressed_size);
    if size > MAX_SECTION_BYTES {
        return Err(TableError::TooLarge {
            section: name,
            size,
        });
    }
    let parse_err = |e: &dyn std::fmt::Display| TableError::Parse(format!("{name}: {e}"));
    let compressed = section.compressed_data().map_err(|e| parse_err(&e))?;
    if compressed.format != object::CompressionFormat::Zlib {
        return section.uncompressed_data().map_err(|e| parse_err(&e));
    }
    // zlib (what compilers and objcopy use): decompressed here in steps, so that a build
    // can give up in the middle of a large section.
    use std::io::Read as _;
    let mut out = Vec::with_capacity(size as usize);
    let mut decoder = flate2::bufread::ZlibDecoder::new(compressed.data).take(size);
    let mut chunk = vec![0u8; 1 << 20];
    loop {
        if give_up.now() {
            return Err(TableError::Deadline);
        }
        let n = decoder.read(&mut chunk).map_err(|e| parse_err(&e))?;
        if n == 0 {
            break;
        }
        out.extend_from_slice(&chunk[..n]);
    }
    if out.len() as u64 != size {
        return Err(parse_err(&format!(
            "decompressed to {} bytes, expected {size}",
            out.len()
        )));
    }
    Ok(std::borrow::Cow::Owned(out))
}

fn read_fdes<'a, S>(
    section: &S,
    bases: &BaseAddresses,
    out: &mut BinaryTable,
    fdes: &mut Fdes<'_>,
) -> Result<(), TableError>
where
    S: UnwindSection<gimli::EndianSlice<'a, LittleEndian>>,
{
    let mut ctx = Box::new(UnwindContext::new());
    let mut entries = section.entries(bases);
    loop {
        let entry = match entries.next() {
            Ok(Some(e)) => e,
            Ok(None) => break,
            // A malformed entry ends the section: its length cannot be trusted.
            Err(_) => {
                out.skipped += 1;
                break;
            }
        };
        let CieOrFde::Fde(partial) = entry else {
            continue;
        };
        let Ok(fde) = partial.parse(S::cie_from_offset) else {
            out.skipped += 1;
            continue;
        };
        let (start, len) = (fde.initial_address(), fde.len());
        let end = start.saturating_add(len);
        if len == 0 || u32::try_from(end).is_err() {
            out.skipped += 1;
            continue;
        }
        let Ok(mut table) = fde.rows(section, bases, &mut ctx) else {
            out.skipped += 1;
            continue;
        };
        let first = fdes.rows.len();
        loop {
            match table.next_row() {
                Ok(Some(row)) => {
                    let Ok(pc) = u32::try_from(row.start_address()) else {
                        break;
                    };
                    fdes.rows.push(convert(section, row, pc, out.go));
                    if fdes.full() {
                        return Err(fdes.too_many());
                    }
                }
                Ok(None) => break,
                Err(_) => {
                    out.skipped += 1;
                    break;
                }
            }
        }
        if fdes.overrun() {
            return Err(TableError::Deadline);
        }
        let n = fdes.rows.len() - first;
        if n > 0 {
            let (Ok(first), Ok(n)) = (u32::try_from(first), u32::try_from(n)) else {
                return Err(fdes.too_many());
            };
            fdes.index.push((start, end, first, n));
            if fdes.full() {
                return Err(fdes.too_many());
            }
        }
    }
    Ok(())
}

fn convert<'a, S>(section: &S, row: &gimli::UnwindTableRow<usize>, pc: u32, go: bool) -> Row
where
    S: UnwindSection<gimli::EndianSlice<'a, LittleEndian>>,
{
    let unsupported = Row {
        pc,
        cfa_off: 0,
        kind: kind::UNSUPPORTED,
        rbp_off: 0,
    };
    if matches!(row.register(RA), Some(RegisterRule::Undefined)) {
        return Row {
            kind: kind::END,
            ..unsupported
        };
    }
    let (mut k, cfa_off) = match row.cfa() {
        CfaRule::RegisterAndOffset { register, offset } => {
            let Ok(off) = i16::try_from(*offset) else {
                return unsupported;
            };
            match *register {
                RSP => (kind::RSP, off),
                RBP => (kind::RBP, off),
                _ => return unsupported,
            }
        }
        CfaRule::Expression(e) => {
            let Ok(expr) = e.get(section) else {
                return unsupported;
            };
            let bytes = expr.0.slice();
            if let Some(t) = plt_threshold(bytes) {
                (kind::PLT, t)
            } else if let Some(off) = deref_rbp(bytes) {
                (kind::DEREF_RBP, off)
            } else {
                return unsupported;
            }
        }
    };
    let mut rbp_off = 0i8;
    match row.register(RBP) {
        Some(RegisterRule::Offset(o)) if o % 8 == 0 && o != 0 => match i8::try_from(o / 8) {
            Ok(v) => rbp_off = v,
            Err(_) => k |= kind::RBP_LOST,
        },
        None | Some(RegisterRule::Undefined | RegisterRule::SameValue) => {
            // Go's CFI says nothing of rbp, but every Go frame of 16 bytes or
            // more has pushed the caller's rbp right below the return address.
            if go && k == kind::RSP && cfa_off >= 16 {
                rbp_off = -2;
            }
        }
        _ => k |= kind::RBP_LOST,
    }
    Row {
        pc,
        cfa_off,
        kind: k,
        rbp_off,
    }
}

/// Load bias of the mapping `[start, end)` of file offset `offset`: runtime
/// address minus ELF virtual address. The kernel maps whole pages, so the
/// segment is the one whose file start lies in the mapping's file range (a
/// segment at file offset 0x12800 is mapped from offset 0x12000).
pub fn load_bias(segments: &[Segment], start: u64, end: u64, offset: u64) -> Option<u64> {
    let len = end.saturating_sub(start);
    segments
        .iter()
        .find(|s| s.filesz > 0 && offset <= s.offset && s.offset < offset.saturating_add(len))
        .map(|s| start.wrapping_add(s.offset - offset).wrapping_sub(s.vaddr))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn recognizes_plt_and_realignment_expressions() {
        let plt11 = [
            0x77, 0x08, 0x80, 0x00, 0x3f, 0x1a, 0x3b, 0x2a, 0x33, 0x24, 0x22,
        ];
        assert_eq!(plt_threshold(&plt11), Some(11));
        assert_eq!(plt_threshold(&plt11[..10]), None);
        // DW_OP_breg6 -8; DW_OP_deref
        assert_eq!(deref_rbp(&[0x76, 0x78, 0x06]), Some(-8));
        assert_eq!(deref_rbp(&[0x76, 0x78]), None);
    }

    #[test]
    fn own_binary_has_a_sorted_table_and_bias() {
        let exe = std::fs::read("/proc/self/exe").unwrap();
        let t = build(exe.as_slice()).expect("the test binary has .eh_frame");
        assert!(t.rows.len() > 1000, "{} rows", t.rows.len());
        assert!(t.rows.windows(2).all(|w| w[0].pc < w[1].pc));
        assert!(t.rows.iter().any(|r| r.kind == kind::RSP && r.cfa_off == 8));
        assert!(!t.segments.is_empty());
        let seg = t.segments[0];
        assert_eq!(
            load_bias(&t.segments, 0x5000_0000, 0x5000_1000, seg.offset),
            Some(0x5000_0000 - seg.vaddr)
        );
        // Text at file offset 0x12800, vaddr 0x13800, mapped from offset 0x12000.
        let segs = [
            Segment {
                offset: 0,
                vaddr: 0,
                filesz: 0x127f8,
            },
            Segment {
                offset: 0x12800,
                vaddr: 0x13800,
                filesz: 0x3c980,
            },
        ];
        let base = 0x5555_0000_0000u64;
        let bias = load_bias(&segs, base + 0x13000, base + 0x50000, 0x12000).unwrap();
        assert_eq!(bias, base);
    }

    /// A `.debug_frame` of one CIE and `n` identical FDEs (24 bytes each).
    fn identical_fdes(n: usize) -> Vec<u8> {
        let mut d = 20u32.to_le_bytes().to_vec();
        d.extend_from_slice(&[
            0xff, 0xff, 0xff, 0xff, 1, 0, 1, 0x78, 16, 0x0c, 7, 8, 0x90, 1,
        ]);
        d.resize(24, 0);
        for _ in 0..n {
            d.extend_from_slice(&20u32.to_le_bytes());
            d.extend_from_slice(&0u32.to_le_bytes());
            d.extend_from_slice(&0x1000u64.to_le_bytes());
            d.extend_from_slice(&0x10u64.to_le_bytes());
        }
        d
    }

    #[test]
    fn what_a_build_keeps_of_many_fdes_is_bounded() {
        let data = identical_fdes(10_000);
        let mut df = DebugFrame::new(&data, LittleEndian);
        df.set_address_size(8);
        let mut out = BinaryTable::default();
        // Room for all: every FDE is read, with its one row.
        let mut all = Fdes::new(1 << 20, GiveUp::default());
        read_fdes(&df, &BaseAddresses::default(), &mut out, &mut all).unwrap();
        assert_eq!((all.index.len(), all.rows.len()), (10_000, 10_000));
        // Room for about a thousand: the read stops there, with an error naming the count.
        let mut few = Fdes::new(1000 * 32, GiveUp::default());
        let e = read_fdes(&df, &BaseAddresses::default(), &mut out, &mut few).unwrap_err();
        assert!(
            matches!(
                e,
                TableError::TooManyEntries {
                    fdes: 1000,
                    rows: 1001
                }
            ),
            "{e}"
        );
    }

    #[test]
    fn garbage_is_an_error_not_a_panic() {
        assert!(matches!(
            build(&b"\x7fELF garbage"[..]),
            Err(TableError::Parse(_))
        ));
        // A real ELF header with a corrupted .eh_frame still yields an error or
        // a partial table, never a panic.
        let mut exe = std::fs::read("/proc/self/exe").unwrap();
        let obj = object::File::parse(exe.as_slice()).unwrap();
        let (off, size) = obj
            .section_by_name(".eh_frame")
            .and_then(|s| s.file_range())
            .unwrap();
        drop(obj);
        for (i, b) in exe[off as usize..(off + size) as usize]
            .iter_mut()
            .enumerate()
        {
            if i % 7 == 3 {
                *b = 0xff;
            }
        }
        let _ = build(exe.as_slice());
    }
}
