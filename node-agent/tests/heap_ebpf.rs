//! eBPF heap sampling on real processes in real cgroups (needs root).
//!
//! The workload keeps a known live set from two call sites in a 3:1 ratio,
//! churns much more on top, and starts a new process image during the
//! capture; a noise process doing the same in another cgroup must not appear.

mod heap_support;

use std::process::{Command, Stdio};
use std::sync::Mutex;
use std::time::Duration;

use flamefleet_agent::capture::TargetLabels;
use flamefleet_agent::capture::heap::ebpf::EbpfHeapOptions;
use flamefleet_agent::capture::heap::endpoint::FetchLimits;
use flamefleet_agent::capture::heap::{self, HeapRequest, HeapSource, HeapSourceUsed, HeapTarget};
use heap_support::*;

/// Captures in this binary share 2 CPUs and the allocator probes: one at a time.
static SERIAL: Mutex<()> = Mutex::new(());

fn live_bytes(lines: &[String], site: &str) -> f64 {
    lines
        .iter()
        .find_map(|l| l.strip_prefix(&format!("live {site} ")))
        .and_then(|v| v.trim().parse::<f64>().ok())
        .unwrap_or_else(|| panic!("workload did not report {site}: {lines:?}"))
}

#[test]
fn inuse_space_and_call_sites_match_the_truth() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    require_root();
    let dir = tempfile::tempdir().unwrap();
    let bin = compile_c(&workload("heap_live.c"), dir.path());
    let target_cg = TestCgroup::new("target");
    let noise_cg = TestCgroup::new("noise");
    let start = |cg: &TestCgroup| {
        cg.spawn(
            Command::new(&bin)
                .stdin(Stdio::piped())
                .stdout(Stdio::piped())
                .stderr(Stdio::inherit()),
        )
    };
    let mut target = start(&target_cg);
    let mut noise = start(&noise_cg);
    let target_out = Lines::new(target.stdout.take().unwrap());
    let noise_out = Lines::new(noise.stdout.take().unwrap());

    let sample_bytes = 128 * 1024;
    let request = HeapRequest {
        source: HeapSource::Auto,
        targets: vec![HeapTarget {
            labels: TargetLabels {
                namespace: "heap-test".into(),
                pod: "live-set".into(),
                container: "c".into(),
            },
            cgroup: Some(target_cg.cgroup.clone()),
            endpoint: None,
        }],
        ebpf: EbpfHeapOptions {
            duration: Duration::from_secs(8),
            sample_bytes,
            node: "test-node".into(),
            ..Default::default()
        },
        fetch: FetchLimits::default(),
        delta_seconds: 0,
    };
    let capture = std::thread::spawn(move || heap::capture(&request));
    // Probes attach when the capture starts; give it a moment, then let the
    // workloads allocate.
    std::thread::sleep(Duration::from_millis(1500));
    say(&mut target, "go");
    say(&mut noise, "go");
    let mut seen = Vec::new();
    let ready = target_out.wait_for("ready ", Duration::from_secs(20), &mut seen);
    let child_ready = target_out.wait_for("child-ready ", Duration::from_secs(20), &mut seen);
    let mut noise_seen = Vec::new();
    let noise_ready = noise_out.wait_for("ready ", Duration::from_secs(20), &mut noise_seen);
    let parent_pid: i64 = ready[6..].trim().parse().unwrap();
    let child_pid: i64 = child_ready[12..].trim().parse().unwrap();
    let noise_pid: i64 = noise_ready[6..].trim().parse().unwrap();

    let result = capture.join().unwrap().expect("heap capture");
    assert_eq!(result.source, HeapSourceUsed::Ebpf, "{}", result.reason);
    assert!(
        result.reason.contains("no pprof endpoint"),
        "{}",
        result.reason
    );
    let stats = result.ebpf_stats.clone().unwrap();
    eprintln!("stats: {stats:?}");
    assert!(
        stats.allocators.iter().any(|a| a.contains("libc")),
        "{stats:?}"
    );
    assert_eq!(
        stats.dropped_live_full + stats.dropped_rows_full,
        0,
        "{stats:?}"
    );
    let p = &result.profile;

    // Go's heap layout, with inuse_space the default and the sampling period.
    let names: Vec<_> = p
        .sample_type
        .iter()
        .map(|vt| format!("{}/{}", s(p, vt.r#type), s(p, vt.unit)))
        .collect();
    assert_eq!(
        names,
        [
            "alloc_objects/count",
            "alloc_space/bytes",
            "inuse_objects/count",
            "inuse_space/bytes"
        ]
    );
    assert_eq!(s(p, p.default_sample_type), "inuse_space");
    assert_eq!(p.period, sample_bytes as i64);
    let inuse = sample_index(p, "inuse_space");
    let alloc = sample_index(p, "alloc_space");

    let (mut a, mut b, mut c, mut churn_inuse, mut churn_alloc, mut parent_total) =
        (0f64, 0f64, 0f64, 0f64, 0f64, 0f64);
    for sample in &p.sample {
        let pid = num_label(p, sample, "pid").expect("pid label");
        assert_ne!(pid, noise_pid, "the noise process must never appear");
        assert_eq!(str_label(p, sample, "pod"), Some("live-set"));
        assert_eq!(str_label(p, sample, "node"), Some("test-node"));
        let fns = stack_functions(p, sample);
        let v = sample.value[inuse] as f64;
        let has = |name: &str| fns.iter().any(|f| f == name);
        if pid == parent_pid {
            parent_total += v;
            if has("site_a") {
                a += v;
            } else if has("site_b") {
                b += v;
            } else if has("churn_site") {
                churn_inuse += v;
                churn_alloc += sample.value[alloc] as f64;
            }
        } else if pid == child_pid && has("site_c") {
            c += v;
        }
    }
    let truth_a = live_bytes(&seen, "site_a");
    let truth_b = live_bytes(&seen, "site_b");
    let truth_c = live_bytes(&seen, "site_c");
    let truth = truth_a + truth_b;
    eprintln!(
        "inuse: parent {parent_total:.0} (truth {truth:.0}), site_a {a:.0} (truth {truth_a:.0}), \
         site_b {b:.0} (truth {truth_b:.0}), child site_c {c:.0} (truth {truth_c:.0}), churn \
         inuse {churn_inuse:.0} alloc {churn_alloc:.0}"
    );
    let err = parent_total / truth - 1.0;
    assert!(
        err.abs() <= 0.15,
        "inuse_space off by {:.1}% (limit 15%)",
        err * 100.0
    );
    let share_a = a / (a + b) * 100.0;
    let truth_share = truth_a / truth * 100.0;
    assert!(
        (share_a - truth_share).abs() <= 5.0,
        "site_a share {share_a:.1}% vs truth {truth_share:.1}% (limit ±5 points)"
    );
    // The churn allocated a lot and freed it all: seen allocating, not in use.
    assert!(
        churn_alloc > 100.0 * 1024.0 * 1024.0,
        "churn alloc_space {churn_alloc:.0}"
    );
    assert!(
        churn_inuse < 0.02 * truth,
        "freed churn still in use: {churn_inuse:.0}"
    );
    // The child started during the capture, from a new image: covered too.
    assert!(
        (c / truth_c - 1.0).abs() <= 0.3,
        "child process started during the capture: site_c {c:.0} vs truth {truth_c:.0}"
    );

    let top = pprof_top(p, &["-sample_index=inuse_space"]);
    assert!(top.contains("site_a") && top.contains("site_b"), "{top}");
    drop(target);
    drop(noise);
}
