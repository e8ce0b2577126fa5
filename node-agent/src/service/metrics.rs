//! What the agent counts about its captures, rendered on the probe server's `/metrics`:
//! captures by type and outcome, samples dropped in the kernel, time spent symbolizing,
//! bytes uploaded. Map fill is read from the samplers at scrape time (see
//! [`super::probes`]).

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::Mutex;
use std::sync::PoisonError;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use flamefleet_proto::agent::CaptureSummary;
use flamefleet_proto::agent::capture_summary::Kind;

use super::reporter::{Outcome, Reporter};
use crate::capture::lifecycle::Symbolized;

/// Counters of the agent's captures. Labels are fixed sets (profile type, outcome), so
/// the series are bounded.
#[derive(Debug, Default)]
pub struct AgentMetrics {
    captures: Mutex<BTreeMap<(&'static str, Outcome), u64>>,
    drops: Mutex<BTreeMap<&'static str, u64>>,
    symbolize: TimeByType,
    window_symbolize: TimeByType,
    upload_bytes: AtomicU64,
    uploads: AtomicU64,
}

impl AgentMetrics {
    /// Counts a capture of `profile_type` that ended with `outcome`.
    pub fn capture_finished(&self, profile_type: &'static str, outcome: Outcome) {
        *self
            .captures
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .entry((profile_type, outcome))
            .or_default() += 1;
    }

    /// Adds samples (or waits) a capture of `profile_type` lost in the kernel.
    pub fn dropped(&self, profile_type: &'static str, n: u64) {
        *self
            .drops
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .entry(profile_type)
            .or_default() += n;
    }

    /// Records the time one capture of `profile_type` spent symbolizing and building its
    /// profile after the window.
    pub fn symbolized(&self, profile_type: &'static str, took: Duration) {
        add_time(&self.symbolize, profile_type, took);
    }

    /// Records one symbolization pass during a capture's window (it fills the caches the
    /// symbolization after the window then hits).
    pub fn symbolized_during_window(&self, profile_type: &'static str, took: Duration) {
        add_time(&self.window_symbolize, profile_type, took);
    }

    /// Counts one uploaded artifact of `bytes`.
    pub fn uploaded(&self, bytes: usize) {
        self.upload_bytes.fetch_add(bytes as u64, Ordering::Relaxed);
        self.uploads.fetch_add(1, Ordering::Relaxed);
    }

    /// The counters in Prometheus text format.
    pub fn render(&self) -> String {
        let mut out = String::new();
        out.push_str(
            "# HELP flamefleet_agent_captures_total Captures ended, by profile type and outcome.\n\
             # TYPE flamefleet_agent_captures_total counter\n",
        );
        for ((ty, outcome), n) in self
            .captures
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .iter()
        {
            let _ = writeln!(
                out,
                "flamefleet_agent_captures_total{{type=\"{ty}\",outcome=\"{}\"}} {n}",
                outcome.as_str()
            );
        }
        out.push_str(
            "# HELP flamefleet_agent_dropped_samples_total Samples or waits the kernel side could not record (a full map), by profile type.\n\
             # TYPE flamefleet_agent_dropped_samples_total counter\n",
        );
        for (ty, n) in self
            .drops
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .iter()
        {
            let _ = writeln!(
                out,
                "flamefleet_agent_dropped_samples_total{{type=\"{ty}\"}} {n}"
            );
        }
        write_time_summary(
            &mut out,
            "flamefleet_agent_symbolize_seconds",
            "Time spent after a capture's window reading maps, symbolizing and encoding its profile.",
            &self.symbolize,
        );
        write_time_summary(
            &mut out,
            "flamefleet_agent_window_symbolize_seconds",
            "Time spent half-way through a CPU capture's window symbolizing the frames sampled so far that were not cached yet; one count per capture that found the sampler idle.",
            &self.window_symbolize,
        );
        let _ = write!(
            out,
            "# HELP flamefleet_agent_upload_bytes_total Bytes of artifacts uploaded to the store.\n\
             # TYPE flamefleet_agent_upload_bytes_total counter\n\
             flamefleet_agent_upload_bytes_total {}\n\
             # HELP flamefleet_agent_uploads_total Artifacts uploaded to the store.\n\
             # TYPE flamefleet_agent_uploads_total counter\n\
             flamefleet_agent_uploads_total {}\n",
            self.upload_bytes.load(Ordering::Relaxed),
            self.uploads.load(Ordering::Relaxed)
        );
        out.push_str(&crate::capture::kernel::KernelFeatures::get().render_metrics());
        out
    }
}

impl Reporter for AgentMetrics {
    fn uploaded(&self, bytes: usize) {
        AgentMetrics::uploaded(self, bytes);
    }

    fn symbolized(&self, profile_type: &'static str, symbolized: Symbolized) {
        if let Some(took) = symbolized.during_window {
            self.symbolized_during_window(profile_type, took);
        }
        if let Some(took) = symbolized.after_window {
            AgentMetrics::symbolized(self, profile_type, took);
        }
    }

    fn capture_finished(
        &self,
        profile_type: &'static str,
        outcome: Outcome,
        summary: Option<&CaptureSummary>,
    ) {
        // Heap captures report their losses in their eBPF counters, not as dropped samples.
        if let Some(s) = summary
            && matches!(s.kind, Some(Kind::Cpu(_) | Kind::Runqlat(_)))
        {
            self.dropped(profile_type, s.dropped_samples());
        }
        AgentMetrics::capture_finished(self, profile_type, outcome);
    }
}

/// Time summed per profile type, with a count.
type TimeByType = Mutex<BTreeMap<&'static str, (Duration, u64)>>;

/// Adds one observation of `took` for `profile_type`.
fn add_time(map: &TimeByType, profile_type: &'static str, took: Duration) {
    let mut m = map.lock().unwrap_or_else(PoisonError::into_inner);
    let e = m.entry(profile_type).or_default();
    e.0 += took;
    e.1 += 1;
}

/// Writes `map` as the Prometheus summary `name` (sum and count per `type`).
fn write_time_summary(out: &mut String, name: &str, help: &str, map: &TimeByType) {
    let _ = write!(out, "# HELP {name} {help}\n# TYPE {name} summary\n");
    for (ty, (sum, count)) in map.lock().unwrap_or_else(PoisonError::into_inner).iter() {
        let _ = writeln!(
            out,
            "{name}_sum{{type=\"{ty}\"}} {:.6}\n{name}_count{{type=\"{ty}\"}} {count}",
            sum.as_secs_f64()
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_every_counter_with_its_labels() {
        let m = AgentMetrics::default();
        m.capture_finished("cpu", Outcome::Succeeded);
        m.capture_finished("cpu", Outcome::Succeeded);
        m.capture_finished("heap", Outcome::Failed);
        m.dropped("cpu", 3);
        m.symbolized("cpu", Duration::from_millis(250));
        m.uploaded(1000);
        m.uploaded(24);
        let text = m.render();
        for line in [
            "flamefleet_agent_captures_total{type=\"cpu\",outcome=\"succeeded\"} 2",
            "flamefleet_agent_captures_total{type=\"heap\",outcome=\"failed\"} 1",
            "flamefleet_agent_dropped_samples_total{type=\"cpu\"} 3",
            "flamefleet_agent_symbolize_seconds_sum{type=\"cpu\"} 0.250000",
            "flamefleet_agent_symbolize_seconds_count{type=\"cpu\"} 1",
            "flamefleet_agent_upload_bytes_total 1024",
            "flamefleet_agent_uploads_total 2",
        ] {
            assert!(text.lines().any(|l| l == line), "{line} missing in\n{text}");
        }
    }
}
