//! A request that arrives while the artifact store cannot be reached waits for it, Pending.
//!
//! Before a capture the operator reads from the store what the request's namespace already
//! stores (its quota). Right after `helm install` the operator often runs before the store's
//! Service has an endpoint (or kube-proxy its rules), and a store pod restarting has the
//! same effect: the store is briefly unreachable. A request created then is not failed: it
//! stays Pending with a `Queued` condition (reason [`REASON`]) saying which store it waits
//! for and why, is checked again with backoff (1 s, doubling, at most [`MAX_RETRY`] apart),
//! and fails with reason [`FAILED_REASON`] only once the store stayed unreachable for the
//! operator's `--store-wait` (2 minutes by default).
//!
//! The wait is kept in memory, per request: an operator that restarts (or a replica that
//! takes over) starts its own bound, so a request waits at most `--store-wait` per leader.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::store::StoreError;

/// The `Queued` condition's reason while a request waits for the store.
pub const REASON: &str = "WaitingForStore";
/// The request's reason when the store stayed unreachable for the whole bound.
pub const FAILED_REASON: &str = "StoreUnavailable";
/// The longest time between two checks of the store.
pub const MAX_RETRY: Duration = Duration::from_secs(15);
/// The operator's default bound (`--store-wait`).
pub const DEFAULT_BOUND: Duration = Duration::from_secs(120);

/// What to do with a request after a check of the store.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// The store answered (or the check says nothing about reaching it): start.
    Ready,
    /// Keep the request Pending with `message`; check again after `retry_in`.
    Wait {
        /// The `Queued` condition's message.
        message: String,
        /// When to check again.
        retry_in: Duration,
    },
    /// The store stayed unreachable for the whole bound: fail the request with `message`.
    GiveUp {
        /// The request's message.
        message: String,
    },
}

/// The store called (the origin of the URL: what a user checks is the Service and its port,
/// not the endpoint's path) and why that failed, when `error` says the store could not be
/// reached or could not answer (a transport error, or an HTTP 5xx other than 507, which
/// means a full volume). Other errors are not a store outage: waiting would not help.
pub fn unavailable(error: &StoreError) -> Option<(String, String)> {
    let (url, reason) = match error {
        StoreError::Unreachable { url, reason } => (url, reason.clone()),
        StoreError::Remote {
            url,
            status,
            message,
        } if *status >= 500 && *status != 507 => (url, format!("HTTP {status}: {message}")),
        _ => return None,
    };
    let store = match url::Url::parse(url) {
        Ok(u) if u.has_host() => format!("{}/", u.origin().ascii_serialization()),
        _ => url.clone(),
    };
    Some((store, reason))
}

#[derive(Debug, Clone, Copy)]
struct Wait {
    since: Instant,
    checks: u32,
}

/// The requests waiting for the store, by UID.
#[derive(Debug)]
pub struct StoreWaits {
    bound: Duration,
    waits: Mutex<HashMap<String, Wait>>,
}

impl Default for StoreWaits {
    fn default() -> Self {
        Self::new(DEFAULT_BOUND)
    }
}

