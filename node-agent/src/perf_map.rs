//! Names of JIT-compiled code from perf maps (`/tmp/perf-<pid>.map`), the
//! format V8 (`node --perf-basic-prof`), the JVM's perf-map agents, .NET and
//! LuaJIT write: one `START SIZE NAME` line (hex) per code object.
//!
//! The file belongs to the profiled process, which may be hostile:
//! * it is opened with [`crate::process::files`]: inside the process's own root
//!   (`openat2(RESOLVE_IN_ROOT)`, so a symlink planted at that path cannot
//!   point the agent at the node's files, whose lines would then appear as
//!   function names in a profile the tenant downloads), only if it is a
//!   regular file (a FIFO would block the agent), non-blocking;
//! * at most [`MAX_BYTES`] are read, streamed line by line (lines longer than
//!   a name can be are cut), malformed lines are skipped, names are cut at
//!   [`MAX_NAME`] bytes, at most [`MAX_ENTRIES`] entries are kept;
//! * what the maps of all processes keep is bounded by a [`PerfMapBudget`]
//!   per symbolizer, since each process's map is kept until the profile is
//!   built;
//! * it is read by PID, so it counts only if that PID still names the process
//!   the samples came from afterwards (its start time, see [`PerfMap::read`]).
//!
//! The pid in the file name is the process's pid in its own PID namespace
//! (the last `NSpid` field of `/proc/<pid>/status`).

use std::io::BufRead as _;

/// Largest perf map read (a long-running V8 process writes a few MiB).
pub const MAX_BYTES: u64 = 64 << 20;
/// Entries kept per process.
pub const MAX_ENTRIES: usize = 1 << 20;
/// Longest name kept, in bytes.
pub const MAX_NAME: usize = 512;
/// Memory the perf maps of one symbolizer may keep, all processes together.
pub const DEFAULT_BUDGET: u64 = 64 << 20;
/// Longest line read whole: two hex numbers and a name.
const MAX_LINE: usize = MAX_NAME + 64;

/// Memory perf maps may still keep (see the module docs).
#[derive(Debug)]
pub struct PerfMapBudget {
    left: u64,
    /// Maps cut short because the budget ran out.
    pub cut: u64,
}

impl PerfMapBudget {
    /// A budget of `bytes`.
    pub fn new(bytes: u64) -> Self {
        Self {
            left: bytes,
            cut: 0,
        }
    }

    /// Bytes left.
    pub fn left(&self) -> u64 {
        self.left
    }
}

impl Default for PerfMapBudget {
    fn default() -> Self {
        Self::new(DEFAULT_BUDGET)
    }
}

/// One code object: its address range and where its name is in [`PerfMap::names`].
#[derive(Debug, Clone, Copy)]
struct Entry {
    start: u64,
    end: u64,
    name_at: u32,
    name_len: u16,
}

/// Bytes one entry keeps besides its name.
const ENTRY_BYTES: u64 = std::mem::size_of::<Entry>() as u64;

/// One process's JIT symbols, sorted by start address.
#[derive(Debug, Clone, Default)]
pub struct PerfMap {
    entries: Vec<Entry>,
    /// Every name, one after the other.
    names: String,
    /// The budget ran out before the end of the file.
    pub truncated: bool,
}

impl PerfMap {
    /// Parses perf-map text; malformed lines are skipped.
    pub fn parse(text: &str) -> Self {
        Self::parse_lines(text.as_bytes(), &mut PerfMapBudget::new(u64::MAX))
    }

    /// Parses perf-map lines from `reader` within `budget`.
    fn parse_lines(mut reader: impl std::io::BufRead, budget: &mut PerfMapBudget) -> Self {
        let mut map = Self::default();
        let mut line = Vec::with_capacity(MAX_LINE);
        loop {
            line.clear();
            let Ok(n) =
                std::io::Read::take(&mut reader, MAX_LINE as u64).read_until(b'\n', &mut line)
            else {
                break;
            };
            if n == 0 {
                break;
            }
            if line.last() != Some(&b'\n') && n == MAX_LINE && skip_line(&mut reader).is_err() {
                break;
            }
            if map.entries.len() >= MAX_ENTRIES {
                break;
            }
            let Some((start, size, name)) = parse_line(&line) else {
                continue;
            };
            let cost = ENTRY_BYTES + name.len() as u64;
            if cost > budget.left {
                map.truncated = true;
                budget.cut += 1;
                break;
            }
            budget.left -= cost;
            let Ok(name_at) = u32::try_from(map.names.len()) else {
                break;
            };
            map.names.push_str(name);
            map.entries.push(Entry {
                start,
                end: start.saturating_add(size),
                name_at,
                name_len: name.len() as u16,
            });
        }
        // Stable: of two entries at one address, the later line (newer code) wins below.
        map.entries.sort_by_key(|e| e.start);
        map.entries.shrink_to_fit();
        map.names.shrink_to_fit();
        map
    }

