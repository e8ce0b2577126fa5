//! A namespace of its own for each test, on the shared control plane.

use std::sync::atomic::{AtomicU32, Ordering};

use k8s_openapi::api::authentication::v1::{TokenRequest, TokenRequestSpec};
use k8s_openapi::api::core::v1::{Namespace, Pod, ServiceAccount};
use k8s_openapi::api::rbac::v1::{Role, RoleBinding};
use kube::api::{Api, PostParams};
use kube::{Client, Resource};
use serde_json::json;

use crate::pods::{PodFixture, create_running_pod};
use crate::{ControlPlane, Error, Result, crds, kube_err};

static COUNTER: AtomicU32 = AtomicU32::new(0);

/// A unique namespace with an admin client; the Flamefleet CRDs are installed.
///
/// The namespace is not deleted at the end: there is no namespace controller to finish a
/// deletion, and the per-process control plane is thrown away with the test process.
#[derive(Clone)]
pub struct TestNamespace {
    name: String,
    client: Client,
    control_plane: &'static ControlPlane,
}

impl std::fmt::Debug for TestNamespace {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TestNamespace")
            .field("name", &self.name)
            .finish_non_exhaustive()
    }
}

impl TestNamespace {
    /// Starts (or reuses) the shared control plane, installs the CRDs and creates a namespace
    /// named `<prefix>-<unique suffix>`.
    ///
    /// # Errors
    /// When the control plane is unavailable (tests must fail, not skip) or the API refuses.
    pub async fn create(prefix: &str) -> Result<Self> {
        let control_plane = ControlPlane::shared()?;
        let client = control_plane.client().await?;
        crds::install(&client).await?;
        let name = unique_name(prefix);
        let namespace: Namespace = serde_json::from_value(json!({
            "apiVersion": "v1", "kind": "Namespace",
            "metadata": {"name": name, "labels": {"flamefleet.dev/e2e": "true"}},
        }))
        .map_err(|source| Error::Json {
            what: "the namespace",
            source,
        })?;
        Api::<Namespace>::all(client.clone())
            .create(&PostParams::default(), &namespace)
            .await
            .map_err(kube_err(format!("creating namespace {name}")))?;
        Ok(Self {
            name,
            client,
            control_plane,
        })
    }

    /// The namespace name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The admin client.
    pub fn client(&self) -> Client {
        self.client.clone()
    }

