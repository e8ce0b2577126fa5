//! Downloading a request's artifacts from the short-lived URLs the operator signed
//! ([`crate::download_urls`]): no credential is sent, the sha256 recorded in the request's
//! result slice is checked before anything is written, files are renamed into place
//! atomically.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use flamefleet_api::Artifact;
use flamefleet_api::results::RequestResults;
use sha2::{Digest, Sha256};

use crate::cluster::Cluster;
use crate::download_urls::{
    self, Batch, MAX_NODES_PER_DOWNLOAD, MAX_REQUESTS_PER_DOWNLOAD, MAX_URLS_PER_DOWNLOAD,
};
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

/// The artifacts to download of one request.
#[derive(Debug, Clone, Copy)]
pub struct FromRequest<'a> {
    /// The request's name.
    pub name: &'a str,
    /// Its per-node results.
    pub results: &'a RequestResults,
    /// Only these nodes' artifacts; every node's when `None`.
    pub nodes: Option<&'a BTreeSet<String>>,
}

/// What to download: (request, node, artifact), and the ProfileDownloads that give their URLs
/// (pure). A request whose every artifact is wanted, and that has at most
/// [`MAX_URLS_PER_DOWNLOAD`] of them, shares a download with other such requests; any other
/// is asked for by batches of its nodes (at most 100 nodes and 500 URLs each), so that a
/// subset of a 5,000-node request signs only the URLs it needs and no answer grows too big.
pub fn plan<'a>(
    requests: &[FromRequest<'a>],
    keep: impl Fn(&Artifact) -> bool,
) -> (Vec<(&'a str, &'a Artifact)>, Vec<Batch>) {
    let mut wanted = Vec::new();
    let mut batches = Vec::new();
    let mut shared = Batch::default();
    let mut shared_urls = 0usize;
    for r in requests {
        let total = r.results.artifacts().count();
        let mine: Vec<(&'a str, &'a Artifact)> = r
            .results
            .artifacts()
            .filter(|(n, a)| r.nodes.is_none_or(|set| set.contains(&n.node)) && keep(a))
            .map(|(n, a)| (n.node.as_str(), a))
            .collect();
        if mine.is_empty() {
            continue;
        }
        if mine.len() == total && total <= MAX_URLS_PER_DOWNLOAD {
            if shared.requests.len() == MAX_REQUESTS_PER_DOWNLOAD
                || shared_urls + total > MAX_URLS_PER_DOWNLOAD
            {
                batches.push(std::mem::take(&mut shared));
                shared_urls = 0;
            }
            shared.requests.push(r.name.to_string());
            shared_urls += total;
        } else {
            let mut batch = Batch {
                requests: vec![r.name.to_string()],
                nodes: Vec::new(),
            };
            let mut urls = 0usize;
            let mut last: Option<&str> = None;
            for (node, _) in &mine {
                if last == Some(*node) {
                    continue;
                }
                last = Some(node);
                let of_node = r.results.nodes.get(*node).map_or(0, |n| n.artifacts.len());
                if !batch.nodes.is_empty()
                    && (batch.nodes.len() == MAX_NODES_PER_DOWNLOAD
                        || urls + of_node > MAX_URLS_PER_DOWNLOAD)
                {
                    batches.push(Batch {
                        requests: batch.requests.clone(),
                        nodes: std::mem::take(&mut batch.nodes),
                    });
                    urls = 0;
                }
                batch.nodes.push(node.to_string());
                urls += of_node;
            }
            batches.push(batch);
        }
        wanted.extend(mine.into_iter().map(|(_, a)| (r.name, a)));
    }
    if !shared.requests.is_empty() {
        batches.push(shared);
    }
    (wanted, batches)
}

/// Progress of a long download on stderr: rewritten in place on a terminal, a line every
/// tenth otherwise; silent for a few files.
struct Progress {
    total: usize,
    done: usize,
    bytes: u64,
    tty: bool,
}

impl Progress {
    /// Below this many files a download is quick and prints nothing.
    const QUIET_BELOW: usize = 20;

    fn new(total: usize) -> Self {
        use std::io::IsTerminal;
        Self {
            total,
            done: 0,
            bytes: 0,
            tty: std::io::stderr().is_terminal(),
        }
    }

    fn step(&mut self, bytes: usize) {
        self.done += 1;
        self.bytes += u64::try_from(bytes).unwrap_or(u64::MAX);
        if self.total < Self::QUIET_BELOW {
            return;
        }
        let line = format!(
            "downloaded {}/{} artifacts ({} KiB)",
            self.done,
            self.total,
            self.bytes / 1024
        );
        if self.tty {
            eprint!("\r\x1b[2K{line}");
            if self.done == self.total {
                eprintln!();
            }
        } else if self.done == self.total || self.done.is_multiple_of((self.total / 10).max(1)) {
            eprintln!("{line}");
        }
    }
}

