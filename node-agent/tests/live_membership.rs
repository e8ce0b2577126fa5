//! Cgroup membership is live: a capture of a pod cgroup sees containers that
//! start, or restart, after the capture began (the kernel matches each task on
//! its cgroup's ancestry, bpf/targets.bpf.h), for every profile type; and a
//! capture of a pod keeps seeing a container that another, shorter capture
//! targeted on its own (nested targets).

mod support;

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use flamefleet_agent::capture::TargetLabels;
use flamefleet_agent::capture::cpu::{CpuOptions, CpuSamples};
use flamefleet_agent::capture::heap::ebpf::EbpfHeapOptions;
use flamefleet_agent::capture::heap::endpoint::FetchLimits;
use flamefleet_agent::capture::heap::{self, HeapRequest, HeapSource, HeapTarget};
use flamefleet_agent::capture::runqlat::RunqlatOptions;
use flamefleet_agent::capture::{CaptureTarget, SamplerConfig, Samplers};
use flamefleet_agent::cgroup::Cgroup;
use support::{Decoded, TestCgroup, compile_c, require_root, serial};

const SPIN: &str = "static volatile unsigned long s; int main(void) { for (;;) s++; }";

const SLEEPER: &str = r#"
#include <time.h>
int main(void) {
    struct timespec ms = {0, 1000000};
    for (;;) nanosleep(&ms, 0);
}
"#;

/// Keeps 16 MiB live in 64 KiB blocks from `late_site`, then says so on
/// stdout-less report file (argv[1]) and sleeps.
const ALLOCATOR: &str = r#"
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
__attribute__((noinline)) void *late_site(size_t n) { void *p = malloc(n); if (p) memset(p, 1, n); return p; }
int main(int argc, char **argv) {
    static void *keep[256];
    for (;;) {
        for (int i = 0; i < 256; i++) { free(keep[i]); keep[i] = late_site(65536); }
        FILE *f = fopen(argv[1], "w");
        if (f) { fputs("round\n", f); fclose(f); }
        usleep(100000);
    }
}
"#;

/// A child cgroup `name` of `parent`, created now.
fn child(parent: &TestCgroup, name: &str) -> TestCgroup {
    let dir = parent.path().join(name);
    std::fs::create_dir(&dir).unwrap_or_else(|e| panic!("mkdir {}: {e}", dir.display()));
    TestCgroup::adopt(Cgroup::open(&dir).expect("open child cgroup"))
}

fn samples_of(r: &CpuSamples, pid: u32) -> u64 {
    r.samples
        .iter()
        .filter(|s| s.tgid == pid)
        .map(|s| s.count)
        .sum()
}

/// CPU time each spinner gets before a check: ~150 samples at 99 Hz, so that
/// the 70% floor below sits ~3.7 standard deviations under the count expected
/// (at 0.5 s, ~50 samples, it was ~2 and failed once in a loaded run).
const SPIN_CPU: Duration = Duration::from_millis(1500);

/// Asserts that `pid` got at least 70% of the samples its CPU time `cpu`
/// calls for at 99 Hz (a loaded machine gives a spinner only part of a CPU).
fn assert_sampled(r: &CpuSamples, pid: u32, cpu: Duration, what: &str) {
    let own = samples_of(r, pid);
    let expected = cpu.as_secs_f64() * 99.0;
    assert!(
        expected > 10.0 && own as f64 >= 0.7 * expected,
        "{what}: {own} samples for {:.2} s of CPU (~{expected:.0} expected)",
        cpu.as_secs_f64()
    );
}

