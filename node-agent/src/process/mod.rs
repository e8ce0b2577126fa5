//! The processes the samplers see: snapshots of their executable mappings (`catalog.rs`),
//! and how the agent reads what a process owns, which a hostile workload controls: its
//! files ([`files`]), its maps ([`maps`]), and the process itself, by identity rather than
//! by PID ([`handle`]).

mod catalog;
pub mod files;
pub mod handle;
pub mod maps;

pub use self::catalog::{
    Binary, MAX_CACHED_OFFSETS, MAX_CACHED_OFFSETS_PER_BINARY, MAX_OPEN_BINARIES, MAX_PROCESSES,
    MappedRange, ProcessCatalog, ProcessMaps,
};
