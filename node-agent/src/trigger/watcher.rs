//! The watcher: one thread that waits on every watched cgroup's kernel events and ticks.
//!
//! What wakes it, per watched cgroup:
//! - `memory.events` (v2): the kernel notifies the file when a counter changes (`POLLPRI`);
//! - a v1 memory threshold and OOM notification (`cgroup.event_control` with an eventfd),
//!   which is how a hybrid host says "usage crossed N bytes" the moment it happens;
//! - the kernel's PSI triggers ([`super::psi`]);
//! - its tick (`WatcherConfig::tick`): `cpu.stat` (usage and throttling, which have no
//!   notification), the v1 counters without one, and the run-queue latency histogram the
//!   runqlat sampler keeps in BPF for cgroups with a latency trigger ([`super::runqlat`]);
//! - on a unified host, `memory.current`, which has no notification either: it is read at an
//!   interval that shrinks as usage nears the threshold (a quarter of the time the last
//!   growth rate needs to reach it, at least `memory_poll_min`), so a slow leak costs one read
//!   a tick and a fast one is still seen before the limit.
//!
//! Every event source is armed one-shot: after a wakeup it is re-armed no sooner than
//! `min_rearm`, and not before the cooldowns of every trigger it serves have ended, so a pod
//! that makes its counters change a million times a second costs at most one wakeup per
//! `min_rearm` per source. Fires go through [`super::cooldown`] and a bounded queue that
//! never blocks the thread (a full queue drops and counts).

use std::collections::HashMap;
use std::os::fd::{AsFd, AsRawFd as _, BorrowedFd};
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant, SystemTime};

use nix::sys::epoll::{Epoll, EpollCreateFlags, EpollEvent, EpollFlags};
use nix::sys::eventfd::{EfdFlags, EventFd};

use super::cooldown::{Cooldown, FireBudget};
use super::files::{
    self, Controller, CounterFile, Hierarchies, MemoryEvents, Throttling, pressure_some,
};
use super::psi::{self, PsiTrigger};
use super::runqlat::{self as latency, LatencyWatch};
use super::{Condition, Fire, Measurement, MemoryEvent, Result, TriggerError, TriggerSpec};
use crate::capture::Samplers;
use crate::cgroup::Cgroup;

const MIB: f64 = 1024.0 * 1024.0;
/// The epoll token of the watcher's own wakeup eventfd.
const WAKE: u64 = 0;

/// The watcher's bounds.
#[derive(Debug, Clone)]
pub struct WatcherConfig {
    /// Most cgroups watched at once (`serve --max-watched-cgroups`).
    pub max_watched: usize,
    /// How often the counters without notifications are read.
    pub tick: Duration,
    /// Least time between two wakeups by one event source.
    pub min_rearm: Duration,
    /// The fastest `memory.current` read interval of one cgroup (unified hosts).
    pub memory_poll_min: Duration,
    /// Least cooldown a trigger may ask for.
    pub min_cooldown: Duration,
    /// The node's budget of fires per minute, all cgroups together.
    pub fires_per_minute: u32,
    /// Fires queued for the consumer before new ones are dropped.
    pub queue: usize,
}

impl Default for WatcherConfig {
    fn default() -> Self {
        Self {
            max_watched: 1024,
            tick: Duration::from_secs(1),
            min_rearm: Duration::from_millis(50),
            memory_poll_min: Duration::from_millis(5),
            min_cooldown: Duration::from_secs(60),
            fires_per_minute: 30,
            queue: 64,
        }
    }
}

/// A cgroup to watch, with its triggers.
#[derive(Debug, Clone)]
pub struct WatchTarget {
    /// The caller's name for it (e.g. `namespace/pod/container`), carried by its fires.
    pub key: String,
    /// The cgroup v2 directory.
    pub cgroup: Cgroup,
    /// Its triggers.
    pub triggers: Vec<TriggerSpec>,
}

/// A watched cgroup's handle.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct WatchId(u64);

/// What the watcher did so far.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct WatcherStats {
    /// Cgroups watched now.
    pub watched: u64,
    /// Event-source wakeups handled.
    pub wakeups: u64,
    /// Counter files read.
    pub reads: u64,
    /// Fires sent.
    pub fires: u64,
    /// Times a condition held inside its cooldown.
    pub held_back: u64,
    /// Fires refused for the node's budget.
    pub refused: u64,
    /// Fires dropped because the queue was full.
    pub dropped: u64,
    /// Cgroups dropped because they were removed.
    pub gone: u64,
    /// Pressure triggers the kernel refused, read on the tick instead.
    pub psi_fallbacks: u64,
    /// v1 memory notifications that could not be registered (`cgroup.event_control` not
    /// writable, e.g. a read-only host cgroup mount): usage polled, OOM counters ticked.
    pub v1_notify_fallbacks: u64,
}

#[derive(Default)]
struct Counters {
    watched: AtomicU64,
    wakeups: AtomicU64,
    reads: AtomicU64,
    fires: AtomicU64,
    held_back: AtomicU64,
    refused: AtomicU64,
    dropped: AtomicU64,
    gone: AtomicU64,
    psi_fallbacks: AtomicU64,
    v1_notify_fallbacks: AtomicU64,
}

fn bump(c: &AtomicU64) {
    c.fetch_add(1, Ordering::Relaxed);
}

enum Command {
    Watch(WatchTarget, mpsc::SyncSender<Result<WatchId>>),
    Unwatch(WatchId),
    Stop,
}

