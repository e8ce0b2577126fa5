//! The fault tier: a real component fails while captures are in flight, and what survives
//! is measured. Each test owns this binary's control plane (etcd + kube-apiserver started
//! by the test process), real agents capturing real workloads and a real operator; the
//! fault is injected with the real mechanism (the process stopped, then started again on
//! the same ports and data) for a fixed time, the fault's own and only timer. Every other
//! wait is on a signal: a phase, an agent's log line, `/readyz`.
//!
//! Each test prints one `FAULT` line with its figures (requests in flight, end phases with
//! reasons, artifacts lost, duplicates, time from recovery to the last status write, peak
//! RSS); `docs/benchmarks.md` keeps them and `docs/failure-modes.md` says what a user sees.

mod pipeline_support;

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use flamefleet_api::{ProfileRequest, RequestPhase};
use flamefleet_e2e::{Component, ControlPlane, TestNamespace};
use futures::StreamExt as _;
use kube::api::{Api, PostParams};
use kube::runtime::{WatchStreamExt as _, watcher};
use pipeline_support::{Pipeline, PipelineOptions, RUN_LABEL, node_results, serial};
use serde_json::json;

/// How long each fault lasts.
const OUTAGE: Duration = Duration::from_secs(30);
/// Bound of every wait on a signal.
const TIMEOUT: Duration = Duration::from_secs(120);

/// Fails unless this process started the control plane: the fault tier stops it, which a
/// control plane shared through `FLAMEFLEET_KUBECONFIG` must never suffer.
fn owned_control_plane() -> &'static ControlPlane {
    assert!(
        std::env::var_os(flamefleet_e2e::control_plane::KUBECONFIG_ENV).is_none(),
        "the fault tier stops and restarts etcd and kube-apiserver: unset {} so that this test binary starts its own",
        flamefleet_e2e::control_plane::KUBECONFIG_ENV
    );
    ControlPlane::shared().expect("the test's own control plane")
}

/// Every phase each request of the fixture went through, as a watch saw them, and when it
/// first saw each request terminal. The watch lives through the fault (it re-lists after a
/// `410 Gone` like any client), so it also proves a client's watch resumes.
#[derive(Clone, Default)]
struct PhaseLog {
    seen: Arc<Mutex<Seen>>,
}

/// Per request: the phases seen in order, and when it was first seen terminal.
type Seen = BTreeMap<String, (Vec<RequestPhase>, Option<Instant>)>;

impl PhaseLog {
    /// Starts watching the fixture's requests in `ns`; returns once the watch has listed.
    async fn start(pipeline: &Pipeline, ns: &TestNamespace) -> Self {
        let log = Self::default();
        let seen = log.seen.clone();
        let api: Api<ProfileRequest> = ns.api();
        let config = watcher::Config::default().labels(&format!("{RUN_LABEL}={}", pipeline.id));
        let (listed_tx, listed) = tokio::sync::oneshot::channel::<()>();
        tokio::spawn(async move {
            let mut listed_tx = Some(listed_tx);
            let stream = watcher::watcher(api, config).default_backoff();
            let mut stream = std::pin::pin!(stream);
            while let Some(event) = stream.next().await {
                let object = match event {
                    Ok(watcher::Event::InitDone) => {
                        if let Some(tx) = listed_tx.take() {
                            let _ = tx.send(());
                        }
                        continue;
                    }
                    Ok(watcher::Event::Apply(o) | watcher::Event::InitApply(o)) => o,
                    _ => continue,
                };
                let Some(phase) = object.status.as_ref().and_then(|s| s.phase) else {
                    continue;
                };
                let name = object.metadata.name.clone().unwrap_or_default();
                let mut seen = seen.lock().unwrap();
                let (phases, terminal_at) = seen.entry(name).or_default();
                if phases.last() != Some(&phase) {
                    phases.push(phase);
                    if phase.is_terminal() && terminal_at.is_none() {
                        *terminal_at = Some(Instant::now());
                    }
                }
            }
        });
        tokio::time::timeout(Duration::from_secs(30), listed)
            .await
            .expect("the phase watch listed within 30 s")
            .expect("the phase watch ended before listing");
        log
    }

    fn snapshot(&self) -> Seen {
        self.seen.lock().unwrap().clone()
    }

