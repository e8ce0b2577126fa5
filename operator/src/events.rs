//! Kubernetes Events on the operator's objects, and the one rule for cutting text that
//! came from elsewhere (an agent, the API server) down to what a field can hold.

use k8s_openapi::api::core::v1::ObjectReference;
use kube::runtime::events::{Event, EventType, Recorder};

/// The most bytes of an Event's note: the API server refuses notes over 1 KiB.
const NOTE_BYTES: usize = 1000;

/// `message` cut to at most `max` bytes at a character boundary, with `…` appended
/// (three bytes more) when anything was cut.
pub fn truncated(message: &str, max: usize) -> String {
    if message.len() <= max {
        return message.to_string();
    }
    let mut cut = max;
    while !message.is_char_boundary(cut) {
        cut -= 1;
    }
    format!("{}…", &message[..cut])
}

/// Records an Event about `object`; a failure to record is logged, never fatal (the
/// status carries the same facts).
pub async fn publish(
    recorder: &Recorder,
    object: &ObjectReference,
    type_: EventType,
    action: &str,
    reason: &str,
    note: &str,
) {
    let event = Event {
        type_,
        reason: reason.to_string(),
        note: Some(truncated(note, NOTE_BYTES)),
        action: action.to_string(),
        secondary: None,
    };
    if let Err(e) = recorder.publish(&event, object).await {
        tracing::warn!("recording event {reason}: {e}");
    }
}

#[cfg(test)]
mod tests {
    use super::truncated;

    #[test]
    fn cuts_at_a_character_boundary_and_says_so() {
        assert_eq!(truncated("short", 10), "short");
        assert_eq!(truncated("exactly", 7), "exactly");
        assert_eq!(truncated("abcdef", 3), "abc…");
        // 'é' is two bytes: a cut inside it moves back to before it.
        assert_eq!(truncated("aé", 2), "a…");
        let long = "ü".repeat(1000);
        let cut = truncated(&long, 1001);
        assert!(cut.len() <= 1001 + '…'.len_utf8());
        assert!(cut.ends_with('…'));
    }
}
