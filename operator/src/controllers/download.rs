//! The ProfileDownload controller: answers a user's `ProfileDownload` with URLs the store
//! signs for a few minutes, one per artifact of the named (finished) ProfileRequests, and
//! deletes the object once its URLs have expired.
//!
//! The API server has already authorized the download when the object was created (RBAC on
//! `profiledownloads`, and the `flamefleet-profile-download` admission policy requiring
//! `get` on each named request), so the controller only checks that each request exists,
//! has finished, belongs to this operator (`--request-selector`) and has artifacts (in its
//! `ProfileResultSlice`s, optionally only those of the download's `spec.nodes`).
//!
//! An answer holds at most [`MAX_DOWNLOAD_URLS`] URLs, so its status stays small: a larger
//! request is downloaded in batches of nodes (`kubectl profile get` does so).

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use flamefleet_api::conditions::{new_condition, set_condition};
use flamefleet_api::profile_download::MAX_DOWNLOAD_URLS;
use flamefleet_api::results::RequestResults;
use flamefleet_api::{
    DownloadPhase, DownloadUrl, ProfileDownload, ProfileDownloadStatus, ProfileRequest,
    SkippedRequest,
};
use futures::StreamExt as _;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams};
use kube::runtime::controller::Action;
use kube::runtime::{Controller, watcher};
use kube::{Resource, ResourceExt};
use serde_json::json;

use crate::metrics::Metrics;
use crate::store::{ArtifactStore, RequestRef};
use crate::{Error, Result};

/// Field manager of the download status.
const MANAGER: &str = "flamefleet-operator";
/// How long an answered or failed ProfileDownload is kept after its URLs expired.
const KEEP_AFTER_EXPIRY: Duration = Duration::from_secs(600);

/// What the download controller needs.
pub struct DownloadContext {
    /// Kubernetes client.
    pub client: kube::Client,
    /// The store that signs the URLs.
    pub store: Arc<dyn ArtifactStore>,
    /// How long the URLs stay valid.
    pub url_ttl: Duration,
    /// Only requests matching this label selector are this operator's.
    pub request_selector: Option<String>,
    /// PEM CA bundle users need to verify the store's TLS certificate, if any.
    pub ca_bundle: Option<String>,
    /// Answer only downloads of this namespace (tests that share one API server between
    /// several stores); `None`: every namespace.
    pub namespace: Option<String>,
    /// Metrics (reconciles and their failures, as the other controllers count them).
    pub metrics: Arc<Metrics>,
}

impl super::ControllerContext for DownloadContext {
    fn metrics(&self) -> &Metrics {
        &self.metrics
    }
}

impl std::fmt::Debug for DownloadContext {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DownloadContext")
            .field("url_ttl", &self.url_ttl)
            .finish_non_exhaustive()
    }
}

fn now() -> Time {
    Time(jiff::Timestamp::now())
}

/// What one named request contributes (pure): its artifacts' names (those of `nodes` only,
/// unless empty), or why it has none.
pub fn artifacts_of(
    name: &str,
    request: Option<&ProfileRequest>,
    results: &RequestResults,
    nodes: &[String],
) -> std::result::Result<Vec<String>, String> {
    let Some(request) = request else {
        return Err("not found".into());
    };
    let phase = request.status.as_ref().and_then(|s| s.phase);
    if !phase.is_some_and(|p| p.is_terminal()) {
        return Err(format!(
            "still {}; download it once it has finished",
            phase.map_or("Pending", |p| p.as_str())
        ));
    }
    let names: Vec<String> = results
        .artifacts()
        .filter(|(n, _)| nodes.is_empty() || nodes.contains(&n.node))
        .map(|(_, a)| a.name.clone())
        .collect();
    if names.is_empty() {
        if !nodes.is_empty() {
            return Err(format!(
                "{name} has no artifacts of node(s) {}",
                nodes.join(", ")
            ));
        }
        if results.incomplete() {
            return Err(format!(
                "{name}: its ProfileResultSlices {:?} are missing, so its artifacts are unknown",
                results.missing_slices
            ));
        }
        return Err(format!(
            "{name} finished {} without artifacts",
            phase.map_or("", |p| p.as_str())
        ));
    }
    Ok(names)
}

