//! Installing the Flamefleet CRDs and waiting until they are served.

use std::time::Duration;

use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::Client;
use kube::api::{Api, ApiResource, DynamicObject, Patch, PatchParams};
use kube::runtime::wait::{await_condition, conditions};

use crate::{Error, Result, kube_err};

/// Field manager the harness installs CRDs with.
pub const FIELD_MANAGER: &str = "flamefleet-e2e";
const ESTABLISH_TIMEOUT: Duration = Duration::from_secs(30);

/// Applies every CRD of `flamefleet_api` and its admission policies (server-side apply,
/// idempotent) and waits until each CRD is Established.
pub async fn install(client: &Client) -> Result<()> {
    install_policies(client).await?;
    let api: Api<CustomResourceDefinition> = Api::all(client.clone());
    let params = PatchParams::apply(FIELD_MANAGER).force();
    let crds = flamefleet_api::crd_yaml::crds();
    for crd in &crds {
        let name = crd.metadata.name.clone().unwrap_or_default();
        api.patch(&name, &params, &Patch::Apply(crd))
            .await
            .map_err(kube_err(format!("applying CRD {name}")))?;
    }
    for crd in &crds {
        let name = crd.metadata.name.clone().unwrap_or_default();
        let established = await_condition(api.clone(), &name, conditions::is_crd_established());
        match tokio::time::timeout(ESTABLISH_TIMEOUT, established).await {
            Ok(Ok(_)) => {}
            Ok(Err(e)) => {
                return Err(Error::Timeout {
                    what: format!("CRD {name} to become Established ({e})"),
                    seconds: ESTABLISH_TIMEOUT.as_secs(),
                });
            }
            Err(_) => {
                return Err(Error::Timeout {
                    what: format!("CRD {name} to become Established"),
                    seconds: ESTABLISH_TIMEOUT.as_secs(),
                });
            }
        }
    }
    Ok(())
}

/// Applies the admission policies of `flamefleet_api` (`crds/policies/`).
async fn install_policies(client: &Client) -> Result<()> {
    let params = PatchParams::apply(FIELD_MANAGER).force();
    let objects = flamefleet_api::admission::policy_objects()?;
    for object in objects {
        let kind = object["kind"].as_str().unwrap_or_default().to_owned();
        let name = object["metadata"]["name"]
            .as_str()
            .unwrap_or_default()
            .to_owned();
        let resource = ApiResource {
            group: "admissionregistration.k8s.io".into(),
            version: "v1".into(),
            api_version: "admissionregistration.k8s.io/v1".into(),
            plural: match kind.as_str() {
                "ValidatingAdmissionPolicy" => "validatingadmissionpolicies".into(),
                "ValidatingAdmissionPolicyBinding" => "validatingadmissionpolicybindings".into(),
                other => format!("{}s", other.to_ascii_lowercase()),
            },
            kind: kind.clone(),
        };
        let api: Api<DynamicObject> = Api::all_with(client.clone(), &resource);
        api.patch(&name, &params, &Patch::Apply(&object))
            .await
            .map_err(kube_err(format!("applying {kind} {name}")))?;
    }
    Ok(())
}
