//! `get` with a kubeconfig user holding a bearer token (a service account's), on unsigned
//! artifact URLs: the built-in store lets the token through because RBAC allows `get` on the
//! ProfileRequest, and refuses the same download to a token without it (exit 6, HTTP 403).

mod support;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use flamefleet_api::{NodePhase, RequestPhase};
use flamefleet_operator::store::authorize::KubeAuthorizer;
use kube::config::Kubeconfig;
use support::{Store, cli, cpu_profile, create_request, files, node, write_status};

/// The admin kubeconfig with its user replaced by `token` only.
fn token_kubeconfig(admin: &Path, token: &str, out: &Path) -> PathBuf {
    let mut kc = Kubeconfig::read_from(admin).unwrap();
    for user in &mut kc.auth_infos {
        user.auth_info = Some(kube::config::AuthInfo {
            token: Some(token.to_string().into()),
            ..Default::default()
        });
    }
    std::fs::write(out, serde_yaml::to_string(&kc).unwrap()).unwrap();
    out.to_path_buf()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bearer_token_downloads_follow_rbac() {
    let ns = support::namespace("cli-token").await;
    let store = Store::start_with(Arc::new(KubeAuthorizer::new(ns.client()))).await;
    let req = create_request(&ns, "tokened").await;
    let mut artifact = store
        .upload(&req, "cpu-node-a.pb.gz", &cpu_profile("tok_fn"))
        .await;
    // Unsigned: only the bearer token can authorize this download.
    let mut url = url::Url::parse(artifact.url.as_deref().unwrap()).unwrap();
    url.set_query(None);
    artifact.url = Some(url.to_string());
    write_status(
        &ns,
        "tokened",
        RequestPhase::Succeeded,
        vec![node("node-a", NodePhase::Succeeded, None, vec![artifact])],
    )
    .await;
    ns.grant_get_profile_request("reader", "tokened")
        .await
        .unwrap();
    let kcdir = tempfile::tempdir().unwrap();
    let admin = support::admin_kubeconfig(&ns);
    let reader = token_kubeconfig(
        &admin,
        &ns.service_account_token("reader").await.unwrap(),
        &kcdir.path().join("r"),
    );

    let out = tempfile::tempdir().unwrap();
    let dir = out.path().to_str().unwrap();
    // RBAC changes reach the authorizer's checks within moments: retry for up to 15 s.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(15);
    let r = loop {
        let r = cli(&reader, ns.name(), &["get", "tokened", "-o", dir]).await;
        if r.code == 0 || tokio::time::Instant::now() > deadline {
            break r;
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
    };
    assert_eq!(r.code, 0, "{r:?}");
    assert_eq!(files(out.path()), ["cpu-node-a.pb.gz"]);

    // The admin user authenticates with a client certificate, has no token, so the store
    // refuses the unsigned URL: exit 6 with the store's answer, nothing written.
    let empty = tempfile::tempdir().unwrap();
    let r = cli(
        &admin,
        ns.name(),
        &["get", "tokened", "-o", empty.path().to_str().unwrap()],
    )
    .await;
    assert_eq!(r.code, 6, "{r:?}");
    assert!(r.stderr.contains("HTTP 401"), "{}", r.stderr);
    assert_eq!(files(empty.path()), Vec::<String>::new());
}
