//! Pod targets resolved in real cgroup trees laid out like the kubelet's
//! (systemd and cgroupfs drivers, containerd and CRI-O names), and a CPU
//! capture of a pod cgroup that covers its container cgroups.

mod support;

use std::process::Command;
use std::time::Duration;

use flamefleet_agent::capture::cpu::CpuOptions;
use flamefleet_agent::capture::{CaptureTarget, SamplerConfig, Samplers};
use flamefleet_agent::cgroup::{Cgroup, CgroupRoot};
use support::{TestCgroup, compile_c, require_root, serial};

/// Creates `rel` under `base` and returns the directories made, deepest last.
fn mkdirs(base: &std::path::Path, rel: &str) -> Vec<std::path::PathBuf> {
    let mut made = Vec::new();
    let mut p = base.to_path_buf();
    for part in rel.split('/') {
        p.push(part);
        std::fs::create_dir(&p).unwrap();
        made.push(p.clone());
    }
    made
}

fn rmdirs(made: &[std::path::PathBuf]) {
    for d in made.iter().rev() {
        let _ = std::fs::remove_dir(d);
    }
}

#[test]
fn resolves_pods_for_both_drivers_and_runtimes() {
    require_root();
    let base = TestCgroup::new("kubelet");
    let root = CgroupRoot::new(base.path()).expect("a cgroup2 directory works as a root");
    let uid = "8a7f1c2e-0b1d-4c3e-9f00-123456789abc";
    let cid = "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef";
    let cases = [
        (
            format!(
                "kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{}.slice/cri-containerd-{cid}.scope",
                uid.replace('-', "_")
            ),
            "systemd + containerd",
        ),
        (
            format!("kubepods/besteffort/pod{uid}/{cid}"),
            "cgroupfs + containerd",
        ),
        (
            format!(
                "kubepods.slice/kubepods-pod{}.slice/crio-{cid}.scope",
                uid.replace('-', "_")
            ),
            "systemd + CRI-O, guaranteed",
        ),
        (
            format!("kubepods/burstable/pod{uid}/crio-{cid}"),
            "cgroupfs + CRI-O",
        ),
    ];
    for (rel, what) in &cases {
        let made = mkdirs(base.path(), rel);
        let container = root
            .resolve_pod(uid, Some(&format!("containerd://{cid}")))
            .unwrap_or_else(|e| panic!("{what}: {e}"));
        assert_eq!(container.path, *made.last().unwrap(), "{what}");
        let pod = root.resolve_pod(uid, None).unwrap();
        assert_eq!(pod.path, made[made.len() - 2], "{what}: pod cgroup");
        rmdirs(&made);
    }
    let err = root.resolve_pod(uid, Some(cid)).unwrap_err().to_string();
    assert!(
        err.contains("no cgroup found for pod") && err.contains(uid),
        "{err}"
    );
    // Relative raw paths resolve under the root; the ID is the inode.
    let made = mkdirs(base.path(), "raw");
    let cg = root.resolve_path(std::path::Path::new("raw")).unwrap();
    assert_eq!(cg, Cgroup::open(&made[0]).unwrap());
    rmdirs(&made);
}

#[test]
fn capturing_a_pod_cgroup_includes_its_containers() {
    require_root();
    let _serial = serial();
    let dir = tempfile::tempdir().unwrap();
    let spin = compile_c(
        dir.path(),
        "ffpodspin",
        "static volatile unsigned long s; int main(void) { for (;;) s++; }",
    );
    let pod = TestCgroup::new("pod");
    let container_dir = pod.path().join("app");
    std::fs::create_dir(&container_dir).unwrap();
    let mut container = TestCgroup::adopt(Cgroup::open(&container_dir).unwrap());
    let pid = container.spawn(&mut Command::new(&spin));
    let samplers = Samplers::new(SamplerConfig::default());
    let c = samplers
        .start_cpu(
            &[CaptureTarget::raw(pod.cgroup.clone())],
            &CpuOptions::default(),
        )
        .unwrap();
    let cpu_before = container.cpu_usage();
    std::thread::sleep(Duration::from_secs(2));
    let r = c.finish().unwrap();
    let cpu = container.cpu_usage() - cpu_before;
    let own: u64 = r
        .samples
        .iter()
        .filter(|s| s.tgid == pid)
        .map(|s| s.count)
        .sum();
    // On a loaded machine the spinner may get only part of a CPU: compare with the CPU
    // time it really had (99 Hz default).
    let expected = cpu.as_secs_f64() * 99.0;
    assert!(
        expected > 10.0 && own as f64 >= 0.7 * expected,
        "the container's process is sampled through its pod: {own} samples for {:.2} s of CPU (~{expected:.0} expected)",
        cpu.as_secs_f64()
    );
    drop(container);
}
