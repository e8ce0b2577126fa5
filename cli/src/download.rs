//! Downloading a request's artifacts: bearer token or signed URL, sha256 check before
//! anything is written, atomic rename into the output directory.

use std::path::{Path, PathBuf};

use flamefleet_api::Artifact;
use sha2::{Digest, Sha256};

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

/// Fetches one artifact into memory and checks its sha256 against the status.
///
/// Signed URLs (with `sig=`) are used as given; otherwise the user's bearer token, if any,
/// goes in `Authorization`.
pub async fn fetch(
    http: &reqwest::Client,
    artifact: &Artifact,
    token: Option<&str>,
) -> Result<Downloaded> {
    let unreachable = |url: String, reason: String| Error::StoreUnreachable {
        artifact: artifact.name.clone(),
        url,
        reason,
    };
    let raw = artifact.url.as_deref().ok_or_else(|| {
        unreachable(
            String::new(),
            "the status lists no URL for it; the upload may not be finished".into(),
        )
    })?;
    let url = reqwest::Url::parse(raw)
        .map_err(|e| unreachable(raw.to_string(), format!("invalid URL: {e}")))?;
    let signed = url.query_pairs().any(|(k, _)| k == "sig");
    let mut req = http.get(url.clone());
    if let (false, Some(token)) = (signed, token) {
        req = req.bearer_auth(token);
    }
    let resp = req
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
