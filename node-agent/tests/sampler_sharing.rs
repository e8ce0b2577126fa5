//! One sampler per type per node: 100 target cgroups and 3 concurrent
//! captures cost exactly one perf event per online CPU, each capture gets
//! only its own samples back, and the sampler stops sampling with the last
//! capture (and unloads after its linger period).

mod support;

use std::collections::HashSet;
use std::process::Command;
use std::sync::Arc;
use std::time::Duration;

use flamefleet_agent::capture::cpu::{CpuOptions, CpuSamples};
use flamefleet_agent::capture::{CaptureTarget, SamplerConfig, Samplers};
use support::{TestCgroup, compile_c, require_root, serial, wait_until};

const SPIN: &str = r#"
static volatile unsigned long sink;
int main(void) { for (;;) sink++; }
"#;

/// Open perf-event fds of this process ("anon_inode:[perf_event]").
fn perf_event_fds() -> usize {
    std::fs::read_dir("/proc/self/fd")
        .unwrap()
        .flatten()
        .filter(|e| {
            std::fs::read_link(e.path())
                .map(|l| l.to_string_lossy() == "anon_inode:[perf_event]")
                .unwrap_or(false)
        })
        .count()
}

fn online_cpus() -> usize {
    let text = std::fs::read_to_string("/sys/devices/system/cpu/online").unwrap();
    text.trim()
        .split(',')
        .map(|p| match p.split_once('-') {
            Some((a, b)) => b.parse::<usize>().unwrap() - a.parse::<usize>().unwrap() + 1,
            None => 1,
        })
        .sum()
}

fn pids(r: &CpuSamples) -> HashSet<u32> {
    r.samples.iter().map(|s| s.tgid).collect()
}

#[test]
fn hundred_cgroups_three_captures_use_one_perf_event_per_cpu() {
    require_root();
    let _serial = serial();
    let dir = tempfile::tempdir().unwrap();
    let spin = compile_c(dir.path(), "ffspin", SPIN);
    let mut cgroups: Vec<TestCgroup> = (0..100)
        .map(|i| TestCgroup::new(&format!("scale{i}")))
        .collect();
    // One busy process in a cgroup only capture A targets, one only C targets.
    let pid_a = cgroups[5].spawn(&mut Command::new(&spin));
    let pid_c = cgroups[95].spawn(&mut Command::new(&spin));
    let targets: Vec<CaptureTarget> = cgroups
        .iter()
        .map(|c| CaptureTarget::raw(c.cgroup.clone()))
        .collect();
    assert_eq!(perf_event_fds(), 0, "no perf events before the captures");

    let samplers = Arc::new(Samplers::new(SamplerConfig::default()));
    let ranges = [0..40, 30..70, 60..100];
    // All three run at once: measured after every capture started and
    // before any finished.
    let barrier = Arc::new(std::sync::Barrier::new(ranges.len()));
    let handles: Vec<_> = ranges
        .iter()
        .cloned()
        .map(|range| {
            let samplers = samplers.clone();
            let barrier = barrier.clone();
            let mine = targets[range].to_vec();
            std::thread::spawn(move || {
                let c = samplers
                    .start_cpu(&mine, &CpuOptions::default())
                    .expect("start capture");
                let sampler = c.sampler().clone();
                barrier.wait();
                std::thread::sleep(Duration::from_secs(3));
                let fds = perf_event_fds();
                let cgroups_in_map = sampler.target_cgroups();
                barrier.wait();
                (
                    c.finish().expect("finish"),
                    fds,
                    sampler.perf_events(),
                    cgroups_in_map,
                )
            })
        })
        .collect();
    let results: Vec<_> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    let cpus = online_cpus();
    for (r, fds, perf_events, in_map) in &results {
        eprintln!(
            "capture: {} samples, {fds} perf fds, {perf_events} perf events, {in_map} cgroups in the map",
            r.total()
        );
        assert_eq!(*fds, cpus, "perf-event fds must equal the online CPUs");
        assert_eq!(*perf_events, cpus);
        assert_eq!(
            *in_map, 100,
            "all three captures' cgroups share one target map"
        );
    }
    let (a, b, c) = (&results[0].0, &results[1].0, &results[2].0);
    assert!(
        pids(a).contains(&pid_a) && !pids(a).contains(&pid_c),
        "A sees only its targets"
    );
    assert!(
        pids(c).contains(&pid_c) && !pids(c).contains(&pid_a),
        "C sees only its targets"
    );
    assert!(
        !pids(b).contains(&pid_a) && !pids(b).contains(&pid_c),
        "B targets neither"
    );
    assert!(
        a.total() > 20 && c.total() > 20,
        "A {} C {}",
        a.total(),
        c.total()
    );
    // The last capture stops the sampler: its owner thread closes the perf events.
    wait_until(
        "the sampler to close its perf events after the last capture",
        || perf_event_fds() == 0,
    );
    for c in &mut cgroups {
        c.kill_all();
    }
}