/// The running watcher; dropping it stops the thread.
pub struct Watcher {
    commands: mpsc::Sender<Command>,
    wake: Arc<EventFd>,
    counters: Arc<Counters>,
    thread: Option<JoinHandle<()>>,
}

impl Watcher {
    /// Starts the thread; fires arrive on the returned receiver. Without samplers, latency
    /// triggers are refused ([`Self::start_with_samplers`]).
    pub fn start(
        hierarchies: Hierarchies,
        config: WatcherConfig,
    ) -> Result<(Self, mpsc::Receiver<Fire>)> {
        Self::start_with_samplers(hierarchies, config, None)
    }

    /// As [`Self::start`]; latency triggers count run-queue waits with `samplers`' runqlat
    /// sampler.
    pub fn start_with_samplers(
        hierarchies: Hierarchies,
        config: WatcherConfig,
        samplers: Option<Arc<Samplers>>,
    ) -> Result<(Self, mpsc::Receiver<Fire>)> {
        let sys = |what: &str, e: nix::Error| TriggerError::Watcher(format!("{what}: {e}"));
        let epoll =
            Epoll::new(EpollCreateFlags::EPOLL_CLOEXEC).map_err(|e| sys("epoll_create", e))?;
        let wake = Arc::new(
            EventFd::from_value_and_flags(0, EfdFlags::EFD_CLOEXEC | EfdFlags::EFD_NONBLOCK)
                .map_err(|e| sys("eventfd", e))?,
        );
        epoll
            .add(wake.as_fd(), EpollEvent::new(EpollFlags::EPOLLIN, WAKE))
            .map_err(|e| sys("epoll_ctl", e))?;
        let (fires_tx, fires_rx) = mpsc::sync_channel(config.queue.max(1));
        let (commands, commands_rx) = mpsc::channel();
        let counters = Arc::new(Counters::default());
        let now = Instant::now();
        let mut state = Loop {
            epoll,
            wake: wake.clone(),
            commands: commands_rx,
            budget: FireBudget::new(config.fires_per_minute, now),
            next_tick: now + config.tick,
            hierarchies,
            config,
            targets: HashMap::new(),
            sources: HashMap::new(),
            next_token: WAKE + 1,
            rearm: Vec::new(),
            fires: fires_tx,
            counters: counters.clone(),
            samplers,
        };
        let thread = std::thread::Builder::new()
            .name("trigger-watch".into())
            .spawn(move || state.run())
            .map_err(|e| TriggerError::Watcher(format!("spawning its thread: {e}")))?;
        Ok((
            Self {
                commands,
                wake,
                counters,
                thread: Some(thread),
            },
            fires_rx,
        ))
    }

    fn send(&self, command: Command) -> Result<()> {
        self.commands
            .send(command)
            .map_err(|_| TriggerError::Watcher("its thread has stopped".into()))?;
        let _ = self.wake.write(1);
        Ok(())
    }

    /// Watches `target`; fails when the node is at its cap, a trigger is invalid, or a
    /// condition needs a controller the cgroup lacks.
    pub fn watch(&self, target: WatchTarget) -> Result<WatchId> {
        let (tx, rx) = mpsc::sync_channel(1);
        self.send(Command::Watch(target, tx))?;
        rx.recv()
            .map_err(|_| TriggerError::Watcher("its thread has stopped".into()))?
    }

    /// Stops watching `id` (nothing when it is not watched).
    pub fn unwatch(&self, id: WatchId) {
        let _ = self.send(Command::Unwatch(id));
    }

    /// The counters so far.
    pub fn stats(&self) -> WatcherStats {
        let c = &self.counters;
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        WatcherStats {
            watched: get(&c.watched),
            wakeups: get(&c.wakeups),
            reads: get(&c.reads),
            fires: get(&c.fires),
            held_back: get(&c.held_back),
            refused: get(&c.refused),
            dropped: get(&c.dropped),
            gone: get(&c.gone),
            psi_fallbacks: get(&c.psi_fallbacks),
            v1_notify_fallbacks: get(&c.v1_notify_fallbacks),
        }
    }
}

