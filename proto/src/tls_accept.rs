//! Accepting TLS connections for a server (the agent's gRPC, the built-in store's HTTPS):
//! handshakes run off the accept loop, so a slow or silent client never holds up others,
//! each bounded by a timeout; failed handshakes are logged and dropped.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::net::{TcpListener, TcpStream};
use tokio_rustls::server::TlsStream;

/// A finished handshake and the peer's address.
pub type Accepted = (TlsStream<TcpStream>, SocketAddr);

/// Accepts on `listener` with `config` in a background task; finished handshakes arrive on
/// the returned channel. The task ends when the receiver is dropped.
pub fn accept_tls(
    listener: TcpListener,
    config: Arc<rustls::ServerConfig>,
    timeout: Duration,
) -> tokio::sync::mpsc::Receiver<Accepted> {
    let acceptor = tokio_rustls::TlsAcceptor::from(config);
    // Bounded: a flood of handshakes waits in the kernel's backlog instead of in memory.
    let (tx, rx) = tokio::sync::mpsc::channel(64);
    tokio::spawn(async move {
        loop {
            let (tcp, peer) = match listener.accept().await {
                Ok(accepted) => accepted,
                Err(e) => {
                    tracing::warn!("accepting a connection: {e}");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            };
            let _ = tcp.set_nodelay(true);
            let acceptor = acceptor.clone();
            let sender = tx.clone();
            tokio::spawn(async move {
                match tokio::time::timeout(timeout, acceptor.accept(tcp)).await {
                    Ok(Ok(tls)) => {
                        let _ = sender.send((tls, peer)).await;
                    }
                    Ok(Err(e)) => tracing::info!(%peer, "TLS handshake refused: {e}"),
                    Err(_) => tracing::info!(%peer, "TLS handshake timed out"),
                }
            });
            if tx.is_closed() {
                return;
            }
        }
    });
    rx
}
