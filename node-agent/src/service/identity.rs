//! The agent's node identity from a Kubernetes CSR: a key generated in memory, a
//! `CertificateSigningRequest` with signer [`AGENT_SIGNER_NAME`] created with the agent's
//! pod-bound ServiceAccount token, and the certificate the operator signs into its status
//! (the API server records who asked, so the operator can check that this pod runs on the
//! node it claims). The certificate is renewed at two thirds of its lifetime and swapped
//! into the running server ([`ServingIdentity::replace`]).
//!
//! The key never leaves the process. The CA that the operator's client certificate must
//! chain to is the last certificate of the issued chain, delivered by the API server.

use std::time::{Duration, SystemTime};

use flamefleet_proto::identity::{AGENT_SIGNER_NAME, agent_common_name, agent_dns_name};
use futures::StreamExt as _;
use k8s_openapi::ByteString;
use k8s_openapi::api::certificates::v1::{
    CertificateSigningRequest, CertificateSigningRequestSpec,
};
use kube::api::{Api, ObjectMeta, PostParams};
use kube::runtime::{WatchStreamExt as _, watcher};
use rcgen::{CertificateParams, DnType, KeyPair};
use rustls::pki_types::CertificateDer;
use rustls::pki_types::pem::PemObject as _;

use super::tls::{ServingIdentity, TlsMaterial};
use super::{Result, ServiceError};

/// Lifetime the agent asks for (the operator may grant less).
pub const REQUESTED_LIFETIME: Duration = Duration::from_secs(24 * 3600);
/// How long to wait for the operator to sign before asking again with a new CSR.
const SIGNING_TIMEOUT: Duration = Duration::from_secs(300);
/// Retry delay after a failed or denied request.
const RETRY_DELAY: Duration = Duration::from_secs(15);

/// A certificate obtained through a CSR.
#[derive(Debug)]
pub struct Issued {
    /// The serving material.
    pub material: TlsMaterial,
    /// When the certificate expires.
    pub not_after: SystemTime,
}

fn tls_err(what: impl std::fmt::Display) -> ServiceError {
    ServiceError::Tls(what.to_string())
}

fn condition(csr: &CertificateSigningRequest, kind: &str) -> Option<String> {
    csr.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .and_then(|cs| cs.iter().find(|c| c.type_ == kind && c.status == "True"))
        .map(|c| {
            format!(
                "{}: {}",
                c.reason.as_deref().unwrap_or(kind),
                c.message.as_deref().unwrap_or("no message")
            )
        })
}

/// The object name of a new CSR for `node`: unique, and within the 253-character limit.
fn csr_name(node: &str) -> String {
    let mut random = [0u8; 5];
    let suffix = match std::fs::File::open("/dev/urandom")
        .and_then(|mut f| std::io::Read::read_exact(&mut f, &mut random))
    {
        Ok(()) => hex::encode(random),
        Err(_) => format!(
            "{:x}",
            SystemTime::now()
                .duration_since(SystemTime::UNIX_EPOCH)
                .map(|d| d.as_nanos())
                .unwrap_or(0)
        ),
    };
    let node: String = node.chars().take(200).collect();
    format!("flamefleet-agent-{node}-{suffix}")
}

/// Expiry of the first certificate of `chain_pem`.
fn not_after(chain_pem: &[u8]) -> Result<SystemTime> {
    let first = CertificateDer::pem_slice_iter(chain_pem)
        .next()
        .ok_or_else(|| tls_err("the issued chain holds no certificate"))?
        .map_err(|e| tls_err(format!("the issued certificate does not parse: {e}")))?;
    let (_, cert) = x509_parser::parse_x509_certificate(&first)
        .map_err(|e| tls_err(format!("the issued certificate does not parse: {e}")))?;
    let secs = u64::try_from(cert.validity().not_after.timestamp()).unwrap_or(0);
    Ok(SystemTime::UNIX_EPOCH + Duration::from_secs(secs))
}

/// Turns the CSR's issued chain into serving material: the chain as issued, the key, and
/// the chain's last certificate (the operator's CA) as the client trust root.
fn material_from(chain_pem: &[u8], key_pem: &str, node: &str) -> Result<Issued> {
    let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(chain_pem)
        .collect::<std::result::Result<_, _>>()
        .map_err(|e| tls_err(format!("the issued chain does not parse: {e}")))?;
    let [leaf, .., ca] = certs.as_slice() else {
        return Err(tls_err(
            "the issued chain must hold the certificate and the operator's CA; is the operator's signer up to date?",
        ));
    };
    let name = agent_dns_name(node);
    let server_name = rustls::pki_types::ServerName::try_from(name.as_str())
        .map_err(|e| tls_err(format!("{name}: {e}")))?;
    webpki::EndEntityCert::try_from(leaf)
        .and_then(|c| c.verify_is_valid_for_subject_name(&server_name))
        .map_err(|_| {
            tls_err(format!(
                "the issued certificate is not for {name}; this pod's token names another node than --node-name {node}"
            ))
        })?;
    let ca_pem = pem_encode(ca);
    Ok(Issued {
        not_after: not_after(chain_pem)?,
        material: TlsMaterial {
            chain_pem: chain_pem.to_vec(),
            key_pem: key_pem.as_bytes().to_vec(),
            ca_pem,
        },
    })
}

fn pem_encode(der: &CertificateDer<'_>) -> Vec<u8> {
    use base64::Engine as _;
    let b64 = base64::engine::general_purpose::STANDARD.encode(der.as_ref());
    let mut out = String::from("-----BEGIN CERTIFICATE-----\n");
    for line in b64.as_bytes().chunks(64) {
        out.push_str(&String::from_utf8_lossy(line));
        out.push('\n');
    }
    out.push_str("-----END CERTIFICATE-----\n");
    out.into_bytes()
}

