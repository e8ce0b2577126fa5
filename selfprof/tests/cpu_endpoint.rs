//! The CPU profile endpoint over real HTTP, profiling this test process for real: the busy
//! function is named in the pprof and the SVG, a second profile is refused with 409 while one
//! runs, and `force=true` ends the running one and takes its place.

use std::hint::black_box;
use std::io::Read as _;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use flamefleet_proto::pprof::Profile;
use flamefleet_selfprof::SelfProfiler;
use prost::Message as _;

#[inline(never)]
fn selfprof_test_spin(stop: &AtomicBool) -> u64 {
    let mut x = 1u64;
    while !stop.load(Ordering::Relaxed) {
        for _ in 0..10_000 {
            x = black_box(x.wrapping_mul(6364136223846793005).wrapping_add(1));
        }
    }
    x
}

/// A thread spinning in `selfprof_test_spin` until dropped.
struct Spinner(Arc<AtomicBool>, Option<std::thread::JoinHandle<u64>>);

impl Spinner {
    fn start() -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let s = Arc::clone(&stop);
        Self(
            stop,
            Some(std::thread::spawn(move || selfprof_test_spin(&s))),
        )
    }
}

impl Drop for Spinner {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Relaxed);
        if let Some(t) = self.1.take() {
            let _ = t.join();
        }
    }
}

/// The process has one sampler: the tests of this binary take turns.
async fn serial() -> tokio::sync::MutexGuard<'static, ()> {
    static LOCK: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());
    LOCK.lock().await
}

async fn serve() -> (SocketAddr, Arc<SelfProfiler>) {
    let profiler = Arc::new(SelfProfiler::default());
    let addr = flamefleet_selfprof::spawn_with(
        "127.0.0.1:0".parse().expect("address"),
        Arc::clone(&profiler),
    )
    .await
    .expect("bind");
    (addr, profiler)
}

/// This process's CPU time so far, in nanoseconds.
fn process_cpu_ns() -> i64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: a plain syscall writing into `ts`.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_PROCESS_CPUTIME_ID, &raw mut ts) };
    assert_eq!(rc, 0, "clock_gettime");
    ts.tv_sec * 1_000_000_000 + ts.tv_nsec
}

fn decode(gz: &[u8]) -> Profile {
    let mut raw = Vec::new();
    flate2::read::GzDecoder::new(gz)
        .read_to_end(&mut raw)
        .expect("gzip");
    Profile::decode(&raw[..]).expect("pprof")
}

