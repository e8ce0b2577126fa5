//! Helpers shared by the artifact-store tests.

#![allow(dead_code)]

use std::{
    path::Path,
    sync::atomic::{AtomicU32, Ordering},
};

/// A valid UID unique in this process (and across processes, through the PID), so tests
/// never share a prefix.
pub fn unique_uid() -> String {
    static NEXT: AtomicU32 = AtomicU32::new(0);
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    format!("{:08x}-0000-4000-8000-{:012x}", std::process::id(), n)
}

/// `len` bytes of a non-repeating-looking pattern.
pub fn payload(len: usize) -> Vec<u8> {
    (0..len).map(|i| (i * 31 % 251) as u8).collect()
}

/// Every regular file below `root`, relative to it, sorted.
pub fn files_under(root: &Path) -> Vec<String> {
    fn walk(dir: &Path, root: &Path, out: &mut Vec<String>) {
        for entry in std::fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                walk(&path, root, out);
            } else {
                out.push(path.strip_prefix(root).unwrap().display().to_string());
            }
        }
    }
    let mut out = Vec::new();
    walk(root, root, &mut out);
    out.sort();
    out
}

use std::sync::Arc;
use std::time::Duration;

use flamefleet_api::ProfileRequest;
use flamefleet_e2e::TestNamespace;
use flamefleet_operator::store::quota::{QUOTA_ANNOTATION, QuotaLedger};
use flamefleet_operator::store::{ArtifactStore, RequestRef, UploadLimits, gc};
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};

/// Uploads `len` bytes as `artifact` of `request` through the store's signed URL (with the
/// headers it asks for), as an agent does.
pub async fn upload(store: &dyn ArtifactStore, request: &RequestRef, artifact: &str, len: usize) {
    let key = request.artifact(artifact).unwrap();
    let target = store
        .upload_target(
            &key,
            &UploadLimits {
                max_bytes: 1 << 20,
                sha256: None,
                ttl: Duration::from_secs(300),
            },
        )
        .await
        .unwrap();
    let mut put = reqwest::Client::new().put(target.url).body(payload(len));
    for (name, value) in target.headers {
        put = put.header(name, value);
    }
    let response = put.send().await.unwrap();
    assert!(response.status().is_success(), "{response:?}");
}

fn profile_request(name: &str, finalizer: bool) -> ProfileRequest {
    let mut request: ProfileRequest = serde_json::from_value(serde_json::json!({
        "apiVersion": "flamefleet.dev/v1alpha1", "kind": "ProfileRequest",
        "metadata": {"name": name},
        "spec": {"type": "cpu", "podNames": ["p"], "duration": "1s"},
    }))
    .unwrap();
    if finalizer {
        request.metadata.finalizers = Some(vec!["flamefleet.dev/artifacts".into()]);
    }
    request
}

