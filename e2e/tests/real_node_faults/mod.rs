//! The fault tier's faults of a real node (the control plane's, the store's and the
//! operator's are in `faults.rs`), run by `real_node.rs` on its one installation:
//!
//! - the agent OOM-killed by its memory limit mid-capture ([`agent_oom_killed_mid_capture`]);
//! - the kubelet stopped until the node is NotReady, then started ([`kubelet_restarted`]);
//! - the agent DaemonSet rolled by `helm upgrade` while captures run ([`AgentRoll`], around
//!   `real_node.rs`'s upgrade step).
//!
//! Each injects the fault with the real mechanism, bounded (a guard undoes it when the test
//! fails), waits only on signals (a phase, a node condition, a container state, `bpftool`),
//! and prints one `FAULT` line with its figures, as `faults.rs` does.
//!
//! **Not run yet.** `real_node.rs` does not include this module: it compiled and passed
//! clippy as a module of `real_node.rs` (`mod real_node_faults;`, with
//! `BpfIds::now()` taken before the install, `agent_oom_killed_mid_capture` and
//! `kubelet_restarted` after the across-restart step, and `AgentRoll::start` / `rolled` /
//! `check` around the upgrade step), but no run on the one-node cluster has passed: the
//! attempts of 2026-11-29 failed before the faults, the cluster's Service IPs refusing the
//! operator's connections to the store (`sendto` to the DNS Service IP failed with EPERM
//! from the host too). Wire it in once it passes there.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use flamefleet_api::{ProfileRequest, RequestPhase};
use flamefleet_e2e::Cluster;
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::api::{Api, ListParams, PostParams};
use serde_json::{Value, json};

use super::{NAMESPACE, TIMEOUT, agent_program_names, kubectl_profile, step, walkdir_find};

/// The operator's `--capture-grace` (the chart's `operator.captureGrace`).
const CAPTURE_GRACE: Duration = Duration::from_secs(60);

/// The workload the faults' requests capture: the checkout pod of `real_node.rs`.
pub struct Shop<'a> {
    pub cluster: &'a Cluster,
    pub client: kube::Client,
    /// Its namespace.
    pub ns: String,
    /// The checkout pod.
    pub pod: String,
}

