//! The pods of a `Capture` call (proto `Target`s) to capture targets: one
//! cgroup per container (or the pod's cgroup when no container is named),
//! labelled with the pod's namespace, name and container.

use std::collections::BTreeMap;

use flamefleet_proto::agent::Target;

use crate::capture::heap::HeapTarget;
use crate::capture::heap::endpoint::{EndpointError, resolve_endpoint};
use crate::capture::{CaptureTarget, TargetLabels};
use crate::cgroup::CgroupRoot;

pub use crate::capture::STARTED_DURING_CAPTURE;

/// One resolved container (or pod) of a request.
#[derive(Debug, Clone)]
pub struct ResolvedTarget {
    /// Its cgroup and labels.
    pub capture: CaptureTarget,
    /// The pod's IP (for heap endpoints).
    pub pod_ip: String,
    /// The pod's annotations (for heap endpoints).
    pub annotations: BTreeMap<String, String>,
}

/// Resolves every target under `root`. All must resolve: a capture that
/// silently left out a container would report a misleading profile.
///
/// # Errors
/// One line per target that did not resolve (empty pod UID, no cgroup for the
/// pod or container), ready to be shown as the FAILED reason.
pub fn resolve(root: &CgroupRoot, targets: &[Target]) -> Result<Vec<ResolvedTarget>, String> {
    if targets.is_empty() {
        return Err("the request has no targets on this node; expected at least one pod".into());
    }
    let mut out = Vec::new();
    let mut errors = Vec::new();
    for t in targets {
        let pod = format!("{}/{}", t.namespace, t.pod_name);
        if t.pod_uid.trim().is_empty() {
            errors.push(format!("pod {pod}: empty pod UID; expected metadata.uid"));
            continue;
        }
        let annotations: BTreeMap<String, String> = t
            .annotations
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        let containers: Vec<(&str, Option<&str>)> = if t.containers.is_empty() {
            vec![("", None)]
        } else {
            t.containers
                .iter()
                .map(|c| {
                    let id = c.container_id.trim();
                    (c.name.as_str(), (!id.is_empty()).then_some(id))
                })
                .collect()
        };
        for (name, id) in containers {
            if id.is_none() && !name.is_empty() {
                errors.push(format!(
                    "pod {pod}, container {name}: no container ID (not started yet?); expected e.g. containerd://<id>"
                ));
                continue;
            }
            match root.resolve_pod(&t.pod_uid, id) {
                Ok(cgroup) => out.push(ResolvedTarget {
                    capture: CaptureTarget {
                        cgroup,
                        labels: TargetLabels {
                            namespace: t.namespace.clone(),
                            pod: t.pod_name.clone(),
                            container: name.to_owned(),
                        },
                    },
                    pod_ip: t.pod_ip.clone(),
                    annotations: annotations.clone(),
                }),
                Err(e) => errors.push(format!("pod {pod}: {e}")),
            }
        }
        // The pod's own cgroup too, below its listed containers: the samplers attribute a
        // task to its deepest target, so containers listed at capture start keep their
        // names, and a container the kubelet (re)starts during the capture, whose cgroup
        // nobody could name in advance, is still captured, under the pod.
        if !t.containers.is_empty()
            && let Ok(cgroup) = root.resolve_pod(&t.pod_uid, None)
        {
            out.push(ResolvedTarget {
                capture: CaptureTarget {
                    cgroup,
                    labels: TargetLabels {
                        namespace: t.namespace.clone(),
                        pod: t.pod_name.clone(),
                        container: STARTED_DURING_CAPTURE.to_owned(),
                    },
                },
                pod_ip: t.pod_ip.clone(),
                annotations: annotations.clone(),
            });
        }
    }
    if errors.is_empty() {
        Ok(out)
    } else {
        Err(errors.join("; "))
    }
}

/// Heap targets: each container with its cgroup, and the pod's pprof endpoint
/// (from its annotations and IP, or the request's explicit port/path) when
/// one can be derived. Endpoint problems are not fatal here: the heap engine
/// falls back to eBPF (source `auto`) or reports them (source `endpoint`).
pub fn heap_targets(
    resolved: &[ResolvedTarget],
    endpoint_port: u32,
    endpoint_path: &str,
) -> Vec<HeapTarget> {
    resolved
        .iter()
        .filter_map(|t| {
            let mut annotations = t.annotations.clone();
            if endpoint_port != 0 {
                annotations.insert(
                    crate::capture::heap::endpoint::ANNOTATION_PORT.into(),
                    endpoint_port.to_string(),
                );
            }
            if !endpoint_path.is_empty() {
                annotations.insert(
                    crate::capture::heap::endpoint::ANNOTATION_PATH.into(),
                    endpoint_path.to_owned(),
                );
            }
            let endpoint = resolve_endpoint(None, &annotations, &t.pod_ip)
                .map_err(|e: EndpointError| {
                    tracing::debug!(pod = %t.capture.labels.pod, error = %e, "no heap endpoint")
                })
                .ok();
            // The pod-level target only widens eBPF coverage to containers started during
            // the capture; an endpoint would be fetched twice through it.
            if t.capture.labels.container == STARTED_DURING_CAPTURE && endpoint.is_some() {
                return None;
            }
            Some(HeapTarget {
                labels: t.capture.labels.clone(),
                cgroup: Some(t.capture.cgroup.clone()),
                endpoint,
            })
        })
        .collect()
}

/// The distinct pod names of the targets, in request order.
pub fn pod_names(targets: &[Target]) -> Vec<String> {
    let mut names: Vec<String> = Vec::new();
    for t in targets {
        if !t.pod_name.is_empty() && !names.contains(&t.pod_name) {
            names.push(t.pod_name.clone());
        }
    }
    names
}
