//! The built-in store's serving certificate: issued by the operator's CA for the host names
//! of the store's URLs, kept in a `kubernetes.io/tls` Secret that the store mounts, and
//! renewed well before it expires. The store re-reads the files when the kubelet updates
//! the volume, so the certificate rotates without a restart. Clients trust the operator's
//! CA for the store only: the operator and agents know it already, and users get it in the
//! answer to their ProfileDownload.
//!
//! A Secret the operator did not write (no [`HOSTS_ANNOTATION`]), e.g. one from
//! cert-manager, is used as it is and never replaced.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use k8s_openapi::ByteString;
use k8s_openapi::api::core::v1::Secret;
use kube::api::{Api, ObjectMeta, PostParams};

use super::ca::OperatorCa;
use crate::{Error, Result};

/// Annotation listing the host names the certificate was issued for (comma separated).
pub const HOSTS_ANNOTATION: &str = "flamefleet.dev/store-hosts";
/// Annotation holding when the certificate expires (Unix seconds).
pub const NOT_AFTER_ANNOTATION: &str = "flamefleet.dev/not-after";
/// Validity of an issued certificate.
pub const VALIDITY: Duration = Duration::from_secs(90 * 24 * 3600);
/// A certificate with less than this left is renewed.
pub const RENEW_BEFORE: Duration = Duration::from_secs(30 * 24 * 3600);
/// How often the Secret is checked.
const CHECK_EVERY: Duration = Duration::from_secs(3600);

/// The hosts a store certificate must name: those of the given URLs, deduplicated, in order.
pub fn hosts_of<'u>(urls: impl IntoIterator<Item = &'u url::Url>) -> Vec<String> {
    let mut hosts: Vec<String> = Vec::new();
    for url in urls {
        let host = match url.host() {
            Some(url::Host::Domain(d)) => d.to_owned(),
            Some(url::Host::Ipv4(ip)) => ip.to_string(),
            Some(url::Host::Ipv6(ip)) => ip.to_string(),
            None => continue,
        };
        if !hosts.contains(&host) {
            hosts.push(host);
        }
    }
    hosts
}

/// What to do with the Secret as found.
#[derive(Debug, PartialEq, Eq)]
pub enum Verdict {
    /// Absent: create it.
    Create,
    /// Ours, for other hosts or expiring soon: replace it.
    Renew(String),
    /// Ours and current, or not ours: leave it.
    Keep,
}

/// Decides, from the Secret's annotations, whether it needs a new certificate at `now`.
pub fn verdict(secret: Option<&Secret>, hosts: &[String], now: SystemTime) -> Verdict {
    let Some(secret) = secret else {
        return Verdict::Create;
    };
    let annotations = secret.metadata.annotations.clone().unwrap_or_default();
    let Some(issued_for) = annotations.get(HOSTS_ANNOTATION) else {
        return Verdict::Keep;
    };
    if *issued_for != hosts.join(",") {
        return Verdict::Renew(format!(
            "it names {issued_for}, the store is reached at {}",
            hosts.join(",")
        ));
    }
    let not_after = annotations
        .get(NOT_AFTER_ANNOTATION)
        .and_then(|s| s.parse::<u64>().ok())
        .map(|secs| SystemTime::UNIX_EPOCH + Duration::from_secs(secs));
    match not_after {
        Some(t) if t > now + RENEW_BEFORE => Verdict::Keep,
        Some(_) => Verdict::Renew("it expires within 30 days".into()),
        None => Verdict::Renew("its expiry is unknown".into()),
    }
}

fn issued_secret(name: &str, hosts: &[String], ca: &OperatorCa) -> Result<Secret> {
    let pair = ca.issue_store_server(hosts, VALIDITY)?;
    let not_after = pair
        .not_after
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    Ok(Secret {
        metadata: ObjectMeta {
            name: Some(name.to_owned()),
            labels: Some(BTreeMap::from([(
                "app.kubernetes.io/part-of".to_owned(),
                "flamefleet".to_owned(),
            )])),
            annotations: Some(BTreeMap::from([
                (HOSTS_ANNOTATION.to_owned(), hosts.join(",")),
                (NOT_AFTER_ANNOTATION.to_owned(), not_after.to_string()),
            ])),
            ..ObjectMeta::default()
        },
        type_: Some("kubernetes.io/tls".to_owned()),
        data: Some(BTreeMap::from([
            (
                "tls.crt".to_owned(),
                ByteString(pair.chain_pem.into_bytes()),
            ),
            ("tls.key".to_owned(), ByteString(pair.key_pem.into_bytes())),
            (
                "ca.crt".to_owned(),
                ByteString(ca.cert_pem().as_bytes().to_vec()),
            ),
        ])),
        ..Secret::default()
    })
}