    /// Reads the perf map of process `tgid` within `budget`, if it has one. With
    /// `start_time` (the process's, as [`crate::process::handle::start_time`] reads it when
    /// its samples' process was known), the map is kept only if the process that has PID
    /// `tgid` after the read started then: a reused PID's map is not another's names.
    pub fn read(tgid: u32, start_time: Option<u64>, budget: &mut PerfMapBudget) -> Option<Self> {
        let nspid = ns_pid(tgid).unwrap_or(tgid);
        let file =
            crate::process::files::open_in_root(tgid, &format!("/tmp/perf-{nspid}.map")).ok()?;
        let reader = std::io::BufReader::new(std::io::Read::take(&file.file, MAX_BYTES));
        let map = Self::parse_lines(reader, budget);
        if let Some(expected) = start_time
            && crate::process::handle::start_time(tgid).ok() != Some(expected)
        {
            return None;
        }
        Some(map)
    }

    /// The name of the code object containing `addr`.
    pub fn lookup(&self, addr: u64) -> Option<&str> {
        let i = self.entries.partition_point(|e| e.start <= addr);
        // Code is replaced in place: the nearest start may be a small stub
        // inside an older, larger object; look a few entries back.
        self.entries[..i]
            .iter()
            .rev()
            .take(8)
            .find(|e| addr < e.end)
            .and_then(|e| {
                let at = e.name_at as usize;
                self.names.get(at..at + usize::from(e.name_len))
            })
    }

    /// Number of entries.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether there are no entries.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Bytes the map keeps.
    pub fn heap_bytes(&self) -> u64 {
        self.entries.capacity() as u64 * ENTRY_BYTES + self.names.capacity() as u64
    }
}

/// Skips to the next line.
fn skip_line(reader: &mut impl std::io::BufRead) -> std::io::Result<()> {
    loop {
        let buf = reader.fill_buf()?;
        if buf.is_empty() {
            return Ok(());
        }
        if let Some(i) = buf.iter().position(|&b| b == b'\n') {
            reader.consume(i + 1);
            return Ok(());
        }
        let n = buf.len();
        reader.consume(n);
    }
}

/// `START SIZE NAME` (hex, optional `0x`), the name cut at [`MAX_NAME`] bytes.
fn parse_line(line: &[u8]) -> Option<(u64, u64, &str)> {
    let line = std::str::from_utf8(line)
        .or_else(|e| std::str::from_utf8(&line[..e.valid_up_to()]))
        .ok()?;
    let line = line.trim_start();
    let mut parts = line.splitn(3, [' ', '\t']);
    let (start, size, name) = (parts.next()?, parts.next()?, parts.next()?);
    let hex = |s: &str| u64::from_str_radix(s.trim_start_matches("0x"), 16).ok();
    let (start, size) = (hex(start)?, hex(size)?);
    let name = name.trim();
    if size == 0 || name.is_empty() {
        return None;
    }
    let mut cut = name.len().min(MAX_NAME);
    while !name.is_char_boundary(cut) {
        cut -= 1;
    }
    Some((start, size, &name[..cut]))
}

/// The pid of `tgid` in its innermost PID namespace.
pub(crate) fn ns_pid(tgid: u32) -> Option<u32> {
    let status = std::fs::read_to_string(format!("/proc/{tgid}/status")).ok()?;
    let line = status.lines().find(|l| l.starts_with("NSpid:"))?;
    line.split_whitespace().last()?.parse().ok()
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
    fn what_maps_keep_is_bounded_across_processes() {
        let text: String = (0..1000)
            .map(|i| format!("{:x} 10 JS:fn{i:04}\n", 0x1000 + i * 0x10))
            .collect();
        let mut budget = PerfMapBudget::new(300 * (ENTRY_BYTES + 9));
        let first = PerfMap::parse_lines(text.as_bytes(), &mut budget);
        assert!(first.truncated);
        assert_eq!(first.len(), 300);
        assert_eq!(first.lookup(0x1005), Some("JS:fn0000"));
        // Nothing left for the next process's map.
        let second = PerfMap::parse_lines(text.as_bytes(), &mut budget);
        assert!(second.is_empty() && second.truncated);
        assert_eq!(budget.cut, 2);
        // A line far longer than a name is cut; the next line still parses.
        let long = format!("100 10 {}\n200 10 next\n", "x".repeat(1 << 20));
        let m = PerfMap::parse_lines(long.as_bytes(), &mut PerfMapBudget::default());
        assert_eq!(m.lookup(0x205), Some("next"));
    }
}
