//! Function names for this process's own code addresses, from the ELF symbol tables only.
//!
//! Not the `backtrace` crate: it parses the binary's DWARF with gimli and keeps what it
//! parsed in a process-wide cache for good. For a release binary with line tables that
//! costs 100-400 MiB of resident memory during and after every dump: a diagnostic that
//! could push the operator over its memory limit, and that would make the operator's own
//! heap profiles mostly about themselves. blazesym reads the
//! symbol tables of the mapped objects (`/proc/self/maps`), and everything it loaded is
//! freed when the dump is done.
//!
//! The trade: no file names, line numbers or inlined frames. The images ship without DWARF
//! anyway (`scripts/images.sh` strips it), so there the profiles lose nothing; with an
//! unstripped binary, `go tool pprof <binary> <profile>` reads lines from the binary since
//! every location keeps its address and mapping.

use std::collections::HashMap;

use blazesym::Pid;
use blazesym::symbolize::source::{Process, Source};
use blazesym::symbolize::{Input, Symbolizer};

use flamefleet_pprof::{Frame, FrameLine, MappingInfo, ProfileBuilder};

/// The function name of each address (`None` when no symbol covers it).
pub(crate) fn names(addrs: &[u64]) -> HashMap<u64, Option<String>> {
    let mut unique: Vec<u64> = addrs.to_vec();
    unique.sort_unstable();
    unique.dedup();
    let mut process = Process::new(Pid::Slf);
    // Symbol tables only (see the module documentation). `map_files` would need
    // CAP_SYS_ADMIN on some kernels; the paths in our own maps are in our own mount
    // namespace.
    process.debug_syms = false;
    process.perf_map = false;
    process.map_files = false;
    let symbolizer = Symbolizer::builder()
        .enable_code_info(false)
        .enable_inlined_fns(false)
        .build();
    let found = symbolizer
        .symbolize(&Source::Process(process), Input::AbsAddr(&unique))
        .unwrap_or_default();
    let mut out: HashMap<u64, Option<String>> = unique.iter().map(|&a| (a, None)).collect();
    for (addr, symbolized) in unique.iter().zip(found) {
        if let Some(sym) = symbolized.as_sym() {
            out.insert(*addr, Some(readable(&sym.name)));
        }
    }
    out
}

/// `<a::B>::method` (how Rust's v0 mangling names an inherent method) as `a::B::method`:
/// pprof hides what is between angle brackets as C++ template arguments, which would leave
/// `::method`. Trait impls (`<a::B as c::D>::method`) stay as they are.
fn readable(name: &str) -> String {
    if let Some(rest) = name.strip_prefix('<') {
        let mut depth = 1;
        for (i, c) in rest.char_indices() {
            match c {
                '<' => depth += 1,
                '>' => {
                    depth -= 1;
                    if depth == 0 {
                        let (ty, tail) = (&rest[..i], &rest[i + 1..]);
                        if !ty.contains(" as ") {
                            return format!("{ty}{tail}");
                        }
                        break;
                    }
                }
                _ => {}
            }
        }
    }
    name.to_owned()
}

/// One loaded object of this process, as a pprof mapping.
pub(crate) struct Object {
    pub start: u64,
    pub end: u64,
    pub file_offset: u64,
    pub path: String,
    pub build_id: Option<String>,
}

/// This process's executable mappings (`/proc/self/maps`), as the `mappings` crate read them
/// at start-up (what jemalloc's heap profiles are relative to as well).
pub(crate) fn objects() -> Vec<Object> {
    mappings::MAPPINGS
        .as_deref()
        .unwrap_or_default()
        .iter()
        .map(|m| Object {
            start: m.memory_start as u64,
            end: m.memory_end as u64,
            file_offset: m.file_offset,
            path: m.pathname.to_string_lossy().into_owned(),
            build_id: m.build_id.as_ref().map(ToString::to_string),
        })
        .collect()
}

/// Frames for this process's code addresses: each address's mapping and function name,
/// added to a [`ProfileBuilder`] once per address.
pub(crate) struct Locations {
    objects: Vec<Object>,
    /// The builder's mapping ID of each object, once [`Locations::add_mappings`] ran.
    mapping_ids: Vec<u64>,
    names: HashMap<u64, Option<String>>,
    location_ids: HashMap<u64, u64>,
}

impl Locations {
    /// For stacks made of `addrs` (code addresses as recorded: return addresses, one past
    /// the call; see [`Locations::id`]).
    pub(crate) fn new(addrs: &[u64]) -> Self {
        let lookups: Vec<u64> = addrs.iter().map(|&a| a.saturating_sub(1)).collect();
        Self {
            names: names(&lookups),
            objects: objects(),
            mapping_ids: Vec::new(),
            location_ids: HashMap::new(),
        }
    }

    /// Adds this process's objects to `b` as its mappings, in load order.
    pub(crate) fn add_mappings(&mut self, b: &mut ProfileBuilder) {
        self.mapping_ids = self
            .objects
            .iter()
            .map(|o| {
                b.add_mapping(&MappingInfo {
                    start: o.start,
                    limit: o.end,
                    file_offset: o.file_offset,
                    file: o.path.clone(),
                    build_id: o.build_id.clone().unwrap_or_default(),
                    has_functions: true,
                })
            })
            .collect();
    }

    /// The location of `addr` in `b`. Stack addresses are return addresses, one past the
    /// call instruction, so the address looked up is one less (what `backtrace` and pprof
    /// do): a call that ends a function would otherwise be named after the next function.
    pub(crate) fn id(&mut self, addr: u64, b: &mut ProfileBuilder) -> u64 {
        let addr = addr.saturating_sub(1);
        if let Some(&id) = self.location_ids.get(&addr) {
            return id;
        }
        let mapping = self
            .objects
            .iter()
            .position(|o| o.start <= addr && addr < o.end)
            .and_then(|i| self.mapping_ids.get(i).copied());
        let id = b.location(&Frame {
            address: addr,
            mapping,
            lines: vec![FrameLine {
                function: self.name_at(addr),
                file: String::new(),
                line: 0,
            }],
        });
        self.location_ids.insert(addr, id);
        id
    }

    /// The function name shown for `addr` (as [`Locations::id`] names it).
    pub(crate) fn name(&self, addr: u64) -> String {
        self.name_at(addr.saturating_sub(1))
    }

    fn name_at(&self, lookup: u64) -> String {
        self.names
            .get(&lookup)
            .cloned()
            .flatten()
            .unwrap_or_else(|| format!("{lookup:#x}"))
    }
}

#[cfg(test)]
mod tests {
    use super::readable;

    #[test]
    fn inherent_methods_lose_their_angle_brackets_trait_impls_keep_them() {
        assert_eq!(
            readable("<std::sys::pal::unix::time::Timespec>::sub_timespec"),
            "std::sys::pal::unix::time::Timespec::sub_timespec"
        );
        assert_eq!(
            readable("<alloc::vec::Vec<u8>>::push"),
            "alloc::vec::Vec<u8>::push"
        );
        assert_eq!(
            readable("<a::B as core::fmt::Debug>::fmt"),
            "<a::B as core::fmt::Debug>::fmt"
        );
        assert_eq!(readable("main"), "main");
    }
}
