//! The agent's mutual TLS: the serving certificate (this node's, rotated without a restart)
//! and the check that every client is the operator.
//!
//! - A client must present a certificate that chains to the CA the agent trusts **and**
//!   names [`OPERATOR_DNS_NAME`]; anything else fails the handshake. Agents' own
//!   certificates come from the same CA but are for server auth only, so one node's key
//!   cannot command another node's agent.
//! - The serving certificate and the trusted CA live behind locks that [`ServingIdentity::
//!   replace`] swaps: new connections use the new certificate, open ones finish on the old.
//!
//! The material comes from files ([`TlsFiles`], set up by hand or by tests) or from a
//! Kubernetes CSR signed by the operator ([`super::identity`]).

use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};

use flamefleet_proto::identity::OPERATOR_DNS_NAME;
use rustls::client::danger::HandshakeSignatureValid;
use rustls::pki_types::pem::PemObject as _;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
use rustls::server::danger::{ClientCertVerified, ClientCertVerifier};
use rustls::server::{ClientHello, ResolvesServerCert, WebPkiClientVerifier};
use rustls::sign::CertifiedKey;
use rustls::{DigitallySignedStruct, DistinguishedName, RootCertStore, SignatureScheme};

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

/// Serving material in PEM: the certificate chain, its key, and the CA clients chain to.
#[derive(Clone)]
pub struct TlsMaterial {
    /// The serving certificate, then any intermediates.
    pub chain_pem: Vec<u8>,
    /// Its private key.
    pub key_pem: Vec<u8>,
    /// The CA(s) the operator's client certificate must chain to.
    pub ca_pem: Vec<u8>,
}

impl std::fmt::Debug for TlsMaterial {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("TlsMaterial { .. }")
    }
}

impl TlsFiles {
    /// Reads the three files.
    ///
    /// # Errors
    /// [`ServiceError::TlsFile`] when a file cannot be read,
    /// [`ServiceError::TlsPem`] when it holds no PEM block.
    pub fn read(&self) -> Result<TlsMaterial> {
        Ok(TlsMaterial {
            ca_pem: read_pem("CA certificate (--tls-ca)", &self.ca)?,
            chain_pem: read_pem("serving certificate (--tls-cert)", &self.cert)?,
            key_pem: read_pem("serving key (--tls-key)", &self.key)?,
        })
    }
}

fn tls_err(what: impl std::fmt::Display) -> ServiceError {
    ServiceError::Tls(what.to_string())
}

fn certified_key(material: &TlsMaterial) -> Result<CertifiedKey> {
    let chain: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(&material.chain_pem)
        .collect::<std::result::Result<_, _>>()
        .map_err(|e| tls_err(format!("the serving certificate chain does not parse: {e}")))?;
    if chain.is_empty() {
        return Err(tls_err(
            "the serving certificate chain holds no certificate",
        ));
    }
    let key = PrivateKeyDer::from_pem_slice(&material.key_pem)
        .map_err(|e| tls_err(format!("the serving key does not parse: {e}")))?;
    let provider = rustls::crypto::ring::default_provider();
    CertifiedKey::from_der(chain, key, &provider).map_err(|e| {
        tls_err(format!(
            "the serving key does not match its certificate: {e}"
        ))
    })
}

fn operator_verifier(ca_pem: &[u8]) -> Result<Arc<dyn ClientCertVerifier>> {
    let mut roots = RootCertStore::empty();
    for cert in CertificateDer::pem_slice_iter(ca_pem) {
        let cert = cert.map_err(|e| tls_err(format!("the CA certificate does not parse: {e}")))?;
        roots
            .add(cert)
            .map_err(|e| tls_err(format!("the CA certificate is unusable: {e}")))?;
    }
    if roots.is_empty() {
        return Err(tls_err("no CA certificate to check clients against"));
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider)
        .build()
        .map_err(|e| tls_err(format!("building the client verifier: {e}")))
}

/// The agent's current serving certificate and client verifier, swappable at run time.
#[derive(Debug)]
pub struct ServingIdentity {
    cert: RwLock<Arc<CertifiedKey>>,
    verifier: RwLock<Arc<dyn ClientCertVerifier>>,
}

impl ServingIdentity {
    /// An identity serving `material`.
    ///
    /// # Errors
    /// [`ServiceError::Tls`] when the material does not parse or does not fit together.
    pub fn new(material: &TlsMaterial) -> Result<Arc<Self>> {
        Ok(Arc::new(Self {
            cert: RwLock::new(Arc::new(certified_key(material)?)),
            verifier: RwLock::new(operator_verifier(&material.ca_pem)?),
        }))
    }

