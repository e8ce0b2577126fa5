//! The Go runtime heap source on real Go processes in real cgroups (root):
//! programs built in the test with each supported Go toolchain keep a known
//! live set; the agent reads the runtime's own heap profile from outside,
//! with no endpoint declared, and must agree with the truth and with the
//! process's own `/debug/pprof/heap` fetched at the same moment, built plain and
//! stripped (`-ldflags="-s -w"`). Programs without memory profiling fail with a clear reason;
//! the target keeps running at full speed while it is read.

mod support;

use std::collections::HashMap;
use std::io::{BufRead as _, BufReader, Read as _, Write as _};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{ChildStdout, Command};
use std::time::{Duration, Instant};

use flamefleet_agent::capture::TargetLabels;
use flamefleet_agent::capture::heap::ebpf::EbpfHeapOptions;
use flamefleet_agent::capture::heap::endpoint::{FetchLimits, HeapEndpoint, fetch_profile};
use flamefleet_agent::capture::heap::goruntime::{
    self,
    buckets::{DEFAULT_HELD_BYTES, HeldBudget, WalkLimits},
};
use flamefleet_agent::capture::heap::{
    self, HeapError, HeapProfile, HeapRequest, HeapSource, HeapSourceUsed, HeapTarget,
};
use flamefleet_proto::pprof::Profile;
use support::{Decoded, TestCgroup, pprof_top, require_root, serial};

/// The toolchains of the supported versions (downloaded through the module
/// proxy on first use; scripts/setup.sh fetches them ahead); `None` is the
/// installed `go`.
const TOOLCHAINS: [Option<&str>; 4] = [Some("go1.23.12"), Some("go1.24.0"), Some("go1.25.0"), None];

const MIB: f64 = 1024.0 * 1024.0;

/// Builds workload `name` (a folder of tests/heap_workloads) into `dir`.
fn build_go(dir: &Path, name: &str, toolchain: Option<&str>, ldflags: &str, cgo: bool) -> PathBuf {
    support::go::build_workload(dir, name, toolchain, ldflags, cgo, &[])
}

/// Reads the workload's first line and returns what follows `prefix`.
fn ready_line(stdout: ChildStdout, prefix: &str) -> (String, BufReader<ChildStdout>) {
    let mut reader = BufReader::new(stdout);
    let mut line = String::new();
    reader.read_line(&mut line).expect("reading the ready line");
    let rest = line
        .trim()
        .strip_prefix(prefix)
        .unwrap_or_else(|| panic!("expected {prefix:?} from the workload, found {line:?}"))
        .trim()
        .to_owned();
    (rest, reader)
}

fn request(source: HeapSource, cgroup: &TestCgroup, pod: &str) -> HeapRequest {
    HeapRequest {
        source,
        targets: vec![HeapTarget {
            labels: TargetLabels {
                namespace: "heap-test".into(),
                pod: pod.into(),
                container: "app".into(),
            },
            cgroup: Some(cgroup.cgroup.clone()),
            endpoint: None,
        }],
        ebpf: EbpfHeapOptions {
            duration: Duration::from_secs(2),
            node: "test-node".into(),
            ..Default::default()
        },
        fetch: FetchLimits::default(),
        delta_seconds: 0,
    }
}

