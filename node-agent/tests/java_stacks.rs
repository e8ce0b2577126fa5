//! Java frames in CPU and off-CPU profiles of real HotSpot JVMs (Debian's OpenJDK 17, the
//! default `java`, and Temurin 25 beside it): the agent asks each JVM for its perf map
//! through the attach listener (starting it with SIGQUIT, as `jcmd` does) and names the
//! compiled frames `package.Class.method`; with `-XX:+PreserveFramePointer` the walk goes
//! on through them to their callers. A missing JDK fails the test with what to install.

mod support;

use std::collections::HashMap;
use std::io::{BufRead as _, BufReader};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use flamefleet_agent::capture::cpu::CpuOptions;
use flamefleet_agent::capture::offcpu::OffcpuOptions;
use flamefleet_agent::capture::{CaptureTarget, SamplerConfig, Samplers};
use flamefleet_agent::java::JvmStatus;
use flamefleet_agent::symbolize::StackSymbolizer;
use support::{Decoded, TestCgroup, require_root, serial};

const HZ: u64 = 499;
const BURN: &str = include_str!("java_workloads/Burn.java");
const BLOCK: &str = include_str!("java_workloads/Block.java");
const JDK17: &str = "/usr/lib/jvm/java-17-openjdk-amd64";
const JDK25: &str = "/usr/lib/jvm/temurin-25-jdk-amd64";

/// `bin/<tool>` of the JDK at `home`, or a failure naming what to install.
fn jdk_tool(home: &str, tool: &str) -> PathBuf {
    let path = Path::new(home).join("bin").join(tool);
    assert!(
        path.exists(),
        "{} is missing: install {} (scripts/setup.sh installs both JDKs these tests need: \
         Debian's openjdk-17-jdk-headless and Temurin 25 from Adoptium, \
         scripts/install-temurin.sh)",
        path.display(),
        if home == JDK17 {
            "openjdk-17-jdk-headless"
        } else {
            "Temurin 25 into /usr/lib/jvm/temurin-25-jdk-amd64"
        }
    );
    path
}

