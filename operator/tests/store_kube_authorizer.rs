//! `KubeAuthorizer` against a real kube-apiserver (RBAC on): service-account tokens with and
//! without RBAC `get` on profilerequests, checked directly and through the built-in store's
//! HTTP server.

use std::{sync::Arc, time::Duration};

use flamefleet_e2e::TestNamespace;
use flamefleet_operator::store::{
    ArtifactStore, RequestRef, UploadLimits,
    authorize::{CachedAuthorizer, Decision, DownloadAuthorizer, KubeAuthorizer},
    builtin::{BuiltinConfig, BuiltinStore, http::router},
};
use k8s_openapi::api::{
    authentication::v1::{TokenRequest, TokenRequestSpec},
    core::v1::ServiceAccount,
    rbac::v1::{Role, RoleBinding},
};
use kube::api::{Api, PostParams};
use reqwest::StatusCode;
use serde_json::json;

const UID: &str = "5c0ffee0-1234-4abc-8def-000000000001";

async fn service_account_token(ns: &TestNamespace, name: &str) -> String {
    let sas: Api<ServiceAccount> = ns.api();
    let sa: ServiceAccount = serde_json::from_value(json!({"metadata": {"name": name}})).unwrap();
    sas.create(&PostParams::default(), &sa).await.unwrap();
    let request = TokenRequest {
        spec: TokenRequestSpec {
            audiences: vec![],
            expiration_seconds: Some(600),
            ..Default::default()
        },
        ..Default::default()
    };
    sas.create_token_request(name, &PostParams::default(), &request)
        .await
        .unwrap()
        .status
        .unwrap()
        .token
}

/// Lets service account `sa` get the ProfileRequest `request` (and only that one).
async fn grant_get(ns: &TestNamespace, sa: &str, request: &str) {
    let role: Role = serde_json::from_value(json!({
        "metadata": {"name": "profilerequest-reader"},
        "rules": [{
            "apiGroups": ["flamefleet.dev"],
            "resources": ["profilerequests"],
            "resourceNames": [request],
            "verbs": ["get"],
        }],
    }))
    .unwrap();
    ns.api::<Role>()
        .create(&PostParams::default(), &role)
        .await
        .unwrap();
    let binding: RoleBinding = serde_json::from_value(json!({
        "metadata": {"name": "profilerequest-reader"},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "profilerequest-reader"},
        "subjects": [{"kind": "ServiceAccount", "name": sa, "namespace": ns.name()}],
    }))
    .unwrap();
    ns.api::<RoleBinding>()
        .create(&PostParams::default(), &binding)
        .await
        .unwrap();
}

#[tokio::test]
async fn kube_authorizer_follows_rbac_on_profilerequests() {
    flamefleet_operator::store::install_default_crypto_provider();
    let ns = TestNamespace::create("store-authz").await.unwrap();
    let reader = service_account_token(&ns, "reader").await;
    let stranger = service_account_token(&ns, "stranger").await;
    grant_get(&ns, "reader", "readable").await;

    let readable = RequestRef::new(ns.name(), "readable", UID).unwrap();
    let other = RequestRef::new(ns.name(), "other", UID).unwrap();
    let authorizer = KubeAuthorizer::new(ns.client());

    // RBAC reaches the authorizer through an informer: allow a moment for the new binding.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(15);
    loop {
        match authorizer.authorize(&reader, &readable).await.unwrap() {
            Decision::Allowed => break,
            d if tokio::time::Instant::now() > deadline => {
                panic!("reader with RBAC get was not allowed within 15 s: {d:?}")
            }
            _ => tokio::time::sleep(Duration::from_millis(200)).await,
        }
    }
    assert!(matches!(
        authorizer.authorize(&reader, &other).await.unwrap(),
        Decision::Denied { .. }
    ));
    let denied = authorizer.authorize(&stranger, &readable).await.unwrap();
    let Decision::Denied { reason } = denied else {
        panic!("stranger without RBAC was not denied: {denied:?}");
    };
    assert!(reason.contains("stranger"), "{reason}");
    assert!(matches!(
        authorizer
            .authorize("not-a-token", &readable)
            .await
            .unwrap(),
        Decision::Unauthenticated { .. }
    ));

    // The same decisions over HTTP, on a stored artifact, through the decision cache.
    let dir = tempfile::tempdir().unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base: url::Url = format!("http://{}/", listener.local_addr().unwrap())
        .parse()
        .unwrap();
    let store = Arc::new(
        BuiltinStore::open(BuiltinConfig {
            root: dir.path().to_path_buf(),
            public_url: base.clone(),
            secret: vec![42u8; 32],
            max_upload_bytes: 1 << 20,
        })
        .await
        .unwrap(),
    );
    let cached = CachedAuthorizer::new(authorizer, Duration::from_secs(10), 100);
    let app = router(store.clone(), Arc::new(cached));
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    let key = readable.artifact("cpu.pb.gz").unwrap();
    let limits = UploadLimits {
        max_bytes: 1024,
        sha256: None,
        ttl: Duration::from_secs(60),
    };
    let upload = store.upload_target(&key, &limits).await.unwrap();
    let http = reqwest::Client::new();
    let put = http.put(upload.url).body("pprof").send().await.unwrap();
    assert_eq!(put.status(), StatusCode::CREATED);

    let url = base.join(&format!("v1/artifacts/{key}")).unwrap();
    let get = |token: &str| http.get(url.clone()).bearer_auth(token).send();
    let ok = get(&reader).await.unwrap();
    assert_eq!(ok.status(), StatusCode::OK);
    assert_eq!(ok.text().await.unwrap(), "pprof");
    assert_eq!(
        get(&stranger).await.unwrap().status(),
        StatusCode::FORBIDDEN
    );
    assert_eq!(
        get("not-a-token").await.unwrap().status(),
        StatusCode::UNAUTHORIZED
    );
}
