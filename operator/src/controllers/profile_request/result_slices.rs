//! Writing and deleting a request's `ProfileResultSlice`s.
//!
//! The operator is the only writer of slices: it applies each with server-side apply, field
//! manager `flamefleet-operator`, forced (no one else owns a field of them). Agents never
//! write results; the operator records a node's outcome only from the mTLS `Capture` stream
//! of the agent whose certificate names that node (see `dispatch::connector`), so a node's entry
//! always comes from that node.

use flamefleet_api::result_slice::{selector_for, slice_index};
use flamefleet_api::status_apply::OPERATOR_FIELD_MANAGER;
use flamefleet_api::{ProfileRequest, ProfileResultSlice};
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams};

use super::result_table::ResultTable;
use crate::{Error, Result};

fn api(client: &kube::Client, namespace: &str) -> Api<ProfileResultSlice> {
    Api::namespaced(client.clone(), namespace)
}

/// Applies every dirty slice of `table` for `request`, marking each clean once written.
/// Returns how many were written.
///
/// One slice's failure never holds back the others: every dirty slice is tried. A slice
/// the API server refuses for its content or size (which the bounds on what agents report
/// should make impossible) is written again reduced to what the operator itself knows
/// ([`reduced`]); should even that be refused, the slice is given up (marked clean and
/// logged), so that its nodes' neighbours, the request's status and its completion never
/// wait on it forever.
///
/// # Errors
/// The first failure that may pass on a retry (conflict, throttling, an unreachable or
/// failing API server); those slices stay dirty for the next attempt.
pub async fn write_dirty(
    client: &kube::Client,
    request: &ProfileRequest,
    dirty: Vec<(usize, Vec<flamefleet_api::NodeStatus>)>,
    mut mark_clean: impl FnMut(usize),
) -> Result<usize> {
    let namespace = request
        .metadata
        .namespace
        .as_deref()
        .ok_or(Error::MissingMetadata("namespace"))?;
    let api = api(client, namespace);
    let mut written = 0;
    let mut first_error = None;
    for (index, nodes) in dirty {
        let outcome = match apply_slice(&api, request, index, nodes.clone()).await {
            Err(e) if refused_for_content(&e) => {
                tracing::warn!(
                    slice = index,
                    error = %e,
                    "a result slice was refused for its content; writing it reduced to what the operator knows"
                );
                apply_slice(&api, request, index, reduced(nodes, &e)).await
            }
            other => other,
        };
        match outcome {
            Ok(()) => {
                mark_clean(index);
                written += 1;
            }
            Err(e) if refused_for_content(&e) => {
                tracing::error!(
                    slice = index,
                    error = %e,
                    "a result slice cannot be written even reduced; giving it up so that the request can finish"
                );
                mark_clean(index);
            }
            Err(e) => {
                first_error.get_or_insert(e);
            }
        }
    }
    match first_error {
        Some(e) => Err(e),
        None => Ok(written),
    }
}

async fn apply_slice(
    api: &Api<ProfileResultSlice>,
    request: &ProfileRequest,
    index: usize,
    nodes: Vec<flamefleet_api::NodeStatus>,
) -> Result<()> {
    let params = PatchParams::apply(OPERATOR_FIELD_MANAGER).force();
    let slice = ProfileResultSlice::for_request(request, index, nodes)?;
    let name = slice.metadata.name.clone().unwrap_or_default();
    let namespace = slice.metadata.namespace.clone().unwrap_or_default();
    let body = slice.apply_body()?;
    let action = format!("applying ProfileResultSlice {namespace}/{name}");
    api.patch(&name, &params, &Patch::Apply(body))
        .await
        .map_err(|e| match e {
            // The resource itself is unknown: the CRD is not installed.
            kube::Error::Api(s) if s.code == 404 => Error::OutdatedCrd {
                action,
                message: format!(
                    "{} (the profileresultslices.flamefleet.dev CRD is not installed)",
                    s.message
                ),
            },
            e => Error::kube(action)(e),
        })?;
    Ok(())
}

/// True when the API server refused a write for what it holds (invalid, too large), so
/// that the same write can never pass.
fn refused_for_content(error: &Error) -> bool {
    match error {
        Error::Kube {
            source: kube::Error::Api(status),
            ..
        } => {
            matches!(status.code, 400 | 413 | 422)
                || (status.code == 500 && status.message.contains("too large"))
        }
        _ => false,
    }
}

