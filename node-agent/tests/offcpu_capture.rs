//! Off-CPU profiles on real threads in a real cgroup: a C workload without frame pointers
//! whose three threads block in nanosleep, a pipe read and a contended mutex for 5:3:2 of
//! their off-CPU time, checked against the kernel's own accounting of each thread and
//! against libbpf-tools' `offcputime` on the same threads and window.

mod support;

use std::collections::HashMap;
use std::io::{BufRead as _, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use flamefleet_agent::capture::offcpu::{OffcpuOptions, OffcpuSamples};
use flamefleet_agent::capture::{CaptureTarget, SamplerConfig, Samplers};
use flamefleet_agent::symbolize::StackSymbolizer;
use support::{Decoded, TestCgroup, require_root, serial, wait_until};

const BLOCKERS: &str = include_str!("offcpu_workloads/blockers.c");

/// How long each capture of the C workload lasts.
const WINDOW: Duration = Duration::from_secs(5);

/// The worker threads of blockers.c: name, share of the workers' off-CPU time (percent),
/// the function it blocks in, and the kernel frame that says why. Kernel stacks are those
/// of the stopped thread, where the kernel leaves out its scheduling functions (`__sched`:
/// `schedule`, `do_nanosleep`, `io_schedule`): the leaf is the function that chose to wait.
const WORKERS: [(&str, f64, &str, &str); 3] = [
    ("ff-sleep", 50.0, "block_in_sleep", "hrtimer_nanosleep"),
    ("ff-pipe", 30.0, "block_in_pipe", "pipe_read"),
    ("ff-mutex", 20.0, "block_in_mutex", "futex_wait"),
];

/// Builds blockers.c: without frame pointers (`frame_pointers: false`; our walk needs
/// none), or with them for `offcputime`, whose user stacks need them.
fn build_blockers(dir: &Path, frame_pointers: bool) -> PathBuf {
    let src = dir.join("blockers.c");
    std::fs::write(&src, BLOCKERS).unwrap();
    let bin = dir.join("blockers");
    let fp = if frame_pointers {
        "-fno-omit-frame-pointer"
    } else {
        "-fomit-frame-pointer"
    };
    let out = Command::new("cc")
        .args(["-O2", fp, "-g", "-pthread", "-o"])
        .arg(&bin)
        .arg(&src)
        .output()
        .expect("running cc (install gcc)");
    assert!(
        out.status.success(),
        "cc failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    bin
}

/// Starts `cmd` in `cg` and waits for its "ready" line.
fn start_ready(cg: &mut TestCgroup, cmd: &mut Command) -> u32 {
    let (pid, stdout) = cg.spawn_piped(cmd);
    let mut line = String::new();
    BufReader::new(stdout)
        .read_line(&mut line)
        .expect("reading the workload's ready line");
    assert_eq!(line.trim(), "ready", "workload {pid} did not start");
    pid
}

/// Thread IDs of `pid` by name.
fn threads(pid: u32) -> HashMap<String, u32> {
    std::fs::read_dir(format!("/proc/{pid}/task"))
        .unwrap()
        .filter_map(|e| {
            let tid: u32 = e.ok()?.file_name().to_str()?.parse().ok()?;
            let comm = std::fs::read_to_string(format!("/proc/{pid}/task/{tid}/comm")).ok()?;
            Some((comm.trim().to_owned(), tid))
        })
        .collect()
}

/// A thread's CPU time and run-queue wait so far (ns, /proc/.../schedstat).
fn schedstat(pid: u32, tid: u32) -> (u64, u64) {
    let s = std::fs::read_to_string(format!("/proc/{pid}/task/{tid}/schedstat")).unwrap();
    let mut f = s.split_whitespace().map(|v| v.parse::<u64>().unwrap());
    (f.next().unwrap(), f.next().unwrap())
}

fn write_profile(dir: &Path, name: &str, samples: &OffcpuSamples, samplers: &Samplers) -> PathBuf {
    let mut symbolizer = StackSymbolizer::new(samplers.catalog().clone());
    let built = samples.to_profile(&mut symbolizer, "test-node");
    eprintln!("{}", built.text(samples, 12));
    let file = dir.join(format!("{name}.pb.gz"));
    flamefleet_agent::cli::write_profile(&file, &built.profile).unwrap();
    file
}

/// Per thread: off-CPU ns in total, under `user` frames, and under both `user` and
/// `kernel` frames.
fn per_thread(d: &Decoded, user: &str, kernel: &str) -> HashMap<i64, (i64, i64, i64)> {
    let mut out: HashMap<i64, (i64, i64, i64)> = HashMap::new();
    for s in &d.profile.sample {
        let Some(tid) = d.num_label(s, "thread") else {
            continue;
        };
        let names: Vec<(bool, Vec<&str>)> = s
            .location_id
            .iter()
            .map(|&l| (d.is_kernel(l), d.functions(l)))
            .collect();
        let has_user = names
            .iter()
            .any(|(k, f)| !k && f.iter().any(|n| n.contains(user)));
        let has_kernel = names
            .iter()
            .any(|(k, f)| *k && f.iter().any(|n| n.contains(kernel)));
        let e = out.entry(tid).or_default();
        e.0 += s.value[0];
        if has_user {
            e.1 += s.value[0];
        }
        if has_user && has_kernel {
            e.2 += s.value[0];
        }
    }
    out
}

#[test]
fn three_threads_block_5_3_2_under_their_blocking_functions() {
    require_root();
    let _serial = serial();
    let dir = tempfile::tempdir().unwrap();
    let bin = build_blockers(dir.path(), false);
    let mut cg = TestCgroup::new("offcpu-c");
    let pid = start_ready(&mut cg, &mut Command::new(&bin));
    let tids = threads(pid);
    let samplers = Samplers::new(SamplerConfig::default());
    let capture = samplers
        .start_offcpu(
            &[CaptureTarget::raw(cg.cgroup.clone())],
            &OffcpuOptions::default(),
        )
        .expect("start off-CPU capture");
    let t0 = Instant::now();
    let before: HashMap<&str, (u64, u64)> = WORKERS
        .iter()
        .map(|w| (w.0, schedstat(pid, tids[w.0])))
        .collect();
    std::thread::sleep(WINDOW);
    let after: HashMap<&str, (u64, u64)> = WORKERS
        .iter()
        .map(|w| (w.0, schedstat(pid, tids[w.0])))
        .collect();
    let wall = t0.elapsed().as_nanos() as f64;
    let result = capture.finish().expect("finish");
    let file = write_profile(dir.path(), "blockers", &result, &samplers);
    let d = Decoded::read(&file);
    let types: Vec<&str> = d
        .profile
        .sample_type
        .iter()
        .map(|t| d.string(t.r#type))
        .collect();
    assert_eq!(types, ["off_cpu", "blocks"]);
    assert_eq!(result.stats.lost(), 0, "blocks lost: {:?}", result.stats);

    // Per worker: its whole off-CPU time (blocks and pacing), and the time under its
    // blocking function, which must all be under the right kernel frame.
    let mut totals = HashMap::new();
    let mut blocking = HashMap::new();
    for (name, _, user, kernel) in WORKERS {
        let tid = i64::from(tids[name]);
        let (total, under_user, under_both) = per_thread(&d, user, kernel)
            .get(&tid)
            .copied()
            .unwrap_or_default();
        let pct = 100.0 * under_both as f64 / under_user.max(1) as f64;
        eprintln!(
            "{name}: {total} ns off-CPU, {under_user} ns under {user}, {pct:.1}% of it under {kernel}"
        );
        assert!(
            under_user > 0 && pct >= 95.0,
            "{name}: expected >= 95% of its off-CPU time under {user} (user) to be under {kernel} (kernel), found {pct:.1}% of {under_user} ns"
        );
        totals.insert(name, total as f64);
        blocking.insert(name, under_user as f64);
    }
    let sum: f64 = blocking.values().sum();
    for (name, want, user, _) in WORKERS {
        let share = 100.0 * blocking[name] / sum;
        eprintln!(
            "{name}: {share:.1}% of the time under the blocking functions in {user} (expected {want}%)"
        );
        assert!(
            (share - want).abs() <= 3.0,
            "{name}: expected {want} ± 3 points of the time under the blocking functions, found {share:.1}% in {user}"
        );
    }
    // A thread's wall time is on CPU or off it; off it, either blocked (this profile) or
    // runnable and waiting for a CPU (runqlat's: after a wakeup, which the profile keeps
    // apart as each block's run-queue time, or after a preemption, which it does not see).
    // The blocked total is checked against the kernel's own accounting of the other two
    // (CPU time and run_delay of /proc/.../schedstat).
    let queued: HashMap<u32, u64> = result.samples.iter().fold(HashMap::new(), |mut m, s| {
        *m.entry(s.pid).or_default() += s.queued_ns;
        m
    });
    for (name, ..) in WORKERS {
        let (cpu0, rq0) = before[name];
        let (cpu1, rq1) = after[name];
        let cpu = (cpu1 - cpu0) as f64;
        let run_delay = (rq1 - rq0) as f64;
        let blocked = totals[name];
        let expected = wall - cpu - run_delay;
        let off = 100.0 * (blocked - expected) / expected;
        eprintln!(
            "{name}: wall {:.3} s - CPU {:.3} s = {:.3} s off CPU, of which run-queue wait {:.3} s \
             ({:.3} s after its blocks, in the profile's run-queue time); \
             wall - CPU - run-queue wait = {:.3} s vs blocked {:.3} s ({off:+.2}%)",
            wall / 1e9,
            cpu / 1e9,
            (wall - cpu) / 1e9,
            run_delay / 1e9,
            queued.get(&tids[name]).copied().unwrap_or(0) as f64 / 1e9,
            expected / 1e9,
            blocked / 1e9,
        );
        assert!(
            off.abs() <= 5.0,
            "{name}: blocked {blocked} ns, expected within 5% of wall - CPU - run-queue wait = {expected} ns"
        );
    }
}

/// `offcputime`'s stacks: (thread name, kernel frames leaf first) -> total in microseconds.
type PeerStacks = HashMap<(String, Vec<String>), u64>;

/// Parses `offcputime`'s default output: frames (kernel, then user), a `-  comm (pid)`
/// line, then the total in microseconds. Keeps the kernel frames, up to the system call
/// entry.
fn parse_offcputime(out: &str) -> PeerStacks {
    let mut stacks = PeerStacks::new();
    let mut frames: Vec<String> = Vec::new();
    let mut comm: Option<String> = None;
    for line in out.lines().map(str::trim) {
        if line.is_empty() {
            frames.clear();
            comm = None;
        } else if let Some(rest) = line.strip_prefix("- ") {
            let rest = rest.trim();
            comm = Some(
                rest.rsplit_once(" (")
                    .map_or(rest, |(c, _)| c)
                    .trim()
                    .to_owned(),
            );
        } else if let (Some(c), Ok(us)) = (&comm, line.parse::<u64>()) {
            *stacks.entry((c.clone(), kernel_part(&frames))).or_default() += us;
        } else {
            frames.push(line.to_owned());
        }
    }
    stacks
}

/// The kernel frames of a leaf-first stack of kernel then user frames: up to the system
/// call entry.
fn kernel_part(frames: &[String]) -> Vec<String> {
    match frames.iter().position(|f| f.starts_with("entry_SYSCALL")) {
        Some(end) => frames[..=end].to_vec(),
        None => Vec::new(),
    }
}

/// Whether `ours` (leaf first) is the root end of `theirs`: the same stack seen by both,
/// `offcputime`'s with its own program, the tracepoint and the scheduler's functions at
/// the leaf (it walks the running task), ours without them (the stopped task's stack).
/// `offcputime` also records preemptions (a runnable thread switched out, e.g. by an
/// interrupt in the middle of `futex_wait`), which are run-queue time here: a stack with
/// the preemption's frames is never the same as a block's.
fn same_stack(ours: &[String], theirs: &[String]) -> bool {
    const PREEMPTION: [&str; 4] = [
        "preempt_schedule",
        "irqentry_exit",
        "asm_sysvec",
        "__cond_resched",
    ];
    let preempted = theirs
        .iter()
        .any(|f| PREEMPTION.iter().any(|p| f.starts_with(p)));
    !ours.is_empty() && !preempted && theirs.ends_with(ours)
}

/// Whether `pid` holds a BPF link (its programs are attached).
fn has_bpf_link(pid: u32) -> bool {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|d| {
            d.filter_map(Result::ok).any(|e| {
                std::fs::read_link(e.path()).is_ok_and(|t| t.to_string_lossy().contains("bpf_link"))
            })
        })
        .unwrap_or(false)
}

#[test]
fn per_stack_totals_agree_with_offcputime() {
    require_root();
    let _serial = serial();
    let dir = tempfile::tempdir().unwrap();
    let bin = build_blockers(dir.path(), true);
    let mut cg = TestCgroup::new("offcpu-peer");
    let pid = start_ready(&mut cg, &mut Command::new(&bin));
    let tids = threads(pid);
    let samplers = Samplers::new(SamplerConfig::default());
    let capture = samplers
        .start_offcpu(
            &[CaptureTarget::raw(cg.cgroup.clone())],
            &OffcpuOptions::default(),
        )
        .expect("start off-CPU capture");
    // The same threads (the process), blocks of at least 1 ms as ours. offcputime also
    // counts preemptions (a runnable thread switched out), which are not off-CPU time
    // here; their stacks (an interrupt's return) match none of ours.
    let peer = Command::new("offcputime")
        // Its stack map is 1024 stacks by default: without room the kernel stacks of the
        // workers' blocks would be lost among those of their preemptions.
        .args([
            "-m",
            "1000",
            "--stack-storage-size",
            "262144",
            "-p",
            &pid.to_string(),
            "600",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("running offcputime (install libbpf-tools: scripts/setup.sh)");
    let peer_pid = peer.id();
    // The same window for both: ours is read when offcputime has attached and again when
    // it is stopped, and only the difference counts.
    wait_until("offcputime to attach", || has_bpf_link(peer_pid));
    let peer_started = Instant::now();
    let before = capture.peek().expect("peek");
    std::thread::sleep(WINDOW);
    let after = capture.peek().expect("peek");
    // SIGINT ends offcputime's wait; it then prints its maps.
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(peer_pid as i32),
        nix::sys::signal::Signal::SIGINT,
    )
    .unwrap();
    let peer_window = peer_started.elapsed();
    let ours_window = after.duration - before.duration;
    drop(capture);
    let out = peer.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "offcputime failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let peer_stacks = parse_offcputime(&String::from_utf8_lossy(&out.stdout));

    // Ours per (thread, kernel stack): blocked + runnable, which is what offcputime
    // measures (switch-out to switch-in), over the window.
    let mut symbolizer = StackSymbolizer::new(samplers.catalog().clone());
    let mut totals = |samples: &OffcpuSamples| {
        let mut out: HashMap<(String, Vec<String>), i128> = HashMap::new();
        for s in &samples.samples {
            let mut b = flamefleet_agent::pprof::ProfileBuilder::new(&[("x", "y")]);
            let frames: Vec<String> = symbolizer
                .kernel_frames(&mut b, &s.kernel_stack)
                .iter()
                .filter_map(|f| f.lines.last().map(|l| l.function.clone()))
                .collect();
            *out.entry((s.comm.clone(), frames)).or_default() +=
                i128::from(s.blocked_ns + s.queued_ns);
        }
        out
    };
    let (at_start, at_end) = (totals(&before), totals(&after));
    let ours: HashMap<(String, Vec<String>), u64> = at_end
        .into_iter()
        .map(|(k, v)| {
            let d = v - at_start.get(&k).copied().unwrap_or(0);
            (k, u64::try_from(d).unwrap_or(0))
        })
        .collect();
    let rate = |total_ns: f64, window: Duration| total_ns / window.as_secs_f64();
    let mut compared = 0;
    for (name, _, _, kernel) in WORKERS {
        assert!(tids.contains_key(name));
        // The worker's blocking stacks as we saw them, and offcputime's totals of the
        // same stacks.
        let our_stacks: Vec<(&Vec<String>, u64)> = ours
            .iter()
            .filter(|((c, st), _)| c == name && st.iter().any(|f| f.contains(kernel)))
            .map(|((_, st), ns)| (st, *ns))
            .collect();
        assert!(
            !our_stacks.is_empty(),
            "no stack of {name} under {kernel}: {ours:?}"
        );
        let our_ns: u64 = our_stacks.iter().map(|(_, ns)| ns).sum();
        let peer_ns: u64 = peer_stacks
            .iter()
            .filter(|((c, st), _)| c == name && our_stacks.iter().any(|(o, _)| same_stack(o, st)))
            .map(|(_, us)| us * 1000)
            .sum();
        let (a, b) = (
            rate(our_ns as f64, ours_window),
            rate(peer_ns as f64, peer_window),
        );
        let diff = 100.0 * (a - b) / b.max(1.0);
        let shown: Vec<String> = our_stacks.iter().map(|(st, _)| st.join(";")).collect();
        eprintln!(
            "{name} [{}]: ours {:.1} ms/s over {:.2?}, offcputime {:.1} ms/s over {:.2?} ({diff:+.2}%)",
            shown.join(" | "),
            a / 1e6,
            ours_window,
            b / 1e6,
            peer_window
        );
        assert!(
            diff.abs() <= 5.0,
            "{name}: off-CPU time per second under {kernel} differs by {diff:.2}% from offcputime's (ours {a:.0} ns/s, theirs {b:.0} ns/s)"
        );
        compared += 1;
    }
    assert_eq!(compared, WORKERS.len());
}

const GOBLOCK: &str = include_str!("offcpu_workloads/goblock/main.go");
const GOBLOCK_MOD: &str = include_str!("offcpu_workloads/goblock/go.mod");

/// Off-CPU ns under stacks holding every one of `user` (user frames) and `kernel` (a kernel
/// frame), and the total of the profile.
fn under(d: &Decoded, user: &[&str], kernel: &str) -> (i64, i64) {
    let (mut hit, mut total) = (0, 0);
    for s in &d.profile.sample {
        total += s.value[0];
        let frames: Vec<(bool, Vec<&str>)> = s
            .location_id
            .iter()
            .map(|&l| (d.is_kernel(l), d.functions(l)))
            .collect();
        let has = |name: &str, kernel_frame: bool| {
            frames
                .iter()
                .any(|(k, f)| *k == kernel_frame && f.iter().any(|n| n.contains(name)))
        };
        if user.iter().all(|u| has(u, false)) && has(kernel, true) {
            hit += s.value[0];
        }
    }
    (hit, total)
}

#[test]
fn go_waits_show_their_go_callers() {
    require_root();
    let _serial = serial();
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("main.go"), GOBLOCK).unwrap();
    std::fs::write(dir.path().join("go.mod"), GOBLOCK_MOD).unwrap();
    let bin = dir.path().join("goblock");
    let out = Command::new("go")
        .args(["build", "-o"])
        .arg(&bin)
        .arg(".")
        .current_dir(dir.path())
        .env("CGO_ENABLED", "0")
        .output()
        .expect("running go build (install Go)");
    assert!(
        out.status.success(),
        "go build failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let mut cg = TestCgroup::new("offcpu-go");
    start_ready(&mut cg, &mut Command::new(&bin));
    let samplers = Samplers::new(SamplerConfig::default());
    let capture = samplers
        .start_offcpu(
            &[CaptureTarget::raw(cg.cgroup.clone())],
            &OffcpuOptions::default(),
        )
        .expect("start off-CPU capture");
    let window = Duration::from_secs(3);
    std::thread::sleep(window);
    let result = capture.finish().expect("finish");
    let file = write_profile(dir.path(), "goblock", &result, &samplers);
    let d = Decoded::read(&file);
    // Each waiting goroutine is locked to its own thread, which blocks (in the runtime's
    // futex sleep, on the scheduler's stack) for nearly all of the window.
    let floor = window.as_nanos() as i64 / 2;
    for (what, user) in [
        (
            "channel receive",
            &[
                "main.receiver",
                "main.receive",
                "runtime.chanrecv",
                "runtime.gopark",
            ][..],
        ),
        (
            "time.Sleep",
            &["main.sleeper", "main.nap", "time.Sleep", "runtime.gopark"][..],
        ),
    ] {
        let (hit, total) = under(&d, user, "futex");
        eprintln!(
            "{what}: {:.3} s of {:.3} s off-CPU under {} and a futex kernel frame",
            hit as f64 / 1e9,
            total as f64 / 1e9,
            user.join(" > ")
        );
        assert!(
            hit >= floor,
            "{what}: expected at least {floor} ns off-CPU under {user:?} (with a futex kernel frame), found {hit} of {total}"
        );
    }
}
