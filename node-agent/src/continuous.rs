//! Always-on profiling (docs/export.md, "Always-on profiling"): the pods of continuous
//! policies on this node, profiled back to back in windows (by default 19 s every 20 s) by
//! one thread, each window split into one CPU profile per pod and handed to the operator's
//! stream.
//!
//! - **One set per node.** The operator sends the whole set (pods, their policies and
//!   frequency, the window and period); a new set replaces the old one at once: the running
//!   window ends early (what it sampled is sent) and the next one starts, so a pod that joins
//!   is sampled within a second and a pod that leaves is not sampled any more. A set lives as
//!   long as the call that sent it ([`Continuous::end`]).
//! - **Its own samplers.** The windows run on CPU samplers of their own, one per frequency
//!   (the node's registry gives a capture that joins a running sampler that sampler's
//!   frequency: always-on windows there would hold every ad hoc capture of the node at 19 Hz).
//!   They share the node's process catalog.
//! - **Windows cut from one capture.** Each frequency's capture is held as long as the set:
//!   a window ends and the next begins at one read of the sampler's counts, so consecutive
//!   windows' sampled spans meet exactly and a window's start costs nothing (no BPF load, no
//!   perf event to open, no process to walk). Windows keep a fixed cadence from the first
//!   one; between a window's end and the next period, if the window is shorter than the
//!   period, the sampler's perf events are disabled. What a window reports as sampled is
//!   the span between the reads (or the pause) that bound it. Symbolizing, splitting and
//!   encoding a window happen on a builder thread while the next window samples.
//! - **Bounded.** At most [`MAX_PODS`] pods and [`MAX_LANES`] frequencies; each pod's
//!   profile at most the set's `max_profile_bytes` (a larger one is replaced by a window
//!   saying so); windows go to a queue of [`QUEUE`] that drops, and counts, when the
//!   operator does not keep up. Nothing here ever waits for the operator.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::time::{Duration, Instant};

use flamefleet_proto::agent::{
    ContinuousAck, ContinuousEvent, ContinuousRequest, Target, WindowProfile, continuous_event,
};

use crate::capture::cpu::CpuOptions;
use crate::capture::lifecycle::{self, CaptureSpec, Running, WindowCut};
use crate::capture::{CaptureTarget, SamplerConfig, Samplers};
use crate::cgroup::CgroupRoot;
use crate::process::ProcessCatalog;
use crate::service::targets;

/// Most pods in one node's set.
pub const MAX_PODS: usize = 1000;
/// Most distinct frequencies (one sampler each) in one node's set.
pub const MAX_LANES: usize = 4;
/// Windows queued for the operator's stream before new ones are dropped.
pub const QUEUE: usize = 256;
/// Shortest window and period accepted.
pub const MIN_WINDOW: Duration = Duration::from_secs(1);
/// Longest period accepted.
pub const MAX_PERIOD: Duration = Duration::from_secs(3600);
/// Largest profile a set may allow per pod and window (gRPC's default message limit is
/// 4 MiB).
pub const MAX_PROFILE_BYTES: u64 = 3 << 20;
/// Highest frequency accepted.
pub const MAX_FREQUENCY_HZ: u32 = 1000;

/// One pod of the set.
#[derive(Debug, Clone, PartialEq)]
struct Pod {
    policy_uids: Vec<String>,
    target: Target,
}

/// A checked set.
#[derive(Debug, Clone, Default, PartialEq)]
struct Set {
    /// Pods by frequency.
    lanes: BTreeMap<u32, Vec<Pod>>,
    window: Duration,
    period: Duration,
    max_profile_bytes: u64,
}

impl Set {
    fn is_empty(&self) -> bool {
        self.lanes.values().all(Vec::is_empty)
    }

    fn pods(&self) -> usize {
        self.lanes.values().map(Vec::len).sum()
    }
}

