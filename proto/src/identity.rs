//! Names in the operator ↔ agent mutual TLS: the identity contract both sides check.
//!
//! - Each agent serves gRPC with a certificate for its own node alone:
//!   DNS name [`agent_dns_name`]`(node)`, issued by the operator's CA through a Kubernetes
//!   `CertificateSigningRequest` with signer [`AGENT_SIGNER_NAME`]. The operator dials an
//!   agent expecting the name of the node it wants, so one node's key cannot serve another
//!   node's captures.
//! - The operator presents a client certificate with DNS name [`OPERATOR_DNS_NAME`] from the
//!   same CA; agents accept no other client.
//!
//! The names live under `.internal`, a top-level domain reserved for private use, so they
//! can never be a public host somebody else holds a certificate for.

use sha2::{Digest, Sha256};

/// `spec.signerName` of the CSRs agents create for their serving certificates.
pub const AGENT_SIGNER_NAME: &str = "flamefleet.dev/agent-serving";

/// The DNS name (subject alternative name) of the operator's client certificate.
pub const OPERATOR_DNS_NAME: &str = "operator.flamefleet.internal";

/// The parent domain of agents' node names.
pub const AGENT_DNS_SUFFIX: &str = "agents.flamefleet.internal";

/// The common name of an agent's certificate for `node`.
pub fn agent_common_name(node: &str) -> String {
    format!("flamefleet-agent:{node}")
}

/// The DNS name an agent serving `node` carries in its certificate, and the one the operator
/// verifies when it dials that node's agent.
///
/// Node names are DNS subdomains, so `<node>.agents.flamefleet.internal` is a valid name
/// unless it exceeds 253 characters; such (rare) names are replaced by a hash label, still
/// unique per node.
pub fn agent_dns_name(node: &str) -> String {
    let plain = format!("{node}.{AGENT_DNS_SUFFIX}");
    if plain.len() <= 253 && node.split('.').all(|l| !l.is_empty() && l.len() <= 63) {
        return plain;
    }
    let digest = Sha256::digest(node.as_bytes());
    let label: String = digest.iter().take(16).map(|b| format!("{b:02x}")).collect();
    format!("h{label}.{AGENT_DNS_SUFFIX}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ordinary_node_names_are_kept_readable() {
        assert_eq!(
            agent_dns_name("worker-1.eu-west"),
            "worker-1.eu-west.agents.flamefleet.internal"
        );
    }

    #[test]
    fn overlong_names_become_a_stable_hash_label() {
        let long = "a".repeat(240);
        let name = agent_dns_name(&long);
        assert!(name.len() <= 253, "{name}");
        assert!(name.starts_with('h') && name.ends_with(AGENT_DNS_SUFFIX));
        assert_eq!(name, agent_dns_name(&long));
        assert_ne!(name, agent_dns_name(&"b".repeat(240)));
    }
}
