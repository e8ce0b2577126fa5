//! The OTLP export sink, end to end: real captures (real agents, real eBPF, the real
//! kube-apiserver) exported by the operator to a real OpenTelemetry Collector (v0.165,
//! built from its Go modules by scripts/otelcol.sh, profiles behind its
//! `service.profilesSupport` gate), read back from what the Collector's file exporter wrote:
//!
//! - each node's export equals its pprof artifact (sample types, stacks with addresses,
//!   functions and lines, labels, values), with the Kubernetes resource attributes of the
//!   semantic conventions and the samples' own attributes; `export: false` (a request's, or
//!   a policy template's for its runs) is not sent;
//! - a profile whose OTLP request would be over the operator's request size limit arrives
//!   as several requests, each within it, that together are the artifact;
//! - with the Collector down, captures finish as usual, exports are retried, a namespace
//!   past its share of the queue has its exports dropped and counted while another
//!   namespace's still get in, and everything queued arrives once the Collector is up.

mod pipeline_support;

use std::collections::BTreeMap;
use std::io::Read;
use std::path::Path;
use std::time::Duration;

use flamefleet_api::{ProfileRequest, RequestPhase, SamplingPolicy};
use flamefleet_e2e::TestNamespace;
use flamefleet_pprof::otlp::common::any_value;
use flamefleet_pprof::otlp::messages::ProfilesData;
use flamefleet_proto::pprof::Profile;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, Patch, PatchParams, PostParams};
use pipeline_support::otelcol::{Collector, resource_attributes};
use pipeline_support::{Pipeline, PipelineOptions, node_results, serial};
use prost::Message;
use serde_json::json;

const TIMEOUT: Duration = Duration::from_secs(60);

fn free_port() -> u16 {
    flamefleet_e2e::workload::free_port().expect("a free port")
}

fn decode_pprof(file: &Path) -> Profile {
    let gz = std::fs::read(file).expect("read the artifact");
    let mut raw = Vec::new();
    flate2::read::GzDecoder::new(&gz[..])
        .read_to_end(&mut raw)
        .expect("a gzipped pprof");
    Profile::decode(&raw[..]).expect("a pprof Profile")
}

/// A sample's identity: its stack (address and inlined (function, line) frames per
/// location, leaf first) and its labels (numeric ones as `value unit`).
type SampleKey = (Vec<(u64, Vec<(String, i64)>)>, BTreeMap<String, String>);

