//! What an agent reports, bounded before it reaches an object or the operator's memory.
//!
//! An agent is trusted for its own node's profiles and nothing more: a compromised node
//! can put anything a gRPC message carries (4 MiB) into each field of its DONE or FAILED
//! message. Every field the operator keeps is bounded here, where the message arrives, so
//! that one node can never make its result slice (shared with 99 other nodes), the
//! request's status or the operator's memory large. Each bound is far above what a genuine
//! agent sends.

use std::collections::BTreeMap;

use flamefleet_api::text::truncated;
use flamefleet_proto::agent::LatencyHistogram;

/// Longest sample type kept (`cpu/nanoseconds`, `inuse_space/bytes`, ...).
pub const MAX_SAMPLE_TYPE_BYTES: usize = 128;
/// Most summary entries kept from one node (a genuine agent sends about ten).
pub const MAX_SUMMARY_ENTRIES: usize = 32;
/// Longest summary key kept.
pub const MAX_SUMMARY_KEY_BYTES: usize = 64;
/// Longest summary value kept (heap summaries name processes and warnings).
pub const MAX_SUMMARY_VALUE_BYTES: usize = 1024;
/// Longest frequency note kept: it is copied into the request's status.
pub const MAX_FREQUENCY_NOTE_BYTES: usize = 256;
/// Longest agent message kept (a failure's reason); the slice entry has the same bound.
pub const MAX_MESSAGE_BYTES: usize = 8 * 1024;
/// Most buckets of a run-queue latency histogram (log2 buckets of a 64-bit value).
pub const MAX_HISTOGRAM_BUCKETS: usize = 64;

/// Checks a reported sample type: `<type>/<unit>` of a safe charset, at most
/// [`MAX_SAMPLE_TYPE_BYTES`]. The error says what was found.
pub fn check_sample_type(sample_type: &str) -> Result<(), String> {
    if sample_type.len() > MAX_SAMPLE_TYPE_BYTES {
        return Err(format!(
            "the agent reported a sample type of {} bytes; expected at most {MAX_SAMPLE_TYPE_BYTES} (e.g. cpu/nanoseconds)",
            sample_type.len()
        ));
    }
    let ok = sample_type
        .bytes()
        .all(|c| c.is_ascii_alphanumeric() || matches!(c, b'/' | b'_' | b'-' | b'.'));
    if !ok {
        return Err(format!(
            "the agent reported the sample type {sample_type:?}; expected letters, digits and / _ - . only"
        ));
    }
    Ok(())
}

/// The summary entries kept from one node: at most [`MAX_SUMMARY_ENTRIES`] (in key order),
/// keys of a safe charset up to [`MAX_SUMMARY_KEY_BYTES`], values cut to
/// [`MAX_SUMMARY_VALUE_BYTES`] (the frequency note to [`MAX_FREQUENCY_NOTE_BYTES`]).
pub fn bounded_summary(
    summary: impl IntoIterator<Item = (String, String)>,
) -> BTreeMap<String, String> {
    let mut kept = BTreeMap::new();
    let mut entries: Vec<(String, String)> = summary
        .into_iter()
        .filter(|(k, _)| {
            !k.is_empty()
                && k.len() <= MAX_SUMMARY_KEY_BYTES
                && k.bytes()
                    .all(|c| c.is_ascii_alphanumeric() || matches!(c, b'_' | b'-' | b'.'))
        })
        .collect();
    entries.sort_by(|a, b| a.0.cmp(&b.0));
    for (key, value) in entries.into_iter().take(MAX_SUMMARY_ENTRIES) {
        let max = if key == "frequency_note" {
            MAX_FREQUENCY_NOTE_BYTES
        } else {
            MAX_SUMMARY_VALUE_BYTES
        };
        kept.insert(key, truncated(&value, max));
    }
    kept
}

/// A reported histogram, or `None` when it has more buckets than any latency can fill.
pub fn bounded_histogram(histogram: Option<LatencyHistogram>) -> Option<LatencyHistogram> {
    histogram.filter(|h| h.buckets.len() <= MAX_HISTOGRAM_BUCKETS)
}

/// An agent's message (a failure's reason), cut to [`MAX_MESSAGE_BYTES`].
pub fn bounded_message(message: &str) -> String {
    truncated(message, MAX_MESSAGE_BYTES)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sample_types_are_short_and_plain() {
        for good in [
            "cpu/nanoseconds",
            "inuse_space/bytes",
            "samples/count",
            "a.b-c",
        ] {
            check_sample_type(good).unwrap();
        }
        let long = check_sample_type(&"n".repeat(2 << 20)).unwrap_err();
        assert!(long.contains("2097152 bytes"), "{long}");
        assert!(long.len() < 200, "{long}");
        assert!(check_sample_type("cpu/\"x\" <b>").is_err());
    }

    #[test]
    fn summaries_keep_few_short_entries() {
        let mut huge: Vec<(String, String)> = (0..5000)
            .map(|i| (format!("junk-{i:05}"), "v".repeat(4096)))
            .collect();
        huge.push(("frequency_note".into(), "f".repeat(1 << 20)));
        huge.push(("frequency_hz".into(), "99".into()));
        huge.push(("k".repeat(100), "dropped".into()));
        huge.push(("bad key".into(), "dropped".into()));
        let kept = bounded_summary(huge);
        assert_eq!(kept.len(), MAX_SUMMARY_ENTRIES);
        // Key order: the genuine keys sort before the junk.
        assert_eq!(kept["frequency_hz"], "99");
        assert!(kept["frequency_note"].len() <= MAX_FREQUENCY_NOTE_BYTES + 3);
        let total: usize = kept.iter().map(|(k, v)| k.len() + v.len()).sum();
        assert!(total < 40 * 1024, "{total}");
    }

    #[test]
    fn histograms_and_messages_are_bounded() {
        let fine = LatencyHistogram {
            unit_ns: 1000,
            buckets: vec![1; 27],
        };
        assert_eq!(bounded_histogram(Some(fine.clone())), Some(fine));
        let huge = LatencyHistogram {
            unit_ns: 1000,
            buckets: vec![1; 100_000],
        };
        assert_eq!(bounded_histogram(Some(huge)), None);
        assert!(bounded_message(&"m".repeat(1 << 22)).len() <= MAX_MESSAGE_BYTES + 3);
    }
}
