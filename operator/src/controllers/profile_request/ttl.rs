//! `ttlSecondsAfterFinished`: when a finished request is deleted (pure logic).

use std::time::Duration;

use k8s_openapi::jiff::Timestamp;

/// What to do with a finished request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TtlAction {
    /// No TTL (or no completion time): keep it.
    Keep,
    /// The TTL has passed: delete it now.
    Delete,
    /// Check again after this long.
    RequeueAfter(Duration),
}

/// The TTL decision for a request that completed at `completed` with `ttl_seconds`, at `now`.
pub fn ttl_action(
    ttl_seconds: Option<i64>,
    completed: Option<Timestamp>,
    now: Timestamp,
) -> TtlAction {
    let (Some(ttl), Some(completed)) = (ttl_seconds, completed) else {
        return TtlAction::Keep;
    };
    let ttl = u64::try_from(ttl).unwrap_or(0);
    let elapsed = now.duration_since(completed);
    let elapsed = Duration::try_from(elapsed).unwrap_or(Duration::ZERO);
    match Duration::from_secs(ttl).checked_sub(elapsed) {
        Some(left) if !left.is_zero() => TtlAction::RequeueAfter(left),
        _ => TtlAction::Delete,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(secs: i64) -> Timestamp {
        Timestamp::from_second(secs).unwrap()
    }

    #[test]
    fn keeps_without_ttl_or_completion() {
        assert_eq!(ttl_action(None, Some(at(10)), at(100)), TtlAction::Keep);
        assert_eq!(ttl_action(Some(5), None, at(100)), TtlAction::Keep);
    }

    #[test]
    fn requeues_until_the_ttl_then_deletes() {
        assert_eq!(
            ttl_action(Some(60), Some(at(100)), at(130)),
            TtlAction::RequeueAfter(Duration::from_secs(30))
        );
        assert_eq!(
            ttl_action(Some(60), Some(at(100)), at(160)),
            TtlAction::Delete
        );
        assert_eq!(
            ttl_action(Some(0), Some(at(100)), at(100)),
            TtlAction::Delete
        );
        // A clock behind the completion time never deletes early.
        assert_eq!(
            ttl_action(Some(60), Some(at(100)), at(90)),
            TtlAction::RequeueAfter(Duration::from_secs(60))
        );
    }
}