/// The garbage collector against `store` and the real API server: a tenant removes the
/// artifacts finalizer of a request and deletes it (no operator runs here to clean up);
/// a sweep within the grace period keeps everything, one past it deletes the orphan's
/// artifacts and nothing of the live request.
pub async fn orphans_are_swept_and_live_requests_kept(store: &dyn ArtifactStore) {
    let ns = TestNamespace::create("store-gc").await.unwrap();
    let client = ns.client();
    let api: Api<ProfileRequest> = ns.api();
    let pp = PostParams::default();
    let live = api
        .create(&pp, &profile_request("live", true))
        .await
        .unwrap();
    let orphan = api
        .create(&pp, &profile_request("orphan", true))
        .await
        .unwrap();
    let reference = |r: &ProfileRequest| {
        RequestRef::new(
            ns.name(),
            r.metadata.name.clone().unwrap(),
            r.metadata.uid.clone().unwrap(),
        )
        .unwrap()
    };
    let (live_ref, orphan_ref) = (reference(&live), reference(&orphan));
    for r in [&live_ref, &orphan_ref] {
        upload(store, r, "cpu-n1.pb.gz", 1000).await;
        upload(store, r, "cpu-n2.pb.gz", 2000).await;
    }
    // The tenant's move: drop the finalizer, then delete.
    api.patch(
        "orphan",
        &PatchParams::default(),
        &Patch::Merge(serde_json::json!({"metadata": {"finalizers": null}})),
    )
    .await
    .unwrap();
    api.delete("orphan", &DeleteParams::default())
        .await
        .unwrap();
    assert!(api.get_opt("orphan").await.unwrap().is_none());
    // The finalizer of "live" is cleared at the end so the namespace can go.
    let stored = store.stored_requests(Some(ns.name())).await.unwrap();
    assert_eq!(stored.len(), 2, "{stored:?}");
    assert!(stored.iter().all(|r| r.bytes == 3000 && r.artifacts == 2));

    let report = gc::sweep(&client, store, None, Duration::from_secs(3600))
        .await
        .unwrap();
    assert!(report.deleted.is_empty(), "{report:?}");
    assert_eq!(store.list(&orphan_ref).await.unwrap().len(), 2);

    let report = gc::sweep(&client, store, None, Duration::ZERO)
        .await
        .unwrap();
    assert!(report.deleted.contains(&orphan_ref.prefix()), "{report:?}");
    assert!(!report.deleted.contains(&live_ref.prefix()), "{report:?}");
    assert!(store.list(&orphan_ref).await.unwrap().is_empty());
    assert_eq!(store.list(&live_ref).await.unwrap().len(), 2);
    api.patch(
        "live",
        &PatchParams::default(),
        &Patch::Merge(serde_json::json!({"metadata": {"finalizers": null}})),
    )
    .await
    .unwrap();
}

/// The per-namespace quota against `store` and the real API server: the namespace's
/// annotation sets it, the store's listing says what is used, an artifact past it is
/// refused and deleted artifacts free room.
pub async fn quota_counts_what_the_store_holds(store: Arc<dyn ArtifactStore>) {
    let ns = TestNamespace::create("store-quota").await.unwrap();
    let client = ns.client();
    let namespaces: Api<k8s_openapi::api::core::v1::Namespace> = Api::all(client.clone());
    namespaces
        .patch(
            ns.name(),
            &PatchParams::default(),
            &Patch::Merge(
                serde_json::json!({"metadata": {"annotations": {QUOTA_ANNOTATION: "5000"}}}),
            ),
        )
        .await
        .unwrap();
    let ledger = QuotaLedger::new(store.clone(), 1 << 30);
    let quota = ledger.quota_of(&client, ns.name()).await.unwrap();
    assert_eq!(quota, 5000);
    let first = RequestRef::new(ns.name(), "first", unique_uid()).unwrap();
    upload(store.as_ref(), &first, "cpu-n1.pb.gz", 1500).await;
    upload(store.as_ref(), &first, "cpu-n2.pb.gz", 2500).await;
    assert_eq!(ledger.room(ns.name(), quota).await.unwrap(), Ok(1000));

    let second = RequestRef::new(ns.name(), "second", unique_uid()).unwrap();
    let big = second.artifact("cpu-n1.pb.gz").unwrap();
    let refused = ledger.admit(&big, 1200, quota).await.unwrap().unwrap_err();
    assert_eq!((refused.used, refused.needed), (4000, Some(1200)));
    let small = second.artifact("cpu-n2.pb.gz").unwrap();
    ledger.admit(&small, 900, quota).await.unwrap().unwrap();
    let full = ledger.room(ns.name(), 4900).await.unwrap().unwrap_err();
    assert!(full.to_string().contains("has used"), "{full}");

    // Deleting a request frees its room.
    store.delete_request(&first).await.unwrap();
    ledger.forget(&first).await;
    assert_eq!(ledger.room(ns.name(), quota).await.unwrap(), Ok(4100));
    // One artifact can be deleted alone (a node refused by the quota keeps nothing).
    upload(store.as_ref(), &second, "cpu-n2.pb.gz", 900).await;
    store.delete_artifact(&small).await.unwrap();
    store.delete_artifact(&small).await.unwrap();
    assert!(store.list(&second).await.unwrap().is_empty());
}
