//! Secrets the operator generates on first start (its CA, the store's URL-signing key):
//! created when missing, read when present, so every replica and every restart agrees on
//! the same material without a manual step at install time.

use std::collections::BTreeMap;

use k8s_openapi::ByteString;
use k8s_openapi::api::core::v1::Secret;
use kube::api::{Api, ObjectMeta, PostParams};

use crate::{Error, Result};

/// Returns Secret `namespace/name`, creating it from `make()` (type `type_`) when it does not
/// exist. When two replicas race, the first create wins and the other reads it.
///
/// # Errors
/// API errors, or whatever `make` returns.
pub async fn get_or_create(
    client: &kube::Client,
    namespace: &str,
    name: &str,
    type_: &str,
    make: impl Fn() -> Result<BTreeMap<String, ByteString>>,
) -> Result<Secret> {
    let api: Api<Secret> = Api::namespaced(client.clone(), namespace);
    let what = format!("Secret {namespace}/{name}");
    for _ in 0..3 {
        if let Some(secret) = api
            .get_opt(name)
            .await
            .map_err(Error::kube(format!("reading {what}")))?
        {
            return Ok(secret);
        }
        let secret = Secret {
            metadata: ObjectMeta {
                name: Some(name.to_owned()),
                labels: Some(BTreeMap::from([(
                    "app.kubernetes.io/part-of".to_owned(),
                    "flamefleet".to_owned(),
                )])),
                ..ObjectMeta::default()
            },
            type_: Some(type_.to_owned()),
            data: Some(make()?),
            ..Secret::default()
        };
        match api.create(&PostParams::default(), &secret).await {
            Ok(created) => {
                tracing::info!(secret = %what, "created");
                return Ok(created);
            }
            Err(kube::Error::Api(status)) if status.code == 409 => {}
            Err(e) => return Err(Error::kube(format!("creating {what}"))(e)),
        }
    }
    Err(Error::Tls(format!(
        "{what} keeps appearing and disappearing; is something deleting it?"
    )))
}

/// The bytes under `key` of `secret`.
///
/// # Errors
/// [`Error::Tls`] naming the Secret and key when it is absent.
pub fn field<'s>(secret: &'s Secret, key: &str) -> Result<&'s [u8]> {
    secret
        .data
        .as_ref()
        .and_then(|d| d.get(key))
        .map(|b| b.0.as_slice())
        .ok_or_else(|| {
            Error::Tls(format!(
                "Secret {}/{} has no key {key}",
                secret.metadata.namespace.as_deref().unwrap_or_default(),
                secret.metadata.name.as_deref().unwrap_or_default()
            ))
        })
}
