//! The agent's table of captures, keyed by request UID: the idempotency of
//! `Capture`. A UID seen for the first time starts a capture; a UID whose
//! capture runs attaches to its progress; a UID whose capture finished gets
//! the final result replayed. `Collect` attaches or replays but never starts.
//! `Cancel` stops a running capture.
//!
//! Finished results are kept in a bounded cache: at most [`CacheLimits::max_entries`]
//! (default 1,000) for at most [`CacheLimits::ttl`] (default 1 h). The
//! operator retries or re-attaches within seconds to minutes (e.g. after its
//! own restart, bounded by duration + grace); an hour covers that with room
//! to spare, and 1,000 final messages of a few hundred bytes each cost well
//! under a megabyte. An entry evicted earlier makes a repeated call start a
//! new capture, which is the behaviour of an agent that restarted.
//!
//! Progress is published on a `watch` channel, so a slow caller never queues
//! ticks, but the channel carries the first message of every stage as well as
//! the newest one: a caller that started a capture sees every stage it went
//! through, from ACCEPTED, however late its stream is first polled (see
//! [`follow`]).

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use flamefleet_proto::agent::CaptureProgress;
use flamefleet_proto::agent::capture_progress::Stage;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

/// Bounds of the finished-results cache.
#[derive(Debug, Clone, Copy)]
pub struct CacheLimits {
    /// Most finished results kept.
    pub max_entries: usize,
    /// How long a finished result is kept.
    pub ttl: Duration,
}

impl Default for CacheLimits {
    fn default() -> Self {
        Self {
            max_entries: 1000,
            ttl: Duration::from_secs(3600),
        }
    }
}

/// True for DONE and FAILED.
pub fn is_terminal(p: &CaptureProgress) -> bool {
    matches!(p.stage(), Stage::Done | Stage::Failed)
}

/// What the progress channel holds: the first message of each stage the capture
/// reached, in order (at most one per stage, so a handful), and the newest message, each
/// with its sequence number (from 1; none yet for a capture that has not answered).
#[derive(Debug, Clone)]
pub struct Published {
    stages: Vec<(u64, CaptureProgress)>,
    latest: Option<(u64, CaptureProgress)>,
}

impl Published {
    fn new(first: Option<CaptureProgress>) -> Self {
        let mut published = Self {
            stages: Vec::new(),
            latest: None,
        };
        if let Some(first) = first {
            published.push(first);
        }
        published
    }

    fn push(&mut self, p: CaptureProgress) {
        let seq = self.latest.as_ref().map_or(1, |(seq, _)| seq + 1);
        if self.latest.as_ref().is_none_or(|(_, l)| l.stage != p.stage) {
            self.stages.push((seq, p.clone()));
        }
        self.latest = Some((seq, p));
    }

    /// The messages a follower that has seen up to `seen` has not seen: the first
    /// message of every stage reached since, then the newest message.
    fn unseen(&self, seen: u64) -> Vec<(u64, CaptureProgress)> {
        let mut out: Vec<(u64, CaptureProgress)> = self
            .stages
            .iter()
            .filter(|(seq, _)| *seq > seen)
            .cloned()
            .collect();
        if let Some(latest) = &self.latest
            && latest.0 > seen
            && out.last().is_none_or(|(seq, _)| *seq != latest.0)
        {
            out.push(latest.clone());
        }
        out
    }
}

/// A capture's progress channel.
pub type ProgressFeed = watch::Receiver<Published>;

/// Follows a capture's progress until (and including) its final message. `from_start`
/// replays every stage from ACCEPTED (the caller that started the capture); otherwise the
/// stream starts at the newest message (a caller attaching to a running capture).
pub fn follow(
    rx: ProgressFeed,
    from_start: bool,
) -> impl futures::Stream<Item = CaptureProgress> + Send + 'static {
    let seen = if from_start {
        0
    } else {
        rx.borrow()
            .latest
            .as_ref()
            .map_or(0, |(seq, _)| seq.saturating_sub(1))
    };
    futures::StreamExt::flat_map(
        futures::stream::unfold(
            (rx, seen, false, true),
            |(mut rx, seen, done, first)| async move {
                if done {
                    return None;
                }
                // The sender goes away after publishing the final message, or without one
                // when the capture was forgotten ([`CaptureHandle::forget`]).
                if !first && rx.changed().await.is_err() {
                    return None;
                }
                let unseen = rx.borrow_and_update().unseen(seen);
                let seen = unseen.last().map_or(seen, |(seq, _)| *seq);
                let done = unseen.iter().any(|(_, p)| is_terminal(p));
                let batch: Vec<CaptureProgress> = unseen.into_iter().map(|(_, p)| p).collect();
                Some((batch, (rx, seen, done, false)))
            },
        ),
        futures::stream::iter,
    )
}

