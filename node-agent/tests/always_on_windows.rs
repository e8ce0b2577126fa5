//! Always-on windows ([`flamefleet_agent::continuous`]) on real eBPF, real processes and
//! real cgroups laid out as the kubelet lays them out: the sampled spans of a pod's
//! consecutive windows follow each other with no gap beyond the configured one, on a fixed
//! cadence (no drift from one window's processing to the next), across a change of the set
//! too, and each window holds samples.
//!
//! Synchronized on the windows themselves (each arrives on the engine's stream when it
//! ends); the bounds below are on what the windows say, never sleeps.

mod support;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::Command;
use std::sync::mpsc;
use std::time::Duration;

use flamefleet_agent::capture::SamplerConfig;
use flamefleet_agent::cgroup::{Cgroup, CgroupRoot};
use flamefleet_agent::continuous::Continuous;
use flamefleet_agent::process::ProcessCatalog;
use flamefleet_proto::agent::{
    ContinuousPod, ContinuousRequest, Target, WindowProfile, continuous_event,
};
use support::{TestCgroup, compile_c, require_root, serial};

const SPIN: &str = r#"
static volatile unsigned long sink;
__attribute__((noinline)) void ff_always_spin(void) { for (int i = 0; i < 100000; i++) sink += i; }
int main(void) { for (;;) ff_always_spin(); }
"#;

/// How far a window's end may be from its cadence point: the windows' thread waking late on
/// a loaded machine. Not a gap: in contiguous windows the next one starts at that same
/// instant whatever it is.
const WAKE: i64 = 250;

/// A pod cgroup `kubepods/burstable/pod<uid>` under the test's root, its spinner in it.
struct Pods {
    pods: Vec<TestCgroup>,
    dirs: Vec<PathBuf>,
    root: TestCgroup,
}

impl Drop for Pods {
    fn drop(&mut self) {
        self.pods.clear();
        for d in self.dirs.iter().rev() {
            let _ = std::fs::remove_dir(d);
        }
        let _ = &self.root;
    }
}

fn uid(i: usize) -> String {
    format!("0000a11b-0000-4000-8000-{:012x}", i + 1)
}

fn request(pods: usize, window_ms: u32, period_ms: u32) -> ContinuousRequest {
    ContinuousRequest {
        pods: (0..pods)
            .map(|i| ContinuousPod {
                policy_uids: vec!["test-policy".into()],
                target: Some(Target {
                    pod_uid: uid(i),
                    namespace: "always".into(),
                    pod_name: format!("pod-{i}"),
                    ..Target::default()
                }),
                frequency_hz: 199,
            })
            .collect(),
        window_ms,
        period_ms,
        max_profile_bytes: 0,
    }
}

/// The windows that arrived, per pod, in order.
#[derive(Default)]
struct Received(BTreeMap<String, Vec<WindowProfile>>);

impl Received {
    /// Takes windows off `rx` until every pod of `pods` has `n` windows that started at
    /// `since_ms` or later.
    fn until(
        &mut self,
        rx: &mpsc::Receiver<WindowProfile>,
        pods: &[&str],
        n: usize,
        since_ms: i64,
    ) {
        while pods.iter().any(|p| self.since(p, since_ms).len() < n) {
            let w = rx
                .recv_timeout(Duration::from_secs(30))
                .expect("a window within 30 s");
            assert!(w.error.is_empty(), "{}: {}", w.pod_name, w.error);
            self.0.entry(w.pod_name.clone()).or_default().push(w);
        }
    }

    /// The windows of `pod` that started at `since_ms` or later, in order.
    fn since(&self, pod: &str, since_ms: i64) -> Vec<WindowProfile> {
        let mut ws: Vec<WindowProfile> = self
            .0
            .get(pod)
            .map_or(&[][..], Vec::as_slice)
            .iter()
            .filter(|w| w.start_unix_ms >= since_ms)
            .cloned()
            .collect();
        ws.sort_by_key(|w| w.start_unix_ms);
        ws
    }
}

fn unix_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64)
}

fn spans(ws: &[WindowProfile]) -> String {
    ws.iter()
        .map(|w| {
            format!(
                "[{} +{} ms, {} samples]",
                w.start_unix_ms, w.duration_ms, w.samples
            )
        })
        .collect::<Vec<_>>()
        .join(" ")
}

fn end(w: &WindowProfile) -> i64 {
    w.start_unix_ms + i64::from(w.duration_ms)
}

