//! Capture through the agent service, end to end on this machine: a real
//! workload in a kubelet-style cgroup tree, the agent binary over mTLS, the
//! shared eBPF CPU sampler, and an HTTP upload server.

mod service_support;

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use flamefleet_proto::agent::capture_progress::Stage;
use flamefleet_proto::agent::capture_summary::Kind;
use flamefleet_proto::agent::{
    CancelRequest, CaptureProgress, CaptureRequest, HeapSourceUsed, ProfileType, artifact_names,
};
use service_support::*;

fn done(progress: &[CaptureProgress]) -> &CaptureProgress {
    let last = progress.last().expect("at least one message");
    assert_eq!(
        last.stage(),
        Stage::Done,
        "expected DONE, found {:?}: {}",
        last.stage(),
        last.message
    );
    last
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cpu_capture_streams_stages_and_uploads_a_pprof_go_can_read() {
    require_root();
    let _serial = serial().await;
    let Setup {
        mut client,
        agent,
        upload,
        tree,
        pki: _pki,
    } = Setup::new("node-cpu-a", burner()).await;

    let uid = unique("uid-cpu");
    let started = Instant::now();
    let progress = collect(
        &mut client,
        cpu_request(&uid, "node-cpu-a", &tree, &upload, 2500),
    )
    .await;
    let took = started.elapsed();
    assert_full_lifecycle(&progress, &agent);
    assert!(took >= Duration::from_millis(2500), "took {took:?}");
    // Periodic RUNNING progress with elapsed and remaining time.
    let running: Vec<_> = progress
        .iter()
        .filter(|p| p.stage() == Stage::Running && p.elapsed_ms > 0)
        .collect();
    assert!(running.len() >= 2, "{progress:#?}");
    for p in &running {
        assert!(p.elapsed_ms + p.remaining_ms >= 2400, "{p:?}");
    }
    assert!(
        running
            .windows(2)
            .all(|w| w[0].elapsed_ms < w[1].elapsed_ms)
    );

    let last = done(&progress);
    assert_eq!(last.artifacts.len(), 1);
    let a = &last.artifacts[0];
    assert_eq!(a.name, "cpu-node-cpu-a.pb.gz");
    assert_eq!(a.sample_type, "cpu/nanoseconds");
    assert!(
        a.url.is_empty(),
        "download URLs are the operator's business"
    );
    let body = upload
        .body(&uid, &a.name)
        .expect("the artifact reached the upload server");
    assert_eq!(a.size_bytes, body.len() as u64);
    assert_eq!(
        a.sha256,
        flamefleet_agent::service::upload::sha256_hex(&body)
    );
    // ~99 Hz for 2.5 s on one busy thread would be ~250; the 2 cores are
    // shared with other work, so only require clearly more than noise.
    assert!(a.samples >= 25, "samples {}", a.samples);
    assert_eq!(last.summary.get("samples"), Some(&a.samples.to_string()));
    // The typed summary carries the same numbers as the text map.
    let typed = last.capture_summary.as_deref().expect("a typed summary");
    assert_eq!(typed.display(), last.summary);
    assert!(
        matches!(&typed.kind, Some(Kind::Cpu(c)) if c.samples == a.samples && c.frequency_hz == 99),
        "{typed:?}"
    );
    // Symbolization quality is reported with every CPU capture.
    let unsymbolized: f64 = last
        .summary
        .get("unsymbolized_frames_pct")
        .and_then(|v| v.parse().ok())
        .expect("unsymbolized_frames_pct in the summary");
    assert!((0.0..=100.0).contains(&unsymbolized), "{unsymbolized}");

    let top = pprof_top(&body);
    assert!(top.contains("burn_cpu"), "go tool pprof -top:\n{top}");
    let profile = flamefleet_agent::pprof::decode(&body).expect("decode");
    // `samples` of a CPU capture is the profile's samples/count total.
    assert_eq!(value_total(&profile, "samples"), a.samples as i64);
    assert_eq!(
        last.summary.get("frequency_hz").map(String::as_str),
        Some("99")
    );
    assert!(!last.summary.contains_key("requested_frequency_hz"));
    let s = |i: i64| profile.string_table[i as usize].as_str();
    let labels: std::collections::BTreeSet<(String, String)> = profile
        .sample
        .iter()
        .flat_map(|x| x.label.iter())
        .filter(|l| l.str != 0)
        .map(|l| (s(l.key).to_owned(), s(l.str).to_owned()))
        .collect();
    for (k, v) in [
        ("namespace", "shop"),
        ("pod", "checkout-1"),
        ("container", "app"),
        ("node", "node-cpu-a"),
    ] {
        assert!(
            labels.contains(&(k.to_owned(), v.to_owned())),
            "label {k}={v} missing in {labels:?}"
        );
    }
}

/// The total of sample type `name` over a profile's samples.
fn value_total(profile: &flamefleet_proto::pprof::Profile, name: &str) -> i64 {
    let s = |i: i64| profile.string_table[i as usize].as_str();
    let index = profile
        .sample_type
        .iter()
        .position(|t| s(t.r#type) == name)
        .unwrap_or_else(|| panic!("no sample type {name}"));
    profile.sample.iter().map(|x| x.value[index]).sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn offcpu_reports_the_blocked_time_and_where_it_blocked() {
    require_root();
    let _serial = serial().await;
    let node = "node-offcpu";
    // The allocator sleeps 2 ms per iteration (usleep): blocked nearly all the time.
    let Setup {
        mut client,
        agent,
        upload,
        tree,
        pki: _pki,
    } = Setup::new(node, allocator()).await;
    let uid = unique("uid-offcpu");
    let req = request_of(ProfileType::Offcpu, &uid, node, &tree, &upload, 2000);
    let progress = collect(&mut client, req).await;
    assert_full_lifecycle(&progress, &agent);
    let last = done(&progress);
    let pb = &last.artifacts[0];
    assert_eq!(pb.name, format!("offcpu-{node}.pb.gz"));
    let profile = flamefleet_agent::pprof::decode(&upload.body(&uid, &pb.name).expect("uploaded"))
        .expect("decode");
    let blocked = value_total(&profile, "off_cpu");
    let blocks = value_total(&profile, "blocks");
    assert!(
        blocked >= 1_000_000_000,
        "only {blocked} ns blocked in 2 s of a thread sleeping 2 ms per iteration"
    );
    assert!(blocks >= 100, "only {blocks} blocks");
    assert_eq!(pb.samples, blocks as u64);
    let typed = last.capture_summary.as_deref().expect("a typed summary");
    assert_eq!(typed.display(), last.summary);
    let Some(Kind::Offcpu(o)) = &typed.kind else {
        panic!("an off-CPU summary: {typed:?}");
    };
    assert_eq!(o.blocked_ns, blocked as u64);
    assert_eq!(o.blocks, blocks as u64);
    assert_eq!(o.min_block_micros, 1000);
    let top = o.top_blocking.first().expect("a top blocking function");
    assert!(
        top.function.contains("nanosleep"),
        "the sleeper blocks in nanosleep, found {:?}",
        o.top_blocking
    );
    assert_eq!(last.summary["blocks"], blocks.to_string());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn runqlat_counts_each_wait_once_and_reports_its_histogram() {
    require_root();
    let _serial = serial().await;
    let node = "node-rq-sum";
    // The allocator sleeps 2 ms per iteration: ~500 wakeups, so run-queue waits, a second.
    let Setup {
        mut client,
        agent,
        upload,
        tree,
        pki: _pki,
    } = Setup::new(node, allocator()).await;
    let uid = unique("uid-rq-sum");
    let req = request_of(ProfileType::Runqlat, &uid, node, &tree, &upload, 2000);
    let progress = collect(&mut client, req).await;
    assert_full_lifecycle(&progress, &agent);
    let last = done(&progress);
    let pb = &last.artifacts[0];
    let txt = &last.artifacts[1];
    assert_eq!(pb.name, format!("runqlat-{node}.pb.gz"));
    assert_eq!(
        txt.samples, 0,
        "the text rendering counts no samples of its own"
    );
    let profile = flamefleet_agent::pprof::decode(&upload.body(&uid, &pb.name).expect("uploaded"))
        .expect("decode");
    let waits = value_total(&profile, "count");
    assert!(waits >= 100, "only {waits} waits in 2 s of a 500/s sleeper");
    assert_eq!(pb.samples, waits as u64);
    let summary = |k: &str| -> f64 {
        last.summary
            .get(k)
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("{k} in {:?}", last.summary))
    };
    assert_eq!(summary("samples") as i64, waits);
    assert_eq!(summary("events") as i64, waits);
    let h = last
        .runqlat_histogram
        .as_ref()
        .expect("a runqlat DONE carries its histogram");
    assert_eq!(h.unit_ns, 1000);
    assert_eq!(h.count() as i64, waits);
    let typed = last.capture_summary.as_deref().expect("a typed summary");
    assert_eq!(typed.display(), last.summary);
    assert!(
        matches!(&typed.kind, Some(Kind::Runqlat(r)) if r.waits == h.count() && r.p50_us == h.quantile_us(0.5)),
        "{typed:?}"
    );
    // The summary's numbers are the histogram's.
    assert_eq!(
        format!("{:.1}", h.quantile_us(0.5).unwrap()),
        last.summary["p50_us"]
    );
    assert_eq!(
        format!("{:.1}", h.quantile_us(0.99).unwrap()),
        last.summary["p99_us"]
    );
    let max_us = summary("max_us");
    assert!(summary("p99_us") <= max_us);
    // max_us is the upper bound of the highest bucket the pprof has a sample in.
    let s = |i: i64| profile.string_table[i as usize].as_str();
    let highest_ns = profile
        .sample
        .iter()
        .flat_map(|x| x.label.iter())
        .filter(|l| s(l.key) == "bucket_high")
        .map(|l| l.num)
        .max()
        .expect("bucket_high labels");
    assert_eq!(max_us as i64, highest_ns / 1000, "{highest_ns} ns");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_capture_joining_a_running_sampler_reports_the_effective_frequency() {
    require_root();
    let _serial = serial().await;
    let node = "node-join-hz";
    let setup = Setup::new(node, burner()).await;
    let (upload, tree) = (&setup.upload, &setup.tree);
    let first_uid = unique("uid-hz-first");
    let mut first_req = cpu_request(&first_uid, node, tree, upload, 3000);
    first_req.cpu = Some(flamefleet_proto::agent::CpuOptions { frequency_hz: 49 });
    let mut c1 = setup.client().await;
    let (attached, running) = tokio::sync::oneshot::channel();
    let first = tokio::spawn(async move {
        collect_signalling(&mut c1, first_req, sampler_attached, attached).await
    });
    running.await.expect("the first capture's sampler runs");
    let second_uid = unique("uid-hz-second");
    let second_req = cpu_request(&second_uid, node, tree, upload, 1000);
    let mut c2 = setup.client().await;
    let second = collect(&mut c2, second_req).await;
    let first = first.await.expect("first caller");
    let (d1, d2) = (done(&first), done(&second));
    assert_eq!(
        d1.summary.get("frequency_hz").map(String::as_str),
        Some("49")
    );
    assert!(
        !d1.summary.contains_key("requested_frequency_hz"),
        "{:?}",
        d1.summary
    );
    assert_eq!(
        d2.summary.get("frequency_hz").map(String::as_str),
        Some("49")
    );
    assert_eq!(
        d2.summary.get("requested_frequency_hz").map(String::as_str),
        Some("99")
    );
    let note = d2.summary.get("frequency_note").expect("a note");
    assert!(note.contains("49 Hz") && note.contains("99 Hz"), "{note}");
    // The profile agrees: its period is the effective one.
    let body = upload
        .body(&second_uid, &d2.artifacts[0].name)
        .expect("uploaded");
    let profile = flamefleet_agent::pprof::decode(&body).expect("decode");
    assert_eq!(profile.period, 1_000_000_000 / 49, "{}", profile.period);
    assert_eq!(
        value_total(&profile, "samples"),
        d2.artifacts[0].samples as i64
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_same_uid_attaches_while_running_and_replays_after() {
    require_root();
    let _serial = serial().await;
    let setup = Setup::new("node-idem", burner()).await;
    let (agent, upload, tree) = (&setup.agent, &setup.upload, &setup.tree);
    let uid = unique("uid-idem");
    let req = cpu_request(&uid, "node-idem", tree, upload, 3000);

    let mut c1 = setup.client().await;
    let mut c2 = setup.client().await;
    let mut c4 = setup.client().await;
    let r1 = req.clone();
    let (attached, running) = tokio::sync::oneshot::channel();
    let first =
        tokio::spawn(
            async move { collect_signalling(&mut c1, r1, sampler_attached, attached).await },
        );
    // Inside the 3 s window: once the agent says its sampler runs (loading
    // the CPU sampler with its unwinder takes about a second on a loaded
    // 2-core machine, so no fixed delay would do).
    running
        .await
        .expect("the first capture reported its sampler running");
    // Meanwhile another request (another UID) runs a capture of its own.
    let other_uid = unique("uid-other");
    let other_req = cpu_request(&other_uid, "node-idem", tree, upload, 1500);
    let other = tokio::spawn(async move { collect(&mut c4, other_req).await });
    let second = collect(&mut c2, req.clone()).await;
    let first = first.await.expect("first caller");
    let other = other.await.expect("other caller");
    let other_done = done(&other);
    assert!(
        upload
            .body(&other_uid, &other_done.artifacts[0].name)
            .is_some()
    );

    let (d1, d2) = (done(&first), done(&second));
    assert_eq!(d1.artifacts, d2.artifacts, "one capture, one result");
    // The attached caller joined mid-capture: it never saw ACCEPTED.
    assert_ne!(second[0].stage(), Stage::Accepted, "{second:#?}");
    assert_eq!(
        upload.puts.load(Ordering::SeqCst),
        2,
        "one upload per UID, none for the attached call"
    );
    let log = agent.log();
    assert_eq!(log.matches("new capture").count(), 2, "{log}");
    assert_eq!(
        log.matches("attaching to running capture").count(),
        1,
        "{log}"
    );
    // The two overlapping captures joined one CPU sampler.
    let samplers: std::collections::BTreeSet<&str> = log
        .lines()
        .filter(|l| l.contains("cpu sampler attached"))
        .filter_map(|l| l.split("sampler=").nth(1))
        .map(|rest| rest.split_whitespace().next().unwrap_or(rest))
        .collect();
    assert_eq!(log.matches("cpu sampler attached").count(), 2, "{log}");
    assert_eq!(samplers.len(), 1, "{log}");

    // After it finished: the final message is replayed, nothing re-captured.
    let mut c3 = setup.client().await;
    let replay = collect(&mut c3, req).await;
    assert_eq!(replay.len(), 1, "{replay:#?}");
    assert_eq!(done(&replay).artifacts, d1.artifacts);
    assert_eq!(upload.puts.load(Ordering::SeqCst), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancel_stops_a_running_capture() {
    require_root();
    let _serial = serial().await;
    let Setup {
        mut client,
        agent: _agent,
        upload,
        tree,
        pki: _pki,
    } = Setup::new("node-cancel", burner()).await;
    let uid = unique("uid-cancel");

    let mut stream = client
        .capture(cpu_request(&uid, "node-cancel", &tree, &upload, 30_000))
        .await
        .expect("Capture accepted")
        .into_inner();
    // Wait until it runs.
    loop {
        let p = stream
            .message()
            .await
            .expect("progress")
            .expect("not ended");
        if p.stage() == Stage::Running {
            break;
        }
    }
    let started = Instant::now();
    let cancelled = client
        .cancel(CancelRequest {
            request_uid: uid.clone(),
        })
        .await
        .expect("Cancel")
        .into_inner();
    assert!(cancelled.found);
    let mut last = None;
    while let Some(p) = stream.message().await.expect("progress") {
        last = Some(p);
    }
    let last = last.expect("a final message");
    assert_eq!(last.stage(), Stage::Failed, "{last:?}");
    assert!(last.message.contains("cancelled"), "{}", last.message);
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "{:?}",
        started.elapsed()
    );
    assert_eq!(upload.puts.load(Ordering::SeqCst), 0, "nothing uploaded");

    let again = client
        .cancel(CancelRequest { request_uid: uid })
        .await
        .expect("Cancel")
        .into_inner();
    assert!(!again.found, "a finished capture is not running any more");
    let unknown = client
        .cancel(CancelRequest {
            request_uid: "never-seen".into(),
        })
        .await
        .expect("Cancel")
        .into_inner();
    assert!(!unknown.found);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failures_carry_clear_reasons() {
    require_root();
    let _serial = serial().await;
    let Setup {
        mut client,
        agent,
        upload: ok_store,
        tree,
        pki: _pki,
    } = Setup::new("node-fail", burner()).await;
    let refusing = UploadServer::start(Some((
        403,
        "signature expired at 2026-01-01T00:00:00Z",
        u32::MAX,
    )))
    .await;

    // An empty UID is refused outright.
    let mut bad = cpu_request("", "node-fail", &tree, &ok_store, 1000);
    bad.request_uid = "  ".into();
    let status = client.capture(bad).await.expect_err("empty uid refused");
    assert_eq!(status.code(), tonic::Code::InvalidArgument);

    // Unknown container: no cgroup.
    let uid = unique("uid-nocg");
    let mut req = cpu_request(&uid, "node-fail", &tree, &ok_store, 1000);
    req.targets[0].containers[0].container_id = format!("containerd://{}", "ab".repeat(32));
    let progress = collect(&mut client, req).await;
    let last = progress.last().expect("a message");
    assert_eq!(last.stage(), Stage::Failed);
    assert!(
        last.message.contains("no cgroup found for pod") && last.message.contains("checkout-1"),
        "{}",
        last.message
    );

    // No upload slot for the artifact.
    let uid = unique("uid-noslot");
    let mut req = cpu_request(&uid, "node-fail", &tree, &ok_store, 1000);
    req.uploads[0].artifact_name = "heap-node-fail.pb.gz".into();
    let last = collect(&mut client, req).await.pop().expect("a message");
    assert_eq!(last.stage(), Stage::Failed);
    assert!(
        last.message
            .contains("no upload slot for artifact cpu-node-fail.pb.gz"),
        "{}",
        last.message
    );

    // The store refuses: its status code and body are in the reason, no retry of a 403.
    let uid = unique("uid-refused");
    let progress = collect(
        &mut client,
        cpu_request(&uid, "node-fail", &tree, &refusing, 1000),
    )
    .await;
    assert!(stages(&progress).contains(&Stage::Uploading));
    let last = progress.last().expect("a message");
    assert_eq!(last.stage(), Stage::Failed);
    assert!(
        last.message.contains("HTTP 403") && last.message.contains("signature expired"),
        "{}",
        last.message
    );
    assert!(!agent.log().contains("retrying"), "{}", agent.log());

    // A store that is briefly unavailable (503 twice): retried, then uploaded.
    let flaky = UploadServer::start(Some((503, "try again", 2))).await;
    let uid = unique("uid-flaky");
    let progress = collect(
        &mut client,
        cpu_request(&uid, "node-fail", &tree, &flaky, 1000),
    )
    .await;
    let last = done(&progress);
    assert!(flaky.body(&uid, &last.artifacts[0].name).is_some());
    assert_eq!(agent.log().matches("upload failed, retrying").count(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn heap_capture_with_ebpf_uploads_a_heap_profile() {
    require_root();
    let _serial = serial().await;
    let node = "node-heap";
    let Setup {
        mut client,
        agent,
        upload,
        tree,
        pki: _pki,
    } = Setup::new(node, allocator()).await;
    let uid = unique("uid-heap");
    let mut req = request_of(ProfileType::Heap, &uid, node, &tree, &upload, 2500);
    req.heap = Some(flamefleet_proto::agent::HeapOptions {
        source: "ebpf".into(),
        sample_bytes: 4096,
        ..Default::default()
    });

    let progress = collect(&mut client, req).await;
    assert_full_lifecycle(&progress, &agent);
    let last = done(&progress);
    assert_eq!(
        last.summary.get("heap_source").map(String::as_str),
        Some("ebpf")
    );
    let typed = last.capture_summary.as_deref().expect("a typed summary");
    assert_eq!(typed.display(), last.summary);
    assert!(
        matches!(&typed.kind, Some(Kind::Heap(h)) if h.source() == HeapSourceUsed::Ebpf && h.ebpf.is_some()),
        "{typed:?}"
    );
    let a = &last.artifacts[0];
    assert!(a.samples > 0, "{a:?}");
    assert_eq!(a.sample_type, "inuse_space/bytes");
    let body = upload.body(&uid, &a.name).expect("uploaded");
    // `samples` of a heap capture is the allocations the profile accounts for (its
    // alloc_objects total), not the number of pprof rows.
    let profile = flamefleet_agent::pprof::decode(&body).expect("decode");
    let alloc_objects = value_total(&profile, "alloc_objects");
    assert!(alloc_objects > 0);
    assert_ne!(alloc_objects, profile.sample.len() as i64, "rows by chance");
    assert_eq!(a.samples, alloc_objects as u64);
    assert_eq!(last.summary.get("samples"), Some(&a.samples.to_string()));
    // The allocation site holds the live blocks at the end of the window
    // (inuse_space, the default) and made the allocations during it (alloc_space).
    // The engine reads before it detaches its probes: detached one by one, `free`'s
    // probe could outlive `malloc`'s long enough to retire every sampled block of this
    // free-then-allocate loop, leaving inuse_space empty.
    for index in ["inuse_space", "alloc_space"] {
        let top = pprof_top_with(&body, &[&format!("-sample_index={index}")]);
        assert!(
            top.contains("grow_heap"),
            "go tool pprof -top ({index}):\n{top}"
        );
    }
}

/// The address in the agent's "serving /debug/pprof" log line.
async fn debug_address(agent: &AgentProcess) -> String {
    let log = agent
        .wait_for_log("serving /debug/pprof")
        .await
        .unwrap_or_else(|log| panic!("no debug server in the log:\n{log}"));
    let line = log
        .lines()
        .find(|l| l.contains("serving /debug/pprof"))
        .expect("the line");
    line.split("bound=")
        .nth(1)
        .and_then(|rest| rest.split_whitespace().next())
        .unwrap_or_else(|| panic!("no bound= in {line:?}"))
        .to_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_agent_serves_its_own_cpu_profile_one_at_a_time() {
    require_root();
    let _serial = serial().await;
    let node = "node-selfprof";
    let pki = TestPki::new("ca");
    let mut tree = PodTree::new();
    tree.start(burner());
    let upload = UploadServer::start(None).await;
    let agent = AgentProcess::start_with(
        node,
        &pki,
        &tree.root,
        None,
        &["--debug-listen", "127.0.0.1:0"],
    );
    let mut client = operator_client(&pki, &agent).await;
    let debug = debug_address(&agent).await;
    let http = reqwest::Client::new();

    // Profile the agent while it captures and symbolizes: a long profile runs from before
    // the capture starts until after its DONE, then a forced one ends it (no timing guess:
    // on a loaded machine the capture's work can come seconds later than planned).
    let whole = {
        let (http, debug) = (http.clone(), debug.clone());
        tokio::spawn(async move {
            let r = http
                .get(format!(
                    "http://{debug}/debug/pprof/profile?seconds=300&frequency=499"
                ))
                .send()
                .await
                .expect("GET profile");
            (r.status(), r.bytes().await.expect("body"))
        })
    };
    agent
        .wait_for_log("self CPU profile started seconds=300")
        .await
        .expect("the profile started");
    let uid = unique("uid-selfprof");
    done(&collect(&mut client, cpu_request(&uid, node, &tree, &upload, 2000)).await);
    let ender = http
        .get(format!(
            "http://{debug}/debug/pprof/profile?seconds=1&force=true"
        ))
        .send()
        .await
        .expect("GET forced");
    assert_eq!(ender.status(), 200);
    let (status, body) = whole.await.expect("profile");
    assert_eq!(status, 200);
    let p = flamefleet_agent::pprof::decode(&body).expect("pprof");
    // Each sample stands for its share of the agent's measured CPU time: at least the
    // nominal 1/499 s, more where the kernel's tick delivered fewer signals than asked.
    assert!(
        p.period * 10 >= 9 * (1_000_000_000 / 499),
        "period {} ns",
        p.period
    );
    let names: Vec<&str> = p
        .function
        .iter()
        .map(|f| p.string_table[f.name as usize].as_str())
        .collect();
    assert!(
        names.iter().any(|n| n.contains("flamefleet_agent")),
        "the agent's own functions: {names:?}"
    );

    // One at a time: while a long one runs, another is refused unless forced.
    let long = {
        let (http, debug) = (http.clone(), debug.clone());
        tokio::spawn(async move {
            http.get(format!(
                "http://{debug}/debug/pprof/profile?seconds=120&format=svg"
            ))
            .send()
            .await
            .expect("GET long")
            .status()
        })
    };
    agent
        .wait_for_log("self CPU profile started seconds=120")
        .await
        .expect("the long profile started");
    let refused = http
        .get(format!("http://{debug}/debug/pprof/profile?seconds=1"))
        .send()
        .await
        .expect("GET refused");
    assert_eq!(refused.status(), 409);
    // (pprof: an idle agent may take no sample in 1 s, and a flame graph of nothing is an
    // error.)
    let forced = http
        .get(format!(
            "http://{debug}/debug/pprof/profile?seconds=1&force=true"
        ))
        .send()
        .await
        .expect("GET forced");
    assert_eq!(forced.status(), 200);
    flamefleet_agent::pprof::decode(&forced.bytes().await.expect("body")).expect("pprof");
    // The forced-out profile ended early with what it had (or, with nothing sampled yet,
    // a clear 500); either way it no longer runs.
    let status = long.await.expect("long");
    assert!(status == 200 || status == 500, "{status}");
    let heap = http
        .get(format!("http://{debug}/debug/pprof/heap"))
        .send()
        .await
        .expect("GET heap");
    // The binary runs on jemalloc with its profiler on: its in-use heap, as pprof.
    assert_eq!(heap.status(), 200);
    let h = flamefleet_agent::pprof::decode(&heap.bytes().await.expect("body")).expect("pprof");
    assert_eq!(
        h.string_table[h.sample_type[0].r#type as usize],
        "inuse_space"
    );
    assert!(
        !h.sample.is_empty(),
        "an agent that captured holds sampled memory"
    );
}

/// A heap request of `uid` sampling every `sample_bytes` bytes with eBPF for `duration_ms`.
fn heap_request(
    uid: &str,
    node: &str,
    tree: &PodTree,
    upload: &UploadServer,
    duration_ms: u32,
    sample_bytes: u64,
) -> CaptureRequest {
    let mut req = request_of(ProfileType::Heap, uid, node, tree, upload, duration_ms);
    req.heap = Some(flamefleet_proto::agent::HeapOptions {
        source_kind: flamefleet_proto::agent::HeapSource::Ebpf as i32,
        sample_bytes,
        ..Default::default()
    });
    req
}

/// [`cpu_request`] made a request of type `kind` (its options are the caller's to set),
/// with upload slots for the type's artifacts.
fn request_of(
    kind: ProfileType,
    uid: &str,
    node: &str,
    tree: &PodTree,
    upload: &UploadServer,
    duration_ms: u32,
) -> CaptureRequest {
    let mut req = cpu_request(uid, node, tree, upload, duration_ms);
    req.r#type = kind as i32;
    req.cpu = None;
    req.uploads = upload.slots(uid, &artifact_names(kind, node));
    req
}

/// A cancelled eBPF heap capture leaves the node's heap sampler at once, not at the end of
/// its window: a capture right after it starts a sampler of its own, at its own rate.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancelled_heap_capture_gives_up_the_heap_sampler_at_once() {
    require_root();
    let _serial = serial().await;
    let node = "node-heap-cancel";
    let Setup {
        mut client,
        agent: _agent,
        upload,
        tree,
        pki: _pki,
    } = Setup::new(node, allocator()).await;
    let uid = unique("uid-heap-cancel");
    let mut stream = client
        .capture(heap_request(&uid, node, &tree, &upload, 60_000, 4096))
        .await
        .expect("Capture accepted")
        .into_inner();
    loop {
        let p = stream
            .message()
            .await
            .expect("progress")
            .expect("not ended");
        if p.stage() == Stage::Running {
            break;
        }
    }
    let cancelled = client
        .cancel(CancelRequest {
            request_uid: uid.clone(),
        })
        .await
        .expect("Cancel")
        .into_inner();
    assert!(cancelled.found);
    let mut last = None;
    while let Some(p) = stream.message().await.expect("progress") {
        last = Some(p);
    }
    let last = last.expect("a final message");
    assert_eq!(last.stage(), Stage::Failed, "{last:?}");
    assert!(last.message.contains("cancelled"), "{}", last.message);

    let next_uid = unique("uid-heap-next");
    let progress = collect(
        &mut client,
        heap_request(&next_uid, node, &tree, &upload, 1500, 8192),
    )
    .await;
    let done = done(&progress);
    let typed = done.capture_summary.as_deref().expect("a typed summary");
    let Some(Kind::Heap(heap)) = &typed.kind else {
        panic!("a heap summary: {typed:?}");
    };
    let stats = heap.ebpf.as_ref().expect("eBPF counters");
    assert_eq!(
        (stats.sample_bytes, stats.shared_with),
        (8192, 0),
        "the cancelled capture still held the heap sampler: {stats:?}"
    );
}

/// Polls `agent`'s eBPF file descriptors every 20 ms until `done` holds, for at most `limit`;
/// returns when it held (measured from `since`), or `None`.
async fn bpf_fds_until(
    agent: &AgentProcess,
    since: Instant,
    limit: Duration,
    done: impl Fn(BpfFds) -> bool,
) -> Option<Duration> {
    loop {
        if done(agent.bpf_fds()) {
            return Some(since.elapsed());
        }
        if since.elapsed() > limit {
            return None;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The operator goes away mid-capture (its connection closes, nobody calls Collect) and
/// the store the capture uploads to accepts connections but never answers: the capture's
/// eBPF programs, maps and perf events go at the end of its window, and the capture, stuck
/// in its upload, is stopped at the operator's deadline plus the agent's margin, FAILED with
/// reason `Abandoned` (what a later Collect replays), instead of running on for nobody.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_abandoned_capture_frees_its_bpf_state_and_is_stopped_past_the_deadline() {
    require_root();
    let _serial = serial().await;
    let node = "node-abandoned";
    let pki = TestPki::new("ca");
    let mut tree = PodTree::new();
    tree.start(burner());
    let upload = UploadServer::start(None).await;
    // The CPU sampler's program stays loaded this long after its last capture (30 s by
    // default: docs/capture.md); 2 s keeps the test short.
    let agent = AgentProcess::start_with(
        node,
        &pki,
        &tree.root,
        None,
        &["--cpu-sampler-linger", "2s"],
    );
    let client = operator_client(&pki, &agent).await;
    // A store that takes the connection and never answers (its backlog holds it).
    let stalled = std::net::TcpListener::bind("127.0.0.1:0").expect("bind a stalled store");
    let stalled_addr = stalled.local_addr().expect("its address");
    let uid = unique("uid-abandoned");
    let mut request = cpu_request(&uid, node, &tree, &upload, 2_000);
    request.deadline_ms = 4_000;
    for slot in &mut request.uploads {
        slot.put_url = format!(
            "http://{stalled_addr}/{uid}/{}?sig=test",
            slot.artifact_name
        );
    }
    let idle = agent.bpf_fds();

    let mut operator = client;
    let asked = Instant::now();
    let mut stream = operator
        .capture(request)
        .await
        .expect("Capture accepted")
        .into_inner();
    loop {
        let p = stream
            .message()
            .await
            .expect("progress")
            .expect("not ended");
        if sampler_attached(&p) {
            break;
        }
    }
    let capturing = agent.bpf_fds();
    assert!(
        capturing.programs > idle.programs && capturing.perf_events > idle.perf_events,
        "the capture holds no eBPF state of its own: idle {idle:?}, capturing {capturing:?}"
    );
    // The operator dies: its stream and connection go.
    drop(stream);
    drop(operator);

    let limit = Duration::from_secs(30);
    let unheld = |what: &str| {
        panic!(
            "the agent still holds {:?} (idle {idle:?}) 30 s after the request: {what}\n{}",
            agent.bpf_fds(),
            agent.log()
        )
    };
    let sampling_stopped = bpf_fds_until(&agent, asked, limit, |fds| {
        fds.perf_events == idle.perf_events
    })
    .await
    .unwrap_or_else(|| unheld("its perf events"));
    let freed = bpf_fds_until(&agent, asked, limit, |fds| fds == idle)
        .await
        .unwrap_or_else(|| unheld("its programs and maps"));
    let log = agent
        .wait_for_log("capture abandoned")
        .await
        .unwrap_or_else(|log| panic!("the capture was never abandoned\n{log}"));
    let abandoned = asked.elapsed();
    assert!(
        !log.contains("capture done"),
        "the stalled store answered?\n{log}"
    );
    eprintln!(
        "abandoned capture (2 s window, 4 s deadline, 2 s linger): sampling stopped {:.2} s after the request, programs and maps unloaded {:.2} s, the capture stopped {:.2} s",
        sampling_stopped.as_secs_f64(),
        freed.as_secs_f64(),
        abandoned.as_secs_f64()
    );
    // Bounds: the window's end (2 s), then the sampler's linger (4 s), and the deadline
    // plus the agent's 5 s margin (9 s); what is over them is this machine's scheduling,
    // allowed 3 s.
    assert!(
        sampling_stopped < Duration::from_secs(5),
        "sampling stopped after {sampling_stopped:?}"
    );
    assert!(freed < Duration::from_secs(7), "unloaded after {freed:?}");
    assert!(
        abandoned >= Duration::from_secs(9) && abandoned < Duration::from_secs(12),
        "stopped after {abandoned:?}"
    );

    // A replica that comes back finds the capture's end, with the reason.
    let mut collector = operator_client(&pki, &agent).await;
    let mut replay = collector
        .collect(flamefleet_proto::agent::CollectRequest {
            request_uid: uid.clone(),
        })
        .await
        .expect("Collect finds the capture")
        .into_inner();
    let mut last = None;
    while let Some(p) = replay.message().await.expect("replay") {
        last = Some(p);
    }
    let last = last.expect("the final message");
    assert_eq!(last.stage(), Stage::Failed, "{last:?}");
    assert_eq!(last.reason, "Abandoned", "{last:?}");
    assert!(
        last.message.contains("abandoned") && last.message.contains("freed its eBPF state"),
        "{}",
        last.message
    );
    assert_eq!(agent.bpf_fds(), idle);
    drop(stalled);
    drop(agent);
}
