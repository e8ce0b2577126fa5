//! The heaps memory fires read on the node, kept until the fire's run asks for them.
//!
//! A memory fire reads the Go heap at once ([`super::heap_now`]): the run the operator
//! creates for the fire reaches this node a second or more later, often after the OOM
//! killer. So the profile read at the fire is kept here under the fire's id, and the run's
//! heap capture (`CaptureRequest.trigger_fire_id`) takes it as this node's artifact.
//!
//! Bounded by what it keeps: at most [`FireHeapLimits::max_entries`] profiles and
//! [`FireHeapLimits::max_bytes`] of encoded profile in all (the oldest go first), each for
//! at most [`FireHeapLimits::ttl`]. A run asks within seconds of its fire (the operator
//! creates it at once, the capture starts when the node's budget allows); the default 15
//! minutes leave room for a run that waits in a namespace's queue.
//!
//! Trust: the id is the node's own name for a fire, unique but not a secret. A profile is
//! handed only to a capture whose targets include the pod it was read from (by pod UID), so
//! a request that names someone else's fire (a tenant can write annotations on its own
//! requests) gets nothing it could not capture itself: its targets are pods of its own
//! namespace, resolved by the operator.

use std::collections::VecDeque;
use std::sync::Mutex;
use std::sync::PoisonError;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime};

use prost::Message as _;

use crate::capture::heap::HeapProfile;

/// The bounds of the spool.
#[derive(Debug, Clone, Copy)]
pub struct FireHeapLimits {
    /// Most profiles kept.
    pub max_entries: usize,
    /// Most encoded profile bytes kept, all together.
    pub max_bytes: usize,
    /// How long a profile is kept.
    pub ttl: Duration,
}

impl Default for FireHeapLimits {
    fn default() -> Self {
        Self {
            max_entries: 32,
            max_bytes: 64 << 20,
            ttl: Duration::from_secs(15 * 60),
        }
    }
}

/// A heap read at a fire.
#[derive(Debug, Clone)]
pub struct FireHeap {
    /// The pod it was read from (its UID).
    pub pod_uid: String,
    /// When the fire was seen.
    pub fired_at: SystemTime,
    /// From the fire to the profile read.
    pub took: Duration,
    /// The profile.
    pub heap: HeapProfile,
}

struct Kept {
    id: String,
    kept_at: Instant,
    bytes: usize,
    heap: FireHeap,
}

/// Why a fire's heap is not handed out.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Missing {
    /// Never kept, expired or evicted (or the agent restarted since).
    #[error(
        "the heap read at fire {0} is not kept on this node (the agent restarted, or it was \
         evicted or older than its time to live)"
    )]
    Unknown(String),
    /// Kept, for a pod that is not among the capture's targets.
    #[error("fire {0} was on a pod that is not a target of this capture")]
    OtherPod(String),
}

/// The spool. Share it behind an `Arc`.
#[derive(Default)]
pub struct FireHeaps {
    limits: FireHeapLimits,
    kept: Mutex<VecDeque<Kept>>,
    next: AtomicU64,
    seed: u64,
}

impl std::fmt::Debug for FireHeaps {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FireHeaps")
            .field("limits", &self.limits)
            .finish_non_exhaustive()
    }
}

impl FireHeaps {
    /// An empty spool with `limits`.
    pub fn new(limits: FireHeapLimits) -> Self {
        Self {
            limits,
            kept: Mutex::default(),
            next: AtomicU64::new(1),
            // Makes ids of one agent's run distinct from a restarted agent's.
            seed: fastrand::u64(..),
        }
    }

    /// A new fire id: unique on this node (and across its restarts), 32 hex digits.
    pub fn new_id(&self) -> String {
        format!(
            "{:016x}{:016x}",
            self.seed,
            self.next.fetch_add(1, Ordering::Relaxed)
        )
    }