    /// Serves `material` from now on (new connections); checked before anything changes.
    ///
    /// # Errors
    /// [`ServiceError::Tls`] as for [`ServingIdentity::new`]; the old material stays.
    pub fn replace(&self, material: &TlsMaterial) -> Result<()> {
        let cert = Arc::new(certified_key(material)?);
        let verifier = operator_verifier(&material.ca_pem)?;
        if let Ok(mut c) = self.cert.write() {
            *c = cert;
        }
        if let Ok(mut v) = self.verifier.write() {
            *v = verifier;
        }
        Ok(())
    }

    fn current_verifier(&self) -> Option<Arc<dyn ClientCertVerifier>> {
        self.verifier.read().ok().map(|v| Arc::clone(&v))
    }

    /// A rustls server configuration that always uses the current material, requires a
    /// client certificate naming the operator, and speaks HTTP/2 (gRPC).
    pub fn server_config(self: &Arc<Self>) -> Arc<rustls::ServerConfig> {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        // The safe default protocol versions cannot fail with ring's provider.
        let builder = rustls::ServerConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .unwrap_or_else(|_| unreachable!("ring supports TLS 1.2 and 1.3"));
        let mut config = builder
            .with_client_cert_verifier(Arc::new(OperatorOnly(Arc::clone(self))))
            .with_cert_resolver(Arc::new(CurrentCert(Arc::clone(self))));
        config.alpn_protocols = vec![b"h2".to_vec()];
        // One TLS 1.3 ticket per connection (rustls sends two by default). The operator
        // resumes with one (and uses it up), so one keeps its cache at a ticket or two per
        // agent where two would pile up to rustls' eight per agent across requests.
        config.send_tls13_tickets = 1;
        Arc::new(config)
    }
}

#[derive(Debug)]
struct CurrentCert(Arc<ServingIdentity>);

impl ResolvesServerCert for CurrentCert {
    fn resolve(&self, _hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        self.0.cert.read().ok().map(|c| Arc::clone(&c))
    }
}

/// Chain verification by the current CA, then the operator's name on the certificate.
#[derive(Debug)]
struct OperatorOnly(Arc<ServingIdentity>);

fn unavailable() -> rustls::Error {
    rustls::Error::General("the agent's client verifier is unavailable".into())
}

impl ClientCertVerifier for OperatorOnly {
    fn root_hint_subjects(&self) -> &[DistinguishedName] {
        // Hints are optional; the operator sends its one certificate regardless.
        &[]
    }

    fn verify_client_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        now: UnixTime,
    ) -> std::result::Result<ClientCertVerified, rustls::Error> {
        let verifier = self.0.current_verifier().ok_or_else(unavailable)?;
        verifier.verify_client_cert(end_entity, intermediates, now)?;
        let cert = webpki::EndEntityCert::try_from(end_entity)
            .map_err(|e| rustls::Error::General(format!("client certificate: {e}")))?;
        let operator = ServerName::try_from(OPERATOR_DNS_NAME)
            .map_err(|e| rustls::Error::General(e.to_string()))?;
        cert.verify_is_valid_for_subject_name(&operator).map_err(|_| {
            rustls::Error::General(format!(
                "the client certificate does not name {OPERATOR_DNS_NAME}: only the Flamefleet operator may call agents"
            ))
        })?;
        Ok(ClientCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> std::result::Result<HandshakeSignatureValid, rustls::Error> {
        self.0
            .current_verifier()
            .ok_or_else(unavailable)?
            .verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> std::result::Result<HandshakeSignatureValid, rustls::Error> {
        self.0
            .current_verifier()
            .ok_or_else(unavailable)?
            .verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0
            .current_verifier()
            .map(|v| v.supported_verify_schemes())
            .unwrap_or_default()
    }
}

/// TLS connections accepted on `listener`, handshakes done off the accept loop (a slow or
/// silent client never holds up others; each handshake has `timeout`). Failed handshakes
/// are logged and dropped.
pub fn incoming(
    listener: tokio::net::TcpListener,
    config: Arc<rustls::ServerConfig>,
    timeout: std::time::Duration,
) -> impl futures::Stream<Item = std::io::Result<tokio_rustls::server::TlsStream<tokio::net::TcpStream>>>
{
    use futures::StreamExt as _;
    tokio_stream::wrappers::ReceiverStream::new(flamefleet_proto::tls_accept::accept_tls(
        listener, config, timeout,
    ))
    .map(|(tls, _peer)| Ok(tls))
}
