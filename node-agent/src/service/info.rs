//! What this agent is and can do (the `Info` call): kernel release, the
//! profile types whose kernel prerequisites are present, and the missing ones.

use std::path::Path;

use flamefleet_proto::agent::{InfoResponse, ProfileType};

/// The API version served (the proto package).
pub const API_VERSION: &str = "flamefleet.agent.v1";

/// A kernel prerequisite and where it is visible.
struct Feature {
    name: &'static str,
    present: bool,
}

/// The running kernel's release (`uname -r`), or an empty string when
/// /proc is not mounted.
pub fn kernel_release() -> String {
    std::fs::read_to_string("/proc/sys/kernel/osrelease")
        .map(|s| s.trim().to_owned())
        .unwrap_or_default()
}

fn probe() -> (Feature, Feature) {
    let btf = Feature {
        name: "BTF (/sys/kernel/btf/vmlinux, CONFIG_DEBUG_INFO_BTF=y)",
        present: Path::new("/sys/kernel/btf/vmlinux").exists(),
    };
    let perf = Feature {
        name: "perf events (/proc/sys/kernel/perf_event_paranoid, CONFIG_PERF_EVENTS=y)",
        present: Path::new("/proc/sys/kernel/perf_event_paranoid").exists(),
    };
    (btf, perf)
}

/// Probes the kernel and answers `Info` for `node`.
pub fn info(node: &str) -> InfoResponse {
    let (btf, perf) = probe();
    let mut supported = Vec::new();
    if btf.present && perf.present {
        supported.push(ProfileType::Cpu as i32);
    }
    // Heap profiles can always come from the pods' pprof endpoints; eBPF
    // allocation sampling additionally needs BTF (uprobes are CO-RE programs).
    supported.push(ProfileType::Heap as i32);
    if btf.present {
        supported.push(ProfileType::Runqlat as i32);
    }
    if btf.present
        && crate::capture::kernel::KernelFeatures::get()
            .offcpu_refusal()
            .is_none()
    {
        supported.push(ProfileType::Offcpu as i32);
    }
    let missing_features = [btf, perf]
        .into_iter()
        .filter(|f| !f.present)
        .map(|f| f.name.to_owned())
        .collect();
    InfoResponse {
        node_name: node.to_owned(),
        kernel_release: kernel_release(),
        supported_types: supported,
        agent_version: env!("CARGO_PKG_VERSION").to_owned(),
        api_version: API_VERSION.to_owned(),
        missing_features,
    }
}
