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
/// # Errors
/// The first failed write; the slices written before it are marked clean, the others stay
/// dirty for the next attempt.
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
    let params = PatchParams::apply(OPERATOR_FIELD_MANAGER).force();
    let mut written = 0;
    for (index, nodes) in dirty {
        let slice = ProfileResultSlice::for_request(request, index, nodes)?;
        let name = slice.metadata.name.clone().unwrap_or_default();
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
        mark_clean(index);
        written += 1;
    }
    Ok(written)
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
