//! Serving the built-in store: bind, build the routes, run in the background. Shared by the
//! operator (store in-process, `--store builtin`) and `flamefleet-store` (store apart).

use std::net::SocketAddr;
use std::sync::Arc;

use super::{BuiltinConfig, BuiltinStore, http};
use crate::store::{Result, StoreError};

/// Opens the store in `config.root` and serves it on `listen` in a background task. Every
/// request must carry a URL the operator signed: the store needs no Kubernetes access.
///
/// Returns the store and the bound address (useful with port 0).
///
/// # Errors
/// When the directory cannot be prepared or the address cannot be bound.
pub async fn spawn(
    config: BuiltinConfig,
    listen: SocketAddr,
) -> Result<(Arc<BuiltinStore>, SocketAddr)> {
    let store = Arc::new(BuiltinStore::open(config).await?);
    let listener = tokio::net::TcpListener::bind(listen)
        .await
        .map_err(|e| StoreError::Config(format!("binding the store to {listen}: {e}")))?;
    let bound = listener
        .local_addr()
        .map_err(|e| StoreError::Config(format!("binding the store to {listen}: {e}")))?;
    let router = http::router(store.clone());
    tokio::spawn(async move {
        if let Err(e) = axum::serve(listener, router).await {
            tracing::error!("artifact store server stopped: {e}");
        }
    });
    tracing::info!(listen = %bound, "built-in artifact store serving");
    Ok((store, bound))
}
