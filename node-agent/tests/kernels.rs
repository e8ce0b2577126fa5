//! The guest tier: the capture engines' own tests, run for real inside Debian's 5.10, 6.1 and
//! 6.12 kernels, each booted under QEMU on this machine's files (`flamefleet_e2e::guest`;
//! `scripts/setup.sh` installs QEMU and `scripts/guest-kernels.sh` the kernels). Real eBPF
//! in the guest kernel on real processes in real cgroups: a frame-pointer-less C program's
//! full chains (CPU), runqlat against libbpf-tools' runqlat, the Go runtime's heap buckets,
//! eBPF heap sampling or its refusal with the reason, and off-CPU profiles (three threads
//! blocking 5:3:2) or their refusal with what the kernel lacks. Each kernel also says which
//! mechanism each engine chose there, and the tier checks it is the one that kernel should
//! get.
//!
//! One guest at a time (TCG is CPU-heavy); the engines' tests run one at a time inside it.
//! What only needs building (the test executables, the Go heap workload) is built on the
//! host, whose files the guests see.

mod support;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use flamefleet_e2e::guest::{self, GuestConfig, Kernel};

/// A kernel of the tier and what it should give.
struct GuestKernel {
    /// `uname -r`; keep in step with KERNELS in scripts/guest-kernels.sh.
    release: &'static str,
    /// How the CPU sampler walks frames there (`KernelFeatures::frame_walk`).
    frame_walk: &'static str,
    /// How runqlat's target lookups go (`KernelFeatures::target_lookup`).
    targets: &'static str,
    /// Whether eBPF heap sampling runs there (`ran`) or is refused (`refused`).
    heap_ebpf: &'static str,
    /// What eBPF heap sampling does there with only the chart's capabilities: runs
    /// (`ran`), needs CAP_SYS_ADMIN for perf-event uprobes and says so (`needs SYS_ADMIN`),
    /// or is refused for what the kernel lacks (`refused`).
    heap_ebpf_chart_caps: &'static str,
    /// Whether runqlat's waits after idle end at PSI's stamp there
    /// (`runqlat.after_idle=psi-stamps`; else they read the clock).
    psi_stamps: bool,
    /// Whether off-CPU profiles run there (`ran`) or are refused (`refused`).
    offcpu: &'static str,
    /// What an off-CPU refusal must name (what the kernel lacks, with the release that has
    /// it), as `KernelFeatures::offcpu_refusal` words it.
    offcpu_lacks: &'static [&'static str],
}

/// The engines' tests every guest runs: (test binary, test).
const TESTS: &[(&str, &str)] = &[
    (
        "heap_ebpf",
        "ebpf_heap_runs_or_is_refused_with_what_the_kernel_lacks",
    ),
    (
        "heap_ebpf",
        "ebpf_heap_runs_with_only_the_charts_capabilities",
    ),
    (
        "cpu_capture",
        "captures_without_cap_sys_resource_or_names_the_memlock_limit",
    ),
    (
        "cpu_capture",
        "captures_with_only_the_charts_capabilities_or_names_perf_event_paranoid",
    ),
    (
        "full_stacks",
        "c_without_frame_pointers_full_chain_and_caller_proportions",
    ),
    (
        "runqlat_capture",
        "agrees_with_libbpf_tools_runqlat_for_one_process",
    ),
    (
        "heap_goruntime",
        "go_heap_matches_the_truth_and_its_own_endpoint_with_the_local_toolchain",
    ),
    (
        "offcpu_capture",
        "offcpu_runs_or_is_refused_with_what_the_kernel_lacks",
    ),
];

/// Run where off-CPU profiles run: the engine's core test on three threads of a
/// frame-pointer-less C program blocking in three known places (each one's blocking time
/// under its blocking function and the kernel frame that says why, its blocked total
/// against the kernel's accounting), without the 5:3:2 shares, which the workload's
/// helper threads do not keep under TCG on a loaded host (see the test); and each blocking
/// stack's total against libbpf-tools' `offcputime` on the same kernel.
const OFFCPU_TESTS: [(&str, &str); 2] = [
    (
        "offcpu_capture",
        "blocked_time_under_the_blocking_functions_matches_the_kernels_accounting",
    ),
    ("offcpu_capture", "per_stack_totals_agree_with_offcputime"),
];