/// Everything a profile reader sees, independent of table order and of how samples with
/// the same stack and labels are split: per sample identity, the total of each sample type.
fn canonical(p: &Profile) -> BTreeMap<SampleKey, BTreeMap<String, i64>> {
    let s = |i: i64| p.string_table[i as usize].clone();
    let types: Vec<String> = p
        .sample_type
        .iter()
        .map(|t| format!("{}/{}", s(t.r#type), s(t.unit)))
        .collect();
    let mut out: BTreeMap<SampleKey, BTreeMap<String, i64>> = BTreeMap::new();
    for sample in &p.sample {
        let stack = sample
            .location_id
            .iter()
            .map(|id| {
                let l = p.location.iter().find(|l| l.id == *id).expect("location");
                let lines = l
                    .line
                    .iter()
                    .map(|line| {
                        let f = p
                            .function
                            .iter()
                            .find(|f| f.id == line.function_id)
                            .expect("function");
                        (s(f.name), line.line)
                    })
                    .collect();
                (l.address, lines)
            })
            .collect();
        let labels = sample
            .label
            .iter()
            .map(|l| {
                let v = if l.str != 0 {
                    s(l.str)
                } else {
                    format!("{} {}", l.num, s(l.num_unit))
                };
                (s(l.key), v)
            })
            .collect();
        let totals = out.entry((stack, labels)).or_default();
        for (t, v) in types.iter().zip(&sample.value) {
            *totals.entry(t.clone()).or_default() += v;
        }
    }
    out
}

/// The sum of every line of `metrics` whose name (with labels) starts with `prefix`.
fn metric(metrics: &str, prefix: &str) -> u64 {
    metrics
        .lines()
        .filter(|l| l.starts_with(prefix))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum::<f64>() as u64
}

const EXPORTED: &str = "flamefleet_operator_export_artifacts_total";
const DROPPED: &str = "flamefleet_operator_export_dropped_artifacts_total";
const RETRIES: &str = "flamefleet_operator_export_retries_total";
const SPLIT: &str = "flamefleet_operator_export_split_requests_total";

/// Makes `pod` a pod of Deployment `deployment`, as the ReplicaSet controller would: owned
/// by ReplicaSet `<deployment>-<hash>`, labelled `pod-template-hash: <hash>`.
async fn owned_by_deployment(ns: &TestNamespace, pod: &str, deployment: &str, hash: &str) {
    let api: Api<Pod> = ns.api();
    api.patch(
        pod,
        &PatchParams::default(),
        &Patch::Merge(json!({"metadata": {
            "labels": {"pod-template-hash": hash},
            "ownerReferences": [{
                "apiVersion": "apps/v1", "kind": "ReplicaSet",
                "name": format!("{deployment}-{hash}"),
                "uid": "00000000-0000-0000-0000-000000000001",
                "controller": true,
            }],
        }})),
    )
    .await
    .expect("patching the pod's owner");
}

/// The messages the Collector holds for request `name`, by node.
fn exports_of(collector: &Collector, name: &str) -> BTreeMap<String, Vec<ProfilesData>> {
    let mut out: BTreeMap<String, Vec<ProfilesData>> = BTreeMap::new();
    for data in collector.received() {
        let first = data
            .resource_profiles
            .first()
            .map(resource_attributes)
            .unwrap_or_default();
        if first.get("flamefleet.request.name").map(String::as_str) == Some(name) {
            let node = first.get("k8s.node.name").cloned().unwrap_or_default();
            out.entry(node).or_default().push(data);
        }
    }
    out
}

async fn run_succeeded(
    pipeline: &mut Pipeline,
    ns: &TestNamespace,
    name: &str,
    spec: serde_json::Value,
) -> ProfileRequest {
    let request = pipeline.request(name, spec);
    let (done, _) = pipeline.run(ns, &request, TIMEOUT).await;
    let status = done.status.clone().unwrap_or_default();
    assert_eq!(
        status.phase,
        Some(RequestPhase::Succeeded),
        "{name}: {status:#?}\n{}",
        pipeline.operator_logs()
    );
    done
}

#[tokio::test(flavor = "multi_thread")]
async fn captures_reach_a_real_collector_as_the_pprof_they_are() {
    let _serial = serial().await;
    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
    let collector = Collector::start(dir.path(), port);
    let mut pipeline = Pipeline::start(PipelineOptions {
        operator_args: vec![
            "--export-otlp-endpoint".into(),
            format!("http://127.0.0.1:{port}"),
        ],
        ..Default::default()
    })
    .await;
    let ns = TestNamespace::create("ff-export").await.unwrap();
    let web = pipeline
        .pod(&ns, "web-5d8f7-x2x9q", 0, &[("app", "web")], "spin", 1)
        .await;
    owned_by_deployment(&ns, "web-5d8f7-x2x9q", "web", "5d8f7").await;
    pipeline
        .pod(&ns, "batch-0", 1, &[("app", "web")], "spin", 1)
        .await;
    let spec = |export: Option<bool>| {
        let mut spec =
            json!({"type": "cpu", "selector": {"matchLabels": {"app": "web"}}, "duration": "3s"});
        if let Some(e) = export {
            spec["export"] = json!(e);
        }
        spec
    };

    // Opted out first: the queue is served in order, so they would arrive before the other.
    let quiet = run_succeeded(&mut pipeline, &ns, "quiet", spec(Some(false))).await;
    // A policy whose template opts out: one run, then suspended, every run finished.
    let policy_started = std::time::Instant::now();
    let mut template = spec(Some(false));
    template["duration"] = json!("1s");
    let policy_api: Api<SamplingPolicy> = ns.api();
    let policy = policy_api
        .create(
            &PostParams::default(),
            &pipeline.policy(
                "muted",
                json!({"schedule": "*/2 * * * * *", "template": template}),
            ),
        )
        .await
        .expect("creating the SamplingPolicy");
    let uid = policy.metadata.uid.clone().unwrap_or_default();
    let client = ns.client();
    let runs = || {
        let (client, uid) = (client.clone(), uid.clone());
        async move { pipeline_support::runs_of(&client, &uid).await }
    };
    pipeline
        .wait_for("a succeeded run of the muted policy", TIMEOUT, || async {
            runs()
                .await
                .iter()
                .any(|r| r.status.as_ref().and_then(|s| s.phase) == Some(RequestPhase::Succeeded))
                .then_some(())
        })
        .await;
    policy_api
        .patch(
            "muted",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"suspend": true}})),
        )
        .await
        .expect("suspending the policy");
    let muted_runs = pipeline
        .wait_for(
            "every run of the muted policy finished",
            TIMEOUT,
            || async {
                let runs = runs().await;
                runs.iter().all(pipeline_support::is_terminal).then(|| {
                    runs.iter()
                        .map(|r| r.metadata.name.clone().unwrap_or_default())
                        .collect::<Vec<_>>()
                })
            },
        )
        .await;
    println!(
        "policy run(s) {muted_runs:?} done in {} ms",
        policy_started.elapsed().as_millis()
    );
    let started = std::time::Instant::now();
    let loud = run_succeeded(&mut pipeline, &ns, "loud", spec(None)).await;
    let metrics_port = pipeline.metrics_port;
    pipeline
        .wait_for(
            "both nodes' exports in the Collector's file",
            TIMEOUT,
            || {
                let collector = &collector;
                async move {
                    let m = pipeline_support::metrics_at(metrics_port).await;
                    (metric(&m, EXPORTED) >= 2 && exports_of(collector, "loud").len() == 2)
                        .then_some(())
                }
            },
        )
        .await;
    println!(
        "exports of both nodes in the Collector {} ms after the request finished",
        started.elapsed().as_millis()
    );
    let m = pipeline.operator_metrics().await;
    assert_eq!(
        metric(&m, EXPORTED),
        2,
        "one artifact per node, quiet's not exported"
    );
    assert_eq!(metric(&m, DROPPED), 0, "nothing dropped");
    assert!(
        exports_of(&collector, "quiet").is_empty(),
        "export: false was exported"
    );
    for run in &muted_runs {
        assert!(
            exports_of(&collector, run).is_empty(),
            "run {run} of a policy with template.export: false was exported"
        );
    }
    assert!(quiet.status.is_some());

    let exports = exports_of(&collector, "loud");
    let nodes = node_results(&pipeline.client, &loud).await;
    for (i, node) in pipeline.nodes.iter().enumerate() {
        let messages = &exports[node];
        assert_eq!(messages.len(), 1, "{node}: one export per artifact");
        let data = &messages[0];
        let dictionary = data.dictionary.as_ref().expect("a dictionary");
        let artifact = nodes[node]
            .artifacts
            .iter()
            .find(|a| a.name.ends_with(".pb.gz"))
            .expect("a pprof artifact");
        let pprof = decode_pprof(&pipeline.stored_artifact(&loud, &artifact.name));

        // The profile: what pprof holds, all of it.
        let back = flamefleet_pprof::otlp::to_pprof(&data.resource_profiles, dictionary)
            .expect("the export reads back as pprof");
        let want = canonical(&pprof);
        assert!(!want.is_empty(), "{node}: the capture has samples");
        assert_eq!(canonical(&back), want, "{node}: export and artifact differ");
        let types = |p: &Profile| {
            let mut t: Vec<(String, String)> = p
                .sample_type
                .iter()
                .map(|t| {
                    (
                        p.string_table[t.r#type as usize].clone(),
                        p.string_table[t.unit as usize].clone(),
                    )
                })
                .collect();
            t.sort();
            t
        };
        assert_eq!(types(&back), types(&pprof), "{node}: sample types");
        assert_eq!(
            (back.period, back.duration_nanos),
            (pprof.period, pprof.duration_nanos)
        );
        for t in types(&pprof) {
            let total = flamefleet_pprof::value_total(&pprof, &t.0, &t.1);
            assert!(total.is_some_and(|n| n > 0), "{node}: no {t:?}");
            assert_eq!(
                flamefleet_pprof::value_total(&back, &t.0, &t.1),
                total,
                "{node}: {t:?}"
            );
        }

        // The resource: the conventions' Kubernetes attributes, from the operator's view.
        assert_eq!(
            data.resource_profiles.len(),
            1,
            "{node}: one pod, one resource"
        );
        let rp = &data.resource_profiles[0];
        let attrs = resource_attributes(rp);
        let (pod, service) = if i == 0 {
            ("web-5d8f7-x2x9q", "web")
        } else {
            ("batch-0", "batch-0")
        };
        let mut want: BTreeMap<String, String> = [
            ("k8s.namespace.name", ns.name()),
            ("service.namespace", ns.name()),
            ("k8s.node.name", node.as_str()),
            ("k8s.pod.name", pod),
            ("k8s.container.name", "app"),
            ("service.name", service),
            ("flamefleet.request.name", "loud"),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect();
        if i == 0 {
            want.insert("k8s.deployment.name".into(), "web".into());
            want.insert("k8s.replicaset.name".into(), "web-5d8f7".into());
            want.insert(
                "k8s.pod.uid".into(),
                web.metadata.uid.clone().unwrap_or_default(),
            );
        } else {
            let uid = attrs.get("k8s.pod.uid").cloned().unwrap_or_default();
            assert!(!uid.is_empty(), "{node}: no k8s.pod.uid");
            want.insert("k8s.pod.uid".into(), uid);
        }
        assert_eq!(attrs, want, "{node}: resource attributes");
        let scope = rp.scope_profiles[0].scope.as_ref().expect("a scope");
        assert_eq!(scope.name, "flamefleet");

        // The samples' own attributes: the agent's labels, through the dictionary.
        let string = |i: i32| dictionary.string_table[i as usize].as_str();
        for profile in &rp.scope_profiles[0].profiles {
            assert!(!profile.samples.is_empty());
            for sample in &profile.samples {
                let labels: BTreeMap<&str, String> = sample
                    .attribute_indices
                    .iter()
                    .map(|&a| {
                        let kv = &dictionary.attribute_table[a as usize];
                        let v = match kv.value.as_ref().and_then(|v| v.value.as_ref()) {
                            Some(any_value::Value::StringValue(v)) => v.clone(),
                            Some(any_value::Value::StringValueStrindex(i)) => string(*i).into(),
                            Some(any_value::Value::IntValue(n)) => n.to_string(),
                            other => format!("{other:?}"),
                        };
                        (string(kv.key_strindex), v)
                    })
                    .collect();
                assert_eq!(
                    labels.get("pod").map(String::as_str),
                    Some(pod),
                    "{labels:?}"
                );
                assert_eq!(labels.get("namespace").map(String::as_str), Some(ns.name()));
                assert_eq!(labels.get("container").map(String::as_str), Some("app"));
                assert!(labels.contains_key("pid"), "{labels:?}");
            }
        }
    }
    drop(collector);
}

/// A profile over `--export-otlp-max-message-bytes` (here 4 KiB, the least it takes; the
/// default is the Collector's 4 MiB) is sent as several requests of consecutive samples:
/// each within the limit, the parts counted in `/metrics`, and the Collector's messages
/// together the artifact, sample for sample.
#[tokio::test(flavor = "multi_thread")]
async fn a_profile_over_the_request_size_limit_reaches_the_collector_in_parts() {
    const LIMIT: usize = 4096;
    let _serial = serial().await;
    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
    let collector = Collector::start(dir.path(), port);
    let mut pipeline = Pipeline::start(PipelineOptions {
        nodes: 1,
        operator_args: vec![
            "--export-otlp-endpoint".into(),
            format!("http://127.0.0.1:{port}"),
            format!("--export-otlp-max-message-bytes={LIMIT}"),
        ],
        ..Default::default()
    })
    .await;
    let ns = TestNamespace::create("ff-export-parts").await.unwrap();
    // Three pods of three processes each: samples of nine PIDs, three resources.
    for i in 0..3 {
        pipeline
            .pod(&ns, &format!("wide-{i}"), 0, &[("app", "wide")], "spin", 3)
            .await;
    }
    let spec =
        json!({"type": "cpu", "selector": {"matchLabels": {"app": "wide"}}, "duration": "3s"});
    let done = run_succeeded(&mut pipeline, &ns, "wide", spec).await;
    let node = pipeline.nodes[0].clone();
    let metrics_port = pipeline.metrics_port;
    let parts = pipeline
        .wait_for("every part in the Collector's file", TIMEOUT, || {
            let (collector, node) = (&collector, &node);
            async move {
                let m = pipeline_support::metrics_at(metrics_port).await;
                let parts = metric(&m, SPLIT) as usize;
                let got = exports_of(collector, "wide").get(node).map_or(0, Vec::len);
                (metric(&m, EXPORTED) == 1 && got == parts).then_some(parts)
            }
        })
        .await;
    let m = pipeline.operator_metrics().await;
    assert_eq!(metric(&m, DROPPED), 0, "nothing dropped");
    assert!(parts >= 2, "the profile was sent in {parts} request(s)");
    let nodes = node_results(&pipeline.client, &done).await;
    let artifact = nodes[&node]
        .artifacts
        .iter()
        .find(|a| a.name.ends_with(".pb.gz"))
        .expect("a pprof artifact");
    let pprof = decode_pprof(&pipeline.stored_artifact(&done, &artifact.name));
    let mut sum: BTreeMap<SampleKey, BTreeMap<String, i64>> = BTreeMap::new();
    let mut sizes = Vec::new();
    for data in &exports_of(&collector, "wide")[&node] {
        // As the operator sent it (the Collector writes string references in place of some
        // of the resource's strings, and its own scope).
        sizes.push(data.encoded_len());
        let back = flamefleet_pprof::otlp::to_pprof(
            &data.resource_profiles,
            data.dictionary.as_ref().expect("a dictionary"),
        )
        .expect("each part reads back as pprof");
        for (key, totals) in canonical(&back) {
            let entry = sum.entry(key).or_default();
            for (t, v) in totals {
                *entry.entry(t).or_default() += v;
            }
        }
    }
    println!(
        "a {}-sample profile ({} bytes gzipped) in {parts} requests of {sizes:?} bytes as the \
         Collector wrote them (limit {LIMIT})",
        pprof.sample.len(),
        std::fs::metadata(pipeline.stored_artifact(&done, &artifact.name))
            .map(|m| m.len())
            .unwrap_or_default()
    );
    let want = canonical(&pprof);
    assert!(!want.is_empty(), "the capture has samples");
    assert_eq!(sum, want, "the parts together are the artifact");
    drop(collector);
}

#[tokio::test(flavor = "multi_thread")]
async fn with_the_collector_down_nothing_waits_and_exports_resume() {
    let _serial = serial().await;
    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
    // One capture of a namespace may wait in the queue (and one is being retried).
    let mut pipeline = Pipeline::start(PipelineOptions {
        operator_args: [
            "--export-otlp-endpoint",
            &format!("http://127.0.0.1:{port}"),
            "--export-queue-per-namespace=1",
            "--export-max-retry-delay=2s",
        ]
        .map(String::from)
        .to_vec(),
        ..Default::default()
    })
    .await;
    let noisy = TestNamespace::create("ff-export-noisy").await.unwrap();
    let calm = TestNamespace::create("ff-export-calm").await.unwrap();
    pipeline
        .pod(&noisy, "a-0", 0, &[("app", "a")], "spin", 1)
        .await;
    pipeline
        .pod(&noisy, "a-1", 1, &[("app", "a")], "spin", 1)
        .await;
    pipeline
        .pod(&calm, "b-0", 0, &[("app", "b")], "spin", 1)
        .await;
    let spec = |app: &str| json!({"type": "cpu", "selector": {"matchLabels": {"app": app}}, "duration": "2s"});

    // No Collector: captures finish as usual (the phase does not wait for the export).
    let started = std::time::Instant::now();
    for name in ["flood-1", "flood-2"] {
        run_succeeded(&mut pipeline, &noisy, name, spec("a")).await;
    }
    run_succeeded(&mut pipeline, &calm, "calm-1", spec("b")).await;
    println!(
        "three requests finished in {} ms with the Collector down",
        started.elapsed().as_millis()
    );
    let metrics_port = pipeline.metrics_port;
    pipeline
        .wait_for(
            "retries while the Collector is down",
            TIMEOUT,
            || async move {
                let m = pipeline_support::metrics_at(metrics_port).await;
                (metric(&m, RETRIES) > 0).then_some(())
            },
        )
        .await;
    let m = pipeline.operator_metrics().await;
    // 4 artifacts of the noisy namespace: at most one being retried and one queued.
    let noisy_dropped = metric(&m, &format!("{DROPPED}{{reason=\"namespace_full\"}}"));
    assert!(
        noisy_dropped >= 2,
        "namespace_full drops: {noisy_dropped}\n{m}"
    );
    assert_eq!(metric(&m, DROPPED), noisy_dropped, "{m}");
    assert_eq!(metric(&m, EXPORTED), 0);

    // The Collector comes up: what waited is delivered, the calm namespace's included.
    let collector = Collector::start(dir.path(), port);
    let delivered = 5 - noisy_dropped;
    pipeline
        .wait_for(
            "the queued exports delivered",
            Duration::from_secs(90),
            || {
                let collector = &collector;
                async move {
                    let m = pipeline_support::metrics_at(metrics_port).await;
                    (metric(&m, EXPORTED) == delivered
                        && !exports_of(collector, "calm-1").is_empty())
                    .then_some(())
                }
            },
        )
        .await;
    let m = pipeline.operator_metrics().await;
    assert_eq!(
        metric(&m, DROPPED),
        noisy_dropped,
        "nothing more dropped:\n{m}"
    );
    let calm_export = &exports_of(&collector, "calm-1")[&pipeline.nodes[0]][0];
    let attrs = resource_attributes(&calm_export.resource_profiles[0]);
    assert_eq!(attrs["k8s.namespace.name"], calm.name());
    assert_eq!(attrs["k8s.pod.name"], "b-0");
}
