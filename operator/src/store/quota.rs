//! Per-namespace storage quota of the artifact store.
//!
//! Without one, any tenant allowed to create ProfileRequests fills the store's volume (or
//! bucket) for everyone. The cluster admin sets a default (`--artifact-quota-per-namespace`,
//! chart value `store.quota.perNamespace`) and may override it per namespace with the
//! annotation [`QUOTA_ANNOTATION`]: Namespace objects are cluster-scoped, so the namespace
//! `admin` and `edit` roles cannot annotate them, and the chart's admission policy refuses a
//! change of `flamefleet.dev/` annotations on a Namespace from anyone who may not `update`
//! the virtual resource `namespacelimits.flamefleet.dev` (multi-tenancy tools that let
//! tenants edit their own Namespace objects do not grant it).
//!
//! Enforcement, in the operator (the same for every backend):
//! - before a node's capture, a namespace at or past its quota fails the node with
//!   [`QuotaExceeded`];
//! - after an upload is verified, an artifact that would take the namespace past its quota
//!   is deleted with the node's other artifacts, and the node fails with
//!   [`QuotaExceeded`]. Until then the store holds at most the artifacts in flight
//!   (each bounded by the store's upload limit).
//!
//! What a namespace uses comes from listing the store (per request, cached for
//! [`REFRESH`]) plus what was verified since. The sum is conservative: an artifact uploaded
//! before a listing and verified after it counts twice until the next listing.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Namespace;
use kube::api::Api;

use super::{ArtifactKey, ArtifactStore, RequestRef};
use crate::{Error, Result};

/// Namespace annotation overriding the operator's default quota (bytes, or a Kubernetes
/// quantity such as `500Mi` or `2Gi`; `0` means unlimited). Only the cluster admin may set it.
pub const QUOTA_ANNOTATION: &str = "flamefleet.dev/artifact-quota";
/// How long a namespace's listed usage is trusted before the store is listed again.
pub const REFRESH: Duration = Duration::from_secs(300);

/// A namespace has no room left for a node's artifacts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QuotaExceeded {
    /// The namespace.
    pub namespace: String,
    /// Bytes it uses.
    pub used: u64,
    /// Its quota.
    pub quota: u64,
    /// The size of the artifact refused, when one was.
    pub needed: Option<u64>,
}

impl std::fmt::Display for QuotaExceeded {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "namespace {} has used {} of its artifact storage quota of {}",
            self.namespace,
            human(self.used),
            human(self.quota)
        )?;
        if let Some(needed) = self.needed {
            write!(f, " and this artifact needs {}", human(needed))?;
        }
        write!(
            f,
            "; this node's artifacts were not kept. Delete finished ProfileRequests of the namespace to free space, or ask the cluster admin to raise the quota (namespace annotation {QUOTA_ANNOTATION}, or the operator's --artifact-quota-per-namespace)"
        )
    }
}

impl std::error::Error for QuotaExceeded {}

/// `bytes` for people, exact first: `12582912 bytes (12.0 MiB)`.
fn human(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["bytes", "KiB", "MiB", "GiB", "TiB"];
    let mut value = bytes as f64;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{bytes} bytes")
    } else {
        format!("{bytes} bytes ({value:.1} {})", UNITS[unit])
    }
}

/// Parses a quota: plain bytes, or a Kubernetes quantity with a binary (`Ki` .. `Ti`) or
/// decimal (`k`, `M`, `G`, `T`) suffix. `None` for anything else.
pub fn parse_quantity(text: &str) -> Option<u64> {
    let text = text.trim();
    let split = text
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(text.len());
    let (number, suffix) = text.split_at(split);
    let number: u64 = number.parse().ok()?;
    let factor: u64 = match suffix {
        "" => 1,
        "Ki" => 1 << 10,
        "Mi" => 1 << 20,
        "Gi" => 1 << 30,
        "Ti" => 1 << 40,
        "k" => 1_000,
        "M" => 1_000_000,
        "G" => 1_000_000_000,
        "T" => 1_000_000_000_000,
        _ => return None,
    };
    number.checked_mul(factor)
}

/// What one namespace uses.
#[derive(Debug, Default)]
struct Usage {
    /// Bytes per request prefix, from the last listing of the store.
    listed: HashMap<String, u64>,
    /// Bytes verified since that listing, per request prefix.
    since: HashMap<String, u64>,
    listed_at: Option<Instant>,
}

impl Usage {
    fn total(&self) -> u64 {
        self.listed
            .values()
            .chain(self.since.values())
            .fold(0u64, |a, b| a.saturating_add(*b))
    }
}

/// The operator's account of what each namespace stores.
pub struct QuotaLedger {
    store: Arc<dyn ArtifactStore>,
    default_bytes: u64,
    namespaces: tokio::sync::Mutex<HashMap<String, Usage>>,
}

impl std::fmt::Debug for QuotaLedger {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("QuotaLedger")
            .field("default_bytes", &self.default_bytes)
            .finish_non_exhaustive()
    }
}

impl QuotaLedger {
    /// A ledger over `store`, with `default_bytes` per namespace (0: unlimited unless a
    /// namespace's annotation sets one).
    pub fn new(store: Arc<dyn ArtifactStore>, default_bytes: u64) -> Self {
        Self {
            store,
            default_bytes,
            namespaces: tokio::sync::Mutex::new(HashMap::new()),
        }
    }

