//! Certificates for the operator ↔ agent mutual TLS, as files (for agents run with
//! `--tls-bootstrap files` and operators with `--tls-ca/--tls-cert/--tls-key`): a CA (the
//! operator's), the operator's client certificate (DNS name
//! [`OPERATOR_DNS_NAME`], the only client agents accept), and per-node agent serving
//! certificates ([`AgentPki::issue_agent`]: [`agent_dns_name`] of the node, plus
//! `localhost` and `127.0.0.1`). ECDSA P-256, generated with rcgen.
//! [`AgentPki::issue_client`] makes other client certificates; a second `AgentPki` is
//! "another CA" for refusal tests.

use std::path::{Path, PathBuf};

use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose,
};

use crate::{Error, Result, io_err};

pub use flamefleet_proto::identity::{OPERATOR_DNS_NAME, agent_dns_name};

/// Files of an agent PKI.
#[derive(Debug, Clone)]
pub struct AgentPkiFiles {
    /// The CA certificate (give it to both sides as `--tls-ca`).
    pub ca_cert: PathBuf,
    /// The operator's client certificate.
    pub operator_cert: PathBuf,
    /// The operator's client key.
    pub operator_key: PathBuf,
}

/// A CA for the agent service, with the certificates both sides need.
pub struct AgentPki {
    dir: PathBuf,
    ca: Issuer<'static, KeyPair>,
    /// The files written.
    pub files: AgentPkiFiles,
}

impl std::fmt::Debug for AgentPki {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AgentPki")
            .field("files", &self.files)
            .finish_non_exhaustive()
    }
}

fn cert_err(what: impl Into<String>) -> impl FnOnce(rcgen::Error) -> Error {
    let what = what.into();
    move |source| Error::Certificate { what, source }
}

fn write(path: &Path, contents: &str) -> Result<()> {
    std::fs::write(path, contents).map_err(io_err(format!("writing {}", path.display())))
}

impl AgentPki {
    /// Generates the CA (named `ca_name`) and the operator client pair into `dir`; agents'
    /// certificates come from [`AgentPki::issue_agent`].
    ///
    /// # Errors
    /// When a key or certificate cannot be generated or written.
    pub fn generate(dir: &Path, ca_name: &str) -> Result<Self> {
        std::fs::create_dir_all(dir).map_err(io_err(format!("creating {}", dir.display())))?;
        let ca_key = KeyPair::generate().map_err(cert_err("the agent CA key"))?;
        let mut params =
            CertificateParams::new(Vec::<String>::new()).map_err(cert_err("the agent CA"))?;
        params.distinguished_name.push(DnType::CommonName, ca_name);
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        let ca_cert = params
            .self_signed(&ca_key)
            .map_err(cert_err("the agent CA"))?;
        let ca_path = dir.join("agent-ca.crt");
        write(&ca_path, &ca_cert.pem())?;
        let mut pki = Self {
            dir: dir.to_path_buf(),
            ca: Issuer::new(params, ca_key),
            files: AgentPkiFiles {
                ca_cert: ca_path,
                operator_cert: PathBuf::new(),
                operator_key: PathBuf::new(),
            },
        };
        let (cert, key) = pki.issue(
            "client-flamefleet-operator",
            "flamefleet-operator",
            &[OPERATOR_DNS_NAME],
            ExtendedKeyUsagePurpose::ClientAuth,
        )?;
        pki.files.operator_cert = cert;
        pki.files.operator_key = key;
        Ok(pki)
    }

    /// Issues the serving certificate of the agent on `node`; returns (certificate, key)
    /// paths.
    ///
    /// # Errors
    /// When it cannot be generated or written.
    pub fn issue_agent(&self, node: &str) -> Result<(PathBuf, PathBuf)> {
        self.issue(
            &format!("agent-{node}"),
            &format!("flamefleet-agent:{node}"),
            &[&agent_dns_name(node), "localhost", "127.0.0.1"],
            ExtendedKeyUsagePurpose::ServerAuth,
        )
    }

    /// Issues a client certificate with common name `name` (and no operator name: agents
    /// refuse it); returns (certificate, key) paths.
    ///
    /// # Errors
    /// When it cannot be generated or written.
    pub fn issue_client(&self, name: &str) -> Result<(PathBuf, PathBuf)> {
        self.issue(
            &format!("client-{name}"),
            name,
            &[],
            ExtendedKeyUsagePurpose::ClientAuth,
        )
    }

    fn issue(
        &self,
        stem: &str,
        common_name: &str,
        sans: &[&str],
        usage: ExtendedKeyUsagePurpose,
    ) -> Result<(PathBuf, PathBuf)> {
        let what = format!("the certificate {stem}");
        let mut params =
            CertificateParams::new(sans.iter().map(|s| (*s).to_owned()).collect::<Vec<_>>())
                .map_err(cert_err(what.clone()))?;
        params
            .distinguished_name
            .push(DnType::CommonName, common_name);
        params.extended_key_usages = vec![usage];
        let key = KeyPair::generate().map_err(cert_err(what.clone()))?;
        let cert = params.signed_by(&key, &self.ca).map_err(cert_err(what))?;
        let stem: String = stem
            .chars()
            .map(|c| {
                if c.is_ascii_alphanumeric() || c == '-' {
                    c
                } else {
                    '_'
                }
            })
            .collect();
        let cert_path = self.dir.join(format!("{stem}.crt"));
        let key_path = self.dir.join(format!("{stem}.key"));
        write(&cert_path, &cert.pem())?;
        write(&key_path, &key.serialize_pem())?;
        Ok((cert_path, key_path))
    }
}