impl Drop for Watcher {
    fn drop(&mut self) {
        let _ = self.send(Command::Stop);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// What an event source is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    /// v2 `memory.events`.
    MemoryEvents,
    /// A v1 usage threshold eventfd.
    Threshold,
    /// A v1 OOM eventfd.
    Oom,
    /// The PSI trigger of trigger `n`.
    Psi(usize),
}

enum SourceFd {
    /// The fd is the target's memory.events file.
    MemoryEvents,
    Event(EventFd),
    Psi(PsiTrigger),
}

struct Source {
    kind: Kind,
    fd: SourceFd,
}

/// The memory files of a watched cgroup.
struct MemoryFiles {
    v2: bool,
    dir: PathBuf,
    usage: CounterFile,
    limit: CounterFile,
    /// v2 memory.events, v1 memory.oom_control.
    events: CounterFile,
    /// v1 memory.failcnt.
    failcnt: Option<CounterFile>,
}

struct Armed {
    spec: TriggerSpec,
    cooldown: Cooldown,
    above_since: Option<Instant>,
    /// The PSI trigger was refused: read `some avg10` on the tick.
    psi_on_tick: bool,
}

struct Watched {
    id: u64,
    key: String,
    cgroup: Cgroup,
    memory: Option<MemoryFiles>,
    /// The v2 cpu.stat (usage; throttling too on a unified host).
    cpu_usage: Option<CounterFile>,
    /// Where the throttling counters are (v1 cpu.stat on a hybrid host).
    throttling: Option<CounterFile>,
    triggers: Vec<Armed>,
    sources: HashMap<u64, Source>,
    events_prev: Option<MemoryEvents>,
    /// OOM notifications counted from the v1 eventfd.
    v1_ooms: u64,
    cpu_prev: Option<(Instant, u64, Option<Throttling>)>,
    /// The limit the v1 threshold was registered for.
    threshold_for: Option<u64>,
    /// The v1 threshold could not be registered: usage is polled as on a unified host.
    threshold_polled: bool,
    /// The next `memory.current` read (unified hosts, memory-percent triggers).
    memory_poll: Option<Instant>,
    memory_last: Option<(Instant, u64)>,
    /// The run-queue waits (latency triggers).
    latency: Option<LatencyWatch>,
}

struct Loop {
    epoll: Epoll,
    wake: Arc<EventFd>,
    commands: mpsc::Receiver<Command>,
    hierarchies: Hierarchies,
    config: WatcherConfig,
    budget: FireBudget,
    next_tick: Instant,
    targets: HashMap<u64, Watched>,
    /// Token → target.
    sources: HashMap<u64, u64>,
    next_token: u64,
    /// (when, token, refresh the baseline first).
    rearm: Vec<(Instant, u64, bool)>,
    fires: mpsc::SyncSender<Fire>,
    counters: Arc<Counters>,
    /// The node's samplers: latency triggers count waits with their runqlat sampler.
    samplers: Option<Arc<Samplers>>,
}

impl Loop {
    fn run(&mut self) {
        let mut events = vec![EpollEvent::empty(); 64];
        loop {
            let now = Instant::now();
            let mut next = self.next_tick;
            for (at, _, _) in &self.rearm {
                next = next.min(*at);
            }
            for t in self.targets.values() {
                if let Some(at) = t.memory_poll {
                    next = next.min(at);
                }
            }
            let ms = next.saturating_duration_since(now).as_millis();
            // Round up, so a deadline 0.4 ms away does not spin.
            let ms = u16::try_from(ms + 1).unwrap_or(u16::MAX);
            let n = match self.epoll.wait(&mut events, ms) {
                Ok(n) => n,
                Err(nix::Error::EINTR) => 0,
                Err(e) => {
                    tracing::error!("trigger watcher: epoll_wait: {e}; stopping");
                    return;
                }
            };
            for ev in &events[..n] {
                let token = ev.data();
                if token == WAKE {
                    let _ = self.wake.read();
                    if !self.commands() {
                        return;
                    }
                } else {
                    self.on_event(token);
                }
            }
            let now = Instant::now();
            self.rearm_due(now);
            let polls: Vec<u64> = self
                .targets
                .iter()
                .filter(|(_, t)| t.memory_poll.is_some_and(|at| at <= now))
                .map(|(id, _)| *id)
                .collect();
            for id in polls {
                self.with_target(id, |l, t| l.memory_percent(t, now));
            }
            if now >= self.next_tick {
                self.next_tick = now + self.config.tick;
                let ids: Vec<u64> = self.targets.keys().copied().collect();
                for id in ids {
                    self.with_target(id, |l, t| l.tick(t, now));
                }
            }
        }
    }

    /// Handles queued commands; false on Stop.
    fn commands(&mut self) -> bool {
        while let Ok(cmd) = self.commands.try_recv() {
            match cmd {
                Command::Watch(target, reply) => {
                    let _ = reply.send(self.watch(target));
                }
                Command::Unwatch(WatchId(id)) => self.remove(id),
                Command::Stop => return false,
            }
        }
        true
    }

