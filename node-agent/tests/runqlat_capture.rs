//! runqlat on real processes in real cgroups: latencies under pinned CPU
//! hogs, agreement with libbpf-tools `runqlat -p`, and attribution to the
//! task that waits (not the waker, which libbpf-tools' `-c` tests).

mod support;

use std::io::{BufRead as _, BufReader, Read as _};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use flamefleet_agent::capture::runqlat::{
    Histogram, LatencyUnit, RunqlatOptions, RunqlatResult, StartStorage,
};
use flamefleet_agent::capture::{CaptureTarget, RunqlatClock, SamplerConfig, Samplers};
use support::{
    Decoded, TestCgroup, compile_c, pinned, pprof_top, require_root, serial, wait_switches,
    wait_until,
};

/// Sleeps 1 ms in a loop: about 1,000 wake-ups per second.
const SLEEPER: &str = r#"
#include <time.h>
int main(void) {
    struct timespec ms = {0, 1000000};
    for (;;) nanosleep(&ms, 0);
}
"#;

const HOG: &str = r#"
static volatile unsigned long sink;
int main(void) { for (;;) sink++; }
"#;

/// Parent (waker) writes a byte every 2 ms to a child (wakee) blocked in
/// read(); with argv[1] the child is moved to that cgroup first.
const PIPE_PAIR: &str = r#"
#include <stdio.h>
#include <time.h>
#include <unistd.h>
int main(int argc, char **argv) {
    int p[2];
    if (pipe(p)) return 1;
    pid_t pid = fork();
    if (pid == 0) {
        FILE *f = fopen(argv[1], "w");
        if (!f) return 2;
        fprintf(f, "0");
        fclose(f);
        char c;
        while (read(p[0], &c, 1) == 1) {}
        return 0;
    }
    struct timespec t = {0, 2000000};
    for (;;) { nanosleep(&t, 0); if (write(p[1], "x", 1) != 1) return 3; }
}
"#;

fn capture(
    samplers: &Samplers,
    target: &TestCgroup,
    options: RunqlatOptions,
    secs: u64,
) -> RunqlatResult {
    let c = samplers
        .start_runqlat(&[CaptureTarget::raw(target.cgroup.clone())], &options)
        .expect("start runqlat capture");
    std::thread::sleep(Duration::from_secs(secs));
    c.finish().expect("finish runqlat capture")
}

/// Asserts that two clocks counted the same waits within 5%, over at least `min` of them
/// on the reference side (`b`).
fn assert_counts_agree(a_name: &str, a: u64, b_name: &str, b: u64, min: u64) {
    let (a, b) = (a as f64, b as f64);
    assert!(b > min as f64, "too few waits to compare: {b}");
    assert!(
        (a - b).abs() <= 0.05 * b,
        "counts differ: {a_name} {a}, {b_name} {b}"
    );
}

fn total(r: &RunqlatResult) -> Histogram {
    r.per_target().remove(0)
}

