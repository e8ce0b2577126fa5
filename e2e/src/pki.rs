//! Certificates and keys of the local control plane: a CA, the API server's serving
//! certificate, client certificates (the admin is in `system:masters`), and the
//! service-account signing key. ECDSA P-256 throughout, generated with rcgen.

use std::path::{Path, PathBuf};

use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose,
};

use crate::{Error, Result, io_err};

/// Files of a generated PKI.
#[derive(Debug, Clone)]
pub struct PkiFiles {
    /// CA certificate (trusted for both serving and client certificates).
    pub ca_cert: PathBuf,
    /// API server serving certificate and key.
    pub serving_cert: PathBuf,
    /// API server serving key.
    pub serving_key: PathBuf,
    /// Admin client certificate (`system:masters`).
    pub admin_cert: PathBuf,
    /// Admin client key.
    pub admin_key: PathBuf,
    /// Service-account token signing key (private).
    pub sa_key: PathBuf,
    /// Service-account token verification key (public).
    pub sa_pub: PathBuf,
}

/// A CA able to issue more client certificates (e.g. for RBAC tests).
pub struct Pki {
    dir: PathBuf,
    ca: Issuer<'static, KeyPair>,
    /// The files written.
    pub files: PkiFiles,
}

impl std::fmt::Debug for Pki {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pki")
            .field("files", &self.files)
            .finish_non_exhaustive()
    }
}

fn cert_err(what: &str) -> impl FnOnce(rcgen::Error) -> Error + '_ {
    move |source| Error::Certificate {
        what: what.to_string(),
        source,
    }
}

fn write(path: &Path, contents: &str) -> Result<()> {
    std::fs::write(path, contents).map_err(io_err(format!("writing {}", path.display())))
}

impl Pki {
    /// Generates the CA, serving, admin and service-account material into `dir`.
    pub fn generate(dir: &Path) -> Result<Self> {
        std::fs::create_dir_all(dir).map_err(io_err(format!("creating {}", dir.display())))?;

        let ca_key = KeyPair::generate().map_err(cert_err("the CA key"))?;
        let mut ca_params =
            CertificateParams::new(Vec::<String>::new()).map_err(cert_err("the CA"))?;
        ca_params
            .distinguished_name
            .push(DnType::CommonName, "flamefleet-local-ca");
        ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        ca_params.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        let ca_cert = ca_params.self_signed(&ca_key).map_err(cert_err("the CA"))?;
        let ca = Issuer::new(ca_params, ca_key);

        let ca_cert_path = dir.join("ca.crt");
        write(&ca_cert_path, &ca_cert.pem())?;

        let mut pki = Self {
            dir: dir.to_path_buf(),
            ca,
            files: PkiFiles {
                ca_cert: ca_cert_path,
                serving_cert: dir.join("apiserver.crt"),
                serving_key: dir.join("apiserver.key"),
                admin_cert: PathBuf::new(),
                admin_key: PathBuf::new(),
                sa_key: dir.join("sa.key"),
                sa_pub: dir.join("sa.pub"),
            },
        };

        let serving_names = [
            "localhost",
            "127.0.0.1",
            "10.96.0.1",
            "kubernetes",
            "kubernetes.default",
            "kubernetes.default.svc",
            "kubernetes.default.svc.cluster.local",
        ];
        let mut serving = CertificateParams::new(serving_names.map(String::from).to_vec())
            .map_err(cert_err("the serving certificate"))?;
        serving
            .distinguished_name
            .push(DnType::CommonName, "kube-apiserver");
        serving.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        let serving_key = KeyPair::generate().map_err(cert_err("the serving key"))?;
        let serving_cert = serving
            .signed_by(&serving_key, &pki.ca)
            .map_err(cert_err("the serving certificate"))?;
        write(&pki.files.serving_cert, &serving_cert.pem())?;
        write(&pki.files.serving_key, &serving_key.serialize_pem())?;

        let (admin_cert, admin_key) =
            pki.issue_client_cert("flamefleet-admin", &["system:masters"])?;
        pki.files.admin_cert = admin_cert;
        pki.files.admin_key = admin_key;

        let sa = KeyPair::generate().map_err(cert_err("the service-account key"))?;
        write(&pki.files.sa_key, &sa.serialize_pem())?;
        write(&pki.files.sa_pub, &sa.public_key_pem())?;
        Ok(pki)
    }

    /// Issues a client certificate for `user` in `groups`; returns (certificate, key) paths.
    pub fn issue_client_cert(&self, user: &str, groups: &[&str]) -> Result<(PathBuf, PathBuf)> {
        let what = format!("the client certificate of {user}");
        let mut params = CertificateParams::new(Vec::<String>::new()).map_err(cert_err(&what))?;
        params.distinguished_name.push(DnType::CommonName, user);
        for group in groups {
            params
                .distinguished_name
                .push(DnType::OrganizationName, *group);
        }
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
        let key = KeyPair::generate().map_err(cert_err(&what))?;
        let cert = params.signed_by(&key, &self.ca).map_err(cert_err(&what))?;
        let stem: String = user
            .chars()
            .map(|c| {
                if c.is_ascii_alphanumeric() || c == '-' {
                    c
                } else {
                    '_'
                }
            })
            .collect();
        let cert_path = self.dir.join(format!("user-{stem}.crt"));
        let key_path = self.dir.join(format!("user-{stem}.key"));
        write(&cert_path, &cert.pem())?;
        write(&key_path, &key.serialize_pem())?;
        Ok((cert_path, key_path))
    }
}

/// A kubeconfig for `server`, trusting `ca_cert`, authenticating with a client certificate.
pub fn kubeconfig_text(
    server: &str,
    ca_cert: &Path,
    client_cert: &Path,
    client_key: &Path,
    user: &str,
) -> String {
    format!(
        "apiVersion: v1
kind: Config
clusters:
- name: flamefleet-local
  cluster:
    server: {server}
    certificate-authority: {ca}
users:
- name: {user}
  user:
    client-certificate: {cert}
    client-key: {key}
contexts:
- name: flamefleet-local
  context:
    cluster: flamefleet-local
    user: {user}
    namespace: default
current-context: flamefleet-local
",
        ca = ca_cert.display(),
        cert = client_cert.display(),
        key = client_key.display(),
    )
}
