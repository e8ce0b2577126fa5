//! The one admission point of the concurrency limits (`limits`): a request moves from
//! Pending to Running only through [`Admission::admit`].
//!
//! Reconciles of different requests run concurrently, and between the limit check and the
//! `Running` status write a start makes several round trips (pods, agents, result slices).
//! Counting Running requests in the cache alone would let every request of a burst see the
//! same free slots. So the check and a reservation happen under one lock: a reservation
//! counts as a running capture from the moment it is taken until the cache shows its
//! request Running (then the cache counts it), finished or gone; a start that ends before
//! writing `Running` hands its reservation back. The snapshot of the cache is taken under
//! the same lock, so each decision sees every earlier one.
//!
//! One operator process decides for the requests it handles (`--request-selector`); two
//! shards do not share reservations, as they do not share Running counts.

use std::collections::HashMap;

use flamefleet_api::{ProfileRequest, RequestPhase};
use k8s_openapi::api::core::v1::Namespace;
use kube::runtime::reflector::Store;

use super::limits::{self, Running, TenantLimits};
use crate::Result;

/// Reservations of requests admitted but not yet seen Running in the cache.
#[derive(Debug, Default)]
pub struct Admission {
    /// Request UID → namespace.
    reserved: tokio::sync::Mutex<HashMap<String, String>>,
}

/// Where admission reads the current state.
pub struct Sources<'a> {
    /// Kubernetes client (lists and gets when a cache is missing).
    pub client: &'a kube::Client,
    /// The controller's cache of the requests it handles.
    pub requests: Option<&'a Store<ProfileRequest>>,
    /// The operator's cache of Namespaces (for the per-namespace limit annotation).
    pub namespaces: Option<&'a Store<Namespace>>,
    /// The `--request-selector`, for the list when there is no request cache.
    pub selector: Option<&'a str>,
    /// The limits.
    pub limits: &'a TenantLimits,
}

impl Admission {
    /// Admits request `uid` of `namespace` under the limits and reserves its slot; the
    /// error is the `Queued` message. A request already reserved is admitted again (a
    /// retried start keeps its slot).
    ///
    /// # Errors
    /// API errors of a list or get when a cache is missing.
    pub async fn admit(
        &self,
        sources: &Sources<'_>,
        uid: &str,
        namespace: &str,
    ) -> Result<std::result::Result<(), String>> {
        let mut reserved = self.reserved.lock().await;
        if reserved.contains_key(uid) {
            return Ok(Ok(()));
        }
        let phases = limits::phases(sources.client, sources.requests, sources.selector).await?;
        // Forget what the cache has caught up with: a Running request is counted from the
        // cache, a finished or deleted one not at all.
        reserved.retain(|uid, _| {
            phases
                .get(uid)
                .is_some_and(|(_, p)| matches!(p, None | Some(RequestPhase::Pending)))
        });
        let mut running = Running::default();
        let running_now = phases
            .iter()
            .filter(|(_, (_, p))| *p == Some(RequestPhase::Running))
            .map(|(_, (ns, _))| ns.as_str());
        for ns in running_now.chain(reserved.values().map(String::as_str)) {
            running.total += 1;
            *running.by_namespace.entry(ns.to_string()).or_default() += 1;
        }
        let namespace_limit = limits::namespace_limit(
            sources.client,
            sources.namespaces,
            namespace,
            sources.limits,
        )
        .await?;
        if let Err(message) =
            limits::check_concurrency(&running, namespace, namespace_limit, sources.limits)
        {
            return Ok(Err(message));
        }
        reserved.insert(uid.to_string(), namespace.to_string());
        Ok(Ok(()))
    }

    /// Hands back the slot of a start that ended before writing `Running`.
    pub async fn release(&self, uid: &str) {
        self.reserved.lock().await.remove(uid);
    }

    /// Requests holding a reservation now (for tests and metrics).
    pub async fn reserved(&self) -> usize {
        self.reserved.lock().await.len()
    }
}
