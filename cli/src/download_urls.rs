//! Asking the operator for short-lived download URLs: create a `ProfileDownload` naming the
//! requests, wait for its status, delete it. The API server authorizes the download when
//! the object is created (RBAC, and `get` on each request through the admission policy);
//! the CLI never sends the user's credentials anywhere but to the API server.
//!
//! Each ProfileDownload carries a fresh public key (`spec.recipientKey`) whose private half
//! stays in this process: the operator seals the URLs to it, so other users who may list or
//! watch ProfileDownloads in the namespace cannot read them.

use std::collections::BTreeMap;
use std::time::Duration;

use flamefleet_api::download_seal::AnswerKey;
use flamefleet_api::{DownloadPhase, ProfileDownload, ProfileDownloadSpec, SealedUrls};
use futures::StreamExt as _;
use kube::api::{Api, DeleteParams, ObjectMeta, PostParams};
use kube::runtime::{WatchStreamExt as _, watcher};

use crate::cluster::Cluster;
use crate::error::{Error, Result};

/// How long to wait for the operator's answer.
pub const ANSWER_TIMEOUT: Duration = Duration::from_secs(60);
/// Most requests one ProfileDownload may name (the API's limit).
pub const MAX_REQUESTS_PER_DOWNLOAD: usize =
    flamefleet_api::profile_download::MAX_DOWNLOAD_REQUESTS;

/// The answer: a URL per (request, artifact), and the CA bundle to trust for them.
#[derive(Debug, Clone, Default)]
pub struct DownloadUrls {
    /// URL by (request name, artifact name).
    pub urls: BTreeMap<(String, String), String>,
    /// Requests without artifacts, and why.
    pub skipped: Vec<(String, String)>,
    /// PEM CA bundle of the store's TLS certificate, when not publicly trusted.
    pub ca_bundle: Option<String>,
}

/// Most nodes one ProfileDownload may name (the API's limit).
pub const MAX_NODES_PER_DOWNLOAD: usize = flamefleet_api::profile_download::MAX_DOWNLOAD_NODES;
/// Most URLs one ProfileDownload answers with (the operator's limit).
pub const MAX_URLS_PER_DOWNLOAD: usize = flamefleet_api::profile_download::MAX_DOWNLOAD_URLS;

/// One ProfileDownload to create: requests, and (for part of one request) its nodes.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Batch {
    /// Request names (at most [`MAX_REQUESTS_PER_DOWNLOAD`]).
    pub requests: Vec<String>,
    /// Only these nodes' artifacts (at most [`MAX_NODES_PER_DOWNLOAD`]); all when empty.
    pub nodes: Vec<String>,
}

/// Asks for URLs of every artifact of `requests` (in the cluster's namespace), in batches of
/// [`MAX_REQUESTS_PER_DOWNLOAD`].
///
/// # Errors
/// As [`batch_urls`].
pub async fn request_urls(cluster: &Cluster, requests: &[String]) -> Result<DownloadUrls> {
    let batches: Vec<Batch> = requests
        .chunks(MAX_REQUESTS_PER_DOWNLOAD)
        .map(|chunk| Batch {
            requests: chunk.to_vec(),
            nodes: Vec::new(),
        })
        .collect();
    batch_urls(cluster, &batches).await
}

/// Asks for URLs of the artifacts each batch names, one ProfileDownload per batch.
///
/// # Errors
/// [`Error::DownloadRefused`] when the API server refuses (RBAC or the admission policy),
/// [`Error::DownloadUnanswered`] when no operator answers in time.
pub async fn batch_urls(cluster: &Cluster, batches: &[Batch]) -> Result<DownloadUrls> {
    let mut all = DownloadUrls::default();
    let add = |answer: DownloadUrls, all: &mut DownloadUrls| {
        all.urls.extend(answer.urls);
        all.skipped.extend(answer.skipped);
        all.ca_bundle = all.ca_bundle.take().or(answer.ca_bundle);
    };
    for batch in batches {
        match one_batch(cluster, &batch.requests, &batch.nodes).await {
            Ok(answer) => add(answer, &mut all),
            // A user allowed to get single requests only (RBAC resourceNames) may download
            // them one at a time: the admission policy checks each name then.
            Err(Error::DownloadRefused { .. }) if batch.requests.len() > 1 => {
                for one in &batch.requests {
                    let answer =
                        one_batch(cluster, std::slice::from_ref(one), &batch.nodes).await?;
                    add(answer, &mut all);
                }
            }
            Err(e) => return Err(e),
        }
    }
    Ok(all)
}