impl Shop<'_> {
    fn requests(&self) -> Api<ProfileRequest> {
        Api::namespaced(self.client.clone(), &self.ns)
    }

    /// Creates request `name` of `kind` on the checkout pod for `duration`; returns when.
    async fn create(&self, name: &str, kind: &str, duration: &str) -> Instant {
        let request: ProfileRequest = serde_json::from_value(json!({
            "apiVersion": "flamefleet.dev/v1alpha1", "kind": "ProfileRequest",
            "metadata": {"name": name},
            "spec": {"type": kind, "podNames": [self.pod], "duration": duration},
        }))
        .expect("a ProfileRequest");
        let at = Instant::now();
        self.requests()
            .create(&PostParams::default(), &request)
            .await
            .unwrap_or_else(|e| panic!("creating {name}: {e}"));
        at
    }

    /// Waits until request `name` is Running; fails at once, with its status, when it has
    /// already ended (a request that failed in preparation never runs).
    async fn wait_running(&self, name: &str) {
        let api = self.requests();
        let ended = self
            .cluster
            .wait_for(&format!("{name} to run"), TIMEOUT, || {
                let api = api.clone();
                async move {
                    let status = api.get(name).await.ok()?.status?;
                    match status.phase? {
                        RequestPhase::Running => Some(None),
                        p if p.is_terminal() => Some(Some(status)),
                        _ => None,
                    }
                }
            })
            .await
            .unwrap();
        if let Some(status) = ended {
            panic!("{name} ended before it ran: {status:#?}");
        }
    }

    /// Waits (at most `timeout`) until request `name` is terminal; returns it and when that
    /// was seen.
    async fn wait_terminal(&self, name: &str, timeout: Duration) -> (ProfileRequest, Instant) {
        let api = self.requests();
        let r = self
            .cluster
            .wait_for(&format!("{name} to end"), timeout, || {
                let api = api.clone();
                async move {
                    let r = api.get(name).await.ok()?;
                    r.status.as_ref()?.phase?.is_terminal().then_some(r)
                }
            })
            .await
            .unwrap();
        (r, Instant::now())
    }

    /// Downloads every artifact `request` recorded with `kubectl profile get` (which checks
    /// each against its recorded sha256); returns how many are missing or damaged.
    fn artifacts_lost(&self, request: &ProfileRequest) -> usize {
        let status = request.status.clone().unwrap_or_default();
        let succeeded = status.node_counts.map_or(0, |c| c.succeeded);
        if succeeded == 0 {
            return 0;
        }
        let dir = tempfile::tempdir().unwrap();
        let name = request.metadata.name.clone().unwrap_or_default();
        let (code, _, _) = kubectl_profile(
            self.cluster,
            &[
                "get",
                &name,
                "-n",
                &self.ns,
                "-o",
                dir.path().to_str().unwrap(),
            ],
        );
        let files = std::fs::read_dir(dir.path())
            .map(|d| {
                d.filter_map(Result::ok)
                    .filter(|e| e.path().to_string_lossy().ends_with(".pb.gz"))
                    .count()
            })
            .unwrap_or(0);
        if code == 0 {
            usize::try_from(succeeded)
                .unwrap_or(0)
                .saturating_sub(files)
        } else {
            usize::try_from(succeeded).unwrap_or(0)
        }
    }

    /// Requests among `ended` whose terminal status changed since: a result recorded twice.
    async fn rewritten(&self, ended: &[ProfileRequest]) -> usize {
        let mut changed = 0;
        for r in ended {
            let name = r.metadata.name.clone().unwrap_or_default();
            let now = self.requests().get(&name).await.unwrap();
            let key = |r: &ProfileRequest| {
                r.status
                    .as_ref()
                    .map(|s| (s.phase, s.completion_time.clone(), s.reason.clone()))
            };
            if key(&now) != key(r) {
                eprintln!(
                    "{name} changed after it ended: {:?} -> {:?}",
                    r.status, now.status
                );
                changed += 1;
            }
        }
        changed
    }
}

/// `Phase (reason)` of a terminal request, with its failures' messages for the log.
fn ended(r: &ProfileRequest) -> String {
    let status = r.status.clone().unwrap_or_default();
    let phase = status.phase.map_or("?".to_string(), |p| format!("{p:?}"));
    match status.reason {
        Some(reason) => format!("{phase} ({reason})"),
        None => phase,
    }
}

/// The first failed node's reason and message.
fn failure(r: &ProfileRequest) -> (String, String) {
    r.status
        .as_ref()
        .and_then(|s| s.failures.first())
        .map(|f| (f.reason.clone(), f.message.clone()))
        .unwrap_or_default()
}

/// One fault's figures, printed as a `FAULT` line (the format of `faults.rs`).
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

/// Pods of the release labelled `app.kubernetes.io/name=NAME`.
async fn release_pods(client: &kube::Client, name: &str) -> Vec<Pod> {
    Api::<Pod>::namespaced(client.clone(), NAMESPACE)
        .list(&ListParams::default().labels(&format!("app.kubernetes.io/name={name}")))
        .await
        .map(|l| l.items)
        .unwrap_or_default()
}

/// The one agent pod (one node).
async fn agent_pod(client: &kube::Client) -> Pod {
    let mut pods = release_pods(client, "flamefleet-agent").await;
    assert_eq!(pods.len(), 1, "one agent pod on the one node");
    pods.remove(0)
}

/// Restarts of each container of `pod`, by container name.
fn restarts(pod: &Pod) -> BTreeMap<String, i32> {
    pod.status
        .as_ref()
        .and_then(|s| s.container_statuses.as_ref())
        .map(|cs| {
            cs.iter()
                .map(|c| (c.name.clone(), c.restart_count))
                .collect()
        })
        .unwrap_or_default()
}

