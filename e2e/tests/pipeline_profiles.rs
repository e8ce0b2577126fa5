//! End to end, on the real control plane with real captures: cpu, runqlat, offcpu and heap requests
//! go Pending → Running → Succeeded on two nodes; every artifact downloads (through a
//! ProfileDownload the operator answers), matches its sha256, and `go tool pprof` reads it;
//! unsigned or forged downloads are refused; a request never profiles pods of another
//! namespace.

mod pipeline_support;

use std::io::Read;
use std::path::{Path, PathBuf};
use std::time::Duration;

use flamefleet_api::{Artifact, NodePhase, ProfileRequest, RequestPhase};
use flamefleet_e2e::TestNamespace;
use flamefleet_proto::agent::LatencyHistogram;
use flamefleet_proto::pprof::Profile;
use kube::api::Api;
use pipeline_support::{Pipeline, PipelineOptions, check_digest, node_results, pprof_top, serial};
use prost::Message;
use serde_json::json;

const TIMEOUT: Duration = Duration::from_secs(60);

/// A downloaded pprof artifact: what the status says of it and the decoded profile.
struct Downloaded {
    artifact: Artifact,
    file: PathBuf,
    profile: Profile,
}

fn decode_pprof(file: &Path) -> Profile {
    let gz = std::fs::read(file).expect("read the artifact");
    let mut raw = Vec::new();
    flate2::read::GzDecoder::new(&gz[..])
        .read_to_end(&mut raw)
        .expect("a gzipped pprof");
    Profile::decode(&raw[..]).expect("a pprof Profile")
}

