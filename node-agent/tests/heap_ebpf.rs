//! eBPF heap sampling on real processes in real cgroups (needs root).
//!
//! The workload keeps a known live set from two call sites in a 3:1 ratio,
//! churns much more on top, and starts a new process image during the
//! capture; a noise process doing the same in another cgroup must not appear.

mod support;

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use flamefleet_agent::capture::TargetLabels;
use flamefleet_agent::capture::heap::ebpf::EbpfHeapOptions;
use flamefleet_agent::capture::heap::endpoint::FetchLimits;
use flamefleet_agent::capture::heap::{self, HeapRequest, HeapSource, HeapSourceUsed, HeapTarget};
use flamefleet_proto::pprof::Sample;
use support::{Decoded, TestCgroup, compile_c, pprof_top, require_root, serial};

/// Waits until the workload's report file has a line starting with `prefix`;
/// returns the rest of that line.
fn wait_report(dir: &Path, prefix: &str) -> String {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let text = std::fs::read_to_string(dir.join("report")).unwrap_or_default();
        if let Some(rest) = text.lines().find_map(|l| l.strip_prefix(prefix)) {
            return rest.trim().to_owned();
        }
        assert!(
            Instant::now() < deadline,
            "workload never reported {prefix:?}; report: {text:?}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Session uprobes exist from Linux 6.13 on.
fn session_uprobes_expected() -> bool {
    let release = std::fs::read_to_string("/proc/sys/kernel/osrelease").expect("kernel release");
    let mut parts = release
        .split(|c: char| !c.is_ascii_digit())
        .filter_map(|p| p.parse::<u32>().ok());
    (parts.next().unwrap_or(0), parts.next().unwrap_or(0)) >= (6, 13)
}

fn stack_has(d: &Decoded, s: &Sample, name: &str) -> bool {
    s.location_id
        .iter()
        .any(|&id| d.functions(id).contains(&name))
}

#[test]
fn inuse_space_and_call_sites_match_the_truth() {
    check_inuse_and_call_sites(false, true);
}

/// The same with classic entry + return probes (kernels without session uprobes).
#[test]
fn inuse_space_and_call_sites_match_the_truth_with_classic_uprobes() {
    check_inuse_and_call_sites(true, true);
}

/// The same with the kernel's frame-pointer walk instead of CFI tables (the workload keeps
/// frame pointers): its stacks are stored the same way, by a hash of their frames.
#[test]
fn inuse_space_and_call_sites_match_the_truth_with_frame_pointer_stacks() {
    check_inuse_and_call_sites(false, false);
}

fn check_inuse_and_call_sites(force_classic_uprobes: bool, cfi_unwind: bool) {
    require_root();
    let _serial = serial();
    let dir = tempfile::tempdir().unwrap();
    let bin = compile_c(
        dir.path(),
        "heap_live",
        include_str!("heap_workloads/heap_live.c"),
    );
    let (target_dir, noise_dir) = (dir.path().join("target"), dir.path().join("noise"));
    std::fs::create_dir(&target_dir).unwrap();
    std::fs::create_dir(&noise_dir).unwrap();
    let mut target_cg = TestCgroup::new("heap-target");
    let mut noise_cg = TestCgroup::new("heap-noise");
    target_cg.spawn(Command::new(&bin).arg(&target_dir));
    noise_cg.spawn(Command::new(&bin).arg(&noise_dir));

    let sample_bytes = 128 * 1024;
    let (ready, attached) = std::sync::mpsc::sync_channel(1);
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
            force_classic_uprobes,
            cfi_unwind,
            ready: Some(ready),
            ..Default::default()
        },
        fetch: FetchLimits::default(),
        delta_seconds: 0,
    };
    let capture = std::thread::spawn(move || {
        heap::capture(
            &flamefleet_agent::capture::Samplers::new(
                flamefleet_agent::capture::SamplerConfig::default(),
            ),
            &request,
        )
    });
    // Let the workloads allocate once the probes are attached.
    if attached.recv_timeout(Duration::from_secs(60)).is_err() {
        panic!(
            "the heap capture never attached its probes: {:?}",
            capture.join().map(|r| r.err())
        );
    }
    std::fs::write(target_dir.join("go"), b"").unwrap();
    std::fs::write(noise_dir.join("go"), b"").unwrap();
    let parent_pid: i64 = wait_report(&target_dir, "ready ").parse().unwrap();
    let child_pid: i64 = wait_report(&target_dir, "child-ready ").parse().unwrap();
    let noise_pid: i64 = wait_report(&noise_dir, "ready ").parse().unwrap();
    let truth = |site: &str| -> f64 {
        wait_report(&target_dir, &format!("live {site} "))
            .parse()
            .unwrap()
    };

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
        stats.session_uprobes,
        !force_classic_uprobes && session_uprobes_expected()
    );
    assert_eq!(
        stats.dropped_live_full + stats.dropped_rows_full,
        0,
        "{stats:?}"
    );
    let d = Decoded {
        profile: result.profile.clone(),
    };
    let p = &d.profile;
    let s = |i: i64| d.string(i);
    let sample_index = |name: &str| {
        p.sample_type
            .iter()
            .position(|vt| s(vt.r#type) == name)
            .expect("sample type")
    };

    // Go's heap layout, with inuse_space the default and the sampling period.
    let names: Vec<_> = p
        .sample_type
        .iter()
        .map(|vt| format!("{}/{}", s(vt.r#type), s(vt.unit)))
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
    assert_eq!(s(p.default_sample_type), "inuse_space");
    assert_eq!(p.period, sample_bytes as i64);
    let inuse = sample_index("inuse_space");
    let alloc = sample_index("alloc_space");

    let (mut a, mut b, mut c, mut churn_inuse, mut churn_alloc, mut parent_total) =
        (0f64, 0f64, 0f64, 0f64, 0f64, 0f64);
    for sample in &p.sample {
        let pid = d.num_label(sample, "pid").expect("pid label");
        assert_ne!(pid, noise_pid, "the noise process must never appear");
        assert_eq!(d.label(sample, "pod"), Some("live-set"));
        assert_eq!(d.label(sample, "node"), Some("test-node"));
        let v = sample.value[inuse] as f64;
        let has = |name: &str| stack_has(&d, sample, name);
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
    let (truth_a, truth_b, truth_c) = (truth("site_a"), truth("site_b"), truth("site_c"));
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

    let file = dir.path().join("heap.pb.gz");
    flamefleet_agent::cli::write_profile(&file, p).unwrap();
    let top = pprof_top(&file, &["-sample_index=inuse_space"]);
    assert!(top.contains("site_a") && top.contains("site_b"), "{top}");
    target_cg.kill_all();
    noise_cg.kill_all();
}

/// A process calling malloc/free in a tight loop: the first window projects
/// an overhead far above the limit, so the capture is refused with the
/// figure; forced, it runs.
#[test]
fn allocation_storm_is_refused_with_its_projected_overhead_unless_forced() {
    require_root();
    let _serial = serial();
    let dir = tempfile::tempdir().unwrap();
    let bin = compile_c(
        dir.path(),
        "malloc_storm",
        "#include <stdio.h>\n#include <stdlib.h>\n\
         void *volatile sink;\n\
         int main(void) { puts(\"ready\"); fflush(stdout);\n\
           for (;;) { sink = malloc(64); free(sink); } }\n",
    );
    let mut cg = TestCgroup::new("heap-storm");
    let (_pid, stdout) = cg.spawn_piped(&mut Command::new(&bin));
    let mut line = String::new();
    std::io::BufRead::read_line(&mut std::io::BufReader::new(stdout), &mut line).unwrap();
    assert_eq!(line.trim(), "ready");
    let request = |force: bool| HeapRequest {
        source: HeapSource::Ebpf,
        targets: vec![HeapTarget {
            labels: TargetLabels::default(),
            cgroup: Some(cg.cgroup.clone()),
            endpoint: None,
        }],
        ebpf: EbpfHeapOptions {
            duration: Duration::from_secs(1),
            force,
            ..Default::default()
        },
        fetch: FetchLimits::default(),
        delta_seconds: 0,
    };
    let err = heap::capture(
        &flamefleet_agent::capture::Samplers::new(
            flamefleet_agent::capture::SamplerConfig::default(),
        ),
        &request(false),
    )
    .expect_err("an allocation storm must be refused");
    let msg = err.to_string();
    eprintln!("{msg}");
    assert!(
        msg.contains("refused") && msg.contains("projected") && msg.contains("maxOverheadPercent"),
        "{msg}"
    );
    let projected: f64 = msg
        .split("projected ")
        .nth(1)
        .and_then(|r| r.split('%').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no projected figure in {msg}"));
    assert!(projected > 3.0, "{msg}");
    let forced = heap::capture(
        &flamefleet_agent::capture::Samplers::new(
            flamefleet_agent::capture::SamplerConfig::default(),
        ),
        &request(true),
    )
    .expect("a forced capture runs");
    eprintln!("{}", forced.text());
    let stats = forced.ebpf_stats.expect("eBPF stats");
    assert!(stats.calls > 1000, "{stats:?}");
    assert!(
        stats.projected_overhead_basis_points.unwrap_or(0) > 300,
        "{stats:?}"
    );
}

/// Where the kernel lacks what eBPF heap sampling needs (Linux 5.10: task-local storage,
/// bpf_loop), a capture fails at once, naming what is missing and the kernel that has it;
/// where it has them, the same capture attaches its probes and ends with a profile. The
/// guest tier (`tests/kernels.rs`) runs this on both kinds of kernel and checks which one
/// it saw.
#[test]
fn ebpf_heap_runs_or_is_refused_with_what_the_kernel_lacks() {
    require_root();
    let _serial = serial();
    let mut cg = TestCgroup::new("heap-refusal");
    cg.spawn(Command::new("sleep").arg("60"));
    let (ready, attached) = std::sync::mpsc::sync_channel(1);
    let request = HeapRequest {
        source: HeapSource::Ebpf,
        targets: vec![HeapTarget {
            labels: TargetLabels::default(),
            cgroup: Some(cg.cgroup.clone()),
            endpoint: None,
        }],
        ebpf: EbpfHeapOptions {
            duration: Duration::from_secs(1),
            node: "test-node".into(),
            ready: Some(ready),
            ..Default::default()
        },
        fetch: FetchLimits::default(),
        delta_seconds: 0,
    };
    let samplers = flamefleet_agent::capture::Samplers::new(
        flamefleet_agent::capture::SamplerConfig::default(),
    );
    let result = heap::capture(&samplers, &request);
    let features = flamefleet_agent::capture::kernel::KernelFeatures::get();
    // What this kernel offers and which mechanism each engine chose (the guest tier reads it).
    println!("{}", features.summary());
    match features.heap_ebpf_refusal() {
        Some(reason) => {
            let err = result.expect_err("a capture on a kernel that lacks what it needs");
            let msg = err.to_string();
            assert!(
                msg.contains(&reason) && msg.contains("which kernel") && msg.contains("Linux 5."),
                "the refusal should name what the kernel lacks and which kernel has it: {msg}"
            );
            println!("heap-ebpf: refused: {msg}");
        }
        None => {
            let profile = result.expect("an eBPF heap capture on a kernel that has what it needs");
            assert!(
                attached.try_recv().is_ok(),
                "the capture never attached its probes"
            );
            assert_eq!(profile.source, HeapSourceUsed::Ebpf);
            println!("heap-ebpf: ran");
        }
    }
}

/// Allocates 64 KiB blocks in a loop, keeping the last 64 live.
const ALLOC_LOOP: &str = r#"
#include <stdlib.h>
#include <string.h>
#include <time.h>
static void *ring[64];
__attribute__((noinline)) void *ff_caps_alloc(size_t n) { void *p = malloc(n); if (p) memset(p, 1, 64); return p; }
int main(void) {
    struct timespec t = {0, 100000};
    for (unsigned i = 0;; i++) { free(ring[i % 64]); ring[i % 64] = ff_caps_alloc(65536); nanosleep(&t, 0); }
}
"#;

/// eBPF heap sampling by the agent with only the chart's capabilities (no CAP_SYS_ADMIN).
/// Where the kernel has `uprobe_multi` links (6.6+) they need only CAP_BPF and
/// CAP_PERFMON: the capture runs and its profile names the allocating function. Where it
/// has not (6.1), the uprobes are perf-event uprobes, which kernels carrying the fix of
/// CVE-2025-38466 open only to CAP_SYS_ADMIN: then the capture is refused up front with a
/// reason naming CAP_SYS_ADMIN, and the same capture with SYS_ADMIN added runs, which
/// proves that capability is the one missing. Where eBPF heap sampling is refused for what
/// the kernel lacks (5.10), the command fails with that reason.
#[test]
fn ebpf_heap_runs_with_only_the_charts_capabilities() {
    require_root();
    let _serial = serial();
    let features = flamefleet_agent::capture::kernel::KernelFeatures::get();
    let dir = tempfile::tempdir().unwrap();
    let bin = compile_c(dir.path(), "ffcapsalloc", ALLOC_LOOP);
    let mut cg = TestCgroup::new("heap-caps");
    cg.spawn(&mut Command::new(&bin));
    let out = dir.path().join("heap.pb.gz");
    let capture = |caps: &[u32]| {
        let _ = std::fs::remove_file(&out);
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_flamefleet-agent"));
        cmd.args([
            "capture",
            "--type",
            "heap",
            "--heap-source",
            "ebpf",
            "--force",
            "--duration",
            "2s",
            "--cgroup",
        ])
        .arg(&cg.cgroup.path)
        .arg("-o")
        .arg(&out);
        support::with_only_capabilities(&mut cmd, caps);
        let output = cmd.output().expect("running flamefleet-agent capture");
        let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
        (output.status.success(), stderr)
    };
    let named_bytes = || {
        let d = Decoded::read(&out);
        let named: i64 = d
            .profile
            .sample
            .iter()
            .filter(|s| {
                s.location_id
                    .iter()
                    .any(|&l| d.functions(l).contains(&"ff_caps_alloc"))
            })
            .map(|s| s.value.iter().copied().max().unwrap_or(0))
            .sum();
        (named, d.profile.sample.len())
    };
    let caps = support::chart_capabilities();
    let (ok, stderr) = capture(&caps);
    if let Some(reason) = features.heap_ebpf_refusal() {
        assert!(
            !ok && stderr.contains(&reason),
            "expected the refusal ({reason}): {stderr}"
        );
        println!("heap-ebpf caps: refused with the reason, as it should");
        return;
    }
    if ok {
        let (named, samples) = named_bytes();
        assert!(
            named > 0,
            "no sample under ff_caps_alloc in {samples} samples: {stderr}"
        );
        println!(
            "heap-ebpf caps: ran with the chart's capabilities {caps:?} via {}",
            features.heap_probes()
        );
        return;
    }
    // Refused with the chart's capabilities: only where perf-event uprobes are the
    // mechanism, and for CAP_SYS_ADMIN, said up front rather than as a failed attach.
    assert!(
        !features.uprobe_multi.found,
        "a heap capture with the chart's capabilities {caps:?} failed on a kernel with uprobe_multi links ({}): {stderr}",
        features.heap_probes()
    );
    assert!(
        stderr.contains("perf-event uprobes")
            && stderr.contains("only to CAP_SYS_ADMIN")
            && stderr.contains(&features.release)
            && stderr.contains("Linux 6.6"),
        "the refusal should name the mechanism, the kernel, CAP_SYS_ADMIN and the kernel that needs none: {stderr}"
    );
    const CAP_SYS_ADMIN: u32 = 21;
    let with_sys_admin: Vec<u32> = caps.iter().copied().chain([CAP_SYS_ADMIN]).collect();
    let (ok, stderr_admin) = capture(&with_sys_admin);
    assert!(
        ok,
        "refused for CAP_SYS_ADMIN ({stderr}), but with SYS_ADMIN added it still fails: {stderr_admin}"
    );
    let (named, samples) = named_bytes();
    assert!(
        named > 0,
        "no sample under ff_caps_alloc in {samples} samples with SYS_ADMIN added: {stderr_admin}"
    );
    println!(
        "heap-ebpf caps: needs SYS_ADMIN here (perf-event uprobes), refused without it with the reason; ran with it"
    );
}