    /// The quota of `namespace` (0: unlimited): its annotation, else the default. An
    /// annotation that does not parse is ignored with a warning (the default applies).
    ///
    /// # Errors
    /// The API server's error reading the Namespace.
    pub async fn quota_of(&self, client: &kube::Client, namespace: &str) -> Result<u64> {
        let api: Api<Namespace> = Api::all(client.clone());
        let ns = api
            .get_opt(namespace)
            .await
            .map_err(Error::kube(format!("reading Namespace {namespace}")))?;
        let annotated = ns
            .as_ref()
            .and_then(|n| n.metadata.annotations.as_ref())
            .and_then(|a| a.get(QUOTA_ANNOTATION));
        Ok(match annotated {
            Some(text) => parse_quantity(text).unwrap_or_else(|| {
                tracing::warn!(
                    namespace,
                    value = %text,
                    "annotation {QUOTA_ANNOTATION} is not a byte count or quantity (e.g. 500Mi); using the default quota"
                );
                self.default_bytes
            }),
            None => self.default_bytes,
        })
    }

    /// Runs `f` on the usage of `namespace`, listing the store first when it was never
    /// listed or the listing is older than [`REFRESH`].
    async fn with_usage<R>(&self, namespace: &str, f: impl FnOnce(&mut Usage) -> R) -> Result<R> {
        let mut namespaces = self.namespaces.lock().await;
        let stale = namespaces
            .get(namespace)
            .and_then(|u| u.listed_at)
            .is_none_or(|at| at.elapsed() >= REFRESH);
        if stale {
            let stored = self.store.stored_requests(Some(namespace)).await?;
            let usage = namespaces.entry(namespace.to_owned()).or_default();
            usage.listed = stored
                .into_iter()
                .map(|r| (r.request.prefix(), r.bytes))
                .collect();
            usage.since.clear();
            usage.listed_at = Some(Instant::now());
        }
        Ok(f(namespaces.entry(namespace.to_owned()).or_default()))
    }

    /// Bytes `namespace` has left under `quota` (`u64::MAX` when unlimited), or
    /// [`QuotaExceeded`] when none.
    ///
    /// # Errors
    /// The store's listing error.
    pub async fn room(
        &self,
        namespace: &str,
        quota: u64,
    ) -> Result<std::result::Result<u64, QuotaExceeded>> {
        if quota == 0 {
            return Ok(Ok(u64::MAX));
        }
        let used = self.with_usage(namespace, |u| u.total()).await?;
        Ok(if used >= quota {
            Err(QuotaExceeded {
                namespace: namespace.to_owned(),
                used,
                quota,
                needed: None,
            })
        } else {
            Ok(quota - used)
        })
    }

    /// Counts a verified artifact of `size` bytes against its namespace, or refuses it
    /// (counting nothing) when it would take the namespace past `quota` (0: unlimited,
    /// nothing is counted).
    ///
    /// # Errors
    /// The store's listing error.
    pub async fn admit(
        &self,
        key: &ArtifactKey,
        size: u64,
        quota: u64,
    ) -> Result<std::result::Result<(), QuotaExceeded>> {
        if quota == 0 {
            return Ok(Ok(()));
        }
        let namespace = key.request().namespace();
        let prefix = key.request().prefix();
        self.with_usage(namespace, |u| {
            let used = u.total();
            if used.saturating_add(size) > quota {
                return Err(QuotaExceeded {
                    namespace: namespace.to_owned(),
                    used,
                    quota,
                    needed: Some(size),
                });
            }
            let entry = u.since.entry(prefix).or_default();
            *entry = entry.saturating_add(size);
            Ok(())
        })
        .await
    }

    /// Forgets what `request` stored (its artifacts were deleted).
    pub async fn forget(&self, request: &RequestRef) {
        let mut namespaces = self.namespaces.lock().await;
        if let Some(usage) = namespaces.get_mut(request.namespace()) {
            let prefix = request.prefix();
            usage.listed.remove(&prefix);
            usage.since.remove(&prefix);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantities_parse_like_kubernetes_ones() {
        assert_eq!(parse_quantity("1024"), Some(1024));
        assert_eq!(parse_quantity("500Mi"), Some(500 << 20));
        assert_eq!(parse_quantity(" 2Gi "), Some(2 << 30));
        assert_eq!(parse_quantity("3G"), Some(3_000_000_000));
        assert_eq!(parse_quantity("0"), Some(0));
        for bad in ["", "Mi", "1.5Gi", "-1", "10mb", "99999999999999999999Ti"] {
            assert_eq!(parse_quantity(bad), None, "{bad}");
        }
    }

    #[test]
    fn the_refusal_says_how_much_and_what_to_do() {
        let text = QuotaExceeded {
            namespace: "shop".into(),
            used: 3 << 20,
            quota: 4 << 20,
            needed: Some(2 << 20),
        }
        .to_string();
        assert!(
            text.starts_with("namespace shop has used 3145728 bytes (3.0 MiB) of its artifact storage quota of 4194304 bytes (4.0 MiB) and this artifact needs 2097152 bytes (2.0 MiB)"),
            "{text}"
        );
        assert!(text.contains(QUOTA_ANNOTATION), "{text}");
        assert!(text.contains("Delete finished ProfileRequests"), "{text}");
    }
}
