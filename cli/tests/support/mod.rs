//! Fixtures of the CLI tests: a real built-in artifact store on 127.0.0.1, real pprof files,
//! ProfileRequests whose status the test writes through the status subresource (as the
//! operator does), the operator's ProfileDownload controller answering for the test's
//! namespace, and a runner for the built binary.

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use flamefleet_api::{
    Artifact, NodeCounts, NodePhase, NodeStatus, ProfileRequest, ProfileResultSlice, RequestPhase,
};
use flamefleet_e2e::TestNamespace;
use flamefleet_operator::store::{
    ArtifactStore, RequestRef, UploadLimits,
    builtin::{BuiltinConfig, BuiltinStore, http::router},
};
use flamefleet_proto::pprof::{Function, Line, Location, Profile, Sample, ValueType};
use kube::api::{Api, Patch, PatchParams, PostParams};
use prost::Message;
use sha2::{Digest, Sha256};

/// A built-in store serving a temporary directory over real HTTP.
pub struct Store {
    pub store: Arc<BuiltinStore>,
    _root: tempfile::TempDir,
}

impl Store {
    /// Starts the store on a free port, and the operator's ProfileDownload controller for
    /// `ns` signing URLs of this store (as the operator does in a cluster).
    pub async fn start_for(ns: &TestNamespace) -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let base: url::Url = format!("http://{}/", listener.local_addr().unwrap())
            .parse()
            .unwrap();
        let store = Self::open(ns, base).await;
        let app = router(store.store.clone());
        tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
        store
    }

    /// Like [`Store::start_for`], but nothing serves the store's URLs (a closed port).
    pub async fn unreachable_for(ns: &TestNamespace) -> Self {
        let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let base: url::Url = format!("http://{}/", closed.local_addr().unwrap())
            .parse()
            .unwrap();
        drop(closed);
        Self::open(ns, base).await
    }

    async fn open(ns: &TestNamespace, base: url::Url) -> Self {
        flamefleet_operator::store::install_default_crypto_provider();
        let root = tempfile::tempdir().unwrap();
        let store = Arc::new(
            BuiltinStore::open(BuiltinConfig {
                root: root.path().to_path_buf(),
                public_url: base,
                secret: b"cli-test-secret-0123456789abcdef0123".to_vec(),
                max_upload_bytes: 64 << 20,
            })
            .await
            .unwrap(),
        );
        tokio::spawn(flamefleet_operator::controllers::download::run(
            Arc::new(
                flamefleet_operator::controllers::download::DownloadContext {
                    client: ns.client(),
                    store: store.clone(),
                    url_ttl: Duration::from_secs(120),
                    request_selector: None,
                    ca_bundle: None,
                    namespace: Some(ns.name().to_owned()),
                    metrics: Arc::new(flamefleet_operator::metrics::Metrics::new()),
                },
            ),
            std::future::pending::<()>(),
        ));
        Self { store, _root: root }
    }

    /// Uploads `bytes` as artifact `name` of `request` through a signed PUT, and returns the
    /// status entry the operator would write (size, sha256; no URL).
    pub async fn upload(&self, request: &ProfileRequest, name: &str, bytes: &[u8]) -> Artifact {
        let rr = RequestRef::new(
            request.metadata.namespace.clone().unwrap(),
            request.metadata.name.clone().unwrap(),
            request.metadata.uid.clone().unwrap(),
        )
        .unwrap();
        let key = rr.artifact(name).unwrap();
        let target = self
            .store
            .upload_target(
                &key,
                &UploadLimits {
                    max_bytes: 64 << 20,
                    sha256: None,
                    ttl: Duration::from_secs(300),
                },
            )
            .await
            .unwrap();
        let resp = reqwest::Client::new()
            .put(target.url)
            .body(bytes.to_vec())
            .send()
            .await
            .unwrap();
        assert!(resp.status().is_success(), "upload failed: {resp:?}");
        Artifact {
            name: name.to_string(),
            url: None,
            size_bytes: Some(bytes.len() as i64),
            sha256: Some(hex::encode(Sha256::digest(bytes))),
            samples: None,
            sample_type: None,
        }
    }
}

