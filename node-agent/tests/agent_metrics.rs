//! The agent's `/metrics`: captures by type and outcome, uploads, symbolization time and
//! the samplers' map fill, read from a real `flamefleet-agent serve` after real captures.

mod service_support;

use std::io::{Read as _, Write as _};

use flamefleet_proto::agent::capture_progress::Stage;
use service_support::*;

/// GET `path` from the plain-HTTP probe server at `addr`; the body.
fn get(addr: &str, path: &str) -> String {
    let mut conn = std::net::TcpStream::connect(addr).expect("connecting to the probe server");
    write!(conn, "GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n").expect("request");
    let mut text = String::new();
    conn.read_to_string(&mut text).expect("response");
    let (head, body) = text.split_once("\r\n\r\n").expect("an HTTP response");
    assert!(
        head.starts_with("HTTP/1.0 200") || head.starts_with("HTTP/1.1 200"),
        "{head}"
    );
    body.to_owned()
}

/// The value of the sample line `series` (name and labels exactly), if present.
fn value(metrics: &str, series: &str) -> Option<f64> {
    metrics.lines().find_map(|l| {
        l.strip_prefix(series)
            .and_then(|rest| rest.strip_prefix(' '))
            .and_then(|v| v.trim().parse().ok())
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_count_captures_by_type_and_outcome_and_uploads() {
    require_root();
    let _serial = serial().await;
    let pki = TestPki::new("ca");
    let mut tree = PodTree::new();
    tree.start(burner());
    let upload = UploadServer::start(None).await;
    let agent = AgentProcess::start_with(
        "node-metrics",
        &pki,
        &tree.root,
        None,
        &["--probe-listen", "127.0.0.1:0"],
    );
    let probes = agent.probes.clone().expect("`probes on ADDR` on stdout");
    let mut client = operator_client(&pki, &agent).await;

    let before = get(&probes, "/metrics");
    assert_eq!(
        value(&before, "flamefleet_agent_uploads_total"),
        Some(0.0),
        "{before}"
    );

    let uid = unique("uid-metrics");
    let progress = collect(
        &mut client,
        cpu_request(&uid, "node-metrics", &tree, &upload, 1500),
    )
    .await;
    let last = progress.last().expect("progress");
    assert_eq!(last.stage(), Stage::Done, "{progress:#?}\n{}", agent.log());
    let size = last.artifacts[0].size_bytes as f64;

    // A request the agent refuses (no upload slot) ends FAILED and counts as failed.
    let mut bad = cpu_request(&unique("uid-bad"), "node-metrics", &tree, &upload, 1000);
    bad.uploads.clear();
    let refused = collect(&mut client, bad).await;
    assert_eq!(
        refused.last().map(|p| p.stage()),
        Some(Stage::Failed),
        "{refused:#?}"
    );

    let after = get(&probes, "/metrics");
    let v = |series: &str| value(&after, series);
    assert_eq!(
        v("flamefleet_agent_captures_total{type=\"cpu\",outcome=\"succeeded\"}"),
        Some(1.0),
        "{after}"
    );
    assert_eq!(
        v("flamefleet_agent_captures_total{type=\"cpu\",outcome=\"failed\"}"),
        Some(1.0),
        "{after}"
    );
    assert_eq!(v("flamefleet_agent_uploads_total"), Some(1.0), "{after}");
    assert_eq!(
        v("flamefleet_agent_upload_bytes_total"),
        Some(size),
        "{after}"
    );
    assert_eq!(
        v("flamefleet_agent_symbolize_seconds_count{type=\"cpu\"}"),
        Some(1.0),
        "{after}"
    );
    assert!(
        v("flamefleet_agent_symbolize_seconds_sum{type=\"cpu\"}").is_some_and(|s| s > 0.0),
        "{after}"
    );
    // The 1.5 s capture symbolized its samples once during its window (half-way), so
    // that the symbolization after it found the symbols cached.
    assert_eq!(
        v("flamefleet_agent_window_symbolize_seconds_count{type=\"cpu\"}"),
        Some(1.0),
        "{after}"
    );
    assert_eq!(
        v("flamefleet_agent_dropped_samples_total{type=\"cpu\"}"),
        Some(0.0),
        "{after}"
    );
    // No capture runs now. The CPU sampler stays loaded for its linger period, its maps
    // reported and empty: the finished capture's targets, counts and stacks are gone.
    let fill: Vec<&str> = after
        .lines()
        .filter(|l| l.starts_with("flamefleet_agent_map_entries{"))
        .collect();
    assert!(
        fill.iter().any(|l| l.contains("sampler=\"cpu\"")),
        "the idle CPU sampler is still loaded: {after}"
    );
    assert!(
        fill.iter().all(|l| l.ends_with(" 0")),
        "maps still hold entries: {fill:#?}"
    );
    assert_eq!(v("flamefleet_agent_captures_active"), Some(0.0), "{after}");
}
