//! The operator's side of the agent contract: a node's `CaptureRequest` from the request's
//! spec, and its outcome from the agent's DONE message. Every option and result crosses as a
//! typed proto field; the text summary the agent also sends is for display only.

use flamefleet_api::{Artifact, HeapSource, ProfileType, RunqlatUnit};
use flamefleet_proto::agent::{self as pb, CaptureRequest};

use super::outcome::NodeOutcome;
use super::{CapturePlan, NodePlan};

/// The wire form of a profile type.
pub fn proto_type(profile_type: ProfileType) -> pb::ProfileType {
    match profile_type {
        ProfileType::Cpu => pb::ProfileType::Cpu,
        ProfileType::Heap => pb::ProfileType::Heap,
        ProfileType::Runqlat => pb::ProfileType::Runqlat,
        ProfileType::Offcpu => pb::ProfileType::Offcpu,
    }
}

/// The CaptureRequest of one node (pure).
pub fn capture_request(
    plan: &CapturePlan,
    node: &NodePlan,
    uploads: Vec<pb::UploadSlot>,
) -> CaptureRequest {
    let spec = &plan.spec;
    let profile_type = proto_type(spec.profile_type);
    let heap = (spec.profile_type == ProfileType::Heap).then(|| {
        let options = spec.heap_options();
        let mut heap = pb::HeapOptions {
            endpoint_port: options
                .endpoint
                .as_ref()
                .and_then(|e| u32::try_from(e.port).ok())
                .unwrap_or(0),
            endpoint_path: options.endpoint.map(|e| e.path).unwrap_or_default(),
            sample_bytes: options
                .sample_bytes
                .and_then(|b| u64::try_from(b).ok())
                .unwrap_or(0),
            max_overhead_percent: options
                .max_overhead_percent
                .and_then(|p| u32::try_from(p).ok()),
            ..Default::default()
        };
        heap.set_source_kind(match options.source {
            HeapSource::Auto => pb::HeapSource::Auto,
            HeapSource::Endpoint => pb::HeapSource::Endpoint,
            HeapSource::Ebpf => pb::HeapSource::Ebpf,
            HeapSource::Goruntime => pb::HeapSource::Goruntime,
        });
        heap
    });
    let runqlat = (spec.profile_type == ProfileType::Runqlat).then(|| {
        let options = spec.runqlat_options();
        let mut runqlat = pb::RunqlatOptions {
            per_process: options.per_process,
            ..Default::default()
        };
        runqlat.set_latency_unit(match options.unit {
            RunqlatUnit::Us => pb::LatencyUnit::Microseconds,
            RunqlatUnit::Ms => pb::LatencyUnit::Milliseconds,
        });
        runqlat
    });
    let offcpu = (spec.profile_type == ProfileType::Offcpu).then(|| {
        let options = spec.offcpu_options();
        pb::OffcpuOptions {
            min_block_micros: options
                .min_block_micros
                .and_then(|us| u32::try_from(us).ok()),
            max_overhead_percent: options
                .max_overhead_percent
                .and_then(|p| u32::try_from(p).ok()),
            with_on_cpu: options.with_on_cpu.unwrap_or(false),
        }
    });
    // The wall-clock view of an off-CPU profile samples on-CPU stacks at the CPU frequency.
    let on_cpu = offcpu.as_ref().is_some_and(|o| o.with_on_cpu);
    let cpu = (spec.profile_type == ProfileType::Cpu || on_cpu).then(|| pb::CpuOptions {
        frequency_hz: u32::try_from(spec.frequency_hz()).unwrap_or(99),
    });
    let mut request = CaptureRequest {
        request_uid: plan.request.uid().to_string(),
        request_namespace: plan.request.namespace().to_string(),
        request_name: plan.request.name().to_string(),
        r#type: 0,
        duration_ms: u32::try_from(plan.duration.as_millis()).unwrap_or(u32::MAX),
        cpu,
        heap,
        runqlat,
        offcpu,
        targets: node
            .targets
            .iter()
            .map(|t| pb::Target {
                pod_uid: t.uid.clone(),
                namespace: t.namespace.clone(),
                pod_name: t.name.clone(),
                containers: t
                    .containers
                    .iter()
                    .map(|c| pb::Container {
                        name: c.name.clone(),
                        container_id: c.container_id.clone(),
                    })
                    .collect(),
                annotations: t.annotations.clone().into_iter().collect(),
                pod_ip: t.pod_ip.clone().unwrap_or_default(),
            })
            .collect(),
        uploads,
        // The dispatcher sets it: it knows the grace.
        deadline_ms: 0,
        // A triggered heap run: the heap its node read at the fire; a triggered CPU run: the
        // lead-up its node read from the ring. Whoever wrote the annotation, the agent hands
        // either only to a capture of the pod it was read from, and the targets are the
        // request's own namespace's pods.
        trigger_fire_id: if matches!(spec.profile_type, ProfileType::Heap | ProfileType::Cpu) {
            plan.trigger_fire_id.clone()
        } else {
            String::new()
        },
    };
    request.set_type(profile_type);
    request
}

