//! Names and labels of the ProfileRequests a policy creates.
//!
//! A run's name is derived from the policy and the scheduled time alone, so creating it twice
//! (an operator restarted between creating it and recording it, or two leaders in a
//! hand-over) hits `AlreadyExists` instead of making a duplicate: exactly one request per
//! policy, namespace and scheduled time.

use jiff::Timestamp;
use sha2::{Digest, Sha256};

/// Label: the kind of the owning policy (`SamplingPolicy` or `ClusterSamplingPolicy`).
pub const POLICY_KIND_LABEL: &str = "flamefleet.dev/policy-kind";
/// Label: the owning policy's name (omitted when it is not a valid label value).
pub const POLICY_NAME_LABEL: &str = "flamefleet.dev/policy";
/// Label: the owning policy's UID.
pub const POLICY_UID_LABEL: &str = "flamefleet.dev/policy-uid";
/// Label: the scheduled time of the run, in Unix seconds.
pub const SCHEDULED_TIME_LABEL: &str = "flamefleet.dev/scheduled-time";
/// Annotation: the scheduled time of the run, RFC 3339.
pub const SCHEDULED_AT_ANNOTATION: &str = "flamefleet.dev/scheduled-at";

/// The longest DNS label.
const MAX_LABEL: usize = 63;

/// Which kind of policy, for names and labels.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PolicyKind {
    /// A namespaced `SamplingPolicy`.
    Namespaced,
    /// A `ClusterSamplingPolicy`.
    Cluster,
}

impl PolicyKind {
    /// The kind's name.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Namespaced => "SamplingPolicy",
            Self::Cluster => "ClusterSamplingPolicy",
        }
    }
}

/// The name of the run of `policy` at `scheduled`: `<policy>-<unix seconds>` for a
/// SamplingPolicy and `<policy>-c<unix seconds>` for a ClusterSamplingPolicy (so the runs
/// of a namespaced and a cluster policy of the same name never collide). Always a valid DNS
/// label: dots become dashes, and a name too long is cut and given a hash of the full name.
pub fn run_name(policy: &str, kind: PolicyKind, scheduled: Timestamp) -> String {
    let suffix = match kind {
        PolicyKind::Namespaced => format!("-{}", scheduled.as_second()),
        PolicyKind::Cluster => format!("-c{}", scheduled.as_second()),
    };
    let cleaned: String = policy
        .chars()
        .map(|c| match c {
            'a'..='z' | '0'..='9' | '-' => c,
            'A'..='Z' => c.to_ascii_lowercase(),
            _ => '-',
        })
        .collect();
    let room = MAX_LABEL - suffix.len();
    let prefix = if cleaned == policy && cleaned.len() <= room {
        cleaned
    } else {
        let hash = hex::encode(&Sha256::digest(policy.as_bytes())[..4]);
        let keep = room - hash.len() - 1;
        let cut: String = cleaned.chars().take(keep).collect();
        format!("{}-{hash}", cut.trim_end_matches('-'))
    };
    let prefix = prefix.trim_start_matches('-');
    let prefix = if prefix.is_empty() { "run" } else { prefix };
    format!("{prefix}{suffix}")
}

/// True when `value` is a valid label value (at most 63 characters of `[A-Za-z0-9._-]`,
/// starting and ending alphanumeric).
pub fn is_label_value(value: &str) -> bool {
    value.len() <= MAX_LABEL
        && value
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
        && value
            .chars()
            .next()
            .is_none_or(|c| c.is_ascii_alphanumeric())
        && value
            .chars()
            .last()
            .is_none_or(|c| c.is_ascii_alphanumeric())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn is_dns_label(s: &str) -> bool {
        !s.is_empty()
            && s.len() <= 63
            && s.chars()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
            && !s.starts_with('-')
            && !s.ends_with('-')
    }

    #[test]
    fn names_are_unique_per_time_and_kind_and_valid_labels() {
        let t = Timestamp::from_second(1_767_607_230).unwrap();
        assert_eq!(run_name("web", PolicyKind::Namespaced, t), "web-1767607230");
        assert_eq!(run_name("web", PolicyKind::Cluster, t), "web-c1767607230");
        let t2 = Timestamp::from_second(1_767_607_240).unwrap();
        assert_ne!(
            run_name("web", PolicyKind::Namespaced, t),
            run_name("web", PolicyKind::Namespaced, t2)
        );
        let long = "a".repeat(253);
        let dotted = "checkout.payments.example";
        for name in [long.as_str(), dotted, "x", "a-b.c-d"] {
            for kind in [PolicyKind::Namespaced, PolicyKind::Cluster] {
                let run = run_name(name, kind, t);
                assert!(is_dns_label(&run), "{run}");
            }
        }
        // Two long names that share a prefix still differ.
        let a = format!("{}-one", "p".repeat(80));
        let b = format!("{}-two", "p".repeat(80));
        assert_ne!(
            run_name(&a, PolicyKind::Namespaced, t),
            run_name(&b, PolicyKind::Namespaced, t)
        );
        assert_ne!(
            run_name("a.b", PolicyKind::Namespaced, t),
            run_name("a-b", PolicyKind::Namespaced, t)
        );
    }

    #[test]
    fn label_values() {
        assert!(is_label_value("checkout-continuous"));
        assert!(is_label_value("a.b_c"));
        assert!(!is_label_value(&"a".repeat(64)));
        assert!(!is_label_value("-a"));
    }
}