#[test]
fn a_capture_joining_later_gets_only_samples_from_after_it_started() {
    require_root();
    let _serial = serial();
    let dir = tempfile::tempdir().unwrap();
    let spin = compile_c(dir.path(), "ffspin", SPIN);
    let mut cg = TestCgroup::new("join");
    cg.spawn(&mut Command::new(&spin));
    let samplers = Samplers::new(SamplerConfig::default());
    let target = [CaptureTarget::raw(cg.cgroup.clone())];
    let first = samplers.start_cpu(&target, &CpuOptions::default()).unwrap();
    let started = cg.cpu_usage();
    // Windows are measured in the spinner's CPU time, not wall time: on a
    // loaded machine it may get a small share of a CPU.
    cg.wait_cpu(Duration::from_millis(1500));
    // Joins the running sampler (and its 200 Hz request yields to 99 Hz).
    let second = samplers
        .start_cpu(
            &target,
            &CpuOptions {
                frequency: 200,
                ..CpuOptions::default()
            },
        )
        .unwrap();
    assert!(
        Arc::ptr_eq(first.sampler(), second.sampler()),
        "one sampler per type"
    );
    // The first found the sampler idle (it makes the window's symbolization pass); the
    // second joined it (and skips the pass).
    assert!(first.opened_busy_spell());
    assert!(!second.opened_busy_spell());
    let before = cg.cpu_usage();
    // Samples the first capture alone should have: 99 Hz over the spinner's
    // CPU time before the second joined.
    let alone = (before - started).as_secs_f64() * 99.0;
    // ~150 samples: the 70% floor below is then ~3.7 standard deviations out.
    cg.wait_cpu(Duration::from_millis(1500));
    let second = second.finish().unwrap();
    // 99 Hz over the CPU time the spinner had while `second` ran.
    let expected = (cg.cpu_usage() - before).as_secs_f64() * 99.0;
    let first = first.finish().unwrap();
    eprintln!(
        "first {} samples, second {} ({expected:.0} expected from its CPU time)",
        first.total(),
        second.total()
    );
    assert_eq!(
        second.options.frequency, 99,
        "the running sampler's frequency is reported"
    );
    assert!(
        (second.total() as f64) <= 1.3 * expected + 5.0,
        "the joining capture must not inherit earlier counts: {} for {expected:.0} expected, the first capture has {}",
        second.total(),
        first.total()
    );
    assert!(
        second.total() as f64 >= 0.7 * expected,
        "it still gets its own samples: {} for {expected:.0} expected",
        second.total()
    );
    // Both saw the samples after the join; only the first saw those before.
    let earlier = first.total().saturating_sub(second.total()) as f64;
    assert!(
        earlier >= 0.7 * alone,
        "the first capture keeps its samples from before the join: {} vs {} ({earlier} earlier for {alone:.0} expected)",
        first.total(),
        second.total()
    );
}

/// Between captures the CPU sampler samples nothing (its perf events are closed) but stays
/// loaded for the linger period: a capture with the same options reuses it, one with
/// other options gets a fresh sampler running at what it asked for, and an idle sampler
/// is unloaded once the period has passed.
#[test]
fn an_idle_cpu_sampler_stays_loaded_with_its_perf_events_closed_until_the_linger_ends() {
    require_root();
    let _serial = serial();
    let dir = tempfile::tempdir().unwrap();
    let spin = compile_c(dir.path(), "ffspin", SPIN);
    let mut cg = TestCgroup::new("linger");
    cg.spawn(&mut Command::new(&spin));
    let target = [CaptureTarget::raw(cg.cgroup.clone())];
    let samplers = Samplers::new(SamplerConfig {
        cpu_sampler_linger: Duration::from_secs(3600),
        ..SamplerConfig::default()
    });
    let capture = |options: &CpuOptions| {
        let c = samplers.start_cpu(&target, options).unwrap();
        let sampler = c.sampler().clone();
        assert_eq!(perf_event_fds(), online_cpus(), "sampling while it runs");
        cg.wait_cpu(Duration::from_millis(300));
        (c.finish().unwrap(), sampler)
    };

    let (first, sampler) = capture(&CpuOptions::default());
    assert!(first.total() > 0, "the first capture has samples");
    assert_eq!(perf_event_fds(), 0, "no perf event open between captures");
    assert!(sampler.idle_for().is_some(), "idle, and still loaded");

    let (second, again) = capture(&CpuOptions::default());
    assert!(
        Arc::ptr_eq(&sampler, &again),
        "a capture with the same options reuses the idle sampler"
    );
    let expected = 0.3 * 99.0;
    assert!(
        second.total() as f64 >= 0.7 * expected && (second.total() as f64) <= 3.0 * expected,
        "the reused sampler samples again: {} samples for ~{expected:.0} expected",
        second.total()
    );

    let other = CpuOptions {
        frequency: 49,
        ..CpuOptions::default()
    };
    let (third, fresh) = capture(&other);
    assert!(
        !Arc::ptr_eq(&sampler, &fresh),
        "other options on an idle sampler load a fresh one"
    );
    assert_eq!(third.options.frequency, 49, "running at what was asked for");
    let old = Arc::downgrade(&sampler);
    drop((sampler, again));
    assert!(old.upgrade().is_none(), "the replaced sampler is unloaded");
    drop(fresh);
    drop(samplers);
    assert_eq!(perf_event_fds(), 0);

    // A short linger: the idle sampler is unloaded once it has passed.
    let samplers = Samplers::new(SamplerConfig {
        cpu_sampler_linger: Duration::from_millis(200),
        ..SamplerConfig::default()
    });
    let c = samplers.start_cpu(&target, &CpuOptions::default()).unwrap();
    let kept = Arc::downgrade(c.sampler());
    c.finish().unwrap();
    wait_until("the idle sampler to be unloaded after its linger", || {
        kept.upgrade().is_none()
    });
}
