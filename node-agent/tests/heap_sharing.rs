//! One eBPF heap sampler per node (needs root): overlapping heap captures of different
//! processes share one program set and one attachment per allocator binary, and each
//! capture sees only its own targets' allocations, made while it ran.
//!
//! Two processes of the same workload (so the same libc) in two cgroups; three captures:
//! A of the first process from the start, B of the second, and C of the first process
//! again, joining after A's first allocations. The workload allocates on command from
//! named functions and answers when done, so every step waits for a signal.

mod support;

use std::io::{BufRead as _, BufReader, Lines, Read as _, Write as _};
use std::net::{SocketAddr, TcpStream};
use std::process::{ChildStdin, ChildStdout, Command, Stdio};
use std::sync::{Arc, mpsc};
use std::thread::JoinHandle;
use std::time::Duration;

use flamefleet_agent::capture::heap::ebpf::sampler;
use flamefleet_agent::capture::heap::ebpf::{self, EbpfHeapOptions, EbpfHeapStats};
use flamefleet_agent::capture::{CaptureTarget, SamplerConfig, Samplers, TargetLabels};
use flamefleet_proto::pprof::Profile;
use support::{Decoded, TestCgroup, compile_c, require_root, serial};

/// A workload process driven over stdin/stdout.
struct Workload {
    stdin: ChildStdin,
    stdout: Lines<BufReader<ChildStdout>>,
}

impl Workload {
    fn start(cg: &mut TestCgroup, bin: &std::path::Path) -> Self {
        let (pid, stdout) = cg.spawn_piped(Command::new(bin).stdin(Stdio::piped()));
        let stdin = cg.take_stdin(pid).expect("piped stdin");
        let mut stdout = BufReader::new(stdout).lines();
        let ready = stdout.next().expect("a ready line").expect("stdout");
        assert!(ready.starts_with("ready "), "{ready}");
        Self { stdin, stdout }
    }

    /// Runs one allocation command and waits until the workload says it is done.
    fn run(&mut self, command: &str) {
        writeln!(self.stdin, "{command}").expect("write command");
        self.stdin.flush().expect("flush");
        let answer = self.stdout.next().expect("an answer").expect("stdout");
        assert_eq!(answer, format!("done {command}"));
    }
}

type Running = JoinHandle<Result<(Profile, EbpfHeapStats), String>>;

/// Starts a capture of `cg` on its own thread and returns once its probes are attached.
fn start_capture(
    node: &Arc<Samplers>,
    cg: &TestCgroup,
    pod: &str,
    duration: Duration,
    sample_bytes: u64,
) -> Running {
    let node = Arc::clone(node);
    let (ready, attached) = mpsc::sync_channel(1);
    let target = CaptureTarget {
        cgroup: cg.cgroup.clone(),
        labels: TargetLabels {
            namespace: "heap-sharing".into(),
            pod: pod.into(),
            container: "c".into(),
        },
    };
    let opts = EbpfHeapOptions {
        duration,
        sample_bytes,
        node: "test-node".into(),
        ready: Some(ready),
        ..Default::default()
    };
    let worker = std::thread::spawn(move || {
        ebpf::capture(&node, std::slice::from_ref(&target), &opts).map_err(|e| e.to_string())
    });
    if attached.recv_timeout(Duration::from_secs(60)).is_err() {
        panic!(
            "capture {pod} never attached its probes: {:?}",
            worker.join().map(|r| r.err())
        );
    }
    worker
}

