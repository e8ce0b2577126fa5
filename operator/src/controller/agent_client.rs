//! mTLS gRPC connections from the operator to agents.
//!
//! Every connection verifies that the agent serves the node the operator wants
//! ([`agent_dns_name`] of that node), so a certificate stolen from one node cannot answer for
//! another. The operator's own client certificate comes either from files (set up by hand)
//! or from the operator's CA ([`AgentConnector::from_ca`]), which issues a short-lived one
//! and renews it in the background.

use std::path::Path;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use flamefleet_proto::agent::agent_service_client::AgentServiceClient;
use flamefleet_proto::identity::agent_dns_name;
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint, Identity};

use super::agents::AgentEndpoint;
use crate::identity::ca::OperatorCa;
use crate::{Error, Result};

/// Lifetime of the operator's client certificates issued by its CA.
const CLIENT_CERT_TTL: Duration = Duration::from_secs(24 * 3600);
/// How often the client certificate is renewed (a third of its lifetime: two spare renewals).
const CLIENT_CERT_RENEWAL: Duration = Duration::from_secs(8 * 3600);

/// The CA that agents' certificates chain to, and the operator's client identity, PEM.
#[derive(Clone)]
struct TlsMaterial {
    ca_pem: Vec<u8>,
    cert_pem: Vec<u8>,
    key_pem: Vec<u8>,
}

/// Opens mTLS channels to agents with the operator's client certificate.
#[derive(Clone)]
pub struct AgentConnector {
    material: Arc<RwLock<TlsMaterial>>,
    connect_timeout: Duration,
}

impl std::fmt::Debug for AgentConnector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AgentConnector")
            .field("connect_timeout", &self.connect_timeout)
            .finish_non_exhaustive()
    }
}

fn read(path: &Path, what: &str) -> Result<Vec<u8>> {
    std::fs::read(path).map_err(|e| {
        Error::Tls(format!(
            "cannot read the {what} {}: {e}; pass a PEM file",
            path.display()
        ))
    })
}

impl AgentConnector {
    /// Loads the CA (that signed the agents' serving certificates) and the operator's client
    /// certificate and key, all PEM.
    ///
    /// # Errors
    /// [`Error::Tls`] when a file cannot be read.
    pub fn from_files(
        ca: &Path,
        cert: &Path,
        key: &Path,
        connect_timeout: Duration,
    ) -> Result<Self> {
        Ok(Self {
            material: Arc::new(RwLock::new(TlsMaterial {
                ca_pem: read(ca, "CA certificate")?,
                cert_pem: read(cert, "client certificate")?,
                key_pem: read(key, "client key")?,
            })),
            connect_timeout,
        })
    }

    /// Issues the operator a client certificate from `ca` and renews it in the background
    /// for as long as the connector (or a clone) lives.
    ///
    /// # Errors
    /// [`Error::Tls`] when the first certificate cannot be issued.
    pub fn from_ca(ca: Arc<OperatorCa>, connect_timeout: Duration) -> Result<Self> {
        let issue = |ca: &OperatorCa| -> Result<TlsMaterial> {
            let pair = ca.issue_operator_client(CLIENT_CERT_TTL)?;
            Ok(TlsMaterial {
                ca_pem: ca.cert_pem().as_bytes().to_vec(),
                cert_pem: pair.chain_pem.into_bytes(),
                key_pem: pair.key_pem.into_bytes(),
            })
        };
        let material = Arc::new(RwLock::new(issue(&ca)?));
        let weak = Arc::downgrade(&material);
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(CLIENT_CERT_RENEWAL).await;
                let Some(material) = weak.upgrade() else {
                    return;
                };
                match issue(&ca) {
                    Ok(fresh) => {
                        if let Ok(mut current) = material.write() {
                            *current = fresh;
                        }
                        tracing::info!("renewed the operator's agent client certificate");
                    }
                    Err(e) => tracing::error!(
                        "renewing the operator's agent client certificate: {e}; the current one stays in use"
                    ),
                }
            }
        });
        Ok(Self {
            material,
            connect_timeout,
        })
    }

    fn tls_for(&self, node: &str) -> Result<ClientTlsConfig, String> {
        let m = self
            .material
            .read()
            .map_err(|_| "the TLS material lock is poisoned".to_owned())?
            .clone();
        Ok(ClientTlsConfig::new()
            .ca_certificate(Certificate::from_pem(m.ca_pem))
            .identity(Identity::from_pem(m.cert_pem, m.key_pem))
            .domain_name(agent_dns_name(node)))
    }

    /// Connects to `agent`, which must prove it serves `agent.node`; the error is a
    /// human-readable transport error.
    pub async fn connect(
        &self,
        agent: &AgentEndpoint,
    ) -> std::result::Result<AgentServiceClient<Channel>, String> {
        let endpoint = Endpoint::from_shared(agent.uri())
            .map_err(|e| format!("invalid agent URI {}: {e}", agent.uri()))?
            .tls_config(self.tls_for(&agent.node)?)
            .map_err(|e| format!("TLS configuration: {e}"))?
            .connect_timeout(self.connect_timeout)
            .tcp_nodelay(true);
        let channel = endpoint.connect().await.map_err(|e| describe(&e))?;
        Ok(AgentServiceClient::new(channel))
    }
}

/// The full chain of a transport error (tonic's top-level message is just "transport error").
pub fn describe(error: &(dyn std::error::Error + 'static)) -> String {
    let mut parts = vec![error.to_string()];
    let mut source = error.source();
    while let Some(e) = source {
        let text = e.to_string();
        if parts.last() != Some(&text) {
            parts.push(text);
        }
        source = e.source();
    }
    parts.join(": ")
}