/// Most pod names a reduced entry keeps.
const REDUCED_PODS: usize = 20;
/// Longest message a reduced entry keeps.
const REDUCED_MESSAGE_BYTES: usize = 512;

/// `nodes` reduced to what the operator itself established: node, phase, reason, a short
/// message, the first pod names, and each artifact's name, size and SHA-256 as checked in
/// the store (no sample type or count, which the agent reported). The refusal is noted in
/// each message.
pub fn reduced(
    nodes: Vec<flamefleet_api::NodeStatus>,
    refusal: &Error,
) -> Vec<flamefleet_api::NodeStatus> {
    let why = flamefleet_api::text::truncated(&refusal.to_string(), 200);
    nodes
        .into_iter()
        .map(|mut entry| {
            entry.pods.truncate(REDUCED_PODS);
            entry.message = entry.message.map(|m| {
                flamefleet_api::text::truncated(
                    &format!("{m} (shortened: the API server refused the full slice: {why})"),
                    REDUCED_MESSAGE_BYTES,
                )
            });
            for artifact in &mut entry.artifacts {
                artifact.name = flamefleet_api::text::truncated(&artifact.name, 253);
                artifact.url = None;
                artifact.sample_type = None;
                artifact.samples = None;
            }
            entry
        })
        .collect()
}

/// Writes every slice of a freshly built `table` and deletes slices of the same request
/// beyond its count (left by an earlier attempt to start it that resolved more nodes).
///
/// # Errors
/// As [`write_dirty`], and a failed list or delete.
pub async fn write_all(
    client: &kube::Client,
    request: &ProfileRequest,
    table: &mut ResultTable,
) -> Result<usize> {
    let dirty = table.dirty_slices();
    let written = write_dirty(client, request, dirty, |i| table.mark_clean(i)).await?;
    let (Some(namespace), Some(uid)) = (
        request.metadata.namespace.as_deref(),
        request.metadata.uid.as_deref(),
    ) else {
        return Ok(written);
    };
    let api = api(client, namespace);
    let existing = api
        .list_metadata(&ListParams::default().labels(&selector_for(uid)))
        .await
        .map_err(Error::kube(format!(
            "listing the ProfileResultSlices of request {namespace}/{uid}"
        )))?;
    for meta in existing.items {
        let Some(name) = meta.metadata.name else {
            continue;
        };
        let stale = slice_index(uid, &name).is_none_or(|i| i >= table.slice_count());
        if stale {
            delete_one(&api, namespace, &name).await?;
        }
    }
    Ok(written)
}

async fn delete_one(api: &Api<ProfileResultSlice>, namespace: &str, name: &str) -> Result<()> {
    match api.delete(name, &DeleteParams::default()).await {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(s)) if s.code == 404 => Ok(()),
        Err(e) => Err(Error::kube(format!(
            "deleting ProfileResultSlice {namespace}/{name}"
        ))(e)),
    }
}

/// Deletes every slice of the request with UID `uid` (the finalizer: a cluster without a
/// garbage collector, such as a bare API server, would keep them). NotFound is success.
///
/// # Errors
/// The API server's error.
pub async fn delete_all(client: &kube::Client, namespace: &str, uid: &str) -> Result<()> {
    let api = api(client, namespace);
    let params = ListParams::default().labels(&selector_for(uid));
    match api
        .delete_collection(&DeleteParams::default(), &params)
        .await
    {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(s)) if s.code == 404 => Ok(()),
        Err(e) => Err(Error::kube(format!(
            "deleting the ProfileResultSlices of request {namespace}/{uid}"
        ))(e)),
    }
}

/// Lists the slices of `request` and builds its result table from them.
///
/// # Errors
/// The API server's error.
pub async fn read_table(client: &kube::Client, request: &ProfileRequest) -> Result<ResultTable> {
    let (Some(namespace), Some(uid)) = (
        request.metadata.namespace.as_deref(),
        request.metadata.uid.as_deref(),
    ) else {
        return Err(Error::MissingMetadata("uid"));
    };
    let slices = flamefleet_api::results::list_slices(client, namespace, uid)
        .await
        .map_err(Error::kube(format!(
            "listing the ProfileResultSlices of request {namespace}/{uid}"
        )))?;
    Ok(ResultTable::from_slices(uid, &slices))
}