fn sample_index(d: &Decoded, name: &str) -> usize {
    d.profile
        .sample_type
        .iter()
        .position(|vt| d.string(vt.r#type) == name)
        .unwrap_or_else(|| panic!("sample type {name}"))
}

/// inuse_space per function anywhere on the stack (each sample counted once
/// per function).
fn inuse_by_function(d: &Decoded) -> HashMap<String, f64> {
    let inuse = sample_index(d, "inuse_space");
    let mut out: HashMap<String, f64> = HashMap::new();
    for s in &d.profile.sample {
        let mut seen: Vec<&str> = Vec::new();
        for &id in &s.location_id {
            for f in d.functions(id) {
                if !seen.contains(&f) {
                    seen.push(f);
                    *out.entry(f.to_owned()).or_default() += s.value[inuse] as f64;
                }
            }
        }
    }
    out
}

fn total(d: &Decoded, name: &str) -> f64 {
    let i = sample_index(d, name);
    d.profile.sample.iter().map(|s| s.value[i] as f64).sum()
}

/// The leaf function of each sample's stack, by inuse_space, largest first.
fn top_leaves(d: &Decoded, n: usize) -> Vec<String> {
    let inuse = sample_index(d, "inuse_space");
    let mut by: HashMap<String, f64> = HashMap::new();
    for s in &d.profile.sample {
        let leaf = s
            .location_id
            .first()
            .and_then(|&id| d.functions(id).last().map(|f| f.to_string()))
            .unwrap_or_default();
        *by.entry(leaf).or_default() += s.value[inuse] as f64;
    }
    let mut v: Vec<_> = by.into_iter().collect();
    v.sort_by(|a, b| b.1.total_cmp(&a.1));
    v.into_iter().take(n).map(|(f, _)| f).collect()
}

fn fetch_endpoint(port: u16) -> Profile {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let ep = HeapEndpoint::parse_url(&format!("http://127.0.0.1:{port}/debug/pprof/heap")).unwrap();
    rt.block_on(fetch_profile(&ep, &FetchLimits::default()))
        .expect("the workload's own /debug/pprof/heap")
}

/// Checks the workload built by `toolchain` (`None`: the installed `go`), position-independent
/// or not, and stripped (`-ldflags="-s -w"`) or not; the agent's inuse_space must be within
/// `limit` (a fraction) of the process's own `/debug/pprof/heap`.
fn check_version(dir: &Path, toolchain: Option<&str>, pie: bool, stripped: bool, limit: f64) {
    let label = format!(
        "{}{}{}",
        toolchain.unwrap_or("installed go"),
        if pie { ", -buildmode=pie" } else { "" },
        if stripped { ", -ldflags=\"-s -w\"" } else { "" }
    );
    let label = label.as_str();
    let extra: &[&str] = if pie { &["-buildmode=pie"] } else { &[] };
    let ldflags = if stripped { "-s -w" } else { "" };
    let bin = match std::env::var_os(support::go::PREBUILT_GORUNTIME) {
        Some(prebuilt) if toolchain.is_none() && !pie && !stripped => PathBuf::from(prebuilt),
        _ => support::go::build_workload(dir, "goruntime", toolchain, ldflags, false, extra),
    };
    let mut cg = TestCgroup::new("goheap");
    // No churn here: the published profile then changes only with the
    // HTTP server's own allocations, so the agent's read and the process's
    // /debug/pprof/heap describe the same moment. (Reads under churn, with GC
    // cycles completing during them, are the speed test's.)
    let (pid, stdout) = cg.spawn_piped(&mut Command::new(&bin));
    let (port, _keep) = ready_line(stdout, "ready ");
    let port: u16 = port.parse().unwrap();

    let started = Instant::now();
    let result: HeapProfile = heap::capture(
        &flamefleet_agent::capture::Samplers::new(
            flamefleet_agent::capture::SamplerConfig::default(),
        ),
        &request(HeapSource::Auto, &cg, "go-live"),
    )
    .unwrap_or_else(|e| panic!("{label}: Go runtime heap capture: {e}"));
    let took = started.elapsed();
    let own = fetch_endpoint(port);
    eprintln!("{label}: capture took {took:?}\n{}", result.text());

    assert_eq!(
        result.source,
        HeapSourceUsed::GoRuntime,
        "{label}: {}",
        result.reason
    );
    let note = result
        .processes
        .iter()
        .find(|n| n.pid == pid)
        .unwrap_or_else(|| panic!("{label}: no note for pid {pid}: {:?}", result.processes));
    assert_eq!(note.source, Some(HeapSourceUsed::GoRuntime), "{note:?}");
    if let Some(v) = toolchain {
        assert!(note.detail.starts_with(v), "{label}: {note:?}");
    }
    let d = Decoded {
        profile: result.profile,
    };
    let p = &d.profile;
    let names: Vec<_> = p
        .sample_type
        .iter()
        .map(|vt| format!("{}/{}", d.string(vt.r#type), d.string(vt.unit)))
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
    assert_eq!(d.string(p.default_sample_type), "inuse_space");
    assert_eq!(
        p.period,
        512 * 1024,
        "{label}: period is the MemProfileRate"
    );
    for s in &p.sample {
        assert_eq!(d.label(s, "heap_source"), Some("goruntime"));
        assert_eq!(d.label(s, "pod"), Some("go-live"));
        assert_eq!(d.num_label(s, "pid"), Some(i64::from(pid)));
    }

    // Against the truth: 64 MiB from keepA, 16 MiB from keepB.
    let by = inuse_by_function(&d);
    let a = by.get("main.keepA").copied().unwrap_or(0.0);
    let b = by.get("main.keepB").copied().unwrap_or(0.0);
    let all = total(&d, "inuse_space");
    // The churn's short-lived objects count as in use when they were still
    // reachable at the last GC (so they do in /debug/pprof/heap too).
    let churn = by.get("main.churn").copied().unwrap_or(0.0);
    eprintln!(
        "{label}: keepA {:.1} MiB, keepB {:.1} MiB, churn {:.1} MiB, all {:.1} MiB",
        a / MIB,
        b / MIB,
        churn / MIB,
        all / MIB
    );
    let err = (a + b) / (80.0 * MIB) - 1.0;
    assert!(
        err.abs() <= 0.10,
        "{label}: keepA+keepB inuse_space off by {:.1}% (limit 10%)",
        err * 100.0
    );
    let err_rest = (all - churn) / (80.0 * MIB) - 1.0;
    assert!(
        err_rest.abs() <= 0.10,
        "{label}: inuse_space outside the churn off by {:.1}% (limit 10%)",
        err_rest * 100.0
    );
    let share = a / (a + b) * 100.0;
    assert!(
        (share - 80.0).abs() <= 5.0,
        "{label}: keepA share {share:.1}% vs truth 80% (limit ±5 points)"
    );

    // Against the process's own /debug/pprof/heap.
    let own = Decoded { profile: own };
    let (ours_top, own_top) = (top_leaves(&d, 2), top_leaves(&own, 2));
    let mut sorted_ours = ours_top.clone();
    let mut sorted_own = own_top.clone();
    sorted_ours.sort();
    sorted_own.sort();
    assert_eq!(
        sorted_ours, sorted_own,
        "{label}: top functions differ: agent {ours_top:?}, /debug/pprof/heap {own_top:?}"
    );
    assert_eq!(sorted_ours, ["main.keepA", "main.keepB"], "{label}");
    let own_total = total(&own, "inuse_space");
    let diff = all / own_total - 1.0;
    eprintln!(
        "{label}: inuse_space agent {:.2} MiB, /debug/pprof/heap {:.2} MiB ({:+.2}%)",
        all / MIB,
        own_total / MIB,
        diff * 100.0
    );
    assert!(
        diff.abs() <= limit,
        "{label}: inuse_space {all:.0} vs the process's own {own_total:.0} (limit {:.0}%)",
        limit * 100.0
    );
    // Each function's share too: keepA's and keepB's inuse_space in /debug/pprof/heap.
    let own_by = inuse_by_function(&own);
    for f in ["main.keepA", "main.keepB"] {
        let (ours, theirs) = (
            by.get(f).copied().unwrap_or(0.0),
            own_by.get(f).copied().unwrap_or(0.0),
        );
        assert!(
            theirs > 0.0 && (ours / theirs - 1.0).abs() <= limit,
            "{label}: {f} inuse_space {ours:.0} vs the process's own {theirs:.0} (limit {:.0}%)",
            limit * 100.0
        );
    }
    let (oa, ob) = (total(&d, "alloc_space"), total(&own, "alloc_space"));
    assert!(oa > 0.0 && ob > 0.0);

    if toolchain.is_none() && !pie && !stripped {
        let file = dir.join("go-heap.pb.gz");
        flamefleet_agent::cli::write_profile(&file, p).unwrap();
        let top = pprof_top(&file, &["-sample_index=inuse_space"]);
        assert!(
            top.contains("main.keepA") && top.contains("main.keepB"),
            "{top}"
        );
    }
    cg.kill_all();
}

/// Each supported version's build, plain and stripped (`-ldflags="-s -w"`: no symbol table,
/// no DWARF; the globals are then found from the runtime's code and the stacks named from
/// Go's function table), and position-independent: the agent's heap profile is the process's
/// own, within 2%.
#[test]
fn go_heap_matches_the_truth_and_its_own_endpoint_for_each_supported_version() {
    require_root();
    let _serial = serial();
    let dir = tempfile::tempdir().unwrap();
    for toolchain in TOOLCHAINS {
        // The local toolchain's plain build has its own test (below).
        if toolchain.is_some() {
            check_version(dir.path(), toolchain, false, false, 0.02);
        }
        check_version(dir.path(), toolchain, false, true, 0.02);
    }
    // Position-independent: the globals move by the load bias.
    check_version(dir.path(), None, true, false, 0.02);
    check_version(dir.path(), None, true, true, 0.02);
}

/// The same check with the machine's own Go toolchain only, which the guest tier
/// (`tests/kernels.rs`) runs under each kernel with the workload it built on the host
/// (`support::go::PREBUILT_GORUNTIME`): `go build` under TCG takes minutes.
#[test]
fn go_heap_matches_the_truth_and_its_own_endpoint_with_the_local_toolchain() {
    require_root();
    let _serial = serial();
    let dir = tempfile::tempdir().unwrap();
    check_version(dir.path(), None, false, false, 0.05);
}

fn unseen_message(result: Result<HeapProfile, HeapError>) -> String {
    match result {
        Err(e @ HeapError::Unseen(_)) => e.to_string(),
        Err(e) => panic!("expected the processes named as unseen, found error {e}"),
        Ok(p) => panic!(
            "expected the processes named as unseen, found a {} profile of {} samples: {}",
            p.source,
            p.profile.sample.len(),
            p.text()
        ),
    }
}

#[test]
fn go_program_without_memory_profiling_is_named_with_the_reason() {
    require_root();
    let _serial = serial();
    let dir = tempfile::tempdir().unwrap();
    let bin = build_go(dir.path(), "gonopprof", None, "", false);
    let mut cg = TestCgroup::new("goheap-nopprof");
    let mut cmd = Command::new(&bin);
    cmd.stdin(std::process::Stdio::piped());
    let (pid, stdout) = cg.spawn_piped(&mut cmd);
    let _stdin = cg.take_stdin(pid);
    let (_, _keep) = ready_line(stdout, "ready");
    let msg = unseen_message(heap::capture(
        &flamefleet_agent::capture::Samplers::new(
            flamefleet_agent::capture::SamplerConfig::default(),
        ),
        &request(HeapSource::Auto, &cg, "nopprof"),
    ));
    eprintln!("{msg}");
    assert!(msg.contains(&format!("pid {pid}")), "{msg}");
    assert!(
        msg.contains("disableMemoryProfiling") && msg.contains("MemProfileRate=0"),
        "{msg}"
    );
    // eBPF alone sees nothing of a Go heap, and says why rather than
    // returning 0 samples silently.
    let r = heap::capture(
        &flamefleet_agent::capture::Samplers::new(
            flamefleet_agent::capture::SamplerConfig::default(),
        ),
        &request(HeapSource::Ebpf, &cg, "nopprof"),
    )
    .expect("eBPF capture");
    let text = r.text();
    eprintln!("{text}");
    assert!(r.profile.sample.is_empty(), "{text}");
    assert!(
        r.warnings.iter().any(|w| w.contains("no allocator")),
        "{text}"
    );
    assert!(
        r.processes.iter().any(|n| n.pid == pid
            && n.source.is_none()
            && n.detail.contains("does not go through malloc")),
        "{text}"
    );
}

/// Stripped (`-ldflags="-s -w"`), the same program is told apart the same way: its
/// `disableMemoryProfiling` and `MemProfileRate` are found from `runtime.schedinit`'s code,
/// and `runtime.memProfileInternal`, where the buckets would be found, is not in it.
#[test]
fn stripped_go_program_without_memory_profiling_is_named_with_the_reason() {
    require_root();
    let _serial = serial();
    let dir = tempfile::tempdir().unwrap();
    let bin = build_go(dir.path(), "gonopprof", None, "-s -w", false);
    let mut cg = TestCgroup::new("goheap-nopprof-stripped");
    let mut cmd = Command::new(&bin);
    cmd.stdin(std::process::Stdio::piped());
    let (pid, stdout) = cg.spawn_piped(&mut cmd);
    let _stdin = cg.take_stdin(pid);
    let (_, _keep) = ready_line(stdout, "ready");
    let msg = unseen_message(heap::capture(
        &flamefleet_agent::capture::Samplers::new(
            flamefleet_agent::capture::SamplerConfig::default(),
        ),
        &request(HeapSource::GoRuntime, &cg, "nopprof-stripped"),
    ));
    eprintln!("{msg}");
    assert!(msg.contains(&format!("pid {pid}")), "{msg}");
    assert!(
        msg.contains("disableMemoryProfiling") && msg.contains("MemProfileRate=0"),
        "{msg}"
    );
}

/// Iterations of the workload's busy loop so far (its /count handler).
fn iterations(port: u16) -> u64 {
    let mut s = TcpStream::connect(("127.0.0.1", port)).expect("connect to the workload");
    s.write_all(b"GET /count HTTP/1.0\r\nHost: x\r\n\r\n")
        .unwrap();
    let mut body = String::new();
    s.read_to_string(&mut body).unwrap();
    body.rsplit("\r\n\r\n")
        .next()
        .and_then(|b| b.trim().parse().ok())
        .unwrap_or_else(|| panic!("bad /count answer {body:?}"))
}

/// The scheduler state letter of every thread of `pid`.
fn thread_states(pid: u32) -> Vec<char> {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return Vec::new();
    };
    tasks
        .flatten()
        .filter_map(|t| std::fs::read_to_string(t.path().join("stat")).ok())
        .filter_map(|stat| {
            let after = stat.rsplit_once(") ")?.1;
            after.chars().next()
        })
        .collect()
}

#[test]
fn target_keeps_running_at_full_speed_while_read() {
    require_root();
    let _serial = serial();
    let dir = tempfile::tempdir().unwrap();
    let bin = build_go(dir.path(), "goruntime", None, "", false);
    let mut cg = TestCgroup::new("goheap-speed");
    let (pid, stdout) = cg.spawn_piped(Command::new(&bin).arg("churn"));
    let (port, _keep) = ready_line(stdout, "ready ");
    let port: u16 = port.parse().unwrap();
    let process = goruntime::probe(pid).expect("probe").expect("a Go process");
    let (window, pairs) = (Duration::from_millis(1000), 5);
    let rate = |f: &mut dyn FnMut()| {
        let (i0, t0) = (iterations(port), Instant::now());
        f();
        (iterations(port) - i0) as f64 / t0.elapsed().as_secs_f64()
    };
    let (mut quiet, mut busy) = (0.0, 0.0);
    let (mut reads, mut read_time, mut bytes, mut restarts) = (0u64, Duration::ZERO, 0u64, 0u32);
    // Alternate quiet and reading windows so load from elsewhere hits both.
    for _ in 0..pairs {
        quiet += rate(&mut || std::thread::sleep(window));
        busy += rate(&mut || {
            let end = Instant::now() + window;
            while Instant::now() < end {
                let t = Instant::now();
                let (walk, n) = process
                    .read(
                        goruntime::DEFAULT_READ_BUDGET,
                        WalkLimits::default(),
                        &mut HeldBudget::new(DEFAULT_HELD_BYTES),
                    )
                    .expect("reading the heap profile");
                read_time += t.elapsed();
                reads += 1;
                bytes = n;
                restarts += walk.restarts;
                assert!(!walk.buckets.is_empty());
                // Never stopped: no thread in a stopped or traced state.
                for state in thread_states(pid) {
                    assert!(
                        !matches!(state, 't' | 'T'),
                        "a thread of the target was stopped ({state}) during a read"
                    );
                }
                // 200 reads a second: far more than any capture does, and
                // leaves the machine's 2 CPUs to the workload.
                std::thread::sleep(Duration::from_millis(5));
            }
        });
    }
    let ratio = busy / quiet;
    eprintln!(
        "busy loop: {:.0} iterations/s quiet, {:.0}/s while read ({:.1}%); {reads} reads, \
         {:.2} ms each, {bytes} bytes each, {restarts} restarts (GC completed during a read)",
        quiet / f64::from(pairs),
        busy / f64::from(pairs),
        ratio * 100.0,
        read_time.as_secs_f64() * 1e3 / reads as f64
    );
    assert!(reads >= 100, "only {reads} reads in {pairs} s");
    assert!(
        ratio >= 0.8,
        "the target slowed to {:.1}% of its speed while read (limit 80%)",
        ratio * 100.0
    );
}

#[test]
fn cgo_program_gets_its_go_heap_from_the_runtime_and_its_c_heap_from_ebpf() {
    require_root();
    let _serial = serial();
    let dir = tempfile::tempdir().unwrap();
    let bin = build_go(dir.path(), "gocgo", None, "", true);
    let mut cg = TestCgroup::new("goheap-cgo");
    let mut cmd = Command::new(&bin);
    cmd.stdin(std::process::Stdio::piped());
    let (pid, stdout) = cg.spawn_piped(&mut cmd);
    let mut stdin = cg.take_stdin(pid).expect("piped stdin");
    let (_, mut lines) = ready_line(stdout, "ready");
    let (attached_tx, attached) = std::sync::mpsc::sync_channel(1);
    let mut req = request(HeapSource::Auto, &cg, "cgo");
    req.ebpf.duration = Duration::from_secs(8);
    req.ebpf.sample_bytes = 64 * 1024;
    req.ebpf.ready = Some(attached_tx);
    let capture = std::thread::spawn(move || {
        heap::capture(
            &flamefleet_agent::capture::Samplers::new(
                flamefleet_agent::capture::SamplerConfig::default(),
            ),
            &req,
        )
    });
    if attached.recv_timeout(Duration::from_secs(60)).is_err() {
        panic!(
            "the heap capture never attached its probes: {:?}",
            capture.join().map(|r| r.err())
        );
    }
    // Let the C part allocate while the probes are attached.
    stdin.write_all(b"go\n").unwrap();
    let mut line = String::new();
    lines.read_line(&mut line).unwrap();
    assert_eq!(line.trim(), "c-ready");
    let result = capture.join().unwrap().expect("mixed capture");
    let text = result.text();
    eprintln!("{text}");
    assert_eq!(result.source, HeapSourceUsed::Mixed, "{text}");
    let d = Decoded {
        profile: result.profile,
    };
    let inuse = sample_index(&d, "inuse_space");
    let (mut go, mut c) = (0.0, 0.0);
    for s in &d.profile.sample {
        assert_eq!(d.num_label(s, "pid"), Some(i64::from(pid)));
        let has = |name: &str| {
            s.location_id
                .iter()
                .any(|&id| d.functions(id).contains(&name))
        };
        match d.label(s, "heap_source") {
            Some("goruntime") if has("main.keepGo") => go += s.value[inuse] as f64,
            Some("ebpf") if has("c_site") => c += s.value[inuse] as f64,
            Some("goruntime" | "ebpf") => {}
            other => panic!("sample without a heap_source label: {other:?}"),
        }
    }
    eprintln!(
        "Go heap {:.1} MiB (truth 64), C heap {:.1} MiB (truth 32)",
        go / MIB,
        c / MIB
    );
    assert!((go / (64.0 * MIB) - 1.0).abs() <= 0.10, "Go heap {go:.0}");
    assert!((c / (32.0 * MIB) - 1.0).abs() <= 0.15, "C heap {c:.0}");
}