    fn watch(&mut self, target: WatchTarget) -> Result<WatchId> {
        if self.targets.len() >= self.config.max_watched {
            return Err(TriggerError::TooMany {
                max: self.config.max_watched,
            });
        }
        for t in &target.triggers {
            validate(t, self.config.min_cooldown)?;
        }
        let paths = self.hierarchies.files(&target.cgroup);
        let needs = |memory: bool| {
            target.triggers.iter().find(|t| match t.condition {
                Condition::MemoryAboveLimit { .. } | Condition::MemoryEvent(_) => memory,
                Condition::CpuThrottled { .. } => !memory,
                _ => false,
            })
        };
        let missing = |t: &TriggerSpec, controller| TriggerError::NoController {
            condition: t.condition.to_string(),
            controller,
            cgroup: target.cgroup.path.clone(),
        };
        let memory = match (needs(true), &paths.memory) {
            (None, _) => None,
            (Some(t), None) => return Err(missing(t, "memory")),
            (Some(_), Some(Controller::V2(dir))) => Some(MemoryFiles {
                v2: true,
                dir: dir.clone(),
                usage: CounterFile::open(dir.join("memory.current"))?,
                limit: CounterFile::open(dir.join("memory.max"))?,
                events: CounterFile::open(dir.join("memory.events"))?,
                failcnt: None,
            }),
            (Some(_), Some(Controller::V1(dir))) => Some(MemoryFiles {
                v2: false,
                dir: dir.clone(),
                usage: CounterFile::open(dir.join("memory.usage_in_bytes"))?,
                limit: CounterFile::open(dir.join("memory.limit_in_bytes"))?,
                events: CounterFile::open(dir.join("memory.oom_control"))?,
                failcnt: Some(CounterFile::open(dir.join("memory.failcnt"))?),
            }),
        };
        let cpu_usage = target
            .triggers
            .iter()
            .any(|t| matches!(t.condition, Condition::CpuAbove { .. }))
            .then(|| CounterFile::open(paths.v2.join("cpu.stat")))
            .transpose()?;
        let throttling = match (needs(false), &paths.cpu) {
            (None, _) => None,
            (Some(t), None) => return Err(missing(t, "cpu")),
            (Some(_), Some(Controller::V2(dir) | Controller::V1(dir))) => {
                Some(CounterFile::open(dir.join("cpu.stat"))?)
            }
        };
        let window = target
            .triggers
            .iter()
            .filter_map(|t| match t.condition {
                Condition::RunqlatP99 { window, .. } => Some(window),
                _ => None,
            })
            .max();
        let latency = match (window, &self.samplers) {
            (None, _) => None,
            (Some(_), None) => {
                return Err(TriggerError::Runqlat(
                    "this watcher was started without the node's samplers".into(),
                ));
            }
            (Some(window), Some(samplers)) => Some(LatencyWatch::start(
                samplers,
                &target.cgroup,
                window,
                self.config.tick,
                Instant::now(),
            )?),
        };
        let id = self.next_token;
        self.next_token += 1;
        let mut watched = Watched {
            id,
            key: target.key,
            cgroup: target.cgroup,
            memory,
            cpu_usage,
            throttling,
            triggers: target
                .triggers
                .into_iter()
                .map(|spec| Armed {
                    cooldown: Cooldown::new(spec.cooldown),
                    spec,
                    above_since: None,
                    psi_on_tick: false,
                })
                .collect(),
            sources: HashMap::new(),
            events_prev: None,
            v1_ooms: 0,
            cpu_prev: None,
            threshold_for: None,
            threshold_polled: false,
            memory_poll: None,
            memory_last: None,
            latency,
        };
        if let Err(e) = self.arm_sources(&mut watched) {
            for token in watched.sources.keys() {
                self.sources.remove(token);
            }
            return Err(e);
        }
        // Baselines: only what changes from now on fires.
        if let Some(m) = &watched.memory {
            watched.events_prev = Some(read_events(m, 0)?);
        }
        let now = Instant::now();
        if watched
            .triggers
            .iter()
            .any(|t| matches!(t.spec.condition, Condition::MemoryAboveLimit { .. }))
            && watched.memory.as_ref().is_some_and(|m| m.v2)
        {
            watched.memory_poll = Some(now);
        }
        self.targets.insert(id, watched);
        self.counters
            .watched
            .store(self.targets.len() as u64, Ordering::Relaxed);
        Ok(WatchId(id))
    }

    fn token(&mut self, target: u64) -> u64 {
        let token = self.next_token;
        self.next_token += 1;
        self.sources.insert(token, target);
        token
    }

    fn arm_sources(&mut self, w: &mut Watched) -> Result<()> {
        let id = w.id;
        let sys = |what: &str, e: nix::Error| TriggerError::Watcher(format!("{what}: {e}"));
        let oneshot = EpollFlags::EPOLLONESHOT;
        if let Some(m) = &w.memory {
            let wants_events = w
                .triggers
                .iter()
                .any(|t| matches!(t.spec.condition, Condition::MemoryEvent(_)));
            if m.v2 && wants_events {
                let token = self.token(id);
                self.epoll
                    .add(
                        m.events.file.as_fd(),
                        EpollEvent::new(EpollFlags::EPOLLPRI | oneshot, token),
                    )
                    .map_err(|e| sys("epoll_ctl memory.events", e))?;
                w.sources.insert(
                    token,
                    Source {
                        kind: Kind::MemoryEvents,
                        fd: SourceFd::MemoryEvents,
                    },
                );
            }
            if !m.v2 && wants_events {
                // Without the OOM notification (a read-only cgroup mount), the tick reads
                // memory.oom_control's oom_kill and memory.failcnt; only `oom` needs it.
                let efd = match register_v1(&m.dir, &m.events, None) {
                    Ok(efd) => efd,
                    Err(e) => {
                        tracing::info!("{e}; reading the v1 OOM counters on the tick instead");
                        bump(&self.counters.v1_notify_fallbacks);
                        return self.arm_rest(w);
                    }
                };
                let token = self.token(id);
                self.epoll
                    .add(
                        efd.as_fd(),
                        EpollEvent::new(EpollFlags::EPOLLIN | oneshot, token),
                    )
                    .map_err(|e| sys("epoll_ctl oom eventfd", e))?;
                w.sources.insert(
                    token,
                    Source {
                        kind: Kind::Oom,
                        fd: SourceFd::Event(efd),
                    },
                );
            }
        }
        self.arm_rest(w)
    }

    /// The v1 usage threshold and the PSI triggers.
    fn arm_rest(&mut self, w: &mut Watched) -> Result<()> {
        let id = w.id;
        let sys = |what: &str, e: nix::Error| TriggerError::Watcher(format!("{what}: {e}"));
        let oneshot = EpollFlags::EPOLLONESHOT;
        self.arm_threshold(w)?;
        let cgroup_dir = w.cgroup.path.clone();
        for (i, t) in w.triggers.iter_mut().enumerate() {
            let Condition::Pressure { resource, percent } = t.spec.condition else {
                continue;
            };
            match PsiTrigger::arm(cgroup_dir.join(resource.file()), percent, psi::WINDOW) {
                Ok(trigger) => {
                    let token = self.next_token;
                    self.next_token += 1;
                    self.sources.insert(token, id);
                    self.epoll
                        .add(
                            trigger.as_fd(),
                            EpollEvent::new(EpollFlags::EPOLLPRI | oneshot, token),
                        )
                        .map_err(|e| sys("epoll_ctl psi", e))?;
                    w.sources.insert(
                        token,
                        Source {
                            kind: Kind::Psi(i),
                            fd: SourceFd::Psi(trigger),
                        },
                    );
                }
                Err(e) => {
                    tracing::info!("{e}; reading some avg10 on the tick instead");
                    bump(&self.counters.psi_fallbacks);
                    t.psi_on_tick = true;
                }
            }
        }
        Ok(())
    }

