//! `kubectl profile cpu|heap|runqlat|offcpu TARGET`: create a ProfileRequest, follow it, download.

use std::collections::BTreeMap;
use std::io::{IsTerminal, Write};
use std::time::{Duration, Instant};

use flamefleet_api::profile_request::OffcpuOptions;
use flamefleet_api::{
    CpuOptions, HeapOptions, HeapSource, ProfileRequest, ProfileRequestSpec, ProfileType,
    RequestPhase, RunqlatOptions, RunqlatUnit, duration::parse_capture_duration,
};
use k8s_openapi::api::apps::v1::{Deployment, StatefulSet};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, LabelSelectorRequirement};
use kube::api::{Api, ObjectMeta};

use crate::cluster::Cluster;
use crate::error::{Error, Result};
use crate::{flags, requests};

/// The request condition that says it waits for a concurrency limit (written by the
/// operator while the request stays Pending).
pub const CONDITION_QUEUED: &str = "Queued";

/// Time allowed after the capture duration for upload and status write-back.
pub const GRACE: Duration = Duration::from_secs(90);

/// What to profile, as given on the command line.
#[derive(Debug, Clone, PartialEq)]
pub enum Target {
    /// One pod by name.
    Pod(String),
    /// The pods of a Deployment.
    Deployment(String),
    /// The pods of a StatefulSet.
    StatefulSet(String),
    /// A label selector (`-l`).
    Selector(LabelSelector),
}

/// Parses `-l` syntax: `k=v`, `k==v`, `k!=v`, `k`, `!k`, comma separated.
pub fn parse_selector(text: &str) -> Result<LabelSelector> {
    let mut labels = BTreeMap::new();
    let mut exprs = Vec::new();
    for term in text.split(',').map(str::trim).filter(|t| !t.is_empty()) {
        let req = |key: &str, op: &str, values: Option<Vec<String>>| LabelSelectorRequirement {
            key: key.to_string(),
            operator: op.to_string(),
            values,
        };
        let unsupported = || {
            Error::Usage(format!(
                "unsupported selector term {term:?}; use k=v, k!=v, k or !k separated by commas"
            ))
        };
        let key = |k: &str| -> Result<String> {
            let k = k.trim();
            flags::check_label_key(k).map_err(|e| Error::Usage(format!("-l {text:?}: {e}")))?;
            Ok(k.to_owned())
        };
        let value = |v: &str| -> Result<String> {
            let v = v.trim();
            flags::check_label_value(v).map_err(|e| Error::Usage(format!("-l {text:?}: {e}")))?;
            Ok(v.to_owned())
        };
        if term.contains(' ') || term.contains('(') {
            return Err(unsupported());
        } else if let Some((k, v)) = term.split_once("!=") {
            exprs.push(req(&key(k)?, "NotIn", Some(vec![value(v)?])));
        } else if let Some((k, v)) = term.split_once("==").or_else(|| term.split_once('=')) {
            labels.insert(key(k)?, value(v)?);
        } else if let Some(k) = term.strip_prefix('!') {
            exprs.push(req(&key(k)?, "DoesNotExist", None));
        } else {
            exprs.push(req(&key(term)?, "Exists", None));
        }
    }
    if labels.is_empty() && exprs.is_empty() {
        return Err(Error::Usage(format!("empty label selector {text:?}")));
    }
    Ok(LabelSelector {
        match_labels: (!labels.is_empty()).then_some(labels),
        match_expressions: (!exprs.is_empty()).then_some(exprs),
    })
}

/// Parses the positional target: `POD`, `pod/NAME`, `deploy/NAME`, `sts/NAME`.
pub fn parse_target(target: Option<&str>, selector: Option<&str>) -> Result<Target> {
    match (target, selector) {
        (Some(_), Some(_)) => Err(Error::Usage(
            "give either a target (POD, deploy/NAME, sts/NAME) or -l SELECTOR, not both".into(),
        )),
        (None, None) => Err(Error::Usage(
            "what to profile? give POD, deploy/NAME, sts/NAME or -l SELECTOR".into(),
        )),
        (None, Some(sel)) => Ok(Target::Selector(parse_selector(sel)?)),
        (Some(t), None) => {
            let name = |n: &str| -> Result<String> {
                flags::check_dns_subdomain(n).map_err(|e| Error::Usage(format!("{t:?}: {e}")))?;
                Ok(n.to_owned())
            };
            match t.split_once('/') {
                None => Ok(Target::Pod(name(t)?)),
                Some(("pod" | "pods" | "po", n)) => Ok(Target::Pod(name(n)?)),
                Some(("deploy" | "deployment" | "deployments", n)) => {
                    Ok(Target::Deployment(name(n)?))
                }
                Some(("sts" | "statefulset" | "statefulsets", n)) => {
                    Ok(Target::StatefulSet(name(n)?))
                }
                Some((kind, _)) => Err(Error::Usage(format!(
                    "unsupported target kind {kind:?}; expected pod/, deploy/ or sts/"
                ))),
            }
        }
    }
}

