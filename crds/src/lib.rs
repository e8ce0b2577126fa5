//! Flamefleet API types, group `flamefleet.dev`, version `v1alpha1`.
//!
//! - [`ProfileRequest`]: one on-demand capture (cpu, heap or runqlat) of selected pods.
//! - [`SamplingPolicy`] / [`ClusterSamplingPolicy`]: scheduled, sampled captures.
//! - [`ProfileResultSlice`]: up to 100 nodes' results of one ProfileRequest (written only by
//!   the operator; the request's status stays small whatever the fleet size).
//! - [`ProfileDownload`]: short-lived download URLs of finished requests' artifacts,
//!   authorized by the API server when asked for.
//!
//! Validation lives in the generated OpenAPI schema (bounds, enums, CEL rules) so the API
//! server itself rejects bad objects; the pure helpers here (durations, phases, conditions,
//! server-side-apply bodies) are what the operator, the agent and the CLI share.

pub mod admission;
pub mod conditions;
pub mod continuous;
pub mod crd_yaml;
pub mod download_seal;
pub mod duration;
pub mod phase;
pub mod policy_runs;
pub mod profile_download;
pub mod profile_request;
pub mod result_slice;
pub mod results;
pub mod sampling_policy;
pub mod status_apply;
pub mod text;
pub mod trigger;

pub use phase::{NodePhase, RequestPhase};
pub use profile_download::{
    DownloadPhase, DownloadUrl, ProfileDownload, ProfileDownloadSpec, ProfileDownloadStatus,
    SealedUrls, SkippedRequest,
};
pub use profile_request::{
    Artifact, CpuOptions, CpuSummary, HeapEndpoint, HeapOptions, HeapSource, LatencySummary,
    NodeCounts, NodeFailureEntry, NodeStatus, ProfileRequest, ProfileRequestSpec,
    ProfileRequestStatus, ProfileSummary, ProfileType, RunqlatOptions, RunqlatUnit,
};
pub use result_slice::{ProfileResultSlice, ProfileResultSliceFields, RequestReference};
pub use sampling_policy::{
    ClusterSamplingPolicy, ClusterSamplingPolicySpec, Coverage, HistoryLimits, NodeBudget,
    PendingRun, PlannedRequest, RotationState, RunReference, SamplingLimits, SamplingPolicy,
    SamplingPolicySpec, SamplingPolicyStatus, SkippedPod,
};

/// The API group of every Flamefleet kind.
pub const GROUP: &str = "flamefleet.dev";
/// The API version of every Flamefleet kind.
pub const VERSION: &str = "v1alpha1";

/// Errors of the pure helpers in this crate.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A duration string is not of the form the schema accepts.
    #[error(
        "invalid duration {found:?}: {reason}; expected a number with a unit (ms, s, m, h), e.g. \"30s\", \"2m\" or \"1m30s\""
    )]
    InvalidDuration {
        /// The rejected input.
        found: String,
        /// What is wrong with it.
        reason: String,
    },
    /// A duration parsed but lies outside the allowed range.
    #[error("duration {found:?} is out of range: it must be at least {min:?} and at most {max:?}")]
    DurationOutOfRange {
        /// The rejected input.
        found: String,
        /// The smallest allowed value.
        min: std::time::Duration,
        /// The largest allowed value.
        max: std::time::Duration,
    },
    /// An object could not be serialized to JSON.
    #[error("cannot serialize {what} to JSON: {source}")]
    Json {
        /// What was being serialized.
        what: String,
        /// The serializer's error.
        source: serde_json::Error,
    },
    /// A committed admission policy does not parse.
    #[error("admission policy file crds/policies/{file} does not parse: {source}")]
    Policy {
        /// The file.
        file: String,
        /// The parser's error.
        source: serde_yaml::Error,
    },
    /// An object lacks metadata the API server always sets.
    #[error("the object has no metadata.{0}; it was not read from the API server")]
    MissingMetadata(&'static str),
    /// A CRD could not be rendered as YAML.
    #[error("cannot render CRD {name} as YAML: {source}")]
    Yaml {
        /// The CRD's name.
        name: String,
        /// The serializer's error.
        source: serde_yaml::Error,
    },
}

/// The result type of this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;
