//! Reading a profiled process's `/proc/<pid>/maps`, bounded.
//!
//! The workload decides how long that file is: up to `vm.max_map_count` mappings (65,530
//! by default), each with a path of up to 4 KiB — a quarter of a GiB of text, which a
//! `read_to_string` would hold at once, per process, in every reader. So the file is
//! streamed line by line: only executable mappings with a file are kept (the only ones
//! symbolization, unwinding and allocator discovery need), at most
//! [`MAX_EXECUTABLE_MAPPINGS`] of them (readers choose which, [`mappings`]), and reading stops after [`MAX_READ_BYTES`]; a
//! snapshot says when it was cut.

use std::io::BufRead as _;

/// Executable mappings kept per process. A large native process maps a few hundred
/// (its executable and shared libraries, a few segments each); the unwinder keeps 64.
pub const MAX_EXECUTABLE_MAPPINGS: usize = 2048;
/// Bytes of the maps file read per process (65,530 mappings with 100-byte lines fit).
pub const MAX_READ_BYTES: u64 = 16 << 20;
/// Longest line kept: an address range, permissions, offset, device, inode and a path of
/// at most PATH_MAX (4,096) bytes, which the kernel may escape.
const MAX_LINE: usize = 8 << 10;

/// One executable mapping of a process.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Mapping {
    /// `start-end` as written in the file (the name under `map_files/`).
    pub range: String,
    /// First address.
    pub start: u64,
    /// One past the last address.
    pub end: u64,
    /// File offset of `start`.
    pub offset: u64,
    /// Inode number (0 for anonymous mappings).
    pub inode: u64,
    /// Mapped executable (`x` in the permissions).
    pub executable: bool,
    /// Path (with `" (deleted)"` where the file was unlinked), or a pseudo-name
    /// (`[vdso]`), or empty.
    pub name: String,
}

impl Mapping {
    /// Whether the mapping is backed by a file with a path.
    pub fn is_file(&self) -> bool {
        self.inode != 0 && self.name.starts_with('/')
    }

    /// Whether the mapped file was deleted (its path no longer names it).
    pub fn is_deleted(&self) -> bool {
        self.name.ends_with(" (deleted)")
    }
}

/// The mappings of a process a reader kept, as far as they were read.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Mappings {
    /// Mappings kept, in file order (by address).
    pub mappings: Vec<Mapping>,
    /// The file had more than the limits allow: mappings after the cut are missing.
    pub truncated: bool,
}

/// Reads the executable mappings of `pid`. `Err` when the process is gone or its maps
/// cannot be read.
pub fn executable_mappings(pid: u32) -> std::io::Result<Mappings> {
    mappings(pid, |m| m.executable)
}

/// Reads the mappings of `pid` that `keep` selects (at most [`MAX_EXECUTABLE_MAPPINGS`]).
pub fn mappings(pid: u32, keep: impl FnMut(&Mapping) -> bool) -> std::io::Result<Mappings> {
    let file = std::fs::File::open(format!("/proc/{pid}/maps"))?;
    read(std::io::BufReader::new(file), keep)
}

/// Parses maps text from `reader` with the module's bounds, keeping what `keep` selects.
pub fn read(
    reader: impl std::io::BufRead,
    mut keep: impl FnMut(&Mapping) -> bool,
) -> std::io::Result<Mappings> {
    let mut out = Mappings::default();
    let mut reader = reader.take(MAX_READ_BYTES);
    let mut line = Vec::with_capacity(256);
    loop {
        line.clear();
        // A line longer than MAX_LINE is read in pieces: the first piece is parsed (its
        // path is cut), the rest skipped.
        let n = std::io::Read::take(&mut reader, MAX_LINE as u64).read_until(b'\n', &mut line)?;
        if n == 0 {
            // The end of the file, or of what the byte cap lets us read.
            if reader.limit() == 0 {
                out.truncated = true;
            }
            return Ok(out);
        }
        let whole = line.last() == Some(&b'\n');
        if !whole {
            skip_rest_of_line(&mut reader)?;
        }
        if let Some(m) = parse_line(&String::from_utf8_lossy(&line)).filter(|m| keep(m)) {
            if out.mappings.len() >= MAX_EXECUTABLE_MAPPINGS {
                out.truncated = true;
                return Ok(out);
            }
            out.mappings.push(m);
        }
    }
}