/// Run where eBPF heap sampling runs.
const HEAP_EBPF_TEST: (&str, &str) = ("heap_ebpf", "inuse_space_and_call_sites_match_the_truth");

/// Run where the CPU sampler takes the user registers of a task sampled in the kernel from
/// the top of its kernel stack (no `bpf_task_pt_regs`).
const STACK_TOP_TEST: (&str, &str) = ("cpu_capture", "kernel_stacks_sit_on_top_of_the_user_stack");

/// How every test runs in a guest: without CAP_SYS_RESOURCE, which this machine's and CI's
/// capability bounding set lacks and real nodes may not grant, and with a low soft memlock
/// limit under an unlimited hard one (a runtime with LimitMEMLOCK=infinity), so that a
/// kernel charging BPF memory to RLIMIT_MEMLOCK (5.10) runs them as such a node would.
const WITHOUT_SYS_RESOURCE: &str =
    "prlimit --memlock=65536:unlimited setpriv --bounding-set=-sys_resource --";

/// Seconds one engine test may run in a guest before it counts as hung. The slowest took
/// 60 s under TCG at host load 10-13; a test that hangs (as runqlat's agreement test once
/// did in the 6.1 guest of a CI run, after its capture, until the guest's 20-minute limit)
/// would otherwise take the whole tier's time and tell nothing of where it stood.
const TEST_HANG_SECS: u32 = 300;

