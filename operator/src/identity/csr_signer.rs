//! Signs agents' serving certificates: a watch on `CertificateSigningRequest`s with signer
//! [`AGENT_SIGNER_NAME`], which approves and signs those that an agent pod created for the
//! node it runs on, and denies the rest with the reason.
//!
//! Why a CSR: the API server, not the agent, fills in who asked. An agent creates the CSR
//! with its pod-bound ServiceAccount token, so `spec.username` is the agent's ServiceAccount
//! and `spec.extra` carries the pod's name and UID and the node's name (Kubernetes ≥ 1.30
//! adds the node to pod-bound tokens). Nothing in the CSR's own content is trusted: the
//! certificate's name comes from that node claim, and the pod it names must exist, run on
//! that node, belong to the agent DaemonSet's ServiceAccount and carry the agent label. A
//! token stolen from one node therefore yields a certificate for that node only.

use std::collections::BTreeMap;
use std::time::Duration;

use flamefleet_proto::identity::AGENT_SIGNER_NAME;
use futures::StreamExt as _;
use k8s_openapi::api::certificates::v1::{
    CertificateSigningRequest, CertificateSigningRequestCondition,
};
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::api::{Api, Patch, PatchParams};
use kube::runtime::{WatchStreamExt as _, watcher};
use serde_json::json;

use super::ca::OperatorCa;
use crate::pods::AGENT_LABEL;
use crate::{Error, Result};

/// Extra keys the API server sets from a pod-bound ServiceAccount token.
const EXTRA_NODE_NAME: &str = "authentication.kubernetes.io/node-name";
const EXTRA_POD_NAME: &str = "authentication.kubernetes.io/pod-name";
const EXTRA_POD_UID: &str = "authentication.kubernetes.io/pod-uid";
/// Certificates are issued for this long unless the CSR asks for less.
pub const DEFAULT_AGENT_CERT_TTL: Duration = Duration::from_secs(24 * 3600);
/// Shortest lifetime granted (a shorter request is raised to this).
const MIN_AGENT_CERT_TTL: Duration = Duration::from_secs(10 * 60);
/// Field manager of the approval and status writes.
const MANAGER: &str = "flamefleet-operator";

/// Who may ask for an agent certificate.
#[derive(Debug, Clone)]
pub struct AgentIdentityPolicy {
    /// Namespace of the agent pods.
    pub namespace: String,
    /// Name of the agents' ServiceAccount.
    pub service_account: String,
}

/// What a CSR asks for, once its requester is verified: the node it may serve.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VerifiedRequester {
    /// The node named by the requester's token.
    pub node: String,
    /// The requesting pod.
    pub pod: String,
}

fn one_extra<'a>(extra: &'a BTreeMap<String, Vec<String>>, key: &str) -> Option<&'a str> {
    match extra.get(key).map(Vec::as_slice) {
        Some([one]) if !one.is_empty() => Some(one.as_str()),
        _ => None,
    }
}

/// Checks the API-server-filled requester fields of a CSR (pure). The error is the denial
/// reason shown to the cluster admin.
pub fn check_requester(
    csr: &CertificateSigningRequest,
    policy: &AgentIdentityPolicy,
) -> std::result::Result<(VerifiedRequester, String), String> {
    let spec = &csr.spec;
    let expected_user = format!(
        "system:serviceaccount:{}:{}",
        policy.namespace, policy.service_account
    );
    let user = spec.username.as_deref().unwrap_or_default();
    if user != expected_user {
        return Err(format!(
            "requested by {user:?}; only the agent ServiceAccount {expected_user} may request agent certificates"
        ));
    }
    let extra = spec.extra.clone().unwrap_or_default();
    let node = one_extra(&extra, EXTRA_NODE_NAME).ok_or_else(|| {
        format!(
            "the requester's token names no node ({EXTRA_NODE_NAME}); the agent must use its pod-bound ServiceAccount token on Kubernetes >= 1.30"
        )
    })?;
    let pod = one_extra(&extra, EXTRA_POD_NAME)
        .ok_or_else(|| format!("the requester's token names no pod ({EXTRA_POD_NAME})"))?;
    let pod_uid = one_extra(&extra, EXTRA_POD_UID)
        .ok_or_else(|| format!("the requester's token names no pod UID ({EXTRA_POD_UID})"))?;
    let usages = spec.usages.clone().unwrap_or_default();
    if !usages.iter().any(|u| u == "server auth")
        || usages.iter().any(|u| {
            !matches!(
                u.as_str(),
                "server auth" | "digital signature" | "key encipherment"
            )
        })
    {
        return Err(format!(
            "usages {usages:?}; an agent certificate is for \"server auth\" (with \"digital signature\") only"
        ));
    }
    Ok((
        VerifiedRequester {
            node: node.to_owned(),
            pod: pod.to_owned(),
        },
        pod_uid.to_owned(),
    ))
}