    /// Waits until the watch has seen each of `names` terminal: a watch cut by the fault
    /// resumes on its own backoff (up to 30 s between attempts in kube-runtime), after
    /// which it re-lists (`410 Gone`) or continues.
    async fn wait_seen_terminal(&self, names: &[String]) {
        let deadline = Instant::now() + TIMEOUT;
        loop {
            let seen = self.snapshot();
            let missing: Vec<&String> = names
                .iter()
                .filter(|n| !seen.get(*n).is_some_and(|(_, at)| at.is_some()))
                .collect();
            if missing.is_empty() {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "the test's watch never saw {missing:?} end: {seen:?}"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

/// Peak resident set (VmHWM) of process `pid`, MiB.
fn peak_rss_mib(pid: Option<u32>) -> f64 {
    let Some(pid) = pid else { return 0.0 };
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<f64>().ok())
        .map_or(0.0, |kb| kb / 1024.0)
}

/// Waits until every agent in `agents` logged that it attached a sampler for each of
/// `uids` (the capture's window runs from then on).
async fn wait_capturing(pipeline: &Pipeline, agents: &[usize], uids: &[String]) {
    let deadline = Instant::now() + TIMEOUT;
    loop {
        let all = agents.iter().all(|&i| {
            let log = pipeline.agents[i].log_text();
            uids.iter().all(|uid| {
                log.lines()
                    .any(|l| l.contains("sampler attached") && l.contains(uid.as_str()))
            })
        });
        if all {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "agents {agents:?} never attached samplers for {uids:?}\n{}",
            pipeline.agent_logs()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Lines of agent `i`'s log that mention `uid` and `what`.
fn agent_lines(pipeline: &Pipeline, i: usize, uid: &str, what: &str) -> usize {
    pipeline.agents[i]
        .log_text()
        .lines()
        .filter(|l| l.contains(what) && l.contains(uid))
        .count()
}

/// Sends etcd's JSON gateway `body` at `path`; returns the answer.
async fn etcd_call(cp: &ControlPlane, path: &str, body: serde_json::Value) -> serde_json::Value {
    let url = format!("{}{path}", cp.etcd_url());
    let response = reqwest::Client::new()
        .post(&url)
        .json(&body)
        .send()
        .await
        .unwrap_or_else(|e| panic!("POST {url}: {e}"));
    assert!(response.status().is_success(), "POST {url}: {response:?}");
    response.json().await.expect("etcd answers JSON")
}

/// Compacts etcd's history up to its current revision (physically), so that every watch
/// resuming from an older resourceVersion gets `410 Gone`; returns that revision.
async fn compact_etcd(cp: &ControlPlane) -> i64 {
    // Any range answers with the store's current revision in its header.
    let status = etcd_call(cp, "/v3/kv/range", json!({"key": "AA==", "limit": 1})).await;
    let revision: i64 = status["header"]["revision"]
        .as_str()
        .and_then(|r| r.parse().ok())
        .unwrap_or_else(|| panic!("no revision in etcd's answer: {status}"));
    etcd_call(
        cp,
        "/v3/kv/compaction",
        json!({"revision": revision.to_string(), "physical": true}),
    )
    .await;
    revision
}

/// One fault's figures, printed as a `FAULT` line and checked.
struct Figures {
    fault: &'static str,
    in_flight: usize,
    phases: BTreeMap<String, usize>,
    artifacts_lost: usize,
    duplicates: usize,
    recovery_to_last_write: Duration,
    agent_rss_mib: f64,
    operator_rss_mib: f64,
}

impl Figures {
    fn print(&self) {
        let phases = self
            .phases
            .iter()
            .map(|(p, n)| format!("{p} {n}"))
            .collect::<Vec<_>>()
            .join(", ");
        eprintln!(
            "FAULT {}: requests in flight {}; ended {phases}; artifacts lost {}; duplicates {}; recovery to last status write {:.1} s; peak RSS agent {:.1} MiB, operator {:.1} MiB",
            self.fault,
            self.in_flight,
            self.artifacts_lost,
            self.duplicates,
            self.recovery_to_last_write.as_secs_f64(),
            self.agent_rss_mib,
            self.operator_rss_mib,
        );
    }
}

/// Requests of a control-plane outage: CPU and runqlat on both nodes, long enough that the
/// outage starts while they capture and ends after they finished on the agents.
const REQUESTS: [(&str, &str); 3] = [("cpu-a", "cpu"), ("cpu-b", "cpu"), ("runq", "runqlat")];

/// Two pods on the two agents and REQUESTS selecting both, each lasting `duration`, once
/// every capture is running: the namespace, its phase log, the requests' API and uids.
async fn web_requests_capturing(
    pipeline: &mut Pipeline,
    namespace: &str,
    duration: &str,
) -> (TestNamespace, PhaseLog, Api<ProfileRequest>, Vec<String>) {
    let ns = TestNamespace::create(namespace).await.unwrap();
    pipeline
        .pod(&ns, "web-1", 0, &[("app", "web")], "spin", 1)
        .await;
    pipeline
        .pod(&ns, "web-2", 1, &[("app", "web")], "wake", 1)
        .await;
    let log = PhaseLog::start(pipeline, &ns).await;
    let api: Api<ProfileRequest> = ns.api();
    let mut uids = Vec::new();
    for (name, ty) in REQUESTS {
        let request = pipeline.request(
            name,
            json!({"type": ty, "selector": {"matchLabels": {"app": "web"}}, "duration": duration}),
        );
        let created = api.create(&PostParams::default(), &request).await.unwrap();
        uids.push(created.metadata.uid.unwrap());
    }
    wait_capturing(pipeline, &[0, 1], &uids).await;
    (ns, log, api, uids)
}

/// Stops `component` for [`OUTAGE`] while [`REQUESTS`] capture on two nodes, starts it
/// again, and checks that every request ends Succeeded exactly once with every artifact
/// stored as its slice says, and that the operator's watches resume. With `compact`, etcd's
/// history is compacted during the outage so that resuming watches get `410 Gone`.
async fn control_plane_outage(fault: &'static str, component: Component, compact: bool) {
    let _serial = serial().await;
    let cp = owned_control_plane();
    let mut pipeline = Pipeline::start(PipelineOptions::default()).await;
    let (ns, log, api, uids) = web_requests_capturing(&mut pipeline, "ff-fault", "10s").await;

    // The fault: the process stops; its clients get connection errors (etcd: the API
    // server's answers fail) for the whole outage.
    let stopped = tokio::task::spawn_blocking(move || cp.stop(component));
    stopped.await.unwrap().expect("stopping the component");
    let outage_started = Instant::now();
    if compact {
        let revision = compact_etcd(cp).await;
        eprintln!("compacted etcd at revision {revision} during the outage");
    }
    tokio::time::sleep(OUTAGE.saturating_sub(outage_started.elapsed())).await;
    let uploaded_during_outage = (0..2)
        .map(|i| {
            uids.iter()
                .filter(|uid| agent_lines(&pipeline, i, uid, "capture done") > 0)
                .count()
        })
        .sum::<usize>();
    // Recovery starts when the process does; `restart` returns once /readyz says ok.
    let recovered = Instant::now();
    tokio::task::spawn_blocking(move || cp.restart(component))
        .await
        .unwrap()
        .expect("the component starts again");
    eprintln!(
        "{fault}: /readyz ok {:.1} s after the restart",
        recovered.elapsed().as_secs_f64()
    );
    eprintln!(
        "{fault}: {} s outage; {uploaded_during_outage} node captures finished on the agents during it",
        OUTAGE.as_secs()
    );

    let figures = settle(&mut pipeline, &api, &log, recovered, fault).await;
    // The operator's watch works after the outage: a request created now is handled.
    let after = pipeline.request(
        "after",
        json!({"type": "cpu", "selector": {"matchLabels": {"app": "web"}}, "duration": "1s"}),
    );
    let asked = Instant::now();
    let (after, _) = pipeline.run(&ns, &after, TIMEOUT).await;
    eprintln!(
        "{fault}: a 1 s request created after the recovery ended {:.1} s later",
        asked.elapsed().as_secs_f64()
    );
    assert_eq!(
        after.status.as_ref().and_then(|s| s.phase),
        Some(RequestPhase::Succeeded),
        "a request created after the outage: {:#?}\n{}",
        after.status,
        pipeline.operator_logs()
    );
    figures.print();
    for name in REQUESTS.map(|(n, _)| n) {
        let request = api.get(name).await.unwrap();
        assert_eq!(
            request.status.as_ref().and_then(|s| s.phase),
            Some(RequestPhase::Succeeded),
            "{name}: {:#?}\n{}\n{}",
            request.status,
            pipeline.operator_logs(),
            pipeline.agent_logs()
        );
    }
    assert_eq!(figures.artifacts_lost, 0, "artifacts recorded but missing");
    assert_eq!(
        figures.duplicates,
        0,
        "captures started twice\n{}",
        pipeline.agent_logs()
    );
}

/// Waits for every request of [`REQUESTS`] to end and measures what survived: each ended
/// exactly once (nothing after its first terminal phase), every artifact a slice records
/// is stored with the digest and size it records, and each agent started one capture per
/// request.
async fn settle(
    pipeline: &mut Pipeline,
    api: &Api<ProfileRequest>,
    log: &PhaseLog,
    recovered: Instant,
    fault: &'static str,
) -> Figures {
    let names: Vec<String> = REQUESTS.iter().map(|(n, _)| (*n).to_string()).collect();
    settle_requests(pipeline, api, log, recovered, fault, &names).await
}

/// [`settle`] for the requests `names`.
async fn settle_requests(
    pipeline: &mut Pipeline,
    api: &Api<ProfileRequest>,
    log: &PhaseLog,
    recovered: Instant,
    fault: &'static str,
    names: &[String],
) -> Figures {
    // The last status write is when the last request was first read terminal (a GET
    // every 100 ms); the test's own watch may see it later, after its backoff.
    let mut done = BTreeMap::new();
    let mut last_write = recovered;
    for name in names {
        let phases = pipeline.watch_phases(api, name).await;
        let (request, _) = pipeline.wait_terminal(api, name, TIMEOUT, phases).await;
        last_write = last_write.max(Instant::now());
        done.insert(name.clone(), request);
    }
    log.wait_seen_terminal(names).await;
    let watch_resumed = recovered.elapsed();
    let seen = log.snapshot();
    let mut phases = BTreeMap::new();
    let mut artifacts_lost = 0;
    let mut duplicates = 0;
    for (name, request) in &done {
        let status = request.status.clone().unwrap_or_default();
        let phase = status.phase.expect("terminal");
        let key = match &status.reason {
            Some(reason) => format!("{phase} ({reason})"),
            None => phase.to_string(),
        };
        *phases.entry(key).or_insert(0) += 1;
        let (history, _) = seen
            .get(name)
            .cloned()
            .unwrap_or_else(|| panic!("the watch never saw {name}"));
        let first_terminal = history.iter().position(|p| p.is_terminal());
        assert_eq!(
            first_terminal,
            Some(history.len() - 1),
            "{name} went through {history:?}"
        );
        for node in node_results(&pipeline.client, request).await.values() {
            for artifact in &node.artifacts {
                match std::fs::read(pipeline.stored_artifact(request, &artifact.name)) {
                    Ok(body) => pipeline_support::check_digest(artifact, &body),
                    Err(_) => artifacts_lost += 1,
                }
            }
        }
        let uid = request.metadata.uid.clone().unwrap();
        for i in 0..pipeline.agents.len() {
            duplicates += agent_lines(pipeline, i, &uid, "new capture").saturating_sub(1);
        }
    }
    eprintln!(
        "{fault}: the test's own watch saw every request end {:.1} s after the recovery",
        watch_resumed.as_secs_f64()
    );
    Figures {
        fault,
        in_flight: names.len(),
        phases,
        artifacts_lost,
        duplicates,
        recovery_to_last_write: last_write - recovered,
        agent_rss_mib: (0..pipeline.agents.len())
            .map(|i| peak_rss_mib(pipeline.agents[i].pid()))
            .fold(0.0, f64::max),
        operator_rss_mib: peak_rss_mib(pipeline.operator.as_ref().and_then(|p| p.pid())),
    }
}

/// kube-apiserver stopped for 30 s mid-capture, etcd's history compacted meanwhile: the
/// captures finish on the agents, every result reaches its slice and status once the
/// server is back, and every watch resumes (after `410 Gone`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn api_server_stopped_30s_mid_capture() {
    control_plane_outage("kube-apiserver stopped 30 s", Component::ApiServer, true).await;
}

/// etcd stopped for 30 s mid-capture: the API server answers errors meanwhile; the same
/// must hold.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_stopped_30s_mid_capture() {
    control_plane_outage("etcd stopped 30 s", Component::Etcd, false).await;
}

/// The built-in store's process killed (its pod deleted) while captures run, back after
/// 30 s on the same volume: agents retry their uploads with backoff within the request's
/// deadline (the operator's default grace of 60 s), so every node succeeds, and every
/// artifact a slice records is in the store with the digest it records.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn artifact_store_down_30s_mid_capture() {
    let _serial = serial().await;
    owned_control_plane();
    let mut pipeline = Pipeline::start(PipelineOptions {
        store_process: true,
        capture_grace: Duration::from_secs(60),
        ..PipelineOptions::default()
    })
    .await;
    let (_ns, log, api, _uids) =
        web_requests_capturing(&mut pipeline, "ff-fault-store", "5s").await;
    pipeline.kill_store();
    let outage_started = Instant::now();
    // The uploads fail while the store is down: the agents say so and retry.
    let deadline = Instant::now() + OUTAGE;
    let mut retrying = false;
    while !retrying && Instant::now() < deadline {
        retrying = (0..2).all(|i| {
            pipeline.agents[i]
                .log_text()
                .contains("upload failed, retrying")
        });
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(
        retrying,
        "the agents did not retry an upload while the store was down\n{}",
        pipeline.agent_logs()
    );
    tokio::time::sleep(OUTAGE.saturating_sub(outage_started.elapsed())).await;
    pipeline.start_store();
    let recovered = Instant::now();
    let figures = settle(
        &mut pipeline,
        &api,
        &log,
        recovered,
        "artifact store down 30 s",
    )
    .await;
    figures.print();
    for name in REQUESTS.map(|(n, _)| n) {
        let request = api.get(name).await.unwrap();
        assert_eq!(
            request.status.as_ref().and_then(|s| s.phase),
            Some(RequestPhase::Succeeded),
            "{name}: {:#?}\n{}\n{}",
            request.status,
            pipeline.operator_logs(),
            pipeline.agent_logs()
        );
    }
    assert_eq!(figures.artifacts_lost, 0, "artifacts recorded but missing");
    assert_eq!(figures.duplicates, 0, "captures started twice");
}

/// A small tmpfs mounted for the store's volume, unmounted (lazily) on drop.
struct SmallVolume {
    dir: tempfile::TempDir,
}

impl SmallVolume {
    fn mount(size: &str) -> Self {
        let dir = tempfile::Builder::new()
            .prefix("flamefleet-fault-volume-")
            .tempdir()
            .unwrap();
        let out = std::process::Command::new("mount")
            .args([
                "-t",
                "tmpfs",
                "-o",
                &format!("size={size},mode=0700"),
                "tmpfs",
            ])
            .arg(dir.path())
            .output()
            .expect("running mount (util-linux)");
        assert!(
            out.status.success(),
            "mounting a tmpfs at {}: {}",
            dir.path().display(),
            String::from_utf8_lossy(&out.stderr)
        );
        Self { dir }
    }

    fn path(&self) -> &std::path::Path {
        self.dir.path()
    }

    /// Writes a filler file until the volume refuses (ENOSPC); returns its path.
    fn fill(&self) -> std::path::PathBuf {
        use std::io::Write as _;
        let path = self.path().join("filler");
        let mut file = std::fs::File::create(&path).expect("creating the filler");
        let chunk = vec![0xa5u8; 4096];
        loop {
            match file.write(&chunk) {
                Ok(0) => break,
                Ok(_) => {}
                Err(e) if e.kind() == std::io::ErrorKind::StorageFull => break,
                Err(e) => panic!("filling {}: {e}", path.display()),
            }
        }
        let _ = file.sync_all();
        path
    }
}

impl Drop for SmallVolume {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount")
            .arg("-l")
            .arg(self.dir.path())
            .status();
    }
}

/// The store's volume full: uploads are refused with `StorageFull` named as the node's
/// reason and in its message, the store keeps serving what it holds, and once space
/// returns the next capture is stored; nothing stored before is damaged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_store_volume_refuses_uploads_by_name_and_recovers() {
    let _serial = serial().await;
    owned_control_plane();
    let volume = SmallVolume::mount("2m");
    let mut pipeline = Pipeline::start(PipelineOptions {
        store_process: true,
        store_dir: Some(volume.path().join("store")),
        ..PipelineOptions::default()
    })
    .await;
    let ns = TestNamespace::create("ff-fault-full").await.unwrap();
    pipeline
        .pod(&ns, "web-1", 0, &[("app", "web")], "spin", 1)
        .await;
    pipeline
        .pod(&ns, "web-2", 1, &[("app", "web")], "spin", 1)
        .await;
    let cpu = json!({"type": "cpu", "selector": {"matchLabels": {"app": "web"}}, "duration": "1s"});
    let (before, _) = pipeline
        .run(&ns, &pipeline.request("before", cpu.clone()), TIMEOUT)
        .await;
    assert_eq!(
        before.status.as_ref().and_then(|s| s.phase),
        Some(RequestPhase::Succeeded)
    );
    let kept: Vec<_> = node_results(&pipeline.client, &before)
        .await
        .into_values()
        .flat_map(|n| n.artifacts)
        .collect();
    assert_eq!(kept.len(), 2, "{kept:#?}");

    let filler = volume.fill();
    let started = Instant::now();
    let (full, _) = pipeline
        .run(&ns, &pipeline.request("full", cpu.clone()), TIMEOUT)
        .await;
    let refused_after = started.elapsed();
    let status = full.status.clone().unwrap_or_default();
    assert_eq!(status.phase, Some(RequestPhase::Failed), "{status:#?}");
    assert_eq!(status.reason.as_deref(), Some("StorageFull"), "{status:#?}");
    for node in node_results(&pipeline.client, &full).await.values() {
        assert_eq!(node.reason.as_deref(), Some("StorageFull"), "{node:#?}");
        let message = node.message.as_deref().unwrap_or_default();
        assert!(message.contains("StorageFull"), "{message}");
        assert!(message.contains("space"), "{message}");
        assert!(node.artifacts.is_empty(), "{node:#?}");
    }
    pipeline
        .store
        .as_mut()
        .expect("the store process")
        .assert_alive();

    std::fs::remove_file(&filler).unwrap();
    let recovered = Instant::now();
    let (after, _) = pipeline
        .run(&ns, &pipeline.request("after", cpu), TIMEOUT)
        .await;
    let recovery = recovered.elapsed();
    assert_eq!(
        after.status.as_ref().and_then(|s| s.phase),
        Some(RequestPhase::Succeeded),
        "{:#?}\n{}",
        after.status,
        pipeline.agent_logs()
    );
    // What was stored before the volume filled is intact, on disk and downloaded.
    let mut lost = 0;
    for artifact in &kept {
        match std::fs::read(pipeline.stored_artifact(&before, &artifact.name)) {
            Ok(body) => pipeline_support::check_digest(artifact, &body),
            Err(_) => lost += 1,
        }
        pipeline.download(&before, artifact).await;
    }
    // Nothing of the refused uploads stayed behind in the store's temporary directory.
    let leftovers: Vec<_> = std::fs::read_dir(pipeline.store_dir().join(".tmp"))
        .map(|d| d.flatten().map(|e| e.path()).collect())
        .unwrap_or_default();
    assert!(leftovers.is_empty(), "{leftovers:?}");
    Figures {
        fault: "store volume full",
        in_flight: 1,
        phases: BTreeMap::from([("Failed (StorageFull)".to_string(), 1)]),
        artifacts_lost: lost,
        duplicates: 0,
        recovery_to_last_write: recovery,
        agent_rss_mib: (0..2)
            .map(|i| peak_rss_mib(pipeline.agents[i].pid()))
            .fold(0.0, f64::max),
        operator_rss_mib: peak_rss_mib(pipeline.operator.as_ref().and_then(|p| p.pid())),
    }
    .print();
    eprintln!(
        "store volume full: the refused request ended in {:.1} s",
        refused_after.as_secs_f64()
    );
    assert_eq!(lost, 0);
}

/// Ad hoc requests in flight when the leader is killed. Each holds a capture on both
/// nodes: with the policies' runs they stay under the per-node budget (at most 100), so
/// that a scheduled time without a run is a miss, not a run skipped for budget.
const LEADER_REQUESTS: usize = 60;
/// Policies running when the leader is killed.
const LEADER_POLICIES: usize = 5;
/// Their schedule's period, seconds.
const POLICY_PERIOD: i64 = 5;

/// The operator leader SIGKILLed with requests and policies in flight, a standby replica
/// on the same Lease: the standby leads within the Lease time, every request ends exactly
/// once with one capture per node, every artifact is stored, no scheduled run is missed or
/// doubled, and no capture is left running on an agent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn operator_leader_killed_with_requests_and_policies_in_flight() {
    use flamefleet_api::SamplingPolicy;
    use kube::api::{Patch, PatchParams};
    use pipeline_support::{is_leader, metrics_at, runs_of, scheduled_second};

    let _serial = serial().await;
    owned_control_plane();
    // The store runs apart from the operator replicas, as the chart installs it: the URLs
    // the killed leader signed stay valid.
    let mut pipeline = Pipeline::start(PipelineOptions {
        store_process: true,
        operator_args: vec![
            "--max-concurrent-captures=0".into(),
            "--max-concurrent-captures-per-namespace=0".into(),
        ],
        ..PipelineOptions::default()
    })
    .await;
    let lease = Duration::from_secs(PipelineOptions::default().lease_seconds);
    let ns = TestNamespace::create("ff-fault-leader").await.unwrap();
    pipeline
        .pod(&ns, "web-1", 0, &[("app", "web")], "spin", 1)
        .await;
    pipeline
        .pod(&ns, "web-2", 1, &[("app", "web")], "spin", 1)
        .await;
    // The ad hoc requests live in a namespace of their own: a namespace whose queue of
    // requests waiting to start is full passes its policies' runs over by design
    // (--max-queued-runs-per-namespace), which is not what this test counts.
    let adhoc = TestNamespace::create("ff-fault-adhoc").await.unwrap();
    pipeline
        .pod(&adhoc, "web-3", 0, &[("app", "web")], "spin", 1)
        .await;
    pipeline
        .pod(&adhoc, "web-4", 1, &[("app", "web")], "spin", 1)
        .await;
    let (mut standby, standby_port) = pipeline.start_replica();
    let log = PhaseLog::start(&pipeline, &adhoc).await;

    let policies: Api<SamplingPolicy> = ns.api();
    let mut policy_uids = Vec::new();
    for i in 0..LEADER_POLICIES {
        let policy = pipeline.policy(
            &format!("sampled-{i}"),
            json!({
                "schedule": format!("*/{POLICY_PERIOD} * * * * *"),
                "startingDeadlineSeconds": 60,
                "template": {"type": "cpu", "selector": {"matchLabels": {"app": "web"}}, "duration": "1s"},
                "sampling": {"maxPods": 1},
                "budget": {"maxConcurrentCapturesPerNode": 100},
                // Every run stays listed: the count of runs per scheduled time is the check.
                "history": {"successfulRunsHistoryLimit": 1000, "failedRunsHistoryLimit": 1000},
            }),
        );
        let created = policies
            .create(&PostParams::default(), &policy)
            .await
            .unwrap();
        policy_uids.push(created.metadata.uid.unwrap());
    }
    // Every policy has run once; then the ad hoc requests.
    let client = pipeline.client.clone();
    let uids = policy_uids.clone();
    let first_runs: Vec<i64> = pipeline
        .wait_for("a run of every policy", TIMEOUT, || {
            let client = client.clone();
            let uids = uids.clone();
            async move {
                let mut firsts = Vec::new();
                for uid in &uids {
                    firsts.push(scheduled_second(runs_of(&client, uid).await.first()?));
                }
                Some(firsts)
            }
        })
        .await;
    let api: Api<ProfileRequest> = adhoc.api();
    let names: Vec<String> = (0..LEADER_REQUESTS).map(|i| format!("adhoc-{i}")).collect();
    for name in &names {
        let request = pipeline.request(
            name,
            json!({"type": "cpu", "selector": {"matchLabels": {"app": "web"}}, "duration": "8s"}),
        );
        api.create(&PostParams::default(), &request).await.unwrap();
    }
    // Mid-flight: a quarter of the requests capture, the others are still to be
    // dispatched.
    let seen = log.clone();
    pipeline
        .wait_for("a quarter of the requests running", TIMEOUT, || {
            let seen = seen.clone();
            async move {
                let running = seen
                    .snapshot()
                    .iter()
                    .filter(|(n, (p, _))| {
                        n.starts_with("adhoc-") && p.contains(&RequestPhase::Running)
                    })
                    .count();
                (running >= LEADER_REQUESTS / 4).then_some(())
            }
        })
        .await;
    let in_flight = log
        .snapshot()
        .iter()
        .filter(|(n, (p, _))| n.starts_with("adhoc-") && !p.last().is_some_and(|p| p.is_terminal()))
        .count();
    let leader_rss = peak_rss_mib(pipeline.operator.as_ref().and_then(|p| p.pid()));
    pipeline.kill_operator();
    let killed = Instant::now();
    let killed_at = k8s_openapi::jiff::Timestamp::now().as_second();
    loop {
        standby.assert_alive();
        if is_leader(&metrics_at(standby_port).await) {
            break;
        }
        assert!(
            killed.elapsed() < TIMEOUT,
            "the standby never took over:\n{}",
            standby.log_tail()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let takeover = killed.elapsed();
    eprintln!(
        "operator leader killed: the standby led {:.1} s later (Lease {} s)",
        takeover.as_secs_f64(),
        lease.as_secs()
    );
    assert!(
        takeover < lease * 3,
        "the standby took {takeover:?} to take over a Lease of {lease:?}"
    );
    // `settle` follows the replica that leads now.
    pipeline.operator = Some(standby);
    let mut figures = settle_requests(
        &mut pipeline,
        &api,
        &log,
        killed,
        "operator leader SIGKILLed",
        &names,
    )
    .await;
    figures.in_flight = in_flight;
    figures.operator_rss_mib = figures.operator_rss_mib.max(leader_rss);

    // Scheduled runs: every period from each policy's first run to past the takeover has
    // exactly one run.
    let until = killed_at + 3 * POLICY_PERIOD;
    let client = pipeline.client.clone();
    let uids = policy_uids.clone();
    let runs = pipeline
        .wait_for("every policy's runs past the takeover", TIMEOUT, || {
            let client = client.clone();
            let uids = uids.clone();
            async move {
                let mut all = Vec::new();
                for uid in &uids {
                    let runs = runs_of(&client, uid).await;
                    if !runs.iter().any(|r| scheduled_second(r) >= until) {
                        return None;
                    }
                    all.push(runs);
                }
                Some(all)
            }
        })
        .await;
    for i in 0..LEADER_POLICIES {
        policies
            .patch(
                &format!("sampled-{i}"),
                &PatchParams::default(),
                &Patch::Merge(json!({"spec": {"suspend": true}})),
            )
            .await
            .unwrap();
    }
    // What the policies themselves counted as missed (past startingDeadlineSeconds).
    let mut counted_missed = 0;
    for i in 0..LEADER_POLICIES {
        let policy = policies.get(&format!("sampled-{i}")).await.unwrap();
        counted_missed += policy.status.and_then(|s| s.missed_runs).unwrap_or(0);
    }
    let mut missed = 0;
    let mut doubled = 0;
    for (runs, first) in runs.iter().zip(&first_runs) {
        let times: Vec<i64> = runs.iter().map(scheduled_second).collect();
        let distinct: std::collections::BTreeSet<i64> = times.iter().copied().collect();
        doubled += times.len() - distinct.len();
        missed += (*first..=until)
            .step_by(POLICY_PERIOD as usize)
            .filter(|t| !distinct.contains(t))
            .count();
    }
    figures.duplicates += doubled;
    figures.print();
    eprintln!(
        "operator leader SIGKILLed: {LEADER_POLICIES} policies, scheduled runs missed {missed} (the policies count {counted_missed}), doubled {doubled}"
    );
    let phases = figures.phases.clone();
    assert_eq!(
        phases.get("Succeeded").copied().unwrap_or(0),
        LEADER_REQUESTS,
        "{phases:?}\n{}",
        pipeline.operator_logs()
    );
    assert_eq!(figures.artifacts_lost, 0, "artifacts recorded but missing");
    assert_eq!(figures.duplicates, 0, "captures or runs doubled");
    assert_eq!(missed, 0, "scheduled runs missed");
    // No capture is left running: once every run has ended, every capture an agent
    // started has ended.
    let client = pipeline.client.clone();
    let uids = policy_uids.clone();
    pipeline
        .wait_for("every scheduled run to end", TIMEOUT, || {
            let client = client.clone();
            let uids = uids.clone();
            async move {
                for uid in &uids {
                    if !runs_of(&client, uid)
                        .await
                        .iter()
                        .all(pipeline_support::is_terminal)
                    {
                        return None;
                    }
                }
                Some(())
            }
        })
        .await;
    for i in 0..2 {
        let log = pipeline.agents[i].log_text();
        let started = log.lines().filter(|l| l.contains("new capture")).count();
        let ended = log
            .lines()
            .filter(|l| l.contains("capture done") || l.contains("capture failed"))
            .count();
        assert_eq!(started, ended, "agent {i} left captures running");
    }
}
