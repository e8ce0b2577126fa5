//! The S3 backend against a real S3-compatible server (`s3s-fs`) on 127.0.0.1.
//!
//! `scripts/install-s3-test-server.sh` installs the server; these tests fail, not skip,
//! when it is missing.

use std::{
    path::PathBuf,
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use flamefleet_operator::store::{
    ArtifactStore, RequestRef, Sha256Digest, StoreError, UploadLimits,
    s3::{S3Config, S3Store},
};
use reqwest::StatusCode;
use url::Url;

mod store_support;
use store_support::{files_under, payload, unique_uid};

const DEFAULT_BINARY: &str = "/var/cache/flamefleet/s3s-fs/bin/s3s-fs";
const BUCKET: &str = "flamefleet-artifacts";
const ACCESS_KEY: &str = "flamefleet-test";
const SECRET_KEY: &str = "flamefleet-test-secret-key-0123456789";

/// One `s3s-fs` process over a temporary directory; killed on drop.
struct S3Server {
    child: Child,
    endpoint: String,
    bucket_dir: PathBuf,
    _dir: tempfile::TempDir,
}

impl Drop for S3Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl S3Server {
    async fn start() -> S3Server {
        let binary =
            std::env::var("FLAMEFLEET_S3S_FS").unwrap_or_else(|_| DEFAULT_BINARY.to_owned());
        assert!(
            std::path::Path::new(&binary).is_file(),
            "the S3-compatible test server is missing: {binary} does not exist. \
             Install it with scripts/install-s3-test-server.sh (scripts/setup.sh does), \
             or point FLAMEFLEET_S3S_FS at an s3s-fs binary."
        );
        let dir = tempfile::tempdir().unwrap();
        let bucket_dir = dir.path().join(BUCKET);
        std::fs::create_dir(&bucket_dir).unwrap();
        // Ask the kernel for a free port, then hand it to the server.
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let child = Command::new(&binary)
            .args(["--host", "127.0.0.1", "--port", &port.to_string()])
            .args(["--access-key", ACCESS_KEY, "--secret-key", SECRET_KEY])
            .arg(dir.path())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {binary}: {e}"));
        let server = S3Server {
            child,
            endpoint: format!("http://127.0.0.1:{port}"),
            bucket_dir,
            _dir: dir,
        };
        let deadline = Instant::now() + Duration::from_secs(10);
        while tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .is_err()
        {
            assert!(
                Instant::now() < deadline,
                "{binary} did not listen on 127.0.0.1:{port} within 10 s"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        server
    }

    fn store(&self) -> S3Store {
        S3Store::new(S3Config {
            endpoint: self.endpoint.clone(),
            bucket: BUCKET.to_owned(),
            region: "us-east-1".to_owned(),
            access_key_id: ACCESS_KEY.to_owned(),
            secret_access_key: SECRET_KEY.to_owned(),
            allow_http: true,
        })
        .unwrap()
    }

    /// Every file the server keeps for the bucket, relative to it.
    /// Every file the server keeps for the bucket, relative to it.
    fn files(&self) -> Vec<String> {
        files_under(&self.bucket_dir)
    }
}

fn limits(max_bytes: u64) -> UploadLimits {
    UploadLimits {
        max_bytes,
        sha256: None,
        ttl: Duration::from_secs(300),
    }
}

async fn put(url: Url, body: Vec<u8>) -> (StatusCode, String) {
    let r = reqwest::Client::new()
        .put(url)
        .body(body)
        .send()
        .await
        .unwrap();
    (r.status(), r.text().await.unwrap())
}

#[tokio::test]
async fn s3_upload_download_verify_and_delete() {
    let server = S3Server::start().await;
    let store = server.store();
    let req = RequestRef::new("shop", "checkout-cpu", unique_uid()).unwrap();
    let other = RequestRef::new("shop", "checkout-cpu-2", unique_uid()).unwrap();
    let key = req.artifact("cpu-worker-1.pb.gz").unwrap();
    let body = payload(300_000);
    let sha = Sha256Digest::of(&body);

    let target = store.upload_target(&key, &limits(1 << 20)).await.unwrap();
    assert!(target.headers.is_empty());
    let (status, text) = put(target.url.clone(), body.clone()).await;
    assert_eq!(status, StatusCode::OK, "{text}");
    // Uploading again to the same key is idempotent.
    let (status, text) = put(target.url, body.clone()).await;
    assert_eq!(status, StatusCode::OK, "{text}");

    let digest = store.verify_upload(&key, 1 << 20, Some(sha)).await.unwrap();
    assert_eq!(digest.sha256, sha);
    assert_eq!(digest.size_bytes, body.len() as u64);

    let get = store
        .download_url(&key, Duration::from_secs(60))
        .await
        .unwrap();
    let r = reqwest::get(get.clone()).await.unwrap();
    assert_eq!(r.status(), StatusCode::OK);
    assert_eq!(Sha256Digest::of(&r.bytes().await.unwrap()), sha);

    // A tampered key or the wrong method is refused by the server.
    let mut tampered = get.clone();
    tampered.set_path(&get.path().replace("cpu-worker-1", "cpu-worker-2"));
    let r = reqwest::get(tampered).await.unwrap();
    assert_eq!(r.status(), StatusCode::FORBIDDEN);
    let (status, _) = put(get, b"overwrite".to_vec()).await;
    assert_eq!(status, StatusCode::FORBIDDEN);

    for name in ["cpu-worker-2.pb.gz", "runqlat.txt"] {
        let k = req.artifact(name).unwrap();
        let t = store.upload_target(&k, &limits(1024)).await.unwrap();
        assert_eq!(put(t.url, payload(10)).await.0, StatusCode::OK);
    }
    let k = other.artifact("cpu.pb.gz").unwrap();
    let t = store.upload_target(&k, &limits(1024)).await.unwrap();
    assert_eq!(put(t.url, payload(10)).await.0, StatusCode::OK);

    let listed: Vec<String> = store
        .list(&req)
        .await
        .unwrap()
        .into_iter()
        .map(|a| a.key.artifact().to_owned())
        .collect();
    assert_eq!(
        listed,
        ["cpu-worker-1.pb.gz", "cpu-worker-2.pb.gz", "runqlat.txt"]
    );

    assert_eq!(store.delete_request(&req).await.unwrap(), 3);
    assert!(store.list(&req).await.unwrap().is_empty());
    assert_eq!(store.list(&other).await.unwrap().len(), 1);
    // The finalizer may run twice: the second delete succeeds with nothing to do.
    assert_eq!(store.delete_request(&req).await.unwrap(), 0);
    assert_eq!(store.delete_request(&other).await.unwrap(), 1);
    assert!(
        server.files().iter().all(|f| !f.contains("checkout-cpu")),
        "{:?}",
        server.files()
    );
    let err = store.verify_upload(&key, 1 << 20, None).await.unwrap_err();
    assert!(matches!(err, StoreError::NotFound { .. }), "{err}");
}

#[tokio::test]
async fn s3_oversized_or_mismatched_uploads_are_removed_at_verification() {
    let server = S3Server::start().await;
    let store = server.store();
    let req = RequestRef::new("team-b", "heap", unique_uid()).unwrap();

    let big = req.artifact("big.pb.gz").unwrap();
    let t = store.upload_target(&big, &limits(1000)).await.unwrap();
    assert_eq!(t.max_bytes, 1000);
    assert_eq!(put(t.url, payload(1001)).await.0, StatusCode::OK);
    let err = store.verify_upload(&big, 1000, None).await.unwrap_err();
    assert!(
        matches!(err, StoreError::TooLarge { max: 1000, .. }),
        "{err}"
    );

    let bad = req.artifact("bad.pb.gz").unwrap();
    let t = store.upload_target(&bad, &limits(1000)).await.unwrap();
    assert_eq!(put(t.url, payload(500)).await.0, StatusCode::OK);
    let wrong = Sha256Digest::of(b"other");
    let err = store
        .verify_upload(&bad, 1000, Some(wrong))
        .await
        .unwrap_err();
    assert!(matches!(err, StoreError::ChecksumMismatch { .. }), "{err}");

    assert!(store.list(&req).await.unwrap().is_empty());
}

#[tokio::test]
async fn s3_expired_url_is_refused() {
    let server = S3Server::start().await;
    let store = server.store();
    let req = RequestRef::new("shop", "expiry", unique_uid()).unwrap();
    let key = req.artifact("a.pb.gz").unwrap();
    let mut short = limits(1024);
    short.ttl = Duration::from_secs(1);
    let t = store.upload_target(&key, &short).await.unwrap();
    tokio::time::sleep(Duration::from_millis(2100)).await;
    let (status, text) = put(t.url, payload(10)).await;
    assert_eq!(status, StatusCode::FORBIDDEN, "{text}");
    assert!(store.list(&req).await.unwrap().is_empty());
}

#[tokio::test]
async fn s3_upload_bound_to_a_sha256_refuses_other_bodies() {
    let server = S3Server::start().await;
    let store = server.store();
    let req = RequestRef::new("shop", "bound", unique_uid()).unwrap();
    let key = req.artifact("cpu.pb.gz").unwrap();
    let body = payload(4000);
    let mut bound = limits(1 << 20);
    bound.sha256 = Some(Sha256Digest::of(&body));
    let target = store.upload_target(&key, &bound).await.unwrap();
    assert_eq!(target.headers.len(), 1, "{:?}", target.headers);
    let http = reqwest::Client::new();
    let send = |body: Vec<u8>, with_header: bool| {
        let mut r = http.put(target.url.clone()).body(body);
        if with_header {
            for (name, value) in &target.headers {
                r = r.header(name, value);
            }
        }
        r.send()
    };

    // Without the signed header the signature does not match.
    let r = send(body.clone(), false).await.unwrap();
    assert_eq!(r.status(), StatusCode::FORBIDDEN);
    // Another body with the header: the server refuses the digest.
    let r = send(payload(3999), true).await.unwrap();
    assert_eq!(r.status(), StatusCode::BAD_REQUEST);
    // AWS keeps nothing after a BadDigest; s3s-fs 0.14 keeps the refused body. Either way
    // verification never accepts it and leaves nothing behind.
    let err = store
        .verify_upload(&key, 1 << 20, bound.sha256)
        .await
        .unwrap_err();
    assert!(
        matches!(
            err,
            StoreError::ChecksumMismatch { .. } | StoreError::NotFound { .. }
        ),
        "{err}"
    );
    assert!(store.list(&req).await.unwrap().is_empty());

    let r = send(body.clone(), true).await.unwrap();
    assert_eq!(r.status(), StatusCode::OK, "{}", r.text().await.unwrap());
    let digest = store
        .verify_upload(&key, 1 << 20, bound.sha256)
        .await
        .unwrap();
    assert_eq!(digest.size_bytes, 4000);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s3_orphans_are_swept_and_live_requests_kept() {
    let server = S3Server::start().await;
    store_support::orphans_are_swept_and_live_requests_kept(&server.store()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s3_quota_counts_what_the_bucket_holds() {
    let server = S3Server::start().await;
    store_support::quota_counts_what_the_store_holds(std::sync::Arc::new(server.store())).await;
}
