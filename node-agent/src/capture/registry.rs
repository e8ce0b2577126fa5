//! One sampler per profile type per node, shared by concurrent captures.
//!
//! The registry holds weak references: the first capture of a type starts
//! the sampler, later ones join it, and when the last capture of a type
//! ends the sampler stops (detaching its programs and freeing its maps, so
//! an idle node pays nothing and a long-lived stack map never fills up).

use std::sync::{Arc, Mutex, PoisonError, Weak};

use super::cpu::{CpuCapture, CpuOptions, CpuSampler};
use super::runqlat::{RunqlatCapture, RunqlatOptions, RunqlatSampler};
use super::{CaptureTarget, Result, SamplerConfig};
use crate::symbolize::ProcessCatalog;

/// The node's samplers. Thread-safe; share it behind an `Arc`.
#[derive(Debug, Default)]
pub struct Samplers {
    config: SamplerConfig,
    catalog: ProcessCatalog,
    cpu: Mutex<Weak<CpuSampler>>,
    runqlat: Mutex<Weak<RunqlatSampler>>,
}

impl Samplers {
    /// A registry with no sampler running yet.
    pub fn new(config: SamplerConfig) -> Self {
        Self {
            config,
            ..Self::default()
        }
    }

    /// Settings the samplers are created with.
    pub fn config(&self) -> &SamplerConfig {
        &self.config
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
        let sampler = {
            let mut slot = self.cpu.lock().unwrap_or_else(PoisonError::into_inner);
            match slot.upgrade() {
                Some(s) => s,
                None => {
                    let s = Arc::new(CpuSampler::start(
                        &self.config,
                        *options,
                        self.catalog.clone(),
                    )?);
                    *slot = Arc::downgrade(&s);
                    s
                }
            }
        };
        sampler.capture(targets)
    }

    /// Starts a run-queue latency capture of `targets`.
    pub fn start_runqlat(
        &self,
        targets: &[CaptureTarget],
        options: &RunqlatOptions,
    ) -> Result<RunqlatCapture> {
        let sampler = {
            let mut slot = self.runqlat.lock().unwrap_or_else(PoisonError::into_inner);
            match slot.upgrade() {
                Some(s) => s,
                None => {
                    let s = Arc::new(RunqlatSampler::start(&self.config)?);
                    *slot = Arc::downgrade(&s);
                    s
                }
            }
        };
        sampler.capture(targets, options)
    }
}