/// Checks that `pod` is the live agent pod the token claims (pure).
pub fn check_pod(
    pod: &Pod,
    requester: &VerifiedRequester,
    pod_uid: &str,
    policy: &AgentIdentityPolicy,
) -> std::result::Result<(), String> {
    let name = &requester.pod;
    if pod.metadata.uid.as_deref() != Some(pod_uid) {
        return Err(format!(
            "pod {name} is not the pod that requested (UID differs): it was replaced"
        ));
    }
    if pod.metadata.deletion_timestamp.is_some() {
        return Err(format!("pod {name} is being deleted"));
    }
    let spec = pod.spec.as_ref();
    if spec.and_then(|s| s.node_name.as_deref()) != Some(requester.node.as_str()) {
        return Err(format!(
            "pod {name} does not run on node {} as its token claims",
            requester.node
        ));
    }
    let sa = spec
        .and_then(|s| s.service_account_name.as_deref())
        .unwrap_or("default");
    if sa != policy.service_account {
        return Err(format!(
            "pod {name} runs as ServiceAccount {sa}, not {}",
            policy.service_account
        ));
    }
    let (key, value) = AGENT_LABEL.split_once('=').unwrap_or((AGENT_LABEL, ""));
    let labelled = pod
        .metadata
        .labels
        .as_ref()
        .and_then(|l| l.get(key))
        .is_some_and(|v| v == value);
    if !labelled {
        return Err(format!("pod {name} is not labelled {AGENT_LABEL}"));
    }
    Ok(())
}

fn condition_set(csr: &CertificateSigningRequest, kind: &str) -> bool {
    csr.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|cs| cs.iter().any(|c| c.type_ == kind && c.status == "True"))
}

fn decision(kind: &str, reason: &str, message: &str) -> serde_json::Value {
    let now = Time(jiff::Timestamp::now());
    let condition = CertificateSigningRequestCondition {
        type_: kind.to_owned(),
        status: "True".to_owned(),
        reason: Some(reason.to_owned()),
        message: Some(message.to_owned()),
        last_update_time: Some(now.clone()),
        last_transition_time: Some(now),
    };
    json!({"status": {"conditions": [condition]}})
}

/// Signs agent CSRs until the stream ends.
pub struct CsrSigner {
    client: kube::Client,
    ca: std::sync::Arc<OperatorCa>,
    policy: AgentIdentityPolicy,
}

impl std::fmt::Debug for CsrSigner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CsrSigner")
            .field("policy", &self.policy)
            .finish_non_exhaustive()
    }
}

impl CsrSigner {
    /// A signer issuing from `ca` to agents matching `policy`.
    pub fn new(
        client: kube::Client,
        ca: std::sync::Arc<OperatorCa>,
        policy: AgentIdentityPolicy,
    ) -> Self {
        Self { client, ca, policy }
    }

    /// Watches agent CSRs and handles each one; returns when `shutdown` resolves.
    pub async fn run(self, shutdown: impl std::future::Future<Output = ()>) {
        let api: Api<CertificateSigningRequest> = Api::all(self.client.clone());
        let config =
            watcher::Config::default().fields(&format!("spec.signerName={AGENT_SIGNER_NAME}"));
        let stream = watcher(api, config).default_backoff().applied_objects();
        tokio::pin!(stream);
        tokio::pin!(shutdown);
        loop {
            let next = tokio::select! {
                next = stream.next() => next,
                () = &mut shutdown => return,
            };
            match next {
                Some(Ok(csr)) => {
                    let name = csr.metadata.name.clone().unwrap_or_default();
                    if let Err(e) = self.handle(&csr).await {
                        tracing::warn!(csr = %name, "agent certificate request: {e}");
                    }
                }
                Some(Err(e)) => tracing::warn!("watching agent CSRs: {e}"),
                None => return,
            }
        }
    }