/// Asks for a certificate for `node` once: creates the CSR and waits for the operator.
///
/// # Errors
/// [`ServiceError::Tls`] when the CSR cannot be created (RBAC), is denied (with the
/// operator's reason), fails, or is not signed in time.
pub async fn request_certificate(client: &kube::Client, node: &str) -> Result<Issued> {
    let key = KeyPair::generate().map_err(|e| tls_err(format!("generating a key: {e}")))?;
    let mut params = CertificateParams::new(vec![agent_dns_name(node)])
        .map_err(|e| tls_err(format!("building the CSR: {e}")))?;
    params
        .distinguished_name
        .push(DnType::CommonName, agent_common_name(node));
    let request = params
        .serialize_request(&key)
        .and_then(|r| r.pem())
        .map_err(|e| tls_err(format!("building the CSR: {e}")))?;
    let name = csr_name(node);
    let csr = CertificateSigningRequest {
        metadata: ObjectMeta {
            name: Some(name.clone()),
            ..ObjectMeta::default()
        },
        spec: CertificateSigningRequestSpec {
            signer_name: AGENT_SIGNER_NAME.to_owned(),
            request: ByteString(request.into_bytes()),
            usages: Some(vec!["digital signature".into(), "server auth".into()]),
            expiration_seconds: i32::try_from(REQUESTED_LIFETIME.as_secs()).ok(),
            ..CertificateSigningRequestSpec::default()
        },
        status: None,
    };
    let api: Api<CertificateSigningRequest> = Api::all(client.clone());
    api.create(&PostParams::default(), &csr).await.map_err(|e| {
        tls_err(format!(
            "creating CertificateSigningRequest {name}: {e}; the agent's ServiceAccount needs create/get/watch on certificatesigningrequests"
        ))
    })?;
    tracing::info!(csr = %name, signer = AGENT_SIGNER_NAME, "waiting for the operator to sign this node's certificate");
    let config = watcher::Config::default().fields(&format!("metadata.name={name}"));
    let stream = watcher(api, config).default_backoff().applied_objects();
    tokio::pin!(stream);
    let wait = async {
        while let Some(event) = stream.next().await {
            let csr = match event {
                Ok(csr) => csr,
                Err(e) => {
                    tracing::warn!(csr = %name, "watching the CSR: {e}");
                    continue;
                }
            };
            if let Some(reason) = condition(&csr, "Denied") {
                return Err(tls_err(format!("the operator denied CSR {name}: {reason}")));
            }
            if let Some(reason) = condition(&csr, "Failed") {
                return Err(tls_err(format!("signing CSR {name} failed: {reason}")));
            }
            if let Some(cert) = csr.status.and_then(|s| s.certificate)
                && !cert.0.is_empty()
            {
                return material_from(&cert.0, &key.serialize_pem(), node);
            }
        }
        Err(tls_err(format!("the watch of CSR {name} ended")))
    };
    tokio::time::timeout(SIGNING_TIMEOUT, wait)
        .await
        .unwrap_or_else(|_| {
            Err(tls_err(format!(
                "CSR {name} was not signed within {}s; is the Flamefleet operator running (and leading)?",
                SIGNING_TIMEOUT.as_secs()
            )))
        })
}

/// Obtains a first certificate, retrying until one is issued (the operator may start after
/// the agents).
pub async fn first_certificate(client: &kube::Client, node: &str) -> Issued {
    loop {
        match request_certificate(client, node).await {
            Ok(issued) => return issued,
            Err(e) => {
                tracing::error!("{e}; asking again in {}s", RETRY_DELAY.as_secs());
                tokio::time::sleep(RETRY_DELAY).await;
            }
        }
    }
}

/// When to renew a certificate expiring at `not_after`: two thirds into its remaining life.
pub fn renewal_delay(not_after: SystemTime, now: SystemTime) -> Duration {
    not_after
        .duration_since(now)
        .map(|left| left * 2 / 3)
        .unwrap_or(Duration::ZERO)
}

/// Renews the certificate before it expires and swaps it into `identity`, forever.
pub async fn keep_renewed(
    client: kube::Client,
    node: String,
    identity: std::sync::Arc<ServingIdentity>,
    mut not_after: SystemTime,
) {
    loop {
        tokio::time::sleep(renewal_delay(not_after, SystemTime::now())).await;
        match request_certificate(&client, &node).await {
            Ok(issued) => match identity.replace(&issued.material) {
                Ok(()) => {
                    not_after = issued.not_after;
                    tracing::info!(%node, "renewed this node's serving certificate");
                }
                Err(e) => tracing::error!("the renewed certificate is unusable: {e}"),
            },
            Err(e) => {
                tracing::error!("renewing this node's certificate: {e}; retrying");
                tokio::time::sleep(RETRY_DELAY).await;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renewal_happens_two_thirds_into_the_remaining_lifetime() {
        let now = SystemTime::UNIX_EPOCH + Duration::from_secs(1_000_000);
        assert_eq!(
            renewal_delay(now + Duration::from_secs(3000), now),
            Duration::from_secs(2000)
        );
        assert_eq!(
            renewal_delay(now - Duration::from_secs(1), now),
            Duration::ZERO
        );
    }

    #[test]
    fn csr_names_are_unique_and_bounded() {
        let a = csr_name("node-1");
        assert!(a.starts_with("flamefleet-agent-node-1-"));
        assert_ne!(a, csr_name("node-1"));
        assert!(csr_name(&"x".repeat(253)).len() <= 253);
    }
}