async fn answer(
    download: &ProfileDownload,
    ctx: &DownloadContext,
) -> Result<Option<ProfileDownloadStatus>> {
    let namespace = download.namespace().unwrap_or_default();
    let api: Api<ProfileRequest> = Api::namespaced(ctx.client.clone(), &namespace);
    let ours: Option<BTreeSet<String>> = match &ctx.request_selector {
        Some(selector) => Some(
            api.list_metadata(&ListParams::default().labels(selector))
                .await
                .map_err(Error::kube(format!(
                    "listing ProfileRequests of {namespace}"
                )))?
                .items
                .into_iter()
                .filter_map(|m| m.metadata.name)
                .collect(),
        ),
        None => None,
    };
    let mut artifacts = Vec::new();
    let mut skipped = Vec::new();
    let (mut mine, mut others) = (0usize, 0usize);
    for name in &download.spec.requests {
        let request = api.get_opt(name).await.map_err(Error::kube(format!(
            "reading ProfileRequest {namespace}/{name}"
        )))?;
        if request.is_some() && ours.as_ref().is_some_and(|o| !o.contains(name)) {
            // Another operator shard's request: that shard answers for it.
            others += 1;
            continue;
        }
        mine += usize::from(request.is_some());
        let results = match &request {
            Some(r) => flamefleet_api::results::fetch(&ctx.client, r)
                .await
                .map_err(Error::kube(format!(
                    "listing the ProfileResultSlices of {namespace}/{name}"
                )))?,
            None => RequestResults::default(),
        };
        match artifacts_of(name, request.as_ref(), &results, &download.spec.nodes) {
            Err(reason) => skipped.push(SkippedRequest {
                request: name.clone(),
                reason,
            }),
            Ok(names) => {
                let uid = request
                    .as_ref()
                    .and_then(|r| r.meta().uid.clone())
                    .unwrap_or_default();
                let request_ref = RequestRef::new(&namespace, name, &uid)?;
                for artifact in names {
                    let key = request_ref.artifact(artifact.clone())?;
                    let url = ctx.store.download_url(&key, ctx.url_ttl).await?;
                    artifacts.push(DownloadUrl {
                        request: name.clone(),
                        name: artifact,
                        url: url.to_string(),
                    });
                }
            }
        }
    }
    if artifacts.len() > MAX_DOWNLOAD_URLS {
        let total = artifacts.len();
        artifacts.clear();
        skipped.clear();
        skipped.push(SkippedRequest {
            request: download.spec.requests.join(","),
            reason: format!(
                "{total} artifacts are more than one download answers ({MAX_DOWNLOAD_URLS}); name at most 100 nodes in spec.nodes and download in batches (kubectl profile get does)"
            ),
        });
    }
    if mine == 0 && others > 0 {
        // Only other shards' requests (and maybe missing ones): not ours to answer.
        return Ok(None);
    }
    let expires = jiff::Timestamp::now()
        .checked_add(jiff::SignedDuration::try_from(ctx.url_ttl).unwrap_or_default())
        .unwrap_or_else(|_| jiff::Timestamp::now());
    let mut status = ProfileDownloadStatus {
        expires_at: Some(Time(expires)),
        ca_bundle: ctx.ca_bundle.clone(),
        ..Default::default()
    };
    let (phase, reason, message) = if artifacts.is_empty() {
        let why: Vec<String> = skipped
            .iter()
            .map(|s| format!("{}: {}", s.request, s.reason))
            .collect();
        (
            DownloadPhase::Failed,
            "NothingToDownload",
            format!("nothing to download: {}", why.join("; ")),
        )
    } else {
        (
            DownloadPhase::Ready,
            "UrlsSigned",
            format!(
                "{} artifact URLs valid for {}s",
                artifacts.len(),
                ctx.url_ttl.as_secs()
            ),
        )
    };
    status.phase = Some(phase);
    if phase == DownloadPhase::Failed {
        status.message = Some(message.clone());
    }
    status.artifacts = artifacts;
    status.skipped = skipped;
    set_condition(
        &mut status.conditions,
        new_condition(
            "Ready",
            phase == DownloadPhase::Ready,
            reason,
            message,
            download.meta().generation,
            now(),
        ),
    );
    Ok(Some(status))
}

async fn reconcile(download: Arc<ProfileDownload>, ctx: Arc<DownloadContext>) -> Result<Action> {
    let _timer = ctx.metrics.reconcile();
    let namespace = download.namespace().unwrap_or_default();
    let name = download.name_any();
    let api: Api<ProfileDownload> = Api::namespaced(ctx.client.clone(), &namespace);
    if let Some(status) = &download.status {
        // Answered: delete once the URLs have expired (plus a margin for late readers).
        let expires = status
            .expires_at
            .as_ref()
            .map_or_else(jiff::Timestamp::now, |t| t.0);
        let delete_at = expires
            .checked_add(jiff::SignedDuration::try_from(KEEP_AFTER_EXPIRY).unwrap_or_default())
            .unwrap_or(expires);
        let left = delete_at.duration_since(jiff::Timestamp::now());
        if left.is_positive() {
            let wait = Duration::try_from(left).unwrap_or(KEEP_AFTER_EXPIRY);
            return Ok(Action::requeue(wait));
        }
        match api.delete(&name, &DeleteParams::default()).await {
            Ok(_) => {}
            Err(kube::Error::Api(status)) if status.code == 404 => {}
            Err(e) => {
                return Err(Error::kube(format!(
                    "deleting ProfileDownload {namespace}/{name}"
                ))(e));
            }
        }
        return Ok(Action::await_change());
    }
    let Some(status) = answer(&download, &ctx).await? else {
        return Ok(Action::await_change());
    };
    let body = json!({
        "apiVersion": ProfileDownload::api_version(&()),
        "kind": ProfileDownload::kind(&()),
        "metadata": {"name": name},
        "status": status,
    });
    api.patch_status(
        &name,
        &PatchParams::apply(MANAGER).force(),
        &Patch::Apply(body),
    )
    .await
    .map_err(Error::kube(format!(
        "answering ProfileDownload {namespace}/{name}"
    )))?;
    tracing::info!(download = %format!("{namespace}/{name}"), phase = ?status.phase, urls = status.artifacts.len(), "answered a download");
    Ok(Action::requeue(ctx.url_ttl + KEEP_AFTER_EXPIRY))
}