    /// (Re-)registers the v1 usage threshold of the lowest memory-percent trigger at the
    /// current limit.
    fn arm_threshold(&mut self, w: &mut Watched) -> Result<()> {
        let id = w.id;
        if w.memory.as_ref().is_none_or(|m| m.v2) || w.threshold_polled {
            return Ok(());
        }
        let Some(percent) = w
            .triggers
            .iter()
            .filter_map(|t| match t.spec.condition {
                Condition::MemoryAboveLimit { percent } => Some(percent),
                _ => None,
            })
            .min()
        else {
            return Ok(());
        };
        let Some(m) = &w.memory else {
            return Ok(());
        };
        bump(&self.counters.reads);
        let limit = m.limit.parse(files::limit)?;
        if limit == w.threshold_for && w.sources.values().any(|s| s.kind == Kind::Threshold) {
            return Ok(());
        }
        // The old eventfd's close unregisters its threshold in the kernel.
        let old: Vec<u64> = w
            .sources
            .iter()
            .filter(|(_, s)| s.kind == Kind::Threshold)
            .map(|(t, _)| *t)
            .collect();
        for token in old {
            self.drop_source(w, token);
        }
        w.threshold_for = limit;
        let (Some(limit), Some(m)) = (limit, &w.memory) else {
            return Ok(());
        };
        let bytes = limit / 100 * u64::from(percent);
        let efd = match register_v1(&m.dir, &m.usage, Some(bytes)) {
            Ok(efd) => efd,
            Err(e) => {
                // A read-only cgroup mount: read usage at the adaptive interval of a unified
                // host instead (a quarter of the time the growth needs to reach the
                // threshold, at least `memory_poll_min`), never registering again.
                tracing::info!("{e}; polling memory.usage_in_bytes instead");
                bump(&self.counters.v1_notify_fallbacks);
                w.threshold_polled = true;
                w.memory_poll.get_or_insert_with(Instant::now);
                return Ok(());
            }
        };
        let token = self.token(id);
        self.epoll
            .add(
                efd.as_fd(),
                EpollEvent::new(EpollFlags::EPOLLIN | EpollFlags::EPOLLONESHOT, token),
            )
            .map_err(|e| TriggerError::Watcher(format!("epoll_ctl threshold eventfd: {e}")))?;
        w.sources.insert(
            token,
            Source {
                kind: Kind::Threshold,
                fd: SourceFd::Event(efd),
            },
        );
        Ok(())
    }

    fn drop_source(&mut self, w: &mut Watched, token: u64) {
        if let Some(s) = w.sources.remove(&token) {
            let _ = self.epoll.delete(source_fd(w, &s));
        }
        self.sources.remove(&token);
        self.rearm.retain(|(_, t, _)| *t != token);
    }

    fn remove(&mut self, id: u64) {
        if let Some(mut w) = self.targets.remove(&id) {
            let tokens: Vec<u64> = w.sources.keys().copied().collect();
            for token in tokens {
                self.drop_source(&mut w, token);
            }
        }
        self.counters
            .watched
            .store(self.targets.len() as u64, Ordering::Relaxed);
    }

    /// Runs `f` on target `id`; a target whose files fail to read was removed and is
    /// dropped.
    fn with_target(&mut self, id: u64, f: impl FnOnce(&mut Self, &mut Watched) -> Result<()>) {
        let Some(mut w) = self.targets.remove(&id) else {
            return;
        };
        match f(self, &mut w) {
            Ok(()) => {
                self.targets.insert(id, w);
            }
            Err(e) => {
                tracing::info!("trigger watcher: {}: {e}; no longer watched", w.key);
                bump(&self.counters.gone);
                self.targets.insert(id, w);
                self.remove(id);
            }
        }
    }

    fn on_event(&mut self, token: u64) {
        let Some(&id) = self.sources.get(&token) else {
            return;
        };
        bump(&self.counters.wakeups);
        let now = Instant::now();
        self.with_target(id, |l, w| {
            let Some(kind) = w.sources.get(&token).map(|s| s.kind) else {
                return Ok(());
            };
            match kind {
                Kind::MemoryEvents => l.memory_events(w, now)?,
                Kind::Oom => {
                    if let Some(Source {
                        fd: SourceFd::Event(efd),
                        ..
                    }) = w.sources.get(&token)
                    {
                        w.v1_ooms += efd.read().unwrap_or(0);
                    }
                    l.memory_events(w, now)?;
                }
                Kind::Threshold => {
                    if let Some(Source {
                        fd: SourceFd::Event(efd),
                        ..
                    }) = w.sources.get(&token)
                    {
                        let _ = efd.read();
                    }
                    l.memory_percent(w, now)?;
                }
                Kind::Psi(i) => l.pressure(w, i, now)?,
            }
            // Re-arm no sooner than min_rearm, and not before every trigger this source
            // serves has cooled down (nothing could fire before).
            let served: Vec<&Armed> = w
                .triggers
                .iter()
                .enumerate()
                .filter(|(i, t)| serves(kind, *i, &t.spec.condition))
                .map(|(_, t)| t)
                .collect();
            let cooling = served
                .iter()
                .map(|t| t.cooldown.ends(now))
                .collect::<Option<Vec<_>>>()
                .and_then(|ends| ends.into_iter().min());
            let at = match cooling {
                Some(end) if !served.is_empty() => end.max(now + l.config.min_rearm),
                _ => now + l.config.min_rearm,
            };
            l.rearm.push((at, token, cooling.is_some()));
            Ok(())
        });
    }