struct Running {
    progress: ProgressFeed,
    cancel: CancellationToken,
}

#[derive(Default)]
struct Inner {
    running: HashMap<String, Running>,
    finished: HashMap<String, (CaptureProgress, Instant)>,
    /// Finished UIDs oldest first (for eviction).
    order: VecDeque<(String, Instant)>,
}

/// The capture table. Share it behind an `Arc`.
#[derive(Default)]
pub struct CaptureTable {
    inner: Mutex<Inner>,
    limits: CacheLimits,
}

impl std::fmt::Debug for CaptureTable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let inner = self.lock();
        f.debug_struct("CaptureTable")
            .field("running", &inner.running.len())
            .field("finished", &inner.finished.len())
            .finish()
    }
}

/// What a `Capture` call with a given UID gets.
#[derive(Debug)]
pub enum Joined {
    /// No capture with this UID: the caller runs it through the handle.
    New(CaptureHandle, ProgressFeed),
    /// The capture runs: follow its progress.
    Attached(ProgressFeed),
    /// The capture finished: its final message.
    Finished(CaptureProgress),
}

/// What a `Collect` call for a known UID gets.
#[derive(Debug)]
pub enum Collected {
    /// The capture runs: follow its progress.
    Running(ProgressFeed),
    /// The capture finished: its final message.
    Finished(CaptureProgress),
}

