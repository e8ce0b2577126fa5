//! HTTPS for the built-in store: a serving certificate read from PEM files and re-read when
//! they change (a mounted Secret the operator renews), so certificates rotate without a
//! restart; handshakes run off the accept loop, each bounded in time.

use std::path::PathBuf;
use std::sync::{Arc, RwLock};
use std::time::{Duration, SystemTime};

use rustls::pki_types::pem::PemObject as _;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::{ClientHello, ResolvesServerCert};
use rustls::sign::CertifiedKey;

use flamefleet_proto::tls_accept::{Accepted, accept_tls};

use crate::store::{Result, StoreError};

/// How often the files are checked for a new certificate.
const RELOAD_EVERY: Duration = Duration::from_secs(30);
/// Longest a client may take to finish its handshake.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// The PEM files the store serves HTTPS with.
#[derive(Debug, Clone)]
pub struct TlsFiles {
    /// Certificate chain (leaf first).
    pub cert: PathBuf,
    /// Private key (PKCS#8, SEC1 or PKCS#1).
    pub key: PathBuf,
}

fn config_err(what: impl std::fmt::Display) -> StoreError {
    StoreError::Config(what.to_string())
}

impl TlsFiles {
    fn modified(&self) -> Option<(SystemTime, SystemTime)> {
        let m = |p: &PathBuf| std::fs::metadata(p).and_then(|m| m.modified()).ok();
        Some((m(&self.cert)?, m(&self.key)?))
    }

    /// Reads and checks the pair.
    ///
    /// # Errors
    /// Unreadable files, no certificate, a key that does not parse or does not match.
    pub fn load(&self) -> Result<CertifiedKey> {
        let read = |what: &str, p: &PathBuf| {
            std::fs::read(p).map_err(|e| {
                config_err(format!(
                    "reading the store's TLS {what} {}: {e}",
                    p.display()
                ))
            })
        };
        let cert_pem = read("certificate", &self.cert)?;
        let key_pem = read("key", &self.key)?;
        let chain: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(&cert_pem)
            .collect::<std::result::Result<_, _>>()
            .map_err(|e| {
                config_err(format!(
                    "{}: not a PEM certificate chain: {e}",
                    self.cert.display()
                ))
            })?;
        if chain.is_empty() {
            return Err(config_err(format!(
                "{}: holds no certificate",
                self.cert.display()
            )));
        }
        let key = PrivateKeyDer::from_pem_slice(&key_pem).map_err(|e| {
            config_err(format!(
                "{}: not a PEM private key: {e}",
                self.key.display()
            ))
        })?;
        CertifiedKey::from_der(chain, key, &rustls::crypto::ring::default_provider()).map_err(|e| {
            config_err(format!(
                "{} does not match the certificate {}: {e}",
                self.key.display(),
                self.cert.display()
            ))
        })
    }
}

/// The certificate in use; a background task swaps in a new one when the files change.
#[derive(Debug)]
struct Current(RwLock<Arc<CertifiedKey>>);

impl ResolvesServerCert for Current {
    fn resolve(&self, _hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        self.0.read().ok().map(|k| k.clone())
    }
}

/// A server configuration serving `files`, reloaded when they change. A pair that fails to
/// load at start is an error; a bad pair later is logged and the previous one kept.
///
/// # Errors
/// See [`TlsFiles::load`].
pub fn server_config(files: TlsFiles) -> Result<Arc<rustls::ServerConfig>> {
    let current = Arc::new(Current(RwLock::new(Arc::new(files.load()?))));
    let watched = Arc::downgrade(&current);
    tokio::spawn(async move {
        let mut seen = files.modified();
        loop {
            tokio::time::sleep(RELOAD_EVERY).await;
            let Some(current) = watched.upgrade() else {
                return;
            };
            let now = files.modified();
            if now == seen {
                continue;
            }
            match files.load() {
                Ok(key) => {
                    if let Ok(mut slot) = current.0.write() {
                        *slot = Arc::new(key);
                    }
                    seen = now;
                    tracing::info!(cert = %files.cert.display(), "store TLS certificate reloaded");
                }
                // A Secret volume is updated in one atomic swap, but a hand-made pair may be
                // caught half written: try again next time.
                Err(e) => tracing::warn!("keeping the current TLS certificate: {e}"),
            }
        }
    });
    let mut config = rustls::ServerConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .map_err(config_err)?
    .with_no_client_auth()
    .with_cert_resolver(current);
    // HTTP/1.1 only: the store's server (flamefleet_proto::http_serve) speaks HTTP/1.1 with
    // per-connection bounds. Offering h2 here made every client that prefers it (the
    // kubelet's probes, curl, Go and browser clients) negotiate a protocol the server then
    // does not speak, and fail.
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(Arc::new(config))
}

/// A listener of TLS connections for `axum::serve` (handshakes off the accept loop, see
/// [`flamefleet_proto::tls_accept`]).
pub struct TlsListener {
    rx: tokio::sync::mpsc::Receiver<Accepted>,
    local: std::net::SocketAddr,
}

impl TlsListener {
    /// Accepts on `listener` with `config`.
    ///
    /// # Errors
    /// When the listener has no local address.
    pub fn new(
        listener: tokio::net::TcpListener,
        config: Arc<rustls::ServerConfig>,
    ) -> std::io::Result<Self> {
        let local = listener.local_addr()?;
        Ok(Self {
            rx: accept_tls(listener, config, HANDSHAKE_TIMEOUT),
            local,
        })
    }
}

impl axum::serve::Listener for TlsListener {
    type Io = tokio_rustls::server::TlsStream<tokio::net::TcpStream>;
    type Addr = std::net::SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        match self.rx.recv().await {
            Some(accepted) => accepted,
            // The accept loop only ends when this receiver is gone.
            None => std::future::pending().await,
        }
    }

    fn local_addr(&self) -> std::io::Result<Self::Addr> {
        Ok(self.local)
    }
}
