//! The hollow agents' mutual TLS, as strict as the real agent's (node-agent
//! `service/tls.rs`): each node serves its own certificate (from the CA the operator
//! trusts, naming the node with `agent_dns_name`), and a client must present a certificate
//! that chains to that CA and names the operator.

use std::sync::Arc;

use flamefleet_proto::identity::OPERATOR_DNS_NAME;
use rustls::client::danger::HandshakeSignatureValid;
use rustls::pki_types::pem::PemObject as _;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
use rustls::server::WebPkiClientVerifier;
use rustls::server::danger::{ClientCertVerified, ClientCertVerifier};
use rustls::{DigitallySignedStruct, DistinguishedName, RootCertStore, SignatureScheme};

use super::HollowError;

fn tls_err(what: impl std::fmt::Display) -> HollowError {
    HollowError::Tls(what.to_string())
}

/// The verifier every hollow node shares: chain to `ca_pem`, then the operator's name.
///
/// # Errors
/// [`HollowError::Tls`] when the CA does not parse.
pub fn operator_verifier(ca_pem: &[u8]) -> Result<Arc<dyn ClientCertVerifier>, HollowError> {
    let mut roots = RootCertStore::empty();
    for cert in CertificateDer::pem_slice_iter(ca_pem) {
        let cert = cert.map_err(|e| tls_err(format!("the CA certificate does not parse: {e}")))?;
        roots
            .add(cert)
            .map_err(|e| tls_err(format!("the CA certificate is unusable: {e}")))?;
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let chain = WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider)
        .build()
        .map_err(|e| tls_err(format!("building the client verifier: {e}")))?;
    Ok(Arc::new(OperatorOnly(chain)))
}

/// The server configuration of one node: its certificate, the shared verifier, HTTP/2.
///
/// # Errors
/// [`HollowError::Tls`] when the certificate or key does not parse.
pub fn server_config(
    cert_pem: &[u8],
    key_pem: &[u8],
    verifier: Arc<dyn ClientCertVerifier>,
) -> Result<Arc<rustls::ServerConfig>, HollowError> {
    let chain: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(cert_pem)
        .collect::<Result<_, _>>()
        .map_err(|e| tls_err(format!("the serving certificate does not parse: {e}")))?;
    let key = PrivateKeyDer::from_pem_slice(key_pem)
        .map_err(|e| tls_err(format!("the serving key does not parse: {e}")))?;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| tls_err(format!("TLS versions: {e}")))?
        .with_client_cert_verifier(verifier)
        .with_single_cert(chain, key)
        .map_err(|e| tls_err(format!("the serving key does not match: {e}")))?;
    config.alpn_protocols = vec![b"h2".to_vec()];
    // As the real agent (node-agent/src/service/tls.rs): one ticket per connection.
    config.send_tls13_tickets = 1;
    Ok(Arc::new(config))
}

#[derive(Debug)]
struct OperatorOnly(Arc<dyn ClientCertVerifier>);

impl ClientCertVerifier for OperatorOnly {
    fn root_hint_subjects(&self) -> &[DistinguishedName] {
        &[]
    }

    fn verify_client_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        now: UnixTime,
    ) -> Result<ClientCertVerified, rustls::Error> {
        self.0.verify_client_cert(end_entity, intermediates, now)?;
        let cert = webpki::EndEntityCert::try_from(end_entity)
            .map_err(|e| rustls::Error::General(format!("client certificate: {e}")))?;
        let operator = ServerName::try_from(OPERATOR_DNS_NAME)
            .map_err(|e| rustls::Error::General(e.to_string()))?;
        cert.verify_is_valid_for_subject_name(&operator)
            .map_err(|_| {
                rustls::Error::General(format!(
                    "the client certificate does not name {OPERATOR_DNS_NAME}"
                ))
            })?;
        Ok(ClientCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.0.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.0.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.supported_verify_schemes()
    }
}
