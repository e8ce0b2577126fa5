//! The operator's certificate authority for operator ↔ agent mutual TLS.
//!
//! It lives in a `kubernetes.io/tls` Secret of the operator's namespace (`tls.crt`,
//! `tls.key`). On first start the operator generates it (ECDSA P-256, ten years) and creates
//! the Secret; every replica then loads the same one, so a restart or a new leader keeps
//! trusting the agents' certificates. A cluster admin may instead provide the Secret (from
//! their own PKI, e.g. cert-manager) with an ECDSA or RSA key in PKCS#8.
//!
//! The CA issues three kinds of certificates, both short-lived and renewed automatically:
//! - the operator's client certificate ([`OperatorCa::issue_operator_client`]), DNS name
//!   [`OPERATOR_DNS_NAME`], client auth only: agents accept no other client;
//! - an agent's serving certificate for exactly one node ([`OperatorCa::sign_agent`]),
//!   DNS name [`agent_dns_name`], server auth only, for the key in the agent's CSR;
//! - the built-in store's serving certificate ([`OperatorCa::issue_store_server`]) for the
//!   host names of its URLs, server auth only (see [`super::store_cert`]).

use std::collections::BTreeMap;
use std::time::Duration;

use flamefleet_proto::identity::{OPERATOR_DNS_NAME, agent_common_name, agent_dns_name};
use k8s_openapi::ByteString;
use rcgen::{
    BasicConstraints, CertificateParams, CertificateSigningRequestParams, DnType,
    ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair, KeyUsagePurpose, SanType,
};

use crate::{Error, Result, owned_secret};

/// Secret keys of a `kubernetes.io/tls` Secret.
const CERT_KEY: &str = "tls.crt";
const KEY_KEY: &str = "tls.key";
/// Validity of a generated CA.
const CA_VALIDITY: Duration = Duration::from_secs(10 * 365 * 24 * 3600);
/// Certificates are valid from a little before now, for clocks slightly behind ours.
const BACKDATE: Duration = Duration::from_secs(5 * 60);

/// A certificate and its private key, PEM.
#[derive(Clone)]
pub struct IssuedPair {
    /// The certificate, followed by the CA certificate.
    pub chain_pem: String,
    /// The private key (PKCS#8).
    pub key_pem: String,
    /// When the certificate expires.
    pub not_after: std::time::SystemTime,
}

impl std::fmt::Debug for IssuedPair {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IssuedPair")
            .field("not_after", &self.not_after)
            .finish_non_exhaustive()
    }
}

/// The operator's CA.
pub struct OperatorCa {
    issuer: Issuer<'static, KeyPair>,
    cert_pem: String,
}

impl std::fmt::Debug for OperatorCa {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("OperatorCa { .. }")
    }
}

fn tls_err(what: impl std::fmt::Display) -> impl FnOnce(rcgen::Error) -> Error {
    let what = what.to_string();
    move |e| Error::Tls(format!("{what}: {e}"))
}

fn validity(params: &mut CertificateParams, ttl: Duration) -> std::time::SystemTime {
    let now = std::time::SystemTime::now();
    let not_after = now + ttl;
    params.not_before = (now - BACKDATE).into();
    params.not_after = not_after.into();
    not_after
}

impl OperatorCa {
    /// Loads a CA from its certificate and key (PEM).
    ///
    /// # Errors
    /// [`Error::Tls`] when either does not parse or the certificate is not a CA.
    pub fn from_pem(cert_pem: &str, key_pem: &str) -> Result<Self> {
        let key = KeyPair::from_pem(key_pem).map_err(tls_err(
            "the CA key does not parse (expected a PKCS#8 ECDSA or RSA key in PEM)",
        ))?;
        let issuer = Issuer::from_ca_cert_pem(cert_pem, key).map_err(tls_err(
            "the CA certificate does not parse or does not match its key",
        ))?;
        Ok(Self {
            issuer,
            cert_pem: cert_pem.to_owned(),
        })
    }

