//! mTLS gRPC connections from the operator to agents.

use std::path::Path;
use std::time::Duration;

use flamefleet_proto::agent::agent_service_client::AgentServiceClient;
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint, Identity};

use super::agents::AgentEndpoint;
use crate::{Error, Result};

/// The DNS name every agent's serving certificate carries (the agents' Service), which the
/// operator verifies whatever IP it dials.
pub const AGENT_TLS_NAME: &str = "flamefleet-agent.flamefleet.svc";

/// Opens mTLS channels to agents with the operator's client certificate.
#[derive(Clone)]
pub struct AgentConnector {
    tls: ClientTlsConfig,
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
    pub fn from_files(
        ca: &Path,
        cert: &Path,
        key: &Path,
        connect_timeout: Duration,
    ) -> Result<Self> {
        let tls = ClientTlsConfig::new()
            .ca_certificate(Certificate::from_pem(read(ca, "CA certificate")?))
            .identity(Identity::from_pem(
                read(cert, "client certificate")?,
                read(key, "client key")?,
            ))
            .domain_name(AGENT_TLS_NAME);
        Ok(Self {
            tls,
            connect_timeout,
        })
    }

    /// Connects to `agent`; the error is a human-readable transport error.
    pub async fn connect(
        &self,
        agent: &AgentEndpoint,
    ) -> std::result::Result<AgentServiceClient<Channel>, String> {
        let endpoint = Endpoint::from_shared(agent.uri())
            .map_err(|e| format!("invalid agent URI {}: {e}", agent.uri()))?
            .tls_config(self.tls.clone())
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
