//! A tenant against the shared artifact store, with the real operator, the real store
//! process and the real API server (hollow agents upload the artifacts):
//! - orphaning: the tenant removes the `flamefleet.dev/artifacts` finalizer of a finished
//!   request and deletes it, so the finalizer never deletes its artifacts; the operator's
//!   garbage collector does, and keeps those of live requests;
//! - filling the store: past the namespace's quota (annotation set by the cluster admin)
//!   a node's capture fails with a message saying so and its artifacts are not kept; a
//!   tenant who may edit Namespace objects still cannot raise its own quota.

#[path = "pipeline_support/mod.rs"]
mod pipeline_support;

use std::path::Path;
use std::time::{Duration, Instant};

use flamefleet_api::{NodePhase, ProfileRequest, RequestPhase};
use flamefleet_e2e::hollow::cluster::{ClusterOptions, HollowCluster};
use k8s_openapi::api::core::v1::Namespace;
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};
use serde_json::json;

const TIMEOUT: Duration = Duration::from_secs(90);

async fn run(cluster: &mut HollowCluster, name: &str) -> ProfileRequest {
    let api: Api<ProfileRequest> = cluster.target_ns.api();
    let request = cluster.request(name, Duration::from_secs(1)).unwrap();
    api.create(&PostParams::default(), &request).await.unwrap();
    cluster
        .wait_terminal(name, TIMEOUT, &format!("{name} did not finish"))
        .await
}

/// The request's directory in the store.
fn stored(cluster: &HollowCluster, request: &ProfileRequest) -> std::path::PathBuf {
    cluster
        .store_dir()
        .join(request.metadata.namespace.as_deref().unwrap())
        .join(format!(
            "{}-{}",
            request.metadata.name.as_deref().unwrap(),
            request.metadata.uid.as_deref().unwrap()
        ))
}