#[test]
fn consecutive_windows_leave_no_gap_beyond_the_configured_one() {
    require_root();
    let _serial = serial();
    let tmp = tempfile::tempdir().expect("tempdir");
    let program = compile_c(tmp.path(), "ffalwaysspin", SPIN);
    let root = TestCgroup::new("always-on");
    let mut fixture = Pods {
        pods: Vec::new(),
        dirs: Vec::new(),
        root,
    };
    for d in ["kubepods", "kubepods/burstable"] {
        let dir = fixture.root.path().join(d);
        std::fs::create_dir(&dir).expect("creating the QoS cgroups");
        fixture.dirs.push(dir);
    }
    for i in 0..3 {
        let dir = fixture
            .root
            .path()
            .join(format!("kubepods/burstable/pod{}", uid(i)));
        std::fs::create_dir(&dir).expect("creating a pod cgroup");
        let mut pod = TestCgroup::adopt(Cgroup::open(&dir).expect("the pod cgroup"));
        pod.spawn(&mut Command::new(&program));
        fixture.pods.push(pod);
    }
    let continuous = Continuous::new(
        CgroupRoot::at_or_under(fixture.root.path()).expect("the test's cgroup root"),
        SamplerConfig {
            node: "test".into(),
            ..SamplerConfig::default()
        },
        ProcessCatalog::new(),
    );
    let (tx, rx) = mpsc::channel();
    let forward = |mut stream: tokio::sync::mpsc::Receiver<_>| {
        let tx = tx.clone();
        std::thread::spawn(move || {
            while let Some(flamefleet_proto::agent::ContinuousEvent {
                event: Some(continuous_event::Event::Window(w)),
            }) = stream.blocking_recv()
            {
                if tx.send(w).is_err() {
                    return;
                }
            }
        })
    };
    let mut got = Received::default();

    // Contiguous windows (each the whole period) of two pods: each window starts where the
    // one before ended, to the millisecond, and they keep to the cadence.
    let t0 = unix_ms();
    let (_, _, stream) = continuous
        .replace(&request(2, 1000, 1000))
        .expect("the set");
    let first_stream = forward(stream);
    got.until(&rx, &["pod-0", "pod-1"], 5, t0);
    for pod in ["pod-0", "pod-1"] {
        let ws = &got.since(pod, t0);
        for pair in ws.windows(2) {
            assert_eq!(
                pair[1].start_unix_ms,
                end(&pair[0]),
                "{pod}: a gap or an overlap between contiguous windows: {}",
                spans(ws)
            );
        }
        for (k, w) in ws.iter().enumerate() {
            let drift = end(w) - (ws[0].start_unix_ms + 1000 * (k as i64 + 1));
            assert!(
                drift.abs() <= WAKE,
                "{pod}: window {k} ends {drift} ms off its cadence point: {}",
                spans(ws)
            );
            assert!(
                w.samples > 0,
                "{pod}: window {k} has no sample: {}",
                spans(ws)
            );
            assert_eq!(w.frequency_hz, 199);
        }
    }

    // A pod joins: the new set's capture starts before the old one's windows end, so the
    // pods that stay are sampled throughout: their windows meet or overlap by the time the
    // new capture took to start (milliseconds here; bounded loosely for a loaded machine),
    // never leave a gap.
    let t1 = unix_ms();
    let (_, _, stream) = continuous
        .replace(&request(3, 1000, 1000))
        .expect("the set with a third pod");
    let second_stream = forward(stream);
    got.until(&rx, &["pod-0", "pod-1", "pod-2"], 3, t1);
    for pod in ["pod-0", "pod-1"] {
        // From the old set's last windows on.
        let sorted = got.since(pod, t1 - 2000);
        for pair in sorted.windows(2) {
            let gap = pair[1].start_unix_ms - end(&pair[0]);
            assert!(
                (-5000..=0).contains(&gap),
                "{pod}: {gap} ms between windows across the set's change: {}",
                spans(&sorted)
            );
        }
    }
    assert!(got.since("pod-2", t1).iter().all(|w| w.samples > 0));

    // Windows of one second every 1.5 s: half a second between a window's end and the
    // next one's start, not more, and each window its second.
    let t2 = unix_ms();
    let (session, _, stream) = continuous
        .replace(&request(3, 1000, 1500))
        .expect("the set with gaps");
    let third_stream = forward(stream);
    // The first window of the new set may be cut short by the cadence: judged from the
    // second on.
    got.until(&rx, &["pod-0", "pod-1", "pod-2"], 5, t2);
    for pod in ["pod-0", "pod-1", "pod-2"] {
        let ws = &got.since(pod, t2)[1..];
        for (k, w) in ws.iter().enumerate() {
            assert!(
                (i64::from(w.duration_ms) - 1000).abs() <= WAKE,
                "{pod}: window {k} sampled {} ms of 1000: {}",
                w.duration_ms,
                spans(ws)
            );
            assert!(
                w.samples > 0,
                "{pod}: window {k} has no sample: {}",
                spans(ws)
            );
        }
        for pair in ws.windows(2) {
            let gap = pair[1].start_unix_ms - end(&pair[0]);
            assert!(
                (500 - WAKE..=500 + WAKE).contains(&gap),
                "{pod}: {gap} ms between windows, expected 500: {}",
                spans(ws)
            );
            let step = pair[1].start_unix_ms - pair[0].start_unix_ms;
            assert!(
                (step - 1500).abs() <= WAKE,
                "{pod}: windows {step} ms apart, expected 1500: {}",
                spans(ws)
            );
        }
    }
    for pod in got.0.keys() {
        eprintln!("{pod}: {}", spans(&got.since(pod, t0)));
    }
    continuous.end(session);
    drop(rx);
    for t in [first_stream, second_stream, third_stream] {
        t.join().expect("the forwarding thread");
    }
}

