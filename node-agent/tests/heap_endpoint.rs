//! The heap endpoint source against real HTTP servers on 127.0.0.1: a Go
//! program built in the test with `net/http/pprof`, and hostile endpoints
//! (garbage, a 1 GiB body, a zip bomb, a trickle, silence, 404) that must
//! fail fast with a clear error and leave the agent able to fetch again.

mod support;

use std::io::{BufRead as _, BufReader, Read as _, Write as _};
use std::net::{TcpListener, TcpStream};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use flamefleet_agent::capture::TargetLabels;
use flamefleet_agent::capture::heap::ebpf::EbpfHeapOptions;
use flamefleet_agent::capture::heap::endpoint::{
    EndpointError, EndpointOrigin, FetchLimits, HeapEndpoint, ResolvedEndpoint, fetch_profile,
};
use flamefleet_agent::capture::heap::{self, HeapRequest, HeapSource, HeapSourceUsed, HeapTarget};
use flamefleet_agent::pprof::{Frame, FrameLine, ProfileBuilder, encode_gzip};
use support::{Decoded, pprof_top};

/// Kills the Go workload when the test ends, whichever way.
struct KillOnDrop(Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Builds and starts the Go workload; returns it and its pprof port.
fn start_go_workload(dir: &Path) -> (KillOnDrop, u16) {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/heap_workloads/goheap");
    for f in ["main.go", "go.mod"] {
        std::fs::copy(src.join(f), dir.join(f)).expect("copying the Go workload");
    }
    let out = Command::new("go")
        .args(["build", "-o", "goheap", "."])
        .current_dir(dir)
        // Standard library only: nothing to download.
        .env("GOFLAGS", "-mod=mod")
        .env("GOPROXY", "off")
        .output()
        .expect("running `go build` (install Go)");
    assert!(
        out.status.success(),
        "go build failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let mut child = Command::new(dir.join("goheap"))
        .stdout(Stdio::piped())
        .spawn()
        .expect("starting the Go workload");
    let stdout = child.stdout.take().expect("piped stdout");
    let child = KillOnDrop(child);
    let mut line = String::new();
    BufReader::new(stdout)
        .read_line(&mut line)
        .expect("reading the port");
    let port = line
        .trim()
        .strip_prefix("port ")
        .and_then(|p| p.parse().ok())
        .unwrap_or_else(|| panic!("expected `port N` from the Go workload, found {line:?}"));
    (child, port)
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

fn inuse_of(d: &Decoded, function: &str) -> i64 {
    let p = &d.profile;
    let idx = p
        .sample_type
        .iter()
        .position(|vt| d.string(vt.r#type) == "inuse_space")
        .expect("Go heap profiles have inuse_space");
    p.sample
        .iter()
        .filter(|s| {
            s.location_id
                .iter()
                .any(|&id| d.functions(id).contains(&function))
        })
        .map(|s| s.value[idx])
        .sum()
}

#[test]
fn go_endpoint_is_fetched_merged_labelled_and_readable_by_pprof() {
    let dir = tempfile::tempdir().unwrap();
    let (_go, port) = start_go_workload(dir.path());
    let url = format!("http://127.0.0.1:{port}/debug/pprof/heap");
    let target = |pod: &str, ep: HeapEndpoint, origin| HeapTarget {
        labels: TargetLabels {
            namespace: "heap-test".into(),
            pod: pod.into(),
            container: "app".into(),
        },
        cgroup: None,
        endpoint: Some(ResolvedEndpoint {
            endpoint: ep,
            origin,
        }),
    };
    // Two "containers": one by URL, one by port inside the process's network
    // namespace (the --pid path); auto must pick the endpoint for both.
    let by_url = HeapEndpoint::parse_url(&url).unwrap();
    let by_netns = HeapEndpoint {
        host: "127.0.0.1".into(),
        port,
        path: "/debug/pprof/heap".into(),
        netns_pid: Some(_go.0.id()),
    };
    let request = HeapRequest {
        source: HeapSource::Auto,
        targets: vec![
            target("web-1", by_url, EndpointOrigin::Explicit),
            target("web-2", by_netns, EndpointOrigin::Annotations),
        ],
        ebpf: EbpfHeapOptions {
            node: "test-node".into(),
            ..Default::default()
        },
        fetch: FetchLimits::default(),
        delta_seconds: 0,
    };
    let result = heap::capture(
        &flamefleet_agent::capture::Samplers::new(
            flamefleet_agent::capture::SamplerConfig::default(),
        ),
        &request,
    )
    .expect("fetching the Go heap profile");
    assert_eq!(result.source, HeapSourceUsed::Endpoint, "{}", result.reason);
    assert!(result.warnings.is_empty(), "{:?}", result.warnings);
    let d = Decoded {
        profile: result.profile,
    };
    let types: Vec<_> = d
        .profile
        .sample_type
        .iter()
        .map(|vt| d.string(vt.r#type))
        .collect();
    assert_eq!(
        types,
        [
            "alloc_objects",
            "alloc_space",
            "inuse_objects",
            "inuse_space"
        ]
    );
    let pods: std::collections::BTreeSet<_> = d
        .profile
        .sample
        .iter()
        .filter_map(|s| d.label(s, "pod"))
        .collect();
    assert_eq!(pods, ["web-1", "web-2"].into_iter().collect());
    assert!(
        d.profile
            .sample
            .iter()
            .all(|s| d.label(s, "node") == Some("test-node"))
    );
    // Go keeps 32 MiB live in keepLive (recorded exactly); both copies report it.
    let live = inuse_of(&d, "main.keepLive") as f64;
    let expected = 2.0 * 32.0 * 1024.0 * 1024.0;
    assert!(
        (live / expected - 1.0).abs() < 0.05,
        "main.keepLive inuse {live} vs {expected}"
    );

    let file = dir.path().join("go-heap.pb.gz");
    flamefleet_agent::cli::write_profile(&file, &d.profile).unwrap();
    let top = pprof_top(&file, &["-sample_index=inuse_space"]);
    assert!(top.contains("main.keepLive"), "{top}");

    // Go's delta form: allocations over one second.
    let started = Instant::now();
    let delta = runtime()
        .block_on(fetch_profile(
            &HeapEndpoint::parse_url(&url).unwrap().with_delta_seconds(1),
            &FetchLimits::default(),
        ))
        .expect("delta profile");
    assert!(
        started.elapsed() >= Duration::from_millis(900),
        "the delta form waits"
    );
    assert!(!delta.sample_type.is_empty());

    // The CLI with --port/--pid writes a file pprof reads, and says the source.
    let out = dir.path().join("cli.pb.gz");
    let cli = Command::new(env!("CARGO_BIN_EXE_flamefleet-agent"))
        .args(["capture", "--type", "heap", "--port", &port.to_string()])
        .args(["--pid", &_go.0.id().to_string(), "--text", "-o"])
        .arg(&out)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&cli.stdout);
    assert!(
        cli.status.success(),
        "{}",
        String::from_utf8_lossy(&cli.stderr)
    );
    assert!(stdout.contains("heap profile from endpoint"), "{stdout}");
    assert!(pprof_top(&out, &[]).contains("main.keepLive"));
}

/// A one-connection-at-a-time HTTP server on 127.0.0.1 whose handler
/// misbehaves on purpose. Returns its address.
fn hostile_server(handler: fn(TcpStream)) -> String {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    std::thread::spawn(move || {
        for stream in listener.incoming().flatten() {
            std::thread::spawn(move || {
                let mut s = stream;
                // Read the request head; the content does not matter.
                let mut buf = [0u8; 4096];
                let _ = s.read(&mut buf);
                handler(s);
            });
        }
    });
    format!("http://{addr}/debug/pprof/heap")
}

fn garbage(mut s: TcpStream) {
    let body = b"<html><body>this is not a profile</body></html>";
    let _ = write!(
        s,
        "HTTP/1.1 200 OK\r\nContent-Length: {}\r\n\r\n",
        body.len()
    );
    let _ = s.write_all(body);
}

/// Declares 1 GiB and streams it.
fn huge_declared(mut s: TcpStream) {
    let _ = write!(
        s,
        "HTTP/1.1 200 OK\r\nContent-Length: {}\r\n\r\n",
        1u64 << 30
    );
    stream_zeros(s, 1 << 30);
}

/// Streams 1 GiB with chunked encoding (no length to refuse up front).
fn huge_chunked(mut s: TcpStream) {
    let _ = write!(s, "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n");
    let chunk = vec![0u8; 1 << 20];
    for _ in 0..1024 {
        if write!(s, "{:x}\r\n", chunk.len()).is_err()
            || s.write_all(&chunk).is_err()
            || s.write_all(b"\r\n").is_err()
        {
            return;
        }
    }
    let _ = s.write_all(b"0\r\n\r\n");
}

fn stream_zeros(mut s: TcpStream, total: usize) {
    let chunk = vec![0u8; 1 << 20];
    let mut sent = 0;
    while sent < total {
        if s.write_all(&chunk).is_err() {
            return;
        }
        sent += chunk.len();
    }
}

/// 1 GiB of zeros gzipped: about 1 MiB on the wire (made once, before the server starts).
static BOMB: std::sync::OnceLock<Vec<u8>> = std::sync::OnceLock::new();

fn make_bomb() -> Vec<u8> {
    // One gzip member of 1 MiB of zeros, repeated: a valid multi-member stream.
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::best());
    gz.write_all(&vec![0u8; 1 << 20]).unwrap();
    gz.finish().unwrap().repeat(1024)
}

fn zip_bomb(mut s: TcpStream) {
    let bomb = BOMB.get_or_init(make_bomb);
    let _ = write!(
        s,
        "HTTP/1.1 200 OK\r\nContent-Length: {}\r\n\r\n",
        bomb.len()
    );
    let _ = s.write_all(bomb);
}

/// One byte every 200 ms, forever: never idle long enough to trip the idle timeout.
fn trickle(mut s: TcpStream) {
    let _ = write!(s, "HTTP/1.1 200 OK\r\nContent-Length: 1000000\r\n\r\n");
    for _ in 0..600 {
        if s.write_all(b"\x1f").is_err() {
            return;
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// Accepts and never answers.
fn silent(s: TcpStream) {
    std::thread::sleep(Duration::from_secs(60));
    drop(s);
}

fn not_found(mut s: TcpStream) {
    let body = b"404 page not found\n";
    let _ = write!(
        s,
        "HTTP/1.1 404 Not Found\r\nContent-Length: {}\r\n\r\n",
        body.len()
    );
    let _ = s.write_all(body);
}

fn good(mut s: TcpStream) {
    let mut b = ProfileBuilder::new(&[("inuse_space", "bytes")]);
    let frame = Frame {
        address: 0x1000,
        mapping: None,
        lines: vec![FrameLine {
            function: "good_function".into(),
            file: String::new(),
            line: 0,
        }],
    };
    b.add_sample(&[frame], &[4096], &[]);
    let body = encode_gzip(&b.build()).unwrap();
    let _ = write!(
        s,
        "HTTP/1.1 200 OK\r\nContent-Length: {}\r\n\r\n",
        body.len()
    );
    let _ = s.write_all(&body);
}

/// Peak resident memory of this test process.
fn peak_rss_bytes() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map(|kb| kb * 1024)
        .expect("VmHWM in /proc/self/status")
}

#[test]
fn hostile_endpoints_fail_fast_with_clear_errors_and_the_agent_stays_healthy() {
    let limits = FetchLimits {
        connect_timeout: Duration::from_secs(2),
        idle_timeout: Duration::from_secs(2),
        total_timeout: Duration::from_secs(3),
        // Decompressing is CPU work, slow in debug builds: a smaller cap keeps the test quick.
        max_profile_bytes: 64 << 20,
        ..FetchLimits::default()
    };
    BOMB.get_or_init(make_bomb);
    let rt = runtime();
    let fetch = |url: &str| {
        let started = Instant::now();
        let r = rt.block_on(fetch_profile(
            &HeapEndpoint::parse_url(url).unwrap(),
            &limits,
        ));
        (r, started.elapsed())
    };
    type Check = fn(&EndpointError) -> bool;
    /// Name, server behaviour, expected error kind, text the message must contain.
    type Case = (&'static str, fn(TcpStream), Check, &'static str);
    let cases: [Case; 7] = [
        (
            "garbage",
            garbage,
            |e| matches!(e, EndpointError::NotPprof { .. }),
            "did not return a pprof profile",
        ),
        (
            "1 GiB declared",
            huge_declared,
            |e| matches!(e, EndpointError::TooLarge { .. }),
            "response cap",
        ),
        (
            "1 GiB chunked",
            huge_chunked,
            |e| matches!(e, EndpointError::TooLarge { .. }),
            "response cap",
        ),
        (
            "zip bomb",
            zip_bomb,
            |e| matches!(e, EndpointError::TooLargeDecompressed { .. }),
            "zip bomb",
        ),
        (
            "trickle",
            trickle,
            |e| {
                matches!(
                    e,
                    EndpointError::Timeout {
                        what: "whole request",
                        ..
                    }
                )
            },
            "timed out",
        ),
        (
            "silent",
            silent,
            |e| matches!(e, EndpointError::Timeout { .. }),
            "timed out",
        ),
        (
            "404",
            not_found,
            |e| matches!(e, EndpointError::Status { status: 404, .. }),
            "404 page not found",
        ),
    ];
    for (name, handler, check, text) in cases {
        let url = hostile_server(handler);
        let (result, took) = fetch(&url);
        let err = match result {
            Ok(_) => panic!("{name}: expected an error, got a profile"),
            Err(e) => e,
        };
        let msg = err.to_string();
        eprintln!("{name}: {took:.2?}: {msg}");
        assert!(check(&err), "{name}: unexpected error kind: {msg}");
        assert!(
            msg.contains(text),
            "{name}: message should mention {text:?}: {msg}"
        );
        assert!(
            msg.contains("127.0.0.1"),
            "{name}: message should name the endpoint: {msg}"
        );
        // The time limits are what stops a trickling or silent server: those
        // must end near the 3 s whole-exchange limit. The size caps stop the
        // others (the error kind proves it); how long decompressing 256 MiB
        // takes is the machine's speed, which a test must not judge.
        if matches!(err, EndpointError::Timeout { .. }) {
            assert!(
                took < Duration::from_secs(5),
                "{name}: took {took:?}, limit is 3 s total"
            );
        }
    }
    // Nothing listening: a connection error naming the endpoint.
    let closed = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let (r, _) = fetch(&format!("http://{closed}/debug/pprof/heap"));
    assert!(matches!(r, Err(EndpointError::Connect { .. })), "{r:?}");

    // Still healthy: a good endpoint works, and memory never held the 1 GiB bodies.
    let (r, _) = fetch(&hostile_server(good));
    let p = r.expect("a good endpoint after the hostile ones");
    assert_eq!(p.sample.len(), 1);
    let peak = peak_rss_bytes();
    assert!(
        peak < 512 << 20,
        "peak RSS {peak} bytes: a body or a bomb was buffered whole"
    );

    // The CLI: clear error, non-zero exit.
    let out = Command::new(env!("CARGO_BIN_EXE_flamefleet-agent"))
        .args([
            "capture",
            "--type",
            "heap",
            "--heap-source",
            "endpoint",
            "--endpoint",
        ])
        .arg(hostile_server(garbage))
        .args(["-o", "/dev/null"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        stderr.contains("did not return a pprof profile"),
        "{stderr}"
    );
}

/// Connections to [`held_good`] servers open now, and the most seen at once.
static LIVE: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
static MOST_LIVE: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// A slow endpoint: holds each connection half a second (as a pod serving a large profile
/// would), then answers with a good profile; counts the connections open at once.
fn held_good(s: TcpStream) {
    use std::sync::atomic::Ordering;
    let live = LIVE.fetch_add(1, Ordering::SeqCst) + 1;
    MOST_LIVE.fetch_max(live, Ordering::SeqCst);
    std::thread::sleep(Duration::from_millis(500));
    good(s);
    LIVE.fetch_sub(1, Ordering::SeqCst);
}

/// Every endpoint body is the pod's to choose, up to the body and decode caps: the agent
/// holds at most `MAX_CONCURRENT_FETCHES` of them at once in all, not per capture, so two
/// heap captures of three containers each running together fetch two at a time.
#[test]
fn concurrent_captures_share_the_agents_fetch_slots() {
    let urls: Vec<String> = (0..6).map(|_| hostile_server(held_good)).collect();
    let request = |urls: &[String]| HeapRequest {
        source: HeapSource::Endpoint,
        targets: urls
            .iter()
            .map(|u| HeapTarget {
                labels: TargetLabels::default(),
                cgroup: None,
                endpoint: Some(ResolvedEndpoint {
                    endpoint: HeapEndpoint::parse_url(u).unwrap(),
                    origin: EndpointOrigin::Explicit,
                }),
            })
            .collect(),
        ebpf: EbpfHeapOptions {
            node: "test-node".into(),
            ..Default::default()
        },
        fetch: FetchLimits::default(),
        delta_seconds: 0,
    };
    let samplers = flamefleet_agent::capture::Samplers::new(
        flamefleet_agent::capture::SamplerConfig::default(),
    );
    let start = std::sync::Barrier::new(2);
    let samples: Vec<usize> = std::thread::scope(|s| {
        let captures: Vec<_> = urls
            .chunks(3)
            .map(|part| {
                let (req, samplers, start) = (request(part), &samplers, &start);
                s.spawn(move || {
                    start.wait();
                    heap::capture(samplers, &req).map(|r| r.profile.sample.len())
                })
            })
            .collect();
        captures
            .into_iter()
            .map(|c| c.join().unwrap().expect("a capture of good endpoints"))
            .collect()
    });
    assert_eq!(samples, [3, 3], "each capture merges its three endpoints");
    let most = MOST_LIVE.load(std::sync::atomic::Ordering::SeqCst);
    assert_eq!(
        most,
        heap::MAX_CONCURRENT_FETCHES,
        "endpoints fetched at once by two captures together"
    );
}
