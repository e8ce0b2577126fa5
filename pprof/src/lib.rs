//! Flamefleet's pprof kit: everything the agent, the CLI and the self-profiler do with a
//! `perftools.profiles.Profile` (the message `go tool pprof` reads), in one place.
//!
//! - [`builder`]: [`ProfileBuilder`], a string table with `""` at index 0 and deduplicated
//!   mappings, functions and locations, fed symbolized frames.
//! - [`codec`]: [`decode_with`], gzip and protobuf decoded under a budget of what decoding
//!   keeps in memory, checked before it is allocated ([`footprint`] reads the wire bytes to
//!   know), then [`validate`](mod@validate)d; [`encode_gzip`]. Profiles come from places we do not trust: a pod's pprof
//!   endpoint, an artifact store a compromised node wrote to.
//! - [`validate`]: the invariants readers and [`merge`] index by.
//! - [`merge`](mod@merge): profiles of one kind into one, tables re-indexed and
//!   deduplicated exactly, each part's samples labelled with where it came from.
//! - `otlp` (feature `otlp`): to OpenTelemetry profiles (OTLP) and back, losslessly.
//! - [`read`]: strings, sample types, totals and stacks of a decoded profile.
//! - [`split`](mod@split): one profile into parts by a key of each sample (a node's window into
//!   one profile per pod), each part with only the table entries it uses.
//!
//! Written here rather than taken from a crate: the `pprof` crate (pprof-rs) builds profiles
//! of its own process only and brings its own generated types and a signal-based sampler;
//! no maintained crate merges pprof protobufs or bounds what decoding one allocates (prost
//! bounds nothing but recursion, and not even that in this workspace, see [`footprint`]).

pub mod builder;
pub mod codec;
pub mod footprint;
pub mod merge;
#[cfg(feature = "otlp")]
pub mod otlp;
pub mod read;
pub mod split;
pub mod validate;

pub use builder::{Frame, FrameLine, Label, MappingInfo, ProfileBuilder, nanos_per_sample};
pub use codec::{DecodeLimits, decode, decode_with, encode_gzip};
pub use merge::{LabelledProfile, Window, merge};
pub use read::{Frames, allocation_count, sample_types, string, value_total};
pub use split::split;
pub use validate::validate;

/// The generated `perftools.profiles` messages (from `flamefleet-proto`).
pub use flamefleet_proto::pprof as pb;

/// Why a profile could not be decoded, validated, merged or encoded.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// Nothing to decode.
    #[error("the input is empty; expected a gzipped or plain protobuf perftools.profiles.Profile")]
    Empty,
    /// The gzip stream cannot be inflated.
    #[error("the gzip stream is corrupt: {0}")]
    Gzip(String),
    /// The input inflates to more than the decompression cap.
    #[error(
        "the profile decompresses to more than {limit} bytes (the cap); refusing it as a likely \
         zip bomb (real profiles are far smaller)"
    )]
    TooLargeDecompressed {
        /// The cap in bytes.
        limit: u64,
    },
    /// Decoding would keep more memory than the budget allows.
    #[error(
        "decoding the profile would keep at least {needed} bytes in memory ({protobuf} bytes of \
         protobuf decoding into {decoded} bytes of structures), more than its budget of {limit} \
         bytes; refusing it before decoding it: the profile is hostile, or too large \
         for this budget (raise it to read it)"
    )]
    TooLargeDecoded {
        /// Protobuf bytes held while decoding.
        protobuf: u64,
        /// The decoded structures, counted as the allocator will size them.
        decoded: u64,
        /// `protobuf + decoded` (at the point the budget ran out).
        needed: u64,
        /// The budget in bytes.
        limit: u64,
    },
    /// The bytes are not a protobuf `Profile`.
    #[error("protobuf decoding failed: {0}")]
    Protobuf(String),
    /// The profile decodes but breaks an invariant pprof readers rely on.
    #[error("the profile is inconsistent: {0}")]
    Invalid(String),
    /// [`merge()`] was given no profile.
    #[error("no profile to merge")]
    NothingToMerge,
    /// [`merge()`] was given profiles measuring different things.
    #[error(
        "cannot merge profiles with different sample types: profile 0 has {expected} but \
         profile {other} has {found}; merge profiles of one kind only"
    )]
    MixedSampleTypes {
        /// Sample types of the first profile, as `[type/unit, ...]`.
        expected: String,
        /// Index of the first profile that differs.
        other: usize,
        /// Its sample types.
        found: String,
    },
    /// Compressing an encoded profile failed.
    #[error("gzip-compressing the profile failed: {0}")]
    Encode(#[source] std::io::Error),
}

/// Result of this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;