/// `ff_run NAME COMMAND...`: runs one test with a watchdog. At [`TEST_HANG_SECS`] it prints
/// `== hung NAME`, each thread's name, state, kernel wait channel and kernel stack, and
/// gdb's backtrace of every thread (the host's gdb, seen through the shared root), kills
/// the test with its process group (its workloads) and runs it once more; the second run's status is the test's, and the host side
/// reports the hang whatever the second run did. (Polls once a second: this is a watchdog
/// over a test, not a test's synchronization.)
const TEST_WATCHDOG: &str = r#"ff_run() {
  name=$1; shift
  for attempt in 1 2; do
    setsid "$@" & pid=$!
    waited=0
    while kill -0 $pid 2>/dev/null && [ $waited -lt HANG_SECS ]; do sleep 1; waited=$((waited + 1)); done
    if ! kill -0 $pid 2>/dev/null; then wait $pid; return $?; fi
    echo "== hung $name (attempt $attempt) after ${waited}s, its threads:"
    for t in /proc/$pid/task/*; do
      echo "-- thread $(basename $t) $(cat $t/comm) state $(cut -d' ' -f3 $t/stat) wchan $(cat $t/wchan)"
      cat $t/stack 2>/dev/null
    done
    command -v gdb >/dev/null && timeout 120 gdb -p $pid -batch -nx -ex 'thread apply all bt 30' 2>&1 | grep -E '^(Thread|#)' | head -200
    kill -9 -- -$pid; wait $pid
    echo "== end hung $name"
  done
  return 124
}
"#;

/// The test executables of this package, built by cargo (already built when the whole
/// suite runs; built here otherwise), by name.
fn test_executables() -> HashMap<String, PathBuf> {
    let exe = std::env::current_exe().expect("the test executable's path");
    // <target>/<profile>/deps/<exe>
    let profile_dir = exe
        .parent()
        .and_then(|d| d.parent())
        .expect("<target>/<profile>");
    let target_dir = profile_dir.parent().expect("<target>");
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let mut build = Command::new(cargo);
    // Without what `cargo test` sets for this package: build scripts that track it (ring's
    // tracks CARGO_PKG_NAME and CARGO_MANIFEST_DIR) would run again and rebuild what
    // depends on them (flamefleet_e2e::binaries::without_cargo_test_env, which this package
    // cannot depend on, says more).
    for (name, _) in std::env::vars_os() {
        if name.to_str().is_some_and(|n| {
            n.starts_with("CARGO_PKG_")
                || n.starts_with("CARGO_BIN_EXE_")
                || n == "CARGO_MANIFEST_DIR"
                || n == "CARGO_MANIFEST_PATH"
                || n == "CARGO_CRATE_NAME"
                || n == "CARGO_PRIMARY_PACKAGE"
                || n == "CARGO_TARGET_TMPDIR"
                || n == "OUT_DIR"
        }) {
            build.env_remove(name);
        }
    }
    build
        // The whole workspace's feature set: the suite (`cargo test --workspace`) has then
        // built these already, where `-p flamefleet-agent` alone would resolve other
        // features for shared dependencies and rebuild them and every test (minutes of CI).
        .args(["test", "--workspace", "--no-run", "--message-format=json"])
        .env("CARGO_TARGET_DIR", target_dir)
        .current_dir(env!("CARGO_MANIFEST_DIR"));
    for name in TESTS
        .iter()
        .chain(&OFFCPU_TESTS)
        .map(|t| t.0)
        .chain([HEAP_EBPF_TEST.0, STACK_TOP_TEST.0])
    {
        build.args(["--test", name]);
    }
    if profile_dir.file_name().is_some_and(|n| n == "release") {
        build.arg("--release");
    }
    let out = build.output().expect("running cargo");
    assert!(
        out.status.success(),
        "building the engines' tests failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let mut found = HashMap::new();
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let Ok(msg) = serde_json::from_str::<serde_json::Value>(line) else {
            continue;
        };
        let ours = msg["package_id"].as_str().is_some_and(|id| {
            id.contains("#flamefleet-agent@") || id.starts_with("flamefleet-agent ")
        });
        if let (true, Some(name), Some(path)) = (
            ours,
            msg["target"]["name"].as_str(),
            msg["executable"].as_str(),
        ) {
            found.insert(name.to_owned(), PathBuf::from(path));
        }
    }
    found
}

/// The Go heap test's workload, built once on the host with the installed toolchain for
/// every guest (`go build` under TCG took 64 to 202 s per guest), in the target directory:
/// the guests see it at the same path, and their own /tmp is not the host's.
fn prebuilt_goruntime() -> &'static Path {
    static BUILT: OnceLock<PathBuf> = OnceLock::new();
    BUILT.get_or_init(|| {
        let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("guest-tier-go");
        let _ = std::fs::remove_dir_all(&dir);
        let began = Instant::now();
        let bin = support::go::build_workload(&dir, "goruntime", None, "", false, &[]);
        println!(
            "goruntime built on the host in {:.1}s",
            began.elapsed().as_secs_f64()
        );
        bin
    })
}

/// The guests run one at a time.
static ONE_GUEST: Mutex<()> = Mutex::new(());

fn run_tier(k: &GuestKernel) {
    let _one = ONE_GUEST.lock().unwrap_or_else(|e| e.into_inner());
    assert!(
        nix::unistd::geteuid().is_root(),
        "the guest tier boots kernels whose tests load eBPF as root: run it as root (scripts/test.sh)"
    );
    let kernel = Kernel::find(k.release).unwrap_or_else(|e| panic!("{e}"));
    let executables = test_executables();
    // The guests see the host's files at their own paths, except under /tmp (a tmpfs of
    // their own there).
    let hidden: Vec<&Path> = std::iter::once(Path::new(env!("CARGO_MANIFEST_DIR")))
        .chain(executables.values().map(PathBuf::as_path))
        .filter(|p| p.starts_with("/tmp"))
        .collect();
    assert!(
        hidden.is_empty(),
        "the guests mount a /tmp of their own, so they cannot see {hidden:?}: put the checkout and CARGO_TARGET_DIR outside /tmp"
    );
    let mut tests: Vec<(&str, &str)> = TESTS.to_vec();
    if k.heap_ebpf == "ran" {
        tests.push(HEAP_EBPF_TEST);
    }
    if k.frame_walk == "bounded-loop" {
        tests.push(STACK_TOP_TEST);
    }
    if k.offcpu == "ran" {
        tests.extend(OFFCPU_TESTS);
    }
    let mut script = format!(
        "cd {}\nfailed=0\n{TEST_WATCHDOG}",
        env!("CARGO_MANIFEST_DIR")
    );
    for (bin, test) in &tests {
        let exe = executables
            .get(*bin)
            .unwrap_or_else(|| panic!("cargo built no test executable {bin}"));
        script.push_str(&format!(
            "echo '== run {bin}::{test}'\nstart=$(date +%s)\nff_run {bin}::{test} {WITHOUT_SYS_RESOURCE} {} --exact {test} --test-threads=1 --nocapture\nrc=$?\necho \"== status {bin}::{test} $rc $(( $(date +%s) - start ))s\"\n[ $rc -eq 0 ] || failed=$((failed + 1))\n",
            guest::shell_quote(&exe.display().to_string())
        ));
    }
    script.push_str("exit $failed\n");
    // The host's pprof: Go builds it on first use, which would take minutes in the guest.
    let pprof = Command::new("go")
        .args(["tool", "-n", "pprof"])
        .output()
        .expect("running `go tool -n pprof` (install Go)");
    assert!(
        pprof.status.success(),
        "go tool -n pprof: {}",
        String::from_utf8_lossy(&pprof.stderr)
    );
    let pprof = String::from_utf8_lossy(&pprof.stdout).trim().to_owned();
    // A tier runs in 2 to 3 minutes here (126-148 s at load 4-6); a hung boot is cut short
    // by the boot timeout and tried again, so this bounds only a command that hangs.
    let config = GuestConfig {
        timeout: Duration::from_secs(20 * 60),
        env: vec![
            ("RUST_BACKTRACE".into(), "1".into()),
            ("FLAMEFLEET_PPROF".into(), pprof),
            (
                support::go::PREBUILT_GORUNTIME.into(),
                prebuilt_goruntime().display().to_string(),
            ),
        ],
        ..GuestConfig::default()
    };
    let script = script.replace("HANG_SECS", &TEST_HANG_SECS.to_string());
    let out = guest::run(&kernel, &config, &script).unwrap_or_else(|e| panic!("{e}"));
    for hung in &out.hung_boots {
        println!(
            "{}: a boot hung before the command and was killed after {}s, then booted again; its console ended:\n{}",
            k.release,
            hung.seconds,
            guest::tail(&hung.console_tail, 8)
        );
    }
    // A test that hung is reported whatever its second run did: where each thread stood.
    for hung in out.output.split("== hung ").skip(1) {
        let section = hung.split("== end hung ").next().unwrap_or(hung);
        println!("{}: HUNG {}", k.release, guest::tail(section, 250));
    }
    // The figures of this run, whatever the outcome.
    let timings: Vec<&str> = out
        .output
        .lines()
        .filter(|l| l.starts_with("== status "))
        .collect();
    println!(
        "{}: guest ran {:.0}s\n  {}",
        k.release,
        out.elapsed.as_secs_f64(),
        timings.join("\n  ")
    );
    let failed: Vec<String> = tests
        .iter()
        .filter(|(bin, test)| {
            let status = format!("== status {bin}::{test} 0 ");
            !out.output.lines().any(|l| l.starts_with(&status))
        })
        .map(|(bin, test)| format!("{bin}::{test}"))
        .collect();
    // Each failed test's own output, whole: a tail of the guest's output would show the
    // tests that ran after it.
    let sections: Vec<String> = failed
        .iter()
        .map(|name| {
            let lines: Vec<&str> = out
                .output
                .lines()
                .skip_while(|l| *l != format!("== run {name}"))
                .take_while(|l| !l.starts_with(&format!("== status {name} ")))
                .collect();
            guest::tail(&lines.join("\n"), 200)
        })
        .collect();
    assert!(
        failed.is_empty(),
        "{failed:?} failed under {} (exit {}):\n{}\n--- console ---\n{}",
        k.release,
        out.status,
        sections.join("\n"),
        guest::tail(&out.console, 20)
    );
    assert_eq!(out.status, 0, "{}", guest::tail(&out.output, 80));
    // Printed by a test, so after libtest's "test NAME ... " on the same line.
    let marker = format!("kernel {}: features", k.release);
    let features = out
        .output
        .lines()
        .find_map(|l| l.find(&marker).map(|at| &l[at..]))
        .unwrap_or_else(|| panic!("no feature line from {}:\n{}", k.release, out.output));
    println!("  {features}");
    let after_idle = if k.psi_stamps {
        "psi-stamps"
    } else {
        "clock-read-after-idle"
    };
    let offcpu = if k.offcpu == "ran" {
        "tp_btf-sched_switch"
    } else {
        "refused"
    };
    for expected in [
        format!("cpu.frame_walk={}", k.frame_walk),
        format!("targets={}", k.targets),
        format!("runqlat.after_idle={after_idle}"),
        format!("offcpu={offcpu}"),
    ] {
        assert!(
            features.contains(&expected),
            "{} should run with {expected}: {features}",
            k.release
        );
    }
    for said in [
        format!("heap-ebpf: {}", k.heap_ebpf),
        format!("heap-ebpf caps: {}", k.heap_ebpf_chart_caps),
        format!("offcpu: {}", k.offcpu),
    ] {
        assert!(
            out.output.lines().any(|l| l.contains(&said)),
            "{} should say {said:?}:\n{}",
            k.release,
            out.output
        );
    }
    if let Some(refusal) = out
        .output
        .lines()
        .find_map(|l| l.find("offcpu: refused: ").map(|at| &l[at..]))
    {
        println!("  {refusal}");
        for lacks in k.offcpu_lacks {
            assert!(
                refusal.contains(lacks),
                "{}'s off-CPU refusal should name {lacks:?}: {refusal}",
                k.release
            );
        }
    }
}

// Each guest boots under TCG and costs minutes: measured on this 2-core machine while
// other builds ran (load 4-9), the 5.10 guest ran 159-193 s, 6.1 212-223 s, 6.12 194-213 s
// (`guest ran` in the output), 11.2-11.7 minutes for the three.
#[test]
fn linux_5_10() {
    run_tier(&GuestKernel {
        release: "5.10.0-32-amd64",
        frame_walk: "bounded-loop",
        targets: "ancestry-walk",
        heap_ebpf: "refused",
        heap_ebpf_chart_caps: "refused",
        psi_stamps: false,
        offcpu: "refused",
        offcpu_lacks: &[
            "the bpf_loop() helper (Linux 5.17)",
            "the bpf_task_pt_regs() helper (Linux 5.15)",
            "task-local storage maps (BPF_MAP_TYPE_TASK_STORAGE) (Linux 5.11)",
        ],
    });
}

#[test]
fn linux_6_1() {
    run_tier(&GuestKernel {
        release: "6.1.0-50-amd64",
        frame_walk: "bpf_loop",
        targets: "ancestry-walk",
        heap_ebpf: "ran",
        heap_ebpf_chart_caps: "needs SYS_ADMIN",
        psi_stamps: false,
        offcpu: "ran",
        offcpu_lacks: &[],
    });
}

#[test]
fn linux_6_12() {
    run_tier(&GuestKernel {
        release: "6.12.95+deb12-amd64",
        frame_walk: "bpf_loop",
        targets: "cgroup-storage-cache",
        heap_ebpf: "ran",
        heap_ebpf_chart_caps: "ran",
        psi_stamps: true,
        offcpu: "ran",
        offcpu_lacks: &[],
    });
}

/// The boot watchdog, for real: a boot timeout far shorter than any boot (QEMU is still in
/// the firmware or the early kernel after 2 s under TCG) makes every attempt count as hung,
/// so each is killed, the next is booted, and the error names the boots and the console.
#[test]
fn a_boot_that_never_reaches_the_command_is_tried_again_then_reported() {
    let _one = ONE_GUEST.lock().unwrap_or_else(|e| e.into_inner());
    let kernel = Kernel::find("6.1.0-50-amd64").unwrap_or_else(|e| panic!("{e}"));
    let config = GuestConfig {
        boot_timeout: Duration::from_secs(2),
        boot_attempts: 2,
        ..GuestConfig::default()
    };
    let began = Instant::now();
    let err = guest::run(&kernel, &config, "echo never")
        .expect_err("a guest cannot run a command within 2 s of QEMU's start under TCG")
        .to_string();
    assert!(
        err.contains("had not started the command 2s after QEMU started, in each of 2 boots"),
        "{err}"
    );
    assert!(
        err.contains("--- last lines of the guest's console ---"),
        "{err}"
    );
    // Two boots of about 2 s each, killed: far from the command's 20-minute timeout.
    assert!(
        began.elapsed() < Duration::from_secs(120),
        "the hung boots were not cut at the boot timeout: {:?}",
        began.elapsed()
    );
}
