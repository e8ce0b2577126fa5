//! Go binaries without DWARF (`-ldflags="-s -w"`, what most production images ship) named
//! from their own function table ([`crate::gopclntab`]): function, file, line and inlined
//! functions, as blazesym gives them from DWARF for a binary built without those flags.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use super::{MAX_PARSE_BYTES, PARSE_BYTES, StackSymbolizer};
use crate::gopclntab::{self, GoTable};
use crate::pprof::FrameLine;
use crate::process::Binary;
use crate::process::files::BoundedReader;

/// What reading one table may read of the file: the section, the part holding the inline
/// trees, the search for the runtime's module data and the relocations it needs.
const READ_BUDGET: u64 = gopclntab::MAX_SECTION_BYTES + gopclntab::MAX_FUNCDATA_BYTES + (64 << 20);

impl StackSymbolizer {
    /// The frames of `file_offset` in `bin`, a Go binary without DWARF, and caches them.
    pub(super) fn go_lines(
        &mut self,
        bin: &Arc<Binary>,
        tgid: u32,
        file_offset: u64,
    ) -> Vec<FrameLine> {
        let (Some(table), Some(vaddr)) = (
            self.go_table(bin, tgid),
            bin.elf.virtual_address(file_offset),
        ) else {
            return Vec::new();
        };
        let lines = table.frames(vaddr);
        bin.remember(file_offset, Arc::from(lines.as_slice()));
        lines
    }

    /// The function table of `bin`, read once per symbolizer within [`MAX_PARSE_BYTES`].
    fn go_table(&mut self, bin: &Arc<Binary>, tgid: u32) -> Option<Arc<GoTable>> {
        let key = Arc::as_ptr(bin) as usize;
        if let Some((_, table)) = self.go_tables.get(&key) {
            return table.clone();
        }
        let table = self.read_go_table(bin, tgid);
        self.go_tables.insert(key, (bin.clone(), table.clone()));
        table
    }

    fn read_go_table(&mut self, bin: &Arc<Binary>, tgid: u32) -> Option<Arc<GoTable>> {
        // The section, and about as much again for the part of the read-only data holding
        // the inline trees; charged again at its real size once read.
        let estimate = bin.elf.go_pclntab.unwrap_or(0).saturating_mul(2);
        if !reserve(estimate) {
            self.note(format!(
                "pid {tgid}: {}: the agent's symbolization memory ({MAX_PARSE_BYTES} bytes, all \
                 captures) is taken",
                bin.path
            ));
            return None;
        }
        let read = bin.open(tgid).map_err(|e| e.to_string()).and_then(|file| {
            let reader = BoundedReader::new(&file, gopclntab::MAX_SECTION_BYTES, READ_BUDGET)
                .map_err(|e| e.to_string())?;
            let obj = object::File::parse(&reader).map_err(|e| e.to_string())?;
            GoTable::from_elf(&obj).map_err(|e| e.to_string())
        });
        PARSE_BYTES.fetch_sub(estimate, Ordering::Relaxed);
        let table = match read {
            Ok(Some(t)) => t,
            Ok(None) => return None,
            Err(e) => {
                self.note(format!("pid {tgid}: {}: Go function table: {e}", bin.path));
                return None;
            }
        };
        if !reserve(table.bytes()) {
            self.note(format!(
                "pid {tgid}: {}: the agent's symbolization memory ({MAX_PARSE_BYTES} bytes, all \
                 captures) is taken",
                bin.path
            ));
            return None;
        }
        self.parse_bytes += table.bytes();
        if !table.has_inline_trees() {
            self.note(format!(
                "pid {tgid}: {}: named from Go's function table without inlined functions (the \
                 runtime's module data, which locates the inline trees, was not found)",
                bin.path
            ));
        }
        Some(Arc::new(table))
    }
}

/// Takes `bytes` of [`PARSE_BYTES`] if they fit within [`MAX_PARSE_BYTES`].
fn reserve(bytes: u64) -> bool {
    PARSE_BYTES
        .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |used| {
            (used.saturating_add(bytes) <= MAX_PARSE_BYTES).then_some(used + bytes)
        })
        .is_ok()
}
