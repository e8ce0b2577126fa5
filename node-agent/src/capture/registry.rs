//! One sampler per profile type per node (CPU, runqlat, eBPF heap, off-CPU), shared by concurrent
//! captures, all sized by the node's [`SamplerConfig`] and feeding one process catalog.
//!
//! The registry holds weak references: the first capture of a type starts
//! the sampler, later ones join it, and when the last capture of a type
//! ends the sampler stops (detaching its programs and freeing its maps, so
//! an idle node pays nothing).
//!
//! The CPU sampler is the exception, in part: its last capture closes its perf events
//! (nothing samples any more), but the registry keeps the loaded program for
//! `SamplerConfig::cpu_sampler_linger` (30 s by default) so that a capture following soon
//! after with the same options skips the load, a fraction of a second of verifier time
//! per capture that sequential requests and scheduled policies would otherwise pay each
//! time. Its maps stay allocated meanwhile; `0s` turns this off.
//!
//! Under continuous use captures overlap and a sampler would never stop, so
//! a sampler also has a bounded life: when it has handed out all its target
//! indices, the next capture starts a fresh sampler and the old one stops
//! once its last capture ends. Every kernel map is thereby bounded in size
//! *and* in lifetime.

use std::sync::{Arc, Condvar, Mutex, PoisonError, Weak};
use std::time::Duration;

use super::cpu::{CpuCapture, CpuOptions, CpuSampler};
use super::heap::ebpf::EbpfHeapOptions;
use super::heap::ebpf::sampler::{HeapSampler, JoinedCapture};
use super::offcpu::{OffcpuCapture, OffcpuOptions, OffcpuSampler};
use super::runqlat::{RunqlatCapture, RunqlatOptions, RunqlatSampler};
use super::{CaptureError, CaptureTarget, Result, SamplerConfig};
use crate::process::ProcessCatalog;

/// The node's samplers. Thread-safe; share it behind an `Arc`.
#[derive(Debug, Default)]
pub struct Samplers {
    config: SamplerConfig,
    catalog: ProcessCatalog,
    cpu: Mutex<Weak<CpuSampler>>,
    runqlat: Mutex<Weak<RunqlatSampler>>,
    heap: Mutex<Weak<HeapSampler>>,
    offcpu: Mutex<Weak<OffcpuSampler>>,
    /// Keeps the last CPU sampler loaded for a while after its last capture.
    cpu_linger: LingerSlot,
}

/// Owns the [`Linger`]: dropping the registry unloads the kept sampler and ends the
/// thread.
#[derive(Debug, Default)]
struct LingerSlot(Arc<Linger>);

impl Drop for LingerSlot {
    fn drop(&mut self) {
        let kept = {
            let mut state = self.0.lock();
            state.stop = true;
            state.sampler.take()
        };
        self.0.changed.notify_all();
        drop(kept);
    }
}

/// The idle CPU sampler kept loaded, and the thread that unloads it when it has been idle
/// for the linger period (spawned with the first sampler kept; it sleeps on a condition
/// variable, with no periodic wakeups while nothing is kept).
#[derive(Debug, Default)]
struct Linger {
    state: Mutex<LingerState>,
    changed: Condvar,
}

#[derive(Debug, Default)]
struct LingerState {
    sampler: Option<Arc<CpuSampler>>,
    reaper: bool,
    stop: bool,
}

impl Linger {
    fn lock(&self) -> std::sync::MutexGuard<'_, LingerState> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Keeps `sampler` (replacing the one kept before) until it has been idle for
    /// `period`.
    fn keep(self: &Arc<Self>, sampler: &Arc<CpuSampler>, period: Duration) {
        if period.is_zero() {
            return;
        }
        let replaced = {
            let mut state = self.lock();
            if state.stop {
                return;
            }
            if !state.reaper {
                let me = self.clone();
                let spawned = std::thread::Builder::new()
                    .name("ff-cpu-linger".into())
                    .spawn(move || me.reap(period));
                match spawned {
                    Ok(_) => state.reaper = true,
                    Err(e) => {
                        tracing::warn!("not keeping the CPU sampler loaded: {e}");
                        return;
                    }
                }
            }
            match &state.sampler {
                Some(kept) if Arc::ptr_eq(kept, sampler) => None,
                _ => state.sampler.replace(sampler.clone()),
            }
        };
        self.changed.notify_all();
        // A replaced sampler may stop here (joining its thread): outside the lock.
        drop(replaced);
    }

