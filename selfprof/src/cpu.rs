//! One CPU profile of this process at a time, on a thread of its own.

use std::sync::Mutex;
use std::sync::mpsc;
use std::time::Duration;

use serde::Deserialize;

use crate::{Error, Result, encode, sampler};

/// Longest profile served (Go's net/http/pprof has no limit; a forgotten 1-hour profile
/// would hold the profiler that long).
pub const MAX_SECONDS: u64 = 300;
/// Default length, as Go's.
pub const DEFAULT_SECONDS: u64 = 30;
/// Default frequency (Hz): 99 avoids lockstep with periodic work at round frequencies.
pub const DEFAULT_FREQUENCY: u32 = 99;
/// Highest frequency served: SIGPROF with in-process unwinding costs a few µs per sample
/// and thread; more than 1 kHz profiles mostly the profiler.
pub const MAX_FREQUENCY: u32 = 1000;

/// The query string of `/debug/pprof/profile`.
#[derive(Debug, Default, Deserialize)]
pub struct Query {
    seconds: Option<String>,
    frequency: Option<String>,
    format: Option<String>,
    force: Option<String>,
}

/// The output format.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    /// Gzipped pprof protobuf.
    Pprof,
    /// Flame graph SVG.
    Svg,
}

/// A validated CPU profile request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CpuProfileRequest {
    /// Length.
    pub duration: Duration,
    /// Sampling frequency, Hz.
    pub frequency: u32,
    /// Output format.
    pub format: Format,
    /// End a running profile instead of refusing.
    pub force: bool,
}

impl CpuProfileRequest {
    /// Validates the query.
    ///
    /// # Errors
    /// [`Error::Invalid`] naming the parameter, what was found and what is accepted.
    pub fn from_query(q: &Query) -> Result<Self> {
        fn number(name: &str, v: Option<&str>, default: u64, max: u64) -> Result<u64> {
            let Some(v) = v else {
                return Ok(default);
            };
            match v.trim().parse::<u64>() {
                Ok(n) if (1..=max).contains(&n) => Ok(n),
                _ => Err(Error::Invalid(format!(
                    "{name} must be a whole number from 1 to {max}, found {v:?}"
                ))),
            }
        }
        let seconds = number(
            "seconds",
            q.seconds.as_deref(),
            DEFAULT_SECONDS,
            MAX_SECONDS,
        )?;
        let frequency = number(
            "frequency",
            q.frequency.as_deref(),
            u64::from(DEFAULT_FREQUENCY),
            u64::from(MAX_FREQUENCY),
        )?;
        let format = match q.format.as_deref().unwrap_or("pprof") {
            "pprof" | "proto" => Format::Pprof,
            "svg" | "flamegraph" => Format::Svg,
            other => {
                return Err(Error::Invalid(format!(
                    "format must be pprof or svg, found {other:?}"
                )));
            }
        };
        let force = match q.force.as_deref() {
            None | Some("false" | "0") => false,
            Some("" | "true" | "1") => true,
            Some(other) => {
                return Err(Error::Invalid(format!(
                    "force must be true or false, found {other:?}"
                )));
            }
        };
        Ok(Self {
            duration: Duration::from_secs(seconds),
            frequency: u32::try_from(frequency).unwrap_or(DEFAULT_FREQUENCY),
            format,
            force,
        })
    }
}

/// Held for the whole of a profile: the sampler is process-wide (one `SIGPROF` timer).
static RUNNING: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());
/// Ends the running profile early (a forced request). Set while holding this lock in the
/// same step that takes [`RUNNING`], so a forced request always finds it.
static STOP: Mutex<Option<mpsc::Sender<()>>> = Mutex::new(None);

/// The process's CPU profiler. Profiles run one at a time in the whole process, whichever
/// `SelfProfiler` serves them.
#[derive(Debug)]
pub struct SelfProfiler {
    /// Profiles this instance started so far (a readiness signal for tests and logs).
    started: tokio::sync::watch::Sender<u64>,
}

impl Default for SelfProfiler {
    fn default() -> Self {
        Self {
            started: tokio::sync::watch::Sender::new(0),
        }
    }
}

impl SelfProfiler {
    /// Waits until at least `n` profiles of this instance have started sampling.
    pub async fn wait_started(&self, n: u64) {
        let mut rx = self.started.subscribe();
        let _ = rx.wait_for(|&started| started >= n).await;
    }