    fn rearm_due(&mut self, now: Instant) {
        let due: Vec<(Instant, u64, bool)> = self
            .rearm
            .iter()
            .copied()
            .filter(|(at, _, _)| *at <= now)
            .collect();
        self.rearm.retain(|(at, _, _)| *at > now);
        for (_, token, refresh) in due {
            let Some(&id) = self.sources.get(&token) else {
                continue;
            };
            self.with_target(id, |l, w| {
                let Some(kind) = w.sources.get(&token).map(|s| s.kind) else {
                    return Ok(());
                };
                if refresh && kind == Kind::MemoryEvents {
                    // What happened during the cooldown was held back, not owed.
                    if let Some(m) = &w.memory {
                        bump(&l.counters.reads);
                        w.events_prev = Some(read_events(m, w.v1_ooms)?);
                    }
                }
                let Some(source) = w.sources.get(&token) else {
                    return Ok(());
                };
                let flags = match kind {
                    Kind::MemoryEvents | Kind::Psi(_) => EpollFlags::EPOLLPRI,
                    Kind::Threshold | Kind::Oom => EpollFlags::EPOLLIN,
                } | EpollFlags::EPOLLONESHOT;
                let mut ev = EpollEvent::new(flags, token);
                l.epoll
                    .modify(source_fd(w, source), &mut ev)
                    .map_err(|e| TriggerError::Watcher(format!("re-arming: {e}")))
            });
        }
    }

    fn memory_events(&mut self, w: &mut Watched, now: Instant) -> Result<()> {
        let Some(m) = &w.memory else {
            return Ok(());
        };
        bump(&self.counters.reads);
        let events = read_events(m, w.v1_ooms)?;
        let prev = w.events_prev.replace(events).unwrap_or(events);
        for i in 0..w.triggers.len() {
            let Condition::MemoryEvent(kind) = w.triggers[i].spec.condition else {
                continue;
            };
            let (was, is) = match kind {
                MemoryEvent::High => (prev.high, events.high),
                MemoryEvent::Max => (prev.max, events.max),
                MemoryEvent::Oom => (prev.oom, events.oom),
                MemoryEvent::OomKill => (prev.oom_kill, events.oom_kill),
            };
            if is > was {
                let m = Measurement {
                    value: (is - was) as f64,
                    threshold: 1.0,
                    unit: " events",
                    detail: format!("{} went from {was} to {is}", kind.name()),
                };
                self.fire(w, i, m, now);
            }
        }
        // Near the limit, usage is worth a look too.
        if events.max > prev.max || events.high > prev.high {
            self.memory_percent(w, now)?;
        }
        Ok(())
    }

    fn memory_percent(&mut self, w: &mut Watched, now: Instant) -> Result<()> {
        let Some(m) = &w.memory else {
            return Ok(());
        };
        let (usage_name, limit_name) = if m.v2 {
            ("memory.current", "memory.max")
        } else {
            ("memory.usage_in_bytes", "memory.limit_in_bytes")
        };
        bump(&self.counters.reads);
        bump(&self.counters.reads);
        let usage = m.usage.parse(files::single)?;
        let limit = m.limit.parse(files::limit)?;
        let Some(limit) = limit.filter(|l| *l > 0) else {
            w.memory_poll = w.memory_poll.map(|_| now + self.config.tick);
            return Ok(());
        };
        let pct = usage as f64 * 100.0 / limit as f64;
        let mut lowest = f64::MAX;
        for i in 0..w.triggers.len() {
            let Condition::MemoryAboveLimit { percent } = w.triggers[i].spec.condition else {
                continue;
            };
            lowest = lowest.min(f64::from(percent));
            if pct >= f64::from(percent) {
                let measurement = Measurement {
                    value: pct,
                    threshold: f64::from(percent),
                    unit: "%",
                    detail: format!(
                        "{usage_name} {:.1} MiB of {limit_name} {:.1} MiB",
                        usage as f64 / MIB,
                        limit as f64 / MIB
                    ),
                };
                self.fire(w, i, measurement, now);
            }
        }
        if w.memory_poll.is_some() {
            // A quarter of the time the last growth rate needs to reach the threshold.
            let threshold = lowest / 100.0 * limit as f64;
            let rate = match w.memory_last {
                Some((at, before)) if usage > before => {
                    (usage - before) as f64 / now.saturating_duration_since(at).as_secs_f64()
                }
                _ => 0.0,
            };
            let tick = self.config.tick;
            let wait = if rate > 0.0 && (usage as f64) < threshold {
                Duration::from_secs_f64(((threshold - usage as f64) / rate / 4.0).min(3600.0))
            } else if (usage as f64) >= threshold {
                self.config.min_rearm
            } else {
                tick
            };
            let mut next = now + wait.clamp(self.config.memory_poll_min, tick);
            // While every memory-percent trigger cools down, nothing can fire before.
            let cooling = w
                .triggers
                .iter()
                .filter(|t| matches!(t.spec.condition, Condition::MemoryAboveLimit { .. }))
                .map(|t| t.cooldown.ends(now))
                .collect::<Option<Vec<_>>>()
                .and_then(|ends| ends.into_iter().min());
            if let Some(end) = cooling {
                next = next.max(end);
            }
            w.memory_poll = Some(next);
        }
        w.memory_last = Some((now, usage));
        Ok(())
    }