    fn reap(&self, period: Duration) {
        let mut state = self.lock();
        loop {
            if state.stop {
                return;
            }
            let wait = match state.sampler.as_ref().map(|s| s.idle_for()) {
                None => None,
                Some(Some(idle)) if idle >= period => {
                    let expired = state.sampler.take();
                    drop(state);
                    tracing::debug!("cpu sampler idle for {period:?}: unloading it");
                    drop(expired);
                    state = self.lock();
                    continue;
                }
                Some(Some(idle)) => Some(period - idle),
                // A capture runs: look again a period later at the latest.
                Some(None) => Some(period),
            };
            state = match wait {
                None => self
                    .changed
                    .wait(state)
                    .unwrap_or_else(PoisonError::into_inner),
                Some(d) => {
                    self.changed
                        .wait_timeout(state, d)
                        .unwrap_or_else(PoisonError::into_inner)
                        .0
                }
            };
        }
    }
}

impl Samplers {
    /// A registry with no sampler running yet.
    pub fn new(config: SamplerConfig) -> Self {
        Self {
            config,
            ..Self::default()
        }
    }

    /// A registry with no sampler running yet, whose samplers feed `catalog` (one the node's
    /// own registry shares: the always-on windows' samplers, [`crate::continuous`]).
    pub fn with_catalog(config: SamplerConfig, catalog: ProcessCatalog) -> Self {
        Self {
            config,
            catalog,
            ..Self::default()
        }
    }

    /// Settings the samplers are created with.
    pub fn config(&self) -> &SamplerConfig {
        &self.config
    }

    /// `Err` naming the sampler whose owner thread died (a panic): its programs are
    /// detached and captures joining it would get nothing, so the agent must restart.
    ///
    /// # Errors
    /// A message for `/healthz`.
    pub fn health(&self) -> Result<(), String> {
        let dead = |alive: Option<bool>, what: &str| match alive {
            Some(false) => Err(format!(
                "the {what} sampler's thread stopped unexpectedly (see the log); restart the agent"
            )),
            _ => Ok(()),
        };
        dead(running(&self.cpu).map(|s| s.is_alive()), "cpu")?;
        dead(running(&self.runqlat).map(|s| s.is_alive()), "runqlat")?;
        dead(running(&self.heap).map(|s| s.is_alive()), "eBPF heap")?;
        dead(running(&self.offcpu).map(|s| s.is_alive()), "off-CPU")
    }

    /// Process snapshots used to symbolize what the samplers saw.
    pub fn catalog(&self) -> &ProcessCatalog {
        &self.catalog
    }

    /// Starts a CPU capture of `targets`. The first concurrent capture's
    /// options (frequency, event) win: later captures join the running
    /// sampler and their results report the effective options.
    pub fn start_cpu(&self, targets: &[CaptureTarget], options: &CpuOptions) -> Result<CpuCapture> {
        options.validate()?;
        let start = || CpuSampler::start(&self.config, *options, self.catalog.clone());
        let capture = with_sampler(&self.cpu, start, |s| s.capture(targets, options))?;
        self.cpu_linger
            .0
            .keep(capture.sampler(), self.config.cpu_sampler_linger);
        Ok(capture)
    }

