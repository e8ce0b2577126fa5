//! Triggered captures, the node's half: watch conditions of pods' cgroups and fire.
//!
//! The agent watches the cgroups of the pods a policy's triggers select, from the files
//! the kernel keeps for them (never by polling the API server), and when a condition
//! holds it fires a [`Fire`] carrying the condition, its threshold and the measured value.
//! What a fire starts is the caller's: for a memory trigger the Go heap is read at once
//! ([`heap_now`]), because the round trip to the API server loses the race with the OOM
//! killer. `docs/triggers.md` describes the whole design.
//!
//! - [`files`]: where a cgroup's counters live (unified or hybrid host) and their parsers;
//! - [`psi`]: the kernel's PSI triggers;
//! - [`runqlat`]: the run-queue latency of a watched cgroup, from the node's runqlat sampler;
//! - [`cooldown`]: the cooldown per (cgroup, trigger) and the node's fire budget;
//! - [`watcher`]: the one thread that waits on every watched cgroup's events and ticks;
//! - [`heap_now`]: the heap capture a memory fire starts on the node;
//! - [`fire_heaps`]: where those heaps wait for the fire's run;
//! - [`cpu_ring`]: the in-kernel ring of recent CPU samples of the cgroups CPU and pressure
//!   triggers watch (the lead-up of their fires' CPU profiles);
//! - [`fire_lead_ups`]: where a fire's lead-up waits for the fire's run.

pub mod cooldown;
pub mod cpu_ring;
pub mod files;
pub mod fire_heaps;
pub mod fire_lead_ups;
pub mod heap_now;
pub mod psi;
pub mod runqlat;
pub mod watcher;

use std::fmt;
use std::path::PathBuf;
use std::time::{Duration, SystemTime};

pub use psi::PsiResource;
pub use watcher::{WatchId, WatchTarget, Watcher, WatcherConfig, WatcherStats};

/// A counter of `memory.events` whose increment fires.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum MemoryEvent {
    /// Usage went over `memory.high` (v2 only).
    High,
    /// Usage hit the limit and the kernel reclaimed (v2 `max`; v1 `memory.failcnt`,
    /// read on the tick: v1 has no notification for it).
    Max,
    /// The cgroup went out of memory.
    Oom,
    /// The OOM killer killed a process of the cgroup.
    OomKill,
}

impl MemoryEvent {
    /// The counter's name in `memory.events`.
    pub fn name(self) -> &'static str {
        match self {
            Self::High => "high",
            Self::Max => "max",
            Self::Oom => "oom",
            Self::OomKill => "oom_kill",
        }
    }
}

/// A condition of one cgroup.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Condition {
    /// Memory usage at or above `percent` of the cgroup's limit (no limit: never).
    MemoryAboveLimit {
        /// 1..=100.
        percent: u8,
    },
    /// An increment of a `memory.events` counter.
    MemoryEvent(MemoryEvent),
    /// At least `percent` of the CFS periods since the last tick were throttled.
    CpuThrottled {
        /// 1..=100.
        percent: u8,
    },
    /// CPU usage above `millicores` for at least `sustained`.
    CpuAbove {
        /// Thousandths of a core.
        millicores: u32,
        /// How long usage must stay above.
        sustained: Duration,
    },
    /// Tasks of the cgroup stalled on `resource` at least `percent` of a 10 s window
    /// (what `some avg10` measures).
    Pressure {
        /// CPU, memory or I/O.
        resource: PsiResource,
        /// 1..=100.
        percent: u8,
    },
    /// The 99th percentile of the cgroup's run-queue waits over the last `window` above
    /// `micros` (at least [`runqlat::MIN_WAITS`] waits in the window).
    RunqlatP99 {
        /// Microseconds.
        micros: u32,
        /// The sliding window.
        window: Duration,
    },
}

impl Condition {
    /// Whether it is a memory condition (its fire reads the heap at once).
    pub fn is_memory(&self) -> bool {
        matches!(
            self,
            Self::MemoryAboveLimit { .. }
                | Self::MemoryEvent(_)
                | Self::Pressure {
                    resource: PsiResource::Memory,
                    ..
                }
        )
    }
}

impl fmt::Display for Condition {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::MemoryAboveLimit { percent } => write!(f, "memory above {percent}% of limit"),
            Self::MemoryEvent(e) => write!(f, "memory.events {} increment", e.name()),
            Self::CpuThrottled { percent } => write!(f, "CPU throttled in {percent}% of periods"),
            Self::CpuAbove {
                millicores,
                sustained,
            } => write!(
                f,
                "CPU above {millicores}m for {}",
                humantime::format_duration(*sustained)
            ),
            Self::Pressure { resource, percent } => {
                write!(f, "{} some avg10 above {percent}%", resource.file())
            }
            Self::RunqlatP99 { micros, window } => write!(
                f,
                "runqlat p99 above {micros}µs over {}",
                humantime::format_duration(*window)
            ),
        }
    }
}

