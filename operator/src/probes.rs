//! `/metrics` (Prometheus text), `/healthz` (the process serves) and `/readyz` (the operator
//! is connected to the API server and either leads or is a ready standby).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use axum::routing::get;

use crate::metrics::Metrics;

/// What the probe server reports.
#[derive(Debug)]
pub struct ProbeState {
    /// The metrics to expose.
    pub metrics: Arc<Metrics>,
    /// Set once the operator is ready.
    pub ready: AtomicBool,
}

impl ProbeState {
    /// A not-yet-ready state over `metrics`.
    pub fn new(metrics: Arc<Metrics>) -> Arc<Self> {
        Arc::new(Self {
            metrics,
            ready: AtomicBool::new(false),
        })
    }

    /// Marks the operator ready (or not).
    pub fn set_ready(&self, ready: bool) {
        self.ready.store(ready, Ordering::Release);
    }
}

/// The probe and metrics routes.
pub fn router(state: Arc<ProbeState>) -> Router {
    Router::new()
        .route("/metrics", get(metrics))
        .route("/healthz", get(|| async { "ok" }))
        .route("/readyz", get(readyz))
        .with_state(state)
}

async fn metrics(State(state): State<Arc<ProbeState>>) -> impl IntoResponse {
    (
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        state.metrics.encode(),
    )
}

async fn readyz(State(state): State<Arc<ProbeState>>) -> impl IntoResponse {
    if state.ready.load(Ordering::Acquire) {
        (StatusCode::OK, "ready")
    } else {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            "not ready: connecting to the API server",
        )
    }
}
