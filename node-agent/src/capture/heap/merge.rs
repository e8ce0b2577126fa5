//! Merging the heap profiles of several containers (or sources) of one capture into one,
//! each sample labelled with where it came from: the pprof kit's exact merge over one
//! shared capture window, with errors that speak of heap sources.

use flamefleet_pprof::Window;
use flamefleet_proto::pprof::Profile;

/// A fetched profile and the labels every one of its samples gets.
pub use flamefleet_pprof::LabelledProfile;

/// Why profiles could not be merged.
#[derive(Debug, thiserror::Error)]
pub enum MergeError {
    /// Nothing to merge.
    #[error("no heap profile to merge")]
    Empty,
    /// The inputs measure different things.
    #[error(
        "cannot merge heap profiles with different sample types: expected {expected}, found \
         {found}; the containers serve different profile kinds (e.g. Go and jemalloc)"
    )]
    SampleTypes {
        /// Sample types of the first profile.
        expected: String,
        /// Sample types of the mismatching one.
        found: String,
    },
    /// Any other failure of the merge.
    #[error(transparent)]
    Other(flamefleet_pprof::Error),
}

/// Merges `parts` (captured over the same window) into one profile: see
/// [`flamefleet_pprof::merge()`].
pub fn merge(parts: &[LabelledProfile]) -> Result<Profile, MergeError> {
    flamefleet_pprof::merge(parts, Window::Shared).map_err(|e| match e {
        flamefleet_pprof::Error::MixedSampleTypes {
            expected, found, ..
        } => MergeError::SampleTypes { expected, found },
        flamefleet_pprof::Error::NothingToMerge => MergeError::Empty,
        other => MergeError::Other(other),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use flamefleet_pprof::{Label, ProfileBuilder};

    #[test]
    fn refuses_mismatched_sample_types() {
        let mut go = ProfileBuilder::new(&[("inuse_objects", "count"), ("inuse_space", "bytes")]);
        go.string("x");
        let mut other = ProfileBuilder::new(&[("space", "bytes")]);
        other.string("x");
        let parts = vec![
            LabelledProfile {
                profile: go.build(),
                labels: vec![Label::Str("container".into(), "a".into())],
            },
            LabelledProfile {
                profile: other.build(),
                labels: vec![],
            },
        ];
        let e = merge(&parts).unwrap_err();
        assert!(e.to_string().contains("[space/bytes]"), "{e}");
        assert!(matches!(merge(&[]), Err(MergeError::Empty)));
    }
}
