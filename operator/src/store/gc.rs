//! The store's garbage collector: deletes the artifacts of requests that no longer exist.
//!
//! A request's finalizer deletes its artifacts, but a tenant with the `edit` role can remove
//! the finalizer before deleting the request (and a store restored from a backup, or a
//! second operator shard's outage, can leave artifacts behind too). Nothing would ever
//! delete those, so the leader sweeps the store periodically.
//!
//! Why a sweep cannot delete a live request's artifacts: every store key holds its
//! request's UID ([`super::key`]). The sweep lists the store first and the requests second,
//! with a consistent (quorum) read of every ProfileRequest of the cluster, whatever the
//! operator's `--request-selector`. An artifact in the first listing was uploaded through a
//! URL the operator signed for a request that existed before that listing; if that UID is
//! absent from the second, the request was deleted, and a new request (even one of the same
//! name) has another UID. On top of that, only requests whose newest artifact is older than
//! a grace period are touched, so an upload still in flight when its request is deleted
//! is left to the next sweep.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use flamefleet_api::ProfileRequest;
use kube::api::{Api, ListParams};

use super::quota::QuotaLedger;
use super::{ArtifactStore, StoredRequest};
use crate::{Error, Result};

/// Settings of the sweep.
#[derive(Debug, Clone, Copy)]
pub struct GcSettings {
    /// Time between sweeps (the first runs one interval after start); zero disables them.
    pub interval: Duration,
    /// Artifacts modified more recently than this are never deleted.
    pub grace: Duration,
}

/// What one sweep did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct GcReport {
    /// Requests with artifacts in the store.
    pub stored: usize,
    /// Orphaned requests whose artifacts were deleted (namespace/name-uid).
    pub deleted: Vec<String>,
    /// Bytes freed.
    pub bytes: u64,
}

/// UIDs of every ProfileRequest of the cluster, from a consistent, paginated list.
async fn live_uids(client: &kube::Client) -> Result<HashSet<String>> {
    let api: Api<ProfileRequest> = Api::all(client.clone());
    let mut uids = HashSet::new();
    let mut params = ListParams::default().limit(500);
    loop {
        let page = api.list_metadata(&params).await.map_err(Error::kube(
            "listing every ProfileRequest for the store's garbage collector",
        ))?;
        uids.extend(page.items.into_iter().filter_map(|m| m.metadata.uid));
        match page.metadata.continue_ {
            Some(token) if !token.is_empty() => params = params.continue_token(&token),
            _ => return Ok(uids),
        }
    }
}

/// The stored requests to delete (pure): those whose UID is not live and whose newest
/// artifact is older than `grace` at `now` (an unknown modification time counts as new).
pub fn orphans<'a>(
    stored: &'a [StoredRequest],
    live: &HashSet<String>,
    grace: Duration,
    now: SystemTime,
) -> Vec<&'a StoredRequest> {
    stored
        .iter()
        .filter(|r| !live.contains(r.request.uid()))
        .filter(|r| {
            // A time ahead of ours (another clock) is as new as can be.
            r.modified
                .map(|m| now.duration_since(m).unwrap_or(Duration::ZERO))
                .is_some_and(|age| age >= grace)
        })
        .collect()
}

/// One sweep: lists the store, then the requests, and deletes the orphans' artifacts.
///
/// # Errors
/// A failed listing (nothing is deleted then) or a failed deletion (the ones before it are
/// done).
pub async fn sweep(
    client: &kube::Client,
    store: &dyn ArtifactStore,
    quota: Option<&QuotaLedger>,
    grace: Duration,
) -> Result<GcReport> {
    let stored = store.stored_requests(None).await?;
    let live = live_uids(client).await?;
    let mut report = GcReport {
        stored: stored.len(),
        ..GcReport::default()
    };
    for orphan in orphans(&stored, &live, grace, SystemTime::now()) {
        store.delete_request(&orphan.request).await?;
        if let Some(quota) = quota {
            quota.forget(&orphan.request).await;
        }
        tracing::info!(
            request = %orphan.request,
            bytes = orphan.bytes,
            artifacts = orphan.artifacts,
            "deleted the artifacts of a ProfileRequest that no longer exists"
        );
        report.bytes = report.bytes.saturating_add(orphan.bytes);
        report.deleted.push(orphan.request.prefix());
    }
    Ok(report)
}

/// Sweeps every `settings.interval` until `shutdown` resolves; failures are logged and the
/// next sweep tries again.
pub async fn run(
    client: kube::Client,
    store: Arc<dyn ArtifactStore>,
    quota: Option<Arc<QuotaLedger>>,
    settings: GcSettings,
    shutdown: impl std::future::Future<Output = ()>,
) {
    if settings.interval.is_zero() {
        return;
    }
    let sweeps = async {
        let mut tick = tokio::time::interval_at(
            tokio::time::Instant::now() + settings.interval,
            settings.interval,
        );
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            match sweep(&client, store.as_ref(), quota.as_deref(), settings.grace).await {
                Ok(report) if !report.deleted.is_empty() => tracing::info!(
                    deleted = report.deleted.len(),
                    bytes = report.bytes,
                    stored = report.stored,
                    "store garbage collection"
                ),
                Ok(_) => tracing::debug!("store garbage collection: nothing to delete"),
                Err(e) => tracing::warn!("store garbage collection failed: {e}"),
            }
        }
    };
    tokio::select! {
        () = sweeps => {}
        () = shutdown => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::RequestRef;

    const LIVE: &str = "0f8fad5b-d9cb-469f-a165-70867728950e";
    const GONE: &str = "7c9e6679-7425-40de-944b-e07fc1f90ae7";

    fn stored(uid: &str, age: Option<u64>, now: SystemTime) -> StoredRequest {
        StoredRequest {
            request: RequestRef::new("shop", "r", uid).unwrap(),
            bytes: 10,
            artifacts: 1,
            modified: age.map(|a| now - Duration::from_secs(a)),
        }
    }

    #[test]
    fn only_old_artifacts_of_absent_requests_are_orphans() {
        let now = SystemTime::now();
        let live: HashSet<String> = [LIVE.to_string()].into();
        let all = [
            stored(LIVE, Some(3600), now),
            stored(GONE, Some(3600), now),
            stored(GONE, Some(5), now),
            stored(GONE, None, now),
        ];
        let found = orphans(&all, &live, Duration::from_secs(60), now);
        assert_eq!(found.len(), 1);
        assert_eq!(found[0].request.uid(), GONE);
        assert_eq!(found[0].modified, all[1].modified);
    }
}