/// The total of sample type `name` over a profile's samples.
fn value_total(profile: &Profile, name: &str) -> i64 {
    let s = |i: i64| profile.string_table[i as usize].as_str();
    let index = profile
        .sample_type
        .iter()
        .position(|t| s(t.r#type) == name)
        .unwrap_or_else(|| panic!("no sample type {name}"));
    profile.sample.iter().map(|x| x.value[index]).sum()
}

/// `go tool pprof -top -sample_index=INDEX`.
fn pprof_top_index(file: &Path, index: &str) -> String {
    let out = std::process::Command::new("go")
        .args(["tool", "pprof", "-top", &format!("-sample_index={index}")])
        .arg(file)
        .output()
        .expect("running `go tool pprof` (install Go)");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Runs one request of `profile_type` over pods on both nodes and checks every artifact;
/// returns the downloaded pprof artifacts too. `operator_args` are the cluster admin's
/// flags for the operator (e.g. a tenant limit lifted).
async fn profile_two_nodes(
    profile_type: &str,
    mode: &str,
    extra: serde_json::Value,
    operator_args: &[&str],
) -> (Pipeline, ProfileRequest, Vec<Downloaded>) {
    let mut pipeline = Pipeline::start(PipelineOptions {
        operator_args: operator_args.iter().map(|a| a.to_string()).collect(),
        ..Default::default()
    })
    .await;
    let ns = TestNamespace::create(&format!("ff-{profile_type}"))
        .await
        .unwrap();
    pipeline
        .pod(&ns, "web-1", 0, &[("app", "web")], mode, 1)
        .await;
    pipeline
        .pod(&ns, "web-2", 1, &[("app", "web")], mode, 1)
        .await;
    pipeline
        .pod(&ns, "db-1", 1, &[("app", "db")], mode, 1)
        .await;
    let mut spec = json!({"type": profile_type, "selector": {"matchLabels": {"app": "web"}}, "duration": "2s"});
    if let (Some(obj), Some(extra)) = (spec.as_object_mut(), extra.as_object()) {
        obj.extend(extra.clone());
    }
    let request = pipeline.request(&format!("{profile_type}-req"), spec);
    let (done, phases) = pipeline.run(&ns, &request, TIMEOUT).await;
    let status = done.status.clone().unwrap();
    assert_eq!(
        status.phase,
        Some(RequestPhase::Succeeded),
        "status: {status:#?}\n{}\n{}",
        pipeline.operator_logs(),
        pipeline.agent_logs()
    );
    assert_eq!(
        phases,
        [
            RequestPhase::Pending,
            RequestPhase::Running,
            RequestPhase::Succeeded
        ],
        "phases seen"
    );
    assert_eq!((status.pod_count, status.node_count), (Some(2), Some(2)));
    assert!(status.start_time.is_some() && status.completion_time.is_some());
    let nodes = node_results(&pipeline.client, &done).await;
    assert_eq!(nodes.len(), 2);
    assert_eq!(nodes[&pipeline.nodes[0]].pods, ["web-1"]);
    assert_eq!(
        nodes[&pipeline.nodes[1]].pods,
        ["web-2"],
        "db-1 is not selected"
    );
    let mut downloaded = Vec::new();
    for (node, entry) in &nodes {
        assert_eq!(entry.phase, Some(NodePhase::Succeeded), "{node}: {entry:?}");
        assert!(!entry.artifacts.is_empty(), "{node} has no artifacts");
        for artifact in &entry.artifacts {
            let file = pipeline.download(&done, artifact).await;
            if artifact.name.ends_with(".pb.gz") {
                let top = pprof_top(&file);
                assert!(
                    !top.trim().is_empty(),
                    "empty pprof output for {}",
                    artifact.name
                );
                downloaded.push(Downloaded {
                    artifact: artifact.clone(),
                    profile: decode_pprof(&file),
                    file,
                });
            } else {
                assert_eq!(artifact.samples, None, "{} is not a profile", artifact.name);
            }
        }
    }
    let completed = status
        .conditions
        .iter()
        .find(|c| c.type_ == "Completed")
        .expect("a Completed condition");
    assert_eq!(
        (completed.status.as_str(), completed.reason.as_str()),
        ("True", "Succeeded")
    );
    let succeeded = status
        .conditions
        .iter()
        .find(|c| c.type_ == "Succeeded")
        .expect("a Succeeded condition");
    assert_eq!(
        (succeeded.status.as_str(), succeeded.reason.as_str()),
        ("True", "AllNodesSucceeded")
    );
    assert_eq!(status.reason, None, "nothing to explain");
    // What `kubectl wait --for=condition=Succeeded` reads.
    let name = done.metadata.name.clone().unwrap_or_default();
    let namespace = done.metadata.namespace.clone().unwrap_or_default();
    let waited = flamefleet_e2e::kubectl::kubectl(
        &pipeline.kubeconfig,
        &[
            "wait",
            "-n",
            &namespace,
            "--for=condition=Succeeded",
            "--timeout=0s",
            &format!("preq/{name}"),
        ],
    );
    assert!(waited.is_ok(), "{waited:?}");
    (pipeline, done, downloaded)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cpu_request_succeeds_on_two_nodes_with_readable_profiles() {
    let _serial = serial().await;
    let (pipeline, done, profiles) =
        profile_two_nodes("cpu", "spin", json!({"cpu": {"frequencyHz": 199}}), &[]).await;
    let summary = done.status.unwrap().summary.expect("a summary");
    assert_eq!(summary.artifacts, Some(2));
    // summary.samples: the CPU samples of every node's profile (samples/count).
    assert_eq!(profiles.len(), 2);
    let mut total = 0;
    for p in &profiles {
        let n = value_total(&p.profile, "samples");
        assert!(n > 0, "no samples in {}", p.artifact.name);
        assert_eq!(p.artifact.samples, Some(n), "{}", p.artifact.name);
        total += n;
        // The workload's hot function, named.
        let top = pprof_top(&p.file);
        assert!(top.contains("burn_cpu"), "{}:\n{top}", p.artifact.name);
        assert_eq!(p.profile.period, 1_000_000_000 / 199);
    }
    assert_eq!(summary.samples, Some(total), "{summary:?}");
    let cpu = summary.cpu.expect("a cpu summary");
    assert_eq!(cpu.frequency_hz, 199, "{cpu:?}");
    assert_eq!((cpu.requested_frequency_hz, cpu.message), (None, None));
    let metrics = pipeline.operator_metrics().await;
    assert!(
        metrics.contains("flamefleet_operator_requests_finished_total{phase=\"Succeeded\"} 1"),
        "{metrics}"
    );
    assert!(
        metrics.contains("flamefleet_operator_captures_dispatched_total 2"),
        "{metrics}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn runqlat_request_succeeds_with_percentiles_in_the_summary() {
    let _serial = serial().await;
    let (pipeline, done, profiles) = profile_two_nodes("runqlat", "wake", json!({}), &[]).await;
    let names: Vec<String> = pipeline_support::artifacts_of(&pipeline.client, &done)
        .await
        .into_iter()
        .map(|a| a.name)
        .collect();
    let status = done.status.unwrap();
    assert_eq!(
        names.iter().filter(|n| n.ends_with(".txt")).count(),
        2,
        "{names:?}"
    );
    let summary = status.summary.expect("a summary");
    let latency = summary
        .runqlat
        .clone()
        .expect("runqlat percentiles in the summary");
    assert!(latency.p99_us >= latency.p50_us, "{latency:?}");
    assert!(latency.events > 0, "{latency:?}");
    // Each wait counted once: the pprof artifacts' waits, not doubled by the text ones.
    assert_eq!(summary.samples, Some(latency.events), "{summary:?}");
    // The percentiles are those of both nodes' waits together: merge the downloaded
    // histograms (bucket_low labels, nanoseconds) and compare.
    let mut merged = LatencyHistogram {
        unit_ns: 1000,
        buckets: vec![0; 27],
    };
    for p in &profiles {
        let s = |i: i64| p.profile.string_table[i as usize].as_str();
        let count = value_total(&p.profile, "count");
        assert_eq!(p.artifact.samples, Some(count), "{}", p.artifact.name);
        for sample in &p.profile.sample {
            let low_ns = sample
                .label
                .iter()
                .find(|l| s(l.key) == "bucket_low")
                .expect("bucket_low")
                .num;
            let low_us = (low_ns / 1000) as u64;
            let index = if low_us == 0 {
                0
            } else {
                low_us.ilog2() as usize
            };
            merged.buckets[index] += sample.value[0] as u64;
        }
    }
    assert_eq!(merged.count() as i64, latency.events);
    let us = |q: f64| merged.quantile_us(q).map(|v| v.round() as i64);
    assert_eq!(latency.merged, Some(true), "{latency:?}");
    assert_eq!(
        (
            Some(latency.p50_us),
            Some(latency.p90_us),
            Some(latency.p99_us)
        ),
        (us(0.5), us(0.9), us(0.99)),
        "{latency:?}"
    );
    assert_eq!(
        latency.max_us,
        merged.max_us().map(|v| v.round() as i64),
        "{latency:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn offcpu_request_succeeds_with_the_blocked_time_in_the_summary() {
    let _serial = serial().await;
    // The wake workload sleeps 200 us between bursts: a minimum of 100 us walks its blocks.
    // It blocks ~3000 times a second on 0.15 CPUs, which the default guard (3%) refuses
    // (a projected 4.3%, the reason in the node's status): this request allows 20%, which
    // takes the cluster admin raising the ceiling first.
    let (_pipeline, done, profiles) = profile_two_nodes(
        "offcpu",
        "wake",
        json!({"offcpu": {"minBlockMicros": 100, "maxOverheadPercent": 20}}),
        &["--max-offcpu-overhead-percent=20"],
    )
    .await;
    let summary = done.status.unwrap().summary.expect("a summary");
    let offcpu = summary.offcpu.clone().expect("an off-CPU summary");
    assert_eq!(profiles.len(), 2);
    let (mut blocked, mut blocks) = (0, 0);
    for p in &profiles {
        let n = value_total(&p.profile, "blocks");
        assert!(n > 0, "no blocks in {}", p.artifact.name);
        assert_eq!(p.artifact.samples, Some(n), "{}", p.artifact.name);
        assert!(
            p.artifact.name.starts_with("offcpu-"),
            "{}",
            p.artifact.name
        );
        blocked += value_total(&p.profile, "off_cpu");
        blocks += n;
        let top = pprof_top(&p.file);
        assert!(top.contains("nanosleep"), "{}:\n{top}", p.artifact.name);
    }
    // The nodes' summaries, summed by the operator.
    assert_eq!(summary.samples, Some(blocks), "{summary:?}");
    assert_eq!(offcpu.blocks, blocks, "{offcpu:?}");
    assert_eq!(offcpu.off_cpu_millis, blocked / 1_000_000, "{offcpu:?}");
    let first = offcpu.top_blocking.first().expect("top blocking functions");
    assert!(first.function.contains("nanosleep"), "{offcpu:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn heap_request_succeeds_with_ebpf_allocation_profiles() {
    let _serial = serial().await;
    let (_pipeline, done, profiles) = profile_two_nodes(
        "heap",
        "alloc",
        // The alloc workload is nearly all allocator calls: the overhead guard would refuse
        // it. Turning the guard off takes the cluster admin lifting the ceiling first.
        json!({"heap": {"source": "ebpf", "maxOverheadPercent": 0}}),
        &["--max-heap-overhead-percent=0"],
    )
    .await;
    let samples = done
        .status
        .unwrap()
        .summary
        .and_then(|s| s.samples)
        .unwrap_or(0);
    assert!(samples > 0, "no heap samples");
    // summary.samples: the allocations the profiles account for (alloc_objects).
    let mut total = 0;
    for p in &profiles {
        let n = value_total(&p.profile, "alloc_objects");
        assert_eq!(p.artifact.samples, Some(n), "{}", p.artifact.name);
        total += n;
        // The workload's allocation site, named.
        let top = pprof_top_index(&p.file, "alloc_space");
        assert!(top.contains("churn_heap"), "{}:\n{top}", p.artifact.name);
    }
    assert_eq!(samples, total);
}

/// Namespace isolation and download permissions in one pipeline: a request in A that names
/// B's pods (by selector and by name) profiles A's pod only; B's pod is never a target. Then
/// the artifacts: a token that may get the request downloads, others are refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_stay_in_their_namespace_and_downloads_need_permission() {
    let _serial = serial().await;
    let mut pipeline = Pipeline::start(PipelineOptions::default()).await;
    let a = TestNamespace::create("ff-tenant-a").await.unwrap();
    let b = TestNamespace::create("ff-tenant-b").await.unwrap();
    pipeline
        .pod(&a, "web-a", 0, &[("app", "web")], "spin", 1)
        .await;
    pipeline
        .pod(&b, "web-b", 1, &[("app", "web")], "spin", 1)
        .await;
    pipeline
        .pod(&b, "only-in-b", 1, &[("app", "secret")], "spin", 1)
        .await;

    // Selector matches pods in both namespaces; podNames names B's pods.
    let request = pipeline.request(
        "cross",
        json!({"type": "cpu", "selector": {"matchLabels": {"app": "web"}}, "podNames": ["web-b", "only-in-b"], "duration": "1s"}),
    );
    let (done, _) = pipeline.run(&a, &request, TIMEOUT).await;
    let status = done.status.clone().unwrap();
    assert_eq!(status.phase, Some(RequestPhase::Succeeded), "{status:#?}");
    let nodes = node_results(&pipeline.client, &done).await;
    assert_eq!(
        nodes.keys().collect::<Vec<_>>(),
        [&pipeline.nodes[0]],
        "only A's node: {nodes:#?}"
    );
    assert_eq!(nodes[&pipeline.nodes[0]].pods, ["web-a"]);
    let resolved = status
        .conditions
        .iter()
        .find(|c| c.type_ == "Resolved")
        .unwrap();
    assert!(
        resolved.message.contains("web-b: no such pod"),
        "{}",
        resolved.message
    );

    // Only B's pods named: nothing to profile in A.
    let only_b = pipeline.request(
        "only-b",
        json!({"type": "cpu", "podNames": ["only-in-b"], "duration": "1s"}),
    );
    let (failed, _) = pipeline.run(&a, &only_b, TIMEOUT).await;
    let status = failed.status.clone().unwrap();
    assert_eq!(status.phase, Some(RequestPhase::Failed));
    assert_eq!(status.node_count, Some(0), "{status:#?}");
    assert!(
        node_results(&pipeline.client, &failed).await.is_empty(),
        "a request that reached no node has no result slices"
    );
    let resolved = status
        .conditions
        .iter()
        .find(|c| c.type_ == "Resolved")
        .unwrap();
    assert_eq!(
        (resolved.status.as_str(), resolved.reason.as_str()),
        ("False", "NoPodsMatched")
    );
    assert!(
        resolved
            .message
            .contains("only-in-b: no such pod in namespace"),
        "{}",
        resolved.message
    );

    // Downloads: a URL the operator signs on request works; unsigned or forged ones do not.
    let artifact = nodes[&pipeline.nodes[0]].artifacts[0].clone();
    assert!(artifact.url.is_none(), "no URL is ever kept in the status");
    let signed = url::Url::parse(&pipeline.download_url(&done, &artifact.name).await).unwrap();
    let http = reqwest::Client::new();
    let ok = http.get(signed.clone()).send().await.unwrap();
    assert_eq!(ok.status(), 200);
    check_digest(&artifact, &ok.bytes().await.unwrap());
    let mut plain = signed.clone();
    plain.set_query(None);
    let anonymous = http.get(plain.clone()).send().await.unwrap();
    assert_eq!(anonymous.status(), 401, "no signature");
    let mut tampered = signed.clone();
    let query: Vec<(String, String)> = signed
        .query_pairs()
        .map(|(k, v)| {
            let v = if k == "sig" {
                "0".repeat(64)
            } else {
                v.into_owned()
            };
            (k.into_owned(), v)
        })
        .collect();
    tampered.query_pairs_mut().clear().extend_pairs(query);
    assert_eq!(
        http.get(tampered).send().await.unwrap().status(),
        403,
        "a forged signature"
    );

    // Deleting the request deletes its artifacts (finalizer).
    let api: Api<ProfileRequest> = a.api();
    api.delete("cross", &Default::default()).await.unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while api.get_opt("cross").await.unwrap().is_some() {
        assert!(
            std::time::Instant::now() < deadline,
            "the finalizer did not complete\n{}",
            pipeline.operator_logs()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(
        reqwest::get(signed).await.unwrap().status(),
        404,
        "artifact still served after deletion"
    );
}

/// A heap profile in the Go layout with the given (leaf-first stack, alloc_objects,
/// alloc_space, inuse_objects, inuse_space) samples, gzipped, as a Go service's
/// `/debug/pprof/heap` serves it.
fn go_heap_profile(samples: &[(&[&str], [i64; 4])]) -> Vec<u8> {
    use flamefleet_proto::pprof::{Function, Line, Location, Sample, ValueType};
    let mut p = Profile {
        string_table: [
            "",
            "alloc_objects",
            "count",
            "alloc_space",
            "bytes",
            "inuse_objects",
            "inuse_space",
        ]
        .map(String::from)
        .to_vec(),
        sample_type: vec![
            ValueType { r#type: 1, unit: 2 },
            ValueType { r#type: 3, unit: 4 },
            ValueType { r#type: 5, unit: 2 },
            ValueType { r#type: 6, unit: 4 },
        ],
        default_sample_type: 6,
        ..Default::default()
    };
    for (stack, values) in samples {
        let mut ids = Vec::new();
        for name in *stack {
            let id = match p
                .function
                .iter()
                .find(|f| p.string_table[f.name as usize] == *name)
            {
                Some(f) => f.id,
                None => {
                    p.string_table.push((*name).to_owned());
                    let id = p.function.len() as u64 + 1;
                    p.function.push(Function {
                        id,
                        name: (p.string_table.len() - 1) as i64,
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
            value: values.to_vec(),
            label: vec![],
        });
    }
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    std::io::Write::write_all(&mut gz, &p.encode_to_vec()).unwrap();
    gz.finish().unwrap()
}

/// Serves `body` to every HTTP request on a free loopback port (the pods' address in these
/// tests) until the test ends; returns the port.
async fn serve_forever(body: Vec<u8>) -> u16 {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    tokio::spawn(async move {
        while let Ok((mut conn, _)) = listener.accept().await {
            let body = body.clone();
            tokio::spawn(async move {
                let mut request = Vec::new();
                let mut buf = [0u8; 1024];
                while !request.windows(4).any(|w| w == b"\r\n\r\n") {
                    match conn.read(&mut buf).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => request.extend_from_slice(&buf[..n]),
                    }
                }
                let head = format!(
                    "HTTP/1.1 200 OK\r\nContent-Type: application/octet-stream\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
                    body.len()
                );
                let _ = conn.write_all(head.as_bytes()).await;
                let _ = conn.write_all(&body).await;
            });
        }
    });
    port
}

/// A heap profile read from a snapshot (the pod's pprof endpoint) finishes when it is read,
/// not after the request's window: only eBPF sampling needs one. And its `samples` is the
/// one heap definition: the allocations the profile accounts for (`alloc_objects`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_heap_snapshot_finishes_when_read_not_after_the_window() {
    let _serial = serial().await;
    let mut pipeline = Pipeline::start(PipelineOptions {
        nodes: 1,
        ..Default::default()
    })
    .await;
    let ns = TestNamespace::create("ff-heap-snap").await.unwrap();
    let heap = go_heap_profile(&[
        (
            &["main.loadCatalog", "main.main"],
            [48, 48 << 20, 48, 48 << 20],
        ),
        (
            &["main.handleOrders", "main.main"],
            [170_000, 700 << 20, 10, 40_960],
        ),
    ]);
    let port = serve_forever(heap).await;
    pipeline
        .pod(&ns, "inventory", 0, &[("app", "inventory")], "spin", 1)
        .await;
    let window = Duration::from_secs(60);
    let request = pipeline.request(
        "snapshot",
        json!({"type": "heap", "podNames": ["inventory"], "duration": "60s",
               "heap": {"source": "endpoint", "endpoint": {"port": port}}}),
    );
    let (done, _) = pipeline.run(&ns, &request, TIMEOUT).await;
    let status = done.status.clone().unwrap();
    assert_eq!(
        status.phase,
        Some(RequestPhase::Succeeded),
        "{status:#?}\n{}\n{}",
        pipeline.operator_logs(),
        pipeline.agent_logs()
    );
    let took = |s: &flamefleet_api::ProfileRequestStatus| {
        let (Some(start), Some(end)) = (&s.start_time, &s.completion_time) else {
            panic!("no start or completion time: {s:#?}");
        };
        Duration::from_secs(u64::try_from(end.0.as_second() - start.0.as_second()).unwrap_or(0))
    };
    // Read at once: nowhere near the 60 s window (the operator collected it on the stream
    // it started instead of hanging up until the window's end).
    assert!(
        took(&status) < window / 2,
        "a snapshot took {:?} of its {window:?} window",
        took(&status)
    );
    let nodes = node_results(&pipeline.client, &done).await;
    let artifact = nodes
        .values()
        .flat_map(|n| n.artifacts.iter())
        .find(|a| a.name.ends_with(".pb.gz"))
        .expect("a heap artifact");
    assert_eq!(
        artifact.samples,
        Some(170_048),
        "alloc_objects: {artifact:?}"
    );
    assert_eq!(
        status.summary.as_ref().and_then(|s| s.samples),
        Some(170_048)
    );
    let file = pipeline.download(&done, artifact).await;
    assert!(pprof_top(&file).contains("main.loadCatalog"));
}