/// Downloads the artifacts of `requests` that `keep` selects: the URLs from ProfileDownloads
/// batched by [`plan`], then every artifact, each checked against the sha256 its result
/// slice records, with progress on stderr. Returns (request name, artifact) in request
/// order, then node order.
///
/// # Errors
/// As [`crate::download_urls::batch_urls`] and [`fetch`]; an artifact the operator gave no
/// URL for is [`Error::StoreUnreachable`] with the operator's reason.
pub async fn fetch_all(
    cluster: &Cluster,
    requests: &[FromRequest<'_>],
    keep: impl Fn(&Artifact) -> bool,
) -> Result<Vec<(String, Downloaded)>> {
    let (wanted, batches) = plan(requests, keep);
    if wanted.is_empty() {
        return Ok(Vec::new());
    }
    let answer = download_urls::batch_urls(cluster, &batches).await?;
    let http = download_urls::http_client(answer.ca_bundle.as_deref())?;
    let mut progress = Progress::new(wanted.len());
    let mut out = Vec::new();
    for (name, artifact) in wanted {
        let Some(url) = answer.urls.get(&(name.to_string(), artifact.name.clone())) else {
            let why = answer
                .skipped
                .iter()
                .find(|(r, _)| r == name || r.split(',').any(|r| r == name))
                .map_or("the operator gave no URL for it", |(_, why)| why.as_str());
            return Err(Error::StoreUnreachable {
                artifact: artifact.name.clone(),
                url: String::new(),
                reason: why.to_owned(),
            });
        };
        let downloaded = fetch(&http, artifact, url).await?;
        progress.step(downloaded.bytes.len());
        out.push((name.to_string(), downloaded));
    }
    Ok(out)
}

/// Fetches one artifact from `url` (signed by the operator) into memory and checks its
/// sha256 against the result slice. No credential is sent.
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

#[cfg(test)]
mod tests {
    use super::*;
    use flamefleet_api::{NodeStatus, ProfileRequest, ProfileResultSlice};

    fn results(uid: &str, nodes: usize, per_node: usize) -> RequestResults {
        let request: ProfileRequest = serde_json::from_value(serde_json::json!({
            "apiVersion": "flamefleet.dev/v1alpha1", "kind": "ProfileRequest",
            "metadata": {"name": uid, "namespace": "ns", "uid": uid},
            "spec": {"type": "cpu", "podNames": ["p"], "duration": "1s"},
        }))
        .unwrap();
        let entries: Vec<NodeStatus> = (0..nodes)
            .map(|i| NodeStatus {
                node: format!("n{i:04}"),
                artifacts: (0..per_node)
                    .map(|k| Artifact {
                        name: format!("cpu-n{i:04}-{k}.pb.gz"),
                        ..Default::default()
                    })
                    .collect(),
                ..Default::default()
            })
            .collect();
        let slices: Vec<ProfileResultSlice> = entries
            .chunks(100)
            .enumerate()
            .map(|(i, c)| ProfileResultSlice::for_request(&request, i, c.to_vec()).unwrap())
            .collect();
        RequestResults::from_slices(uid, &slices, None)
    }

    #[test]
    fn small_whole_requests_share_a_download_and_big_ones_go_by_nodes() {
        let small_a = results("a", 3, 1);
        let small_b = results("b", 2, 2);
        let big = results("c", 250, 1);
        let requests = [
            FromRequest {
                name: "a",
                results: &small_a,
                nodes: None,
            },
            FromRequest {
                name: "b",
                results: &small_b,
                nodes: None,
            },
            FromRequest {
                name: "c",
                results: &big,
                nodes: None,
            },
        ];
        let (wanted, batches) = plan(&requests, |_| true);
        assert_eq!(wanted.len(), 3 + 4 + 250);
        // c has at most 500 URLs: it shares the download with a and b.
        assert_eq!(batches.len(), 1);
        assert_eq!(batches[0].requests, ["a", "b", "c"]);
        assert!(batches[0].nodes.is_empty());

        let huge = results("d", 5000, 1);
        let (wanted, batches) = plan(
            &[FromRequest {
                name: "d",
                results: &huge,
                nodes: None,
            }],
            |_| true,
        );
        assert_eq!(wanted.len(), 5000);
        assert_eq!(batches.len(), 50);
        assert!(
            batches
                .iter()
                .all(|b| b.nodes.len() == 100 && b.requests == ["d"])
        );

        let heavy = results("e", 200, 8);
        let (_, batches) = plan(
            &[FromRequest {
                name: "e",
                results: &heavy,
                nodes: None,
            }],
            |_| true,
        );
        assert!(
            batches
                .iter()
                .all(|b| b.nodes.len() * 8 <= MAX_URLS_PER_DOWNLOAD)
        );
        assert_eq!(batches.iter().map(|b| b.nodes.len()).sum::<usize>(), 200);
    }

    #[test]
    fn a_subset_names_only_its_nodes() {
        let big = results("d", 5000, 1);
        let subset: BTreeSet<String> = ["n0007".to_string(), "n4000".to_string()].into();
        let (wanted, batches) = plan(
            &[FromRequest {
                name: "d",
                results: &big,
                nodes: Some(&subset),
            }],
            |_| true,
        );
        assert_eq!(wanted.len(), 2);
        assert_eq!(
            batches,
            [Batch {
                requests: vec!["d".into()],
                nodes: vec!["n0007".into(), "n4000".into()]
            }]
        );
        // Filtering by artifact also names nodes, not the whole request.
        let small = results("a", 3, 2);
        let (wanted, batches) = plan(
            &[FromRequest {
                name: "a",
                results: &small,
                nodes: None,
            }],
            |a| a.name.ends_with("-0.pb.gz"),
        );
        assert_eq!(wanted.len(), 3);
        assert_eq!(batches[0].nodes.len(), 3);
    }
}