    /// Keeps `heap` under fire `id`, evicting the oldest as the bounds require; an error
    /// when the profile alone is larger than the whole spool.
    pub fn keep(&self, id: &str, heap: FireHeap) -> Result<(), String> {
        let bytes = heap.heap.profile.encoded_len();
        if bytes > self.limits.max_bytes {
            return Err(format!(
                "the heap profile ({bytes} bytes) is larger than the node's spool of fire heaps \
                 ({} bytes)",
                self.limits.max_bytes
            ));
        }
        let now = Instant::now();
        let mut kept = self.kept.lock().unwrap_or_else(PoisonError::into_inner);
        self.expire(&mut kept, now);
        kept.retain(|k| k.id != id);
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
            heap,
        });
        Ok(())
    }

    /// The heap of fire `id`, when it was read from one of `pod_uids`. It stays kept (a
    /// capture retried after a failed upload asks again) until it expires or is evicted.
    pub fn get(&self, id: &str, pod_uids: &[&str]) -> Result<FireHeap, Missing> {
        let mut kept = self.kept.lock().unwrap_or_else(PoisonError::into_inner);
        self.expire(&mut kept, Instant::now());
        let k = kept
            .iter()
            .find(|k| k.id == id)
            .ok_or_else(|| Missing::Unknown(bounded(id)))?;
        if !pod_uids.contains(&k.heap.pod_uid.as_str()) {
            return Err(Missing::OtherPod(bounded(id)));
        }
        Ok(k.heap.clone())
    }

    /// Profiles kept now, and their encoded bytes.
    pub fn usage(&self) -> (usize, usize) {
        let kept = self.kept.lock().unwrap_or_else(PoisonError::into_inner);
        (kept.len(), kept.iter().map(|k| k.bytes).sum())
    }

    fn expire(&self, kept: &mut VecDeque<Kept>, now: Instant) {
        kept.retain(|k| now.saturating_duration_since(k.kept_at) < self.limits.ttl);
    }
}

/// An id as a message may quote it (the operator's, so bounded).
fn bounded(id: &str) -> String {
    id.chars().take(64).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::capture::heap::HeapSourceUsed;
    use flamefleet_proto::pprof::{Profile, Sample};

    fn heap(pod: &str, samples: usize) -> FireHeap {
        FireHeap {
            pod_uid: pod.into(),
            fired_at: SystemTime::now(),
            took: Duration::from_millis(20),
            heap: HeapProfile {
                profile: Profile {
                    sample: vec![
                        Sample {
                            value: vec![1; 16],
                            ..Sample::default()
                        };
                        samples
                    ],
                    ..Profile::default()
                },
                source: HeapSourceUsed::GoRuntime,
                reason: "test".into(),
                ebpf_stats: None,
                warnings: Vec::new(),
                processes: Vec::new(),
            },
        }
    }

    #[test]
    fn a_kept_heap_goes_only_to_a_capture_of_its_pod() {
        let spool = FireHeaps::new(FireHeapLimits::default());
        let id = spool.new_id();
        assert_ne!(id, spool.new_id(), "ids are unique");
        spool.keep(&id, heap("pod-a", 3)).unwrap();
        assert_eq!(
            spool.get(&id, &["pod-b", "pod-a"]).unwrap().pod_uid,
            "pod-a"
        );
        assert_eq!(
            spool.get(&id, &["pod-b"]).unwrap_err(),
            Missing::OtherPod(id.clone())
        );
        assert!(matches!(
            spool.get("nope", &["pod-a"]),
            Err(Missing::Unknown(_))
        ));
        // Asked twice (a retried capture): still there.
        assert!(spool.get(&id, &["pod-a"]).is_ok());
    }

    #[test]
    fn the_spool_keeps_within_its_count_bytes_and_time() {
        let one = heap("p", 100).heap.profile.encoded_len();
        let spool = FireHeaps::new(FireHeapLimits {
            max_entries: 3,
            max_bytes: one * 2 + one / 2,
            ttl: Duration::from_secs(3600),
        });
        for i in 0..5 {
            spool.keep(&format!("f{i}"), heap("p", 100)).unwrap();
        }
        // Bytes bind first: two of the newest.
        assert_eq!(spool.usage(), (2, one * 2));
        assert!(spool.get("f4", &["p"]).is_ok() && spool.get("f3", &["p"]).is_ok());
        assert!(spool.get("f2", &["p"]).is_err());
        assert!(spool.keep("huge", heap("p", 1000)).is_err());

        let spool = FireHeaps::new(FireHeapLimits {
            max_entries: 2,
            max_bytes: 1 << 20,
            ttl: Duration::ZERO,
        });
        spool.keep("f", heap("p", 1)).unwrap();
        assert!(spool.get("f", &["p"]).is_err(), "expired at once");
    }
}