    /// Generates a new self-signed CA; returns it and its key in PEM.
    ///
    /// # Errors
    /// [`Error::Tls`] when key generation or signing fails.
    pub fn generate(common_name: &str) -> Result<(Self, String)> {
        let key = KeyPair::generate().map_err(tls_err("generating the CA key"))?;
        let mut params = CertificateParams::new(Vec::<String>::new())
            .map_err(tls_err("building the CA certificate"))?;
        params
            .distinguished_name
            .push(DnType::CommonName, common_name);
        params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
        params.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        validity(&mut params, CA_VALIDITY);
        let cert = params
            .self_signed(&key)
            .map_err(tls_err("self-signing the CA"))?;
        let key_pem = key.serialize_pem();
        Ok((
            Self {
                issuer: Issuer::new(params, key),
                cert_pem: cert.pem(),
            },
            key_pem,
        ))
    }

    /// Loads the CA from Secret `name` in `namespace`, creating the Secret with a new CA when
    /// it does not exist. Concurrent replicas agree: whoever creates it first wins, the others
    /// read it.
    ///
    /// # Errors
    /// API errors, or [`Error::Tls`] when the Secret exists but does not hold a usable CA.
    pub async fn load_or_create(
        client: &kube::Client,
        namespace: &str,
        name: &str,
    ) -> Result<Self> {
        let secret =
            owned_secret::get_or_create(client, namespace, name, "kubernetes.io/tls", || {
                let (ca, key_pem) = Self::generate("flamefleet-operator-ca")?;
                Ok(BTreeMap::from([
                    (CERT_KEY.to_owned(), ByteString(ca.cert_pem.into_bytes())),
                    (KEY_KEY.to_owned(), ByteString(key_pem.into_bytes())),
                ]))
            })
            .await?;
        let text = |key: &str| -> Result<String> {
            String::from_utf8(owned_secret::field(&secret, key)?.to_vec()).map_err(|_| {
                Error::Tls(format!(
                    "{key} of the CA Secret {namespace}/{name} is not PEM text"
                ))
            })
        };
        Self::from_pem(&text(CERT_KEY)?, &text(KEY_KEY)?).map_err(|e| {
            Error::Tls(format!(
                "the CA Secret {namespace}/{name}: {e} (expected a kubernetes.io/tls Secret with tls.crt and tls.key; delete it to let the operator generate one)"
            ))
        })
    }

    /// The CA certificate, PEM.
    pub fn cert_pem(&self) -> &str {
        &self.cert_pem
    }

    /// A fresh client certificate and key for the operator, valid for `ttl`.
    ///
    /// # Errors
    /// [`Error::Tls`] when generation or signing fails.
    pub fn issue_operator_client(&self, ttl: Duration) -> Result<IssuedPair> {
        let key = KeyPair::generate().map_err(tls_err("generating the operator's client key"))?;
        let mut params = CertificateParams::new(vec![OPERATOR_DNS_NAME.to_owned()])
            .map_err(tls_err("building the operator's client certificate"))?;
        params
            .distinguished_name
            .push(DnType::CommonName, "flamefleet-operator");
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        params.use_authority_key_identifier_extension = true;
        let not_after = validity(&mut params, ttl);
        let cert = params
            .signed_by(&key, &self.issuer)
            .map_err(tls_err("signing the operator's client certificate"))?;
        Ok(IssuedPair {
            chain_pem: format!("{}{}", cert.pem(), self.cert_pem),
            key_pem: key.serialize_pem(),
            not_after,
        })
    }

    /// A fresh serving certificate and key for the built-in artifact store, valid for `ttl`,
    /// naming exactly `hosts` (DNS names, or IP addresses as IP SANs). Server auth only.
    ///
    /// # Errors
    /// [`Error::Tls`] for no host, a host that is not a valid DNS name, or signing failures.
    pub fn issue_store_server(&self, hosts: &[String], ttl: Duration) -> Result<IssuedPair> {
        if hosts.is_empty() {
            return Err(Error::Tls(
                "the store certificate needs at least one host name".into(),
            ));
        }
        let key = KeyPair::generate().map_err(tls_err("generating the store's key"))?;
        let mut params = CertificateParams::new(Vec::<String>::new())
            .map_err(tls_err("building the store certificate"))?;
        for host in hosts {
            let san = match host.parse::<std::net::IpAddr>() {
                Ok(ip) => SanType::IpAddress(ip),
                Err(_) => SanType::DnsName(
                    host.clone()
                        .try_into()
                        .map_err(tls_err(format!("the store host name {host:?}")))?,
                ),
            };
            params.subject_alt_names.push(san);
        }
        params
            .distinguished_name
            .push(DnType::CommonName, "flamefleet-store");
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        params.use_authority_key_identifier_extension = true;
        let not_after = validity(&mut params, ttl);
        let cert = params
            .signed_by(&key, &self.issuer)
            .map_err(tls_err("signing the store certificate"))?;
        Ok(IssuedPair {
            chain_pem: format!("{}{}", cert.pem(), self.cert_pem),
            key_pem: key.serialize_pem(),
            not_after,
        })
    }

