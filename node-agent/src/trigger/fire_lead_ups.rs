//! The lead-ups CPU and pressure fires read from the ring ([`super::cpu_ring`]), kept until
//! the fire's CPU run asks for them, which then prepends them to its profile.
//!
//! Like [`super::fire_heaps`]: bounded by count ([`LeadUpLimits::max_entries`]), bytes
//! ([`LeadUpLimits::max_bytes`], the oldest go first) and time ([`LeadUpLimits::ttl`]); a
//! lead-up goes only to a capture whose targets include the pod it was read from (by pod
//! UID), so a request naming someone else's fire gets nothing.

use std::collections::VecDeque;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant, SystemTime};

use super::cpu_ring::Snapshot;

/// The bounds of the spool.
#[derive(Debug, Clone, Copy)]
pub struct LeadUpLimits {
    /// Most lead-ups kept.
    pub max_entries: usize,
    /// Most bytes of samples kept, all together.
    pub max_bytes: usize,
    /// How long a lead-up is kept.
    pub ttl: Duration,
}

impl Default for LeadUpLimits {
    fn default() -> Self {
        Self {
            max_entries: 32,
            max_bytes: 16 << 20,
            ttl: Duration::from_secs(15 * 60),
        }
    }
}

/// The samples of a fired cgroup before its fire.
#[derive(Debug, Clone)]
pub struct LeadUp {
    /// The pod (its UID).
    pub pod_uid: String,
    /// The fired cgroup.
    pub cgroup: PathBuf,
    /// When the fire was seen.
    pub fired_at: SystemTime,
    /// The ring's frequency (each sample stands for 1/frequency s of CPU).
    pub frequency: u64,
    /// The lookback asked for.
    pub lookback: Duration,
    /// What the ring held.
    pub snapshot: Snapshot,
}

impl LeadUp {
    /// One line for a profile's comments and the capture's notes.
    pub fn describe(&self) -> String {
        format!(
            "lead-up: {} samples at {} Hz from the ring, {:.1} s before the trigger's fire \
             (lookback {} s{}); labelled trigger_phase=lead-up",
            self.snapshot.samples.len(),
            self.frequency,
            self.snapshot.covered().as_secs_f64(),
            self.lookback.as_secs(),
            if self.snapshot.wrapped {
                "; a CPU's ring had wrapped, so the lead-up is shorter there"
            } else {
                ""
            }
        )
    }
}

struct Kept {
    id: String,
    kept_at: Instant,
    bytes: usize,
    lead_up: LeadUp,
}

/// The spool. Share it behind an `Arc`.
#[derive(Default)]
pub struct FireLeadUps {
    limits: LeadUpLimits,
    kept: Mutex<VecDeque<Kept>>,
    next: AtomicU64,
    seed: u64,
}

impl std::fmt::Debug for FireLeadUps {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FireLeadUps")
            .field("limits", &self.limits)
            .finish_non_exhaustive()
    }
}

impl FireLeadUps {
    /// An empty spool with `limits`.
    pub fn new(limits: LeadUpLimits) -> Self {
        Self {
            limits,
            kept: Mutex::default(),
            next: AtomicU64::new(1),
            seed: fastrand::u64(..),
        }
    }

    /// A new fire id (when no heap spool makes them): unique on this node and across its
    /// restarts, 32 hex digits.
    pub fn new_id(&self) -> String {
        format!(
            "{:016x}{:016x}",
            self.seed,
            self.next.fetch_add(1, Ordering::Relaxed)
        )
    }