fn wait_for_file(path: &Path) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while !path.exists() {
        assert!(
            Instant::now() < deadline,
            "{} never appeared",
            path.display()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn cpu_sees_containers_started_and_restarted_during_the_capture() {
    check_cpu_live(SamplerConfig::default());
}

/// Kernels before 6.2 have no cgroup storage: every lookup walks the ancestry.
#[test]
fn cpu_sees_late_containers_without_the_lookup_cache() {
    check_cpu_live(SamplerConfig {
        no_target_cache: true,
        ..SamplerConfig::default()
    });
}

fn check_cpu_live(config: SamplerConfig) {
    require_root();
    let _serial = serial();
    let dir = tempfile::tempdir().unwrap();
    let spin = compile_c(dir.path(), "fflatespin", SPIN);
    let pod = TestCgroup::new("live-pod");
    let samplers = Samplers::new(config);
    let capture = samplers
        .start_cpu(
            &[CaptureTarget::raw(pod.cgroup.clone())],
            &CpuOptions::default(),
        )
        .expect("start cpu capture");

    // A container (two levels down, as containerd's scope under a pod slice)
    // starts after the capture began.
    let mut first = child(&pod, "app");
    let first_pid = first.spawn(&mut Command::new(&spin));
    first.wait_cpu(SPIN_CPU);
    let first_cpu = first.cpu_usage();
    // It "restarts": the process dies, the cgroup is replaced by a new one
    // (new inode, new cgroup ID) with a new process.
    drop(first);
    let mut second = child(&pod, "app");
    let nested = child(&second, "worker");
    let mut nested = nested;
    let second_pid = nested.spawn(&mut Command::new(&spin));
    nested.wait_cpu(SPIN_CPU);
    let second_cpu = nested.cpu_usage();
    let r = capture.finish().expect("finish");
    assert_sampled(
        &r,
        first_pid,
        first_cpu,
        "container started after the capture",
    );
    assert_sampled(
        &r,
        second_pid,
        second_cpu,
        "restarted container's nested cgroup",
    );
    nested.kill_all();
    drop(nested);
    second.kill_all();
}

#[test]
fn a_pod_capture_keeps_the_container_a_shorter_capture_targeted() {
    require_root();
    let _serial = serial();
    let dir = tempfile::tempdir().unwrap();
    let spin = compile_c(dir.path(), "ffnestspin", SPIN);
    let pod = TestCgroup::new("nest-pod");
    let mut app = child(&pod, "app");
    let mut sidecar = child(&pod, "sidecar");
    let app_pid = app.spawn(&mut Command::new(&spin));
    let side_pid = sidecar.spawn(&mut Command::new(&spin));
    let samplers = Samplers::new(SamplerConfig::default());
    let outer = samplers
        .start_cpu(
            &[CaptureTarget::raw(pod.cgroup.clone())],
            &CpuOptions::default(),
        )
        .expect("pod capture");
    // Measured from when the capture runs (loading the sampler takes a while).
    let app_before = app.cpu_usage();
    app.wait_cpu(Duration::from_millis(200));
    // The container's own capture starts and ends inside the pod's window.
    let inner = samplers
        .start_cpu(
            &[CaptureTarget::raw(app.cgroup.clone())],
            &CpuOptions::default(),
        )
        .expect("container capture");
    let inner_before = app.cpu_usage();
    app.wait_cpu(SPIN_CPU);
    let inner_cpu = app.cpu_usage() - inner_before;
    let inner = inner.finish().expect("finish container capture");
    app.wait_cpu(Duration::from_millis(300));
    let app_cpu = app.cpu_usage() - app_before;
    let outer = outer.finish().expect("finish pod capture");
    assert_sampled(&inner, app_pid, inner_cpu, "the container's own capture");
    assert_eq!(
        samples_of(&inner, side_pid),
        0,
        "the container capture sees only its container"
    );
    assert_sampled(
        &outer,
        app_pid,
        app_cpu,
        "the pod capture, over its whole window, including while the container had its own entry",
    );
    assert!(
        samples_of(&outer, side_pid) > 0,
        "the pod capture sees the sidecar"
    );
    app.kill_all();
    sidecar.kill_all();
}

#[test]
fn runqlat_sees_a_container_started_during_the_capture() {
    require_root();
    let _serial = serial();
    let dir = tempfile::tempdir().unwrap();
    let sleeper = compile_c(dir.path(), "fflatesleeper", SLEEPER);
    let pod = TestCgroup::new("live-rq-pod");
    let samplers = Samplers::new(SamplerConfig::default());
    let capture = samplers
        .start_runqlat(
            &[CaptureTarget::raw(pod.cgroup.clone())],
            &RunqlatOptions {
                per_process: true,
                ..RunqlatOptions::default()
            },
        )
        .expect("start runqlat");
    let mut late = child(&pod, "late");
    let pid = late.spawn(&mut Command::new(&sleeper));
    support::wait_switches(pid, 300);
    let r = capture.finish().expect("finish");
    let waits: u64 = r
        .histograms
        .iter()
        .filter(|h| h.tgid == Some(pid))
        .map(|h| h.count())
        .sum();
    // It was switched in 300 times after it started, each the end of a wait.
    assert!(
        waits >= 250,
        "the late container's sleeper: {waits} waits\n{}",
        r.text()
    );
    late.kill_all();
}

#[test]
fn ebpf_heap_sees_a_container_started_during_the_capture() {
    require_root();
    let _serial = serial();
    let dir = tempfile::tempdir().unwrap();
    let alloc = compile_c(dir.path(), "fflatealloc", ALLOCATOR);
    let pod = TestCgroup::new("live-heap-pod");
    let report = dir.path().join("report");
    let request = HeapRequest {
        source: HeapSource::Ebpf,
        targets: vec![HeapTarget {
            labels: TargetLabels::default(),
            cgroup: Some(pod.cgroup.clone()),
            endpoint: None,
        }],
        ebpf: EbpfHeapOptions {
            duration: Duration::from_secs(4),
            sample_bytes: 64 * 1024,
            ..EbpfHeapOptions::default()
        },
        fetch: FetchLimits::default(),
        delta_seconds: 0,
    };
    let worker = std::thread::spawn(move || {
        heap::capture(
            &flamefleet_agent::capture::Samplers::new(
                flamefleet_agent::capture::SamplerConfig::default(),
            ),
            &request,
        )
    });
    // The pod is empty when the capture starts; its container comes later.
    std::thread::sleep(Duration::from_millis(300));
    let mut late = child(&pod, "late");
    late.spawn(Command::new(&alloc).arg(&report));
    wait_for_file(&report);
    let result = worker.join().expect("heap thread").expect("heap capture");
    let out = dir.path().join("heap.pb.gz");
    flamefleet_agent::cli::write_profile(&out, &result.profile).expect("write");
    let d = Decoded::read(&out);
    let inuse = d
        .profile
        .sample_type
        .iter()
        .position(|t| d.string(t.r#type) == "inuse_space")
        .expect("inuse_space");
    let late_inuse: i64 = d
        .profile
        .sample
        .iter()
        .filter(|s| {
            s.location_id
                .iter()
                .any(|&id| d.functions(id).contains(&"late_site"))
        })
        .map(|s| s.value[inuse])
        .sum();
    assert!(
        late_inuse > 4 << 20,
        "late_site's live blocks (16 MiB) in inuse_space: {late_inuse} bytes\n{}",
        result.text()
    );
    late.kill_all();
}