async fn one_batch(
    cluster: &Cluster,
    requests: &[String],
    nodes: &[String],
) -> Result<DownloadUrls> {
    let api: Api<ProfileDownload> = Api::namespaced(cluster.client.clone(), &cluster.namespace);
    let stem: String = requests
        .first()
        .map(|r| r.chars().take(40).collect())
        .unwrap_or_else(|| "download".into());
    let key = AnswerKey::generate().map_err(|e| Error::DownloadFailed {
        message: e.to_string(),
    })?;
    let download = ProfileDownload {
        metadata: ObjectMeta {
            generate_name: Some(format!("{}-", stem.trim_end_matches(['-', '.']))),
            ..ObjectMeta::default()
        },
        spec: ProfileDownloadSpec {
            requests: requests.to_vec(),
            nodes: nodes.to_vec(),
            recipient_key: key.public_key(),
        },
        status: None,
    };
    let created = api
        .create(&PostParams::default(), &download)
        .await
        .map_err(|e| match e {
            kube::Error::Api(status) if status.code == 403 => Error::DownloadRefused {
                message: status.message.clone(),
                namespace: cluster.namespace.clone(),
            },
            kube::Error::Api(status) if status.code == 404 => Error::NotInstalled,
            e => Error::Kube {
                action: "creating a profiledownload".into(),
                source: e,
            },
        })?;
    let name = created.metadata.name.clone().unwrap_or_default();
    let object = format!("{}/{name}", cluster.namespace);
    let answer = wait_answer(&api, &name, key, &object).await;
    // The operator deletes answered downloads itself; deleting now just tidies up early,
    // and a user without `delete` still gets their download.
    let _ = api.delete(&name, &DeleteParams::default()).await;
    answer
}

async fn wait_answer(
    api: &Api<ProfileDownload>,
    name: &str,
    key: AnswerKey,
    object: &str,
) -> Result<DownloadUrls> {
    let mut key = Some(key);
    let config = watcher::Config::default().fields(&format!("metadata.name={name}"));
    let stream = watcher(api.clone(), config)
        .default_backoff()
        .applied_objects();
    tokio::pin!(stream);
    let wait = async {
        while let Some(event) = stream.next().await {
            let Ok(download) = event else { continue };
            let Some(status) = download.status else {
                continue;
            };
            match status.phase {
                Some(DownloadPhase::Ready) => {
                    let Some(key) = key.take() else {
                        continue;
                    };
                    let opened = status
                        .sealed_urls
                        .as_deref()
                        .ok_or_else(|| "the answer holds no sealed URLs".to_string())
                        .and_then(|sealed| key.open(sealed, object).map_err(|e| e.to_string()))
                        .and_then(|plain| {
                            serde_json::from_slice::<SealedUrls>(&plain)
                                .map_err(|e| format!("the opened answer does not parse: {e}"))
                        })
                        .map_err(|message| Error::DownloadFailed { message })?;
                    return Ok(DownloadUrls {
                        urls: opened
                            .artifacts
                            .into_iter()
                            .map(|a| ((a.request, a.name), a.url))
                            .collect(),
                        skipped: status
                            .skipped
                            .into_iter()
                            .map(|s| (s.request, s.reason))
                            .collect(),
                        ca_bundle: status.ca_bundle,
                    });
                }
                Some(DownloadPhase::Failed | DownloadPhase::Expired) => {
                    return Err(Error::DownloadFailed {
                        message: status
                            .message
                            .unwrap_or_else(|| "the operator gave no reason".into()),
                    });
                }
                None => {}
            }
        }
        Err(Error::DownloadUnanswered {
            name: name.to_owned(),
            seconds: ANSWER_TIMEOUT.as_secs(),
        })
    };
    tokio::time::timeout(ANSWER_TIMEOUT, wait)
        .await
        .unwrap_or_else(|_| {
            Err(Error::DownloadUnanswered {
                name: name.to_owned(),
                seconds: ANSWER_TIMEOUT.as_secs(),
            })
        })
}

/// An HTTP client for the store: trusts `ca_bundle` (when given) besides the system roots.
///
/// # Errors
/// [`Error::StoreUnreachable`] when the bundle does not parse or the client cannot be built.
pub fn http_client(ca_bundle: Option<&str>) -> Result<reqwest::Client> {
    let fail = |reason: String| Error::StoreUnreachable {
        artifact: String::new(),
        url: String::new(),
        reason,
    };
    let mut builder = reqwest::Client::builder().timeout(Duration::from_secs(120));
    if let Some(pem) = ca_bundle {
        for cert in reqwest::Certificate::from_pem_bundle(pem.as_bytes())
            .map_err(|e| fail(format!("the store's CA bundle does not parse: {e}")))?
        {
            builder = builder.add_root_certificate(cert);
        }
    }
    builder
        .build()
        .map_err(|e| fail(format!("cannot build the HTTP client: {e}")))
}