/// Artifact files (not metadata) in a request's directory.
fn artifact_files(dir: &Path) -> Vec<String> {
    let mut out: Vec<String> = std::fs::read_dir(dir)
        .map(|d| {
            d.filter_map(Result::ok)
                .filter(|e| e.path().is_file())
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default();
    out.sort();
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn orphaned_artifacts_are_collected_and_live_ones_kept() {
    let mut cluster = HollowCluster::create(
        &pipeline_support::bins().operator,
        ClusterOptions {
            nodes: 2,
            progress_every: 0,
            operator_args: vec![
                "--store-gc-interval".into(),
                "1s".into(),
                "--store-gc-grace".into(),
                "0s".into(),
            ],
            // Sweeps that delete nothing are logged at debug.
            operator_log: "info,flamefleet_operator::store=debug,kube_lease_manager=warn".into(),
            ..Default::default()
        },
    )
    .await
    .unwrap();
    cluster.start_operator().unwrap();
    let kept = run(&mut cluster, "kept").await;
    let orphaned = run(&mut cluster, "orphaned").await;
    for r in [&kept, &orphaned] {
        assert_eq!(
            r.status.as_ref().and_then(|s| s.phase),
            Some(RequestPhase::Succeeded)
        );
        assert_eq!(artifact_files(&stored(&cluster, r)).len(), 2);
    }

    // The tenant, with what the `edit` role allows on its requests.
    let user = cluster.target_ns.unique("tenant");
    cluster
        .target_ns
        .bind_rules(
            "User",
            &user,
            "edit-requests",
            json!([{"apiGroups": ["flamefleet.dev"], "resources": ["profilerequests"],
                    "verbs": ["get", "list", "patch", "update", "delete"]}]),
        )
        .await
        .unwrap();
    let kubeconfig = cluster
        .target_ns
        .control_plane()
        .kubeconfig_for_user(&user, &[])
        .unwrap();
    let tenant = flamefleet_e2e::control_plane::client_from_kubeconfig(&kubeconfig)
        .await
        .unwrap();
    let api: Api<ProfileRequest> = Api::namespaced(tenant, cluster.target_ns.name());
    api.patch(
        "orphaned",
        &PatchParams::default(),
        &Patch::Merge(json!({"metadata": {"finalizers": null}})),
    )
    .await
    .expect("the tenant removes the finalizer");
    api.delete("orphaned", &DeleteParams::default())
        .await
        .expect("the tenant deletes the request");

    let orphan_dir = stored(&cluster, &orphaned);
    let deadline = Instant::now() + Duration::from_secs(30);
    while !artifact_files(&orphan_dir).is_empty() {
        assert!(
            Instant::now() < deadline,
            "the orphaned artifacts are still in the store after 30 s of 1 s sweeps: {:?}\n{}",
            artifact_files(&orphan_dir),
            cluster
                .operator
                .as_ref()
                .map(|o| o.log_tail(40))
                .unwrap_or_default()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // A few more sweeps run; the live request keeps everything.
    let log = cluster.operator.as_ref().unwrap().log.clone();
    let sweeps = |text: &str| text.matches("store garbage collection").count();
    let before = sweeps(&std::fs::read_to_string(&log).unwrap_or_default());
    let deadline = Instant::now() + Duration::from_secs(30);
    while sweeps(&std::fs::read_to_string(&log).unwrap_or_default()) < before + 2 {
        assert!(Instant::now() < deadline, "no more sweeps were logged");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert_eq!(artifact_files(&stored(&cluster, &kept)).len(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn past_its_quota_a_namespace_keeps_nothing_and_says_why() {
    let mut cluster = HollowCluster::create(
        &pipeline_support::bins().operator,
        ClusterOptions {
            nodes: 2,
            progress_every: 0,
            operator_log: "info,flamefleet_operator=debug,kube_lease_manager=warn".into(),
            ..Default::default()
        },
    )
    .await
    .unwrap();
    cluster.start_operator().unwrap();
    let namespaces: Api<Namespace> = Api::all(cluster.target_ns.client());
    let ns = cluster.target_ns.name().to_owned();
    let set_quota = |value: &str| {
        Patch::Merge(json!({"metadata": {"annotations": {"flamefleet.dev/artifact-quota": value}}}))
    };

    // One byte: every node's artifact is refused once verified.
    namespaces
        .patch(&ns, &PatchParams::default(), &set_quota("1"))
        .await
        .unwrap();
    let over = run(&mut cluster, "over").await;
    assert_eq!(
        over.status.as_ref().and_then(|s| s.phase),
        Some(RequestPhase::Failed)
    );
    let nodes = pipeline_support::node_results(&cluster.target_ns.client(), &over).await;
    for entry in nodes.values() {
        assert_eq!(entry.phase, Some(NodePhase::Failed), "{entry:?}");
        assert_eq!(entry.reason.as_deref(), Some("QuotaExceeded"), "{entry:?}");
        let message = entry.message.as_deref().unwrap_or_default();
        assert!(
            message.contains(&format!(
                "namespace {ns} has used 0 bytes of its artifact storage quota of 1 bytes and this artifact needs"
            )),
            "{message}"
        );
        assert!(
            message.contains("flamefleet.dev/artifact-quota"),
            "{message}"
        );
    }
    assert_eq!(
        artifact_files(&stored(&cluster, &over)),
        Vec::<String>::new()
    );

    // Room for one request: it succeeds; the next one is refused before it captures.
    namespaces
        .patch(&ns, &PatchParams::default(), &set_quota("1Mi"))
        .await
        .unwrap();
    let fits = run(&mut cluster, "fits").await;
    assert_eq!(
        fits.status.as_ref().and_then(|s| s.phase),
        Some(RequestPhase::Succeeded),
        "{:#?}",
        fits.status
    );
    let used: u64 = artifact_files(&stored(&cluster, &fits))
        .iter()
        .map(|f| {
            std::fs::metadata(stored(&cluster, &fits).join(f))
                .unwrap()
                .len()
        })
        .sum();
    namespaces
        .patch(&ns, &PatchParams::default(), &set_quota(&used.to_string()))
        .await
        .unwrap();
    let full = run(&mut cluster, "full").await;
    let nodes = pipeline_support::node_results(&cluster.target_ns.client(), &full).await;
    for entry in nodes.values() {
        assert_eq!(entry.reason.as_deref(), Some("QuotaExceeded"), "{entry:?}");
        let message = entry.message.as_deref().unwrap_or_default();
        assert!(
            message.contains(&format!("of its artifact storage quota of {used} bytes")),
            "{message}"
        );
    }
    assert_eq!(
        artifact_files(&stored(&cluster, &full)),
        Vec::<String>::new()
    );

    // A tenant allowed to edit Namespace objects (as some multi-tenancy tools allow) still
    // cannot raise its quota: the admission policy wants the cluster admin.
    let user = cluster.target_ns.unique("ns-editor");
    let kubeconfig = cluster
        .target_ns
        .control_plane()
        .kubeconfig_for_user(&user, &[])
        .unwrap();
    let admin = cluster.target_ns.client();
    let roles: Api<k8s_openapi::api::rbac::v1::ClusterRole> = Api::all(admin.clone());
    let bindings: Api<k8s_openapi::api::rbac::v1::ClusterRoleBinding> = Api::all(admin.clone());
    roles
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({
                "metadata": {"name": user},
                "rules": [{"apiGroups": [""], "resources": ["namespaces"],
                           "resourceNames": [ns], "verbs": ["get", "patch", "update"]}],
            }))
            .unwrap(),
        )
        .await
        .unwrap();
    bindings
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({
                "metadata": {"name": user},
                "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": user},
                "subjects": [{"kind": "User", "name": user, "apiGroup": "rbac.authorization.k8s.io"}],
            }))
            .unwrap(),
        )
        .await
        .unwrap();
    let tenant = flamefleet_e2e::control_plane::client_from_kubeconfig(&kubeconfig)
        .await
        .unwrap();
    let own: Api<Namespace> = Api::all(tenant);
    // RBAC reaches the authorizer a moment after the binding is written.
    let deadline = Instant::now() + Duration::from_secs(15);
    let refused = loop {
        // Another annotation: allowed (RBAC works for this user).
        let other = own
            .patch(
                &ns,
                &PatchParams::default(),
                &Patch::Merge(json!({"metadata": {"annotations": {"team": "checkout"}}})),
            )
            .await;
        if other.is_ok() {
            break own
                .patch(&ns, &PatchParams::default(), &set_quota("100Gi"))
                .await
                .expect_err("a tenant raised its own quota");
        }
        assert!(Instant::now() < deadline, "{other:?}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let text = refused.to_string();
    assert!(
        text.contains("only the cluster admin may set flamefleet.dev/artifact-quota"),
        "{text}"
    );
    let _ = roles.delete(&user, &DeleteParams::default()).await;
    let _ = bindings.delete(&user, &DeleteParams::default()).await;
}