    fn pressure(&mut self, w: &mut Watched, i: usize, now: Instant) -> Result<()> {
        let Condition::Pressure { resource, percent } = w.triggers[i].spec.condition else {
            return Ok(());
        };
        let file = CounterFile::open(w.cgroup.path.join(resource.file()))?;
        bump(&self.counters.reads);
        let (avg10, total) = file.parse(pressure_some)?;
        let from_kernel = !w.triggers[i].psi_on_tick;
        if from_kernel || avg10 >= f64::from(percent) {
            let m = Measurement {
                value: avg10,
                threshold: f64::from(percent),
                unit: "%",
                detail: if from_kernel {
                    format!(
                        "kernel trigger {:?} fired; some avg10 {avg10:.2}%, total {total} µs",
                        psi::trigger_text(percent, psi::WINDOW)
                    )
                } else {
                    format!("some avg10 {avg10:.2}%, total {total} µs")
                },
            };
            self.fire(w, i, m, now);
        }
        Ok(())
    }

    fn tick(&mut self, w: &mut Watched, now: Instant) -> Result<()> {
        // Counters without notifications: v1 failcnt and oom_kill, CPU.
        if w.memory.as_ref().is_some_and(|m| !m.v2)
            && w.triggers
                .iter()
                .any(|t| matches!(t.spec.condition, Condition::MemoryEvent(_)))
        {
            self.memory_events(w, now)?;
        }
        if w.memory.as_ref().is_some_and(|m| !m.v2) {
            // A changed limit moves the threshold; usage is checked in case a notification
            // was missed while re-registering.
            self.arm_threshold(w)?;
            if w.triggers
                .iter()
                .any(|t| matches!(t.spec.condition, Condition::MemoryAboveLimit { .. }))
            {
                self.memory_percent(w, now)?;
            }
        }
        for i in 0..w.triggers.len() {
            if w.triggers[i].psi_on_tick {
                self.pressure(w, i, now)?;
            }
        }
        self.latency(w, now)?;
        self.cpu(w, now)
    }

    /// The p99 of each latency trigger's window, from the runqlat sampler's histogram.
    fn latency(&mut self, w: &mut Watched, now: Instant) -> Result<()> {
        let Some(watch) = w.latency.as_mut() else {
            return Ok(());
        };
        let mut judged = Vec::new();
        for (i, t) in w.triggers.iter().enumerate() {
            if let Condition::RunqlatP99 { micros, window } = t.spec.condition {
                bump(&self.counters.reads);
                judged.push((i, micros, watch.read(now, window)?));
            }
        }
        for (i, micros, waits) in judged {
            let count = waits.count();
            if count < latency::MIN_WAITS {
                continue;
            }
            let Some(p99) = waits.quantile_us(0.99) else {
                continue;
            };
            if p99 > f64::from(micros) {
                let p50 = waits.quantile_us(0.50).unwrap_or(0.0);
                let m = Measurement {
                    value: p99,
                    threshold: f64::from(micros),
                    unit: "µs",
                    detail: format!(
                        "p99 {p99:.0} µs, p50 {p50:.0} µs of {count} run-queue waits over the \
                         last {:.1} s",
                        waits.span.as_secs_f64()
                    ),
                };
                self.fire(w, i, m, now);
            }
        }
        Ok(())
    }

    fn cpu(&mut self, w: &mut Watched, now: Instant) -> Result<()> {
        if w.cpu_usage.is_none() && w.throttling.is_none() {
            return Ok(());
        }
        let usage = match &w.cpu_usage {
            Some(f) => {
                bump(&self.counters.reads);
                f.parse(|t| files::keyed(t, "usage_usec"))?
            }
            None => 0,
        };
        let throttling = match &w.throttling {
            Some(f) => {
                bump(&self.counters.reads);
                Some(f.parse(Throttling::parse)?)
            }
            None => None,
        };
        let Some((at, usage0, throttling0)) = w.cpu_prev.replace((now, usage, throttling)) else {
            return Ok(());
        };
        let wall = now.saturating_duration_since(at).as_secs_f64();
        if wall <= 0.0 {
            return Ok(());
        }
        let millicores = usage.saturating_sub(usage0) as f64 / 1000.0 / wall;
        for i in 0..w.triggers.len() {
            match w.triggers[i].spec.condition {
                Condition::CpuAbove {
                    millicores: limit,
                    sustained,
                } => {
                    if millicores > f64::from(limit) {
                        let since = *w.triggers[i].above_since.get_or_insert(at);
                        let held = now.saturating_duration_since(since);
                        if held >= sustained {
                            let m = Measurement {
                                value: millicores,
                                threshold: f64::from(limit),
                                unit: "m",
                                detail: format!(
                                    "{:.3} cores over the last {wall:.1} s, above {limit}m for \
                                     {:.1} s",
                                    millicores / 1000.0,
                                    held.as_secs_f64()
                                ),
                            };
                            self.fire(w, i, m, now);
                        }
                    } else {
                        w.triggers[i].above_since = None;
                    }
                }
                Condition::CpuThrottled { percent } => {
                    let (Some(t0), Some(t1)) = (throttling0, throttling) else {
                        continue;
                    };
                    let periods = t1.nr_periods.saturating_sub(t0.nr_periods);
                    let throttled = t1.nr_throttled.saturating_sub(t0.nr_throttled);
                    if periods == 0 {
                        continue;
                    }
                    let pct = throttled as f64 * 100.0 / periods as f64;
                    if pct >= f64::from(percent) {
                        let m = Measurement {
                            value: pct,
                            threshold: f64::from(percent),
                            unit: "%",
                            detail: format!(
                                "nr_throttled +{throttled} of nr_periods +{periods} in {wall:.1} \
                                 s, throttled {:.2} s per s",
                                t1.throttled_usec.saturating_sub(t0.throttled_usec) as f64
                                    / 1e6
                                    / wall
                            ),
                        };
                        self.fire(w, i, m, now);
                    }
                }
                _ => {}
            }
        }
        Ok(())
    }