/// A gzipped pprof with the given sample type and (leaf-first stack, value) samples.
pub fn pprof(kind: (&str, &str), samples: &[(&[&str], i64)]) -> Vec<u8> {
    let mut p = Profile {
        string_table: vec![String::new(), kind.0.into(), kind.1.into()],
        sample_type: vec![ValueType { r#type: 1, unit: 2 }],
        ..Default::default()
    };
    for (stack, value) in samples {
        let mut ids = Vec::new();
        for name in *stack {
            let idx = match p.string_table.iter().position(|s| s == name) {
                Some(i) => i as i64,
                None => {
                    p.string_table.push((*name).to_string());
                    (p.string_table.len() - 1) as i64
                }
            };
            let id = match p.function.iter().find(|f| f.name == idx) {
                Some(f) => f.id,
                None => {
                    let id = p.function.len() as u64 + 1;
                    p.function.push(Function {
                        id,
                        name: idx,
                        ..Default::default()
                    });
                    p.location.push(Location {
                        id,
                        address: 0x40_0000 + id * 16,
                        line: vec![Line {
                            function_id: id,
                            ..Default::default()
                        }],
                        ..Default::default()
                    });
                    id
                }
            };
            ids.push(id);
        }
        p.sample.push(Sample {
            location_id: ids,
            value: vec![*value],
            label: vec![],
        });
    }
    let mut enc = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    std::io::Write::write_all(&mut enc, &p.encode_to_vec()).unwrap();
    enc.finish().unwrap()
}

/// A runqlat profile as the agent writes it: for each `(bucket index, waits)` in
/// microsecond log2 buckets, a sample with `count` and `latency/nanoseconds` values, the
/// bucket's bounds as numeric labels `bucket_low`/`bucket_high` (nanoseconds), under a
/// synthetic stack target → bucket.
pub fn runqlat_pprof(buckets: &[(usize, i64)]) -> Vec<u8> {
    use flamefleet_proto::pprof::Label;
    let mut p = Profile {
        string_table: [
            "",
            "count",
            "latency",
            "nanoseconds",
            "bucket_low",
            "bucket_high",
            "shop/web-0/web",
        ]
        .map(String::from)
        .to_vec(),
        sample_type: vec![
            ValueType { r#type: 1, unit: 1 },
            ValueType { r#type: 2, unit: 3 },
        ],
        default_sample_type: 1,
        function: vec![Function {
            id: 1,
            name: 6,
            ..Default::default()
        }],
        location: vec![Location {
            id: 1,
            line: vec![Line {
                function_id: 1,
                ..Default::default()
            }],
            ..Default::default()
        }],
        ..Default::default()
    };
    for &(i, n) in buckets {
        let (lo, hi) = flamefleet_proto::latency::bucket_bounds(i);
        let (lo, hi) = (lo as i64 * 1000, hi as i64 * 1000);
        p.string_table
            .push(format!("runqlat [{}, {}) usecs", lo / 1000, hi / 1000));
        let id = p.function.len() as u64 + 1;
        p.function.push(Function {
            id,
            name: (p.string_table.len() - 1) as i64,
            ..Default::default()
        });
        p.location.push(Location {
            id,
            line: vec![Line {
                function_id: id,
                ..Default::default()
            }],
            ..Default::default()
        });
        p.sample.push(Sample {
            location_id: vec![id, 1],
            value: vec![n, n * (lo + hi) / 2],
            label: vec![
                Label {
                    key: 4,
                    num: lo,
                    num_unit: 3,
                    ..Default::default()
                },
                Label {
                    key: 5,
                    num: hi,
                    num_unit: 3,
                    ..Default::default()
                },
            ],
        });
    }
    let mut enc = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    std::io::Write::write_all(&mut enc, &p.encode_to_vec()).unwrap();
    enc.finish().unwrap()
}

/// A CPU profile whose hot frame has no symbol: a location in `libc.so.6` (mapped at
/// 0x7fed09700000 from file offset 0x28000) at 0x7fed097a91f5, called from `main`.
pub fn unsymbolized_profile() -> Vec<u8> {
    use flamefleet_proto::pprof::Mapping;
    let p = Profile {
        string_table: [
            "",
            "samples",
            "count",
            "main",
            "/usr/lib/x86_64-linux-gnu/libc.so.6",
        ]
        .map(String::from)
        .to_vec(),
        sample_type: vec![ValueType { r#type: 1, unit: 2 }],
        mapping: vec![Mapping {
            id: 1,
            memory_start: 0x7fed_0970_0000,
            memory_limit: 0x7fed_09a0_0000,
            file_offset: 0x2_8000,
            filename: 4,
            ..Default::default()
        }],
        function: vec![Function {
            id: 1,
            name: 3,
            ..Default::default()
        }],
        location: vec![
            Location {
                id: 1,
                address: 0x40_1000,
                line: vec![Line {
                    function_id: 1,
                    ..Default::default()
                }],
                ..Default::default()
            },
            Location {
                id: 2,
                mapping_id: 1,
                address: 0x7fed_097a_91f5,
                ..Default::default()
            },
        ],
        sample: vec![
            Sample {
                location_id: vec![2, 1],
                value: vec![90],
                label: vec![],
            },
            Sample {
                location_id: vec![1],
                value: vec![10],
                label: vec![],
            },
        ],
        ..Default::default()
    };
    let mut enc = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    std::io::Write::write_all(&mut enc, &p.encode_to_vec()).unwrap();
    enc.finish().unwrap()
}

/// A CPU profile where `hot_function` dominates.
pub fn cpu_profile(hot_function: &str) -> Vec<u8> {
    pprof(
        ("cpu", "nanoseconds"),
        &[
            (&[hot_function, "handle_request", "main"], 800_000_000),
            (&["parse_json", "handle_request", "main"], 150_000_000),
            (&["main"], 50_000_000),
        ],
    )
}

/// A namespace of its own on the shared control plane; fails clearly when there is none.
pub async fn namespace(prefix: &str) -> TestNamespace {
    TestNamespace::create(prefix)
        .await
        .unwrap_or_else(|e| panic!("the CLI tests need the local control plane: {e}"))
}

/// Creates a cpu ProfileRequest named `name` targeting pod `web-0`.
pub async fn create_request(ns: &TestNamespace, name: &str) -> ProfileRequest {
    create_typed_request(ns, name, "cpu", serde_json::json!({})).await
}

/// Creates a ProfileRequest of `profile_type` named `name` targeting pod `web-0`, with
/// `labels`.
pub async fn create_typed_request(
    ns: &TestNamespace,
    name: &str,
    profile_type: &str,
    labels: serde_json::Value,
) -> ProfileRequest {
    create_request_as(
        &ns.api(),
        serde_json::json!({"name": name, "labels": labels}),
        profile_type,
    )
    .await
}

/// Creates through `api` (whoever's client it is) a ProfileRequest of `profile_type`
/// targeting pod `web-0`, with `metadata` (name, labels, ownerReferences, ...).
pub async fn create_request_as(
    api: &Api<ProfileRequest>,
    metadata: serde_json::Value,
    profile_type: &str,
) -> ProfileRequest {
    let req: ProfileRequest = serde_json::from_value(serde_json::json!({
        "apiVersion": "flamefleet.dev/v1alpha1",
        "kind": "ProfileRequest",
        "metadata": metadata,
        "spec": {"type": profile_type, "podNames": ["web-0"], "duration": "10s"}
    }))
    .unwrap();
    api.create(&PostParams::default(), &req).await.unwrap()
}

/// Writes `status.phase` through the status subresource and the node entries as the
/// request's ProfileResultSlice, as the operator does.
pub async fn write_status(
    ns: &TestNamespace,
    name: &str,
    phase: RequestPhase,
    nodes: Vec<NodeStatus>,
) {
    let api: Api<ProfileRequest> = ns.api();
    let request = api.get(name).await.unwrap();
    let slices: Api<ProfileResultSlice> = ns.api();
    let slice = ProfileResultSlice::for_request(&request, 0, nodes.clone()).unwrap();
    slices
        .patch(
            slice.metadata.name.as_deref().unwrap(),
            &PatchParams::apply("flamefleet-operator").force(),
            &Patch::Apply(slice.apply_body().unwrap()),
        )
        .await
        .unwrap();
    let patch = serde_json::json!({
        "status": {"phase": phase, "nodeCount": nodes.len(), "podCount": 1,
            "resultSlices": 1, "nodeCounts": NodeCounts::of(&nodes)}
    });
    api.patch_status(name, &PatchParams::default(), &Patch::Merge(&patch))
        .await
        .unwrap();
}

/// Merges `status` into the request's status through the status subresource (the
/// operator's fields the CLI reads: phase, startTime, conditions, nodeCounts).
pub async fn patch_status(ns: &TestNamespace, name: &str, status: serde_json::Value) {
    let api: Api<ProfileRequest> = ns.api();
    api.patch_status(
        name,
        &PatchParams::default(),
        &Patch::Merge(serde_json::json!({ "status": status })),
    )
    .await
    .unwrap();
}

/// The request the CLI created in `ns`: waits (watch) for the first one to appear.
pub async fn first_request(ns: &TestNamespace) -> ProfileRequest {
    let api: Api<ProfileRequest> = ns.api();
    let created = kube::runtime::watcher(api, kube::runtime::watcher::Config::default());
    use futures::StreamExt;
    let mut events = std::pin::pin!(kube::runtime::WatchStreamExt::applied_objects(created));
    tokio::time::timeout(Duration::from_secs(60), events.next())
        .await
        .expect("the CLI created no request within 60 s")
        .expect("the watch ended")
        .expect("watching requests")
}

/// A node entry.
pub fn node(
    name: &str,
    phase: NodePhase,
    message: Option<&str>,
    artifacts: Vec<Artifact>,
) -> NodeStatus {
    NodeStatus {
        node: name.to_string(),
        phase: Some(phase),
        pods: vec!["web-0".into()],
        message: message.map(str::to_string),
        artifacts,
        ..Default::default()
    }
}

/// The result of one CLI run.
#[derive(Debug)]
pub struct Run {
    pub code: i32,
    pub stdout: String,
    pub stderr: String,
}

/// Runs the built `kubectl-profile` with `--kubeconfig` and `-n` of the test namespace.
pub async fn cli(kubeconfig: &Path, namespace: &str, args: &[&str]) -> Run {
    let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_kubectl-profile"))
        .arg("--kubeconfig")
        .arg(kubeconfig)
        .args(["-n", namespace])
        .args(args)
        .env_remove("KUBECONFIG")
        .output()
        .await
        .unwrap();
    Run {
        code: out.status.code().unwrap_or(-1),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

/// A `kubectl-profile` run whose stdout and stderr lines are read as they are printed.
pub struct LiveRun {
    lines: tokio::sync::mpsc::UnboundedReceiver<String>,
    done: tokio::task::JoinHandle<Run>,
    pid: u32,
}

impl LiveRun {
    /// Waits until the CLI prints a line (on stdout or stderr) containing `needle` and
    /// returns it; panics with the run's output when the CLI exits first or `limit` passes.
    pub async fn wait_for_line(&mut self, needle: &str, limit: Duration) -> String {
        let found = tokio::time::timeout(limit, async {
            while let Some(line) = self.lines.recv().await {
                if line.contains(needle) {
                    return Some(line);
                }
            }
            None
        })
        .await;
        match found {
            Ok(Some(line)) => line,
            Ok(None) => panic!("the CLI exited without printing {needle:?}"),
            Err(_) => panic!("the CLI printed no {needle:?} within {limit:?}"),
        }
    }

    /// Sends the CLI a SIGINT, as Ctrl-C in its terminal does.
    pub fn interrupt(&self) {
        let pid = nix::unistd::Pid::from_raw(i32::try_from(self.pid).unwrap());
        nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGINT).unwrap();
    }

    /// Waits for the CLI to exit.
    pub async fn finish(self) -> Run {
        self.done.await.unwrap()
    }
}

/// Starts the built `kubectl-profile` as [`cli`] does, reading its stdout and stderr line by
/// line.
pub fn cli_live(kubeconfig: &Path, namespace: &str, args: &[&str]) -> LiveRun {
    use tokio::io::{AsyncBufReadExt, BufReader};
    let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_kubectl-profile"))
        .arg("--kubeconfig")
        .arg(kubeconfig)
        .args(["-n", namespace])
        .args(args)
        .env_remove("KUBECONFIG")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let pid = child.id().unwrap();
    let stdout = child.stdout.take().unwrap();
    let stderr = child.stderr.take().unwrap();
    let (tx, lines) = tokio::sync::mpsc::unbounded_channel();
    let read = |stream: Box<dyn tokio::io::AsyncRead + Send + Unpin>,
                tx: tokio::sync::mpsc::UnboundedSender<String>| {
        tokio::spawn(async move {
            let mut reader = BufReader::new(stream).lines();
            let mut text = String::new();
            while let Ok(Some(line)) = reader.next_line().await {
                text.push_str(&line);
                text.push('\n');
                let _ = tx.send(line);
            }
            text
        })
    };
    let out = read(Box::new(stdout), tx.clone());
    let err = read(Box::new(stderr), tx);
    let done = tokio::spawn(async move {
        let status = child.wait().await.unwrap();
        Run {
            code: status.code().unwrap_or(-1),
            stdout: out.await.unwrap_or_default(),
            stderr: err.await.unwrap_or_default(),
        }
    });
    LiveRun { lines, done, pid }
}

/// The admin kubeconfig of the shared control plane.
pub fn admin_kubeconfig(ns: &TestNamespace) -> PathBuf {
    ns.control_plane().kubeconfig().to_path_buf()
}

/// Files in `dir`, sorted.
pub fn files(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .map(|rd| {
            rd.filter_map(|e| e.ok())
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default();
    names.sort();
    names
}