/// Compiles `source` (class `class` of package `package`) with the JDK at `home` into
/// `dir`.
fn compile(home: &str, dir: &Path, file: &str, source: &str) {
    let src = dir.join(file);
    std::fs::write(&src, source).unwrap();
    let out = Command::new(jdk_tool(home, "javac"))
        .arg("-d")
        .arg(dir)
        .arg(&src)
        .output()
        .expect("running javac");
    assert!(
        out.status.success(),
        "javac failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Starts `class` under the JDK at `home` with `flags` in `cg`; its pid once it printed
/// "ready".
fn start_jvm(cg: &mut TestCgroup, home: &str, dir: &Path, flags: &[&str], class: &str) -> u32 {
    let mut cmd = Command::new(jdk_tool(home, "java"));
    cmd.args(flags).arg("-cp").arg(dir).arg(class);
    let (pid, stdout) = cg.spawn_piped(&mut cmd);
    let mut line = String::new();
    BufReader::new(stdout)
        .read_line(&mut line)
        .expect("reading the JVM's ready line");
    assert_eq!(line.trim(), "ready", "{class} under {home} did not start");
    pid
}

/// One sample of a process: its first value (CPU: samples; off-CPU: blocked ns), thread
/// and function names, leaf first.
struct Sample {
    value: i64,
    thread: i64,
    frames: Vec<String>,
}

fn samples(d: &Decoded, pid: u32) -> Vec<Sample> {
    d.profile
        .sample
        .iter()
        .filter(|s| d.num_label(s, "pid") == Some(i64::from(pid)))
        .map(|s| Sample {
            value: s.value.first().copied().unwrap_or(0),
            thread: d.num_label(s, "thread").unwrap_or(0),
            frames: s
                .location_id
                .iter()
                .flat_map(|id| d.functions(*id))
                .map(str::to_owned)
                .collect(),
        })
        .collect()
}

fn status_of(jvms: &[JvmStatus], pid: u32) -> &JvmStatus {
    jvms.iter()
        .find(|j| j.tgid == pid)
        .unwrap_or_else(|| panic!("no JVM status for pid {pid}: {jvms:?}"))
}

const METHODS: [(&str, f64); 3] = [
    ("dev.flamefleet.burn.Burn.alpha", 50.0),
    ("dev.flamefleet.burn.Burn.beta", 30.0),
    ("dev.flamefleet.burn.Burn.gamma", 20.0),
];

/// The 5:3:2 workload under the JDK at `home`, once with -XX:+PreserveFramePointer and
/// once without (the control), in one capture.
fn shares_and_chains(home: &str) {
    require_root();
    let _serial = serial();
    let dir = tempfile::tempdir().unwrap();
    compile(home, dir.path(), "Burn.java", BURN);
    let mut cg = TestCgroup::new("java-burn");
    let class = "dev.flamefleet.burn.Burn";
    let with_fp = start_jvm(
        &mut cg,
        home,
        dir.path(),
        &["-XX:+PreserveFramePointer"],
        class,
    );
    let without_fp = start_jvm(&mut cg, home, dir.path(), &[], class);
    let samplers = Samplers::new(SamplerConfig::default());
    let capture = support::start_cpu_with_tables(
        &samplers,
        &[CaptureTarget::raw(cg.cgroup.clone())],
        &CpuOptions {
            frequency: HZ,
            ..CpuOptions::default()
        },
        &[with_fp, without_fp],
    );
    // Until the measured JVM has 2,000 samples (at most 30 s): a loaded machine lengthens
    // the capture instead of thinning the sample (±3 points needs about that many).
    let started = std::time::Instant::now();
    while started.elapsed() < Duration::from_secs(30) {
        std::thread::sleep(Duration::from_millis(500));
        let so_far: u64 = capture
            .peek()
            .expect("peek the capture")
            .samples
            .iter()
            .filter(|s| s.tgid == with_fp)
            .map(|s| s.count)
            .sum();
        if so_far >= 2000 {
            break;
        }
    }
    let result = capture.finish().expect("finish capture");
    let mut sym = StackSymbolizer::new(samplers.catalog().clone());
    sym.java_attach(true);
    let profile = result.to_profile(&mut sym, "");
    let jvms = sym.jvms();
    let out = dir.path().join("burn.pb.gz");
    flamefleet_agent::cli::write_profile(&out, &profile).unwrap();
    let d = Decoded::read(&out);
    drop(cg);
    for j in &jvms {
        eprintln!("{j} (setup {:?})", j.setup);
    }

    // The summary says which JVM keeps frame pointers.
    let fp = status_of(&jvms, with_fp);
    let nofp = status_of(&jvms, without_fp);
    assert!(fp.perf_map_written && fp.perf_map_entries > 0, "{fp}");
    assert_eq!(fp.frame_pointers, Some(true), "{fp}");
    assert_eq!(nofp.frame_pointers, Some(false), "{nofp}");
    assert!(
        nofp.to_string()
            .contains("-XX:+PreserveFramePointer is off"),
        "{nofp}"
    );

    for (pid, label) in [(with_fp, "with"), (without_fp, "without")] {
        let all = samples(&d, pid);
        let total: i64 = all.iter().map(|s| s.value).sum();
        assert!(total > 0, "no samples of pid {pid}");
        let mut by_method: HashMap<&str, i64> = HashMap::new();
        let (mut methods, mut called_from_main, mut interpreter_leaf) = (0i64, 0i64, 0i64);
        for s in &all {
            // The innermost Java frame is interpreted (main, or a method not compiled yet).
            let innermost_java = s
                .frames
                .iter()
                .find(|f| *f == "Interpreter" || METHODS.iter().any(|(m, _)| f == m));
            if innermost_java.is_some_and(|f| f == "Interpreter") {
                interpreter_leaf += s.value;
            }
            // The innermost Java frame of the three methods.
            let Some((at, m)) = s
                .frames
                .iter()
                .enumerate()
                .find_map(|(i, f)| METHODS.iter().find(|(m, _)| f == m).map(|(m, _)| (i, *m)))
            else {
                continue;
            };
            *by_method.entry(m).or_default() += s.value;
            methods += s.value;
            // main is interpreted: its frame is the method's caller.
            if s.frames.get(at + 1).is_some_and(|f| f == "Interpreter") {
                called_from_main += s.value;
            }
        }
        let pct = |n: i64| 100.0 * n as f64 / methods.max(1) as f64;
        let shares: Vec<String> = METHODS
            .iter()
            .map(|(m, _)| format!("{m} {:.1}%", pct(by_method.get(m).copied().unwrap_or(0))))
            .collect();
        eprintln!(
            "{home} {label} -XX:+PreserveFramePointer (pid {pid}): {}; the three methods in \
             {:.1}% of the process's {total} samples; their caller (main, interpreted) found \
             in {:.1}% of theirs; leaf in the interpreter: {:.2}% of the process's samples",
            shares.join(", "),
            100.0 * methods as f64 / total as f64,
            pct(called_from_main),
            100.0 * interpreter_leaf as f64 / total as f64,
        );
        if pid != with_fp {
            continue;
        }
        assert!(
            methods >= 1000,
            "too few samples in the three methods: {methods} in 30 s (the machine is too loaded \
             for ±3 points)"
        );
        for (m, want) in METHODS {
            let got = pct(by_method.get(m).copied().unwrap_or(0));
            assert!(
                (got - want).abs() <= 3.0,
                "{home}: {m} should be {want} ± 3% of the three methods' samples, got {got:.1}% \
                 ({by_method:?})"
            );
        }
        assert!(
            pct(called_from_main) >= 90.0,
            "{home}: with -XX:+PreserveFramePointer, >= 90% of the methods' samples should \
             carry their interpreted caller, got {:.1}%",
            pct(called_from_main)
        );
    }
}

#[test]
fn openjdk_17_shares_and_chains() {
    shares_and_chains(JDK17);
}

#[test]
fn temurin_25_shares_and_chains() {
    shares_and_chains(JDK25);
}

/// Two threads blocking in known methods: their off-CPU time is under those methods,
/// named.
fn blocked_methods(home: &str) {
    require_root();
    let _serial = serial();
    let dir = tempfile::tempdir().unwrap();
    compile(home, dir.path(), "Block.java", BLOCK);
    let mut cg = TestCgroup::new("java-block");
    let pid = start_jvm(
        &mut cg,
        home,
        dir.path(),
        &["-XX:+PreserveFramePointer"],
        "dev.flamefleet.block.Block",
    );
    let threads: HashMap<String, i64> = std::fs::read_dir(format!("/proc/{pid}/task"))
        .unwrap()
        .filter_map(|e| {
            let tid: i64 = e.ok()?.file_name().to_str()?.parse().ok()?;
            let comm = std::fs::read_to_string(format!("/proc/{pid}/task/{tid}/comm")).ok()?;
            Some((comm.trim().to_owned(), tid))
        })
        .collect();
    let samplers = Samplers::new(SamplerConfig::default());
    let targets = [CaptureTarget::raw(cg.cgroup.clone())];
    // As support::start_cpu_with_tables: a first capture registers the JVM's unwind tables
    // (until they are in, libc's frames walk by frame pointer and stop early); the one
    // measured starts once the unwinder says they are.
    let first = samplers
        .start_offcpu(&targets, &OffcpuOptions::default())
        .expect("start the registering off-CPU capture");
    let unwinder = first
        .sampler()
        .unwinder()
        .cloned()
        .expect("CFI unwinding is on");
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while !unwinder.is_registered(pid) {
        assert!(
            std::time::Instant::now() < deadline,
            "the JVM got no unwind tables within a minute"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    let capture = samplers
        .start_offcpu(&targets, &OffcpuOptions::default())
        .expect("start off-CPU capture");
    drop(first.finish().expect("finish the registering capture"));
    std::thread::sleep(Duration::from_secs(4));
    let result = capture.finish().expect("finish off-CPU capture");
    let mut sym = StackSymbolizer::new(samplers.catalog().clone());
    sym.java_attach(true);
    let built = result.to_profile(&mut sym, "");
    let out = dir.path().join("block.pb.gz");
    flamefleet_agent::cli::write_profile(&out, &built.profile).unwrap();
    let d = Decoded::read(&out);
    drop(cg);
    let jvms = sym.jvms();
    let status = status_of(&jvms, pid);
    eprintln!("{status}");
    assert!(status.perf_map_written, "{status}");
    let all = samples(&d, pid);
    for (thread, method) in [
        ("ff-nap", "dev.flamefleet.block.Block.nap"),
        ("ff-park", "dev.flamefleet.block.Block.park"),
    ] {
        let tid = *threads
            .get(thread)
            .unwrap_or_else(|| panic!("no thread {thread} in {threads:?}"));
        let mine: Vec<&Sample> = all.iter().filter(|s| s.thread == tid).collect();
        let total: i64 = mine.iter().map(|s| s.value).sum();
        let under: i64 = mine
            .iter()
            .filter(|s| s.frames.iter().any(|f| f == method))
            .map(|s| s.value)
            .sum();
        let pct = 100.0 * under as f64 / total.max(1) as f64;
        let top = mine
            .iter()
            .filter(|s| !s.frames.iter().any(|f| f == method))
            .max_by_key(|s| s.value)
            .map(|s| s.frames.join(" ← "))
            .unwrap_or_default();
        eprintln!(
            "{home}: {thread}: {pct:.1}% of {:.0} ms off-CPU under {method}; heaviest stack without it: {top}",
            total as f64 / 1e6
        );
        assert!(total > 0, "no off-CPU time of {thread}");
        assert!(
            pct >= 90.0,
            "{home}: >= 90% of {thread}'s off-CPU time should be under {method}, got {pct:.1}% \
             (heaviest stack without it: {top})"
        );
    }
}

#[test]
fn openjdk_17_blocked_methods_named_off_cpu() {
    blocked_methods(JDK17);
}

#[test]
fn temurin_25_blocked_methods_named_off_cpu() {
    blocked_methods(JDK25);
}

/// A process that maps HotSpot's own `libjvm.so` without running a JVM (no SIGQUIT
/// handler, no signal dispatcher) is never signalled: it would die of SIGQUIT.
#[test]
fn a_process_that_only_maps_libjvm_is_never_signalled() {
    require_root();
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("maps_libjvm.c");
    std::fs::write(
        &src,
        format!(
            r#"#include <dlfcn.h>
#include <stdio.h>
#include <unistd.h>
int main(void) {{
    if (!dlopen("{JDK17}/lib/server/libjvm.so", RTLD_LAZY)) {{ puts(dlerror()); return 1; }}
    puts("ready"); fflush(stdout);
    for (;;) pause();
}}"#
        ),
    )
    .unwrap();
    let bin = dir.path().join("maps_libjvm");
    let out = Command::new("cc")
        .arg("-o")
        .arg(&bin)
        .arg(&src)
        .arg("-ldl")
        .output()
        .expect("running cc (install gcc)");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    jdk_tool(JDK17, "java");
    let mut cg = TestCgroup::new("java-fake");
    let (pid, stdout) = cg.spawn_piped(&mut Command::new(&bin));
    let mut line = String::new();
    BufReader::new(stdout).read_line(&mut line).unwrap();
    assert_eq!(
        line.trim(),
        "ready",
        "the libjvm.so mapper did not start: {line}"
    );
    let catalog = flamefleet_agent::process::ProcessCatalog::new();
    assert!(catalog.snapshot(pid));
    let maps = catalog.lookup(pid).unwrap();
    let status = flamefleet_agent::java::prepare(pid, &maps, true)
        .expect("HotSpot's libjvm.so is mapped: taken for a JVM, but not signalled");
    eprintln!("{status}");
    assert!(!status.perf_map_written);
    let why = status.not_attached.clone().unwrap_or_default();
    assert!(why.contains("not attached"), "{status}");
    // Still alive: SIGQUIT's default action would have ended it.
    assert!(
        std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| !s.contains(") Z")),
        "pid {pid} died"
    );
}

/// A JVM under -Xrs does not catch SIGQUIT (it would die of it); HotSpot then starts its
/// attach listener at startup, so the agent asks it without a signal, and it keeps running.
#[test]
fn a_jvm_under_xrs_is_attached_without_a_signal() {
    require_root();
    let dir = tempfile::tempdir().unwrap();
    compile(JDK17, dir.path(), "Burn.java", BURN);
    let mut cg = TestCgroup::new("java-xrs");
    let pid = start_jvm(
        &mut cg,
        JDK17,
        dir.path(),
        &["-Xrs"],
        "dev.flamefleet.burn.Burn",
    );
    let catalog = flamefleet_agent::process::ProcessCatalog::new();
    assert!(catalog.snapshot(pid));
    let maps = catalog.lookup(pid).unwrap();
    let state = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let caught = state
        .lines()
        .find_map(|l| l.strip_prefix("SigCgt:"))
        .and_then(|m| u64::from_str_radix(m.trim(), 16).ok())
        .unwrap();
    assert_eq!(
        caught & 0x4,
        0,
        "-Xrs: SIGQUIT keeps its default action (the control)"
    );
    let status = flamefleet_agent::java::prepare(pid, &maps, true).expect("a HotSpot JVM");
    eprintln!("{status:?}");
    assert!(status.perf_map_written, "{status:?}");
    // A SIGQUIT would end it (and dump core) at once; give that a moment to show.
    std::thread::sleep(Duration::from_millis(200));
    assert!(
        std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| !s.contains(") Z")),
        "the -Xrs JVM {pid} died"
    );
}

/// A JVM of another user than the agent's (here uid 65532, as most images run theirs): the
/// agent run with exactly the chart's default capabilities does not attach, and the
/// profile says why and what to set; with `agent.javaAttachOtherUsers`' two capabilities
/// added (SETUID, SETGID) the agent attaches as the JVM's user and names its methods.
#[test]
fn a_jvm_of_another_user_is_attached_as_that_user_only_with_setuid_and_setgid() {
    use std::os::unix::fs::PermissionsExt as _;
    require_root();
    let _serial = serial();
    const UID: u32 = 65532;
    let dir = tempfile::tempdir().unwrap();
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    compile(JDK17, dir.path(), "Burn.java", BURN);
    let mut cg = TestCgroup::new("java-user");
    // setpriv enters the cgroup as root and then becomes the user, keeping its PID.
    let mut cmd = Command::new("setpriv");
    cmd.args([
        &format!("--reuid={UID}"),
        &format!("--regid={UID}"),
        "--clear-groups",
        "--",
    ])
    .arg(jdk_tool(JDK17, "java"))
    .args(["-XX:+PreserveFramePointer", "-cp"])
    .arg(dir.path())
    .arg("dev.flamefleet.burn.Burn");
    let (pid, stdout) = cg.spawn_piped(&mut cmd);
    let mut line = String::new();
    BufReader::new(stdout)
        .read_line(&mut line)
        .expect("reading the JVM's ready line (setpriv is util-linux's)");
    assert_eq!(line.trim(), "ready", "the JVM of uid {UID} did not start");
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    assert!(
        status
            .lines()
            .any(|l| l.starts_with("Uid:") && l.split_whitespace().nth(2) == Some("65532")),
        "the JVM runs as uid {UID}: {status}"
    );

    let capture = |extra: &[u32], name: &str| {
        let out = dir.path().join(format!("{name}.pb.gz"));
        let mut agent = Command::new(env!("CARGO_BIN_EXE_flamefleet-agent"));
        agent
            .args([
                "capture",
                "--type",
                "cpu",
                "--duration",
                "3s",
                "--frequency",
            ])
            .arg(HZ.to_string())
            .arg("--cgroup")
            .arg(&cg.cgroup.path)
            .arg("-o")
            .arg(&out);
        let mut caps = support::chart_capabilities();
        caps.extend_from_slice(extra);
        support::with_only_capabilities(&mut agent, &caps);
        let output = agent.output().expect("running flamefleet-agent capture");
        assert!(
            output.status.success(),
            "capture with capabilities {caps:?}: {}",
            String::from_utf8_lossy(&output.stderr)
        );
        let d = Decoded::read(&out);
        let comments: Vec<String> = d
            .profile
            .comment
            .iter()
            .map(|&i| d.string(i).to_owned())
            .collect();
        let java = comments
            .iter()
            .find(|c| c.contains(&format!("(pid {pid})")))
            .cloned()
            .unwrap_or_else(|| panic!("no runtimes line for the JVM {pid}: {comments:#?}"));
        eprintln!("{name}: {java}");
        let named: i64 = samples(&d, pid)
            .iter()
            .filter(|s| s.frames.iter().any(|f| METHODS.iter().any(|(m, _)| f == m)))
            .map(|s| s.value)
            .sum();
        let total: i64 = samples(&d, pid).iter().map(|s| s.value).sum();
        (java, named, total)
    };

    // The chart's default capabilities: the agent (root) may neither signal a process of
    // uid 65532 nor connect to its 0600 socket, and does not try.
    let (line, named, total) = capture(&[], "default");
    assert!(
        line.contains("Java frames unnamed")
            && line.contains(&format!("runs as uid {UID}"))
            && line.contains("CAP_SETUID and CAP_SETGID")
            && line.contains("agent.javaAttachOtherUsers=true"),
        "the line says why and what to set: {line}"
    );
    assert!(total > 0, "the JVM was sampled");
    assert_eq!(named, 0, "no method named without the perf map");
    assert!(
        !Path::new(&format!("/tmp/.java_pid{pid}")).exists(),
        "not signalled: no attach listener started"
    );

    // SETUID and SETGID added: attached as the JVM's user, its methods named.
    const SETGID: u32 = 6;
    const SETUID: u32 = 7;
    let (line, named, total) = capture(&[SETGID, SETUID], "as-user");
    assert!(
        line.contains("compiled Java frames named from the JVM's perf map")
            && !line.contains("PreserveFramePointer is off"),
        "{line}"
    );
    assert!(
        named * 10 >= total * 9,
        "the three methods named in >= 90% of the JVM's samples: {named} of {total}"
    );
    let socket = std::fs::metadata(format!("/tmp/.java_pid{pid}")).expect("its attach socket");
    assert_eq!(
        std::os::unix::fs::MetadataExt::uid(&socket),
        UID,
        "the JVM's own socket"
    );
    assert!(
        !Path::new(&format!("/tmp/.attach_pid{pid}")).exists(),
        "the trigger file is removed"
    );
    assert!(
        std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| !s.contains(") Z")),
        "the JVM {pid} still runs"
    );
    drop(cg);
    let _ = std::fs::remove_file(format!("/tmp/perf-{pid}.map"));
    let _ = std::fs::remove_file(format!("/tmp/.java_pid{pid}"));
}