/// `--source` of `kubectl profile heap`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum HeapSourceArg {
    /// The pod's endpoint when it declares one, else per process the Go runtime's profile
    /// (Go) or eBPF (anything else).
    Auto,
    /// The pod's own pprof endpoint.
    Endpoint,
    /// The Go runtime's own heap profile, read from the process (Go only).
    Goruntime,
    /// eBPF uprobes on the allocator.
    Ebpf,
}

impl From<HeapSourceArg> for HeapSource {
    fn from(a: HeapSourceArg) -> Self {
        match a {
            HeapSourceArg::Auto => Self::Auto,
            HeapSourceArg::Endpoint => Self::Endpoint,
            HeapSourceArg::Goruntime => Self::Goruntime,
            HeapSourceArg::Ebpf => Self::Ebpf,
        }
    }
}

/// `--unit` of `kubectl profile runqlat`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum RunqlatUnitArg {
    /// Microseconds.
    Us,
    /// Milliseconds.
    Ms,
}

impl From<RunqlatUnitArg> for RunqlatUnit {
    fn from(a: RunqlatUnitArg) -> Self {
        match a {
            RunqlatUnitArg::Us => Self::Us,
            RunqlatUnitArg::Ms => Self::Ms,
        }
    }
}

/// The options of one profile type, from its own flags (each type's `--help` lists only
/// its own).
#[derive(Debug, Clone, PartialEq)]
pub enum TypeOptions {
    /// `cpu --frequency`.
    Cpu {
        /// Samples per second per CPU.
        frequency_hz: Option<i32>,
    },
    /// `heap --source --sample-bytes`.
    Heap {
        /// Where the profile comes from.
        source: Option<HeapSourceArg>,
        /// eBPF sampling interval in bytes.
        sample_bytes: Option<i64>,
    },
    /// `runqlat --per-process --unit`.
    Runqlat {
        /// One histogram per process.
        per_process: bool,
        /// The buckets' unit.
        unit: Option<RunqlatUnitArg>,
    },
    /// `offcpu --min-block-micros --max-overhead-percent --with-on-cpu --frequency`.
    Offcpu {
        /// Blocks shorter than this are counted, not attributed to a stack.
        min_block_micros: Option<i32>,
        /// The overhead guard's limit.
        max_overhead_percent: Option<i32>,
        /// The wall-clock view (on-CPU samples too).
        with_on_cpu: bool,
        /// Its on-CPU samples per second per CPU.
        frequency_hz: Option<i32>,
    },
}

/// A type's own options block in the spec (pure: the result of [`type_options`]).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct SpecOptions {
    /// `cpu`.
    pub cpu: Option<CpuOptions>,
    /// `heap`.
    pub heap: Option<HeapOptions>,
    /// `runqlat`.
    pub runqlat: Option<RunqlatOptions>,
    /// `offcpu`.
    pub offcpu: Option<OffcpuOptions>,
}

/// Capture options from the command line.
#[derive(Debug, Clone)]
pub struct CaptureOptions {
    /// The profile type.
    pub profile_type: ProfileType,
    /// What to profile.
    pub target: Target,
    /// Capture duration text, e.g. `30s`.
    pub duration: String,
    /// The type's own options.
    pub options: TypeOptions,
    /// Labels for the created ProfileRequest, e.g. for an operator that handles only
    /// requests with a given label.
    pub labels: Vec<(String, String)>,
    /// `ttlSecondsAfterFinished`.
    pub ttl_seconds: Option<i64>,
    /// `export` (`Some(false)` with `--no-export`; absent otherwise, the default).
    pub export: Option<bool>,
}

