//! The files `kubectl profile` writes: named after the request and the node, never silently
//! replacing a file that holds something else (`--force` does), mode 0644; and the totals
//! `merge` reports are the profiles' own.

mod support;

use std::os::unix::fs::PermissionsExt;

use flamefleet_api::{NodePhase, RequestPhase};
use support::{
    Store, cli, cpu_profile, create_request, files, namespace, node, pprof, write_status,
};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_requests_on_one_node_write_two_files_and_nothing_is_overwritten_silently() {
    let ns = namespace("cli-files").await;
    let kc = support::admin_kubeconfig(&ns);
    let store = Store::start_for(&ns).await;
    for (name, hot) in [("cpu-first", "first_fn"), ("cpu-second", "second_fn")] {
        let req = create_request(&ns, name).await;
        let a = store
            .upload(&req, "cpu-node-a.pb.gz", &cpu_profile(hot))
            .await;
        write_status(
            &ns,
            name,
            RequestPhase::Succeeded,
            vec![node("node-a", NodePhase::Succeeded, None, vec![a])],
        )
        .await;
    }
    let out = tempfile::tempdir().unwrap();
    let dir = out.path().to_str().unwrap();
    for name in ["cpu-first", "cpu-second"] {
        let r = cli(&kc, ns.name(), &["get", name, "-o", dir]).await;
        assert_eq!(r.code, 0, "{r:?}");
    }
    assert_eq!(
        files(out.path()),
        ["cpu-first-node-a.pb.gz", "cpu-second-node-a.pb.gz"]
    );
    assert_eq!(
        std::fs::read(out.path().join("cpu-first-node-a.pb.gz")).unwrap(),
        cpu_profile("first_fn")
    );
    for f in files(out.path()) {
        let mode = std::fs::metadata(out.path().join(&f))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o644, "{f}");
    }

    // Again, with a flame graph: the pprof is already there with the same bytes.
    let r = cli(
        &kc,
        ns.name(),
        &["get", "cpu-first", "-o", dir, "--format", "svg"],
    )
    .await;
    assert_eq!(r.code, 0, "{r:?}");
    assert!(r.stdout.contains("unchanged ") && r.stdout.contains("cpu-first-node-a.svg"));

    // A file of that name holding something else: refused, nothing written.
    let svg = out.path().join("cpu-second-node-a.svg");
    std::fs::write(&svg, "my notes").unwrap();
    let r = cli(
        &kc,
        ns.name(),
        &["get", "cpu-second", "-o", dir, "--format", "svg"],
    )
    .await;
    assert_eq!(r.code, 12, "{r:?}");
    assert!(
        r.stderr
            .contains("cpu-second-node-a.svg exists and holds something else")
            && r.stderr.contains("--force"),
        "{}",
        r.stderr
    );
    assert_eq!(std::fs::read_to_string(&svg).unwrap(), "my notes");
    let r = cli(
        &kc,
        ns.name(),
        &["get", "cpu-second", "-o", dir, "--format", "svg", "--force"],
    )
    .await;
    assert_eq!(r.code, 0, "{r:?}");
    assert!(std::fs::read_to_string(&svg).unwrap().contains("second_fn"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn merge_reports_the_profiles_true_totals_and_keeps_other_files() {
    let ns = namespace("cli-totals").await;
    let kc = support::admin_kubeconfig(&ns);
    let dir = tempfile::tempdir().unwrap();
    // Two CPU profiles of 95 and 92 samples in a handful of stacks each.
    let a = dir.path().join("a.pb.gz");
    let b = dir.path().join("b.pb.gz");
    std::fs::write(
        &a,
        pprof(
            ("samples", "count"),
            &[(&["hot", "main"], 80), (&["cold", "main"], 15)],
        ),
    )
    .unwrap();
    std::fs::write(
        &b,
        pprof(
            ("samples", "count"),
            &[
                (&["hot", "main"], 70),
                (&["cold", "main"], 20),
                (&["main"], 2),
            ],
        ),
    )
    .unwrap();
    let merged = dir.path().join("merged.pb.gz");
    let args = [
        "merge",
        a.to_str().unwrap(),
        b.to_str().unwrap(),
        "-o",
        merged.to_str().unwrap(),
    ];
    let r = cli(&kc, ns.name(), &args).await;
    assert_eq!(r.code, 0, "{r:?}");
    assert!(
        r.stdout.contains("merged 2 profiles (187 samples)"),
        "{}",
        r.stdout
    );
    // `go tool pprof` counts the same.
    let top = std::process::Command::new("go")
        .args(["tool", "pprof", "-top", "-sample_index=samples"])
        .arg(&merged)
        .output()
        .expect("`go` must be installed (scripts/setup.sh)");
    let top = String::from_utf8_lossy(&top.stdout);
    assert!(top.contains("187 total"), "{top}");

    // A different merge into the same file: refused without --force.
    let args_b = ["merge", a.to_str().unwrap(), "-o", merged.to_str().unwrap()];
    let r = cli(&kc, ns.name(), &args_b).await;
    assert_eq!(r.code, 12, "{r:?}");
    let mut forced = args_b.to_vec();
    forced.push("--force");
    let r = cli(&kc, ns.name(), &forced).await;
    assert_eq!(r.code, 0, "{r:?}");
    assert!(
        r.stdout.contains("merged 1 profiles (95 samples)"),
        "{}",
        r.stdout
    );
}