#[test]
fn pinned_hogs_raise_latency_into_the_expected_range() {
    require_root();
    let _serial = serial();
    let dir = tempfile::tempdir().unwrap();
    let sleeper = compile_c(dir.path(), "ffsleeper", SLEEPER);
    let hog = compile_c(dir.path(), "ffhog", HOG);
    let samplers = Samplers::new(SamplerConfig::default());
    let mut target = TestCgroup::new("rq-target");
    let pid = target.spawn(&mut pinned(1, &sleeper, &[]));
    // Running (its waits have begun), however loaded the machine is.
    wait_switches(pid, 10);
    let quiet = total(&capture(&samplers, &target, RunqlatOptions::default(), 2));

    // Under load we watch a CPU-bound task of the target kind that shares CPU 1 with two
    // hogs: every time it is preempted it waits in the run queue for their slices. (A
    // sleeper is a poor probe for this: EEVDF lets a short sleeper preempt the hogs on
    // wakeup, so its waits stay in microseconds whatever the load — seen on 6.18.)
    let mut hogs = TestCgroup::new("rq-hogs");
    for _ in 0..2 {
        hogs.spawn(&mut pinned(1, &hog, &[]));
    }
    let mut busy = TestCgroup::new("rq-busy");
    busy.spawn(&mut pinned(1, &hog, &[]));
    hogs.wait_cpu(Duration::from_millis(50));
    busy.wait_cpu(Duration::from_millis(20));
    let result = capture(&samplers, &busy, RunqlatOptions::default(), 3);
    let loaded = total(&result);
    let q50 = quiet.quantile(0.5).unwrap_or(0.0);
    let l50 = loaded.quantile(0.5).unwrap_or(0.0);
    eprintln!(
        "quiet sleeper: {} waits, p50 {q50:.0} us\n{}",
        quiet.count(),
        quiet.render(LatencyUnit::Micros)
    );
    eprintln!(
        "busy task with two hogs on its CPU: {} waits, p50 {l50:.0} us\n{}",
        loaded.count(),
        loaded.render(LatencyUnit::Micros)
    );
    assert!(
        quiet.count() > 1000,
        "expected ~1000 wake-ups/s, got {}",
        quiet.count()
    );
    assert!(
        loaded.count() > 300,
        "a task sharing its CPU with two hogs is preempted many times a second: {}",
        loaded.count()
    );
    assert!(
        q50 < 100.0,
        "without hogs the median wait should be under 100 us, got {q50:.0} us"
    );
    // Preempted, it waits for the hogs' slices: from a fraction of a millisecond up to a
    // few scheduler periods.
    let p90 = loaded.quantile(0.9).unwrap_or(0.0);
    assert!(
        (250.0..=50_000.0).contains(&p90),
        "expected the p90 wait between 250 us and 50 ms with hogs, got {p90:.0} us"
    );
    assert!(
        p90 > 5.0 * quiet.quantile(0.9).unwrap_or(1.0),
        "hogs must raise latency"
    );

    // pprof: count + nanoseconds sample types, bucket bounds as numeric labels.
    let out = dir.path().join("rq.pb.gz");
    flamefleet_agent::cli::write_profile(&out, &result.to_profile("node-a")).unwrap();
    let d = Decoded::read(&out);
    let types: Vec<_> = d
        .profile
        .sample_type
        .iter()
        .map(|t| (d.string(t.r#type), d.string(t.unit)))
        .collect();
    assert_eq!(types, [("count", "count"), ("latency", "nanoseconds")]);
    let mut sum = 0;
    for s in &d.profile.sample {
        let lo = d.num_label(s, "bucket_low").expect("bucket_low label");
        let hi = d.num_label(s, "bucket_high").expect("bucket_high label");
        assert!(lo < hi);
        sum += s.value[0];
    }
    assert_eq!(sum as u64, loaded.count());
    let top = pprof_top(&out, &["-sample_index=count"]);
    assert!(top.contains("runqlat ["), "{top}");
    let text = result.text();
    assert!(text.contains("usecs") && text.contains("p99"), "{text}");
}

/// Runs libbpf-tools' runqlat for `secs` on `pid` and parses its histogram.
fn libbpf_runqlat(args: &[&str], secs: u64, during: impl FnOnce()) -> Vec<u64> {
    let mut child = Command::new("stdbuf")
        .args(["-oL", "/usr/sbin/runqlat"])
        .args(args)
        .arg(secs.to_string())
        .arg("1")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("running /usr/sbin/runqlat (install libbpf-tools)");
    let mut out = BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    while out.read_line(&mut line).unwrap_or(0) > 0 && !line.contains("Tracing") {
        line.clear();
    }
    assert!(line.contains("Tracing"), "runqlat did not start: {line}");
    during();
    let mut rest = String::new();
    out.read_to_string(&mut rest).unwrap();
    let status = child.wait().unwrap();
    assert!(status.success(), "runqlat failed: {rest}");
    let mut slots = vec![0u64; 27];
    for l in rest.lines() {
        // "      4 -> 7          : 12       |****   |"
        let Some((range, tail)) = l.split_once(':') else {
            continue;
        };
        let Some((lo, _)) = range.split_once("->") else {
            continue;
        };
        let (Ok(lo), Some(Ok(n))) = (
            lo.trim().parse::<u64>(),
            tail.split_whitespace().next().map(str::parse::<u64>),
        ) else {
            continue;
        };
        let slot = if lo == 0 {
            0
        } else {
            lo.trailing_zeros() as usize
        };
        slots[slot.min(26)] += n;
    }
    slots
}

/// Our capture of `target` and libbpf-tools' runqlat (with `args`) over the
/// same `secs`-second window: our sampler is loaded first (on an empty
/// cgroup) so that our capture starts as soon as runqlat reports it traces.
fn side_by_side(target: &TestCgroup, args: &[&str], secs: u64) -> (Histogram, Vec<u64>) {
    let samplers = Samplers::new(SamplerConfig::default());
    let warm = TestCgroup::new("rq-warm");
    let _keep = samplers
        .start_runqlat(
            &[CaptureTarget::raw(warm.cgroup.clone())],
            &RunqlatOptions::default(),
        )
        .expect("start runqlat sampler");
    let mut ours = None;
    let theirs = libbpf_runqlat(args, secs, || {
        let c = samplers
            .start_runqlat(
                &[CaptureTarget::raw(target.cgroup.clone())],
                &RunqlatOptions::default(),
            )
            .expect("start capture");
        std::thread::sleep(Duration::from_secs(secs));
        ours = Some(c.finish().expect("finish"));
    });
    let ours = ours.expect("our capture ran");
    // Where the ends of our waits came from (node-wide), to tell a failure's cause.
    eprintln!("our clock: {:?}", ours.clock);
    (total(&ours), theirs)
}

/// What the kernel said when it marked its scheduler clock unstable, if it did: the TSC
/// found unstable (by the clocksource watchdog, at boot, or by `tsc=unstable`) makes a
/// TSC-based scheduler clock unstable too (`tsc: Marking TSC unstable ...`, and
/// `sched_clock: Marking unstable ...` once it had been marked stable). Our waits are measured on the scheduler's
/// run-queue clock, libbpf-tools' on ktime: on an unstable scheduler clock the run-queue
/// clock is a per-CPU clock held within a tick of the last timer tick, and after the CPU
/// went without ticks (a stalled virtual CPU) it stamps waits early by up to the stall,
/// so the two tools measure the same waits on clocks that disagree by milliseconds.
fn sched_clock_unstable() -> Option<String> {
    use std::os::unix::fs::OpenOptionsExt as _;
    let mut kmsg = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open("/dev/kmsg")
        .expect("reading the kernel log (/dev/kmsg, as root)");
    let mut said = None;
    // One record per read ("prio,seq,time,flags;message"), until none is left.
    let mut record = vec![0u8; 8192];
    loop {
        match kmsg.read(&mut record) {
            Ok(0) => break,
            Ok(n) => {
                let text = String::from_utf8_lossy(&record[..n]);
                if let Some((_, msg)) = text.split_once(';')
                    && (msg.starts_with("sched_clock: Marking unstable")
                        || msg.starts_with("tsc: Marking TSC unstable"))
                {
                    said = Some(msg.trim().to_owned());
                }
            }
            // EPIPE: a record was overwritten while we read; the next read goes on.
            Err(e) if e.raw_os_error() == Some(libc::EPIPE) => {}
            Err(_) => break,
        }
    }
    said
}

#[test]
fn agrees_with_libbpf_tools_runqlat_for_one_process() {
    require_root();
    let _serial = serial();
    let dir = tempfile::tempdir().unwrap();
    let sleeper = compile_c(dir.path(), "ffsleeper", SLEEPER);
    let hog = compile_c(dir.path(), "ffhog", HOG);
    let mut target = TestCgroup::new("rq-cmp");
    let pid = target.spawn(&mut pinned(1, &sleeper, &[]));
    let mut hogs = TestCgroup::new("rq-cmp-hog");
    hogs.spawn(&mut pinned(1, &hog, &[]));
    wait_switches(pid, 10);
    hogs.wait_cpu(Duration::from_millis(20));

    // 8 s: under QEMU without KVM (the guest tier) 4 s held fewer than 1,000 waits.
    let (ours, theirs) = side_by_side(&target, &["-p", &pid.to_string()], 8);
    let theirs = Histogram {
        target: 0,
        tgid: None,
        comm: String::new(),
        slots: theirs,
    };
    eprintln!(
        "ours: {}\n{}",
        ours.count(),
        ours.render(LatencyUnit::Micros)
    );
    eprintln!(
        "libbpf-tools: {}\n{}",
        theirs.count(),
        theirs.render(LatencyUnit::Micros)
    );
    // The comparison holds on one clock only (see sched_clock_unstable).
    if let Some(said) = sched_clock_unstable() {
        panic!(
            "this kernel's scheduler clock is unstable ({said:?}): our waits (run-queue clock) and libbpf-tools' (ktime) are on clocks that disagree by up to a stall, and cannot be compared (the guest tier boots its TCG guests with tsc=reliable: their TSC is the host's, which the clocksource watchdog misjudges when the host deschedules a vCPU between its reads)"
        );
    }
    let (a, b) = (ours.count() as f64, theirs.count() as f64);
    assert!(b > 1000.0, "runqlat -p saw too few waits: {b}");
    // The two windows line up within a few milliseconds of eight seconds.
    eprintln!(
        "runqlat agreement: ours {a}, libbpf-tools {b}, gap {:+.2}%",
        100.0 * (a - b) / b
    );
    assert!(
        (a - b).abs() <= 0.02 * b,
        "total counts differ by more than 2%: ours {a}, libbpf-tools {b}"
    );
    let (ma, mb) = (
        ours.median_bucket().unwrap(),
        theirs.median_bucket().unwrap(),
    );
    assert!(
        ma.abs_diff(mb) <= 1,
        "median buckets differ by more than one: ours {ma}, libbpf-tools {mb}"
    );
}

#[test]
fn waits_are_attributed_to_the_waiting_task_not_the_waker() {
    require_root();
    let _serial = serial();
    let dir = tempfile::tempdir().unwrap();
    let pair = compile_c(dir.path(), "ffpipepair", PIPE_PAIR);
    let mut waker = TestCgroup::new("rq-waker");
    let wakee = TestCgroup::new("rq-wakee");
    let procs = wakee.path().join("cgroup.procs");
    waker.spawn(Command::new(&pair).arg(&procs));
    wait_until("the reader to move to the wakee cgroup", || {
        wakee.cgroup.procs().is_ok_and(|p| p.len() == 1)
    });

    let (ours, theirs) = side_by_side(&wakee, &["-c", wakee.path().to_str().unwrap()], 3);
    let ours = ours.count();
    let theirs: u64 = theirs.iter().sum();
    eprintln!("wakee cgroup: ours {ours} waits, libbpf-tools -c {theirs}");
    // The reader is woken ~500 times per second by the writer in the other
    // cgroup: we see those waits; runqlat -c (which checks the waker's
    // cgroup) sees almost none of them.
    assert!(
        ours >= 1000,
        "expected ~1500 waits of the reader, got {ours}"
    );
    assert!(
        (theirs as f64) < 0.2 * ours as f64,
        "libbpf-tools -c should miss the reader's waits (waker in another cgroup): {theirs} vs ours {ours}"
    );
}

/// Loads each registry's runqlat sampler for an empty cgroup and keeps it loaded while
/// the returned guard lives, so that the captures a test starts next line up in time.
fn warm(registries: &[&Samplers], name: &str, opts: &RunqlatOptions) -> Warm<impl Sized + use<>> {
    let cgroup = TestCgroup::new(name);
    let w = [CaptureTarget::raw(cgroup.cgroup.clone())];
    Warm {
        _captures: registries
            .iter()
            .map(|r| r.start_runqlat(&w, opts).unwrap())
            .collect(),
        _cgroup: cgroup,
    }
}

/// Fields drop in order: the captures end before their cgroup goes.
struct Warm<T> {
    _captures: Vec<T>,
    _cgroup: TestCgroup,
}

fn samplers_with(clock: RunqlatClock) -> Samplers {
    Samplers::new(SamplerConfig {
        runqlat_clock: clock,
        ..SamplerConfig::default()
    })
}

#[test]
fn the_four_timestamp_sources_agree() {
    require_root();
    let _serial = serial();
    let dir = tempfile::tempdir().unwrap();
    let sleeper = compile_c(dir.path(), "ffsleeper", SLEEPER);
    let mut target = TestCgroup::new("rq-storage");
    let pid = target.spawn(&mut pinned(0, &sleeper, &[]));
    wait_switches(pid, 10);
    // Four registries: four samplers, one per source of "became runnable" times.
    let hybrid = Samplers::new(SamplerConfig::default());
    let sched_info = samplers_with(RunqlatClock::Scheduler);
    let task = samplers_with(RunqlatClock::Own);
    let hash = Samplers::new(SamplerConfig {
        force_start_hash: true,
        ..SamplerConfig::default()
    });
    let t = [CaptureTarget::raw(target.cgroup.clone())];
    let ms = RunqlatOptions {
        per_process: true,
        unit: LatencyUnit::Millis,
    };
    let _warm = warm(
        &[&hybrid, &sched_info, &task, &hash],
        "rq-storage-warm",
        &ms,
    );
    let y = hybrid.start_runqlat(&t, &ms).unwrap();
    let s = sched_info.start_runqlat(&t, &ms).unwrap();
    let a = task.start_runqlat(&t, &ms).unwrap();
    let b = hash.start_runqlat(&t, &ms).unwrap();
    assert_eq!(y.sampler().storage(), StartStorage::Hybrid);
    assert_eq!(s.sampler().storage(), StartStorage::SchedInfo);
    assert_eq!(a.sampler().storage(), StartStorage::TaskStorage);
    assert_eq!(b.sampler().storage(), StartStorage::HashMap);
    std::thread::sleep(Duration::from_secs(2));
    let (ry, rs, ra, rb) = (
        y.finish().unwrap(),
        s.finish().unwrap(),
        a.finish().unwrap(),
        b.finish().unwrap(),
    );
    let (ny, ns, na, nb) = (
        total(&ry).count() as f64,
        total(&rs).count() as f64,
        total(&ra).count() as f64,
        total(&rb).count() as f64,
    );
    eprintln!("hybrid {ny}, sched_info {ns}, task storage {na}, hash map {nb}");
    assert!(
        na > 1000.0
            && (na - nb).abs() <= 0.05 * na
            && (na - ns).abs() <= 0.05 * na
            && (na - ny).abs() <= 0.05 * na,
        "hybrid {ny} vs sched_info {ns} vs task {na} vs hash {nb}"
    );
    // Only the hybrid variant counts where the ends of its waits came from.
    let clock = ry
        .clock
        .expect("the hybrid variant reports its clock counters");
    // The histograms and the clock counters are two maps read one after the other while
    // the program runs on (the warm capture keeps it attached): a wait between the two
    // reads, at the start or at the end, is in one and not the other. The sleeper waits
    // about once a millisecond, so on a loaded machine a few of them can fall in between.
    let gap = (clock.waits as f64 - ny).abs();
    assert!(
        gap <= (0.01 * ny).max(3.0),
        "{gap} apart: {clock:?} vs {ny}"
    );
    assert!(rs.clock.is_none() && ra.clock.is_none() && rb.clock.is_none());
    // Per-process, in milliseconds: one histogram for the sleeper, all < 2 ms.
    for r in [&ry, &rs, &ra] {
        assert_eq!(r.histograms.len(), 1, "{:?}", r.histograms);
        assert_eq!(r.histograms[0].comm, "ffsleeper");
        assert!(r.histograms[0].slots[0] as f64 >= 0.95 * na);
        assert!(r.text().contains("msecs") && r.text().contains("pid = "));
    }
}

/// The scheduler's clock (`--runqlat-clock scheduler`) against our own on waits behind
/// other tasks (a CPU-bound task sharing its CPU with two hogs, milliseconds per wait):
/// same waits, same distribution. (On microsecond waits that end in a wakeup preemption it
/// reads short, by design: docs/capture.md.)
#[test]
fn scheduler_clock_agrees_on_waits_behind_other_tasks() {
    require_root();
    let _serial = serial();
    let dir = tempfile::tempdir().unwrap();
    let hog = compile_c(dir.path(), "ffhog", HOG);
    let mut hogs = TestCgroup::new("rq-sched-hogs");
    for _ in 0..2 {
        hogs.spawn(&mut pinned(1, &hog, &[]));
    }
    let mut busy = TestCgroup::new("rq-sched-busy");
    busy.spawn(&mut pinned(1, &hog, &[]));
    hogs.wait_cpu(Duration::from_millis(50));
    busy.wait_cpu(Duration::from_millis(20));
    let scheduler = samplers_with(RunqlatClock::Scheduler);
    let own = samplers_with(RunqlatClock::Own);
    let t = [CaptureTarget::raw(busy.cgroup.clone())];
    let opts = RunqlatOptions::default();
    let _warm = warm(&[&scheduler, &own], "rq-sched-warm", &opts);
    let s = scheduler.start_runqlat(&t, &opts).unwrap();
    let o = own.start_runqlat(&t, &opts).unwrap();
    assert_eq!(s.sampler().storage(), StartStorage::SchedInfo);
    assert_eq!(o.sampler().storage(), StartStorage::TaskStorage);
    std::thread::sleep(Duration::from_secs(3));
    let (hs, ho) = (total(&s.finish().unwrap()), total(&o.finish().unwrap()));
    eprintln!(
        "scheduler clock: {} waits\n{}\nown clock: {} waits\n{}",
        hs.count(),
        hs.render(LatencyUnit::Micros),
        ho.count(),
        ho.render(LatencyUnit::Micros)
    );
    assert_counts_agree("scheduler", hs.count(), "own", ho.count(), 100);
    for q in [0.5, 0.9] {
        let (qs, qo) = (hs.quantile(q).unwrap_or(0.0), ho.quantile(q).unwrap_or(0.0));
        assert!(
            qs >= 0.5 * qo && qs <= 2.0 * qo,
            "p{}: scheduler {qs:.0} us, own {qo:.0} us",
            q * 100.0
        );
    }
}

/// The default (hybrid) clock against our own on waits that end in a wakeup: a 1 ms
/// sleeper sharing its CPU with a hog, both targets. Its waits end either on a CPU that was
/// idle or in a wakeup preemption of the hog, exactly where the scheduler's run-queue
/// clock is stale: the hybrid variant must read those from the clock (and correct the
/// preempted hog's queue stamp), and then agree with our own clock.
#[test]
fn hybrid_clock_reads_wakeup_waits_like_our_own_clock() {
    require_root();
    let _serial = serial();
    let dir = tempfile::tempdir().unwrap();
    let sleeper = compile_c(dir.path(), "ffsleeper", SLEEPER);
    let hog = compile_c(dir.path(), "ffhog", HOG);
    let mut target = TestCgroup::new("rq-hybrid");
    let pid = target.spawn(&mut pinned(1, &sleeper, &[]));
    target.spawn(&mut pinned(1, &hog, &[]));
    let hybrid = Samplers::new(SamplerConfig::default());
    let own = samplers_with(RunqlatClock::Own);
    let t = [CaptureTarget::raw(target.cgroup.clone())];
    let opts = RunqlatOptions::default();
    let _warm = warm(&[&hybrid, &own], "rq-hybrid-warm", &opts);
    let h = hybrid.start_runqlat(&t, &opts).unwrap();
    let o = own.start_runqlat(&t, &opts).unwrap();
    assert_eq!(h.sampler().storage(), StartStorage::Hybrid);
    assert_eq!(o.sampler().storage(), StartStorage::TaskStorage);
    // A window of the sleeper's own waits, whatever the machine's load.
    wait_switches(pid, 2000);
    let (rh, ro) = (h.finish().unwrap(), o.finish().unwrap());
    let (hh, ho) = (total(&rh), total(&ro));
    let clock = rh.clock.expect("hybrid clock counters");
    eprintln!(
        "hybrid: {} waits, {clock:?}\n{}\nown clock: {} waits\n{}",
        hh.count(),
        hh.render(LatencyUnit::Micros),
        ho.count(),
        ho.render(LatencyUnit::Micros)
    );
    assert_counts_agree("hybrid", hh.count(), "own", ho.count(), 1000);
    let a = hh.count() as f64;
    assert!(
        clock.clock_reads as f64 >= 0.2 * a,
        "expected most of the sleeper's waits to end on a stale run-queue clock: {clock:?}"
    );
    assert!(
        clock.uncalibrated * 100 <= clock.clock_reads,
        "the clock calibration came too late: {clock:?}"
    );
    let (ma, mb) = (hh.median_bucket().unwrap(), ho.median_bucket().unwrap());
    assert!(
        ma.abs_diff(mb) <= 1,
        "median buckets differ by more than one: hybrid {ma}, own {mb}"
    );
    for q in [0.5, 0.9] {
        let (qh, qo) = (hh.quantile(q).unwrap_or(0.0), ho.quantile(q).unwrap_or(0.0));
        assert!(
            qh >= 0.5 * qo && qh <= 2.0 * qo,
            "p{}: hybrid {qh:.0} us, own {qo:.0} us",
            q * 100.0
        );
    }
}

/// Two processes on two CPUs passing a byte back and forth, the parent pausing 100 µs
/// per round: each blocks while the other runs, so nearly every wait ends on a CPU that
/// was idle (the `perf bench sched pipe` case, at a bounded rate).
const PING_PONG: &str = r#"
#define _GNU_SOURCE
#include <sched.h>
#include <time.h>
#include <unistd.h>
static void pin(int cpu) {
    cpu_set_t s;
    CPU_ZERO(&s);
    CPU_SET(cpu, &s);
    sched_setaffinity(0, sizeof(s), &s);
}
int main(void) {
    int a[2], b[2];
    char c = 'x';
    if (pipe(a) || pipe(b)) return 1;
    if (fork() == 0) {
        pin(1);
        while (read(a[0], &c, 1) == 1)
            if (write(b[1], &c, 1) != 1) return 2;
        return 0;
    }
    pin(0);
    struct timespec t = {0, 100000};
    for (;;) {
        if (write(a[1], &c, 1) != 1 || read(b[0], &c, 1) != 1) return 3;
        nanosleep(&t, 0);
    }
}
"#;

/// Whether the kernel keeps PSI state for `cgroup` (psi=1 or a kernel that has it on by
/// default, and the cgroup's pressure accounting not switched off).
fn cgroup_psi_on(cgroup: &std::path::Path) -> bool {
    std::path::Path::new("/proc/pressure/cpu").exists()
        && cgroup.join("cpu.pressure").exists()
        && std::fs::read_to_string(cgroup.join("cgroup.pressure")).map_or(true, |v| v.trim() != "0")
}

/// The default clock on waits that end on a CPU that was idle: where the kernel keeps PSI
/// state, their end is PSI's stamp of the switch (no clock read), checked against the
/// clock and never rejected, and the histogram agrees with the clock-reading variant
/// (`hybrid-no-psi`) and with our own clock. Where it does not, every such wait reads the
/// clock. The window lasts until the samplers have counted enough waits that ended after
/// idle (`ClockStats::after_idle`): on a loaded machine the CPUs idle seldom, and a window
/// of a fixed number of switches may hold none.
#[test]
fn hybrid_clock_takes_psi_stamps_after_idle_and_agrees_with_the_clock() {
    require_root();
    let _serial = serial();
    let dir = tempfile::tempdir().unwrap();
    let ping_pong = compile_c(dir.path(), "ffpingpong", PING_PONG);
    let mut target = TestCgroup::new("rq-psi");
    let pid = target.spawn(&mut Command::new(&ping_pong));
    wait_switches(pid, 100);
    let hybrid = Samplers::new(SamplerConfig::default());
    let no_psi = samplers_with(RunqlatClock::HybridNoPsi);
    let own = samplers_with(RunqlatClock::Own);
    let t = [CaptureTarget::raw(target.cgroup.clone())];
    let opts = RunqlatOptions::default();
    let _warm = warm(&[&hybrid, &no_psi, &own], "rq-psi-warm", &opts);
    let h = hybrid.start_runqlat(&t, &opts).unwrap();
    let n = no_psi.start_runqlat(&t, &opts).unwrap();
    let o = own.start_runqlat(&t, &opts).unwrap();
    assert_eq!(h.sampler().storage(), StartStorage::Hybrid);
    assert_eq!(n.sampler().storage(), StartStorage::Hybrid);
    wait_switches(pid, 5000);
    // The samplers' own count of waits after idle (node-wide counters, but only this
    // test's targets are in these samplers), for both variants.
    const AFTER_IDLE: u64 = 1000;
    let before = [&h, &n].map(|c| c.sampler().clock_stats().expect("hybrid counters"));
    let after_idle = || {
        [&h, &n]
            .iter()
            .zip(&before)
            .map(|(c, b)| {
                c.sampler()
                    .clock_stats()
                    .map_or(0, |now| now.since(*b).after_idle)
            })
            .min()
            .unwrap_or(0)
    };
    let deadline = Instant::now() + Duration::from_secs(120);
    while after_idle() < AFTER_IDLE {
        assert!(
            Instant::now() < deadline,
            "in 2 minutes the targets' CPUs went idle before only {} of their waits (want {AFTER_IDLE}): the machine is saturated, and this test needs CPUs that idle now and then",
            after_idle()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let (rh, rn, ro) = (
        h.finish().unwrap(),
        n.finish().unwrap(),
        o.finish().unwrap(),
    );
    let (hh, hn, ho) = (total(&rh), total(&rn), total(&ro));
    let (ch, cn) = (
        rh.clock.expect("hybrid clock counters"),
        rn.clock.expect("hybrid-no-psi clock counters"),
    );
    // PSI's stamps are read with bpf_rdonly_cast (Linux 6.2+); before, waits after idle
    // read the clock even where the kernel keeps PSI state.
    let psi = cgroup_psi_on(&target.cgroup.path)
        && flamefleet_agent::capture::kernel::KernelFeatures::get()
            .rdonly_cast
            .found;
    eprintln!(
        "PSI stamps usable for the target: {psi}\nhybrid: {} waits, {ch:?}\n{}\nhybrid-no-psi: {} waits, {cn:?}\n{}\nown clock: {} waits\n{}",
        hh.count(),
        hh.render(LatencyUnit::Micros),
        hn.count(),
        hn.render(LatencyUnit::Micros),
        ho.count(),
        ho.render(LatencyUnit::Micros)
    );
    for (name, x) in [("hybrid", hh.count()), ("hybrid-no-psi", hn.count())] {
        assert_counts_agree(name, x, "own", ho.count(), 5000);
    }
    // Both samplers run on every switch of the node: their counters cover the same
    // events, whatever else runs.
    assert_eq!(cn.psi_stamps + cn.psi_checks + cn.psi_rejects, 0, "{cn:?}");
    // Without PSI stamps, every wait after idle reads the clock (so do the waits after a
    // wakeup preemption).
    assert!(
        cn.after_idle >= AFTER_IDLE && cn.clock_reads >= cn.after_idle,
        "expected every wait after idle to read the clock: {cn:?}"
    );
    if psi {
        // A check fails only when the hypervisor stops the vCPU between PSI's stamp and
        // the program: rare, never the rule.
        assert!(
            ch.after_idle >= AFTER_IDLE
                && ch.psi_stamps as f64 >= 0.2 * ch.after_idle as f64
                && ch.psi_checks > 0
                && ch.psi_rejects * 100 <= ch.psi_checks,
            "expected PSI stamps for the waits after idle, the checks passed: {ch:?}"
        );
        assert!(
            ch.clock_reads < cn.clock_reads,
            "PSI stamps saved no clock reads: {ch:?} vs {cn:?}"
        );
    } else {
        assert_eq!(ch.psi_stamps, 0, "no PSI, yet PSI stamps: {ch:?}");
    }
    for (name, x) in [("hybrid-no-psi", &hn), ("own", &ho)] {
        let (ma, mb) = (hh.median_bucket().unwrap(), x.median_bucket().unwrap());
        assert!(
            ma.abs_diff(mb) <= 1,
            "median buckets differ by more than one: hybrid {ma}, {name} {mb}"
        );
    }
    for q in [0.5, 0.9] {
        let (qh, qn) = (hh.quantile(q).unwrap_or(0.0), hn.quantile(q).unwrap_or(0.0));
        // Sub-microsecond waits land in the first bucket either way.
        assert!(
            qh <= 2.0 * qn.max(1.0) + 2.0 && qn <= 2.0 * qh.max(1.0) + 2.0,
            "p{}: hybrid {qh:.1} us, hybrid-no-psi {qn:.1} us",
            q * 100.0
        );
    }
}

/// A target whose cgroup has pressure accounting switched off (`cgroup.pressure` 0)
/// gets no PSI stamps: its waits after idle read the clock, on a calibrated CPU, even
/// though the kernel has PSI, and agree with the clock-reading variant.
#[test]
fn hybrid_clock_reads_the_clock_where_a_cgroup_turns_pressure_off() {
    require_root();
    let _serial = serial();
    let dir = tempfile::tempdir().unwrap();
    let sleeper = compile_c(dir.path(), "ffsleeper", SLEEPER);
    let mut target = TestCgroup::new("rq-psi-off");
    // Linux 6.1+ (cgroup.pressure); on an older kernel this fails rather than passing
    // without having tested anything.
    let knob = target.cgroup.path.join("cgroup.pressure");
    if let Err(e) = std::fs::write(&knob, "0") {
        panic!(
            "switching pressure accounting off with {} (Linux 6.1+): {e}",
            knob.display()
        );
    }
    let pid = target.spawn(&mut pinned(1, &sleeper, &[]));
    wait_switches(pid, 10);
    let hybrid = Samplers::new(SamplerConfig::default());
    let no_psi = samplers_with(RunqlatClock::HybridNoPsi);
    let t = [CaptureTarget::raw(target.cgroup.clone())];
    let opts = RunqlatOptions::default();
    let _warm = warm(&[&hybrid, &no_psi], "rq-psi-off-warm", &opts);
    let h = hybrid.start_runqlat(&t, &opts).unwrap();
    let n = no_psi.start_runqlat(&t, &opts).unwrap();
    wait_switches(pid, 2000);
    let (rh, rn) = (h.finish().unwrap(), n.finish().unwrap());
    let (hh, hn) = (total(&rh), total(&rn));
    let (ch, cn) = (rh.clock.unwrap(), rn.clock.unwrap());
    eprintln!(
        "hybrid: {ch:?}\n{}\nhybrid-no-psi: {cn:?}\n{}",
        hh.render(LatencyUnit::Micros),
        hn.render(LatencyUnit::Micros)
    );
    assert_counts_agree("hybrid", hh.count(), "hybrid-no-psi", hn.count(), 1000);
    let a = hh.count() as f64;
    assert_eq!(
        ch.psi_stamps, 0,
        "PSI stamps from a cgroup with pressure off: {ch:?}"
    );
    assert!(
        ch.clock_reads as f64 >= 0.2 * a && ch.uncalibrated * 100 <= ch.clock_reads,
        "expected the sleeper's waits read from a calibrated clock: {ch:?}"
    );
    let (ma, mb) = (hh.median_bucket().unwrap(), hn.median_bucket().unwrap());
    assert!(
        ma.abs_diff(mb) <= 1,
        "median buckets differ by more than one: hybrid {ma}, hybrid-no-psi {mb}"
    );
}