async fn workload_selector(cluster: &Cluster, target: &Target) -> Result<Option<LabelSelector>> {
    let missing = |kind: &str, name: &str| {
        Error::Usage(format!(
            "{kind} {name:?} not found in namespace {:?}",
            cluster.namespace
        ))
    };
    let kube_err = |action: String| move |e| Error::Kube { action, source: e };
    Ok(match target {
        Target::Pod(_) => None,
        Target::Selector(s) => Some(s.clone()),
        Target::Deployment(n) => {
            let api: Api<Deployment> = Api::namespaced(cluster.client.clone(), &cluster.namespace);
            let d = api
                .get_opt(n)
                .await
                .map_err(kube_err(format!("getting deployment {n}")))?
                .ok_or_else(|| missing("deployment", n))?;
            Some(d.spec.map(|s| s.selector).unwrap_or_default())
        }
        Target::StatefulSet(n) => {
            let api: Api<StatefulSet> = Api::namespaced(cluster.client.clone(), &cluster.namespace);
            let s = api
                .get_opt(n)
                .await
                .map_err(kube_err(format!("getting statefulset {n}")))?
                .ok_or_else(|| missing("statefulset", n))?;
            Some(s.spec.map(|s| s.selector).unwrap_or_default())
        }
    })
}

/// The spec's per-type options (pure).
///
/// # Errors
/// [`Error::Usage`] when the options are for another type than `profile_type`.
pub fn type_options(profile_type: ProfileType, options: &TypeOptions) -> Result<SpecOptions> {
    let other = |what: &str| {
        Err(Error::Usage(format!(
            "{what} options do not apply to {profile_type} profiles"
        )))
    };
    match (profile_type, options) {
        (ProfileType::Cpu, TypeOptions::Cpu { frequency_hz }) => Ok(SpecOptions {
            cpu: frequency_hz.map(|frequency_hz| CpuOptions { frequency_hz }),
            ..SpecOptions::default()
        }),
        (
            ProfileType::Heap,
            TypeOptions::Heap {
                source,
                sample_bytes,
            },
        ) => Ok(SpecOptions {
            heap: (source.is_some() || sample_bytes.is_some()).then(|| HeapOptions {
                source: source.map(HeapSource::from).unwrap_or_default(),
                sample_bytes: *sample_bytes,
                ..HeapOptions::default()
            }),
            ..SpecOptions::default()
        }),
        (ProfileType::Runqlat, TypeOptions::Runqlat { per_process, unit }) => Ok(SpecOptions {
            runqlat: (*per_process || unit.is_some()).then(|| RunqlatOptions {
                per_process: *per_process,
                unit: unit.map(RunqlatUnit::from).unwrap_or_default(),
            }),
            ..SpecOptions::default()
        }),
        (
            ProfileType::Offcpu,
            TypeOptions::Offcpu {
                min_block_micros,
                max_overhead_percent,
                with_on_cpu,
                frequency_hz,
            },
        ) => Ok(SpecOptions {
            offcpu: (min_block_micros.is_some() || max_overhead_percent.is_some() || *with_on_cpu)
                .then_some(OffcpuOptions {
                    min_block_micros: *min_block_micros,
                    max_overhead_percent: *max_overhead_percent,
                    with_on_cpu: with_on_cpu.then_some(true),
                }),
            cpu: frequency_hz.map(|frequency_hz| CpuOptions { frequency_hz }),
            ..SpecOptions::default()
        }),
        (_, TypeOptions::Cpu { .. }) => other("cpu"),
        (_, TypeOptions::Heap { .. }) => other("heap"),
        (_, TypeOptions::Runqlat { .. }) => other("runqlat"),
        (_, TypeOptions::Offcpu { .. }) => other("offcpu"),
    }
}

/// Builds the ProfileRequest (name generated by the API server from `<type>-`).
pub async fn build_request(cluster: &Cluster, opts: &CaptureOptions) -> Result<ProfileRequest> {
    parse_capture_duration(&opts.duration).map_err(|e| Error::Usage(e.to_string()))?;
    let SpecOptions {
        cpu,
        heap,
        runqlat,
        offcpu,
    } = type_options(opts.profile_type, &opts.options)?;
    let selector = workload_selector(cluster, &opts.target).await?;
    let pod_names = match &opts.target {
        Target::Pod(p) => vec![p.clone()],
        _ => vec![],
    };
    let labels: BTreeMap<String, String> = opts.labels.iter().cloned().collect();
    Ok(ProfileRequest {
        metadata: ObjectMeta {
            generate_name: Some(format!("{}-", opts.profile_type)),
            namespace: Some(cluster.namespace.clone()),
            labels: (!labels.is_empty()).then_some(labels),
            ..Default::default()
        },
        spec: ProfileRequestSpec {
            profile_type: opts.profile_type,
            selector,
            pod_names,
            duration: opts.duration.clone(),
            cpu,
            heap,
            runqlat,
            offcpu,
            ttl_seconds_after_finished: opts.ttl_seconds,
            export: opts.export,
        },
        status: None,
    })
}