    /// Approves and signs `csr`, or denies it, unless it is already decided and issued.
    ///
    /// # Errors
    /// API errors (retried by the next watch event or resync).
    pub async fn handle(&self, csr: &CertificateSigningRequest) -> Result<()> {
        if csr.spec.signer_name != AGENT_SIGNER_NAME
            || condition_set(csr, "Denied")
            || condition_set(csr, "Failed")
            || csr
                .status
                .as_ref()
                .and_then(|s| s.certificate.as_ref())
                .is_some_and(|c| !c.0.is_empty())
        {
            return Ok(());
        }
        let name = csr.metadata.name.clone().unwrap_or_default();
        let api: Api<CertificateSigningRequest> = Api::all(self.client.clone());
        let verdict = self.verify(csr).await?;
        let requester = match verdict {
            Ok(r) => r,
            Err(reason) => {
                tracing::warn!(csr = %name, %reason, "denying agent certificate request");
                api.patch_approval(
                    &name,
                    &PatchParams::apply(MANAGER),
                    &Patch::Merge(decision(
                        "Denied",
                        "FlamefleetAgentIdentityRejected",
                        &reason,
                    )),
                )
                .await
                .map_err(Error::kube(format!("denying CSR {name}")))?;
                return Ok(());
            }
        };
        if !condition_set(csr, "Approved") {
            api.patch_approval(
                &name,
                &PatchParams::apply(MANAGER),
                &Patch::Merge(decision(
                    "Approved",
                    "FlamefleetAgentIdentityVerified",
                    &format!(
                        "agent pod {} runs on node {}",
                        requester.pod, requester.node
                    ),
                )),
            )
            .await
            .map_err(Error::kube(format!("approving CSR {name}")))?;
        }
        let ttl = csr
            .spec
            .expiration_seconds
            .map(|s| Duration::from_secs(u64::try_from(s).unwrap_or(0)))
            .unwrap_or(DEFAULT_AGENT_CERT_TTL)
            .clamp(MIN_AGENT_CERT_TTL, DEFAULT_AGENT_CERT_TTL);
        let request_pem = String::from_utf8(csr.spec.request.0.clone())
            .map_err(|_| Error::Tls(format!("CSR {name}: spec.request is not PEM text")))?;
        let (chain, not_after) = match self.ca.sign_agent(&request_pem, &requester.node, ttl) {
            Ok(signed) => signed,
            Err(e) => {
                api.patch_status(
                    &name,
                    &PatchParams::default(),
                    &Patch::Merge(decision(
                        "Failed",
                        "FlamefleetSigningFailed",
                        &e.to_string(),
                    )),
                )
                .await
                .map_err(Error::kube(format!("failing CSR {name}")))?;
                return Err(e);
            }
        };
        let encoded = k8s_openapi::ByteString(chain.into_bytes());
        match api
            .patch_status(
                &name,
                &PatchParams::default(),
                &Patch::Merge(json!({"status": {"certificate": encoded}})),
            )
            .await
        {
            Ok(_) => {}
            // Our watch was behind: an earlier event of this CSR already got it signed (the
            // API server never replaces an issued certificate).
            Err(kube::Error::Api(status))
                if status.code == 422 && status.message.contains("existing certificate") =>
            {
                return Ok(());
            }
            Err(e) => {
                return Err(Error::kube(format!(
                    "writing the certificate of CSR {name}"
                ))(e));
            }
        }
        let expires = jiff::Timestamp::try_from(not_after)
            .map(|t| t.to_string())
            .unwrap_or_default();
        tracing::info!(csr = %name, node = %requester.node, pod = %requester.pod, %expires, "issued agent certificate");
        Ok(())
    }

