//! The one process tracker of the samplers that record user stacks (CPU, eBPF heap): it
//! keeps the node's [`ProcessCatalog`] and the CFI unwinder fed with the targets' processes,
//! from two sides:
//!
//! - the processes running when a capture starts (they will not announce themselves by
//!   exec), walked from the targets' cgroups;
//! - the process records of `bpf/proc_events.bpf.h` (a process recorded for the first time,
//!   an exec), read from a sampler's ring buffer by its owner thread.
//!
//! Either way a process's mappings are snapshot while it lives (a process that exits before
//! the capture ends is still symbolized) and handed to the unwinder, so its stacks unwind
//! with CFI from (nearly) their first samples.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use libbpf_rs::{MapHandle, RingBuffer, RingBufferBuilder};

use super::{CaptureError, CaptureTarget, Result};
use crate::bpf::cpu_sampler::types::ff_proc_event;
use crate::bpf::from_bytes;
use crate::process::ProcessCatalog;
use crate::python::PythonRegistry;
use crate::unwind::Unwinder;

/// How long a capture's start waits for the unwind tables of the processes already running
/// in its targets, so that even their first samples unwind fully.
const FIRST_TABLES_WAIT: Duration = Duration::from_millis(300);

/// Feeds the catalog (and the unwinder, for samplers that walk stacks with CFI) with the
/// targets' processes. Cheap to clone.
#[derive(Debug, Clone)]
pub(crate) struct ProcessTracker {
    catalog: ProcessCatalog,
    unwinder: Option<Arc<Unwinder>>,
    /// Where Python processes get their frame reader (samplers that read Python frames).
    python: Option<Arc<PythonRegistry>>,
}

impl ProcessTracker {
    /// A tracker writing to `catalog` and, when given, registering with `unwinder`.
    pub(crate) fn new(catalog: ProcessCatalog, unwinder: Option<Arc<Unwinder>>) -> Self {
        Self {
            catalog,
            unwinder,
            python: None,
        }
    }

    /// The same tracker, also registering the processes with `python` (whose CPython ones
    /// then get their Python frames read).
    pub(crate) fn with_python(mut self, python: Arc<PythonRegistry>) -> Self {
        self.python = Some(python);
        self
    }

    /// The Python registry the processes are registered with, if any.
    pub(crate) fn python(&self) -> Option<&Arc<PythonRegistry>> {
        self.python.as_ref()
    }

    /// The catalog the snapshots go to.
    pub(crate) fn catalog(&self) -> &ProcessCatalog {
        &self.catalog
    }

    /// The unwinder the processes are registered with (`None`: frame pointers only).
    pub(crate) fn unwinder(&self) -> Option<&Arc<Unwinder>> {
        self.unwinder.as_ref()
    }

    /// Snapshots the processes running in `targets` now (those `known` does not hold yet,
    /// adding them to it) and registers them with the unwinder: at a capture's start
    /// (`first`) waiting up to [`FIRST_TABLES_WAIT`] for their tables, during its window
    /// queued. A capture tracks its targets itself: the BPF side announces a process only
    /// the first time a sampler records it, and a capture must not symbolize with a
    /// snapshot older than itself.
    pub(crate) fn track_running(
        &self,
        targets: &[CaptureTarget],
        known: &mut HashSet<u32>,
        first: bool,
    ) {
        let mut new = Vec::new();
        for t in targets {
            // A target whose processes all exited is simply empty.
            for pid in t.cgroup.procs_recursive().unwrap_or_default() {
                if known.insert(pid) && self.catalog.snapshot(pid) {
                    new.extend(self.catalog.lookup(pid).map(|maps| (pid, maps)));
                }
            }
        }
        if let Some(py) = &self.python {
            for (pid, maps) in &new {
                py.register(*pid, maps);
            }
        }
        let Some(u) = &self.unwinder else { return };
        if first {
            u.register_now(new, FIRST_TABLES_WAIT);
        } else {
            for (pid, maps) in new {
                u.register(pid, maps);
            }
        }
    }

    /// The reader of a sampler's `proc_events` ring buffer: each record's process is
    /// snapshot and registered. Polled by the sampler's owner thread.
    pub(crate) fn event_ring(&self, events: &MapHandle) -> Result<RingBuffer<'static>> {
        let tracker = self.clone();
        let mut rb = RingBufferBuilder::new();
        rb.add(events, move |data: &[u8]| {
            if let Some(ev) = from_bytes::<ff_proc_event>(data) {
                tracker.on_event(ev.tgid);
            }
            0
        })
        .map_err(|e| CaptureError::bpf("reading the process ring buffer", e))?;
        rb.build()
            .map_err(|e| CaptureError::bpf("reading the process ring buffer", e))
    }

    fn on_event(&self, tgid: u32) {
        self.catalog.snapshot(tgid);
        let Some(maps) = self.catalog.lookup(tgid) else {
            return;
        };
        if let Some(py) = &self.python {
            py.register(tgid, &maps);
        }
        if let Some(u) = &self.unwinder {
            u.register(tgid, maps);
        }
    }
}
