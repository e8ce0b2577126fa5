//! Merging the profiles the CLI reads (the nodes of a request, the runs of a policy) with
//! the pprof kit's exact merge, naming the inputs in errors.

use flamefleet_pprof::{Label, LabelledProfile, Window};
use flamefleet_proto::pprof::Profile;

use crate::error::{Error, Result};
use crate::profile_file::sample_types;

/// One profile to merge: where it came from (for errors) and the labels its samples get.
#[derive(Debug, Clone)]
pub struct Input {
    /// File name or `request/artifact`.
    pub source: String,
    /// The decoded profile.
    pub profile: Profile,
    /// Labels set on each of its samples (e.g. `run`), replacing any of the same key.
    pub labels: Vec<Label>,
}

impl Input {
    /// An input without labels.
    pub fn new(source: impl Into<String>, profile: Profile) -> Self {
        Input {
            source: source.into(),
            profile,
            labels: Vec::new(),
        }
    }
}

/// Merges `inputs`; all must have the same sample types. Durations add up (the inputs are
/// nodes or runs, each its own capture time).
///
/// # Errors
/// [`Error::MixedSampleTypes`] naming the first input and the first one that differs;
/// [`Error::Usage`] when there is no input.
pub fn merge(inputs: Vec<Input>) -> Result<Profile> {
    let Some(first) = inputs.first() else {
        return Err(Error::Usage("merge needs at least one profile".into()));
    };
    let first_types = sample_types(&first.profile);
    for input in &inputs[1..] {
        let types = sample_types(&input.profile);
        if types != first_types {
            return Err(Error::MixedSampleTypes {
                first_source: first.source.clone(),
                first: first_types.join(", "),
                other_source: input.source.clone(),
                other: types.join(", "),
            });
        }
    }
    let parts: Vec<LabelledProfile> = inputs
        .into_iter()
        .map(|i| LabelledProfile {
            profile: i.profile,
            labels: i.labels,
        })
        .collect();
    flamefleet_pprof::merge(&parts, Window::Successive).map_err(|e| Error::BadProfile {
        source_name: "the merged profile".into(),
        reason: e.to_string(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::stacks::{folded, tests::profile};

    #[test]
    fn merge_sums_stacks_and_dedups_tables() {
        let a = profile(
            &[("cpu", "nanoseconds")],
            &[(&["hot", "main"], &[10]), (&["cold", "main"], &[1])],
        );
        // Different table order in b: ids and string indexes differ.
        let b = profile(
            &[("cpu", "nanoseconds")],
            &[(&["other", "main"], &[4]), (&["hot", "main"], &[5])],
        );
        let merged = merge(vec![Input::new("a", a), Input::new("b", b)]).unwrap();
        let f = folded(&merged, 0);
        assert_eq!(f.get("main;hot"), Some(&15));
        assert_eq!(f.get("main;cold"), Some(&1));
        assert_eq!(f.get("main;other"), Some(&4));
        assert_eq!(merged.function.len(), 4);
        // Locations are keyed by address too: b's `hot` sits at another address than a's,
        // while `main` shares one (same function, same address).
        assert_eq!(merged.location.len(), 5);
        assert_eq!(merged.sample.len(), 4);
        assert_eq!(merged.string_table[0], "");
    }

    #[test]
    fn mixed_types_are_refused() {
        let a = profile(&[("cpu", "nanoseconds")], &[]);
        let b = profile(&[("inuse_space", "bytes")], &[]);
        let err = merge(vec![Input::new("a.pb.gz", a), Input::new("b.pb.gz", b)]).unwrap_err();
        let msg = err.to_string();
        assert!(
            msg.contains("a.pb.gz") && msg.contains("inuse_space/bytes"),
            "{msg}"
        );
        assert_eq!(err.exit_code(), 11);
    }
}