/// Restarts of every container of the release's agent and operator pods, by pod.
async fn release_restarts(client: &kube::Client) -> BTreeMap<String, BTreeMap<String, i32>> {
    let mut all = BTreeMap::new();
    for name in ["flamefleet-agent", "flamefleet-operator"] {
        for pod in release_pods(client, name).await {
            all.insert(
                pod.metadata.name.clone().unwrap_or_default(),
                restarts(&pod),
            );
        }
    }
    all
}

/// The running container `container`'s ID (without the runtime prefix) in `pod`.
fn container_id(pod: &Pod, container: &str) -> Option<String> {
    pod.status
        .as_ref()?
        .container_statuses
        .as_ref()?
        .iter()
        .find(|c| c.name == container)?
        .container_id
        .as_ref()
        .and_then(|id| id.rsplit("://").next().map(str::to_owned))
}

/// Peak resident set (VmHWM, MiB) of the processes of `pod`'s running containers: the
/// largest of them.
fn peak_rss_mib(pod: &Pod) -> f64 {
    let uid = pod.metadata.uid.clone().unwrap_or_default();
    let containers: Vec<String> = pod
        .status
        .as_ref()
        .and_then(|s| s.container_statuses.as_ref())
        .map(|cs| cs.iter().map(|c| c.name.clone()).collect())
        .unwrap_or_default();
    let mut peak: f64 = 0.0;
    for c in containers {
        let Some(cid) = container_id(pod, &c) else {
            continue;
        };
        let Some(dir) = walkdir_find(Path::new("/sys/fs/cgroup"), &format!("pod{uid}"), &cid)
        else {
            continue;
        };
        for pid in std::fs::read_to_string(dir.join("cgroup.procs"))
            .unwrap_or_default()
            .lines()
        {
            let status =
                std::fs::read_to_string(format!("/proc/{}/status", pid.trim())).unwrap_or_default();
            let hwm = status
                .lines()
                .find_map(|l| l.strip_prefix("VmHWM:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<f64>().ok())
                .map_or(0.0, |kb| kb / 1024.0);
            peak = peak.max(hwm);
        }
    }
    peak
}

/// The largest peak RSS of the agent's and of the operators' processes now, MiB.
async fn release_peak_rss(client: &kube::Client) -> (f64, f64) {
    let agent = release_pods(client, "flamefleet-agent")
        .await
        .iter()
        .map(peak_rss_mib)
        .fold(0.0, f64::max);
    let operator = release_pods(client, "flamefleet-operator")
        .await
        .iter()
        .map(peak_rss_mib)
        .fold(0.0, f64::max);
    (agent, operator)
}

/// A BPF program or map `bpftool` lists: its ID, name, the processes holding it, and (of a
/// program) the maps it uses.
#[derive(Debug, Clone)]
struct BpfObject {
    id: u64,
    name: String,
    pids: Vec<i64>,
    map_ids: Vec<u64>,
}

/// `bpftool prog|map show --json`.
fn bpf_objects(kind: &str) -> Vec<BpfObject> {
    let out = Command::new("bpftool")
        .args([kind, "show", "--json"])
        .output()
        .expect("running bpftool (apt-get install bpftool)");
    assert!(
        out.status.success(),
        "bpftool {kind} show: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let list: Vec<Value> = serde_json::from_slice(&out.stdout).unwrap_or_default();
    list.iter()
        .filter_map(|o| {
            Some(BpfObject {
                id: o["id"].as_u64()?,
                name: o["name"].as_str().unwrap_or_default().to_owned(),
                pids: o["pids"]
                    .as_array()
                    .map(|a| a.iter().filter_map(|p| p["pid"].as_i64()).collect())
                    .unwrap_or_default(),
                map_ids: o["map_ids"]
                    .as_array()
                    .map(|a| a.iter().filter_map(Value::as_u64).collect())
                    .unwrap_or_default(),
            })
        })
        .collect()
}

/// The IDs of every BPF program and map loaded now.
#[derive(Debug, Clone, Default)]
pub struct BpfIds {
    progs: BTreeSet<u64>,
    maps: BTreeSet<u64>,
}

impl BpfIds {
    /// What is loaded now.
    pub fn now() -> Self {
        Self {
            progs: bpf_objects("prog").iter().map(|o| o.id).collect(),
            maps: bpf_objects("map").iter().map(|o| o.id).collect(),
        }
    }
}

/// The BPF programs and maps an agent process holds, beyond `before` (what was loaded
/// before any agent started): programs named as the agent's, or held by one of `pids`, and
/// every map those use or `pids` hold.
fn agent_bpf(before: &BpfIds, pids: &[i64]) -> BpfIds {
    let names = agent_program_names();
    let progs: Vec<BpfObject> = bpf_objects("prog")
        .into_iter()
        .filter(|p| !before.progs.contains(&p.id))
        .filter(|p| names.contains(&p.name) || p.pids.iter().any(|pid| pids.contains(pid)))
        .collect();
    let mut maps: BTreeSet<u64> = progs.iter().flat_map(|p| p.map_ids.clone()).collect();
    maps.extend(
        bpf_objects("map")
            .into_iter()
            .filter(|m| !before.maps.contains(&m.id))
            .filter(|m| m.pids.iter().any(|pid| pids.contains(pid)))
            .map(|m| m.id),
    );
    BpfIds {
        progs: progs.iter().map(|p| p.id).collect(),
        maps,
    }
}

/// The PIDs (host namespace) of the processes in `pod`'s container `container`.
fn container_pids(pod: &Pod, container: &str) -> Vec<i64> {
    let uid = pod.metadata.uid.clone().unwrap_or_default();
    container_cgroup(pod, container)
        .and_then(|dir| std::fs::read_to_string(dir.join("cgroup.procs")).ok())
        .map(|procs| {
            procs
                .lines()
                .filter_map(|l| l.trim().parse().ok())
                .collect()
        })
        .unwrap_or_else(|| panic!("the cgroup of container {container} of pod {uid}"))
}

/// The cgroup directory of `pod`'s running container `container` (the first hierarchy
/// holding its processes).
fn container_cgroup(pod: &Pod, container: &str) -> Option<PathBuf> {
    let uid = pod.metadata.uid.clone()?;
    let cid = container_id(pod, container)?;
    walkdir_find(Path::new("/sys/fs/cgroup"), &format!("pod{uid}"), &cid)
}

/// Waits until the agent's BPF programs are loaded (a capture runs); returns the agent's
/// programs and maps beyond `before`.
async fn agent_capturing(cluster: &Cluster, client: &kube::Client, before: &BpfIds) -> BpfIds {
    let agent = agent_pod(client).await;
    let pids = container_pids(&agent, "agent");
    cluster
        .wait_for("the agent's BPF programs to be loaded", TIMEOUT, || {
            let held = agent_bpf(before, &pids);
            async move { (!held.progs.is_empty()).then_some(held) }
        })
        .await
        .unwrap()
}

/// The agent DaemonSet rolled by `helm upgrade` while captures run: [`AgentRoll::start`]
/// before the upgrade, [`AgentRoll::check`] after it.
pub struct AgentRoll {
    names: Vec<&'static str>,
    created: Instant,
    old_agent: String,
    old_bpf: BpfIds,
    rolled_at: Option<Instant>,
}

/// The captures in flight during the roll: long enough that the upgrade (about 30 s here)
/// happens while they run.
const ROLL_REQUESTS: [(&str, &str, &str); 2] = [
    ("roll-cpu", "cpu", "45s"),
    ("roll-runqlat", "runqlat", "45s"),
];

impl AgentRoll {
    /// Starts the captures and waits until the agent runs them; records the BPF programs
    /// and maps the agent holds beyond `before` (what was loaded before it started).
    pub async fn start(shop: &Shop<'_>, before: &BpfIds) -> Self {
        step("fault: the agent DaemonSet rolled by helm upgrade while captures run");
        let created = Instant::now();
        for (name, kind, duration) in ROLL_REQUESTS {
            shop.create(name, kind, duration).await;
        }
        for (name, ..) in ROLL_REQUESTS {
            shop.wait_running(name).await;
        }
        let old_bpf = agent_capturing(shop.cluster, &shop.client, before).await;
        let old_agent = agent_pod(&shop.client)
            .await
            .metadata
            .name
            .unwrap_or_default();
        eprintln!(
            "agent {old_agent} captures; it holds BPF programs {:?} and maps {:?}",
            old_bpf.progs, old_bpf.maps
        );
        Self {
            names: ROLL_REQUESTS.iter().map(|(n, ..)| *n).collect(),
            created,
            old_agent,
            old_bpf,
            rolled_at: None,
        }
    }

    /// Marks the end of the roll (helm's `--wait` returned).
    pub fn rolled(&mut self) {
        self.rolled_at = Some(Instant::now());
    }

    /// After the roll: a new agent pod; every capture of the old one ended by its deadline,
    /// succeeded or failed with a reason naming the agent; the old agent's BPF programs and
    /// maps are gone; a capture on the new agent works.
    pub async fn check(self, shop: &Shop<'_>) {
        let rolled_at = self.rolled_at.unwrap_or_else(Instant::now);
        let new_agent = agent_pod(&shop.client).await;
        assert_ne!(
            new_agent.metadata.name.as_deref(),
            Some(self.old_agent.as_str()),
            "the upgrade replaced the agent pod"
        );
        let deadline = Duration::from_secs(45) + CAPTURE_GRACE + Duration::from_secs(30);
        let mut phases = BTreeMap::new();
        let mut ended_all = Vec::new();
        let mut last = rolled_at;
        for name in &self.names {
            let left = deadline.saturating_sub(self.created.elapsed());
            let (r, at) = shop.wait_terminal(name, left).await;
            let status = r.status.clone().unwrap_or_default();
            let end = ended(&r);
            eprintln!("{name}: {end} {:?}", status.failures);
            if status.phase != Some(RequestPhase::Succeeded) {
                let (reason, message) = failure(&r);
                assert!(
                    ["AgentInterrupted", "AgentUnreachable", "TimedOut"].contains(&reason.as_str()),
                    "{name}: a capture of the rolled agent fails with a reason naming it: {reason}: {message}"
                );
                assert!(
                    message.contains(&self.old_agent),
                    "{name}: the message names the old agent: {message}"
                );
            }
            *phases.entry(end).or_insert(0) += 1;
            last = last.max(at);
            ended_all.push(r);
        }
        // The old agent's programs and maps went with its process; nothing it held stays.
        let left = shop
            .cluster
            .wait_for(
                "the old agent's BPF programs and maps to go",
                TIMEOUT,
                || {
                    let now = BpfIds::now();
                    let progs: Vec<u64> = self
                        .old_bpf
                        .progs
                        .intersection(&now.progs)
                        .copied()
                        .collect();
                    let maps: Vec<u64> =
                        self.old_bpf.maps.intersection(&now.maps).copied().collect();
                    async move { (progs.is_empty() && maps.is_empty()).then_some(()) }
                },
            )
            .await;
        let now = BpfIds::now();
        assert!(
            left.is_ok(),
            "still loaded after the roll: programs {:?}, maps {:?}",
            self.old_bpf
                .progs
                .intersection(&now.progs)
                .collect::<Vec<_>>(),
            self.old_bpf
                .maps
                .intersection(&now.maps)
                .collect::<Vec<_>>()
        );
        let lost: usize = ended_all.iter().map(|r| shop.artifacts_lost(r)).sum();
        let duplicates = shop.rewritten(&ended_all).await;
        let (agent_rss, operator_rss) = release_peak_rss(&shop.client).await;
        // The new agent captures.
        shop.create("after-roll", "cpu", "3s").await;
        let (after, _) = shop.wait_terminal("after-roll", TIMEOUT).await;
        assert_eq!(
            after.status.as_ref().and_then(|s| s.phase),
            Some(RequestPhase::Succeeded),
            "a capture on the new agent: {:#?}",
            after.status
        );
        assert_eq!(lost, 0, "artifacts recorded but missing");
        assert_eq!(duplicates, 0, "terminal statuses rewritten");
        Figures {
            fault: "agent DaemonSet rolled (helm upgrade to a new tag)",
            in_flight: self.names.len(),
            phases,
            artifacts_lost: lost,
            duplicates,
            recovery_to_last_write: last.saturating_duration_since(rolled_at),
            agent_rss_mib: agent_rss,
            operator_rss_mib: operator_rss,
        }
        .print();
    }
}

/// The agent OOM-killed by its memory limit mid-capture: the node fails naming `OOMKilled`,
/// the container restarts once, and the next capture on the node works.
pub async fn agent_oom_killed_mid_capture(shop: &Shop<'_>) {
    step("fault: the agent OOM-killed by its memory limit mid-capture");
    let started = Instant::now();
    let agent = agent_pod(&shop.client).await;
    let agent_name = agent.metadata.name.clone().unwrap_or_default();
    let before = restarts(&agent).get("agent").copied().unwrap_or(0);
    shop.create("oom", "cpu", "20s").await;
    shop.wait_running("oom").await;
    agent_capturing(shop.cluster, &shop.client, &BpfIds::default()).await;
    let agent_rss = peak_rss_mib(&agent);
    let hog = MemoryHog::start(&agent, "agent");
    let killed = Instant::now();
    let (r, ended_at) = shop
        .wait_terminal(
            "oom",
            Duration::from_secs(20) + CAPTURE_GRACE + Duration::from_secs(30),
        )
        .await;
    drop(hog);
    let (reason, message) = failure(&r);
    eprintln!("oom: {} {reason}: {message}", ended(&r));
    assert_eq!(
        r.status.as_ref().and_then(|s| s.phase),
        Some(RequestPhase::Failed),
        "{:#?}",
        r.status
    );
    assert!(
        message.contains("OOMKilled") && message.contains(&agent_name),
        "the node's message names the agent's OOM kill: {reason}: {message}"
    );
    // Restarted once, by the kubelet, and running again: no crash loop.
    let restarted = shop
        .cluster
        .wait_for("the agent to run again after its OOM kill", TIMEOUT, || {
            let client = shop.client.clone();
            async move {
                let pod = agent_pod(&client).await;
                let running = pod
                    .status
                    .as_ref()
                    .and_then(|s| s.container_statuses.as_ref())
                    .and_then(|cs| cs.iter().find(|c| c.name == "agent"))
                    .is_some_and(|c| {
                        c.ready && c.state.as_ref().is_some_and(|s| s.running.is_some())
                    });
                running.then_some(pod)
            }
        })
        .await
        .unwrap();
    let last_state = restarted
        .status
        .as_ref()
        .and_then(|s| s.container_statuses.as_ref())
        .and_then(|cs| cs.iter().find(|c| c.name == "agent"))
        .and_then(|c| c.last_state.clone())
        .and_then(|s| s.terminated)
        .and_then(|t| t.reason);
    assert_eq!(last_state.as_deref(), Some("OOMKilled"));
    assert_eq!(
        restarts(&restarted).get("agent").copied(),
        Some(before + 1),
        "restarted exactly once"
    );
    shop.create("after-oom", "cpu", "3s").await;
    let (after, _) = shop.wait_terminal("after-oom", TIMEOUT).await;
    assert_eq!(
        after.status.as_ref().and_then(|s| s.phase),
        Some(RequestPhase::Succeeded),
        "the next capture on the node: {:#?}",
        after.status
    );
    let duplicates = shop.rewritten(std::slice::from_ref(&r)).await;
    assert_eq!(duplicates, 0);
    let (_, operator_rss) = release_peak_rss(&shop.client).await;
    Figures {
        fault: "agent OOM-killed by its memory limit mid-capture",
        in_flight: 1,
        phases: BTreeMap::from([(format!("{} ", ended(&r)).trim().to_string(), 1)]),
        artifacts_lost: 0,
        duplicates,
        recovery_to_last_write: ended_at.saturating_duration_since(killed),
        agent_rss_mib: agent_rss,
        operator_rss_mib: operator_rss,
    }
    .print();
    eprintln!(
        "agent OOM fault: {:.0} s in all",
        started.elapsed().as_secs_f64()
    );
}

/// A process charged to `pod`'s container's memory cgroup that reads more than the
/// container's memory limit into memory (`head -c LIMIT+64MiB /dev/zero | tail`), with the
/// agent made the OOM killer's first choice: the container reaches its limit and the kernel
/// kills the agent, as when the agent itself outgrows it. (The agent has no allocation a
/// test can drive to a given size without a debug switch in it; and on cgroup v1, this
/// VM's, lowering the limit below the usage is refused with EBUSY rather than OOM-killing.)
/// Bounded: the reader stops at that size, and is killed on drop.
struct MemoryHog {
    child: std::process::Child,
}

impl MemoryHog {
    fn start(pod: &Pod, container: &str) -> Self {
        let dir = memory_cgroup(pod, container).expect("the agent container's memory cgroup");
        let limit_file = ["memory.max", "memory.limit_in_bytes"]
            .iter()
            .map(|f| dir.join(f))
            .find(|f| f.exists())
            .unwrap();
        let limit: u64 = std::fs::read_to_string(&limit_file)
            .unwrap()
            .trim()
            .parse()
            .unwrap_or_else(|e| panic!("{}: a number: {e}", limit_file.display()));
        // Its processes' oom_score_adj at the highest: the kernel then kills the agent first
        // (as the Burstable agent's ~997 nearly ensures already; the reader keeps 0).
        for pid in container_pids(pod, container) {
            let _ = std::fs::write(format!("/proc/{pid}/oom_score_adj"), "1000");
        }
        let procs = dir.join("cgroup.procs");
        let child = Command::new("sh")
            .arg("-c")
            .arg(format!(
                "echo $$ > '{}' && head -c {} /dev/zero | tail > /dev/null",
                procs.display(),
                limit + (64 << 20)
            ))
            .stdin(std::process::Stdio::null())
            .spawn()
            .expect("running sh");
        eprintln!(
            "{}: {limit} bytes; reading {} MiB into the container's memory",
            limit_file.display(),
            (limit >> 20) + 64
        );
        Self { child }
    }
}

impl Drop for MemoryHog {
    fn drop(&mut self) {
        // Killed by the OOM killer in turn once the agent is gone, or done: reap it.
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The memory cgroup of `pod`'s container: cgroup v2's unified directory, or v1's memory
/// hierarchy.
fn memory_cgroup(pod: &Pod, container: &str) -> Option<PathBuf> {
    let uid = pod.metadata.uid.clone()?;
    let cid = container_id(pod, container)?;
    for root in ["/sys/fs/cgroup/memory", "/sys/fs/cgroup"] {
        if let Some(dir) = walkdir_find(Path::new(root), &format!("pod{uid}"), &cid)
            && (dir.join("memory.max").exists() || dir.join("memory.limit_in_bytes").exists())
        {
            return Some(dir);
        }
    }
    None
}

/// The node's Ready condition status (`True`, `False`, `Unknown`).
async fn node_ready(client: &kube::Client, node: &str) -> Option<String> {
    let n = Api::<Node>::all(client.clone()).get(node).await.ok()?;
    n.status?
        .conditions?
        .into_iter()
        .find(|c| c.type_ == "Ready")
        .map(|c| c.status)
}

/// The kubelet stopped until the node controller marks the node NotReady, then started:
/// a capture in flight, and one requested while the node is NotReady, end by their
/// deadlines (succeeded, or failed with a reason); the agent's and operator's containers
/// do not restart.
pub async fn kubelet_restarted(shop: &Shop<'_>) {
    step("fault: the kubelet stopped until the node is NotReady, then started");
    let started = Instant::now();
    let node = shop.cluster.node.clone();
    let before = release_restarts(&shop.client).await;
    shop.create("kubelet-in-flight", "cpu", "20s").await;
    shop.wait_running("kubelet-in-flight").await;
    let stopped = shop.cluster.stop_kubelet().expect("stopping the kubelet");
    let stop_at = Instant::now();
    // The node controller marks it after its grace period without a heartbeat (40-50 s).
    let not_ready = shop
        .cluster
        .wait_for(
            "the node to be marked NotReady",
            Duration::from_secs(120),
            || {
                let client = shop.client.clone();
                let node = node.clone();
                async move { node_ready(&client, &node).await.filter(|s| s != "True") }
            },
        )
        .await
        .unwrap();
    eprintln!(
        "node {node} Ready={not_ready} {:.1} s after the kubelet stopped",
        stop_at.elapsed().as_secs_f64()
    );
    shop.create("kubelet-not-ready", "cpu", "5s").await;
    // While NotReady: what the request does before the kubelet is back.
    let during = shop
        .cluster
        .wait_for(
            "kubelet-not-ready to be handled",
            Duration::from_secs(30),
            || {
                let api = shop.requests();
                async move {
                    let r = api.get("kubelet-not-ready").await.ok()?;
                    r.status?.phase
                }
            },
        )
        .await;
    eprintln!("kubelet-not-ready while the node is NotReady: {during:?}");
    stopped.start().expect("starting the kubelet");
    shop.cluster
        .wait_for(
            "the node to be Ready again",
            Duration::from_secs(120),
            || {
                let client = shop.client.clone();
                let node = node.clone();
                async move { (node_ready(&client, &node).await? == "True").then_some(()) }
            },
        )
        .await
        .unwrap();
    let ready_at = Instant::now();
    eprintln!(
        "node Ready again {:.1} s after the kubelet stopped",
        ready_at.duration_since(stop_at).as_secs_f64()
    );
    let mut phases = BTreeMap::new();
    let mut ended_all = Vec::new();
    let mut last = ready_at;
    for (name, duration) in [("kubelet-in-flight", 20), ("kubelet-not-ready", 5)] {
        let (r, at) = shop
            .wait_terminal(
                name,
                Duration::from_secs(duration) + CAPTURE_GRACE + Duration::from_secs(30),
            )
            .await;
        let (reason, message) = failure(&r);
        eprintln!("{name}: {} {reason} {message}", ended(&r));
        if r.status.as_ref().and_then(|s| s.phase) != Some(RequestPhase::Succeeded) {
            assert!(
                !reason.is_empty() && !message.is_empty(),
                "{name} fails with a reason: {:#?}",
                r.status
            );
        }
        *phases.entry(ended(&r)).or_insert(0) += 1;
        last = last.max(at);
        ended_all.push(r);
    }
    let lost: usize = ended_all.iter().map(|r| shop.artifacts_lost(r)).sum();
    let duplicates = shop.rewritten(&ended_all).await;
    // No crash loop: no container of the agent or the operators restarted.
    let after = release_restarts(&shop.client).await;
    assert_eq!(
        before, after,
        "restarts of the agent's and operators' containers"
    );
    let (agent_rss, operator_rss) = release_peak_rss(&shop.client).await;
    assert_eq!(lost, 0);
    assert_eq!(duplicates, 0);
    Figures {
        fault: "kubelet stopped until the node was NotReady, then started",
        in_flight: 2,
        phases,
        artifacts_lost: lost,
        duplicates,
        recovery_to_last_write: last.saturating_duration_since(ready_at),
        agent_rss_mib: agent_rss,
        operator_rss_mib: operator_rss,
    }
    .print();
    eprintln!(
        "kubelet fault: {:.0} s in all",
        started.elapsed().as_secs_f64()
    );
}
