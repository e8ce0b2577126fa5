//! `kubectl profile cpu|heap|runqlat TARGET`: create a ProfileRequest, follow it, download.

use std::collections::BTreeMap;
use std::io::{IsTerminal, Write};
use std::time::{Duration, Instant};

use flamefleet_api::{
    CpuOptions, ProfileRequest, ProfileRequestSpec, ProfileType, duration::parse_capture_duration,
};
use k8s_openapi::api::apps::v1::{Deployment, StatefulSet};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, LabelSelectorRequirement};
use kube::api::{Api, ObjectMeta};

use crate::cluster::Cluster;
use crate::error::{Error, Result};
use crate::requests;

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
        if let Some((k, v)) = term.split_once("!=") {
            exprs.push(req(k.trim(), "NotIn", Some(vec![v.trim().to_string()])));
        } else if let Some((k, v)) = term.split_once("==").or_else(|| term.split_once('=')) {
            labels.insert(k.trim().to_string(), v.trim().to_string());
        } else if let Some(k) = term.strip_prefix('!') {
            exprs.push(req(k.trim(), "DoesNotExist", None));
        } else if term.contains(' ') || term.contains('(') {
            return Err(Error::Usage(format!(
                "unsupported selector term {term:?}; use k=v, k!=v, k or !k separated by commas"
            )));
        } else {
            exprs.push(req(term, "Exists", None));
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
        (Some(t), None) => match t.split_once('/') {
            None => Ok(Target::Pod(t.to_string())),
            Some(("pod" | "pods" | "po", n)) => Ok(Target::Pod(n.to_string())),
            Some(("deploy" | "deployment" | "deployments", n)) => {
                Ok(Target::Deployment(n.to_string()))
            }
            Some(("sts" | "statefulset" | "statefulsets", n)) => {
                Ok(Target::StatefulSet(n.to_string()))
            }
            Some((kind, _)) => Err(Error::Usage(format!(
                "unsupported target kind {kind:?}; expected pod/, deploy/ or sts/"
            ))),
        },
    }
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
    /// CPU sampling frequency.
    pub frequency_hz: Option<i32>,
    /// Labels for the created ProfileRequest (`key=value`), e.g. for an operator that
    /// handles only requests with a given label.
    pub labels: Vec<String>,
}

/// Parses `key=value` labels.
fn parse_labels(labels: &[String]) -> Result<Option<std::collections::BTreeMap<String, String>>> {
    if labels.is_empty() {
        return Ok(None);
    }
    labels
        .iter()
        .map(|l| match l.split_once('=') {
            Some((k, v)) if !k.is_empty() => Ok((k.to_string(), v.to_string())),
            _ => Err(Error::Usage(format!(
                "--label expects key=value, found {l:?}"
            ))),
        })
        .collect::<Result<_>>()
        .map(Some)
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

/// Builds the ProfileRequest (name generated by the API server from `<type>-`).
pub async fn build_request(cluster: &Cluster, opts: &CaptureOptions) -> Result<ProfileRequest> {
    parse_capture_duration(&opts.duration).map_err(|e| Error::Usage(e.to_string()))?;
    let selector = workload_selector(cluster, &opts.target).await?;
    let pod_names = match &opts.target {
        Target::Pod(p) => vec![p.clone()],
        _ => vec![],
    };
    let cpu = match (opts.profile_type, opts.frequency_hz) {
        (ProfileType::Cpu, Some(f)) => Some(CpuOptions { frequency_hz: f }),
        (_, Some(_)) => {
            return Err(Error::Usage(
                "--frequency only applies to cpu profiles".into(),
            ));
        }
        _ => None,
    };
    Ok(ProfileRequest {
        metadata: ObjectMeta {
            generate_name: Some(format!("{}-", opts.profile_type)),
            namespace: Some(cluster.namespace.clone()),
            labels: parse_labels(&opts.labels)?,
            ..Default::default()
        },
        spec: ProfileRequestSpec {
            profile_type: opts.profile_type,
            selector,
            pod_names,
            duration: opts.duration.clone(),
            cpu,
            heap: None,
            runqlat: None,
            ttl_seconds_after_finished: None,
        },
        status: None,
    })
}

/// One progress line: the phase, the time left, and the nodes by phase (counts, so the line
/// stays short on any fleet).
pub fn progress_line(request: &ProfileRequest, left: Duration) -> String {
    let status = request.status.as_ref();
    let phase = status
        .and_then(|s| s.phase)
        .map_or("Pending", |p| p.as_str());
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
            parts.join(", ")
        })
        .unwrap_or_default();
    format!(
        "{} {phase} ({}s left) {nodes}",
        request.metadata.name.as_deref().unwrap_or(""),
        left.as_secs(),
    )
}

/// Polls the request until its phase is terminal, printing progress (rewritten in place on a
/// terminal, one line per change otherwise); gives up after `deadline` (by default the
/// capture duration + [`GRACE`]).
pub async fn wait(
    cluster: &Cluster,
    name: &str,
    capture: Duration,
    deadline: Option<Duration>,
    out: &mut dyn Write,
) -> Result<ProfileRequest> {
    let start = Instant::now();
    let deadline = deadline.unwrap_or(capture + GRACE);
    let tty = std::io::stdout().is_terminal();
    let mut last = String::new();
    loop {
        let request = requests::get(cluster, name).await?;
        let phase = request.status.as_ref().and_then(|s| s.phase);
        let elapsed = start.elapsed();
        let line = progress_line(&request, capture.saturating_sub(elapsed));
        if tty {
            let _ = write!(out, "\r\x1b[2K{line}");
            let _ = out.flush();
        } else {
            // Print on state changes only, without the seconds counter.
            let key = line.replace(char::is_numeric, "");
            if key != last {
                let _ = writeln!(out, "{line}");
                last = key;
            }
        }
        if phase.is_some_and(|p| p.is_terminal()) {
            if tty {
                let _ = writeln!(out);
            }
            return Ok(request);
        }
        if elapsed > deadline {
            return Err(Error::Timeout {
                name: name.to_string(),
                seconds: elapsed.as_secs(),
                phase: phase.map_or("Pending", |p| p.as_str()).to_string(),
            });
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
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
    }
}
