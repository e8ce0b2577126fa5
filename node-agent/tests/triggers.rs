//! Trigger conditions on real processes in real cgroups (root): the watcher fires on what
//! the kernel counts (a CFS quota throttling a spinner, memory nearing a limit), carries
//! the measured value, holds a condition that stays true to its cooldown, and a memory fire
//! reads a leaking Go program's heap before the OOM killer kills it.
//!
//! The cgroups get real limits: in cgroup v2 where the controllers are there, in the v1
//! memory and cpu hierarchies on a hybrid host (where the kubelet puts them too).

mod support;

use std::collections::HashMap;
use std::io::{BufRead as _, BufReader};
use std::os::unix::process::{CommandExt as _, ExitStatusExt as _};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::mpsc::Receiver;
use std::time::{Duration, Instant};

use flamefleet_agent::capture::heap::HeapSourceUsed;
use flamefleet_agent::capture::{SamplerConfig, Samplers, TargetLabels};
use flamefleet_agent::cgroup::{Cgroup, CgroupRoot};
use flamefleet_agent::trigger::files::Hierarchies;
use flamefleet_agent::trigger::heap_now::capture_go_heap;
use flamefleet_agent::trigger::{
    Condition, Fire, MemoryEvent, TriggerSpec, WatchTarget, Watcher, WatcherConfig,
};
use support::{Decoded, require_root, serial};

/// How long a test waits for a fire the kernel's counters already justify.
const FIRE_WAIT: Duration = Duration::from_secs(60);

/// A cgroup with real limits: v2 controllers where the host has them, else the v1
/// hierarchies at the same relative path (a hybrid host). Removed on drop.
struct LimitedCgroup {
    cgroup: Cgroup,
    /// v1 directories created for it.
    v1: Vec<PathBuf>,
    children: Vec<Child>,
}

impl LimitedCgroup {
    fn new(name: &str, memory_max: Option<u64>, cpu_max: Option<(u64, u64)>) -> Self {
        static N: AtomicU32 = AtomicU32::new(0);
        let root = CgroupRoot::detect().expect("a cgroup2 mount");
        let h = Hierarchies::detect(&root);
        let rel = format!(
            "flamefleet-trigger-{name}-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        );
        let dir = root.path().join(&rel);
        std::fs::create_dir(&dir).unwrap_or_else(|e| panic!("creating {}: {e}", dir.display()));
        let controllers =
            std::fs::read_to_string(root.path().join("cgroup.controllers")).unwrap_or_default();
        let has = |c: &str| controllers.split_whitespace().any(|x| x == c);
        let mut me = Self {
            cgroup: Cgroup::open(&dir).expect("open cgroup"),
            v1: Vec::new(),
            children: Vec::new(),
        };
        let write = |path: PathBuf, value: &str| {
            std::fs::write(&path, value)
                .unwrap_or_else(|e| panic!("writing {value:?} to {}: {e}", path.display()))
        };
        if let Some(bytes) = memory_max {
            if has("memory") {
                write(root.path().join("cgroup.subtree_control"), "+memory");
                write(dir.join("memory.max"), &bytes.to_string());
                let _ = std::fs::write(dir.join("memory.swap.max"), "0");
            } else {
                let v1 = h.v1_memory.as_ref().expect(
                    "a memory controller: in cgroup v2 or a v1 memory hierarchy (mount one)",
                );
                let d = v1.join(&rel);
                std::fs::create_dir(&d).unwrap_or_else(|e| panic!("{}: {e}", d.display()));
                write(d.join("memory.limit_in_bytes"), &bytes.to_string());
                me.v1.push(d);
            }
        }
        if let Some((quota, period)) = cpu_max {
            if has("cpu") {
                write(root.path().join("cgroup.subtree_control"), "+cpu");
                write(dir.join("cpu.max"), &format!("{quota} {period}"));
            } else {
                let v1 = h
                    .v1_cpu
                    .as_ref()
                    .expect("a cpu controller: in cgroup v2 or a v1 cpu hierarchy (mount one)");
                let d = v1.join(&rel);
                std::fs::create_dir(&d).unwrap_or_else(|e| panic!("{}: {e}", d.display()));
                write(d.join("cpu.cfs_period_us"), &period.to_string());
                write(d.join("cpu.cfs_quota_us"), &quota.to_string());
                me.v1.push(d);
            }
        }
        me
    }

    /// Spawns `cmd` in every hierarchy of the cgroup, stdout piped.
    fn spawn(&mut self, cmd: &mut Command) -> &mut Child {
        use std::os::unix::ffi::OsStrExt as _;
        let procs: Vec<std::ffi::CString> = std::iter::once(&self.cgroup.path)
            .chain(&self.v1)
            .map(|d| {
                std::ffi::CString::new(d.join("cgroup.procs").as_os_str().as_bytes())
                    .expect("path without NUL")
            })
            .collect();
        // SAFETY: between fork and exec only async-signal-safe calls (open/write/close)
        // on memory prepared before the fork.
        unsafe {
            cmd.pre_exec(move || {
                for p in &procs {
                    let fd = libc::open(p.as_ptr(), libc::O_WRONLY);
                    if fd < 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                    let ok = libc::write(fd, b"0".as_ptr().cast(), 1) == 1;
                    libc::close(fd);
                    if !ok {
                        return Err(std::io::Error::last_os_error());
                    }
                }
                Ok(())
            });
        }
        let child = cmd
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("spawning {cmd:?}: {e}"));
        self.children.push(child);
        self.children.last_mut().expect("just pushed")
    }

