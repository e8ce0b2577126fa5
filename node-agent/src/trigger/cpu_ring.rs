//! The lead-up ring: recent CPU samples of the cgroups CPU and pressure triggers watch,
//! kept in the kernel so a fire's CPU profile covers the seconds before it
//! (docs/triggers.md, "The lead-up").
//!
//! `bpf/cpu_ring.bpf.c` runs on a perf event of every CPU at a low frequency (19 Hz by
//! default) while at least one cgroup is watched, and writes each sample of a watched
//! cgroup's task (its cgroup, thread, user and kernel stacks) into its CPU's ring of
//! `slots` fixed-size entries. At a fire, [`CpuRing::snapshot`] reads the fired cgroup's
//! entries from the lookback window.
//!
//! Bounded: `slots` entries of [`ENTRY_BYTES`] per possible CPU, whatever the number of
//! watched cgroups (a CPU takes at most `frequency` samples a second, so a ring of
//! `frequency × lookback` entries holds the lookback of a CPU busy with watched tasks the
//! whole time); a watched cgroup costs one 12-byte hash entry. No perf event is open while
//! nothing is watched.

use std::collections::HashMap;
use std::mem::MaybeUninit;
use std::os::fd::{AsFd as _, AsRawFd as _, OwnedFd};
use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use libbpf_rs::skel::{OpenSkel as _, SkelBuilder as _};
use libbpf_rs::{MapCore as _, MapFlags, MapHandle};

use crate::bpf::cpu_ring::CpuRingSkelBuilder;
use crate::bpf::cpu_ring::types::ring_entry;
use crate::bpf::from_bytes;
use crate::capture::perf_event::{self, PerfEventKind};
use crate::capture::{CaptureError, Result};

/// Bytes of one ring entry.
pub const ENTRY_BYTES: usize = std::mem::size_of::<ring_entry>();
/// Highest ring frequency accepted.
pub const MAX_FREQUENCY: u64 = 99;
/// Longest lookback accepted.
pub const MAX_LOOKBACK: Duration = Duration::from_secs(30);
/// Most entries per CPU.
const MAX_SLOTS: u32 = 4096;

/// `PERF_EVENT_IOC_SET_BPF` of linux/perf_event.h (`_IOW('$', 8, __u32)`).
const PERF_EVENT_IOC_SET_BPF: libc::c_ulong = 0x4004_2408;

/// How the ring samples and how far back it holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RingConfig {
    /// Samples per second on each CPU (`serve --trigger-lead-up-hz`).
    pub frequency: u64,
    /// How far before a fire the snapshot reaches (`serve --trigger-lead-up`).
    pub lookback: Duration,
    /// Most cgroups watched (the watcher's cap).
    pub max_cgroups: u32,
    /// Also keep kernel stacks.
    pub kernel_stacks: bool,
}

impl Default for RingConfig {
    fn default() -> Self {
        Self {
            frequency: 19,
            lookback: Duration::from_secs(10),
            max_cgroups: 1024,
            kernel_stacks: true,
        }
    }
}

impl RingConfig {
    /// Entries per CPU: the lookback at the frequency with a quarter to spare, rounded up
    /// to a power of two.
    pub fn slots(&self) -> u32 {
        let want = (self.frequency as f64 * self.lookback.as_secs_f64() * 1.25).ceil() as u32;
        want.clamp(8, MAX_SLOTS).next_power_of_two()
    }

    /// The ring's bytes on a node of `cpus` possible CPUs.
    pub fn ring_bytes(&self, cpus: usize) -> usize {
        cpus * self.slots() as usize * ENTRY_BYTES
    }

    /// Checks the bounds.
    pub fn validate(&self) -> std::result::Result<(), String> {
        if !(1..=MAX_FREQUENCY).contains(&self.frequency) {
            return Err(format!(
                "the lead-up ring's frequency must be 1 to {MAX_FREQUENCY} Hz, found {}",
                self.frequency
            ));
        }
        if self.lookback.is_zero() || self.lookback > MAX_LOOKBACK {
            return Err(format!(
                "the lead-up must be more than 0 s and at most {} s, found {:?}",
                MAX_LOOKBACK.as_secs(),
                self.lookback
            ));
        }
        Ok(())
    }
}

/// One sample of the lead-up.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RingSample {
    /// How long before the fire it was taken (negative: between the fire and the
    /// snapshot).
    pub before_fire_ns: i64,
    /// Process ID.
    pub tgid: u32,
    /// Thread ID.
    pub pid: u32,
    /// Thread name.
    pub comm: String,
    /// User stack, leaf first.
    pub user_stack: Vec<u64>,
    /// Kernel stack, leaf first.
    pub kernel_stack: Vec<u64>,
}

/// What a snapshot read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Snapshot {
    /// The cgroup's samples from the lookback window, oldest first.
    pub samples: Vec<RingSample>,
    /// Entries skipped because they were being rewritten while read.
    pub torn: u64,
    /// Whether some CPU's ring had wrapped past the window's start (its oldest kept sample
    /// is younger than the lookback): that CPU's lead-up is shorter than asked.
    pub wrapped: bool,
}