/// Runs the download controller until `shutdown` resolves.
pub async fn run(
    context: Arc<DownloadContext>,
    shutdown: impl std::future::Future<Output = ()> + Send + Sync + 'static,
) {
    let api: Api<ProfileDownload> = match &context.namespace {
        Some(ns) => Api::namespaced(context.client.clone(), ns),
        None => Api::all(context.client.clone()),
    };
    Controller::new(api, watcher::Config::default().any_semantic())
        .graceful_shutdown_on(shutdown)
        .run(reconcile, super::error_policy, context)
        .for_each(|result| async move {
            if let Err(e) = result {
                tracing::debug!("download controller: {e}");
            }
        })
        .await;
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn request(phase: Option<&str>) -> ProfileRequest {
        let mut status = json!({});
        if let Some(p) = phase {
            status["phase"] = json!(p);
        }
        serde_json::from_value(json!({
            "apiVersion": "flamefleet.dev/v1alpha1", "kind": "ProfileRequest",
            "metadata": {"name": "r", "namespace": "ns", "uid": "0c7e3a40-0000-4000-8000-000000000001"},
            "spec": {"type": "cpu", "podNames": ["p"], "duration": "1s"},
            "status": status,
        }))
        .expect("request")
    }

    /// The results of request `r`: node `n1` with `artifacts`, node `n2` with one.
    fn results(artifacts: &[&str]) -> RequestResults {
        let node = |name: &str, artifacts: &[&str]| flamefleet_api::NodeStatus {
            node: name.into(),
            artifacts: artifacts
                .iter()
                .map(|a| flamefleet_api::Artifact {
                    name: a.to_string(),
                    ..Default::default()
                })
                .collect(),
            ..Default::default()
        };
        let r = request(None);
        let slice = flamefleet_api::ProfileResultSlice::for_request(
            &r,
            0,
            vec![node("n1", artifacts), node("n2", &["cpu-n2.pb.gz"])],
        )
        .expect("slice");
        RequestResults::from_slices("0c7e3a40-0000-4000-8000-000000000001", [&slice], Some(1))
    }

    #[test]
    fn only_finished_requests_with_artifacts_are_downloadable() {
        let all: &[String] = &[];
        assert_eq!(
            artifacts_of(
                "r",
                Some(&request(Some("Succeeded"))),
                &results(&["cpu-n1.pb.gz"]),
                all
            ),
            Ok(vec!["cpu-n1.pb.gz".to_string(), "cpu-n2.pb.gz".to_string()])
        );
        assert_eq!(
            artifacts_of(
                "r",
                Some(&request(Some("PartiallySucceeded"))),
                &results(&["a", "b"]),
                &["n1".to_string()]
            ),
            Ok(vec!["a".to_string(), "b".to_string()])
        );
        let running =
            artifacts_of("r", Some(&request(Some("Running"))), &results(&["x"]), all).unwrap_err();
        assert!(running.contains("still Running"), "{running}");
        let failed = artifacts_of(
            "r",
            Some(&request(Some("Failed"))),
            &RequestResults::default(),
            all,
        )
        .unwrap_err();
        assert!(failed.contains("without artifacts"), "{failed}");
        let other = artifacts_of(
            "r",
            Some(&request(Some("Succeeded"))),
            &results(&[]),
            &["n9".to_string()],
        )
        .unwrap_err();
        assert!(other.contains("no artifacts of node(s) n9"), "{other}");
        let missing = RequestResults::from_slices("other-uid", [], Some(2));
        let gone = artifacts_of("r", Some(&request(Some("Succeeded"))), &missing, all).unwrap_err();
        assert!(gone.contains("are missing"), "{gone}");
        assert!(
            artifacts_of("r", None, &RequestResults::default(), all)
                .unwrap_err()
                .contains("not found")
        );
    }
}