fn skip_rest_of_line(reader: &mut impl std::io::BufRead) -> std::io::Result<()> {
    loop {
        let buf = reader.fill_buf()?;
        if buf.is_empty() {
            return Ok(());
        }
        match buf.iter().position(|&b| b == b'\n') {
            Some(i) => {
                reader.consume(i + 1);
                return Ok(());
            }
            None => {
                let n = buf.len();
                reader.consume(n);
            }
        }
    }
}

/// A mapping from one line (`start-end perms offset dev inode [path]`).
fn parse_line(line: &str) -> Option<Mapping> {
    let line = line.trim_end_matches('\n');
    let mut f = line.splitn(6, ' ');
    let (range, perms, offset, _dev, inode) =
        (f.next()?, f.next()?, f.next()?, f.next()?, f.next()?);
    let name = f.next().unwrap_or("").trim_start().to_owned();
    let (start, end) = range.split_once('-')?;
    Some(Mapping {
        range: range.to_owned(),
        start: u64::from_str_radix(start, 16).ok()?,
        end: u64::from_str_radix(end, 16).ok()?,
        offset: u64::from_str_radix(offset, 16).ok()?,
        inode: inode.parse().ok()?,
        executable: perms.contains('x'),
        name,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keeps_executable_mappings_only() {
        let text = "\
55d0c0a00000-55d0c0a02000 r--p 00000000 08:01 1234 /usr/bin/app\n\
55d0c0a02000-55d0c0a08000 r-xp 00002000 08:01 1234 /usr/bin/app with space\n\
7f0000000000-7f0000001000 r-xp 00000000 00:00 0 \n\
7f0000002000-7f0000003000 r-xp 00001000 08:01 99 /tmp/lib.so (deleted)\n\
7ffd00000000-7ffd00002000 r-xp 00000000 00:00 0                          [vdso]\n";
        let m = read(text.as_bytes(), |m| m.executable).unwrap();
        assert!(!m.truncated);
        assert_eq!(m.mappings.len(), 4);
        assert_eq!(m.mappings[0].name, "/usr/bin/app with space");
        assert_eq!(m.mappings[0].offset, 0x2000);
        assert!(m.mappings[0].is_file());
        assert!(!m.mappings[1].is_file());
        assert!(m.mappings[2].is_deleted());
        assert_eq!(m.mappings[3].name, "[vdso]");
    }

    #[test]
    fn a_huge_maps_file_is_cut_and_said_so() {
        // More executable mappings than kept.
        let mut text = String::new();
        for i in 0..MAX_EXECUTABLE_MAPPINGS + 10 {
            text.push_str(&format!(
                "{:x}-{:x} r-xp 00000000 08:01 7 /lib/l{i}.so\n",
                i * 0x1000,
                i * 0x1000 + 0x1000
            ));
        }
        let m = read(text.as_bytes(), |m| m.executable).unwrap();
        assert!(m.truncated);
        assert_eq!(m.mappings.len(), MAX_EXECUTABLE_MAPPINGS);
        // Lines far longer than a path can be: cut, and the next line still parsed.
        let long = format!(
            "1000-2000 r-xp 00000000 08:01 7 /{}\n3000-4000 r-xp 00000000 08:01 8 /b\n",
            "a".repeat(100_000)
        );
        let m = read(long.as_bytes(), |m| m.executable).unwrap();
        assert_eq!(m.mappings.len(), 2);
        assert!(m.mappings[0].name.len() <= MAX_LINE);
        assert_eq!(m.mappings[1].name, "/b");
        // More bytes than read: cut.
        let filler = "0-1000 r--p 00000000 00:00 0 \n".repeat((MAX_READ_BYTES / 20) as usize);
        let m = read(filler.as_bytes(), |m| m.executable).unwrap();
        assert!(m.truncated);
        assert!(m.mappings.is_empty());
    }

    #[test]
    fn reads_own_maps() {
        let m = executable_mappings(std::process::id()).unwrap();
        let exe = std::fs::read_link("/proc/self/exe").unwrap();
        assert!(
            m.mappings
                .iter()
                .any(|r| r.name == exe.to_str().unwrap() && r.is_file())
        );
    }
}