/// One trigger on a watched cgroup.
#[derive(Debug, Clone, PartialEq)]
pub struct TriggerSpec {
    /// The trigger's name (the policy's `triggers[].name`).
    pub name: String,
    /// What fires it.
    pub condition: Condition,
    /// Least time between two fires of this trigger on this cgroup.
    pub cooldown: Duration,
}

/// What was measured when a trigger fired.
#[derive(Debug, Clone, PartialEq)]
pub struct Measurement {
    /// The measured value, in the unit of the threshold.
    pub value: f64,
    /// The threshold it crossed.
    pub threshold: f64,
    /// `%`, `m` (millicores), `events`, `µs`.
    pub unit: &'static str,
    /// The raw numbers behind it (e.g. `memory.current 190 MiB of memory.max 256 MiB`).
    pub detail: String,
}

/// A trigger fired on a cgroup.
#[derive(Debug, Clone, PartialEq)]
pub struct Fire {
    /// The watched target (the caller's key, e.g. `namespace/pod/container`).
    pub target: String,
    /// The cgroup v2 directory.
    pub cgroup: PathBuf,
    /// The trigger's name.
    pub trigger: String,
    /// Its condition.
    pub condition: Condition,
    /// The measured value and threshold.
    pub measurement: Measurement,
    /// When the watcher saw it.
    pub at: SystemTime,
}

impl fmt::Display for Fire {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let m = &self.measurement;
        write!(
            f,
            "{} on {}: {} (measured {:.1}{}, threshold {:.1}{}; {})",
            self.trigger,
            self.target,
            self.condition,
            m.value,
            m.unit,
            m.threshold,
            m.unit,
            m.detail
        )
    }
}

/// Why a cgroup cannot be watched. Each message says what to do.
#[derive(Debug, thiserror::Error)]
pub enum TriggerError {
    /// The node watches as many cgroups as it may.
    #[error(
        "the node already watches {max} cgroups, its cap (serve --max-watched-cgroups); \
         narrow the policies' selectors or raise the cap"
    )]
    TooMany {
        /// The cap.
        max: usize,
    },
    /// The condition needs a controller the cgroup does not have.
    #[error(
        "{condition} needs the {controller} controller, but {cgroup} has none in cgroup v2 \
         or in a v1 hierarchy; give the pod a {controller} limit"
    )]
    NoController {
        /// The condition.
        condition: String,
        /// `memory` or `cpu`.
        controller: &'static str,
        /// The cgroup.
        cgroup: PathBuf,
    },
    /// A trigger's value is out of range.
    #[error("trigger {name}: {why}")]
    Invalid {
        /// The trigger.
        name: String,
        /// What was expected.
        why: String,
    },
    /// A counter file could not be opened.
    #[error("opening {path}: {source}; expected a cgroup counter file the agent can read")]
    Open {
        /// The file.
        path: PathBuf,
        /// The error.
        source: std::io::Error,
    },
    /// A counter file could not be read (the cgroup was removed).
    #[error("reading {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// The error.
        source: std::io::Error,
    },
    /// A counter file holds something unexpected.
    #[error("{path}: expected the kernel's counters, found {found:?}")]
    Parse {
        /// The file.
        path: PathBuf,
        /// The start of what was read.
        found: String,
    },
    /// The kernel refused a PSI trigger.
    #[error(
        "arming PSI trigger {text:?} on {path}: {source}; PSI triggers need Linux ≥ 5.2 with \
         psi=1, write access to the file, and CAP_SYS_RESOURCE for windows that are not \
         multiples of 2 s (or Linux < 6.5)"
    )]
    Psi {
        /// The pressure file.
        path: PathBuf,
        /// The trigger written.
        text: String,
        /// The error.
        source: std::io::Error,
    },
    /// A v1 memory threshold notification could not be registered.
    #[error("registering a memory notification in {path}: {source}")]
    EventControl {
        /// The `cgroup.event_control` file.
        path: PathBuf,
        /// The error.
        source: std::io::Error,
    },
    /// The run-queue latency of a cgroup cannot be counted.
    #[error(
        "counting run-queue latency with the node's runqlat sampler: {0}; latency triggers \
         need what runqlat captures need (BTF, CAP_BPF and CAP_PERFMON)"
    )]
    Runqlat(String),
    /// The watcher's thread or kernel objects.
    #[error("trigger watcher: {0}")]
    Watcher(String),
}

/// Result of this module.
pub type Result<T, E = TriggerError> = std::result::Result<T, E>;
