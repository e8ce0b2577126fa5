//! The built-in store over HTTPS: a certificate from the operator's CA, trusted by a client
//! that holds that CA and by no other; plain HTTP gets no answer; a key that does not match
//! its certificate is refused at start with a message naming both files.

use std::time::Duration;

use flamefleet_operator::identity::ca::OperatorCa;
use flamefleet_operator::store::builtin::tls::TlsFiles;
use flamefleet_operator::store::builtin::{BuiltinConfig, server};

fn config(root: &std::path::Path, url: &str) -> BuiltinConfig {
    BuiltinConfig {
        root: root.to_path_buf(),
        public_url: url.parse().unwrap(),
        secret: b"0123456789abcdef0123456789abcdef".to_vec(),
        max_upload_bytes: 1 << 20,
    }
}

/// Writes a certificate chain and a key into `dir` as the store's PEM files.
fn write_pair(dir: &std::path::Path, chain_pem: &str, key_pem: &str) -> TlsFiles {
    let files = TlsFiles {
        cert: dir.join("tls.crt"),
        key: dir.join("tls.key"),
    };
    std::fs::write(&files.cert, chain_pem).unwrap();
    std::fs::write(&files.key, key_pem).unwrap();
    files
}

/// A store certificate for 127.0.0.1 from `ca`.
fn loopback_pair(ca: &OperatorCa) -> flamefleet_operator::identity::ca::IssuedPair {
    ca.issue_store_server(&["127.0.0.1".into()], Duration::from_secs(3600))
        .unwrap()
}

/// A built-in store serving HTTPS on a loopback port with a certificate from a new CA; the
/// directory and store must live as long as the test uses them.
async fn https_store() -> (
    tempfile::TempDir,
    OperatorCa,
    std::sync::Arc<flamefleet_operator::store::builtin::BuiltinStore>,
    std::net::SocketAddr,
) {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let dir = tempfile::tempdir().unwrap();
    let (ca, _) = OperatorCa::generate("test-ca").unwrap();
    let pair = loopback_pair(&ca);
    let files = write_pair(dir.path(), &pair.chain_pem, &pair.key_pem);
    let (store, bound) = server::spawn(
        config(&dir.path().join("artifacts"), "https://127.0.0.1/"),
        "127.0.0.1:0".parse().unwrap(),
        Some(files),
    )
    .await
    .expect("serving HTTPS");
    (dir, ca, store, bound)
}

#[tokio::test]
async fn the_store_serves_https_only_to_clients_that_trust_the_operator_ca() {
    let (_dir, ca, _store, bound) = https_store().await;

    let trusting = reqwest::Client::builder()
        .add_root_certificate(reqwest::Certificate::from_pem(ca.cert_pem().as_bytes()).unwrap())
        .build()
        .unwrap();
    let ok = trusting
        .get(format!("https://127.0.0.1:{}/healthz", bound.port()))
        .send()
        .await
        .expect("HTTPS with the operator's CA");
    assert!(ok.status().is_success(), "{}", ok.status());

    // Another CA's client does not trust the store.
    let (other, _) = OperatorCa::generate("other-ca").unwrap();
    let stranger = reqwest::Client::builder()
        .add_root_certificate(reqwest::Certificate::from_pem(other.cert_pem().as_bytes()).unwrap())
        .build()
        .unwrap();
    let refused = stranger
        .get(format!("https://127.0.0.1:{}/healthz", bound.port()))
        .send()
        .await;
    assert!(refused.is_err(), "{refused:?}");

    // Plain HTTP gets no HTTP answer.
    let plain = reqwest::Client::builder()
        .timeout(Duration::from_secs(15))
        .build()
        .unwrap()
        .get(format!("http://127.0.0.1:{}/healthz", bound.port()))
        .send()
        .await;
    assert!(
        plain.as_ref().is_err() || plain.as_ref().is_ok_and(|r| !r.status().is_success()),
        "{plain:?}"
    );
}

/// A client that offers HTTP/2 first, as the kubelet's probes and curl do, is answered over
/// the HTTP/1.1 the store speaks.
#[tokio::test]
async fn a_client_preferring_http2_is_answered_over_http1() {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let (_dir, ca, _store, bound) = https_store().await;

    let mut roots = rustls::RootCertStore::empty();
    let ca_der = rustls_pemfile_der(ca.cert_pem());
    roots.add(ca_der).unwrap();
    let mut client = rustls::ClientConfig::builder()
        .with_root_certificates(roots)
        .with_no_client_auth();
    client.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    let connector = tokio_rustls::TlsConnector::from(std::sync::Arc::new(client));
    let tcp = tokio::net::TcpStream::connect(("127.0.0.1", bound.port()))
        .await
        .unwrap();
    let mut tls = connector
        .connect("127.0.0.1".try_into().unwrap(), tcp)
        .await
        .expect("TLS handshake");
    assert_eq!(
        tls.get_ref().1.alpn_protocol(),
        Some(b"http/1.1".as_slice()),
        "the store must not offer a protocol it does not serve"
    );
    tls.write_all(b"GET /healthz HTTP/1.1\r\nhost: 127.0.0.1\r\nconnection: close\r\n\r\n")
        .await
        .unwrap();
    let mut answer = Vec::new();
    tokio::time::timeout(Duration::from_secs(15), tls.read_to_end(&mut answer))
        .await
        .expect("an answer within 15 s")
        .ok();
    let answer = String::from_utf8_lossy(&answer);
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
}

/// The DER of a one-certificate PEM.
fn rustls_pemfile_der(pem: &str) -> rustls::pki_types::CertificateDer<'static> {
    use rustls::pki_types::pem::PemObject as _;
    rustls::pki_types::CertificateDer::from_pem_slice(pem.as_bytes()).unwrap()
}

#[tokio::test]
async fn a_key_that_does_not_match_its_certificate_is_refused_at_start() {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let dir = tempfile::tempdir().unwrap();
    let (ca, _) = OperatorCa::generate("test-ca").unwrap();
    let (a, b) = (loopback_pair(&ca), loopback_pair(&ca));
    let files = write_pair(dir.path(), &a.chain_pem, &b.key_pem);
    let err = server::spawn(
        config(&dir.path().join("artifacts"), "https://127.0.0.1/"),
        "127.0.0.1:0".parse().unwrap(),
        Some(files),
    )
    .await
    .expect_err("a mismatched key must be refused");
    let message = err.to_string();
    assert!(
        message.contains("tls.key")
            && message.contains("tls.crt")
            && message.contains("does not match"),
        "{message}"
    );
}
