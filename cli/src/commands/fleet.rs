//! Fleet views of a sampling policy: `kubectl profile get sp/NAME --since 24h` merges the
//! profiles of every run of the policy in the window into one pprof per profile type, and
//! `kubectl profile list sp/NAME` lists the runs. `csp/NAME` does the same for a
//! ClusterSamplingPolicy, whose runs live in several namespaces.
//!
//! Runs are the requests the operator would count as the policy's runs
//! ([`RunIdentity`]): the `flamefleet.dev/policy-uid` label only narrows the listing, since
//! any tenant with `edit` in a namespace can copy it onto requests of its own. Requests that
//! carry the label but are not runs are left out, and the count of them is printed. Runs are
//! placed in the window by their `flamefleet.dev/scheduled-time` label; the runs a policy's
//! triggers created ([`RunIdentity::why_not_triggered`]) by their fire's time
//! (`status.trigger.firedAt`, which only the operator writes). Every merged sample
//! keeps its labels (namespace, pod, container, node, ...) and gains `run`, so the merged
//! profile can still be split (`go tool pprof -tagfocus=node=...`).

use std::collections::{BTreeMap, BTreeSet};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Duration;

use flamefleet_api::continuous::ContinuousStatus;
use flamefleet_api::policy_runs::{self, POLICY_UID_LABEL, PolicyKind, RunIdentity};
use flamefleet_api::{ClusterSamplingPolicy, ProfileRequest, RequestPhase, SamplingPolicy};
use k8s_openapi::api::core::v1::Namespace;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;
use kube::api::{Api, ListParams};
use kube::core::Selector;

use crate::cluster::Cluster;
use crate::download::{FromRequest, fetch_all};
use crate::error::{Error, Result};
use crate::latency_svg::{self, HeatColumn};
use crate::output::{self, OutputFile};
use crate::{latency, merge, profile_file, stacks};

use super::get::{Format, render};
use super::list::age;

/// A policy named on the command line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PolicyRef {
    /// `sp/NAME`: a SamplingPolicy of the current namespace.
    Namespaced(String),
    /// `csp/NAME`: a ClusterSamplingPolicy.
    Cluster(String),
}

impl PolicyRef {
    /// Parses `sp/NAME`, `samplingpolicy/NAME`, `csp/NAME` or `clustersamplingpolicy/NAME`;
    /// `None` for anything else (a plain request name).
    pub fn parse(text: &str) -> Option<Self> {
        let (kind, name) = text.split_once('/')?;
        let name = name.to_owned();
        match kind.to_ascii_lowercase().as_str() {
            "sp" | "samplingpolicy" | "samplingpolicies" => Some(Self::Namespaced(name)),
            "csp" | "clustersamplingpolicy" | "clustersamplingpolicies" => {
                Some(Self::Cluster(name))
            }
            _ => None,
        }
    }

    fn shown(&self) -> String {
        match self {
            Self::Namespaced(n) => format!("sp/{n}"),
            Self::Cluster(n) => format!("csp/{n}"),
        }
    }

    fn name(&self) -> &str {
        match self {
            Self::Namespaced(n) | Self::Cluster(n) => n,
        }
    }
}

fn kube_err(action: String) -> impl FnOnce(kube::Error) -> Error {
    move |source| match &source {
        kube::Error::Api(s) if s.code == 403 => Error::Forbidden {
            message: s.message.clone(),
            verb: "list".into(),
            resource: "profilerequests".into(),
            namespace: String::new(),
        },
        _ => Error::Kube { action, source },
    }
}

/// A policy's runs, and how many requests claimed to be runs without being ones.
#[derive(Debug, Default)]
pub struct Runs {
    /// The runs, newest first.
    pub runs: Vec<ProfileRequest>,
    /// Requests carrying the policy's UID label that are not its runs.
    pub ignored: usize,
    /// The policy is always-on (`schedule: "@continuous"`): what its status says of the
    /// windows (its profiles are at the OpenTelemetry endpoint, not in runs).
    pub always_on: Option<ContinuousStatus>,
}

