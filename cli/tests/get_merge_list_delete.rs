//! `kubectl profile` against the real local control plane and a real built-in artifact store:
//! the test writes each request's status through the status subresource, as the operator and
//! agents do, with artifacts uploaded to the store through signed URLs.

mod support;

use flamefleet_api::{NodePhase, RequestPhase};
use support::{
    Store, cli, cpu_profile, create_request, files, namespace, node, pprof, write_status,
};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn get_renders_every_format_then_list_merge_delete() {
    let ns = namespace("cli-get").await;
    let kc = support::admin_kubeconfig(&ns);
    let store = Store::start_for(&ns).await;
    let req = create_request(&ns, "checkout-cpu").await;
    let a1 = store
        .upload(&req, "cpu-node-a.pb.gz", &cpu_profile("crc32_hot_loop"))
        .await;
    let a2 = store
        .upload(&req, "cpu-node-b.pb.gz", &cpu_profile("crc32_hot_loop"))
        .await;
    write_status(
        &ns,
        "checkout-cpu",
        RequestPhase::Succeeded,
        vec![
            node("node-a", NodePhase::Succeeded, None, vec![a1]),
            node("node-b", NodePhase::Succeeded, None, vec![a2]),
        ],
    )
    .await;
    let out = tempfile::tempdir().unwrap();
    let dir = out.path().to_str().unwrap();

    // pprof: the bytes as stored, decodable, same sha as the status.
    let r = cli(&kc, ns.name(), &["get", "checkout-cpu", "-o", dir]).await;
    assert_eq!(r.code, 0, "{r:?}");
    assert_eq!(
        files(out.path()),
        ["checkout-cpu-node-a.pb.gz", "checkout-cpu-node-b.pb.gz"]
    );
    let bytes = std::fs::read(out.path().join("checkout-cpu-node-a.pb.gz")).unwrap();
    assert_eq!(bytes, cpu_profile("crc32_hot_loop"));

    // svg: valid XML naming the hot function.
    let r = cli(
        &kc,
        ns.name(),
        &["get", "checkout-cpu", "-o", dir, "--format", "svg"],
    )
    .await;
    assert_eq!(r.code, 0, "{r:?}");
    let svg = std::fs::read_to_string(out.path().join("checkout-cpu-node-a.svg")).unwrap();
    // inferno writes a DOCTYPE; the DTD itself is not fetched.
    let options = roxmltree::ParsingOptions {
        allow_dtd: true,
        ..Default::default()
    };
    let doc = roxmltree::Document::parse_with_options(&svg, options)
        .expect("the flame graph is valid XML");
    assert_eq!(doc.root_element().tag_name().name(), "svg");
    let titles: Vec<&str> = doc
        .descendants()
        .filter(|n| n.tag_name().name() == "title")
        .filter_map(|n| n.text())
        .collect();
    assert!(
        titles.iter().any(|t| t.starts_with("crc32_hot_loop")),
        "no frame titled crc32_hot_loop in {titles:?}"
    );

    // text: the hot function is the first row, with 80% flat.
    let r = cli(
        &kc,
        ns.name(),
        &["get", "checkout-cpu", "-o", dir, "--format", "text"],
    )
    .await;
    assert_eq!(r.code, 0, "{r:?}");
    let first_row = r
        .stdout
        .lines()
        .skip_while(|l| !l.trim_start().starts_with("flat"))
        .nth(1)
        .unwrap_or_default();
    assert!(
        first_row.ends_with("crc32_hot_loop") && first_row.contains("80.00%"),
        "first row {first_row:?} of\n{}",
        r.stdout
    );

    // folded: root→leaf collapsed stacks.
    let r = cli(
        &kc,
        ns.name(),
        &["get", "checkout-cpu", "-o", dir, "--format", "folded"],
    )
    .await;
    assert_eq!(r.code, 0, "{r:?}");
    let folded = std::fs::read_to_string(out.path().join("checkout-cpu-node-a.folded")).unwrap();
    assert!(
        folded.contains("main;handle_request;crc32_hot_loop 800000000\n"),
        "{folded}"
    );

    // merge by request name: both nodes' samples in one file.
    let merged = out.path().join("merged.pb.gz");
    let r = cli(
        &kc,
        ns.name(),
        &["merge", "checkout-cpu", "-o", merged.to_str().unwrap()],
    )
    .await;
    assert_eq!(r.code, 0, "{r:?}");
    let m = kubectl_profile::profile_file::decode(&std::fs::read(&merged).unwrap(), "m").unwrap();
    assert_eq!(m.sample.len(), 6);
    let stacks = kubectl_profile::stacks::folded(&m, 0);
    assert_eq!(
        stacks.get("main;handle_request;crc32_hot_loop"),
        Some(&1_600_000_000)
    );
    // `go tool pprof` is the referee for every pprof file we write.
    let referee = tokio::process::Command::new("go")
        .args(["tool", "pprof", "-top"])
        .arg(&merged)
        .output()
        .await
        .expect("`go` must be installed (scripts/setup.sh) to check the merged pprof");
    let top = String::from_utf8_lossy(&referee.stdout);
    assert!(referee.status.success(), "go tool pprof: {referee:?}");
    let first = top
        .lines()
        .skip_while(|l| !l.trim_start().starts_with("flat"))
        .nth(1)
        .unwrap_or_default();
    assert!(first.ends_with("crc32_hot_loop"), "{top}");

    // merge refuses mixed types, with exit code 11.
    let heap = out.path().join("heap.pb.gz");
    std::fs::write(
        &heap,
        pprof(("inuse_space", "bytes"), &[(&["malloc", "main"], 4096)]),
    )
    .unwrap();
    let r = cli(
        &kc,
        ns.name(),
        &[
            "merge",
            merged.to_str().unwrap(),
            heap.to_str().unwrap(),
            "-o",
            out.path().join("x.pb.gz").to_str().unwrap(),
        ],
    )
    .await;
    assert_eq!(r.code, 11, "{r:?}");
    assert!(r.stderr.contains("different sample types"), "{}", r.stderr);
    assert!(!out.path().join("x.pb.gz").exists());

    // list: a kubectl-like table.
    let r = cli(&kc, ns.name(), &["list"]).await;
    assert_eq!(r.code, 0, "{r:?}");
    let mut lines = r.stdout.lines();
    let header: Vec<&str> = lines.next().unwrap().split_whitespace().collect();
    assert_eq!(header, ["NAME", "TYPE", "PHASE", "PODS", "NODES", "AGE"]);
    let row: Vec<&str> = lines.next().unwrap().split_whitespace().collect();
    assert_eq!(&row[..5], ["checkout-cpu", "cpu", "Succeeded", "1", "2"]);

    // delete, then it is gone (exit 3).
    let r = cli(&kc, ns.name(), &["delete", "checkout-cpu"]).await;
    assert_eq!(r.code, 0, "{r:?}");
    let r = cli(&kc, ns.name(), &["get", "checkout-cpu"]).await;
    assert_eq!(r.code, 3, "{r:?}");
    assert!(r.stderr.contains("not found"), "{}", r.stderr);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn checksum_mismatch_writes_nothing() {
    let ns = namespace("cli-sha").await;
    let kc = support::admin_kubeconfig(&ns);
    let store = Store::start_for(&ns).await;
    let req = create_request(&ns, "bad-sha").await;
    let good = store
        .upload(&req, "cpu-node-a.pb.gz", &cpu_profile("ok_fn"))
        .await;
    let mut bad = store
        .upload(&req, "cpu-node-b.pb.gz", &cpu_profile("ok_fn"))
        .await;
    bad.sha256 = Some("0".repeat(64));
    write_status(
        &ns,
        "bad-sha",
        RequestPhase::Succeeded,
        vec![
            node("node-a", NodePhase::Succeeded, None, vec![good]),
            node("node-b", NodePhase::Succeeded, None, vec![bad]),
        ],
    )
    .await;
    let out = tempfile::tempdir().unwrap();
    let r = cli(
        &kc,
        ns.name(),
        &[
            "get",
            "bad-sha",
            "-o",
            out.path().to_str().unwrap(),
            "--format",
            "svg",
        ],
    )
    .await;
    assert_eq!(r.code, 7, "{r:?}");
    assert!(
        r.stderr
            .contains("checksum mismatch for artifact cpu-node-b.pb.gz"),
        "{}",
        r.stderr
    );
    assert_eq!(
        files(out.path()),
        Vec::<String>::new(),
        "nothing may be written"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failed_pending_unreachable_and_missing_requests() {
    let ns = namespace("cli-err").await;
    let kc = support::admin_kubeconfig(&ns);
    let out = tempfile::tempdir().unwrap();
    let dir = out.path().to_str().unwrap();

    let r = cli(&kc, ns.name(), &["get", "nope", "-o", dir]).await;
    assert_eq!(r.code, 3, "{r:?}");
    assert!(r.stderr.contains("\"nope\" not found"), "{}", r.stderr);

    create_request(&ns, "pending").await;
    let r = cli(&kc, ns.name(), &["get", "pending", "-o", dir]).await;
    assert_eq!(r.code, 5, "{r:?}");
    assert!(r.stderr.contains("no artifacts yet"), "{}", r.stderr);

    create_request(&ns, "failed").await;
    write_status(
        &ns,
        "failed",
        RequestPhase::Failed,
        vec![
            node(
                "node-a",
                NodePhase::Failed,
                Some("no agent on node node-a"),
                vec![],
            ),
            node(
                "node-b",
                NodePhase::Failed,
                Some("timed out after 70s"),
                vec![],
            ),
        ],
    )
    .await;
    let r = cli(&kc, ns.name(), &["get", "failed", "-o", dir]).await;
    assert_eq!(r.code, 4, "{r:?}");
    assert!(
        r.stderr.contains("node-a: Failed: no agent on node node-a")
            && r.stderr.contains("node-b: Failed: timed out after 70s"),
        "{}",
        r.stderr
    );

    // A store that is not there: the operator signs URLs of a closed port.
    let _store = Store::unreachable_for(&ns).await;
    create_request(&ns, "gone").await;
    let artifact = flamefleet_api::Artifact {
        name: "cpu-node-a.pb.gz".into(),
        url: None,
        size_bytes: Some(10),
        sha256: Some("0".repeat(64)),
        samples: None,
        sample_type: None,
    };
    write_status(
        &ns,
        "gone",
        RequestPhase::Succeeded,
        vec![node("node-a", NodePhase::Succeeded, None, vec![artifact])],
    )
    .await;
    let r = cli(&kc, ns.name(), &["get", "gone", "-o", dir]).await;
    assert_eq!(r.code, 6, "{r:?}");
    assert!(
        r.stderr
            .contains("cannot download artifact cpu-node-a.pb.gz")
            && !r.stderr.contains("sig="),
        "{}",
        r.stderr
    );
    assert_eq!(files(out.path()), Vec::<String>::new());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forbidden_user_gets_exit_8() {
    let ns = namespace("cli-rbac").await;
    create_request(&ns, "secret").await;
    let kc = ns
        .control_plane()
        .kubeconfig_for_user(&ns.unique("nobody"), &[])
        .unwrap();
    for args in [
        &["get", "secret"][..],
        &["list"][..],
        &["delete", "secret"][..],
    ] {
        let r = cli(&kc, ns.name(), args).await;
        assert_eq!(r.code, 8, "{args:?}: {r:?}");
        assert!(r.stderr.contains("forbidden"), "{}", r.stderr);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn runqlat_prints_the_histogram_and_top_buckets() {
    let ns = namespace("cli-rq").await;
    let kc = support::admin_kubeconfig(&ns);
    let store = Store::start_for(&ns).await;
    let req = support::create_typed_request(&ns, "rq", "runqlat", serde_json::json!({})).await;
    let histogram = "     usecs               : count    distribution\n         0 -> 1          : 12       |****************************************|\n         2 -> 3          : 3        |**********                              |\n";
    let txt = store
        .upload(&req, "runqlat-node-a.txt", histogram.as_bytes())
        .await;
    let pb = store
        .upload(
            &req,
            "runqlat-node-a.pb.gz",
            &pprof(
                ("count", "count"),
                &[(&["0-1us", "web-0"], 12), (&["2-3us", "web-0"], 3)],
            ),
        )
        .await;
    write_status(
        &ns,
        "rq",
        RequestPhase::Succeeded,
        vec![node("node-a", NodePhase::Succeeded, None, vec![pb, txt])],
    )
    .await;
    let out = tempfile::tempdir().unwrap();
    let r = cli(
        &kc,
        ns.name(),
        &[
            "get",
            "rq",
            "-o",
            out.path().to_str().unwrap(),
            "--format",
            "text",
        ],
    )
    .await;
    assert_eq!(r.code, 0, "{r:?}");
    assert!(r.stdout.contains(histogram), "{}", r.stdout);
    assert!(r.stdout.contains("Type: count"), "{}", r.stdout);
    assert_eq!(files(out.path()), ["rq-node-a.pb.gz", "rq-node-a.txt"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn get_downloads_a_subset_of_nodes_and_says_when_slices_are_missing() {
    let ns = namespace("cli-subset").await;
    let kc = support::admin_kubeconfig(&ns);
    let store = Store::start_for(&ns).await;
    let req = create_request(&ns, "wide").await;
    let mut nodes = Vec::new();
    for n in ["node-a", "node-b", "node-c"] {
        let artifact = store
            .upload(
                &req,
                &format!("cpu-{n}.pb.gz"),
                &cpu_profile("crc32_hot_loop"),
            )
            .await;
        nodes.push(node(n, NodePhase::Succeeded, None, vec![artifact]));
    }
    write_status(&ns, "wide", RequestPhase::Succeeded, nodes).await;

    // --node, repeatable and comma-separated: only those nodes' files.
    let out = tempfile::tempdir().unwrap();
    let dir = out.path().to_str().unwrap();
    let r = cli(
        &kc,
        ns.name(),
        &["get", "wide", "-o", dir, "--node", "node-c,node-a"],
    )
    .await;
    assert_eq!(r.code, 0, "{r:?}");
    assert_eq!(
        files(out.path()),
        ["wide-node-a.pb.gz", "wide-node-c.pb.gz"]
    );

    // --limit: the first nodes in name order.
    let out = tempfile::tempdir().unwrap();
    let dir = out.path().to_str().unwrap();
    let r = cli(&kc, ns.name(), &["get", "wide", "-o", dir, "--limit", "1"]).await;
    assert_eq!(r.code, 0, "{r:?}");
    assert_eq!(files(out.path()), ["wide-node-a.pb.gz"]);

    // A node the request never ran on: a usage error naming it.
    let r = cli(
        &kc,
        ns.name(),
        &["get", "wide", "-o", dir, "--node", "nope"],
    )
    .await;
    assert_eq!(r.code, 2, "{r:?}");
    assert!(r.stderr.contains("has no node nope"), "{}", r.stderr);

    // The status announces two slices but only one exists: say so, download nothing.
    let api: kube::Api<flamefleet_api::ProfileRequest> = ns.api();
    api.patch_status(
        "wide",
        &kube::api::PatchParams::default(),
        &kube::api::Patch::Merge(serde_json::json!({"status": {"resultSlices": 2}})),
    )
    .await
    .unwrap();
    let out = tempfile::tempdir().unwrap();
    let dir = out.path().to_str().unwrap();
    let r = cli(&kc, ns.name(), &["get", "wide", "-o", dir]).await;
    assert_eq!(r.code, 5, "{r:?}");
    assert!(
        r.stderr.contains("1 of its 2 result slices are missing")
            && r.stderr
                .contains("kubectl get prslice -l flamefleet.dev/request-uid="),
        "{}",
        r.stderr
    );
    assert_eq!(files(out.path()), Vec::<String>::new());
}

/// A frame without a symbol is named by its module and its offset in the file, as `go tool
/// pprof` names it by module (`[libc.so.6]`), in the flame graph, the top list and the
/// folded stacks alike, never by the process's virtual address.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unsymbolized_frames_are_named_by_module_and_offset() {
    let ns = namespace("cli-unsym").await;
    let kc = support::admin_kubeconfig(&ns);
    let store = Store::start_for(&ns).await;
    let req = create_request(&ns, "stripped").await;
    let a = store
        .upload(&req, "cpu-node-a.pb.gz", &support::unsymbolized_profile())
        .await;
    write_status(
        &ns,
        "stripped",
        RequestPhase::Succeeded,
        vec![node("node-a", NodePhase::Succeeded, None, vec![a])],
    )
    .await;
    let out = tempfile::tempdir().unwrap();
    let dir = out.path().to_str().unwrap();
    let frame = "[libc.so.6+0xd11f5]";
    for format in ["svg", "folded", "text"] {
        let r = cli(
            &kc,
            ns.name(),
            &["get", "stripped", "-o", dir, "--format", format],
        )
        .await;
        assert_eq!(r.code, 0, "{r:?}");
        assert!(!r.stdout.contains("0x7fed097a91f5"), "{}", r.stdout);
        if format == "text" {
            let first = r
                .stdout
                .lines()
                .skip_while(|l| !l.trim_start().starts_with("flat"))
                .nth(1)
                .unwrap_or_default();
            assert!(first.ends_with(frame), "{}", r.stdout);
        }
    }
    let folded = std::fs::read_to_string(out.path().join("stripped-node-a.folded")).unwrap();
    assert!(folded.contains(&format!("main;{frame} 90\n")), "{folded}");
    let svg = std::fs::read_to_string(out.path().join("stripped-node-a.svg")).unwrap();
    let options = roxmltree::ParsingOptions {
        allow_dtd: true,
        ..Default::default()
    };
    let doc = roxmltree::Document::parse_with_options(&svg, options).unwrap();
    assert!(
        doc.descendants()
            .filter(|n| n.tag_name().name() == "title")
            .filter_map(|n| n.text())
            .any(|t| t.starts_with(frame)),
        "no frame titled {frame}"
    );
    assert!(!svg.contains("0x7fed097a91f5"));
}