/// Bytes (alloc_space, inuse_space) of the samples whose stack names `function`.
fn bytes_of(p: &Profile, function: &str) -> (i64, i64) {
    let d = Decoded { profile: p.clone() };
    let index = |name: &str| {
        p.sample_type
            .iter()
            .position(|t| d.string(t.r#type) == name)
            .expect("sample type")
    };
    let (alloc, inuse) = (index("alloc_space"), index("inuse_space"));
    p.sample
        .iter()
        .filter(|s| {
            s.location_id
                .iter()
                .any(|&l| d.functions(l).contains(&function))
        })
        .fold((0, 0), |(a, i), s| (a + s.value[alloc], i + s.value[inuse]))
}

/// The agent's probe server (`/metrics`) on a runtime of its own.
fn probe_server(node: &Arc<Samplers>) -> (tokio::runtime::Runtime, SocketAddr) {
    let rt = tokio::runtime::Runtime::new().expect("tokio runtime");
    let state = flamefleet_agent::service::probes::ProbeState::new("test");
    state.set_metrics(Arc::default(), Arc::clone(node));
    let addr = rt
        .block_on(flamefleet_agent::service::probes::spawn(
            "127.0.0.1:0".parse().expect("address"),
            state,
        ))
        .expect("probe server");
    (rt, addr)
}

/// The value of gauge `name` on `/metrics`.
fn gauge(addr: SocketAddr, name: &str) -> u64 {
    let mut conn = TcpStream::connect(addr).expect("connect to /metrics");
    write!(conn, "GET /metrics HTTP/1.0\r\nHost: test\r\n\r\n").expect("request");
    let mut text = String::new();
    conn.read_to_string(&mut text).expect("response");
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
        .unwrap_or_else(|| panic!("no {name} in /metrics:\n{text}"))
}

fn libc_attachments(node: &Samplers) -> Vec<sampler::AllocatorAttachment> {
    node.heap()
        .expect("a heap sampler runs while captures do")
        .attachments()
        .into_iter()
        .filter(|a| a.name.contains("libc"))
        .collect()
}

#[test]
fn overlapping_heap_captures_share_one_sampler_and_see_only_their_own() {
    require_root();
    let _serial = serial();
    let dir = tempfile::tempdir().unwrap();
    let bin = compile_c(
        dir.path(),
        "heap_pair",
        include_str!("heap_workloads/heap_pair.c"),
    );
    let mut cg_a = TestCgroup::new("heap-pair-a");
    let mut cg_b = TestCgroup::new("heap-pair-b");
    let mut a = Workload::start(&mut cg_a, &bin);
    let mut b = Workload::start(&mut cg_b, &bin);
    let node = Arc::new(Samplers::new(SamplerConfig::default()));
    assert!(node.heap().is_none(), "no heap capture runs yet");
    let (_rt, metrics) = probe_server(&node);
    assert_eq!(gauge(metrics, "flamefleet_agent_heap_probed_binaries"), 0);

    // A: from the start, long enough to outlive every step below.
    let sample_bytes = 64 * 1024;
    let cap_a = start_capture(&node, &cg_a, "a", Duration::from_secs(14), sample_bytes);
    a.run("alpha");
    // B and C join the running sampler; C (of the same process as A) after `alpha`, and
    // asking for another rate, which the shared sampler does not change.
    let cap_b = start_capture(&node, &cg_b, "b", Duration::from_secs(4), sample_bytes);
    let cap_c = start_capture(&node, &cg_a, "c", Duration::from_secs(9), 4 * sample_bytes);
    let libc = libc_attachments(&node);
    assert_eq!(
        libc.len(),
        1,
        "one attachment per allocator binary, not one per capture: {libc:?}"
    );
    assert_eq!(libc[0].captures, 3, "{libc:?}");
    // The same on /metrics: one entry per binary, three captures on one sampler.
    let attached = node.heap().expect("running").attachments();
    assert_eq!(
        gauge(metrics, "flamefleet_agent_heap_probed_binaries"),
        attached.len() as u64
    );
    assert_eq!(
        gauge(metrics, "flamefleet_agent_heap_uprobes"),
        attached.iter().map(|a| a.probes as u64).sum::<u64>()
    );
    assert_eq!(gauge(metrics, "flamefleet_agent_heap_sampler_captures"), 3);
    b.run("beta");

    let (profile_b, stats_b) = cap_b.join().unwrap().expect("capture B");
    // B ended: A's and C's probes on the same libc stay attached.
    let libc = libc_attachments(&node);
    assert_eq!(libc.len(), 1, "{libc:?}");
    assert_eq!(libc[0].captures, 2, "{libc:?}");
    let probes = libc[0].probes;
    assert!(probes > 0);
    // Allocations after B ended are still seen (by A and C).
    a.run("alpha_late");

    let (profile_c, stats_c) = cap_c.join().unwrap().expect("capture C");
    let (profile_a, stats_a) = cap_a.join().unwrap().expect("capture A");
    eprintln!("A: {stats_a:?}\nB: {stats_b:?}\nC: {stats_c:?}");
    assert!(
        node.heap().is_none(),
        "the sampler stops (and detaches) when its last capture ends"
    );
    assert_eq!(gauge(metrics, "flamefleet_agent_heap_uprobes"), 0);

    let mib = |b: i64| b as f64 / (1024.0 * 1024.0);
    let expect_16 = |who: &str, f: &str, (alloc, inuse): (i64, i64)| {
        // 16 MiB in 256 KiB blocks sampled every 64 KiB on average: within 25%.
        for (what, v) in [("alloc_space", alloc), ("inuse_space", inuse)] {
            assert!(
                (12.0..=20.0).contains(&mib(v)),
                "{who}: {f} {what} {:.1} MiB, expected about 16",
                mib(v)
            );
        }
    };
    let expect_none = |who: &str, f: &str, (alloc, inuse): (i64, i64)| {
        assert_eq!(
            (alloc, inuse),
            (0, 0),
            "{who} must not see {f}: alloc_space {alloc}, inuse_space {inuse}"
        );
    };
    expect_16("A", "pair_alpha", bytes_of(&profile_a, "pair_alpha"));
    expect_16(
        "A",
        "pair_alpha_late",
        bytes_of(&profile_a, "pair_alpha_late"),
    );
    expect_none("A", "pair_beta", bytes_of(&profile_a, "pair_beta"));
    expect_16("B", "pair_beta", bytes_of(&profile_b, "pair_beta"));
    expect_none("B", "pair_alpha", bytes_of(&profile_b, "pair_alpha"));
    expect_none(
        "B",
        "pair_alpha_late",
        bytes_of(&profile_b, "pair_alpha_late"),
    );
    // C joined after `alpha`: neither its allocation nor its residency are C's.
    expect_none("C", "pair_alpha", bytes_of(&profile_c, "pair_alpha"));
    expect_16(
        "C",
        "pair_alpha_late",
        bytes_of(&profile_c, "pair_alpha_late"),
    );
    expect_none("C", "pair_beta", bytes_of(&profile_c, "pair_beta"));

    // One rate for the node's sampler: C asked for another and was told.
    assert_eq!(stats_a.sample_bytes, sample_bytes);
    assert_eq!(stats_c.sample_bytes, sample_bytes);
    assert_eq!(profile_c.period, sample_bytes as i64);
    assert_eq!(
        (
            stats_a.shared_with,
            stats_b.shared_with,
            stats_c.shared_with
        ),
        (0, 1, 2)
    );
    // A attached libc; B and C joined its probes.
    for s in [&stats_a, &stats_b, &stats_c] {
        assert!(s.allocators.iter().any(|a| a.contains("libc")), "{s:?}");
        assert!(s.probes >= probes, "{s:?}");
    }
    cg_a.kill_all();
    cg_b.kill_all();
}