/// What `list` prints of an always-on policy (pure).
pub fn always_on_summary(policy: &str, s: &ContinuousStatus) -> String {
    let mut out = format!(
        "{policy} is always-on (schedule @continuous): each pod is profiled in windows of {}s every {}s and each window is exported to the cluster's OpenTelemetry endpoint (docs/export.md); there are no runs to download.\n",
        s.window_seconds, s.period_seconds
    );
    out.push_str(&format!(
        "  pods {} on {} nodes; windows {}, exported {}, dropped {}, queued {}\n",
        s.pods,
        s.nodes,
        s.windows,
        s.exported,
        s.dropped,
        s.queued.unwrap_or(0)
    ));
    if let Some(c) = s.min_coverage_percent {
        out.push_str(&format!("  lowest coverage of a pod: {c}%\n"));
    }
    for l in &s.low_coverage {
        out.push_str(&format!("  low coverage: {l}\n"));
    }
    if !s.last_export_error.is_empty() {
        out.push_str(&format!("  last export error: {}\n", s.last_export_error));
    }
    for l in &s.refused {
        out.push_str(&format!("  not profiled: {l}\n"));
    }
    out
}

impl Runs {
    /// A line about the ignored requests (empty when there are none).
    fn ignored_note(&self) -> String {
        if self.ignored == 0 {
            return String::new();
        }
        format!(
            "ignored {} ProfileRequests that carry the policy's UID label but are not its runs (not created by the policy: owner, name, namespace or time do not match)\n",
            self.ignored
        )
    }
}

/// The namespaces a ClusterSamplingPolicy's `namespaceSelector` selects now (`None`:
/// every namespace).
async fn sampled_namespaces(
    cluster: &Cluster,
    policy: &str,
    selector: Option<&LabelSelector>,
) -> Result<Option<BTreeSet<String>>> {
    let Some(selector) = selector else {
        return Ok(None);
    };
    // A selector the API cannot evaluate selects nothing: the operator never runs it.
    let Ok(selector) = Selector::try_from(selector.clone()) else {
        return Ok(Some(BTreeSet::new()));
    };
    let api: Api<Namespace> = Api::all(cluster.client.clone());
    let list = api
        .list_metadata(&ListParams::default().labels_from(&selector))
        .await
        .map_err(|source| Error::Kube {
            action: format!(
                "listing the namespaces csp/{policy} samples (a cluster policy's fleet view needs `list` on namespaces)"
            ),
            source,
        })?;
    Ok(Some(
        list.items
            .into_iter()
            .filter_map(|n| n.metadata.name)
            .collect(),
    ))
}

/// The policy's runs (newest first), recognised as the operator recognises them.
///
/// # Errors
/// [`Error::PolicyNotFound`] when the policy does not exist; API errors.
pub async fn runs(cluster: &Cluster, policy: &PolicyRef) -> Result<Runs> {
    let not_found = || Error::PolicyNotFound {
        policy: policy.shown(),
        namespace: cluster.namespace.clone(),
    };
    let mut always_on = None;
    let mut note = |spec: &flamefleet_api::SamplingPolicySpec,
                    status: Option<&flamefleet_api::SamplingPolicyStatus>| {
        if spec
            .schedule
            .as_deref()
            .is_some_and(flamefleet_api::continuous::is_continuous)
        {
            always_on = Some(
                status
                    .and_then(|s| s.continuous.clone())
                    .unwrap_or_default(),
            );
        }
    };
    let identity = match policy {
        PolicyRef::Namespaced(name) => {
            let api: Api<SamplingPolicy> =
                Api::namespaced(cluster.client.clone(), &cluster.namespace);
            let p = api
                .get_opt(name)
                .await
                .map_err(kube_err(format!("getting samplingpolicy {name}")))?
                .ok_or_else(not_found)?;
            let uid = p.metadata.uid.clone().ok_or_else(not_found)?;
            note(&p.spec, p.status.as_ref());
            RunIdentity::of_policy(
                PolicyKind::Namespaced,
                name,
                &uid,
                &p.spec,
                p.status.as_ref(),
                Some(BTreeSet::from([cluster.namespace.clone()])),
            )
        }
        PolicyRef::Cluster(name) => {
            let api: Api<ClusterSamplingPolicy> = Api::all(cluster.client.clone());
            let p = api
                .get_opt(name)
                .await
                .map_err(kube_err(format!("getting clustersamplingpolicy {name}")))?
                .ok_or_else(not_found)?;
            let uid = p.metadata.uid.clone().ok_or_else(not_found)?;
            note(&p.spec.policy, p.status.as_ref());
            let namespaces =
                sampled_namespaces(cluster, name, p.spec.namespace_selector.as_ref()).await?;
            RunIdentity::of_policy(
                PolicyKind::Cluster,
                name,
                &uid,
                &p.spec.policy,
                p.status.as_ref(),
                namespaces,
            )
        }
    };
    let api: Api<ProfileRequest> = match policy {
        PolicyRef::Namespaced(_) => Api::namespaced(cluster.client.clone(), &cluster.namespace),
        PolicyRef::Cluster(_) => Api::all(cluster.client.clone()),
    };
    let labelled = api
        .list(&ListParams::default().labels(&format!("{POLICY_UID_LABEL}={}", identity.uid)))
        .await
        .map_err(kube_err(format!("listing the runs of {}", policy.shown())))?
        .items;
    let (mut runs, ignored) = identity.partition_all(labelled);
    runs.sort_by_key(|r| std::cmp::Reverse(scheduled_second(r)));
    Ok(Runs {
        runs,
        ignored: ignored.len(),
        always_on,
    })
}

