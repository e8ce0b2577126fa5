//! The processes the samplers see: snapshots of their executable mappings ([`catalog`]).

mod catalog;

pub use self::catalog::{
    Binary, MAX_CACHED_OFFSETS, MAX_CACHED_OFFSETS_PER_BINARY, MAX_OPEN_BINARIES, MAX_PROCESSES,
    MappedRange, ProcessCatalog, ProcessMaps,
};