impl StoreWaits {
    /// Requests wait at most `bound` for the store.
    pub fn new(bound: Duration) -> Self {
        Self {
            bound,
            waits: Mutex::new(HashMap::new()),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Wait>> {
        self.waits
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The verdict on request `uid` after a check of the store that found it `unreachable`
    /// (its URL and the error) or not (`None`), at `now`.
    pub fn check(&self, uid: &str, unreachable: Option<(String, String)>, now: Instant) -> Verdict {
        let Some((url, error)) = unreachable else {
            self.forget(uid);
            return Verdict::Ready;
        };
        let mut waits = self.lock();
        let wait = waits.entry(uid.to_owned()).or_insert(Wait {
            since: now,
            checks: 0,
        });
        let waited = now.saturating_duration_since(wait.since);
        if waited >= self.bound {
            waits.remove(uid);
            return Verdict::GiveUp {
                message: format!(
                    "the artifact store at {url} could not be reached for {}s: {error}; check the store Deployment, its pod's events and its Service's endpoints",
                    waited.as_secs()
                ),
            };
        }
        let retry_in = Duration::from_secs(1u64 << wait.checks.min(4))
            .min(MAX_RETRY)
            .min(self.bound - waited);
        wait.checks = wait.checks.saturating_add(1);
        Verdict::Wait {
            // The same message while the same error repeats: the status is written once.
            message: format!(
                "waiting for the artifact store at {url}: {error} (the request fails if it stays unreachable for {}s)",
                self.bound.as_secs()
            ),
            retry_in,
        }
    }

    /// Forgets the wait of request `uid` (it started, failed or was deleted).
    pub fn forget(&self, uid: &str) {
        self.lock().remove(uid);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn down() -> Option<(String, String)> {
        Some((
            "http://flamefleet-store.flamefleet-system.svc:8080/".into(),
            "error sending request: Connection refused".into(),
        ))
    }

    #[test]
    fn waits_with_backoff_then_gives_up_after_the_bound() {
        let waits = StoreWaits::new(Duration::from_secs(120));
        let t0 = Instant::now();
        let mut retries = Vec::new();
        let mut at = t0;
        loop {
            match waits.check("u1", down(), at) {
                Verdict::Wait { message, retry_in } => {
                    assert_eq!(
                        message,
                        "waiting for the artifact store at http://flamefleet-store.flamefleet-system.svc:8080/: error sending request: Connection refused (the request fails if it stays unreachable for 120s)"
                    );
                    retries.push(retry_in.as_secs());
                    at += retry_in;
                }
                Verdict::GiveUp { message } => {
                    assert!(
                        message.starts_with("the artifact store at http://flamefleet-store.flamefleet-system.svc:8080/ could not be reached for 120s: error sending request: Connection refused;"),
                        "{message}"
                    );
                    break;
                }
                Verdict::Ready => panic!("ready while down"),
            }
        }
        assert_eq!(at - t0, Duration::from_secs(120));
        assert_eq!(&retries[..6], &[1, 2, 4, 8, 15, 15]);
        // The wait was forgotten: a new outage starts a new bound.
        assert!(matches!(
            waits.check("u1", down(), at),
            Verdict::Wait { .. }
        ));
    }

    #[test]
    fn a_store_back_within_the_bound_starts_the_request_and_forgets_the_wait() {
        let waits = StoreWaits::new(Duration::from_secs(120));
        let t0 = Instant::now();
        assert!(matches!(
            waits.check("u1", down(), t0),
            Verdict::Wait { .. }
        ));
        assert!(matches!(
            waits.check("u2", down(), t0 + Duration::from_secs(100)),
            Verdict::Wait { .. }
        ));
        assert_eq!(
            waits.check("u1", None, t0 + Duration::from_secs(110)),
            Verdict::Ready
        );
        // u1's bound starts again from its next outage; u2 keeps its own.
        assert!(matches!(
            waits.check("u1", down(), t0 + Duration::from_secs(200)),
            Verdict::Wait { .. }
        ));
        assert!(matches!(
            waits.check("u2", down(), t0 + Duration::from_secs(220)),
            Verdict::GiveUp { .. }
        ));
    }

    #[test]
    fn only_an_unreachable_or_failing_store_is_waited_for() {
        let unreachable = StoreError::Unreachable {
            url: "https://flamefleet-store.ff.svc:8443/v1/usage/shop".into(),
            reason: "dns error".into(),
        };
        assert_eq!(
            unavailable(&unreachable),
            Some((
                "https://flamefleet-store.ff.svc:8443/".into(),
                "dns error".into()
            ))
        );
        let remote = |status| StoreError::Remote {
            url: "http://s/v1/usage/".into(),
            status,
            message: "m".into(),
        };
        assert_eq!(
            unavailable(&remote(503)),
            Some(("http://s/".into(), "HTTP 503: m".into()))
        );
        assert_eq!(unavailable(&remote(507)), None, "a full volume");
        assert_eq!(unavailable(&remote(403)), None, "a signing mismatch");
        assert_eq!(unavailable(&StoreError::Config("x".into())), None);
    }
}