/// A run's scheduled time, or a triggered run's fire time, in Unix seconds (0: neither).
pub fn scheduled_second(run: &ProfileRequest) -> i64 {
    policy_runs::run_second(run).unwrap_or(0)
}

/// The runs scheduled (or triggered) within `since` of `now` (pure).
pub fn in_window(runs: &[ProfileRequest], since: Duration, now: i64) -> Vec<&ProfileRequest> {
    let from = now.saturating_sub(i64::try_from(since.as_secs()).unwrap_or(i64::MAX));
    runs.iter()
        .filter(|r| (from..=now).contains(&scheduled_second(r)))
        .collect()
}

fn is_pprof(name: &str) -> bool {
    name.ends_with(".pb.gz") || name.ends_with(".pb")
}

/// The profile type of an artifact name (`cpu-node1.pb.gz` → `cpu`).
fn artifact_type(name: &str) -> &str {
    name.split('-').next().unwrap_or(name)
}

fn namespace_of(r: &ProfileRequest) -> String {
    r.metadata.namespace.clone().unwrap_or_default()
}

/// The samples of a finished run (its summary's total over nodes); none before it finished.
fn samples(r: &ProfileRequest) -> Option<i64> {
    r.status
        .as_ref()
        .and_then(|s| s.summary.as_ref())
        .and_then(|s| s.samples)
}

