//! Serving HTTP within bounds, for every plain HTTP(S) server of the operator and the agent
//! (the artifact store, the probe and metrics servers, `/debug/pprof`).
//!
//! `axum::serve` keeps a connection as long as its client likes: a client that sends half a
//! request line and then nothing (slowloris), or a thousand of them, holds sockets and tasks
//! forever. Here every connection has
//! - a deadline for its request headers ([`ServeLimits::header_read_timeout`]), which also
//!   closes a kept-alive connection whose next request does not come;
//! - a maximum age ([`ServeLimits::max_connection_age`]), after which it is shut down
//!   gracefully (a request in progress may finish for a few more seconds), so a client that
//!   trickles its body or reads its answer one byte a minute cannot hold it forever;
//! - a place among [`ServeLimits::max_connections`]: once they are taken, further clients
//!   wait in the kernel's accept backlog until one ends.

use std::sync::Arc;
use std::time::Duration;

use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;

/// How long a connection past its maximum age may take to finish the request in progress.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(5);

/// Bounds of one server.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ServeLimits {
    /// Connections served at once.
    pub max_connections: usize,
    /// Time for a request's headers to arrive, from the connection's start or the end of
    /// the previous request.
    pub header_read_timeout: Duration,
    /// Time after which a connection is shut down, whatever it does.
    pub max_connection_age: Duration,
}

impl ServeLimits {
    /// Probe and metrics servers: small answers to the kubelet and Prometheus.
    pub const PROBES: Self = Self {
        max_connections: 64,
        header_read_timeout: Duration::from_secs(5),
        max_connection_age: Duration::from_secs(120),
    };
    /// `/debug/pprof`: a CPU profile may take up to 300 s.
    pub const DEBUG: Self = Self {
        max_connections: 8,
        header_read_timeout: Duration::from_secs(5),
        max_connection_age: Duration::from_secs(360),
    };
    /// The artifact store: uploads and downloads of up to 64 MiB from agents and users.
    pub const STORE: Self = Self {
        max_connections: 1024,
        header_read_timeout: Duration::from_secs(10),
        max_connection_age: Duration::from_secs(15 * 60),
    };
}

/// Serves `router` on `listener` within `limits`, until the listener fails for good.
pub async fn serve<L>(mut listener: L, router: axum::Router, limits: ServeLimits)
where
    L: axum::serve::Listener,
{
    let places = Arc::new(tokio::sync::Semaphore::new(limits.max_connections.max(1)));
    loop {
        let Ok(place) = places.clone().acquire_owned().await else {
            return;
        };
        // `accept` retries transient errors itself.
        let (io, _peer) = listener.accept().await;
        let service = TowerToHyperService::new(router.clone());
        tokio::spawn(async move {
            let _place = place;
            let mut builder = hyper::server::conn::http1::Builder::new();
            builder
                .timer(TokioTimer::new())
                .header_read_timeout(limits.header_read_timeout)
                .keep_alive(true);
            let connection = builder.serve_connection(TokioIo::new(io), service);
            let mut connection = std::pin::pin!(connection);
            if tokio::time::timeout(limits.max_connection_age, connection.as_mut())
                .await
                .is_err()
            {
                connection.as_mut().graceful_shutdown();
                let _ = tokio::time::timeout(SHUTDOWN_GRACE, connection).await;
            }
        });
    }
}
