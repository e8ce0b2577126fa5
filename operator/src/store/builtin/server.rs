//! Serving the built-in store: bind, build the routes, run in the background. Shared by the
//! operator (store in-process, `--store builtin`) and `flamefleet-store` (store apart).

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use super::{BuiltinConfig, BuiltinStore, http};
use crate::store::authorize::{CachedAuthorizer, KubeAuthorizer};
use crate::store::{Result, StoreError};

/// How long a bearer-token decision is reused (a revoked token works at most this long).
const AUTHORIZATION_CACHE_TTL: Duration = Duration::from_secs(10);
/// Most bearer-token decisions kept.
const AUTHORIZATION_CACHE_ENTRIES: usize = 4096;

/// Opens the store in `config.root` and serves it on `listen` in a background task; bearer
/// downloads are checked against the API server behind `client`.
///
/// Returns the store and the bound address (useful with port 0).
///
/// # Errors
/// When the directory cannot be prepared or the address cannot be bound.
pub async fn spawn(
    config: BuiltinConfig,
    listen: SocketAddr,
    client: kube::Client,
) -> Result<(Arc<BuiltinStore>, SocketAddr)> {
    let store = Arc::new(BuiltinStore::open(config).await?);
    let authorizer = Arc::new(CachedAuthorizer::new(
        KubeAuthorizer::new(client),
        AUTHORIZATION_CACHE_TTL,
        AUTHORIZATION_CACHE_ENTRIES,
    ));
    let listener = tokio::net::TcpListener::bind(listen)
        .await
        .map_err(|e| StoreError::Config(format!("binding the store to {listen}: {e}")))?;
    let bound = listener
        .local_addr()
        .map_err(|e| StoreError::Config(format!("binding the store to {listen}: {e}")))?;
    let router = http::router(store.clone(), authorizer);
    tokio::spawn(async move {
        if let Err(e) = axum::serve(listener, router).await {
            tracing::error!("artifact store server stopped: {e}");
        }
    });
    tracing::info!(listen = %bound, "built-in artifact store serving");
    Ok((store, bound))
}