impl Snapshot {
    /// Seconds between the oldest sample and the fire (0 without samples).
    pub fn covered(&self) -> Duration {
        self.samples
            .iter()
            .map(|s| s.before_fire_ns)
            .max()
            .map_or(Duration::ZERO, |ns| {
                Duration::from_nanos(u64::try_from(ns).unwrap_or(0))
            })
    }

    /// Bytes it holds (for the spool's bound).
    pub fn bytes(&self) -> usize {
        self.samples
            .iter()
            .map(|s| 48 + s.comm.len() + 8 * (s.user_stack.len() + s.kernel_stack.len()))
            .sum()
    }
}

struct State {
    /// Watched cgroup ID → how many watch entries want it.
    refs: HashMap<u64, usize>,
    /// The perf events, open while something is watched.
    perf: Vec<OwnedFd>,
}

/// The loaded ring. Share it behind an `Arc`.
pub struct CpuRing {
    config: RingConfig,
    slots: u32,
    possible_cpus: usize,
    online: Vec<u32>,
    program: OwnedFd,
    watched: MapHandle,
    ring: MapHandle,
    state: Mutex<State>,
}

impl std::fmt::Debug for CpuRing {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CpuRing")
            .field("config", &self.config)
            .field("slots", &self.slots)
            .finish_non_exhaustive()
    }
}

impl CpuRing {
    /// Loads the ring's program and maps (no perf event yet).
    pub fn start(config: RingConfig) -> Result<Self> {
        config.validate().map_err(CaptureError::InvalidOptions)?;
        crate::capture::check_btf()?;
        let online = perf_event::online_cpus()?;
        let possible_cpus = libbpf_rs::num_possible_cpus()
            .map_err(|e| CaptureError::bpf("counting the possible CPUs for the lead-up ring", e))?;
        let slots = config.slots();
        let mut object = MaybeUninit::uninit();
        let mut open = CpuRingSkelBuilder::default()
            .open(&mut object)
            .map_err(|e| CaptureError::bpf("opening the lead-up ring BPF object", e))?;
        if let Some(ro) = open.maps.rodata_data.as_deref_mut() {
            ro.ring_slots = slots;
            ro.ring_kernel_stacks = config.kernel_stacks;
        }
        let entries = u32::try_from(possible_cpus)
            .ok()
            .and_then(|c| c.checked_mul(slots))
            .ok_or_else(|| {
                CaptureError::InvalidOptions(format!(
                    "a lead-up ring of {slots} entries on each of {possible_cpus} CPUs is too large"
                ))
            })?;
        open.maps
            .ring
            .set_max_entries(entries)
            .map_err(|e| CaptureError::bpf("sizing the lead-up ring", e))?;
        open.maps
            .watched
            .set_max_entries(config.max_cgroups.max(1))
            .map_err(|e| CaptureError::bpf("sizing the lead-up ring's watched cgroups", e))?;
        let skel = CaptureError::load("loading the lead-up ring BPF program", || open.load())?;
        let program = skel
            .progs
            .on_ring_sample
            .as_fd()
            .try_clone_to_owned()
            .map_err(|source| CaptureError::Io {
                action: "duplicating the lead-up ring program's fd".into(),
                source,
            })?;
        let watched = CaptureError::map_handle(&skel.maps.watched, "watched")?;
        let ring = CaptureError::map_handle(&skel.maps.ring, "ring")?;
        tracing::info!(
            slots,
            possible_cpus,
            bytes = config.ring_bytes(possible_cpus),
            hz = config.frequency,
            "lead-up ring loaded"
        );
        Ok(Self {
            config,
            slots,
            possible_cpus,
            online,
            program,
            watched,
            ring,
            state: Mutex::new(State {
                refs: HashMap::new(),
                perf: Vec::new(),
            }),
        })
    }

    /// Its configuration.
    pub fn config(&self) -> RingConfig {
        self.config
    }

    /// Entries per CPU.
    pub fn slots(&self) -> u32 {
        self.slots
    }

    /// The ring's bytes in kernel memory.
    pub fn ring_bytes(&self) -> usize {
        self.config.ring_bytes(self.possible_cpus)
    }