/// Where a request is, as the progress line and the wait see it (pure).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Stage {
    /// No operator has written a status yet.
    Unaccepted,
    /// Pending, held back by a concurrency limit: the `Queued` condition's reason and
    /// message.
    Queued {
        /// e.g. `ConcurrencyLimit`.
        reason: String,
        /// Which limit.
        message: String,
    },
    /// Accepted, not capturing yet.
    Pending,
    /// Capturing since `started` (Unix seconds, the status' `startTime`).
    Capturing {
        /// `status.startTime`, if written.
        started: Option<i64>,
    },
    /// Terminal.
    Done,
}

/// The stage of `request` (pure).
pub fn stage(request: &ProfileRequest) -> Stage {
    let Some(status) = request.status.as_ref() else {
        return Stage::Unaccepted;
    };
    match status.phase {
        Some(p) if p.is_terminal() => Stage::Done,
        Some(RequestPhase::Running) => Stage::Capturing {
            started: status.start_time.as_ref().map(|t| t.0.as_second()),
        },
        _ => match status
            .conditions
            .iter()
            .find(|c| c.type_ == CONDITION_QUEUED && c.status == "True")
        {
            Some(c) => Stage::Queued {
                reason: c.reason.clone(),
                message: c.message.clone(),
            },
            None if status.phase.is_none() && status.conditions.is_empty() => Stage::Unaccepted,
            None => Stage::Pending,
        },
    }
}

/// One progress line: the phase, the time left of the capture (counted from the status'
/// `startTime`), or why it is queued, and the nodes by phase (counts, so the line stays
/// short on any fleet). `now` is Unix seconds.
pub fn progress_line(request: &ProfileRequest, capture: Duration, now: i64) -> String {
    let status = request.status.as_ref();
    let name = request.metadata.name.as_deref().unwrap_or("");
    let nodes = status
        .and_then(|s| s.node_counts)
        .map(|c| {
            let mut parts = vec![format!("{} nodes", c.total)];
            for (n, what) in [
                (c.pending + c.running, "capturing"),
                (c.succeeded, "succeeded"),
                (c.failed, "failed"),
            ] {
                if n > 0 {
                    parts.push(format!("{n} {what}"));
                }
            }
            format!(" {}", parts.join(", "))
        })
        .unwrap_or_default();
    let what = match stage(request) {
        Stage::Unaccepted => "Pending (waiting for the operator)".to_owned(),
        Stage::Queued { reason, message } => {
            format!(
                "Queued ({reason}): {}",
                flamefleet_api::text::truncated(&message, 160)
            )
        }
        Stage::Pending => "Pending".to_owned(),
        Stage::Capturing { started } => {
            let elapsed = u64::try_from(now.saturating_sub(started.unwrap_or(now))).unwrap_or(0);
            match capture.as_secs().checked_sub(elapsed) {
                Some(left) if left > 0 => format!("Running ({left}s left)"),
                _ => "Running (collecting results)".to_owned(),
            }
        }
        Stage::Done => status
            .and_then(|s| s.phase)
            .map_or("Pending", |p| p.as_str())
            .to_owned(),
    };
    format!("{name} {what}{nodes}")
}

