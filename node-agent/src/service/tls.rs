//! The agent's mutual-TLS settings: a serving certificate and key, and the CA
//! that every client certificate must chain to (the operator's). A client
//! without a certificate, or with one from another CA, fails the handshake.

use std::path::{Path, PathBuf};

use tonic::transport::{Certificate, Identity, ServerTlsConfig};

use super::{Result, ServiceError};

/// Paths of the PEM files the agent serves TLS with.
#[derive(Debug, Clone)]
pub struct TlsFiles {
    /// CA certificate(s) client certificates must chain to.
    pub ca: PathBuf,
    /// Serving certificate chain.
    pub cert: PathBuf,
    /// Serving private key.
    pub key: PathBuf,
}

fn read_pem(what: &'static str, path: &Path) -> Result<Vec<u8>> {
    let bytes = std::fs::read(path).map_err(|source| ServiceError::TlsFile {
        what,
        path: path.to_path_buf(),
        source,
    })?;
    if !bytes.windows(11).any(|w| w == b"-----BEGIN ") {
        return Err(ServiceError::TlsPem {
            what,
            path: path.to_path_buf(),
        });
    }
    Ok(bytes)
}

impl TlsFiles {
    /// Reads the files and builds tonic's server TLS configuration with client
    /// authentication required.
    ///
    /// # Errors
    /// [`ServiceError::TlsFile`] when a file cannot be read,
    /// [`ServiceError::TlsPem`] when it holds no PEM block.
    pub fn server_config(&self) -> Result<ServerTlsConfig> {
        let ca = read_pem("CA certificate (--tls-ca)", &self.ca)?;
        let cert = read_pem("serving certificate (--tls-cert)", &self.cert)?;
        let key = read_pem("serving key (--tls-key)", &self.key)?;
        Ok(ServerTlsConfig::new()
            .identity(Identity::from_pem(cert, key))
            .client_ca_root(Certificate::from_pem(ca))
            .client_auth_optional(false))
    }
}
