//! Downloading a request's artifacts from the short-lived URLs the operator signed
//! ([`crate::download_urls`]): no credential is sent, the sha256 recorded in the status is
//! checked before anything is written, files are renamed into place atomically.

use std::path::{Path, PathBuf};

use flamefleet_api::{Artifact, ProfileRequest};
use sha2::{Digest, Sha256};

use crate::cluster::Cluster;
use crate::download_urls;
use crate::error::{Error, Result};

/// One downloaded and verified artifact.
#[derive(Debug, Clone)]
pub struct Downloaded {
    /// The artifact's name (file name).
    pub name: String,
    /// Its bytes.
    pub bytes: Vec<u8>,
}

fn redacted(url: &reqwest::Url) -> String {
    let mut u = url.clone();
    u.set_query(None);
    u.to_string()
}

/// Downloads the artifacts of `requests` that `keep` selects: one ProfileDownload per
/// batch of requests for the URLs, then every artifact, each checked against the sha256 its
/// request's status records. Returns (request name, artifact) in request order.
///
/// # Errors
/// As [`crate::download_urls::request_urls`] and [`fetch`]; an artifact the operator gave
/// no URL for is [`Error::StoreUnreachable`] with the operator's reason.
pub async fn fetch_all(
    cluster: &Cluster,
    requests: &[&ProfileRequest],
    keep: impl Fn(&Artifact) -> bool,
) -> Result<Vec<(String, Downloaded)>> {
    let names: Vec<String> = requests
        .iter()
        .filter_map(|r| r.metadata.name.clone())
        .collect();
    let answer = download_urls::request_urls(cluster, &names).await?;
    let http = download_urls::http_client(answer.ca_bundle.as_deref())?;
    let mut out = Vec::new();
    for request in requests {
        let name = request.metadata.name.clone().unwrap_or_default();
        for artifact in request
            .status
            .iter()
            .flat_map(|s| s.nodes.iter())
            .flat_map(|n| n.artifacts.iter())
            .filter(|a| keep(a))
        {
            let Some(url) = answer.urls.get(&(name.clone(), artifact.name.clone())) else {
                let why = answer
                    .skipped
                    .iter()
                    .find(|(r, _)| *r == name)
                    .map_or("the operator gave no URL for it", |(_, why)| why.as_str());
                return Err(Error::StoreUnreachable {
                    artifact: artifact.name.clone(),
                    url: String::new(),
                    reason: why.to_owned(),
                });
            };
            out.push((name.clone(), fetch(&http, artifact, url).await?));
        }
    }
    Ok(out)
}

/// Fetches one artifact from `url` (signed by the operator) into memory and checks its
/// sha256 against the status. No credential is sent.
pub async fn fetch(http: &reqwest::Client, artifact: &Artifact, url: &str) -> Result<Downloaded> {
    let unreachable = |url: String, reason: String| Error::StoreUnreachable {
        artifact: artifact.name.clone(),
        url,
        reason,
    };
    let url = reqwest::Url::parse(url)
        .map_err(|e| unreachable(url.to_string(), format!("invalid URL: {e}")))?;
    let resp = http
        .get(url.clone())
        .send()
        .await
        .map_err(|e| unreachable(redacted(&url), e.without_url().to_string()))?;
    let status = resp.status();
    if !status.is_success() {
        let body = resp.text().await.unwrap_or_default();
        return Err(unreachable(
            redacted(&url),
            format!("HTTP {status}: {}", body.trim()),
        ));
    }
    let bytes = resp
        .bytes()
        .await
        .map_err(|e| unreachable(redacted(&url), e.without_url().to_string()))?
        .to_vec();
    if let Some(expected) = &artifact.sha256 {
        let found = hex::encode(Sha256::digest(&bytes));
        if !found.eq_ignore_ascii_case(expected) {
            return Err(Error::ChecksumMismatch {
                artifact: artifact.name.clone(),
                expected: expected.clone(),
                found,
            });
        }
    }
    Ok(Downloaded {
        name: artifact.name.clone(),
        bytes,
    })
}

/// Writes `bytes` to `dir/name` atomically (temp file in `dir`, then rename).
pub fn write_atomic(dir: &Path, name: &str, bytes: &[u8]) -> Result<PathBuf> {
    use std::io::Write;
    // Names come from the status: never let one escape the output directory.
    let file_name = Path::new(name)
        .file_name()
        .filter(|f| *f == std::ffi::OsStr::new(name))
        .ok_or_else(|| Error::Usage(format!("artifact name {name:?} is not a plain file name")))?;
    std::fs::create_dir_all(dir).map_err(Error::io(format!("creating {}", dir.display())))?;
    let path = dir.join(file_name);
    let mut tmp = tempfile::NamedTempFile::new_in(dir).map_err(Error::io(format!(
        "creating a temporary file in {}",
        dir.display()
    )))?;
    tmp.write_all(bytes)
        .map_err(Error::io(format!("writing {}", path.display())))?;
    tmp.persist(&path)
        .map_err(|e| Error::io(format!("renaming into {}", path.display()))(e.error))?;
    Ok(path)
}