impl CaptureTable {
    /// An empty table with the given cache bounds.
    pub fn new(limits: CacheLimits) -> Self {
        Self {
            inner: Mutex::default(),
            limits,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Starts, attaches to or replays the capture of `uid`. A new capture's progress starts
    /// with `accepted`; `None` publishes nothing until its engine answers.
    pub fn join(self: &Arc<Self>, uid: &str, accepted: Option<CaptureProgress>) -> Joined {
        let mut inner = self.lock();
        self.evict(&mut inner, Instant::now());
        if let Some(r) = inner.running.get(uid) {
            return Joined::Attached(r.progress.clone());
        }
        if let Some((last, _)) = inner.finished.get(uid) {
            return Joined::Finished(last.clone());
        }
        let (tx, rx) = watch::channel(Published::new(accepted));
        let cancel = CancellationToken::new();
        inner.running.insert(
            uid.to_owned(),
            Running {
                progress: rx.clone(),
                cancel: cancel.clone(),
            },
        );
        Joined::New(
            CaptureHandle {
                uid: uid.to_owned(),
                tx,
                cancel,
                table: Arc::clone(self),
                finished: false,
            },
            rx,
        )
    }

    /// Attaches to or replays the capture of `uid`, never starting one (`Collect`); `None`
    /// when the table does not know `uid`.
    pub fn collect(&self, uid: &str) -> Option<Collected> {
        let mut inner = self.lock();
        self.evict(&mut inner, Instant::now());
        if let Some(r) = inner.running.get(uid) {
            return Some(Collected::Running(r.progress.clone()));
        }
        inner
            .finished
            .get(uid)
            .map(|(last, _)| Collected::Finished(last.clone()))
    }

    /// Cancels the running capture of `uid`; false when none runs.
    pub fn cancel(&self, uid: &str) -> bool {
        match self.lock().running.get(uid) {
            Some(r) => {
                r.cancel.cancel();
                true
            }
            None => false,
        }
    }

    /// Number of running captures.
    pub fn running(&self) -> usize {
        self.lock().running.len()
    }

    fn forget(&self, uid: &str) {
        self.lock().running.remove(uid);
    }

    fn finish(&self, uid: &str, last: CaptureProgress) {
        let now = Instant::now();
        let mut inner = self.lock();
        inner.running.remove(uid);
        inner.finished.insert(uid.to_owned(), (last, now));
        inner.order.push_back((uid.to_owned(), now));
        self.evict(&mut inner, now);
    }

    fn evict(&self, inner: &mut Inner, now: Instant) {
        while let Some((uid, at)) = inner.order.front().cloned() {
            let expired = now.duration_since(at) > self.limits.ttl;
            if !expired && inner.finished.len() <= self.limits.max_entries {
                break;
            }
            inner.order.pop_front();
            // Only drop the cache entry if it is this (oldest) instance.
            if inner.finished.get(&uid).is_some_and(|(_, t)| *t == at) {
                inner.finished.remove(&uid);
            }
        }
    }
}

/// The running side of one capture: publishes progress, sees cancellation,
/// and records the final message. Dropped without [`CaptureHandle::finish`]
/// (a bug or a panic in the pipeline) it finishes the capture as FAILED, so
/// that no caller waits forever.
#[derive(Debug)]
pub struct CaptureHandle {
    uid: String,
    tx: watch::Sender<Published>,
    cancel: CancellationToken,
    table: Arc<CaptureTable>,
    finished: bool,
}

impl CaptureHandle {
    /// The request UID.
    pub fn uid(&self) -> &str {
        &self.uid
    }

    /// Publishes a non-terminal progress message.
    pub fn progress(&self, p: CaptureProgress) {
        self.tx.send_modify(|published| published.push(p));
    }

    /// Resolves when `Cancel` was called for this capture.
    pub fn cancelled(&self) -> tokio_util::sync::WaitForCancellationFuture<'_> {
        self.cancel.cancelled()
    }

    /// True once `Cancel` was called (or [`CaptureHandle::stop`]).
    pub fn is_cancelled(&self) -> bool {
        self.cancel.is_cancelled()
    }

    /// Stops the capture as a `Cancel` call does: the agent's own bound on a capture
    /// nobody will collect (see `pipeline::abandon_at`).
    pub fn stop(&self) {
        self.cancel.cancel();
    }

    /// Records and publishes the final message.
    pub fn finish(mut self, last: CaptureProgress) {
        self.complete(last);
    }

    /// Drops the capture without a final message, as an agent that restarted loses it: the
    /// streams following it end, and the table no longer knows its UID (a `Collect` finds
    /// nothing, a `Capture` starts it anew).
    pub fn forget(mut self) {
        self.finished = true;
        self.table.forget(&self.uid);
    }

    fn complete(&mut self, last: CaptureProgress) {
        if self.finished {
            return;
        }
        self.finished = true;
        // Cache first, then publish: a caller arriving between the two
        // attaches to a channel that already holds the final message.
        self.table.finish(&self.uid, last.clone());
        self.tx.send_modify(|published| published.push(last));
    }
}

impl Drop for CaptureHandle {
    fn drop(&mut self) {
        if !self.finished {
            self.complete(CaptureProgress {
                stage: Stage::Failed as i32,
                message: "internal error: the capture ended without a result; see the agent log"
                    .into(),
                ..Default::default()
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stage(s: Stage) -> CaptureProgress {
        CaptureProgress {
            stage: s as i32,
            ..Default::default()
        }
    }

    #[test]
    fn new_attach_replay_and_eviction() {
        let table = Arc::new(CaptureTable::new(CacheLimits {
            max_entries: 2,
            ttl: Duration::from_secs(3600),
        }));
        let Joined::New(handle, _) = table.join("a", Some(stage(Stage::Accepted))) else {
            panic!("expected a new capture");
        };
        assert!(matches!(
            table.join("a", Some(stage(Stage::Accepted))),
            Joined::Attached(_)
        ));
        assert!(table.cancel("a"));
        assert!(handle.is_cancelled());
        handle.finish(stage(Stage::Done));
        assert!(!table.cancel("a"));
        assert!(matches!(
            table.join("a", Some(stage(Stage::Accepted))),
            Joined::Finished(p) if p.stage() == Stage::Done
        ));
        for uid in ["b", "c"] {
            let Joined::New(h, _) = table.join(uid, Some(stage(Stage::Accepted))) else {
                panic!("expected a new capture");
            };
            drop(h); // finishes as FAILED
        }
        assert!(matches!(
            table.join("c", Some(stage(Stage::Accepted))),
            Joined::Finished(p) if p.stage() == Stage::Failed
        ));
        // "a" was the oldest of three with room for two: a new capture.
        assert!(matches!(
            table.join("a", Some(stage(Stage::Accepted))),
            Joined::New(..)
        ));
    }

    #[tokio::test]
    async fn collect_follows_or_replays_but_never_starts() {
        use futures::StreamExt as _;
        let table = Arc::new(CaptureTable::new(CacheLimits::default()));
        assert!(table.collect("unknown").is_none());
        assert_eq!(table.running(), 0, "collect started a capture");
        let Joined::New(handle, _) = table.join("a", Some(stage(Stage::Accepted))) else {
            panic!("expected a new capture");
        };
        handle.progress(stage(Stage::Running));
        let Some(Collected::Running(rx)) = table.collect("a") else {
            panic!("expected to follow the running capture");
        };
        // A collector starts at the newest message it finds.
        let collected = follow(rx, false);
        handle.finish(stage(Stage::Done));
        let seen: Vec<Stage> = collected.map(|p| p.stage()).collect().await;
        assert_eq!(seen, [Stage::Running, Stage::Done]);
        assert!(matches!(
            table.collect("a"),
            Some(Collected::Finished(p)) if p.stage() == Stage::Done
        ));
    }

    #[tokio::test]
    async fn a_late_follower_of_a_new_capture_sees_every_stage_in_order() {
        use futures::StreamExt as _;
        let table = Arc::new(CaptureTable::new(CacheLimits::default()));
        let Joined::New(handle, rx) = table.join("late", Some(stage(Stage::Accepted))) else {
            panic!("expected a new capture");
        };
        // Everything happens before the stream is first polled.
        for s in [Stage::Running, Stage::Running, Stage::Uploading] {
            handle.progress(stage(s));
        }
        // A caller attaching now starts from the newest message it finds.
        let attached = match table.join("late", Some(stage(Stage::Accepted))) {
            Joined::Attached(rx) => follow(rx, false),
            other => panic!("expected to attach: {other:?}"),
        };
        handle.finish(stage(Stage::Done));
        let seen: Vec<Stage> = follow(rx, true).map(|p| p.stage()).collect().await;
        assert_eq!(
            seen,
            [
                Stage::Accepted,
                Stage::Running,
                Stage::Uploading,
                Stage::Done
            ]
        );
        let seen: Vec<Stage> = attached.map(|p| p.stage()).collect().await;
        assert_eq!(seen, [Stage::Uploading, Stage::Done]);
    }

    #[tokio::test]
    async fn a_capture_that_never_answers_publishes_nothing_until_it_ends() {
        use futures::StreamExt as _;
        let table = Arc::new(CaptureTable::new(CacheLimits::default()));
        let Joined::New(handle, rx) = table.join("hung", None) else {
            panic!("expected a new capture");
        };
        let attached = match table.join("hung", None) {
            Joined::Attached(rx) => follow(rx, false),
            other => panic!("expected to attach: {other:?}"),
        };
        assert!(table.cancel("hung"));
        handle.finish(stage(Stage::Failed));
        let seen: Vec<Stage> = follow(rx, true).map(|p| p.stage()).collect().await;
        assert_eq!(seen, [Stage::Failed]);
        let seen: Vec<Stage> = attached.map(|p| p.stage()).collect().await;
        assert_eq!(seen, [Stage::Failed]);
    }

    #[tokio::test]
    async fn a_forgotten_capture_ends_its_streams_without_a_result_and_is_unknown() {
        use futures::StreamExt as _;
        let table = Arc::new(CaptureTable::new(CacheLimits::default()));
        let Joined::New(handle, rx) = table.join("lost", Some(stage(Stage::Accepted))) else {
            panic!("expected a new capture");
        };
        handle.progress(stage(Stage::Running));
        handle.forget();
        let seen: Vec<Stage> = follow(rx, true).map(|p| p.stage()).collect().await;
        assert_eq!(seen, [Stage::Accepted, Stage::Running]);
        assert!(table.collect("lost").is_none());
        assert!(!table.cancel("lost"));
        assert_eq!(table.running(), 0);
        assert!(matches!(
            table.join("lost", Some(stage(Stage::Accepted))),
            Joined::New(..)
        ));
    }
}
