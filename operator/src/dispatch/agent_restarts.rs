//! Why an agent stopped answering mid-capture, from the kubelet's record of its pod. A
//! container the kernel killed at its memory limit is recorded as `OOMKilled`; the node's
//! message then names it and what to do, where it would otherwise only say that the agent
//! went away.

use std::time::Duration;

use k8s_openapi::api::core::v1::{ContainerStatus, Pod};
use kube::Api;

use super::outcome::NodeFailure;

/// How long the lookup may take: it delays the node's result.
const LOOKUP_TIMEOUT: Duration = Duration::from_secs(5);

/// The kubelet's termination reason of a container killed at its memory limit.
const OOM_KILLED: &str = "OOMKilled";

/// Reads agent pods (the operator's RBAC already allows `get` on pods).
#[derive(Clone)]
pub struct AgentPods {
    client: kube::Client,
    namespace: String,
}

impl std::fmt::Debug for AgentPods {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AgentPods")
            .field("namespace", &self.namespace)
            .finish_non_exhaustive()
    }
}

/// An agent container the kernel killed at its memory limit.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OomKill {
    /// The container's name.
    pub container: String,
    /// When it was killed (RFC 3339), as the kubelet recorded it.
    pub at: String,
}

impl std::fmt::Display for OomKill {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "its container {} was OOMKilled at {} (it reached its memory limit); raise the agent's memory limit (chart value agent.resources.limits.memory)",
            self.container, self.at
        )
    }
}

impl AgentPods {
    /// Agent pods in `namespace`.
    pub fn new(client: kube::Client, namespace: impl Into<String>) -> Self {
        Self {
            client,
            namespace: namespace.into(),
        }
    }

    /// The OOM kill of a container of agent pod `pod` at or after `since`, if the kubelet
    /// recorded one. `None` too when the pod cannot be read in time (gone, or the API
    /// server slow): the node's message then says what the operator saw, and nothing more.
    pub async fn oom_killed_since(&self, pod: &str, since: jiff::Timestamp) -> Option<OomKill> {
        let api: Api<Pod> = Api::namespaced(self.client.clone(), &self.namespace);
        let pod = match tokio::time::timeout(LOOKUP_TIMEOUT, api.get_opt(pod)).await {
            Ok(Ok(pod)) => pod?,
            Ok(Err(e)) => {
                tracing::debug!(pod, "reading an interrupted agent's pod: {e}");
                return None;
            }
            Err(_) => return None,
        };
        let statuses = pod.status?.container_statuses?;
        oom_kill(&statuses, since)
    }

    /// `failure` with the agent's OOM kill since `since` named in its message, for the
    /// failures of an agent that went away; any other failure unchanged.
    pub async fn explain(
        &self,
        failure: NodeFailure,
        pod: &str,
        since: jiff::Timestamp,
    ) -> NodeFailure {
        if !matches!(
            failure,
            NodeFailure::Interrupted { .. } | NodeFailure::Unreachable { .. }
        ) {
            return failure;
        }
        let Some(kill) = self.oom_killed_since(pod, since).await else {
            return failure;
        };
        match failure {
            NodeFailure::Interrupted { agent, error } => NodeFailure::Interrupted {
                agent,
                error: format!("{error}; {kill}"),
            },
            NodeFailure::Unreachable {
                agent,
                address,
                error,
            } => NodeFailure::Unreachable {
                agent,
                address,
                error: format!("{error}; {kill}"),
            },
            other => other,
        }
    }
}

/// The OOM kill at or after `since` among `statuses`: a container running again after one
/// (its last state), or still down (its state).
pub fn oom_kill(statuses: &[ContainerStatus], since: jiff::Timestamp) -> Option<OomKill> {
    statuses.iter().find_map(|status| {
        let states = [status.state.as_ref(), status.last_state.as_ref()];
        states.into_iter().flatten().find_map(|state| {
            let terminated = state.terminated.as_ref()?;
            if terminated.reason.as_deref() != Some(OOM_KILLED) {
                return None;
            }
            let at = terminated.finished_at.as_ref()?.0;
            (at >= since).then(|| OomKill {
                container: status.name.clone(),
                at: at.to_string(),
            })
        })
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn status(value: serde_json::Value) -> ContainerStatus {
        serde_json::from_value(value).unwrap()
    }

    #[test]
    fn names_an_oom_kill_since_the_capture_started_only() {
        let since: jiff::Timestamp = "2026-11-28T10:00:00Z".parse().unwrap();
        let restarted = status(serde_json::json!({
            "name": "agent", "image": "a", "imageID": "", "ready": true, "restartCount": 1,
            "state": {"running": {"startedAt": "2026-11-28T10:00:06Z"}},
            "lastState": {"terminated": {"exitCode": 137, "reason": "OOMKilled",
                "finishedAt": "2026-11-28T10:00:05Z"}},
        }));
        assert_eq!(
            oom_kill(std::slice::from_ref(&restarted), since),
            Some(OomKill {
                container: "agent".into(),
                at: "2026-11-28T10:00:05Z".into()
            })
        );
        let text = oom_kill(&[restarted], since).unwrap().to_string();
        assert!(text.contains("OOMKilled"), "{text}");
        assert!(text.contains("agent.resources.limits.memory"), "{text}");
        // An OOM kill before the capture is not this capture's story.
        assert_eq!(
            oom_kill(&[restarted_at("2026-11-28T09:59:00Z", "OOMKilled")], since),
            None
        );
        // Another termination reason is not an OOM kill.
        assert_eq!(
            oom_kill(&[restarted_at("2026-11-28T10:00:05Z", "Error")], since),
            None
        );
        // Still down: the kill is the current state.
        let down = status(serde_json::json!({
            "name": "agent", "image": "a", "imageID": "", "ready": false, "restartCount": 0,
            "state": {"terminated": {"exitCode": 137, "reason": "OOMKilled",
                "finishedAt": "2026-11-28T10:00:05Z"}},
        }));
        assert!(oom_kill(&[down], since).is_some());
    }

    fn restarted_at(finished: &str, reason: &str) -> ContainerStatus {
        status(serde_json::json!({
            "name": "agent", "image": "a", "imageID": "", "ready": true, "restartCount": 1,
            "lastState": {"terminated": {"exitCode": 137, "reason": reason,
                "finishedAt": finished}},
        }))
    }
}
