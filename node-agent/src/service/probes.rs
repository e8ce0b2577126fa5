//! The agent's probe server: `/healthz`, `/readyz` and `/metrics` on their own plain-HTTP
//! port (the kubelet's probes cannot present the operator's client certificate).
//!
//! - `/healthz`: 200 while the gRPC server runs and every running sampler's owner thread is
//!   alive (a crashed server, or a sampler thread that died with its programs, fails it, and
//!   the kubelet restarts the agent); answered from the same runtime as the gRPC server, so a
//!   wedged runtime fails it too (the probe times out).
//! - `/readyz`: 200 once the agent serves with a node certificate; 503 with the reason
//!   before (e.g. still waiting for the operator to sign its CSR).
//! - `/metrics`: Prometheus text: readiness, the serving certificate's expiry, captures
//!   running; captures by type and outcome, dropped samples, symbolization time, upload
//!   bytes ([`super::metrics`]); and the fill of every running sampler's maps.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use axum::Router;
use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::get;

use super::metrics::AgentMetrics;
use super::{Result, ServiceError};
use crate::capture::Samplers;

/// A liveness check beyond "the server runs": `Err(reason)` fails `/healthz`.
pub type HealthCheck = Box<dyn Fn() -> Result<(), String> + Send + Sync>;

/// What the probes report, updated by the service.
#[derive(Default)]
pub struct ProbeState {
    serving: AtomicBool,
    waiting_for: std::sync::Mutex<String>,
    cert_expiry_unix: AtomicU64,
    captures_active: AtomicU64,
    health: std::sync::OnceLock<HealthCheck>,
    counters: std::sync::OnceLock<(Arc<AgentMetrics>, Arc<Samplers>)>,
    triggers: std::sync::OnceLock<Arc<super::watch::NodeWatch>>,
    continuous: std::sync::OnceLock<Arc<crate::continuous::Continuous>>,
}

impl std::fmt::Debug for ProbeState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ProbeState")
            .field("serving", &self.serving)
            .field("captures_active", &self.captures_active)
            .finish_non_exhaustive()
    }
}

impl ProbeState {
    /// A state that is neither serving nor ready, waiting for `what`.
    pub fn new(waiting_for: &str) -> Arc<Self> {
        let state = Arc::new(Self::default());
        state.set_waiting(waiting_for);
        state
    }

    /// Records what the agent waits for before it can serve.
    pub fn set_waiting(&self, what: &str) {
        if let Ok(mut w) = self.waiting_for.lock() {
            what.clone_into(&mut w);
        }
    }

    /// Adds the liveness check `/healthz` runs while serving (set once; later calls are
    /// ignored).
    pub fn set_health_check(&self, check: HealthCheck) {
        let _ = self.health.set(check);
    }

    /// Adds the capture counters and the samplers whose map fill `/metrics` reports (set
    /// once; later calls are ignored).
    pub fn set_metrics(&self, metrics: Arc<AgentMetrics>, samplers: Arc<Samplers>) {
        let _ = self.counters.set((metrics, samplers));
    }

    /// Adds the trigger watcher's counters to `/metrics` (set once; later calls are
    /// ignored).
    pub fn set_trigger_metrics(&self, watch: Arc<super::watch::NodeWatch>) {
        let _ = self.triggers.set(watch);
    }

    /// Adds the always-on windows' counters to `/metrics`.
    pub fn set_continuous_metrics(&self, continuous: Arc<crate::continuous::Continuous>) {
        let _ = self.continuous.set(continuous);
    }

    /// Marks the gRPC server as serving (or not).
    pub fn set_serving(&self, serving: bool) {
        self.serving.store(serving, Ordering::SeqCst);
    }

    /// Records the serving certificate's expiry.
    pub fn set_cert_expiry(&self, at: std::time::SystemTime) {
        let secs = at
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0);
        self.cert_expiry_unix.store(secs, Ordering::Relaxed);
    }

    /// Counts a capture starting (`+1`) or ending (`-1`).
    pub fn capture_delta(&self, started: bool) {
        if started {
            self.captures_active.fetch_add(1, Ordering::Relaxed);
        } else {
            let _ = self
                .captures_active
                .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_sub(1));
        }
    }

    fn serving(&self) -> bool {
        self.serving.load(Ordering::SeqCst)
    }
}

async fn healthz(State(state): State<Arc<ProbeState>>) -> (StatusCode, String) {
    if state.serving() {
        match state.health.get().map_or(Ok(()), |check| check()) {
            Ok(()) => (StatusCode::OK, "ok\n".into()),
            Err(reason) => (StatusCode::SERVICE_UNAVAILABLE, format!("{reason}\n")),
        }
    } else {
        // Not serving yet is still healthy: readiness says why; liveness must not kill an
        // agent that waits for the operator to sign its certificate.
        let waiting = state
            .waiting_for
            .lock()
            .map(|w| w.clone())
            .unwrap_or_default();
        if waiting.is_empty() {
            (
                StatusCode::SERVICE_UNAVAILABLE,
                "the gRPC server stopped\n".into(),
            )
        } else {
            (StatusCode::OK, format!("starting: {waiting}\n"))
        }
    }
}