    /// Cgroups watched now.
    pub fn watched(&self) -> usize {
        self.lock().refs.len()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Keeps samples of cgroup `id` (and of its cgroups up to three levels down) from now
    /// on; opens the perf events with the first cgroup. Counted: as many
    /// [`Self::unwatch`] as calls stop it.
    pub fn watch(&self, id: u64) -> Result<()> {
        let mut state = self.lock();
        if let Some(n) = state.refs.get_mut(&id) {
            *n += 1;
            return Ok(());
        }
        self.watched
            .update(&id.to_ne_bytes(), &1u32.to_ne_bytes(), MapFlags::ANY)
            .map_err(|e| CaptureError::bpf("adding a cgroup to the lead-up ring", e))?;
        state.refs.insert(id, 1);
        if state.perf.is_empty()
            && let Err(e) = self.attach(&mut state.perf)
        {
            state.refs.remove(&id);
            let _ = self.watched.delete(&id.to_ne_bytes());
            return Err(e);
        }
        Ok(())
    }

    /// Undoes one [`Self::watch`] of `id`; the last cgroup closes the perf events.
    pub fn unwatch(&self, id: u64) {
        let mut state = self.lock();
        let Some(n) = state.refs.get_mut(&id) else {
            return;
        };
        *n -= 1;
        if *n > 0 {
            return;
        }
        state.refs.remove(&id);
        if let Err(e) = self.watched.delete(&id.to_ne_bytes()) {
            tracing::warn!(cgroup = id, "removing a cgroup from the lead-up ring: {e}");
        }
        if state.refs.is_empty() {
            state.perf.clear();
        }
    }

    fn attach(&self, perf: &mut Vec<OwnedFd>) -> Result<()> {
        for &cpu in &self.online {
            let fd = perf_event::open(PerfEventKind::CpuClock, cpu, self.config.frequency)?;
            // SAFETY: both descriptors are open and ours; the ioctl takes the program fd by
            // value.
            let rc = unsafe {
                libc::ioctl(
                    fd.as_raw_fd(),
                    PERF_EVENT_IOC_SET_BPF as _,
                    self.program.as_raw_fd(),
                )
            };
            if rc != 0 {
                perf.clear();
                return Err(CaptureError::Io {
                    action: format!("attaching the lead-up ring to the perf event of CPU {cpu}"),
                    source: std::io::Error::last_os_error(),
                });
            }
            perf.push(fd);
        }
        Ok(())
    }

    /// The samples of cgroup `id` taken from `lookback` before `fired_ago` ago until now,
    /// their times relative to the fire (`fired_ago` before now).
    pub fn snapshot(&self, id: u64, fired_ago: Duration, lookback: Duration) -> Snapshot {
        let now = monotonic_ns();
        let fired = now.saturating_sub(nanos(fired_ago));
        let from = fired.saturating_sub(nanos(lookback));
        let mut out = Snapshot {
            samples: Vec::new(),
            torn: 0,
            wrapped: false,
        };
        let mut stamps: Vec<(u64, RingSample)> = Vec::new();
        for cpu in 0..self.possible_cpus {
            let mut oldest = u64::MAX;
            let mut full = true;
            for slot in 0..self.slots {
                let idx = cpu as u32 * self.slots + slot;
                let Ok(Some(raw)) = self.ring.lookup(&idx.to_ne_bytes(), MapFlags::ANY) else {
                    full = false;
                    continue;
                };
                let Some(e) = from_bytes::<ring_entry>(&raw) else {
                    full = false;
                    continue;
                };
                if e.stamp == 0 {
                    full = false;
                    continue;
                }
                if e.done != e.stamp {
                    out.torn += 1;
                    continue;
                }
                oldest = oldest.min(e.stamp);
                if e.cgroup != id || e.stamp < from || e.stamp > now {
                    continue;
                }
                let frames = |pcs: &[u64], bytes: u32| -> Vec<u64> {
                    let n = (bytes as usize / 8).min(pcs.len());
                    pcs[..n].iter().copied().take_while(|&pc| pc != 0).collect()
                };
                stamps.push((
                    e.stamp,
                    RingSample {
                        before_fire_ns: i64::try_from(fired).unwrap_or(i64::MAX)
                            - i64::try_from(e.stamp).unwrap_or(i64::MAX),
                        tgid: e.tgid,
                        pid: e.pid,
                        comm: crate::capture::comm_string(&e.comm),
                        user_stack: frames(&e.user, e.user_bytes),
                        kernel_stack: frames(&e.kernel, e.kernel_bytes),
                    },
                ));
            }
            if full && oldest > from {
                out.wrapped = true;
            }
        }
        stamps.sort_by_key(|(stamp, _)| *stamp);
        out.samples = stamps.into_iter().map(|(_, s)| s).collect();
        out
    }
}

fn nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

/// CLOCK_MONOTONIC now, in ns: the clock of `bpf_ktime_get_ns`.
fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: valid pointer to a timespec.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    u64::try_from(ts.tv_sec).unwrap_or(0) * 1_000_000_000 + u64::try_from(ts.tv_nsec).unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_ring_holds_the_lookback_of_a_busy_cpu_with_room() {
        let c = RingConfig::default();
        assert_eq!(ENTRY_BYTES, 440);
        assert_eq!(c.slots(), 256, "19 Hz x 10 s x 1.25 = 238 -> 256");
        assert_eq!(c.ring_bytes(2), 2 * 256 * 440);
        assert!(c.validate().is_ok());
        let fast = RingConfig {
            frequency: 99,
            lookback: MAX_LOOKBACK,
            ..c
        };
        assert_eq!(fast.slots(), MAX_SLOTS);
        assert!(RingConfig { frequency: 0, ..c }.validate().is_err());
        assert!(
            RingConfig {
                lookback: Duration::from_secs(31),
                ..c
            }
            .validate()
            .is_err()
        );
    }
}