/// What the windows stand on, on one held capture: paused, it samples nothing and its
/// window's span ends at the pause (a span is what was really sampled); a paused sampler
/// takes no other capture; resumed, it samples again; and the counts that stopped moving
/// (a process gone) leave the maps, with their stacks, so that a capture held for days
/// keeps only what it samples now.
#[test]
fn a_held_capture_samples_nothing_while_paused_and_drops_counts_that_stopped_moving() {
    use flamefleet_agent::capture::cpu::{CpuMapFill, CpuOptions};
    use flamefleet_agent::capture::{CaptureTarget, Samplers};

    require_root();
    let _serial = serial();
    let tmp = tempfile::tempdir().expect("tempdir");
    let program = compile_c(tmp.path(), "ffheldspin", SPIN);
    let mut busy = TestCgroup::new("held-busy");
    busy.spawn(&mut Command::new(&program));
    let other = TestCgroup::new("held-other");
    let samplers = Samplers::new(SamplerConfig::default());
    let options = CpuOptions {
        frequency: 499,
        ..CpuOptions::default()
    };
    let mut capture = samplers
        .start_cpu(&[CaptureTarget::raw(busy.cgroup.clone())], &options)
        .expect("the held capture");
    let sampler = std::sync::Arc::clone(capture.sampler());
    busy.wait_cpu(Duration::from_millis(200));
    let first_cut_at = std::time::Instant::now();
    let first = capture.cut().expect("the first window");
    assert!(first.total() > 0, "no sample in the first window");

    capture.pause().expect("pausing the sole capture");
    let paused_at = std::time::Instant::now();
    busy.wait_cpu(Duration::from_millis(300));
    let waited = paused_at.elapsed();
    assert!(
        samplers
            .start_cpu(&[CaptureTarget::raw(other.cgroup.clone())], &options)
            .is_err(),
        "a paused sampler took another capture"
    );
    // The window the pause ended runs from the first cut's read to the pause: the samples
    // of that instant are its own. Its span ends at the pause, not at this read.
    let ended = capture.cut().expect("the window ended by the pause");
    let to_pause = paused_at.duration_since(first_cut_at);
    assert!(
        ended.duration <= to_pause,
        "the window ended by the pause claims {:?} sampled; {to_pause:?} passed from its \
         start to the pause (and {waited:?} paused after it)",
        ended.duration
    );
    // A window wholly inside the pause: nothing sampled, nothing spanned.
    busy.wait_cpu(Duration::from_millis(100));
    let paused = capture.cut().expect("a window inside the pause");
    assert_eq!(
        paused.total(),
        0,
        "samples taken while paused ({:?} of a spinning process)",
        paused_at.elapsed()
    );
    assert_eq!(
        paused.duration,
        Duration::ZERO,
        "a paused window spans nothing"
    );

    capture.resume().expect("resuming");
    busy.wait_cpu(Duration::from_millis(200));
    let resumed = capture.cut().expect("the window after the pause");
    assert!(resumed.total() > 0, "no sample after resuming");

    busy.kill_all();
    // The samples up to the kill, then a window with none: every count stood still.
    capture.cut().expect("the window of the kill");
    let still = capture.cut().expect("a window with no process");
    assert_eq!(still.total(), 0);
    assert_eq!(
        sampler.map_fill(),
        CpuMapFill {
            targets: 1,
            ..CpuMapFill::default()
        },
        "counts or stacks of a gone process left in the maps of a held capture"
    );
    drop(capture);
}
