//! Serving the built-in store: bind, build the routes, run in the background, over HTTPS
//! when given a certificate, within [`ServeLimits::STORE`] (header deadline, connection
//! age and count). Shared by the
//! operator (store in-process, `--store builtin`) and `flamefleet-store` (store apart).

use std::net::SocketAddr;
use std::sync::Arc;

use flamefleet_proto::http_serve::{self, ServeLimits};

use super::tls::{self, TlsFiles, TlsListener};
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
    tls: Option<TlsFiles>,
) -> Result<(Arc<BuiltinStore>, SocketAddr)> {
    let store = Arc::new(BuiltinStore::open(config).await?);
    let listener = tokio::net::TcpListener::bind(listen)
        .await
        .map_err(|e| StoreError::Config(format!("binding the store to {listen}: {e}")))?;
    let bound = listener
        .local_addr()
        .map_err(|e| StoreError::Config(format!("binding the store to {listen}: {e}")))?;
    let router = http::router(store.clone());
    let scheme = if let Some(files) = tls {
        let config = tls::server_config(files)?;
        let listener = TlsListener::new(listener, config)
            .map_err(|e| StoreError::Config(format!("serving TLS on {listen}: {e}")))?;
        tokio::spawn(http_serve::serve(listener, router, ServeLimits::STORE));
        "https"
    } else {
        tokio::spawn(http_serve::serve(listener, router, ServeLimits::STORE));
        "http"
    };
    tracing::info!(listen = %bound, scheme, "built-in artifact store serving");
    Ok((store, bound))
}
