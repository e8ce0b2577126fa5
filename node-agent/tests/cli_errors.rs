//! Bad input to `flamefleet-agent capture`: a clear message and a non-zero
//! exit, never a panic. Runs the real binary.

mod support;

use std::os::unix::process::CommandExt as _;
use std::process::{Command, Output};

use support::{TestCgroup, require_root};

fn agent(args: &[&str]) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_flamefleet-agent"));
    c.arg("capture").args(args);
    c
}

fn expect_failure(out: Output, needle: &str) {
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success(),
        "expected a non-zero exit, stderr: {stderr}"
    );
    assert!(!stderr.contains("panicked"), "must not panic: {stderr}");
    assert!(
        stderr.to_lowercase().contains(&needle.to_lowercase()),
        "expected {needle:?} in the error, got: {stderr}"
    );
}

#[test]
fn missing_cgroup_is_reported() {
    require_root();
    let out = agent(&[
        "--type",
        "cpu",
        "--cgroup",
        "/sys/fs/cgroup/flamefleet-no-such-cgroup",
        "-o",
        "/dev/null",
    ])
    .output()
    .unwrap();
    expect_failure(out, "does not exist");
}

#[test]
fn cgroup_v1_path_is_refused() {
    require_root();
    // A named, controller-less v1 hierarchy of our own: works on hybrid and
    // pure-v2 hosts alike.
    let dir = tempfile::tempdir().unwrap();
    let mounted = Command::new("mount")
        .args(["-t", "cgroup", "-o", "none,name=flamefleet-test"])
        .arg("cgroup")
        .arg(dir.path())
        .status()
        .unwrap();
    assert!(mounted.success(), "mounting a cgroup v1 hierarchy failed");
    let out = agent(&[
        "--type",
        "cpu",
        "--cgroup",
        dir.path().to_str().unwrap(),
        "-o",
        "/dev/null",
    ])
    .output()
    .unwrap();
    let _ = Command::new("umount").arg(dir.path()).status();
    expect_failure(out, "cgroup v1");
}

#[test]
fn zero_duration_and_bad_frequencies_are_refused() {
    require_root();
    let cg = TestCgroup::new("cli-bad");
    let path = cg.path().to_str().unwrap();
    let out = agent(&[
        "--type",
        "cpu",
        "--cgroup",
        path,
        "--duration",
        "0s",
        "-o",
        "/dev/null",
    ])
    .output()
    .unwrap();
    expect_failure(out, "--duration must be greater than 0");
    for f in ["0", "100000"] {
        let out = agent(&[
            "--type",
            "cpu",
            "--cgroup",
            path,
            "--duration",
            "1s",
            "--frequency",
            f,
            "-o",
            "/dev/null",
        ])
        .output()
        .unwrap();
        expect_failure(out, "frequency must be between 1 and");
    }
    let out = agent(&[
        "--type",
        "cpu",
        "--cgroup",
        path,
        "--duration",
        "soon",
        "-o",
        "/dev/null",
    ])
    .output()
    .unwrap();
    expect_failure(out, "invalid value");
}

/// CAP_BPF, CAP_PERFMON and CAP_SYS_ADMIN (which implies both).
const BPF_CAPS: [libc::c_ulong; 3] = [39, 38, 21];

#[test]
fn without_cap_bpf_both_types_fail_with_a_privilege_error() {
    require_root();
    let cg = TestCgroup::new("cli-nocap");
    let path = cg.path().to_str().unwrap().to_owned();
    for kind in ["cpu", "runqlat"] {
        let mut cmd = agent(&[
            "--type",
            kind,
            "--cgroup",
            &path,
            "--duration",
            "1s",
            "-o",
            "/dev/null",
        ]);
        // SAFETY: prctl only, between fork and exec. Dropping the caps from
        // the bounding set means the exec'd root process does not get them.
        unsafe {
            cmd.pre_exec(|| {
                for cap in BPF_CAPS {
                    if libc::prctl(libc::PR_CAPBSET_DROP, cap, 0, 0, 0) != 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                }
                Ok(())
            });
        }
        let out = cmd.output().unwrap();
        expect_failure(out, "CAP_BPF");
    }
}

#[test]
fn missing_output_directory_is_reported_after_capture() {
    require_root();
    let cg = TestCgroup::new("cli-out");
    let out = agent(&[
        "--type",
        "runqlat",
        "--cgroup",
        cg.path().to_str().unwrap(),
        "--duration",
        "200ms",
        "-o",
        "/nonexistent-dir/x.pb.gz",
    ])
    .output()
    .unwrap();
    expect_failure(out, "/nonexistent-dir/x.pb.gz");
}

#[test]
fn serve_map_sizes_out_of_range_are_refused() {
    for (flag, value) in [("--max-stacks", "0"), ("--max-targets", "99999999")] {
        let out = Command::new(env!("CARGO_BIN_EXE_flamefleet-agent"))
            .args(["serve", "--node-name", "n1", flag, value])
            .output()
            .unwrap();
        expect_failure(out, &format!("invalid value '{value}' for '{flag}"));
    }
}
