//! The operator's and the agent's own profiles over HTTP, as Go's `net/http/pprof` serves
//! them:
//!
//! - `GET /debug/pprof/profile?seconds=N&frequency=F&format=pprof|svg[&force=true]`: a CPU
//!   profile of this process over the next N seconds (a SIGPROF sampler, `sampler.rs`), as a
//!   gzipped pprof (`go tool pprof` reads it) or a flame graph. One at a time: a second
//!   request gets 409 Conflict, unless it says `force=true`, which ends the running
//!   profile early (its client gets what was sampled so far) and starts the new one.
//! - `GET /debug/pprof/heap`: the in-use heap of this process as a gzipped pprof, from
//!   jemalloc's sampling heap profiler. Binaries opt in with [`jemalloc_heap_profiling!`]
//!   (jemalloc as global allocator, profiling on from start-up); where the profiler is off
//!   this answers 501 with why.
//!
//! Serve [`router`] on a port of its own (`--debug-listen`): the chart keeps it
//! cluster-internal (no Service outside the cluster; its NetworkPolicy admits only pods of
//! the release's namespace).

mod cpu;
mod encode;
pub mod heap;
mod sampler;
mod symbols;

use std::net::SocketAddr;
use std::sync::Arc;

use axum::Router;
use axum::extract::{Query, State};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;

pub use cpu::{CpuProfileRequest, Format, SelfProfiler};
/// The allocator [`jemalloc_heap_profiling!`] installs (re-exported so binaries need no
/// direct dependency on it).
pub use tikv_jemallocator::Jemalloc;

/// Errors of the self-profiling endpoints.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A query parameter is out of range.
    #[error("invalid parameter: {0}")]
    Invalid(String),
    /// Another CPU profile runs.
    #[error(
        "a CPU profile of this process is already running; wait for it, or add force=true to end it and start this one"
    )]
    Busy,
    /// The sampler could not start or report.
    #[error("the CPU profiler failed: {0}")]
    Profiler(String),
    /// This process has no active heap profiler.
    #[error("no heap profile: {0}")]
    HeapUnavailable(String),
    /// Rendering or encoding failed.
    #[error("rendering the profile failed: {0}")]
    Render(String),
    /// The listener could not be bound.
    #[error("binding the debug listener on {addr}: {source}; pick a free --debug-listen address")]
    Bind {
        /// The address.
        addr: SocketAddr,
        /// The error.
        source: std::io::Error,
    },
}

/// Result of this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

impl IntoResponse for Error {
    fn into_response(self) -> Response {
        let status = match &self {
            Self::Invalid(_) => StatusCode::BAD_REQUEST,
            Self::Busy => StatusCode::CONFLICT,
            Self::HeapUnavailable(_) => StatusCode::NOT_IMPLEMENTED,
            Self::Profiler(_) | Self::Render(_) | Self::Bind { .. } => {
                StatusCode::INTERNAL_SERVER_ERROR
            }
        };
        (status, format!("{self}\n")).into_response()
    }
}

async fn cpu_profile(
    State(profiler): State<Arc<SelfProfiler>>,
    Query(query): Query<cpu::Query>,
) -> Result<Response> {
    let request = CpuProfileRequest::from_query(&query)?;
    let format = request.format;
    let body = profiler.profile(request).await?;
    let (content_type, disposition) = match format {
        Format::Pprof => (
            "application/octet-stream",
            "attachment; filename=\"profile.pb.gz\"",
        ),
        Format::Svg => ("image/svg+xml", "inline; filename=\"profile.svg\""),
    };
    Ok((
        [
            (header::CONTENT_TYPE, content_type),
            (header::CONTENT_DISPOSITION, disposition),
        ],
        body,
    )
        .into_response())
}

async fn heap_profile() -> Result<Response> {
    let body = tokio::task::spawn_blocking(heap::in_use_pprof)
        .await
        .map_err(|e| Error::Profiler(format!("the heap dump task failed: {e}")))??;
    Ok((
        [
            (header::CONTENT_TYPE, "application/octet-stream"),
            (
                header::CONTENT_DISPOSITION,
                "attachment; filename=\"heap.pb.gz\"",
            ),
        ],
        body,
    )
        .into_response())
}

/// The `/debug/pprof/*` routes over `profiler`.
pub fn router(profiler: Arc<SelfProfiler>) -> Router {
    Router::new()
        .route("/debug/pprof/profile", get(cpu_profile))
        .route("/debug/pprof/heap", get(heap_profile))
        .with_state(profiler)
}

/// Serves [`router`] on `listen` in a background task with a profiler of its own; returns
/// the bound address.
///
/// # Errors
/// [`Error::Bind`] when the address is taken.
pub async fn spawn(listen: SocketAddr) -> Result<SocketAddr> {
    spawn_with(listen, Arc::new(SelfProfiler::default())).await
}

/// Like [`spawn`], over the caller's `profiler`.
///
/// # Errors
/// [`Error::Bind`] when the address is taken.
pub async fn spawn_with(listen: SocketAddr, profiler: Arc<SelfProfiler>) -> Result<SocketAddr> {
    let listener = tokio::net::TcpListener::bind(listen)
        .await
        .map_err(|source| Error::Bind {
            addr: listen,
            source,
        })?;
    let bound = listener.local_addr().map_err(|source| Error::Bind {
        addr: listen,
        source,
    })?;
    let app = router(profiler);
    tokio::spawn(flamefleet_proto::http_serve::serve(
        listener,
        app,
        flamefleet_proto::http_serve::ServeLimits::DEBUG,
    ));
    tracing::info!(%bound, "serving /debug/pprof");
    Ok(bound)
}