fn function_names(p: &Profile) -> Vec<String> {
    p.function
        .iter()
        .map(|f| p.string_table[f.name as usize].clone())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cpu_profile_names_the_busy_function_in_pprof_and_svg() {
    let _serial = serial().await;
    let (addr, profiler) = serve().await;
    let _spin = Spinner::start();
    let http = reqwest::Client::new();
    let cpu_before = process_cpu_ns();
    let request = {
        let http = http.clone();
        tokio::spawn(async move {
            http.get(format!(
                "http://{addr}/debug/pprof/profile?seconds=2&frequency=199"
            ))
            .send()
            .await
            .expect("GET profile")
        })
    };
    // A stretch inside the 2 s window: from the profiler's start signal, 1 s long (the
    // window began before the signal and ends 2 s after it began).
    // The sleep is the measured stretch, not a wait for anything; that it fell inside the
    // window is checked below against the profile's own start and duration.
    profiler.wait_started(1).await;
    let (inner_from, inner_start) = (std::time::SystemTime::now(), process_cpu_ns());
    tokio::time::sleep(std::time::Duration::from_secs(1)).await;
    let inner_cpu = process_cpu_ns() - inner_start;
    let inner_to = std::time::SystemTime::now();
    let pprof = request.await.expect("profile request");
    assert_eq!(pprof.status(), 200);
    let cpu_used = process_cpu_ns() - cpu_before;
    let p = decode(&pprof.bytes().await.expect("body"));
    // The profile's CPU is the process's CPU over its window: no more than the process
    // used over the whole request (which also covers symbolizing, encoding and the HTTP
    // exchange, a share that grows when a loaded machine gives the spinner less), and no
    // less than it used over a stretch inside the window.
    let unix_ns = |t: std::time::SystemTime| {
        t.duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| i64::try_from(d.as_nanos()).unwrap_or(i64::MAX))
    };
    assert!(
        p.time_nanos <= unix_ns(inner_from) && unix_ns(inner_to) <= p.time_nanos + p.duration_nanos,
        "the measured stretch fell outside the profile's window"
    );
    let profiled: i64 = p.sample.iter().map(|s| s.value[1]).sum();
    assert!(
        profiled <= cpu_used && profiled * 100 >= inner_cpu * 99,
        "profile says {profiled} ns of CPU; the process used {cpu_used} ns over the request, {inner_cpu} ns over 1 s inside the window"
    );
    assert!(
        p.period > 0 && p.period <= 1_000_000_000 / 100,
        "{}",
        p.period
    );
    let names = function_names(&p);
    assert!(
        names.iter().any(|n| n.contains("selfprof_test_spin")),
        "{names:?}"
    );
    let samples: i64 = p.sample.iter().map(|s| s.value[0]).sum();
    // 2 s at 199 Hz of one busy thread is ~400; the 2 cores are shared.
    assert!(samples >= 40, "{samples} samples");

    let svg = http
        .get(format!(
            "http://{addr}/debug/pprof/profile?seconds=1&format=svg"
        ))
        .send()
        .await
        .expect("GET svg");
    assert_eq!(svg.status(), 200);
    assert_eq!(
        svg.headers()["content-type"].to_str().expect("ascii"),
        "image/svg+xml"
    );
    let text = svg.text().await.expect("svg text");
    assert!(
        text.starts_with("<?xml"),
        "{}",
        &text[..text.len().min(200)]
    );
    assert!(text.contains("selfprof_test_spin"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_profile_is_refused_unless_forced() {
    let _serial = serial().await;
    let (addr, profiler) = serve().await;
    let _spin = Spinner::start();
    let http = reqwest::Client::new();
    let first = {
        let http = http.clone();
        tokio::spawn(async move {
            let r = http
                .get(format!("http://{addr}/debug/pprof/profile?seconds=120"))
                .send()
                .await
                .expect("GET first");
            (r.status(), r.bytes().await.expect("body"))
        })
    };
    // The first profile samples from here on (its readiness signal, no sleep).
    profiler.wait_started(1).await;
    let refused = http
        .get(format!("http://{addr}/debug/pprof/profile?seconds=1"))
        .send()
        .await
        .expect("GET second");
    assert_eq!(refused.status(), 409);
    let text = refused.text().await.expect("text");
    assert!(text.contains("force=true"), "{text}");

    let bad = http
        .get(format!("http://{addr}/debug/pprof/profile?seconds=0"))
        .send()
        .await
        .expect("GET bad");
    assert_eq!(bad.status(), 400);

    // Forced: the 120 s profile ends now with what it sampled, and this one runs.
    let forced = http
        .get(format!(
            "http://{addr}/debug/pprof/profile?seconds=1&force=true"
        ))
        .send()
        .await
        .expect("GET forced");
    assert_eq!(forced.status(), 200);
    let (status, body) = first.await.expect("first request");
    assert_eq!(status, 200);
    let first = decode(&body);
    assert!(
        first.duration_nanos < 60_000_000_000,
        "the forced-out profile ended early: {} ns",
        first.duration_nanos
    );
    decode(&forced.bytes().await.expect("body"));

    let heap = http
        .get(format!("http://{addr}/debug/pprof/heap"))
        .send()
        .await
        .expect("GET heap");
    // This test binary links jemalloc but does not switch its profiler on.
    assert_eq!(heap.status(), 501);
    let text = heap.text().await.expect("text");
    assert!(text.contains("opt.prof=false"), "{text}");
}
