//! ProfileRequest API calls with kubectl-like error mapping (404 → not found or not
//! installed, 403 → forbidden).

use flamefleet_api::ProfileRequest;
use flamefleet_api::results::RequestResults;
use kube::api::{Api, DeleteParams, ListParams, PostParams};

use crate::cluster::Cluster;
use crate::error::{Error, Result};

/// The ProfileRequest API of the cluster's namespace.
pub fn api(cluster: &Cluster) -> Api<ProfileRequest> {
    Api::namespaced(cluster.client.clone(), &cluster.namespace)
}

fn status_code(e: &kube::Error) -> Option<u16> {
    match e {
        kube::Error::Api(status) => Some(status.code),
        _ => None,
    }
}

/// Maps an API error: 403 → Forbidden, 404 on the collection → NotInstalled.
fn map_err(cluster: &Cluster, verb: &str, action: String, e: kube::Error) -> Error {
    match (status_code(&e), &e) {
        (Some(403), kube::Error::Api(status)) => Error::Forbidden {
            message: status.message.clone(),
            verb: verb.to_string(),
            resource: "profilerequests".into(),
            namespace: cluster.namespace.clone(),
        },
        _ => Error::Kube { action, source: e },
    }
}

/// The API server's message on one line, without the object's generated name (which says
/// nothing when the server made the name up): `ProfileRequest.flamefleet.dev "cpu-" is
/// invalid: spec.x: ...` becomes `spec.x: ...`.
pub fn one_line(message: &str) -> String {
    let message = match message.split_once(" is invalid: ") {
        Some((_, rest)) => rest,
        None => message,
    };
    message.split_whitespace().collect::<Vec<_>>().join(" ")
}

/// Whether the ProfileRequest resource exists: a list on a missing CRD is a 404.
async fn check_installed(cluster: &Cluster) -> Result<()> {
    match api(cluster).list(&ListParams::default().limit(1)).await {
        Ok(_) => Ok(()),
        Err(e) if status_code(&e) == Some(404) => Err(Error::NotInstalled),
        Err(e) => Err(map_err(
            cluster,
            "list",
            "listing profilerequests".into(),
            e,
        )),
    }
}

/// The error for a 404 on one request: NotInstalled when the collection is missing too.
async fn not_found(cluster: &Cluster, name: &str) -> Error {
    match check_installed(cluster).await {
        Err(e) => e,
        Ok(()) => Error::NotFound {
            name: name.to_string(),
            namespace: cluster.namespace.clone(),
        },
    }
}

/// Gets one request.
pub async fn get(cluster: &Cluster, name: &str) -> Result<ProfileRequest> {
    match api(cluster).get(name).await {
        Ok(r) => Ok(r),
        Err(e) if status_code(&e) == Some(404) => Err(not_found(cluster, name).await),
        Err(e) => Err(map_err(
            cluster,
            "get",
            format!("getting profilerequest {name}"),
            e,
        )),
    }
}

/// Lists the namespace's requests.
pub async fn list(cluster: &Cluster) -> Result<Vec<ProfileRequest>> {
    match api(cluster).list(&ListParams::default()).await {
        Ok(l) => Ok(l.items),
        Err(e) if status_code(&e) == Some(404) => Err(Error::NotInstalled),
        Err(e) => Err(map_err(
            cluster,
            "list",
            "listing profilerequests".into(),
            e,
        )),
    }
}

/// Deletes one request (the operator's finalizer then removes its artifacts).
pub async fn delete(cluster: &Cluster, name: &str) -> Result<()> {
    match api(cluster).delete(name, &DeleteParams::default()).await {
        Ok(_) => Ok(()),
        Err(e) if status_code(&e) == Some(404) => Err(not_found(cluster, name).await),
        Err(e) => Err(map_err(
            cluster,
            "delete",
            format!("deleting profilerequest {name}"),
            e,
        )),
    }
}

/// Creates a request.
pub async fn create(cluster: &Cluster, request: &ProfileRequest) -> Result<ProfileRequest> {
    match api(cluster).create(&PostParams::default(), request).await {
        Ok(r) => Ok(r),
        Err(e) if status_code(&e) == Some(404) => Err(Error::NotInstalled),
        Err(kube::Error::Api(status)) if status.code == 422 => Err(Error::Invalid {
            kind: "profilerequest".into(),
            message: one_line(&status.message),
        }),
        Err(e) => Err(map_err(
            cluster,
            "create",
            "creating the profilerequest".into(),
            e,
        )),
    }
}

/// The per-node results of `request`: one list of its ProfileResultSlices by the label
/// `flamefleet.dev/request-uid`.
///
/// # Errors
/// [`Error::Forbidden`] without `list` on profileresultslices, [`Error::ResultsMissing`]
/// when the request announces slices that are not there, [`Error::Kube`] otherwise.
pub async fn results(cluster: &Cluster, request: &ProfileRequest) -> Result<RequestResults> {
    let name = request.metadata.name.clone().unwrap_or_default();
    let uid = request.metadata.uid.clone().unwrap_or_default();
    let namespace = request
        .metadata
        .namespace
        .clone()
        .unwrap_or_else(|| cluster.namespace.clone());
    let missing = |reason: String| Error::ResultsMissing {
        name: name.clone(),
        uid: uid.clone(),
        namespace: namespace.clone(),
        reason,
    };
    let results = match flamefleet_api::results::fetch(&cluster.client, request).await {
        Ok(r) => r,
        Err(kube::Error::Api(status)) if status.code == 403 => {
            return Err(Error::Forbidden {
                message: status.message.clone(),
                verb: "list".into(),
                resource: "profileresultslices".into(),
                namespace,
            });
        }
        Err(kube::Error::Api(status)) if status.code == 404 => {
            return Err(missing(
                "the API server has no profileresultslices.flamefleet.dev resource: the installed CRDs are older than this kubectl-profile; apply charts/flamefleet/crds/".into(),
            ));
        }
        Err(e) => {
            return Err(Error::Kube {
                action: format!("listing the profileresultslices of {name}"),
                source: e,
            });
        }
    };
    if results.incomplete() {
        return Err(missing(format!(
            "{} of its {} result slices are missing (indexes {:?}), so the results of their nodes are unknown",
            results.missing_slices.len(),
            results.missing_slices.len() + results.slices,
            results.missing_slices
        )));
    }
    Ok(results)
}
