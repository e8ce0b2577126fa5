//! The resource attributes of exported profiles, following OpenTelemetry's semantic
//! conventions for Kubernetes (`k8s.*`) and services (`service.*`).
//!
//! Every value comes from what the operator itself resolved (the request's namespace, the
//! node it dispatched to, the pods it targeted there and their owners), never from the
//! profile: the pprof's `namespace`, `pod` and `container` labels only pick which of the
//! node's targets a sample belongs to. A sample whose labels name no target of that node
//! (an agent that lies, or a bug) is exported under the request's namespace and node with
//! no pod, so a compromised node cannot file its samples under another tenant's pods.

use flamefleet_pprof::otlp::Owner;
use flamefleet_pprof::otlp::common::{AnyValue, KeyValue, any_value};

use crate::pods::target::{TargetPod, Workload};

/// `service.name` of samples no target owns (the conventions' value for an unknown service).
pub const UNKNOWN_SERVICE: &str = "unknown_service";

/// What an export keeps of a target pod: its identity only (never its annotations, which a
/// tenant may fill up to the API server's limit, in a queue of many captures).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExportedPod {
    /// Pod name.
    pub name: String,
    /// Pod UID.
    pub uid: String,
    /// Names of the containers that were targeted.
    pub containers: Vec<String>,
    /// Its controller.
    pub workload: Option<Workload>,
}

impl From<&TargetPod> for ExportedPod {
    fn from(pod: &TargetPod) -> Self {
        Self {
            name: pod.name.clone(),
            uid: pod.uid.clone(),
            containers: pod.containers.iter().map(|c| c.name.clone()).collect(),
            workload: pod.workload.clone(),
        }
    }
}

/// What an export knows of one node's capture.
#[derive(Debug, Clone)]
pub struct CaptureContext {
    /// The request's namespace.
    pub namespace: String,
    /// The request's name; empty for an always-on window, which has none.
    pub request: String,
    /// The always-on policy a window comes from (`namespace/name` of a SamplingPolicy, the
    /// name of a ClusterSamplingPolicy); empty for a capture.
    pub policy: String,
    /// The node.
    pub node: String,
    /// The request's pods on that node.
    pub pods: Vec<ExportedPod>,
}

fn string(key: &str, value: &str) -> KeyValue {
    KeyValue {
        key: key.to_owned(),
        value: Some(AnyValue {
            value: Some(any_value::Value::StringValue(value.to_owned())),
        }),
        key_strindex: 0,
    }
}

/// The resource attributes of the samples of `owner` in a capture of `context`.
pub fn attributes(context: &CaptureContext, owner: &Owner) -> Vec<KeyValue> {
    let mut out = vec![
        string("k8s.namespace.name", &context.namespace),
        string("service.namespace", &context.namespace),
        string("k8s.node.name", &context.node),
    ];
    if !context.request.is_empty() {
        out.push(string("flamefleet.request.name", &context.request));
    }
    if !context.policy.is_empty() {
        out.push(string("flamefleet.policy.name", &context.policy));
    }
    let pod = context.pods.iter().find(|p| {
        owner.namespace.as_deref() == Some(context.namespace.as_str())
            && owner.pod.as_deref() == Some(p.name.as_str())
    });
    let Some(pod) = pod else {
        out.push(string("service.name", UNKNOWN_SERVICE));
        return out;
    };
    out.push(string("k8s.pod.name", &pod.name));
    out.push(string("k8s.pod.uid", &pod.uid));
    if let Some(container) = owner
        .container
        .as_deref()
        .filter(|c| pod.containers.iter().any(|t| t == c))
    {
        out.push(string("k8s.container.name", container));
    }
    let service = match &pod.workload {
        Some(workload) => {
            out.push(string(workload.attribute, &workload.name));
            if let Some(rs) = &workload.replica_set {
                out.push(string("k8s.replicaset.name", rs));
            }
            workload.name.as_str()
        }
        None => pod.name.as_str(),
    };
    out.push(string("service.name", service));
    out
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;
    use crate::pods::target::TargetContainer;

    fn context() -> CaptureContext {
        let pod = |name: &str, workload: Option<Workload>| {
            ExportedPod::from(&TargetPod {
                name: name.into(),
                namespace: "shop".into(),
                uid: format!("uid-{name}"),
                node: "n1".into(),
                pod_ip: None,
                containers: vec![TargetContainer {
                    name: "app".into(),
                    container_id: "containerd://1".into(),
                }],
                annotations: BTreeMap::from([("big".into(), "x".repeat(1000))]),
                workload,
            })
        };
        CaptureContext {
            policy: String::new(),
            namespace: "shop".into(),
            request: "checkout-cpu".into(),
            node: "n1".into(),
            pods: vec![
                pod(
                    "web-abc",
                    Some(Workload {
                        attribute: "k8s.deployment.name",
                        name: "web".into(),
                        replica_set: Some("web-5f6".into()),
                    }),
                ),
                pod("lonely", None),
            ],
        }
    }

    fn owner(ns: &str, pod: &str, container: &str) -> Owner {
        Owner {
            namespace: Some(ns.into()),
            pod: Some(pod.into()),
            container: Some(container.into()),
        }
    }

    fn map(attrs: Vec<KeyValue>) -> BTreeMap<String, String> {
        attrs
            .into_iter()
            .map(|kv| {
                let v = match kv.value.and_then(|v| v.value) {
                    Some(any_value::Value::StringValue(s)) => s,
                    other => panic!("{} is {other:?}", kv.key),
                };
                (kv.key, v)
            })
            .collect()
    }

    #[test]
    fn a_deployments_pod_gets_the_conventions_attributes() {
        let a = map(attributes(&context(), &owner("shop", "web-abc", "app")));
        let want: BTreeMap<String, String> = [
            ("k8s.namespace.name", "shop"),
            ("service.namespace", "shop"),
            ("k8s.node.name", "n1"),
            ("flamefleet.request.name", "checkout-cpu"),
            ("k8s.pod.name", "web-abc"),
            ("k8s.pod.uid", "uid-web-abc"),
            ("k8s.container.name", "app"),
            ("k8s.deployment.name", "web"),
            ("k8s.replicaset.name", "web-5f6"),
            ("service.name", "web"),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect();
        assert_eq!(a, want);
        // No workload: the service is named after the pod.
        let a = map(attributes(&context(), &owner("shop", "lonely", "app")));
        assert_eq!(a["service.name"], "lonely");
        assert!(!a.contains_key("k8s.deployment.name"));
    }

    #[test]
    fn labels_naming_no_target_get_no_pod_and_keep_the_requests_namespace() {
        for o in [
            owner("bank", "web-abc", "app"),
            owner("shop", "someone-else", "app"),
            Owner::default(),
        ] {
            let a = map(attributes(&context(), &o));
            assert_eq!(a["k8s.namespace.name"], "shop", "{o:?}");
            assert_eq!(a["service.name"], UNKNOWN_SERVICE, "{o:?}");
            assert!(!a.contains_key("k8s.pod.name"), "{o:?}");
        }
        // A container the pod does not have is left out, the pod kept.
        let a = map(attributes(&context(), &owner("shop", "web-abc", "sidecar")));
        assert_eq!(a["k8s.pod.name"], "web-abc");
        assert!(!a.contains_key("k8s.container.name"));
    }
}