/// Polls the request until its phase is terminal, printing progress to `progress` (stderr:
/// rewritten in place on a terminal, one line per change otherwise).
///
/// `timeout` (by default the capture duration + [`GRACE`]) counts from the capture's start
/// (`status.startTime`): a request queued behind a concurrency limit waits for its turn
/// first, however long. Before any operator has accepted the request, the same timeout
/// counts from now, so that a cluster without a running operator does not wait forever.
///
/// # Errors
/// [`Error::Timeout`], and the errors of reading the request.
pub async fn wait(
    cluster: &Cluster,
    name: &str,
    capture: Duration,
    timeout: Option<Duration>,
    progress: &mut dyn Write,
) -> Result<ProfileRequest> {
    let waiting = Instant::now();
    let timeout = timeout.unwrap_or(capture + GRACE);
    let tty = std::io::stderr().is_terminal();
    let mut last = String::new();
    // When the capture started, on our clock.
    let mut started: Option<Instant> = None;
    loop {
        let request = requests::get(cluster, name).await?;
        let now = k8s_openapi::jiff::Timestamp::now().as_second();
        let stage = stage(&request);
        let line = progress_line(&request, capture, now);
        if tty {
            let _ = write!(progress, "\r\x1b[2K{line}");
            let _ = progress.flush();
        } else {
            // Print on state changes only, without the seconds counter.
            let key = line.replace(char::is_numeric, "");
            if key != last {
                let _ = writeln!(progress, "{line}");
                last = key;
            }
        }
        if stage == Stage::Done {
            if tty {
                let _ = writeln!(progress);
            }
            return Ok(request);
        }
        if let (Stage::Capturing { started: at }, None) = (&stage, started) {
            // Already this far into the capture by the API server's clock (at most the
            // timeout: clocks may disagree).
            let behind = u64::try_from(now.saturating_sub(at.unwrap_or(now))).unwrap_or(0);
            let behind = Duration::from_secs(behind).min(timeout);
            started = Some(
                Instant::now()
                    .checked_sub(behind)
                    .unwrap_or_else(Instant::now),
            );
        }
        let over = match (&stage, started) {
            (_, Some(at)) => at.elapsed() > timeout,
            (Stage::Queued { .. }, None) => false,
            (_, None) => waiting.elapsed() > timeout,
        };
        if over {
            if tty {
                let _ = writeln!(progress);
            }
            let phase = request
                .status
                .as_ref()
                .and_then(|s| s.phase)
                .map_or("Pending", |p| p.as_str())
                .to_owned();
            let waited = started.map_or(waiting.elapsed(), |at| at.elapsed());
            return Err(Error::Timeout {
                name: name.to_string(),
                namespace: cluster.namespace.clone(),
                seconds: waited.as_secs(),
                phase,
                unaccepted: stage == Stage::Unaccepted,
            });
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}

/// Runs `work` until it ends or the user presses Ctrl-C; then returns `interrupted()`, an
/// error saying what keeps going and how to follow it.
pub async fn interruptible<T>(
    work: impl std::future::Future<Output = Result<T>>,
    interrupted: impl FnOnce() -> Error,
) -> Result<T> {
    tokio::select! {
        result = work => result,
        signal = tokio::signal::ctrl_c() => match signal {
            Ok(()) => Err(interrupted()),
            // No signal handler: nothing to interrupt us but a kill.
            Err(_) => std::future::pending().await,
        },
    }
}

/// Creates the request and returns its name and capture duration.
pub async fn create(cluster: &Cluster, opts: &CaptureOptions) -> Result<(String, Duration)> {
    let capture =
        parse_capture_duration(&opts.duration).map_err(|e| Error::Usage(e.to_string()))?;
    let request = build_request(cluster, opts).await?;
    let created = requests::create(cluster, &request).await?;
    Ok((created.metadata.name.unwrap_or_default(), capture))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn selectors_and_targets() {
        let s = parse_selector("app=web, tier==db,env!=prod,!canary,track").unwrap();
        let labels = s.match_labels.unwrap();
        assert_eq!(labels.get("app").map(String::as_str), Some("web"));
        assert_eq!(labels.get("tier").map(String::as_str), Some("db"));
        let ops: Vec<_> = s
            .match_expressions
            .unwrap()
            .into_iter()
            .map(|e| (e.key, e.operator))
            .collect();
        assert_eq!(
            ops,
            vec![
                ("env".into(), "NotIn".into()),
                ("canary".into(), "DoesNotExist".into()),
                ("track".into(), "Exists".into())
            ]
        );
        assert!(parse_selector("env in (a,b)").is_err());
        assert_eq!(
            parse_target(Some("deploy/web"), None).unwrap(),
            Target::Deployment("web".into())
        );
        assert_eq!(
            parse_target(Some("web-0"), None).unwrap(),
            Target::Pod("web-0".into())
        );
        assert!(parse_target(Some("job/x"), None).is_err());
        assert!(parse_target(None, None).is_err());
        assert!(parse_target(Some("deploy/Web"), None).is_err());
        assert!(parse_selector("app=we b").is_err());
        assert!(parse_selector("app=-web").is_err());
    }

    fn request(status: serde_json::Value) -> ProfileRequest {
        serde_json::from_value(serde_json::json!({
            "apiVersion": "flamefleet.dev/v1alpha1", "kind": "ProfileRequest",
            "metadata": {"name": "cpu-abcde", "namespace": "shop"},
            "spec": {"type": "cpu", "podNames": ["p"], "duration": "10s"},
            "status": status,
        }))
        .unwrap()
    }

    #[test]
    fn progress_counts_from_the_start_time_and_says_why_it_is_queued() {
        let capture = Duration::from_secs(10);
        let t0 = 1_800_000_000;
        let mut r = request(serde_json::json!(null));
        r.status = None;
        assert_eq!(stage(&r), Stage::Unaccepted);
        assert_eq!(
            progress_line(&r, capture, t0),
            "cpu-abcde Pending (waiting for the operator)"
        );
        let queued = request(serde_json::json!({"phase": "Pending", "conditions": [{
            "type": "Queued", "status": "True", "reason": "ConcurrencyLimit",
            "message": "namespace shop has 10 captures running, its limit",
            "lastTransitionTime": "2027-01-15T08:00:00Z"}]}));
        assert_eq!(
            progress_line(&queued, capture, t0),
            "cpu-abcde Queued (ConcurrencyLimit): namespace shop has 10 captures running, its limit"
        );
        let running = request(serde_json::json!({
            "phase": "Running", "startTime": "2027-01-15T08:00:00Z",
            "nodeCounts": {"total": 2, "running": 2}}));
        let started = match stage(&running) {
            Stage::Capturing { started: Some(s) } => s,
            other => panic!("{other:?}"),
        };
        assert_eq!(
            Some(started),
            "2027-01-15T08:00:00Z"
                .parse::<k8s_openapi::jiff::Timestamp>()
                .ok()
                .map(|t| t.as_second())
        );
        assert_eq!(
            progress_line(&running, capture, started + 3),
            "cpu-abcde Running (7s left) 2 nodes, 2 capturing"
        );
        assert_eq!(
            progress_line(&running, capture, started + 10),
            "cpu-abcde Running (collecting results) 2 nodes, 2 capturing"
        );
        let done = request(serde_json::json!({"phase": "Succeeded",
            "nodeCounts": {"total": 2, "succeeded": 2}}));
        assert_eq!(stage(&done), Stage::Done);
        assert_eq!(
            progress_line(&done, capture, t0),
            "cpu-abcde Succeeded 2 nodes, 2 succeeded"
        );
    }

    #[test]
    fn each_type_takes_its_own_options() {
        let SpecOptions {
            cpu, heap, runqlat, ..
        } = type_options(
            ProfileType::Heap,
            &TypeOptions::Heap {
                source: Some(HeapSourceArg::Goruntime),
                sample_bytes: None,
            },
        )
        .unwrap();
        assert!(cpu.is_none() && runqlat.is_none());
        assert_eq!(heap.unwrap().source, HeapSource::Goruntime);
        let SpecOptions { heap, .. } = type_options(
            ProfileType::Heap,
            &TypeOptions::Heap {
                source: None,
                sample_bytes: None,
            },
        )
        .unwrap();
        assert!(heap.is_none(), "no options, no heap block");
        assert!(
            type_options(
                ProfileType::Cpu,
                &TypeOptions::Runqlat {
                    per_process: true,
                    unit: None
                }
            )
            .is_err()
        );
        let offcpu = type_options(
            ProfileType::Offcpu,
            &TypeOptions::Offcpu {
                min_block_micros: Some(5000),
                max_overhead_percent: None,
                with_on_cpu: false,
                frequency_hz: None,
            },
        )
        .unwrap()
        .offcpu
        .unwrap();
        assert_eq!(offcpu.min_block_micros, Some(5000));
        assert_eq!(offcpu.with_on_cpu, None);
        let wall = type_options(
            ProfileType::Offcpu,
            &TypeOptions::Offcpu {
                min_block_micros: None,
                max_overhead_percent: None,
                with_on_cpu: true,
                frequency_hz: Some(199),
            },
        )
        .unwrap();
        assert_eq!(wall.offcpu.unwrap().with_on_cpu, Some(true));
        assert_eq!(
            wall.cpu.unwrap().frequency_hz,
            199,
            "the on-CPU sampler's frequency"
        );
        assert!(
            type_options(
                ProfileType::Cpu,
                &TypeOptions::Offcpu {
                    min_block_micros: Some(5000),
                    max_overhead_percent: None,
                    with_on_cpu: false,
                    frequency_hz: None,
                }
            )
            .is_err()
        );
    }
}