/// The outcome of a node whose agent reported DONE and whose `artifacts` passed the store's
/// checks: the artifacts, and the typed summary and histogram of the DONE message, bounded
/// ([`super::agent_report`]).
pub fn done_outcome(artifacts: Vec<Artifact>, done: pb::CaptureProgress) -> NodeOutcome {
    NodeOutcome::Done {
        artifacts,
        summary: super::agent_report::bounded_summary(done.capture_summary),
        runqlat_histogram: super::agent_report::bounded_histogram(done.runqlat_histogram),
    }
}

/// An artifact the agent reported, as the status records it once the store holds it with
/// `size_bytes` and `sha256`.
pub fn artifact(reported: &pb::Artifact, size_bytes: u64, sha256: String) -> Artifact {
    Artifact {
        name: reported.name.clone(),
        url: None,
        size_bytes: i64::try_from(size_bytes).ok(),
        sha256: Some(sha256),
        // An artifact without a sample type (runqlat's text) is not a profile and counts
        // no samples.
        samples: i64::try_from(reported.samples)
            .ok()
            .filter(|_| !reported.sample_type.is_empty()),
        sample_type: Some(reported.sample_type.clone()).filter(|s| !s.is_empty()),
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use flamefleet_api::ProfileRequestSpec;

    use super::*;
    use crate::pods::agents::AgentEndpoint;
    use crate::pods::target::{TargetContainer, TargetPod};
    use crate::store::RequestRef;

    fn plan_of(spec: serde_json::Value) -> CapturePlan {
        let spec: ProfileRequestSpec = serde_json::from_value(spec).unwrap();
        CapturePlan {
            request: RequestRef::new("shop", "req", "0c7e3a40-0000-4000-8000-000000000001")
                .unwrap(),
            duration: spec.capture_duration().unwrap(),
            spec,
            nodes: Vec::new(),
            settled: BTreeMap::new(),
            artifact_quota: 0,
            trigger_fire_id: String::new(),
        }
    }

    #[test]
    fn the_wall_clock_view_asks_for_on_cpu_samples_at_the_cpu_frequency() {
        let node = NodePlan {
            node: "n1".into(),
            agent: AgentEndpoint {
                node: "n1".into(),
                pod: "agent-n1".into(),
                address: "127.0.0.1:7070".into(),
            },
            targets: Vec::new(),
        };
        let wall = plan_of(serde_json::json!({
            "type": "offcpu", "podNames": ["web-1"], "duration": "10s",
            "offcpu": {"withOnCpu": true}, "cpu": {"frequencyHz": 199}
        }));
        let request = capture_request(&wall, &node, Vec::new());
        assert!(request.offcpu.unwrap().with_on_cpu);
        assert_eq!(request.cpu.map(|c| c.frequency_hz), Some(199));
        let plain = plan_of(serde_json::json!({
            "type": "offcpu", "podNames": ["web-1"], "duration": "10s",
            "offcpu": {"minBlockMicros": 500}
        }));
        let request = capture_request(&plain, &node, Vec::new());
        assert!(!request.offcpu.unwrap().with_on_cpu);
        assert!(request.cpu.is_none(), "no CPU sampler without withOnCpu");
    }

    #[test]
    fn capture_request_carries_targets_options_and_slots() {
        let spec: ProfileRequestSpec = serde_json::from_value(serde_json::json!({
            "type": "runqlat", "podNames": ["web-1"], "duration": "2500ms",
            "runqlat": {"perProcess": true, "unit": "ms"}
        }))
        .unwrap();
        let plan = CapturePlan {
            request: RequestRef::new("shop", "req", "0c7e3a40-0000-4000-8000-000000000001")
                .unwrap(),
            duration: spec.capture_duration().unwrap(),
            spec,
            nodes: Vec::new(),
            settled: BTreeMap::new(),
            artifact_quota: 0,
            trigger_fire_id: String::new(),
        };
        let node = NodePlan {
            node: "n1".into(),
            agent: AgentEndpoint {
                node: "n1".into(),
                pod: "agent-n1".into(),
                address: "127.0.0.1:7070".into(),
            },
            targets: vec![TargetPod {
                name: "web-1".into(),
                namespace: "shop".into(),
                uid: "pod-uid".into(),
                node: "n1".into(),
                pod_ip: None,
                containers: vec![TargetContainer {
                    name: "app".into(),
                    container_id: "containerd://abc".into(),
                }],
                annotations: BTreeMap::new(),
                workload: None,
            }],
        };
        let request = capture_request(&plan, &node, Vec::new());
        assert_eq!(request.r#type(), pb::ProfileType::Runqlat);
        assert_eq!(request.duration_ms, 2500);
        assert_eq!(request.request_namespace, "shop");
        let runqlat = request.runqlat.unwrap();
        assert!(runqlat.per_process);
        assert_eq!(runqlat.latency_unit(), pb::LatencyUnit::Milliseconds);
        assert!(request.cpu.is_none() && request.heap.is_none());
        assert_eq!(
            request.targets[0].containers[0].container_id,
            "containerd://abc"
        );
    }
}