/// Downloads the profiles of every finished run of `policy` scheduled within `since`, merges
/// them into one pprof per profile type (`<policy>-<type>.pb.gz` in `dir`), renders them per
/// `format`, and says what went in.
///
/// # Errors
/// [`Error::PolicyNotFound`], [`Error::NoRuns`] when no finished run is in the window, and
/// the download and merge errors of `get`.
pub async fn get(
    cluster: &Cluster,
    policy: &PolicyRef,
    since: Duration,
    dir: &Path,
    format: Format,
    force: bool,
    out: &mut dyn Write,
) -> Result<Vec<PathBuf>> {
    let found = runs(cluster, policy).await?;
    let _ = write!(out, "{}", found.ignored_note());
    if let Some(s) = &found.always_on {
        let _ = write!(out, "{}", always_on_summary(&policy.shown(), s));
    }
    let all = found.runs;
    let now = k8s_openapi::jiff::Timestamp::now().as_second();
    let window = in_window(&all, since, now);
    let finished: Vec<&ProfileRequest> = window
        .iter()
        .copied()
        .filter(|r| {
            matches!(
                r.status.as_ref().and_then(|s| s.phase),
                Some(RequestPhase::Succeeded | RequestPhase::PartiallySucceeded)
            )
        })
        .collect();
    let unfinished = window.len() - finished.len();
    if finished.is_empty() {
        return Err(Error::NoRuns {
            policy: policy.shown(),
            since: humantime::format_duration(since).to_string(),
            runs: all.len(),
            unfinished,
        });
    }
    // One ProfileDownload (batch) per namespace: authorization is per namespace.
    let mut by_namespace: BTreeMap<String, Vec<&ProfileRequest>> = BTreeMap::new();
    for r in &finished {
        by_namespace.entry(namespace_of(r)).or_default().push(r);
    }
    let _ = writeln!(
        out,
        "{}: {} finished runs in the last {} ({} not finished), from {} namespaces; downloading ...",
        policy.shown(),
        finished.len(),
        humantime::format_duration(since),
        unfinished,
        by_namespace.len()
    );
    let mut by_type: BTreeMap<String, Vec<merge::Input>> = BTreeMap::new();
    let mut artifacts = 0;
    for (namespace, requests) in &by_namespace {
        let scoped = Cluster {
            namespace: namespace.clone(),
            ..cluster.clone()
        };
        let mut results = Vec::with_capacity(requests.len());
        for r in requests {
            results.push(crate::requests::results(&scoped, r).await?);
        }
        let names: Vec<String> = requests
            .iter()
            .map(|r| r.metadata.name.clone().unwrap_or_default())
            .collect();
        let from: Vec<FromRequest<'_>> = names
            .iter()
            .zip(&results)
            .map(|(name, results)| FromRequest {
                name,
                results,
                nodes: None,
            })
            .collect();
        for (run, d) in fetch_all(&scoped, &from, |a| is_pprof(&a.name)).await? {
            let source = format!("{namespace}/{run}/{}", d.name);
            let profile = profile_file::decode(&d.bytes, &source)?;
            by_type
                .entry(artifact_type(&d.name).to_owned())
                .or_default()
                .push(merge::Input {
                    source,
                    profile,
                    labels: vec![flamefleet_pprof::Label::Str("run".into(), run)],
                });
            artifacts += 1;
        }
    }
    let scheduled: BTreeMap<String, i64> = finished
        .iter()
        .map(|r| {
            (
                r.metadata.name.clone().unwrap_or_default(),
                scheduled_second(r),
            )
        })
        .collect();
    let mut files = Vec::new();
    let mut text = String::new();
    for (ty, profiles) in by_type {
        let count = profiles.len();
        let merged = merge::merge(profiles)?;
        let _ = writeln!(
            out,
            "{ty}: merged {count} profiles ({})",
            stacks::total_text(&merged)
        );
        let name = format!("{}-{ty}.pb.gz", policy.name());
        let bytes = profile_file::encode_gzip(&merged)?;
        files.extend(render(&name, &bytes, format, &mut text)?);
        if format == Format::Svg {
            files.extend(latency_over_time(policy, &merged, &scheduled)?);
        }
    }
    let written = output::write_all(dir, &files, force, out)?;
    let _ = write!(out, "{text}");
    let _ = writeln!(
        out,
        "{artifacts} artifacts of {} runs; split the result with go tool pprof -tagfocus=run=NAME (or namespace, pod, node)",
        finished.len()
    );
    Ok(written)
}

/// The heat map of a runqlat policy's runs, `<policy>-runqlat-heatmap.svg`: a column per
/// run at its scheduled time (from `scheduled`, by run name), its waits by latency bucket.
/// Nothing for other profiles.
fn latency_over_time(
    policy: &PolicyRef,
    merged: &flamefleet_proto::pprof::Profile,
    scheduled: &BTreeMap<String, i64>,
) -> Result<Vec<OutputFile>> {
    let by_run = latency::histograms_by(merged, "run");
    if by_run.is_empty() {
        return Ok(Vec::new());
    }
    let columns: Vec<HeatColumn> = by_run
        .into_iter()
        .map(|(run, histogram)| HeatColumn {
            time: scheduled.get(&run).copied().unwrap_or(0),
            run,
            histogram,
        })
        .collect();
    let svg = latency_svg::heat_map(
        &columns,
        &format!("{}: run-queue latency over time", policy.shown()),
    )?;
    Ok(vec![OutputFile {
        name: format!("{}-runqlat-heatmap.svg", policy.name()),
        bytes: svg,
    }])
}

