//! Kubernetes Events on the operator's objects. [`truncated`] (from `flamefleet_api::text`,
//! shared with the agent) is the one rule for cutting text that came from elsewhere down to
//! what a field can hold.

use k8s_openapi::api::core::v1::ObjectReference;
use kube::runtime::events::{Event, EventType, Recorder};

/// The most bytes of an Event's note: the API server refuses notes over 1 KiB.
const NOTE_BYTES: usize = 1000;

pub use flamefleet_api::text::truncated;

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
    publish_related(recorder, object, None, type_, action, reason, note).await;
}

/// Records an Event about `object` that concerns `related` too (the Event's `related`, e.g.
/// the run a policy created). The recorder folds repeats of one (object, reason, related)
/// into a series that keeps the first note; a different `related` is a different Event, so
/// each run's Event names its own run.
pub async fn publish_related(
    recorder: &Recorder,
    object: &ObjectReference,
    related: Option<ObjectReference>,
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
        secondary: related,
    };
    if let Err(e) = recorder.publish(&event, object).await {
        tracing::warn!("recording event {reason}: {e}");
    }
}