async fn readyz(State(state): State<Arc<ProbeState>>) -> (StatusCode, String) {
    if state.serving() {
        (StatusCode::OK, "ready\n".into())
    } else {
        let waiting = state
            .waiting_for
            .lock()
            .map(|w| w.clone())
            .unwrap_or_default();
        (
            StatusCode::SERVICE_UNAVAILABLE,
            format!("not ready: {waiting}\n"),
        )
    }
}

async fn metrics(State(state): State<Arc<ProbeState>>) -> String {
    let heap = state
        .counters
        .get()
        .map_or((0, 0, 0), |(_, samplers)| heap_sampler_gauges(samplers));
    let mut text = format!(
        "# HELP flamefleet_agent_ready Whether the agent serves gRPC with a node certificate.\n\
         # TYPE flamefleet_agent_ready gauge\n\
         flamefleet_agent_ready {}\n\
         # HELP flamefleet_agent_certificate_expiry_timestamp_seconds When the serving certificate expires.\n\
         # TYPE flamefleet_agent_certificate_expiry_timestamp_seconds gauge\n\
         flamefleet_agent_certificate_expiry_timestamp_seconds {}\n\
         # HELP flamefleet_agent_captures_active Captures running now.\n\
         # TYPE flamefleet_agent_captures_active gauge\n\
         flamefleet_agent_captures_active {}\n\
         # HELP flamefleet_agent_heap_probed_binaries Allocator binaries with eBPF heap uprobes attached (one attachment per binary, however many heap captures use it).\n\
         # TYPE flamefleet_agent_heap_probed_binaries gauge\n\
         flamefleet_agent_heap_probed_binaries {}\n\
         # HELP flamefleet_agent_heap_uprobes eBPF heap uprobes attached.\n\
         # TYPE flamefleet_agent_heap_uprobes gauge\n\
         flamefleet_agent_heap_uprobes {}\n\
         # HELP flamefleet_agent_heap_sampler_captures eBPF heap captures sharing the node's heap sampler.\n\
         # TYPE flamefleet_agent_heap_sampler_captures gauge\n\
         flamefleet_agent_heap_sampler_captures {}\n",
        u8::from(state.serving()),
        state.cert_expiry_unix.load(Ordering::Relaxed),
        state.captures_active.load(Ordering::Relaxed),
        heap.0,
        heap.1,
        heap.2,
    );
    if let Some((counters, samplers)) = state.counters.get() {
        text.push_str(&counters.render());
        // Walking the maps' keys takes the samplers' locks briefly: off the runtime.
        let samplers = Arc::clone(samplers);
        if let Ok(fill) = tokio::task::spawn_blocking(move || samplers.map_fill_metrics()).await {
            text.push_str(&fill);
        }
    }
    if let Some(watch) = state.triggers.get() {
        text.push_str(&watch.render_metrics());
    }
    if let Some(continuous) = state.continuous.get() {
        text.push_str(&continuous.render_metrics());
    }
    text
}

/// (probed binaries, uprobes, captures) of the node's eBPF heap sampler; zeros when none runs.
fn heap_sampler_gauges(samplers: &Samplers) -> (usize, usize, usize) {
    samplers.heap().map_or((0, 0, 0), |s| {
        let attached = s.attachments();
        (
            attached.len(),
            attached.iter().map(|a| a.probes).sum(),
            s.captures(),
        )
    })
}

/// Serves the probes on `listen` in a background task; returns the bound address.
///
/// # Errors
/// [`ServiceError::Bind`] when the address is taken.
pub async fn spawn(listen: SocketAddr, state: Arc<ProbeState>) -> Result<SocketAddr> {
    let listener = tokio::net::TcpListener::bind(listen)
        .await
        .map_err(|source| ServiceError::Bind {
            addr: listen,
            source,
        })?;
    let bound = listener.local_addr().map_err(|source| ServiceError::Bind {
        addr: listen,
        source,
    })?;
    let router = Router::new()
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics))
        .with_state(state);
    tokio::spawn(flamefleet_proto::http_serve::serve(
        listener,
        router,
        flamefleet_proto::http_serve::ServeLimits::PROBES,
    ));
    Ok(bound)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn healthz_runs_the_health_check_while_serving() {
        let state = ProbeState::new("waiting for a certificate");
        // Waiting is healthy (liveness must not kill an agent waiting for its CSR).
        assert_eq!(healthz(State(Arc::clone(&state))).await.0, StatusCode::OK);
        state.set_waiting("");
        state.set_serving(true);
        assert_eq!(healthz(State(Arc::clone(&state))).await.0, StatusCode::OK);
        state.set_health_check(Box::new(|| Err("the cpu sampler's thread stopped".into())));
        let (code, body) = healthz(State(Arc::clone(&state))).await;
        assert_eq!(code, StatusCode::SERVICE_UNAVAILABLE);
        assert!(body.contains("cpu sampler"), "{body}");
        state.set_serving(false);
        let (code, body) = healthz(State(state)).await;
        assert_eq!(code, StatusCode::SERVICE_UNAVAILABLE);
        assert!(body.contains("gRPC server stopped"), "{body}");
    }
}