/// Prints the runs of `policy`, newest first.
///
/// # Errors
/// [`Error::PolicyNotFound`] and API errors.
pub async fn list(cluster: &Cluster, policy: &PolicyRef, out: &mut dyn Write) -> Result<()> {
    let found = runs(cluster, policy).await?;
    let _ = write!(out, "{}", found.ignored_note());
    if let Some(s) = &found.always_on {
        let _ = write!(out, "{}", always_on_summary(&policy.shown(), s));
        if found.runs.is_empty() {
            return Ok(());
        }
    }
    if found.runs.is_empty() {
        let _ = writeln!(out, "No runs of {} yet.", policy.shown());
        return Ok(());
    }
    let now = k8s_openapi::jiff::Timestamp::now().as_second();
    let _ = write!(out, "{}", runs_table(&found.runs, now));
    Ok(())
}

/// The table of runs (pure).
pub fn runs_table(runs: &[ProfileRequest], now: i64) -> String {
    let trigger = |r: &ProfileRequest| {
        r.status
            .as_ref()
            .and_then(|s| s.trigger.as_ref())
            .map(|t| t.reason.clone())
    };
    let triggered = runs.iter().any(|r| trigger(r).is_some());
    let mut rows = vec![vec![
        "NAME".to_string(),
        "NAMESPACE".into(),
        "SCHEDULED".into(),
        "PHASE".into(),
        "PODS".into(),
        "NODES".into(),
        "SAMPLES".into(),
    ]];
    if triggered {
        // A triggered run's time is its fire's; the column says what fired.
        rows[0].push("TRIGGER".into());
    }
    for r in runs {
        let status = r.status.as_ref();
        let scheduled = scheduled_second(r);
        let mut row = vec![
            r.metadata.name.clone().unwrap_or_default(),
            namespace_of(r),
            if scheduled == 0 {
                "-".into()
            } else {
                format!("{} ago", age(now - scheduled))
            },
            status
                .and_then(|s| s.phase)
                .map_or("Pending", |p| p.as_str())
                .to_string(),
            status
                .and_then(|s| s.pod_count)
                .map_or("-".into(), |n| n.to_string()),
            status
                .and_then(|s| s.node_count)
                .map_or("-".into(), |n| n.to_string()),
            samples(r).map_or("-".into(), |n| n.to_string()),
        ];
        if triggered {
            row.push(trigger(r).unwrap_or_else(|| "-".into()));
        }
        rows.push(row);
    }
    let widths: Vec<usize> = (0..rows[0].len())
        .map(|c| rows.iter().map(|r| r[c].len()).max().unwrap_or(0))
        .collect();
    let mut out = String::new();
    for r in rows {
        let line: Vec<String> = r
            .iter()
            .zip(&widths)
            .map(|(cell, w)| format!("{cell:<w$}"))
            .collect();
        out.push_str(line.join("   ").trim_end());
        out.push('\n');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use flamefleet_api::policy_runs::SCHEDULED_TIME_LABEL;
    use serde_json::json;

    fn run(name: &str, scheduled: i64, phase: &str, samples: i64) -> ProfileRequest {
        serde_json::from_value(json!({
            "apiVersion": "flamefleet.dev/v1alpha1", "kind": "ProfileRequest",
            "metadata": {"name": name, "namespace": "shop",
                         "labels": {SCHEDULED_TIME_LABEL: scheduled.to_string()}},
            "spec": {"type": "cpu", "podNames": ["p"], "duration": "1s"},
            "status": {"phase": phase, "podCount": 1, "nodeCount": 1,
                       "summary": {"samples": samples, "artifacts": 1}},
        }))
        .unwrap()
    }

    #[test]
    fn an_always_on_policy_says_where_its_profiles_are() {
        let s = ContinuousStatus {
            pods: 10,
            nodes: 1,
            window_seconds: 19,
            period_seconds: 20,
            windows: 300,
            exported: 290,
            dropped: 10,
            queued: Some(0),
            min_coverage_percent: Some(97),
            last_export_error: "retries_exhausted: Unavailable".into(),
            low_coverage: vec!["shop/web-3: 90%".into()],
            ..ContinuousStatus::default()
        };
        let text = always_on_summary("sp/always", &s);
        assert!(text.starts_with("sp/always is always-on"), "{text}");
        assert!(text.contains("windows of 19s every 20s"), "{text}");
        assert!(
            text.contains("pods 10 on 1 nodes; windows 300, exported 290, dropped 10, queued 0"),
            "{text}"
        );
        assert!(text.contains("lowest coverage of a pod: 97%"), "{text}");
        assert!(text.contains("low coverage: shop/web-3: 90%"), "{text}");
        assert!(
            text.contains("last export error: retries_exhausted: Unavailable"),
            "{text}"
        );
    }

    #[test]
    fn policy_references() {
        assert_eq!(
            PolicyRef::parse("sp/web"),
            Some(PolicyRef::Namespaced("web".into()))
        );
        assert_eq!(
            PolicyRef::parse("ClusterSamplingPolicy/fleet"),
            Some(PolicyRef::Cluster("fleet".into()))
        );
        assert_eq!(PolicyRef::parse("checkout-cpu"), None);
        assert_eq!(PolicyRef::parse("deploy/x"), None);
    }

    #[test]
    fn the_window_is_by_scheduled_time() {
        let runs = [
            run("a", 1_000, "Succeeded", 1),
            run("b", 5_000, "Succeeded", 2),
            run("c", 9_000, "Running", 3),
        ];
        let names = |w: Vec<&ProfileRequest>| -> Vec<String> {
            w.iter().map(|r| r.metadata.name.clone().unwrap()).collect()
        };
        assert_eq!(
            names(in_window(&runs, Duration::from_secs(5_000), 10_000)),
            ["b", "c"]
        );
        assert_eq!(
            names(in_window(&runs, Duration::from_secs(100), 10_000)),
            Vec::<String>::new()
        );
        let table = runs_table(&runs, 10_000);
        assert!(table.starts_with("NAME"), "{table}");
        assert!(
            table.contains("b      shop        83m ago") || table.contains("83m ago"),
            "{table}"
        );
        assert!(table.lines().nth(3).unwrap().ends_with('3'), "{table}");
        let mut running = run("d", 9_500, "Running", 0);
        if let Some(s) = running.status.as_mut() {
            s.summary = None;
        }
        let table = runs_table(&[running], 10_000);
        assert!(table.lines().nth(1).unwrap().ends_with('-'), "{table}");
        // A triggered run: placed by its fire, its reason in a TRIGGER column.
        let mut fired = run("t", 0, "Succeeded", 4);
        fired.metadata.labels = None;
        if let Some(s) = fired.status.as_mut() {
            s.trigger = Some(
                serde_json::from_value(json!({
                    "name": "near-limit", "condition": "memory above 60% of limit",
                    "measured": "61.0", "threshold": "60.0", "pod": "p", "node": "n",
                    "firedAt": "1970-01-01T02:45:00Z",
                    "reason": "near-limit: memory above 60% of limit (measured 61.0%, threshold 60.0%)",
                }))
                .unwrap(),
            );
        }
        let all = [runs[0].clone(), fired];
        let names = |w: Vec<&ProfileRequest>| -> Vec<String> {
            w.iter().map(|r| r.metadata.name.clone().unwrap()).collect()
        };
        assert_eq!(
            names(in_window(&all, Duration::from_secs(1_000), 10_000)),
            ["t"]
        );
        let table = runs_table(&all, 10_000);
        assert!(
            table.lines().next().unwrap().ends_with("TRIGGER"),
            "{table}"
        );
        assert!(
            table.contains("100s ago") && table.contains("near-limit: memory above 60%"),
            "{table}"
        );
    }

    #[test]
    fn artifact_types_come_from_the_name() {
        assert_eq!(artifact_type("cpu-node-1.pb.gz"), "cpu");
        assert_eq!(artifact_type("runqlat-n.pb.gz"), "runqlat");
    }
}