    /// Profiles this process as `request` says and returns the encoded profile.
    ///
    /// # Errors
    /// [`Error::Busy`] while another profile runs (unless `force`), [`Error::Profiler`],
    /// [`Error::Render`].
    pub async fn profile(&self, request: CpuProfileRequest) -> Result<Vec<u8>> {
        let (stop_tx, stop_rx) = mpsc::channel();
        let acquired = {
            let mut stop = STOP
                .lock()
                .map_err(|_| Error::Profiler("the profiler state is poisoned".into()))?;
            match RUNNING.try_lock() {
                Ok(guard) => {
                    *stop = Some(stop_tx.clone());
                    Some(guard)
                }
                Err(_) if request.force => {
                    if let Some(tx) = stop.as_ref() {
                        let _ = tx.send(());
                    }
                    None
                }
                Err(_) => return Err(Error::Busy),
            }
        };
        let _running = match acquired {
            Some(guard) => guard,
            None => {
                let guard = RUNNING.lock().await;
                if let Ok(mut stop) = STOP.lock() {
                    *stop = Some(stop_tx);
                }
                guard
            }
        };
        let (done_tx, done_rx) = tokio::sync::oneshot::channel();
        let started = self.started.clone();
        std::thread::Builder::new()
            .name("self-profile".into())
            .spawn(move || {
                let _ = done_tx.send(sample(request, &stop_rx, || {
                    tracing::info!(
                        seconds = request.duration.as_secs(),
                        frequency = request.frequency,
                        "self CPU profile started"
                    );
                    started.send_modify(|n| *n += 1);
                }));
            })
            .map_err(|e| Error::Profiler(format!("spawning the profiling thread: {e}")))?;
        let out = done_rx
            .await
            .map_err(|_| Error::Profiler("the profiling thread panicked".into()))?;
        if let Ok(mut stop) = STOP.lock() {
            *stop = None;
        }
        out
    }
}

/// Samples for the request's duration (or until told to stop), then symbolizes and encodes.
fn sample(
    request: CpuProfileRequest,
    stop: &mpsc::Receiver<()>,
    on_start: impl FnOnce(),
) -> Result<Vec<u8>> {
    let samples = sampler::sample(request.frequency, request.duration, stop, on_start)?;
    let recorded: i64 = samples.stacks.values().sum();
    tracing::info!(
        samples = recorded,
        stacks = samples.stacks.len(),
        dropped = samples.dropped,
        skipped_in_libc = samples.skipped,
        "self CPU profile done"
    );
    match request.format {
        Format::Pprof => encode::pprof_gzip(&samples),
        Format::Svg => encode::svg(&samples),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn query(pairs: &[(&str, &str)]) -> Query {
        let get = |k: &str| {
            pairs
                .iter()
                .find(|(n, _)| *n == k)
                .map(|(_, v)| v.to_string())
        };
        Query {
            seconds: get("seconds"),
            frequency: get("frequency"),
            format: get("format"),
            force: get("force"),
        }
    }

    #[test]
    fn queries_are_validated_with_clear_messages() {
        let d = CpuProfileRequest::from_query(&query(&[])).unwrap();
        assert_eq!(d.duration, Duration::from_secs(30));
        assert_eq!((d.frequency, d.format, d.force), (99, Format::Pprof, false));
        let r = CpuProfileRequest::from_query(&query(&[
            ("seconds", "2"),
            ("frequency", "199"),
            ("format", "svg"),
            ("force", "true"),
        ]))
        .unwrap();
        assert_eq!((r.frequency, r.format, r.force), (199, Format::Svg, true));
        for (pairs, needle) in [
            (
                &[("seconds", "0")][..],
                "seconds must be a whole number from 1 to 300",
            ),
            (&[("seconds", "301")][..], "found \"301\""),
            (&[("frequency", "abc")][..], "frequency must be"),
            (&[("format", "png")][..], "format must be pprof or svg"),
            (&[("force", "maybe")][..], "force must be true or false"),
        ] {
            let err = CpuProfileRequest::from_query(&query(pairs))
                .unwrap_err()
                .to_string();
            assert!(err.contains(needle), "{err}");
        }
    }
}
