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
use reqwest::StatusCode;

const UID: &str = "5c0ffee0-1234-4abc-8def-000000000001";

#[tokio::test]
async fn kube_authorizer_follows_rbac_on_profilerequests() {
    flamefleet_operator::store::install_default_crypto_provider();
    let ns = TestNamespace::create("store-authz").await.unwrap();
    let reader = ns.service_account_token("reader").await.unwrap();
    let stranger = ns.service_account_token("stranger").await.unwrap();
    ns.grant_get_profile_request("reader", "readable")
        .await
        .unwrap();

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