    /// Keeps `lead_up` under fire `id`, evicting the oldest as the bounds require.
    pub fn keep(&self, id: &str, lead_up: LeadUp) -> Result<(), String> {
        let bytes = lead_up.snapshot.bytes();
        if bytes > self.limits.max_bytes {
            return Err(format!(
                "the lead-up ({bytes} bytes) is larger than the node's spool of lead-ups ({} bytes)",
                self.limits.max_bytes
            ));
        }
        let now = Instant::now();
        let mut kept = self.kept.lock().unwrap_or_else(PoisonError::into_inner);
        kept.retain(|k| now.saturating_duration_since(k.kept_at) < self.limits.ttl && k.id != id);
        let mut total: usize = kept.iter().map(|k| k.bytes).sum();
        while !kept.is_empty()
            && (kept.len() >= self.limits.max_entries.max(1)
                || total + bytes > self.limits.max_bytes)
        {
            if let Some(old) = kept.pop_front() {
                total -= old.bytes;
            }
        }
        kept.push_back(Kept {
            id: id.to_owned(),
            kept_at: now,
            bytes,
            lead_up,
        });
        Ok(())
    }

    /// The lead-up of fire `id`, when it was read from one of `pod_uids`; it stays kept (a
    /// retried capture asks again).
    pub fn get(&self, id: &str, pod_uids: &[&str]) -> Result<LeadUp, String> {
        let now = Instant::now();
        let mut kept = self.kept.lock().unwrap_or_else(PoisonError::into_inner);
        kept.retain(|k| now.saturating_duration_since(k.kept_at) < self.limits.ttl);
        let k = kept.iter().find(|k| k.id == id).ok_or_else(|| {
            format!(
                "no lead-up of fire {} is kept on this node (the agent restarted, or it was \
                     evicted or older than its time to live)",
                bounded(id)
            )
        })?;
        if !pod_uids.contains(&k.lead_up.pod_uid.as_str()) {
            return Err(format!(
                "fire {} was on a pod that is not a target of this capture",
                bounded(id)
            ));
        }
        Ok(k.lead_up.clone())
    }

    /// Lead-ups kept now, and their bytes.
    pub fn usage(&self) -> (usize, usize) {
        let kept = self.kept.lock().unwrap_or_else(PoisonError::into_inner);
        (kept.len(), kept.iter().map(|k| k.bytes).sum())
    }
}

/// An id as a message may quote it (the operator's, so bounded).
fn bounded(id: &str) -> String {
    id.chars().take(64).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::trigger::cpu_ring::RingSample;

    fn lead_up(pod: &str, samples: usize) -> LeadUp {
        LeadUp {
            pod_uid: pod.into(),
            cgroup: PathBuf::from("/sys/fs/cgroup/x"),
            fired_at: SystemTime::now(),
            frequency: 19,
            lookback: Duration::from_secs(10),
            snapshot: Snapshot {
                samples: vec![
                    RingSample {
                        before_fire_ns: 1_000_000_000,
                        tgid: 1,
                        pid: 1,
                        comm: "spin".into(),
                        user_stack: vec![1, 2, 3],
                        kernel_stack: vec![],
                    };
                    samples
                ],
                torn: 0,
                wrapped: false,
            },
        }
    }

    #[test]
    fn a_lead_up_goes_only_to_a_capture_of_its_pod_within_the_bounds() {
        let one = lead_up("p", 10).snapshot.bytes();
        let spool = FireLeadUps::new(LeadUpLimits {
            max_entries: 3,
            max_bytes: one * 2 + one / 2,
            ttl: Duration::from_secs(3600),
        });
        for i in 0..4 {
            spool.keep(&format!("f{i}"), lead_up("p", 10)).unwrap();
        }
        assert_eq!(spool.usage(), (2, one * 2));
        assert_eq!(spool.get("f3", &["q", "p"]).unwrap().pod_uid, "p");
        assert!(
            spool
                .get("f3", &["q"])
                .unwrap_err()
                .contains("not a target")
        );
        assert!(
            spool
                .get("f1", &["p"])
                .unwrap_err()
                .starts_with("no lead-up")
        );
        assert!(spool.keep("huge", lead_up("p", 100)).is_err());
        assert_eq!(
            lead_up("p", 1).snapshot.covered(),
            Duration::from_secs(1),
            "covered: the oldest sample's distance to the fire"
        );
    }
}