    fn fire(&mut self, w: &mut Watched, i: usize, measurement: Measurement, now: Instant) {
        let t = &mut w.triggers[i];
        if !t.cooldown.allows(now) {
            bump(&self.counters.held_back);
            return;
        }
        if !self.budget.take(now) {
            bump(&self.counters.refused);
            return;
        }
        t.cooldown.fired(now);
        let fire = Fire {
            target: w.key.clone(),
            cgroup: w.cgroup.path.clone(),
            trigger: t.spec.name.clone(),
            condition: t.spec.condition,
            measurement,
            at: SystemTime::now(),
        };
        match self.fires.try_send(fire) {
            Ok(()) => bump(&self.counters.fires),
            Err(_) => bump(&self.counters.dropped),
        }
    }
}

/// Whether an event source of `kind` serves trigger `i` of `condition`.
fn serves(kind: Kind, i: usize, condition: &Condition) -> bool {
    match kind {
        Kind::MemoryEvents | Kind::Oom => matches!(condition, Condition::MemoryEvent(_)),
        Kind::Threshold => matches!(condition, Condition::MemoryAboveLimit { .. }),
        Kind::Psi(n) => n == i,
    }
}

fn source_fd<'a>(w: &'a Watched, s: &'a Source) -> BorrowedFd<'a> {
    match &s.fd {
        SourceFd::MemoryEvents => match &w.memory {
            Some(m) => m.events.file.as_fd(),
            // Never built without memory files.
            None => unreachable_fd(),
        },
        SourceFd::Event(e) => e.as_fd(),
        SourceFd::Psi(p) => p.as_fd(),
    }
}

/// A descriptor no syscall accepts, for the case that cannot happen.
fn unreachable_fd() -> BorrowedFd<'static> {
    // SAFETY: -1 is never a valid descriptor; the syscalls given it fail with EBADF.
    unsafe { BorrowedFd::borrow_raw(-1) }
}

/// The memory event counters: v2 `memory.events`; v1 `memory.oom_control`, the OOM
/// notifications counted so far and `memory.failcnt` as `max`.
fn read_events(m: &MemoryFiles, v1_ooms: u64) -> Result<MemoryEvents> {
    if m.v2 {
        return m.events.parse(MemoryEvents::parse_v2);
    }
    let mut e = m.events.parse(MemoryEvents::parse_v1_oom_control)?;
    e.oom = v1_ooms;
    if let Some(f) = &m.failcnt {
        e.max = f.parse(files::single)?;
    }
    Ok(e)
}

/// Registers a v1 notification in `dir/cgroup.event_control`: a usage threshold of
/// `bytes` on `file` (`memory.usage_in_bytes`), or the OOM notification of `file`
/// (`memory.oom_control`) when `bytes` is `None`.
fn register_v1(dir: &std::path::Path, file: &CounterFile, bytes: Option<u64>) -> Result<EventFd> {
    use std::io::Write as _;
    let path = dir.join("cgroup.event_control");
    let err = |source| TriggerError::EventControl {
        path: path.clone(),
        source,
    };
    let efd = EventFd::from_value_and_flags(0, EfdFlags::EFD_CLOEXEC | EfdFlags::EFD_NONBLOCK)
        .map_err(|e| err(e.into()))?;
    let line = match bytes {
        Some(b) => format!("{} {} {b}", efd.as_raw_fd(), file.file.as_raw_fd()),
        None => format!("{} {}", efd.as_raw_fd(), file.file.as_raw_fd()),
    };
    std::fs::OpenOptions::new()
        .write(true)
        .open(&path)
        .and_then(|mut f| f.write_all(line.as_bytes()))
        .map_err(err)?;
    Ok(efd)
}

fn validate(t: &TriggerSpec, min_cooldown: Duration) -> Result<()> {
    let invalid = |why: String| TriggerError::Invalid {
        name: t.name.clone(),
        why,
    };
    if t.cooldown < min_cooldown {
        return Err(invalid(format!(
            "cooldown {} is below the node's least cooldown {}",
            humantime::format_duration(t.cooldown),
            humantime::format_duration(min_cooldown)
        )));
    }
    let percent = match t.condition {
        Condition::MemoryAboveLimit { percent }
        | Condition::CpuThrottled { percent }
        | Condition::Pressure { percent, .. } => Some(percent),
        _ => None,
    };
    if let Some(p) = percent
        && !(1..=100).contains(&p)
    {
        return Err(invalid(format!(
            "expected a percentage of 1 to 100, found {p}"
        )));
    }
    if let Condition::RunqlatP99 { micros, window } = t.condition
        && (micros == 0 || window < Duration::from_secs(1))
    {
        return Err(invalid(format!(
            "expected a runqlat p99 above 0 µs over at least 1 s, found {micros} µs over {}",
            humantime::format_duration(window)
        )));
    }
    if let Condition::CpuAbove { millicores: 0, .. } = t.condition {
        return Err(invalid(
            "expected a CPU threshold above 0 millicores".into(),
        ));
    }
    Ok(())
}
