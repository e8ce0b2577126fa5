//! `kubectl profile`: request Flamefleet profiles, wait for them, download and render them.
//!
//! Pure conversions (pprof → folded stacks, top functions, merge, flame graph) are library
//! modules with unit tests; `commands/` wires them to the API server and the artifact store.

pub mod cluster;
pub mod commands;
pub mod download;
pub mod download_urls;
pub mod error;
pub mod flags;
pub mod flamegraph;
pub mod latency;
pub mod latency_svg;
pub mod merge;
pub mod output;
pub mod profile_file;
pub mod requests;
pub mod stacks;
pub mod top_functions;

pub use error::{Error, Result};