#[derive(Default)]
struct State {
    /// The current call's number (0: none yet).
    session: u64,
    set: Set,
    /// Bumped on every change of the set (the thread ends its window early).
    generation: u64,
    sender: Option<tokio::sync::mpsc::Sender<ContinuousEvent>>,
    /// The windows' thread runs.
    running: bool,
}

/// Counters of `/metrics`.
#[derive(Debug, Default)]
struct Counters {
    windows: AtomicU64,
    sent: AtomicU64,
    dropped: AtomicU64,
    failed: AtomicU64,
    too_large: AtomicU64,
}

/// The node's always-on profiling: the current set and the thread that runs its windows.
pub struct Continuous {
    root: CgroupRoot,
    config: SamplerConfig,
    catalog: ProcessCatalog,
    state: Mutex<State>,
    changed: Condvar,
    counters: Counters,
}

impl std::fmt::Debug for Continuous {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Continuous")
            .field("root", &self.root)
            .finish_non_exhaustive()
    }
}

impl Continuous {
    /// Profiles pods under `root`, with samplers configured as `config` (the node's), the
    /// node's process `catalog` shared.
    pub fn new(root: CgroupRoot, config: SamplerConfig, catalog: ProcessCatalog) -> Arc<Self> {
        Arc::new(Self {
            root,
            config,
            catalog,
            state: Mutex::default(),
            changed: Condvar::new(),
            counters: Counters::default(),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Replaces the set with `request`. Returns the call's number, its acknowledgement and
    /// where its windows arrive.
    ///
    /// # Errors
    /// A window or period out of range (the whole set is refused).
    pub fn replace(
        self: &Arc<Self>,
        request: &ContinuousRequest,
    ) -> Result<
        (
            u64,
            ContinuousEvent,
            tokio::sync::mpsc::Receiver<ContinuousEvent>,
        ),
        String,
    > {
        let (set, refused) = checked(request)?;
        let pods = set.pods();
        let (tx, rx) = tokio::sync::mpsc::channel(QUEUE);
        let (session, start) = {
            let mut state = self.lock();
            state.session += 1;
            state.sender = Some(tx);
            if state.set != set {
                state.set = set;
                state.generation += 1;
            }
            let start = !state.running && !state.set.is_empty();
            state.running |= start;
            (state.session, start)
        };
        self.changed.notify_all();
        if start {
            let me = Arc::clone(self);
            let spawned = std::thread::Builder::new()
                .name("ff-continuous".into())
                .spawn(move || me.run());
            if let Err(e) = spawned {
                self.lock().running = false;
                return Err(format!("cannot start the windows' thread: {e}"));
            }
        }
        let ack = ContinuousEvent {
            event: Some(continuous_event::Event::Ack(ContinuousAck {
                pods: u32::try_from(pods).unwrap_or(u32::MAX),
                refused,
            })),
        };
        Ok((session, ack, rx))
    }

    /// Call `session`'s stream ended: when it is still the current one, profile nothing.
    pub fn end(&self, session: u64) {
        let mut state = self.lock();
        if state.session != session {
            return;
        }
        state.sender = None;
        state.set = Set::default();
        state.generation += 1;
        drop(state);
        self.changed.notify_all();
    }

    /// The counters in the Prometheus text format (`/metrics`).
    pub fn render_metrics(&self) -> String {
        let pods = self.lock().set.pods();
        let c = &self.counters;
        let mut out = String::new();
        let mut metric = |name: &str, kind: &str, help: &str, value: u64| {
            out.push_str(&format!(
                "# HELP flamefleet_agent_continuous_{name} {help}\n# TYPE flamefleet_agent_continuous_{name} {kind}\nflamefleet_agent_continuous_{name} {value}\n"
            ));
        };
        metric("pods", "gauge", "Pods profiled always-on.", pods as u64);
        metric(
            "windows_total",
            "counter",
            "Always-on windows run (all pods of the node at once).",
            c.windows.load(Ordering::Relaxed),
        );
        metric(
            "profiles_sent_total",
            "counter",
            "Pod windows queued for the operator.",
            c.sent.load(Ordering::Relaxed),
        );
        metric(
            "profiles_dropped_total",
            "counter",
            "Pod windows dropped: the operator's stream was full or gone.",
            c.dropped.load(Ordering::Relaxed),
        );
        metric(
            "profiles_too_large_total",
            "counter",
            "Pod windows whose profile was over the set's size limit (sent without it).",
            c.too_large.load(Ordering::Relaxed),
        );
        metric(
            "windows_failed_total",
            "counter",
            "Windows that could not start or be read (see the log).",
            c.failed.load(Ordering::Relaxed),
        );
        out
    }

    /// The windows' thread: runs until the set is empty.
    ///
    /// Each frequency's capture is held across windows (a [`Lane`]): its sampler stays
    /// attached, and one window becomes the next by one read of the sampler's counts
    /// ([`Running::cut`]), so the windows' sampled spans follow each other with no gap and a
    /// window's start costs nothing. Windows follow a fixed cadence: window k samples from
    /// `origin + k·period` (the origin: when the first captures had started, their samplers
    /// loaded) for the set's window; in the rest of the period, if any, the sampler is paused
    /// (its perf events disabled: nothing sampled, nothing paid). The work a window's end
    /// costs (symbolizing, splitting, encoding) happens while the next one samples.
    fn run(self: Arc<Self>) {
        loop {
            let (jobs, queue) = std::sync::mpsc::sync_channel(BUILDS);
            let me = Arc::clone(&self);
            let builder = std::thread::Builder::new()
                .name("ff-continuous-build".into())
                .spawn(move || me.build(&queue));
            let builder = match builder {
                Ok(b) => b,
                Err(e) => {
                    tracing::error!(
                        "always-on profiling stops: cannot start its builder thread: {e}"
                    );
                    self.counters.failed.fetch_add(1, Ordering::Relaxed);
                    self.lock().running = false;
                    return;
                }
            };
            let builds = Builds(jobs);
            self.windows(&builds);
            // The last windows are built and sent before the thread ends (or a set that
            // came meanwhile starts).
            drop(builds);
            let _ = builder.join();
            let mut state = self.lock();
            if state.set.is_empty() {
                state.running = false;
                return;
            }
        }
    }

    /// The windows' loop ([`Self::run`]), until the set is empty.
    fn windows(&self, builds: &Builds) {
        let mut samplers: HashMap<u32, Arc<Samplers>> = HashMap::new();
        let mut lanes: BTreeMap<u32, Lane> = BTreeMap::new();
        let mut seen: Option<u64> = None;
        let mut origin: Option<Instant> = None;
        let mut paused = false;
        let mut last = Set::default();
        loop {
            let (set, generation) = {
                let state = self.lock();
                if state.set.is_empty() {
                    // A set replaced by an empty one: what the running windows sampled is
                    // sent (a call that ended has no stream to send it on).
                    if state.sender.is_none() || paused {
                        lanes.clear();
                    }
                    break;
                }
                (state.set.clone(), state.generation)
            };
            last.clone_from(&set);
            samplers.retain(|hz, _| set.lanes.contains_key(hz));
            let period = set.period.max(MIN_WINDOW);
            let contiguous = set.window >= period;
            if seen != Some(generation) {
                // A new set: its captures start while the old ones still sample (joining
                // their samplers), then the old ones' windows end.
                seen = Some(generation);
                lanes = self.renew(&set, &mut samplers, lanes, paused, builds);
                if origin.is_none() && !lanes.is_empty() {
                    origin = Some(Instant::now());
                }
                continue;
            }
            let Some(origin) = origin.filter(|_| !lanes.is_empty()) else {
                // No pod's cgroup found yet: look again a period later.
                if self.pause_until(Instant::now() + period, generation) {
                    seen = None;
                }
                continue;
            };
            let now = Instant::now();
            let periods = now.duration_since(origin).as_nanos() / period.as_nanos();
            let period_start = origin + period * u32::try_from(periods).unwrap_or(u32::MAX);
            let in_window = contiguous || now < period_start + set.window;
            if !contiguous && paused && in_window {
                for (hz, lane) in &mut lanes {
                    if let Err(e) = lane.running.resume() {
                        self.counters.failed.fetch_add(1, Ordering::Relaxed);
                        tracing::warn!(hz, "an always-on window could not start: {e}");
                    }
                }
                paused = false;
                self.counters.windows.fetch_add(1, Ordering::Relaxed);
                continue;
            }
            if !contiguous && !paused && !in_window {
                for (hz, lane) in &mut lanes {
                    if let Err(e) = lane.running.pause() {
                        tracing::warn!(hz, "an always-on window could not pause: {e}");
                    }
                }
                paused = true;
                for (&hz, lane) in &mut lanes {
                    self.cut(hz, lane, &set, builds);
                }
                if lanes.values().any(|l| l.missing > 0) {
                    lanes = self.renew(&set, &mut samplers, lanes, paused, builds);
                }
                continue;
            }
            let next = if contiguous || paused {
                period_start + period
            } else {
                period_start + set.window
            };
            if self.pause_until(next, generation) && contiguous {
                self.counters.windows.fetch_add(1, Ordering::Relaxed);
                if lanes.values().any(|l| l.missing > 0) {
                    lanes = self.renew(&set, &mut samplers, lanes, paused, builds);
                } else {
                    for (&hz, lane) in &mut lanes {
                        self.cut(hz, lane, &set, builds);
                    }
                }
            }
        }
        for (hz, mut lane) in lanes {
            self.cut(hz, &mut lane, &last, builds);
        }
    }

    /// Sleeps until `at` (`true`), or until the set changes from `generation` (`false`).
    fn pause_until(&self, at: Instant, generation: u64) -> bool {
        let mut state = self.lock();
        while state.generation == generation {
            let left = at.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return true;
            }
            state = self
                .changed
                .wait_timeout(state, left)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
        false
    }

    /// Captures for `set`, replacing `old`: the new ones start first (joining the old ones'
    /// samplers, which keep sampling meanwhile: no gap, and the new captures' process walks
    /// are not cut from any window), then the old ones' windows end and are sent. A
    /// `paused` set's old captures end first instead (their windows were sent when they
    /// paused, and a paused sampler takes no new capture), and the new ones start paused.
    fn renew(
        &self,
        set: &Set,
        samplers: &mut HashMap<u32, Arc<Samplers>>,
        mut old: BTreeMap<u32, Lane>,
        paused: bool,
        builds: &Builds,
    ) -> BTreeMap<u32, Lane> {
        if paused {
            old.clear();
        }
        let mut lanes = BTreeMap::new();
        for (&hz, pods) in &set.lanes {
            // Pods whose cgroups are gone (or not there yet) are left out, and looked for
            // again at the end of every window.
            let mut resolved: Vec<CaptureTarget> = Vec::new();
            let mut found: Vec<Pod> = Vec::new();
            for pod in pods {
                match targets::resolve(&self.root, std::slice::from_ref(&pod.target)) {
                    Ok(r) => {
                        resolved.extend(r.into_iter().map(|r| r.capture));
                        found.push(pod.clone());
                    }
                    // A container of the set is gone (exited, or restarted under a new ID
                    // the next set will name): the pod's own cgroup holds what still runs.
                    Err(e) if !pod.target.containers.is_empty() => {
                        tracing::debug!("always-on window: {e}; sampling the pod's cgroup");
                        let whole = Target {
                            containers: Vec::new(),
                            ..pod.target.clone()
                        };
                        match targets::resolve(&self.root, std::slice::from_ref(&whole)) {
                            Ok(r) => {
                                resolved.extend(r.into_iter().map(|r| r.capture));
                                found.push(pod.clone());
                            }
                            Err(e) => tracing::debug!("always-on window: {e}"),
                        }
                    }
                    Err(e) => tracing::debug!("always-on window: {e}"),
                }
            }
            let missing = pods.len() - found.len();
            if resolved.is_empty() {
                continue;
            }
            let registry = samplers.entry(hz).or_insert_with(|| {
                Arc::new(Samplers::with_catalog(
                    self.config.clone(),
                    self.catalog.clone(),
                ))
            });
            let spec = CaptureSpec::Cpu {
                targets: resolved,
                options: CpuOptions {
                    frequency: u64::from(hz),
                    ..CpuOptions::default()
                },
                // Held until the set changes: the windows are cut from it.
                duration: MAX_PERIOD,
            };
            match lifecycle::start(registry, spec) {
                Ok(mut running) => {
                    if paused && let Err(e) = running.pause() {
                        tracing::warn!(hz, "an always-on capture could not pause: {e}");
                    }
                    lanes.insert(
                        hz,
                        Lane {
                            pods: found,
                            missing,
                            running,
                        },
                    );
                }
                Err(e) => {
                    self.counters.failed.fetch_add(1, Ordering::Relaxed);
                    tracing::warn!(hz, "an always-on window could not start: {e}");
                }
            }
        }
        if !lanes.is_empty() {
            self.counters.windows.fetch_add(1, Ordering::Relaxed);
        }
        for (hz, mut lane) in old {
            self.cut(hz, &mut lane, set, builds);
        }
        lanes
    }

    /// Ends `lane`'s window now (the next one starts at the same instant) and hands it to
    /// `builds`, which sends each of its pods' profile of it.
    fn cut(&self, hz: u32, lane: &mut Lane, set: &Set, builds: &Builds) {
        match lane.running.cut() {
            Ok(cut) => {
                let job = Build {
                    cut,
                    pods: lane.pods.clone(),
                    hz,
                    max_bytes: set.max_profile_bytes,
                };
                if let Err(std::sync::mpsc::TrySendError::Full(job)) = builds.0.try_send(job) {
                    self.counters
                        .dropped
                        .fetch_add(job.pods.len() as u64, Ordering::Relaxed);
                    tracing::warn!(
                        hz,
                        "an always-on window was dropped: the windows before it are still being built"
                    );
                }
            }
            Err(e) => {
                self.counters.failed.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(hz, "an always-on window could not be read: {e}");
            }
        }
    }

    /// Builds the windows `jobs` brings (symbolizing, splitting per pod, encoding) and sends
    /// them, until the windows' thread ends.
    fn build(&self, jobs: &std::sync::mpsc::Receiver<Build>) {
        for job in jobs {
            let finished = job.cut.finish();
            let dropped = match &finished.summary.kind {
                Some(flamefleet_proto::agent::capture_summary::Kind::Cpu(c)) => c.dropped_samples,
                _ => 0,
            };
            // The window's span is the profile's: from the read (or resume) that started it
            // to the read (or pause) that ended it. In milliseconds, each end rounded down, so
            // that consecutive windows' spans still meet.
            let start_ns = finished.profile.time_nanos;
            let end_ns = start_ns.saturating_add(finished.profile.duration_nanos);
            let start_unix_ms = start_ns.div_euclid(1_000_000);
            let duration_ms = end_ns.div_euclid(1_000_000) - start_unix_ms;
            if duration_ms <= 0 {
                continue;
            }
            let meta = WindowMeta {
                start_unix_ms,
                duration_ms: u32::try_from(duration_ms).unwrap_or(u32::MAX),
                hz: job.hz,
                dropped,
                max_bytes: job.max_bytes,
            };
            for w in per_pod(&finished.profile, &job.pods, &meta, &self.counters) {
                self.send(w);
            }
        }
    }

    /// Queues `window` for the operator; never waits.
    fn send(&self, window: WindowProfile) {
        let state = self.lock();
        let event = ContinuousEvent {
            event: Some(continuous_event::Event::Window(window)),
        };
        let sent = state
            .sender
            .as_ref()
            .is_some_and(|s| s.try_send(event).is_ok());
        drop(state);
        if sent {
            self.counters.sent.fetch_add(1, Ordering::Relaxed);
        } else {
            self.counters.dropped.fetch_add(1, Ordering::Relaxed);
            tracing::debug!(
                "an always-on window was dropped: the operator's stream is full or gone"
            );
        }
    }
}

/// One frequency's capture, held across windows ([`Continuous::run`]).
struct Lane {
    /// The pods it samples: those of the set whose cgroups were found when it started.
    pods: Vec<Pod>,
    /// The set's pods at this frequency whose cgroups were not found.
    missing: usize,
    running: Running,
}

/// A window cut, for the builder thread ([`Continuous::build`]).
struct Build {
    cut: WindowCut,
    pods: Vec<Pod>,
    hz: u32,
    max_bytes: u64,
}

/// Where the windows' thread hands its cuts: the builder thread, which a window's cut
/// never waits for (a full queue drops the window, counted).
struct Builds(std::sync::mpsc::SyncSender<Build>);

/// Cuts waiting for the builder thread: one per frequency and window, with room for a
/// window whose build is slow (a binary symbolized for the first time).
const BUILDS: usize = 2 * MAX_LANES;

/// What every pod's profile of one window shares.
struct WindowMeta {
    start_unix_ms: i64,
    duration_ms: u32,
    hz: u32,
    dropped: u64,
    max_bytes: u64,
}

/// The window's profile of each pod of `pods` (one for each, a pod without samples too).
fn per_pod(
    profile: &flamefleet_proto::pprof::Profile,
    pods: &[Pod],
    meta: &WindowMeta,
    counters: &Counters,
) -> Vec<WindowProfile> {
    use flamefleet_pprof::split::{label, split};
    let mut parts = split(profile, |p, s| {
        Some((
            label(p, s, "namespace")?.to_owned(),
            label(p, s, "pod")?.to_owned(),
        ))
    });
    pods.iter()
        .map(|pod| {
            let t = &pod.target;
            let part = parts.remove(&(t.namespace.clone(), t.pod_name.clone()));
            let samples = part.as_ref().map_or(0, |p| {
                p.sample
                    .iter()
                    .map(|s| u64::try_from(s.value.first().copied().unwrap_or(0)).unwrap_or(0))
                    .sum()
            });
            let (pprof, error) = match part {
                None => (Vec::new(), String::new()),
                Some(p) => match flamefleet_pprof::encode_gzip(&p) {
                    Ok(bytes) if bytes.len() as u64 <= meta.max_bytes => (bytes, String::new()),
                    Ok(bytes) => {
                        counters.too_large.fetch_add(1, Ordering::Relaxed);
                        (
                            Vec::new(),
                            format!(
                                "the window's profile is {} bytes, over the limit of {} bytes",
                                bytes.len(),
                                meta.max_bytes
                            ),
                        )
                    }
                    Err(e) => (Vec::new(), format!("encoding the profile: {e}")),
                },
            };
            WindowProfile {
                policy_uids: pod.policy_uids.clone(),
                pod_uid: t.pod_uid.clone(),
                namespace: t.namespace.clone(),
                pod_name: t.pod_name.clone(),
                start_unix_ms: meta.start_unix_ms,
                duration_ms: meta.duration_ms,
                frequency_hz: meta.hz,
                samples,
                dropped_samples: meta.dropped,
                pprof,
                error,
            }
        })
        .collect()
}

/// The set of `request`, and what was refused of it.
fn checked(request: &ContinuousRequest) -> Result<(Set, Vec<String>), String> {
    let window = Duration::from_millis(u64::from(request.window_ms));
    let period = Duration::from_millis(u64::from(request.period_ms));
    if window < MIN_WINDOW || period < window || period > MAX_PERIOD {
        return Err(format!(
            "expected a window of at least {MIN_WINDOW:?} and a period from the window to \
             {MAX_PERIOD:?}, found window_ms {} and period_ms {}",
            request.window_ms, request.period_ms
        ));
    }
    let max_profile_bytes = match request.max_profile_bytes {
        0 => MAX_PROFILE_BYTES,
        n => n.min(MAX_PROFILE_BYTES),
    };
    let mut refused = Vec::new();
    let mut lanes: BTreeMap<u32, Vec<Pod>> = BTreeMap::new();
    let mut count = 0;
    for pod in &request.pods {
        let Some(target) = pod.target.as_ref() else {
            refused.push("a pod without a target".to_string());
            continue;
        };
        let name = format!("{}/{}", target.namespace, target.pod_name);
        if target.pod_uid.trim().is_empty() || pod.policy_uids.is_empty() {
            refused.push(format!("{name}: empty pod UID or no policy"));
            continue;
        }
        if !(1..=MAX_FREQUENCY_HZ).contains(&pod.frequency_hz) {
            refused.push(format!(
                "{name}: frequency {} Hz is not within 1 to {MAX_FREQUENCY_HZ} Hz",
                pod.frequency_hz
            ));
            continue;
        }
        if count >= MAX_PODS {
            refused.push(format!(
                "{name}: the node profiles at most {MAX_PODS} pods always-on"
            ));
            continue;
        }
        if !lanes.contains_key(&pod.frequency_hz) && lanes.len() >= MAX_LANES {
            refused.push(format!(
                "{name}: the node runs at most {MAX_LANES} always-on frequencies"
            ));
            continue;
        }
        count += 1;
        lanes.entry(pod.frequency_hz).or_default().push(Pod {
            policy_uids: pod.policy_uids.clone(),
            target: target.clone(),
        });
    }
    refused.truncate(50);
    Ok((
        Set {
            lanes,
            window,
            period,
            max_profile_bytes,
        },
        refused,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use flamefleet_proto::agent::ContinuousPod;

    fn pod(name: &str, hz: u32) -> ContinuousPod {
        ContinuousPod {
            policy_uids: vec!["p1".into()],
            target: Some(Target {
                pod_uid: format!("uid-{name}"),
                namespace: "shop".into(),
                pod_name: name.into(),
                ..Target::default()
            }),
            frequency_hz: hz,
        }
    }

    #[test]
    fn a_set_is_checked_and_bounded() {
        let bad = ContinuousRequest {
            pods: vec![pod("a", 19)],
            window_ms: 20_000,
            period_ms: 19_000,
            max_profile_bytes: 0,
        };
        assert!(checked(&bad).unwrap_err().contains("period"));
        let mut pods: Vec<ContinuousPod> = (1..=6).map(|i| pod(&format!("p{i}"), i * 10)).collect();
        pods.push(pod("fast", 5000));
        pods.push(ContinuousPod {
            policy_uids: Vec::new(),
            ..pod("nobody", 19)
        });
        let (set, refused) = checked(&ContinuousRequest {
            pods,
            window_ms: 19_000,
            period_ms: 20_000,
            max_profile_bytes: 1 << 30,
        })
        .unwrap();
        assert_eq!(set.lanes.len(), MAX_LANES);
        assert_eq!(set.pods(), MAX_LANES);
        assert_eq!(set.max_profile_bytes, MAX_PROFILE_BYTES);
        assert_eq!(refused.len(), 4, "{refused:?}");
        assert!(refused.iter().any(|r| r.contains("frequencies")));
        assert!(refused.iter().any(|r| r.contains("5000 Hz")));
        assert!(refused.iter().any(|r| r.contains("no policy")));
    }
}