    /// Signs the public key of `csr_pem` (whose proof of possession is checked) into a
    /// serving certificate for the agent of `node`, valid for `ttl`. The certificate's names
    /// come from `node` alone, never from what the CSR asks for.
    ///
    /// Returns the certificate followed by the CA certificate, PEM.
    ///
    /// # Errors
    /// [`Error::Tls`] when the CSR does not parse, its signature is wrong, or signing fails.
    pub fn sign_agent(
        &self,
        csr_pem: &str,
        node: &str,
        ttl: Duration,
    ) -> Result<(String, std::time::SystemTime)> {
        let csr = CertificateSigningRequestParams::from_pem(csr_pem).map_err(tls_err(
            "the CSR does not parse or its signature does not match its key",
        ))?;
        let dns = agent_dns_name(node);
        let mut params = CertificateParams::new(Vec::<String>::new())
            .map_err(tls_err("building the agent certificate"))?;
        params.subject_alt_names = vec![SanType::DnsName(
            dns.clone()
                .try_into()
                .map_err(tls_err(format!("the DNS name {dns}")))?,
        )];
        params
            .distinguished_name
            .push(DnType::CommonName, agent_common_name(node));
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        params.use_authority_key_identifier_extension = true;
        let not_after = validity(&mut params, ttl);
        let cert = params
            .signed_by(&csr.public_key, &self.issuer)
            .map_err(tls_err("signing the agent certificate"))?;
        Ok((format!("{}{}", cert.pem(), self.cert_pem), not_after))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rustls::pki_types::pem::PemObject as _;

    fn agent_csr(names: &[&str]) -> (KeyPair, String) {
        let key = KeyPair::generate().expect("key");
        let mut params =
            CertificateParams::new(names.iter().map(|s| (*s).to_owned()).collect::<Vec<_>>())
                .expect("params");
        params
            .distinguished_name
            .push(DnType::CommonName, "whatever-the-agent-asks");
        let csr = params.serialize_request(&key).expect("csr");
        (key, csr.pem().expect("pem"))
    }

    #[test]
    fn agent_certificates_name_the_node_not_what_the_csr_asks() {
        let (ca, key_pem) = OperatorCa::generate("test-ca").expect("ca");
        let reloaded = OperatorCa::from_pem(ca.cert_pem(), &key_pem).expect("reload");
        let (_key, csr) = agent_csr(&["other-node.agents.flamefleet.internal", "evil.example"]);
        let (chain, _) = reloaded
            .sign_agent(&csr, "node-a", Duration::from_secs(3600))
            .expect("sign");
        let certs: Vec<_> = rustls::pki_types::CertificateDer::pem_slice_iter(chain.as_bytes())
            .collect::<std::result::Result<_, _>>()
            .expect("pem chain");
        assert_eq!(certs.len(), 2, "leaf and CA");
        let text = String::from_utf8_lossy(&certs[0]).to_string();
        assert!(!text.contains("evil.example"));
        assert!(!text.contains("other-node"));
        assert!(text.contains("node-a.agents.flamefleet.internal"));
    }

    #[test]
    fn a_csr_with_a_forged_signature_is_refused() {
        let (ca, _) = OperatorCa::generate("test-ca").expect("ca");
        let (_key, csr) = agent_csr(&[]);
        // Flip one byte inside the base64 body (past the header line).
        let mut bytes = csr.into_bytes();
        let pos = bytes.len() / 2;
        bytes[pos] = if bytes[pos] == b'A' { b'B' } else { b'A' };
        let forged = String::from_utf8(bytes).expect("ascii");
        assert!(
            ca.sign_agent(&forged, "n", Duration::from_secs(60))
                .is_err()
        );
    }
}