    async fn verify(
        &self,
        csr: &CertificateSigningRequest,
    ) -> Result<std::result::Result<VerifiedRequester, String>> {
        let (requester, pod_uid) = match check_requester(csr, &self.policy) {
            Ok(r) => r,
            Err(reason) => return Ok(Err(reason)),
        };
        let pods: Api<Pod> = Api::namespaced(self.client.clone(), &self.policy.namespace);
        let Some(pod) = pods
            .get_opt(&requester.pod)
            .await
            .map_err(Error::kube(format!(
                "reading agent pod {}/{}",
                self.policy.namespace, requester.pod
            )))?
        else {
            return Ok(Err(format!(
                "pod {}/{} named by the requester's token does not exist",
                self.policy.namespace, requester.pod
            )));
        };
        Ok(check_pod(&pod, &requester, &pod_uid, &self.policy).map(|()| requester))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy() -> AgentIdentityPolicy {
        AgentIdentityPolicy {
            namespace: "flamefleet".into(),
            service_account: "flamefleet-agent".into(),
        }
    }

    fn csr(user: &str, extra: serde_json::Value, usages: &[&str]) -> CertificateSigningRequest {
        serde_json::from_value(json!({
            "metadata": {"name": "x"},
            "spec": {
                "signerName": AGENT_SIGNER_NAME,
                "request": "",
                "username": user,
                "extra": extra,
                "usages": usages,
            }
        }))
        .expect("csr")
    }

    fn good_extra() -> serde_json::Value {
        json!({
            EXTRA_NODE_NAME: ["node-a"],
            EXTRA_POD_NAME: ["agent-abc"],
            EXTRA_POD_UID: ["uid-1"],
        })
    }

    fn pod(node: &str, uid: &str, sa: &str, labelled: bool) -> Pod {
        let labels = if labelled {
            json!({"app.kubernetes.io/name": "flamefleet-agent"})
        } else {
            json!({})
        };
        serde_json::from_value(json!({
            "metadata": {"name": "agent-abc", "uid": uid, "labels": labels},
            "spec": {"nodeName": node, "serviceAccountName": sa, "containers": []}
        }))
        .expect("pod")
    }

    const SA: &str = "system:serviceaccount:flamefleet:flamefleet-agent";

    #[test]
    fn the_agent_service_account_with_a_node_bound_token_passes() {
        let (r, uid) = check_requester(
            &csr(SA, good_extra(), &["digital signature", "server auth"]),
            &policy(),
        )
        .expect("valid");
        assert_eq!(r.node, "node-a");
        assert_eq!(uid, "uid-1");
        check_pod(
            &pod("node-a", "uid-1", "flamefleet-agent", true),
            &r,
            &uid,
            &policy(),
        )
        .expect("pod matches");
    }

    #[test]
    fn other_requesters_and_usages_are_denied_with_reasons() {
        let usages = ["digital signature", "server auth"];
        let cases = [
            (
                csr("alice", good_extra(), &usages),
                "only the agent ServiceAccount",
            ),
            (
                csr(
                    "system:serviceaccount:default:flamefleet-agent",
                    good_extra(),
                    &usages,
                ),
                "only the agent ServiceAccount",
            ),
            (csr(SA, json!({}), &usages), "names no node"),
            (
                csr(
                    SA,
                    json!({EXTRA_NODE_NAME: ["a", "b"], EXTRA_POD_NAME: ["p"], EXTRA_POD_UID: ["u"]}),
                    &usages,
                ),
                "names no node",
            ),
            (csr(SA, good_extra(), &["client auth"]), "server auth"),
            (
                csr(SA, good_extra(), &["server auth", "client auth"]),
                "server auth",
            ),
        ];
        for (c, want) in cases {
            let err = check_requester(&c, &policy()).expect_err("denied");
            assert!(err.contains(want), "{err} should mention {want}");
        }
    }

    #[test]
    fn a_pod_elsewhere_replaced_or_foreign_is_denied() {
        let (r, uid) =
            check_requester(&csr(SA, good_extra(), &["server auth"]), &policy()).expect("valid");
        let cases = [
            (
                pod("node-b", "uid-1", "flamefleet-agent", true),
                "does not run on node",
            ),
            (
                pod("node-a", "uid-2", "flamefleet-agent", true),
                "UID differs",
            ),
            (pod("node-a", "uid-1", "default", true), "ServiceAccount"),
            (
                pod("node-a", "uid-1", "flamefleet-agent", false),
                "not labelled",
            ),
        ];
        for (p, want) in cases {
            let err = check_pod(&p, &r, &uid, &policy()).expect_err("denied");
            assert!(err.contains(want), "{err} should mention {want}");
        }
    }
}