/// Makes Secret `namespace/name` hold a current certificate for `hosts`. Replicas racing
/// agree: a create or replace that loses (409) leaves the winner's certificate.
///
/// # Errors
/// API errors, or [`Error::Tls`] when a certificate cannot be issued.
pub async fn ensure(
    client: &kube::Client,
    namespace: &str,
    name: &str,
    ca: &OperatorCa,
    hosts: &[String],
) -> Result<()> {
    let api: Api<Secret> = Api::namespaced(client.clone(), namespace);
    let what = format!("Secret {namespace}/{name}");
    let current = api
        .get_opt(name)
        .await
        .map_err(Error::kube(format!("reading {what}")))?;
    let outcome = match verdict(current.as_ref(), hosts, SystemTime::now()) {
        Verdict::Keep => return Ok(()),
        Verdict::Create => {
            tracing::info!(secret = %what, hosts = %hosts.join(","), "issuing the store's TLS certificate");
            api.create(&PostParams::default(), &issued_secret(name, hosts, ca)?)
                .await
        }
        Verdict::Renew(why) => {
            tracing::info!(secret = %what, "renewing the store's TLS certificate: {why}");
            let mut renewed = issued_secret(name, hosts, ca)?;
            renewed.metadata.resource_version = current.and_then(|s| s.metadata.resource_version);
            api.replace(name, &PostParams::default(), &renewed).await
        }
    };
    match outcome {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(status)) if status.code == 409 => Ok(()),
        Err(e) => Err(Error::kube(format!("writing {what}"))(e)),
    }
}

/// Keeps the certificate current, checking every hour (every minute after an error).
pub async fn maintain(
    client: kube::Client,
    namespace: String,
    name: String,
    ca: Arc<OperatorCa>,
    hosts: Vec<String>,
) {
    loop {
        let wait = match ensure(&client, &namespace, &name, &ca, &hosts).await {
            Ok(()) => CHECK_EVERY,
            Err(e) => {
                tracing::warn!("the store's TLS certificate: {e}; retrying in a minute");
                Duration::from_secs(60)
            }
        };
        tokio::time::sleep(wait).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn secret(annotations: &[(&str, &str)]) -> Secret {
        Secret {
            metadata: ObjectMeta {
                annotations: Some(
                    annotations
                        .iter()
                        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                        .collect(),
                ),
                ..ObjectMeta::default()
            },
            ..Secret::default()
        }
    }

    #[test]
    fn creates_renews_and_leaves_alone() {
        let hosts = vec!["ff-store.ns.svc".to_owned(), "192.0.2.2".to_owned()];
        let now = SystemTime::UNIX_EPOCH + Duration::from_secs(1_800_000_000);
        let at = |days: u64| (1_800_000_000 + days * 86_400).to_string();
        assert_eq!(verdict(None, &hosts, now), Verdict::Create);
        let current = secret(&[
            (HOSTS_ANNOTATION, "ff-store.ns.svc,192.0.2.2"),
            (NOT_AFTER_ANNOTATION, &at(60)),
        ]);
        assert_eq!(verdict(Some(&current), &hosts, now), Verdict::Keep);
        let expiring = secret(&[
            (HOSTS_ANNOTATION, "ff-store.ns.svc,192.0.2.2"),
            (NOT_AFTER_ANNOTATION, &at(20)),
        ]);
        assert!(matches!(
            verdict(Some(&expiring), &hosts, now),
            Verdict::Renew(_)
        ));
        let moved = secret(&[
            (HOSTS_ANNOTATION, "ff-store.ns.svc"),
            (NOT_AFTER_ANNOTATION, &at(60)),
        ]);
        assert!(matches!(
            verdict(Some(&moved), &hosts, now),
            Verdict::Renew(_)
        ));
        // Not ours (cert-manager, an admin): never replaced.
        assert_eq!(verdict(Some(&secret(&[])), &hosts, now), Verdict::Keep);
    }

    #[test]
    fn hosts_come_from_the_urls() {
        let a: url::Url = "https://ff-store.ns.svc:8080/".parse().unwrap();
        let b: url::Url = "https://192.0.2.2:30808/".parse().unwrap();
        let c: url::Url = "https://ff-store.ns.svc:8080/x".parse().unwrap();
        assert_eq!(hosts_of([&a, &b, &c]), ["ff-store.ns.svc", "192.0.2.2"]);
    }

    #[test]
    fn the_certificate_names_every_host_for_server_auth() {
        let (ca, _) = OperatorCa::generate("test-ca").unwrap();
        let hosts = vec!["ff-store.ns.svc".to_owned(), "192.0.2.2".to_owned()];
        let s = issued_secret("store-tls", &hosts, &ca).unwrap();
        let data = s.data.unwrap();
        let chain = String::from_utf8(data["tls.crt"].0.clone()).unwrap();
        let leaf = rustls::pki_types::pem::PemObject::pem_slice_iter(chain.as_bytes())
            .next()
            .map(|c: std::result::Result<rustls::pki_types::CertificateDer<'static>, _>| c.unwrap())
            .unwrap();
        let der = String::from_utf8_lossy(&leaf).to_string();
        assert!(der.contains("ff-store.ns.svc"));
        // The IP SAN is its four bytes.
        assert!(leaf.windows(4).any(|w| w == [192, 0, 2, 2]));
        assert_eq!(data["ca.crt"].0, ca.cert_pem().as_bytes());
    }
}