    /// The kernel's OOM kill count of the cgroup.
    fn oom_kills(&self) -> u64 {
        let (file, key) = match self
            .v1
            .iter()
            .find(|d| d.join("memory.oom_control").exists())
        {
            Some(d) => (d.join("memory.oom_control"), "oom_kill"),
            None => (self.cgroup.path.join("memory.events"), "oom_kill"),
        };
        let text = std::fs::read_to_string(&file).expect("memory counters");
        flamefleet_agent::trigger::files::keyed(&text, key).expect("oom_kill counter")
    }

    fn target(&self, key: &str, triggers: Vec<TriggerSpec>) -> WatchTarget {
        WatchTarget {
            key: key.into(),
            cgroup: self.cgroup.clone(),
            triggers,
        }
    }
}

impl Drop for LimitedCgroup {
    fn drop(&mut self) {
        for c in &mut self.children {
            let _ = c.kill();
            let _ = c.wait();
        }
        let _ = std::fs::write(self.cgroup.path.join("cgroup.kill"), b"1");
        for dir in self.v1.iter().chain(std::iter::once(&self.cgroup.path)) {
            for _ in 0..50 {
                if std::fs::remove_dir(dir).is_ok() {
                    break;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
        }
    }
}

fn watcher(config: WatcherConfig) -> (Watcher, Receiver<Fire>) {
    let root = CgroupRoot::detect().expect("a cgroup2 mount");
    Watcher::start(Hierarchies::detect(&root), config).expect("watcher starts")
}

fn test_config() -> WatcherConfig {
    WatcherConfig {
        tick: Duration::from_millis(100),
        min_cooldown: Duration::from_millis(100),
        fires_per_minute: 600,
        ..WatcherConfig::default()
    }
}

fn spinner(dir: &Path) -> PathBuf {
    support::compile_c(
        dir,
        "spin",
        r#"
#include <stdio.h>
static volatile unsigned long sink;
__attribute__((noinline)) void spin_hot(void) { for (unsigned long i = 0; i < 100000; i++) sink += i; }
int main(void) { puts("ready"); fflush(stdout); for (;;) spin_hot(); }
"#,
    )
}

/// Waits for the first line of `child`'s stdout, which must be `expected`.
fn ready(child: &mut Child, expected: &str) -> BufReader<std::process::ChildStdout> {
    let mut reader = BufReader::new(child.stdout.take().expect("piped stdout"));
    let mut line = String::new();
    reader.read_line(&mut line).expect("reading the ready line");
    assert_eq!(line.trim(), expected, "the workload's first line");
    reader
}

#[test]
fn a_cpu_quota_of_a_fifth_of_a_core_fires_the_throttling_condition() {
    require_root();
    let _serial = serial();
    let dir = tempfile::tempdir().unwrap();
    let bin = spinner(dir.path());
    let mut cg = LimitedCgroup::new("throttle", None, Some((20_000, 100_000)));
    let (w, fires) = watcher(test_config());
    w.watch(cg.target(
        "shop/spinner/app",
        vec![TriggerSpec {
            name: "throttled".into(),
            condition: Condition::CpuThrottled { percent: 50 },
            cooldown: Duration::from_secs(3600),
        }],
    ))
    .expect("watch");
    let _out = ready(cg.spawn(&mut Command::new(&bin)), "ready");
    let fire = fires.recv_timeout(FIRE_WAIT).expect("a throttling fire");
    eprintln!("fire: {fire}");
    assert_eq!(fire.trigger, "throttled");
    assert_eq!(fire.target, "shop/spinner/app");
    assert_eq!(fire.cgroup, cg.cgroup.path);
    assert_eq!(fire.condition, Condition::CpuThrottled { percent: 50 });
    let m = &fire.measurement;
    assert_eq!((m.threshold, m.unit), (50.0, "%"));
    // A spinner under 0.2 cores runs out of quota in (nearly) every period.
    assert!(
        (50.0..=100.0).contains(&m.value),
        "measured {}% of periods throttled",
        m.value
    );
    assert!(m.detail.contains("nr_throttled +"), "{}", m.detail);
    // The cooldown of an hour holds every later tick back.
    support::wait_until("the watcher to hold a later tick back", || {
        w.stats().held_back > 0
    });
    assert!(
        fires.try_recv().is_err(),
        "a second fire inside the cooldown"
    );
}

#[test]
fn a_condition_held_true_fires_only_as_often_as_the_cooldown_allows() {
    require_root();
    let _serial = serial();
    let dir = tempfile::tempdir().unwrap();
    let bin = spinner(dir.path());
    let mut cg = LimitedCgroup::new("cooldown", None, Some((20_000, 100_000)));
    let cooldown = Duration::from_secs(2);
    let (w, fires) = watcher(test_config());
    w.watch(cg.target(
        "shop/held/app",
        vec![
            TriggerSpec {
                name: "throttled".into(),
                condition: Condition::CpuThrottled { percent: 50 },
                cooldown,
            },
            // True from the start on any machine: usage above a thousandth of a core.
            TriggerSpec {
                name: "busy".into(),
                condition: Condition::CpuAbove {
                    millicores: 1,
                    sustained: Duration::from_millis(300),
                },
                cooldown,
            },
        ],
    ))
    .expect("watch");
    let _out = ready(cg.spawn(&mut Command::new(&bin)), "ready");
    let mut at: HashMap<String, Vec<std::time::SystemTime>> = HashMap::new();
    while at.values().map(Vec::len).min().unwrap_or(0) < 3 || at.len() < 2 {
        let fire = fires
            .recv_timeout(FIRE_WAIT)
            .expect("fires while the condition holds");
        eprintln!("fire: {fire}");
        at.entry(fire.trigger).or_default().push(fire.at);
    }
    for (trigger, times) in &at {
        for pair in times.windows(2) {
            let gap = pair[1].duration_since(pair[0]).unwrap_or_default();
            // Fire times are taken after the cooldown check, a few µs apart at most.
            assert!(
                gap + Duration::from_millis(5) >= cooldown,
                "{trigger} fired {gap:?} after its previous fire, inside the cooldown of {cooldown:?}"
            );
        }
    }
    let stats = w.stats();
    eprintln!("{stats:?}");
    // Ticks every 100 ms held the true condition back between fires.
    assert!(stats.held_back >= 10, "{stats:?}");
    assert_eq!((stats.dropped, stats.refused), (0, 0), "{stats:?}");
}

#[test]
fn the_watcher_refuses_past_its_cap_and_what_a_cgroup_lacks() {
    require_root();
    let cg = LimitedCgroup::new("cap", None, None);
    let (w, _fires) = watcher(WatcherConfig {
        max_watched: 1,
        ..test_config()
    });
    let cpu = |name: &str| TriggerSpec {
        name: name.into(),
        condition: Condition::CpuAbove {
            millicores: 500,
            sustained: Duration::from_secs(1),
        },
        cooldown: Duration::from_secs(1),
    };
    // No memory limit: a memory condition cannot be watched.
    let err = w
        .watch(cg.target(
            "a",
            vec![TriggerSpec {
                name: "oom".into(),
                condition: Condition::MemoryEvent(MemoryEvent::OomKill),
                cooldown: Duration::from_secs(1),
            }],
        ))
        .expect_err("no memory controller");
    let text = err.to_string();
    assert!(text.contains("memory controller"), "{text}");
    let err = w
        .watch(cg.target(
            "a",
            vec![TriggerSpec {
                cooldown: Duration::from_millis(10),
                ..cpu("fast")
            }],
        ))
        .expect_err("a cooldown below the node's least");
    assert!(err.to_string().contains("least cooldown"), "{err}");
    let id = w.watch(cg.target("a", vec![cpu("busy")])).expect("watch");
    let err = w
        .watch(cg.target("b", vec![cpu("busy")]))
        .expect_err("past the cap");
    assert!(err.to_string().contains("cap"), "{err}");
    w.unwatch(id);
    w.watch(cg.target("b", vec![cpu("busy")]))
        .expect("room again after unwatch");
    assert_eq!(w.stats().watched, 1);
}

/// The share of inuse_space of the samples with `function` on their stack.
fn inuse_share(d: &Decoded, function: &str) -> f64 {
    let inuse = d
        .profile
        .sample_type
        .iter()
        .position(|vt| d.string(vt.r#type) == "inuse_space")
        .expect("inuse_space");
    let mut total = 0.0;
    let mut with = 0.0;
    for s in &d.profile.sample {
        let v = s.value[inuse] as f64;
        total += v;
        if s.location_id
            .iter()
            .any(|&id| d.functions(id).contains(&function))
        {
            with += v;
        }
    }
    if total > 0.0 { with / total } else { 0.0 }
}

/// One leak until the OOM kill: whether the heap was read before it, and how.
struct Race {
    won: bool,
    share: f64,
    fire: String,
    heap_took: Duration,
    before_kill: Option<Duration>,
    error: Option<String>,
}

fn leak_until_killed(bin: &Path, samplers: &Samplers, limit: u64, pause: &str) -> Race {
    let mut cg = LimitedCgroup::new("oom", Some(limit), None);
    let (w, fires) = watcher(test_config());
    w.watch(cg.target(
        "shop/leaky/app",
        vec![TriggerSpec {
            name: "near-limit".into(),
            condition: Condition::MemoryAboveLimit { percent: 60 },
            cooldown: Duration::from_secs(3600),
        }],
    ))
    .expect("watch");
    let kills_before = cg.oom_kills();
    let child = cg.spawn(Command::new(bin).arg(pause));
    let pid = child.id();
    let _out = ready(child, "ready");
    let mut child = cg.children.pop().expect("the leak");
    let fire = fires.recv_timeout(FIRE_WAIT).expect("a memory fire");
    let heap = capture_go_heap(
        samplers,
        &cg.cgroup,
        TargetLabels {
            namespace: "shop".into(),
            pod: "leaky".into(),
            container: "app".into(),
        },
        "test-node",
    );
    let read_at = Instant::now();
    let status = child.wait().expect("the leak's exit");
    let died = read_at.elapsed();
    assert_eq!(
        status.signal(),
        Some(libc::SIGKILL),
        "the leak ends killed by the OOM killer: {status:?}"
    );
    assert_eq!(
        cg.oom_kills(),
        kills_before + 1,
        "the kernel counts one OOM kill in the cgroup"
    );
    match heap {
        Ok(h) => {
            let note = h.profile.processes.iter().find(|n| n.pid == pid);
            let ok = note.is_some_and(|n| n.source == Some(HeapSourceUsed::GoRuntime));
            let share = inuse_share(
                &Decoded {
                    profile: h.profile.profile,
                },
                "main.hoardOrders",
            );
            Race {
                won: ok,
                share,
                fire: fire.to_string(),
                heap_took: h.took,
                before_kill: Some(died),
                error: (!ok).then(|| format!("{:?}", h.profile.processes)),
            }
        }
        Err(e) => Race {
            won: false,
            share: 0.0,
            fire: fire.to_string(),
            heap_took: Duration::ZERO,
            before_kill: None,
            error: Some(e.to_string()),
        },
    }
}

#[test]
fn a_memory_fire_reads_the_go_heap_before_the_oom_kill() {
    require_root();
    let _serial = serial();
    let dir = tempfile::tempdir().unwrap();
    let bin = support::go::build_workload(dir.path(), "gooom", None, "", false, &[]);
    let samplers = Samplers::new(SamplerConfig::default());
    // 1 MiB every 20 ms (≤ 50 MiB/s) into a 192 MiB limit; the trigger at 60% leaves the
    // last ~77 MiB, about 1.5 s at full speed, to read the heap.
    const RUNS: usize = 5;
    let mut wins = 0;
    for run in 1..=RUNS {
        let race = leak_until_killed(&bin, &samplers, 192 << 20, "20ms");
        eprintln!(
            "run {run}: {} | heap read in {:?}, process killed {:?} after the read; \
             main.hoardOrders {:.1}% of inuse_space{}",
            race.fire,
            race.heap_took,
            race.before_kill,
            race.share * 100.0,
            race.error
                .map(|e| format!("; lost: {e}"))
                .unwrap_or_default()
        );
        if race.won {
            wins += 1;
            assert!(
                race.share >= 0.8,
                "run {run}: main.hoardOrders holds {:.1}% of inuse_space, expected ≥ 80%",
                race.share * 100.0
            );
        }
    }
    eprintln!("heap read before the OOM kill in {wins} of {RUNS} runs");
    assert!(
        wins * 5 >= RUNS * 4,
        "the heap was read before the OOM kill in only {wins} of {RUNS} runs"
    );
}

#[test]
fn memory_flapping_around_the_threshold_costs_one_wakeup_per_rearm_and_one_fire_per_cooldown() {
    require_root();
    let _serial = serial();
    let dir = tempfile::tempdir().unwrap();
    // Holds 24 MiB, then maps, touches and unmaps 8 MiB more as fast as it can: usage
    // crosses 50% of a 64 MiB limit twice per round, thousands of times a second.
    let bin = support::compile_c(
        dir.path(),
        "flap",
        r#"
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
int main(void) {
    size_t base = 24u << 20, extra = 8u << 20;
    char *b = mmap(0, base, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    memset(b, 1, base);
    puts("ready"); fflush(stdout);
    for (unsigned long n = 1;; n++) {
        char *e = mmap(0, extra, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        for (size_t i = 0; i < extra; i += 4096) e[i] = 1;
        munmap(e, extra);
        if (n % 500 == 0) { printf("rounds %lu\n", n); fflush(stdout); }
    }
}
"#,
    );
    let mut cg = LimitedCgroup::new("flap", Some(64 << 20), None);
    let config = test_config();
    let min_rearm = config.min_rearm;
    let cooldown = Duration::from_secs(1);
    let (w, fires) = watcher(config);
    w.watch(cg.target(
        "shop/flapper/app",
        vec![TriggerSpec {
            name: "half".into(),
            condition: Condition::MemoryAboveLimit { percent: 50 },
            cooldown,
        }],
    ))
    .expect("watch");
    let started = Instant::now();
    let mut out = ready(cg.spawn(&mut Command::new(&bin)), "ready");
    let mut line = String::new();
    let mut rounds = 0u64;
    while rounds < 2000 {
        line.clear();
        out.read_line(&mut line).expect("the flapper's progress");
        rounds = line
            .trim()
            .strip_prefix("rounds ")
            .and_then(|n| n.parse().ok())
            .unwrap_or_else(|| panic!("expected `rounds N`, found {line:?}"));
    }
    let elapsed = started.elapsed();
    let stats = w.stats();
    let fired: Vec<Fire> = fires.try_iter().collect();
    eprintln!(
        "{rounds} rounds ({} threshold crossings) in {elapsed:?}: {stats:?}",
        rounds * 2
    );
    for f in &fired {
        eprintln!("fire: {f}");
    }
    assert!(
        !fired.is_empty(),
        "no fire while usage crossed 50% {rounds} times"
    );
    let periods = elapsed.as_secs_f64();
    assert!(
        fired.len() as f64 <= periods / cooldown.as_secs_f64() + 1.0,
        "{} fires in {elapsed:?} with a cooldown of {cooldown:?}",
        fired.len()
    );
    // The watcher's own work: bounded by time, not by what the pod does. The v1 threshold
    // is read on the tick as well, so allow a read pair per tick on top.
    assert!(
        stats.wakeups as f64 <= periods / min_rearm.as_secs_f64() + 2.0,
        "{} wakeups in {elapsed:?} (min re-arm {min_rearm:?}) for {} crossings",
        stats.wakeups,
        rounds * 2
    );
}

/// The BPF maps this process holds: (map_type, max_entries, memlock bytes) of each, from
/// `/proc/self/fdinfo`.
fn bpf_maps() -> Vec<(String, u64, u64)> {
    let mut maps = Vec::new();
    for entry in std::fs::read_dir("/proc/self/fdinfo").expect("/proc/self/fdinfo") {
        let Ok(text) = std::fs::read_to_string(entry.expect("an fd").path()) else {
            continue;
        };
        let field = |key: &str| {
            text.lines()
                .find_map(|l| l.strip_prefix(key)?.trim().parse::<u64>().ok())
        };
        if let (Some(kind), Some(entries), Some(memlock), Some(id)) = (
            field("map_type:"),
            field("max_entries:"),
            field("memlock:"),
            field("map_id:"),
        ) {
            maps.push((format!("id {id} type {kind}"), entries, memlock));
        }
    }
    maps
}

/// A C workload whose load grows: `argv[1]` seconds at 15% of a core in bursts of its hot
/// function (under a 0.2-core quota: not throttled), then all of it (throttled).
fn growing_spinner(dir: &Path) -> PathBuf {
    support::compile_c(
        dir,
        "growing",
        r#"
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>
static volatile unsigned long sink;
__attribute__((noinline)) void spin_hot(void) { for (unsigned long i = 0; i < 20000; i++) sink += i; }
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec / 1e9; }
int main(int argc, char **argv) {
    double calm = argc > 1 ? atof(argv[1]) : 8, start = now();
    puts("ready"); fflush(stdout);
    while (now() - start < calm) {
        double t = now();
        while (now() - t < 0.015) spin_hot();
        usleep(85000);
    }
    puts("hot"); fflush(stdout);
    for (;;) spin_hot();
}
"#,
    )
}

/// The lead-up (docs/triggers.md): the ring keeps a throttled C workload's samples at 19 Hz,
/// a CPU-throttling fire snapshots the seconds before it, and the CPU capture after the
/// fire prepends them, symbolized like its own samples and labelled as the lead-up. The
/// workload runs its hot function at 15% of a core for 8 s under a 0.2-core quota, then
/// spins and is throttled: the profile names the hot function and covers at least 5 s
/// before the fire.
#[test]
fn a_cpu_fires_profile_covers_the_seconds_before_the_fire_from_the_ring() {
    use flamefleet_agent::capture::CaptureTarget;
    use flamefleet_agent::capture::cpu::CpuOptions;
    use flamefleet_agent::capture::lifecycle::{self, CaptureSpec};
    use flamefleet_agent::trigger::cpu_ring::{CpuRing, RingConfig};
    use flamefleet_agent::trigger::fire_lead_ups::LeadUp;

    require_root();
    let _serial = serial();
    let began = Instant::now();
    let dir = tempfile::tempdir().unwrap();
    let bin = growing_spinner(dir.path());
    let mut cg = LimitedCgroup::new("leadup", None, Some((20_000, 100_000)));
    let config = RingConfig::default();
    let maps_before = bpf_maps();
    let ring = CpuRing::start(config).expect("the lead-up ring loads");
    // The ring's kernel memory, as the kernel accounts it for its maps.
    let ring_maps: Vec<(String, u64, u64)> = bpf_maps()
        .into_iter()
        .filter(|m| !maps_before.contains(m))
        .collect();
    eprintln!("the ring's maps (type, max_entries, memlock bytes): {ring_maps:?}");
    ring.watch(cg.cgroup.id)
        .expect("the ring watches the cgroup");
    // Ticks of a second (ten CFS periods): one period throttled by chance in the calm phase
    // does not fire.
    let (w, fires) = watcher(WatcherConfig {
        tick: Duration::from_secs(1),
        ..test_config()
    });
    w.watch(cg.target(
        "shop/spinner/app",
        vec![TriggerSpec {
            name: "throttled".into(),
            condition: Condition::CpuThrottled { percent: 50 },
            cooldown: Duration::from_secs(3600),
        }],
    ))
    .expect("watch");
    let started = Instant::now();
    let _out = ready(cg.spawn(Command::new(&bin).arg("8")), "ready");
    let fire = fires.recv_timeout(FIRE_WAIT).expect("a throttling fire");
    let fired_after = started.elapsed();
    let snapshot = ring.snapshot(
        cg.cgroup.id,
        fire.at.elapsed().unwrap_or_default(),
        config.lookback,
    );
    eprintln!(
        "fire {:.1}s after the start: {fire}; ring: {} samples, {:.1}s before the fire, torn {}, {} slots/CPU, {} KiB",
        fired_after.as_secs_f64(),
        snapshot.samples.len(),
        snapshot.covered().as_secs_f64(),
        snapshot.torn,
        ring.slots(),
        ring.ring_bytes() / 1024
    );
    assert!(
        fired_after >= Duration::from_secs(8),
        "the calm phase (8 s at 15% of the 20% quota) does not fire"
    );
    let lead_up = LeadUp {
        pod_uid: "pod-uid".into(),
        cgroup: cg.cgroup.path.clone(),
        fired_at: fire.at,
        frequency: config.frequency,
        lookback: config.lookback,
        snapshot,
    };

    // The capture the fire starts, with the lead-up prepended.
    let samplers = Samplers::new(SamplerConfig::default());
    let mut running = lifecycle::start(
        &samplers,
        CaptureSpec::Cpu {
            targets: vec![CaptureTarget::raw(cg.cgroup.clone())],
            options: CpuOptions::default(),
            duration: Duration::from_secs(2),
        },
    )
    .expect("the CPU capture starts");
    running.prepend_lead_up(lead_up);
    running
        .run_window(&flamefleet_agent::capture::window::Stop::new())
        .expect("the window");
    let finished = running.finish().expect("finish");
    eprintln!("{}", finished.report);
    let file = dir.path().join("cpu.pb.gz");
    flamefleet_agent::cli::write_profile(&file, &finished.profile).unwrap();
    let d = Decoded::read(&file);
    let (mut lead, mut hot, mut after, mut oldest_ms) = (0i64, 0i64, 0i64, 0i64);
    for s in &d.profile.sample {
        match d.label(s, "trigger_phase") {
            Some("lead-up") => {
                lead += 1;
                oldest_ms = oldest_ms.max(d.num_label(s, "ms_before_fire").expect("its time"));
                let leaf = d.user_leaf(s).map(|l| d.functions(l));
                if leaf.is_some_and(|f| f.first() == Some(&"spin_hot")) {
                    hot += 1;
                }
            }
            Some("after-fire") => after += s.value[0],
            other => panic!("a sample labelled {other:?}"),
        }
    }
    let share = hot as f64 * 100.0 / lead.max(1) as f64;
    println!(
        "lead-up: {lead} samples at {} Hz covering {:.1}s before the fire, spin_hot {share:.1}% of them (user leaf); {after} samples after; test {:.1}s",
        config.frequency,
        oldest_ms as f64 / 1e3,
        began.elapsed().as_secs_f64()
    );
    assert!(
        oldest_ms >= 5_000,
        "the lead-up covers at least 5 s before the fire: {oldest_ms} ms"
    );
    assert!(
        share >= 80.0,
        "the lead-up names the hot function: {share:.1}%"
    );
    assert!(after > 0, "the capture's own samples follow the lead-up");
    assert!(
        finished.report.contains("lead-up:"),
        "the capture says it has a lead-up:\n{}",
        finished.report
    );
    ring.unwatch(cg.cgroup.id);
    assert_eq!(ring.watched(), 0);
}