    /// The control plane this namespace lives on.
    pub fn control_plane(&self) -> &'static ControlPlane {
        self.control_plane
    }

    /// An Api for a namespaced kind in this namespace.
    pub fn api<K>(&self) -> Api<K>
    where
        K: Resource<Scope = k8s_openapi::NamespaceResourceScope>,
        <K as Resource>::DynamicType: Default,
    {
        Api::namespaced(self.client.clone(), &self.name)
    }

    /// Creates a Running pod in this namespace (see [`create_running_pod`]).
    pub async fn running_pod(&self, fixture: &PodFixture) -> Result<Pod> {
        create_running_pod(&self.api(), fixture).await
    }

    /// Creates service account `name` and returns a 10-minute token for it.
    ///
    /// # Errors
    /// When the account or the token cannot be created.
    pub async fn service_account_token(&self, name: &str) -> Result<String> {
        let sas: Api<ServiceAccount> = self.api();
        let sa: ServiceAccount = serde_json::from_value(json!({"metadata": {"name": name}}))
            .map_err(|source| Error::Json {
                what: "a service account",
                source,
            })?;
        sas.create(&PostParams::default(), &sa)
            .await
            .map_err(kube_err(format!("creating service account {name}")))?;
        let request = TokenRequest {
            spec: TokenRequestSpec {
                expiration_seconds: Some(600),
                ..Default::default()
            },
            ..Default::default()
        };
        let answer = sas
            .create_token_request(name, &PostParams::default(), &request)
            .await
            .map_err(kube_err(format!("requesting a token for {name}")))?;
        Ok(answer.status.map(|s| s.token).unwrap_or_default())
    }

    /// Lets service account `sa` `get` the ProfileRequest `request` (and only that one) and
    /// download its artifacts (create and read ProfileDownloads).
    ///
    /// # Errors
    /// When the Role or RoleBinding cannot be created.
    pub async fn grant_get_profile_request(&self, sa: &str, request: &str) -> Result<()> {
        self.bind_rules(
            "ServiceAccount",
            sa,
            &format!("get-{request}"),
            download_rules(request),
        )
        .await
        .map(|_| ())
    }

    /// A client for the new user `user`, holding in this namespace only what the chart's
    /// aggregated `edit` role grants on Flamefleet's kinds ([`edit_rules`]): a tenant.
    ///
    /// # Errors
    /// When the binding, the user's certificate or its client cannot be made.
    pub async fn tenant_client(&self, user: &str) -> Result<Client> {
        self.bind_rules("User", user, "flamefleet-edit", edit_rules())
            .await?;
        let kubeconfig = self.control_plane.kubeconfig_for_user(user, &[])?;
        crate::control_plane::client_from_kubeconfig(&kubeconfig).await
    }

    /// Binds a new Role `role` with `rules` to `kind` (`User` or `ServiceAccount`) `subject`;
    /// returns the RoleBinding's name (delete it to revoke).
    ///
    /// # Errors
    /// When the Role or RoleBinding cannot be created.
    pub async fn bind_rules(
        &self,
        kind: &str,
        subject: &str,
        role: &str,
        rules: serde_json::Value,
    ) -> Result<String> {
        let json_err = |source| Error::Json {
            what: "an RBAC object",
            source,
        };
        let role_obj: Role = serde_json::from_value(json!({
            "metadata": {"name": role},
            "rules": rules,
        }))
        .map_err(json_err)?;
        self.api::<Role>()
            .create(&PostParams::default(), &role_obj)
            .await
            .map_err(kube_err(format!("creating role {role}")))?;
        let binding_name: String = format!("{role}-{subject}")
            .chars()
            .map(|c| {
                if c.is_ascii_alphanumeric() || c == '-' || c == '.' {
                    c
                } else {
                    '-'
                }
            })
            .collect();
        let mut subject_json = json!({"kind": kind, "name": subject});
        if kind == "ServiceAccount" {
            subject_json["namespace"] = json!(self.name);
        } else {
            subject_json["apiGroup"] = json!("rbac.authorization.k8s.io");
        }
        let binding: RoleBinding = serde_json::from_value(json!({
            "metadata": {"name": binding_name},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": role},
            "subjects": [subject_json],
        }))
        .map_err(json_err)?;
        self.api::<RoleBinding>()
            .create(&PostParams::default(), &binding)
            .await
            .map_err(kube_err(format!("binding role {role} to {subject}")))?;
        Ok(binding_name)
    }

    /// A name unique in this process and namespace-prefixed, for cluster-scoped objects.
    pub fn unique(&self, prefix: &str) -> String {
        unique_name(prefix)
    }
}

/// The rules the chart's `<release>-edit` ClusterRole aggregates into `edit`
/// (charts/flamefleet/templates/user-roles.yaml).
pub fn edit_rules() -> serde_json::Value {
    json!([
        {"apiGroups": ["flamefleet.dev"], "resources": ["profilerequests", "samplingpolicies"],
         "verbs": ["get", "list", "watch", "create", "delete", "deletecollection", "patch", "update"]},
        {"apiGroups": ["flamefleet.dev"], "resources": ["profiledownloads"],
         "verbs": ["get", "list", "watch", "create", "delete"]},
        {"apiGroups": ["flamefleet.dev"], "resources": ["profileresultslices"],
         "verbs": ["get", "list", "watch"]},
    ])
}

/// RBAC rules to `get` ProfileRequest `request` and download its artifacts (the CLI lists
/// the request's result slices by label, which RBAC cannot narrow to one request).
pub fn download_rules(request: &str) -> serde_json::Value {
    json!([
        {"apiGroups": ["flamefleet.dev"], "resources": ["profilerequests"],
         "resourceNames": [request], "verbs": ["get"]},
        {"apiGroups": ["flamefleet.dev"], "resources": ["profileresultslices"],
         "verbs": ["get", "list"]},
        {"apiGroups": ["flamefleet.dev"], "resources": ["profiledownloads"],
         "verbs": ["create", "get", "list", "watch", "delete"]},
    ])
}

/// `<prefix>-<pid>-<counter>`, cut to a valid DNS label.
fn unique_name(prefix: &str) -> String {
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    let suffix = format!("-{}-{n}", std::process::id());
    let keep = 63usize.saturating_sub(suffix.len());
    let prefix: String = prefix
        .to_ascii_lowercase()
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '-' })
        .take(keep)
        .collect();
    format!("{}{suffix}", prefix.trim_matches('-'))
}

#[cfg(test)]
mod tests {
    use super::unique_name;

    #[test]
    fn unique_names_are_valid_distinct_dns_labels() {
        let a = unique_name("My_Test");
        let b = unique_name("My_Test");
        assert_ne!(a, b);
        assert!(a.starts_with("my-test-"), "{a}");
        let long = unique_name(&"x".repeat(100));
        assert!(long.len() <= 63, "{long}");
    }
}