    /// The fill of the running samplers' maps (entries in use, counted by walking the
    /// keys) in Prometheus text format; nothing for a sampler that is not running.
    pub fn map_fill_metrics(&self) -> String {
        use std::fmt::Write as _;
        let mut out = String::from(
            "# HELP flamefleet_agent_map_entries Entries in use in a running sampler's BPF map.\n\
             # TYPE flamefleet_agent_map_entries gauge\n",
        );
        if let Some(fill) = running(&self.cpu).map(|s| s.map_fill()) {
            for (map, n) in [
                ("targets", fill.targets),
                ("counts", fill.counts),
                ("kernel_stacks", fill.kernel_stacks),
                ("user_stacks", fill.user_stacks),
            ] {
                let _ = writeln!(
                    out,
                    "flamefleet_agent_map_entries{{sampler=\"cpu\",map=\"{map}\"}} {n}"
                );
            }
        }
        if let Some(fill) = running(&self.runqlat).map(|s| s.map_fill()) {
            for (map, n) in [
                ("targets", Some(fill.targets)),
                ("histograms", Some(fill.histograms)),
                ("starts", fill.starts),
            ] {
                if let Some(n) = n {
                    let _ = writeln!(
                        out,
                        "flamefleet_agent_map_entries{{sampler=\"runqlat\",map=\"{map}\"}} {n}"
                    );
                }
            }
        }
        if let Some(fill) = running(&self.offcpu).map(|s| s.map_fill()) {
            for (map, n) in [
                ("targets", fill.targets),
                ("counts", fill.counts),
                ("kernel_stacks", fill.kernel_stacks),
                ("user_stacks", fill.user_stacks),
            ] {
                let _ = writeln!(
                    out,
                    "flamefleet_agent_map_entries{{sampler=\"offcpu\",map=\"{map}\"}} {n}"
                );
            }
        }
        out
    }

    /// Starts an off-CPU capture of `targets`. The first concurrent capture's options
    /// (minimum block time, kernel stacks) win: later captures join the running sampler
    /// and their results report the effective options.
    pub fn start_offcpu(
        &self,
        targets: &[CaptureTarget],
        options: &OffcpuOptions,
    ) -> Result<OffcpuCapture> {
        options.validate()?;
        let start = || OffcpuSampler::start(&self.config, *options, self.catalog.clone());
        with_sampler(&self.offcpu, start, |s| s.capture(targets))
    }

    /// Starts a run-queue latency capture of `targets`.
    pub fn start_runqlat(
        &self,
        targets: &[CaptureTarget],
        options: &RunqlatOptions,
    ) -> Result<RunqlatCapture> {
        let start = || RunqlatSampler::start(&self.config);
        with_sampler(&self.runqlat, start, |s| s.capture(targets, options))
    }

    /// Adds `targets` to the node's eBPF heap sampler, starting it (with `opts`, the
    /// node's map sizes and this registry's catalog) when none runs.
    pub(crate) fn join_heap(
        &self,
        targets: &[CaptureTarget],
        opts: &EbpfHeapOptions,
    ) -> Result<JoinedCapture> {
        let start = || HeapSampler::start(&self.config, opts, self.catalog.clone());
        with_sampler(&self.heap, start, |s| s.register(targets))
    }

    /// The node's eBPF heap sampler, while a heap capture runs on it.
    pub fn heap(&self) -> Option<Arc<HeapSampler>> {
        running(&self.heap)
    }
}

/// The sampler of `slot`, if one runs.
fn running<S>(slot: &Mutex<Weak<S>>) -> Option<Arc<S>> {
    slot.lock()
        .unwrap_or_else(PoisonError::into_inner)
        .upgrade()
}

/// Runs `capture` on the running sampler of `slot` (starting one if none
/// runs); when that sampler has no target indices left, on a fresh one that
/// replaces it for later captures.
pub(crate) fn with_sampler<S, C>(
    slot: &Mutex<Weak<S>>,
    start: impl Fn() -> Result<S>,
    capture: impl Fn(&Arc<S>) -> Result<C>,
) -> Result<C> {
    let current = {
        let mut slot = slot.lock().unwrap_or_else(PoisonError::into_inner);
        match slot.upgrade() {
            Some(s) => s,
            None => {
                let s = Arc::new(start()?);
                *slot = Arc::downgrade(&s);
                s
            }
        }
    };
    match capture(&current) {
        Err(e @ (CaptureError::IndicesExhausted { .. } | CaptureError::IdleSamplerOptions)) => {
            let fresh = {
                let mut slot = slot.lock().unwrap_or_else(PoisonError::into_inner);
                // Another capture may have replaced it meanwhile.
                match slot.upgrade().filter(|s| !Arc::ptr_eq(s, &current)) {
                    Some(s) => s,
                    None => {
                        let s = Arc::new(start()?);
                        *slot = Arc::downgrade(&s);
                        s
                    }
                }
            };
            match e {
                CaptureError::IdleSamplerOptions => tracing::debug!(
                    "the idle sampler was loaded with other options; a fresh one takes over"
                ),
                _ => tracing::info!("sampler used all its target indices; a fresh one takes over"),
            }
            capture(&fresh)
        }
        other => other,
    }
}
