//! The built-in artifact store over real HTTP on 127.0.0.1 and a real directory.

use std::{collections::HashSet, path::PathBuf, sync::Arc, time::Duration};

mod store_support;
use store_support::{files_under, payload, unique_uid};

use flamefleet_operator::store::{
    ArtifactKey, ArtifactStore, RequestRef, SHA256_HEADER, Sha256Digest, StoreError, UploadLimits,
    builtin::{BuiltinConfig, BuiltinStore, http::router},
    remote::{RemoteConfig, RemoteStore},
};
use reqwest::StatusCode;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use url::Url;

struct Server {
    store: Arc<BuiltinStore>,
    base: Url,
    root: PathBuf,
    _dir: tempfile::TempDir,
    http: reqwest::Client,
}

impl Server {
    async fn start(max_upload_bytes: u64) -> Server {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("artifacts");
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let base: Url = format!("http://{}/", listener.local_addr().unwrap())
            .parse()
            .unwrap();
        let store = Arc::new(
            BuiltinStore::open(BuiltinConfig {
                root: root.clone(),
                public_url: base.clone(),
                secret: b"0123456789abcdef0123456789abcdef".to_vec(),
                max_upload_bytes,
            })
            .await
            .unwrap(),
        );
        let app = router(store.clone());
        tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
        Server {
            store,
            base,
            root,
            _dir: dir,
            http: reqwest::Client::new(),
        }
    }

    /// Every file under the root, including temporary uploads.
    fn files(&self) -> Vec<String> {
        files_under(&self.root)
    }

    async fn upload_url(&self, key: &ArtifactKey, max: u64, sha: Option<Sha256Digest>) -> Url {
        let limits = UploadLimits {
            max_bytes: max,
            sha256: sha,
            ttl: Duration::from_secs(60),
        };
        self.store.upload_target(key, &limits).await.unwrap().url
    }

    async fn put(&self, url: Url, body: Vec<u8>) -> (StatusCode, String) {
        let r = self.http.put(url).body(body).send().await.unwrap();
        (r.status(), r.text().await.unwrap())
    }
}

fn request(ns: &str, name: &str) -> RequestRef {
    RequestRef::new(ns, name, unique_uid()).unwrap()
}

#[tokio::test]
async fn upload_and_download_round_trip_with_sha256() {
    let srv = Server::start(1 << 20).await;
    let req = request("shop", "checkout-cpu");
    let key = req.artifact("cpu-worker-1.pb.gz").unwrap();
    let body = payload(200_000);
    let sha = Sha256Digest::of(&body);

    let url = srv.upload_url(&key, 1 << 20, Some(sha)).await;
    let (status, text) = srv.put(url.clone(), body.clone()).await;
    assert_eq!(status, StatusCode::CREATED, "{text}");
    let reply: serde_json::Value = serde_json::from_str(&text).unwrap();
    assert_eq!(reply["sha256"], sha.to_string());
    assert_eq!(reply["sizeBytes"], body.len());
    assert_eq!(reply["key"], key.to_string());

    // The same upload again is idempotent.
    let (status, text) = srv.put(url, body.clone()).await;
    assert_eq!(status, StatusCode::CREATED, "{text}");

    let digest = srv
        .store
        .verify_upload(&key, 1 << 20, Some(sha))
        .await
        .unwrap();
    assert_eq!(digest.sha256, sha);
    assert_eq!(digest.size_bytes, body.len() as u64);

    let get = srv
        .store
        .download_url(&key, Duration::from_secs(60))
        .await
        .unwrap();
    let r = srv.http.get(get).send().await.unwrap();
    assert_eq!(r.status(), StatusCode::OK);
    assert_eq!(r.headers()[SHA256_HEADER], sha.to_string().as_str());
    let got = r.bytes().await.unwrap();
    assert_eq!(Sha256Digest::of(&got), sha);
    assert_eq!(got.as_ref(), body.as_slice());

    let listed = srv.store.list(&req).await.unwrap();
    assert_eq!(listed.len(), 1);
    assert_eq!(listed[0].key, key);
    assert_eq!(listed[0].size_bytes, body.len() as u64);
    // One artifact and its metadata, no leftover temporary file.
    let dir = format!("shop/{}", req.dir_name());
    assert_eq!(
        srv.files(),
        vec![
            format!("{dir}/.meta/cpu-worker-1.pb.gz.json"),
            format!("{dir}/cpu-worker-1.pb.gz"),
        ]
    );

    let health = srv
        .http
        .get(srv.base.join("healthz").unwrap())
        .send()
        .await
        .unwrap();
    assert_eq!(health.status(), StatusCode::OK);
}

/// Rewrites one query parameter of a URL.
fn with_param(url: &Url, name: &str, value: &str) -> Url {
    let pairs: Vec<(String, String)> = url
        .query_pairs()
        .map(|(k, v)| {
            let v = if k == name {
                value.to_owned()
            } else {
                v.into()
            };
            (k.into_owned(), v)
        })
        .collect();
    let mut out = url.clone();
    out.query_pairs_mut().clear().extend_pairs(pairs);
    out
}

fn param(url: &Url, name: &str) -> String {
    url.query_pairs()
        .find(|(k, _)| k == name)
        .map(|(_, v)| v.into_owned())
        .unwrap()
}

#[tokio::test]
async fn bad_expired_misused_or_tampered_signatures_are_refused() {
    let srv = Server::start(1 << 20).await;
    let req = request("shop", "sig");
    let key = req.artifact("a.pb.gz").unwrap();
    let url = srv.upload_url(&key, 1024, None).await;
    let body = payload(100);

    // A flipped signature character.
    let sig = param(&url, "sig");
    let flipped = format!(
        "{}{}",
        if sig.starts_with('0') { '1' } else { '0' },
        &sig[1..]
    );
    let (status, text) = srv
        .put(with_param(&url, "sig", &flipped), body.clone())
        .await;
    assert_eq!(status, StatusCode::FORBIDDEN, "{text}");
    assert!(text.contains("signature does not match"), "{text}");

    // A raised size limit, a moved expiry.
    let (status, _) = srv
        .put(with_param(&url, "max", "999999"), body.clone())
        .await;
    assert_eq!(status, StatusCode::FORBIDDEN);
    let later = (param(&url, "expires").parse::<u64>().unwrap() + 3600).to_string();
    let (status, _) = srv
        .put(with_param(&url, "expires", &later), body.clone())
        .await;
    assert_eq!(status, StatusCode::FORBIDDEN);

    // Another key with this key's signature.
    let mut other = url.clone();
    other.set_path(&url.path().replace("a.pb.gz", "b.pb.gz"));
    let (status, _) = srv.put(other, body.clone()).await;
    assert_eq!(status, StatusCode::FORBIDDEN);

    // An expired URL (valid signature, zero lifetime).
    let expired = srv
        .store
        .upload_target(
            &key,
            &UploadLimits {
                max_bytes: 1024,
                sha256: None,
                ttl: Duration::ZERO,
            },
        )
        .await
        .unwrap()
        .url;
    let (status, text) = srv.put(expired, body.clone()).await;
    assert_eq!(status, StatusCode::FORBIDDEN, "{text}");
    assert!(text.contains("expired"), "{text}");

    // No signature at all.
    let mut bare = url.clone();
    bare.set_query(None);
    let (status, _) = srv.put(bare, body.clone()).await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);

    // Nothing was stored; now the genuine URL works, but only for PUT.
    assert!(srv.files().is_empty(), "{:?}", srv.files());
    let (status, _) = srv.put(url.clone(), body.clone()).await;
    assert_eq!(status, StatusCode::CREATED);
    let r = srv.http.get(url.clone()).send().await.unwrap();
    assert_eq!(r.status(), StatusCode::FORBIDDEN, "a PUT URL must not GET");
    let r = srv.http.delete(url).send().await.unwrap();
    assert_eq!(
        r.status(),
        StatusCode::BAD_REQUEST,
        "DELETE takes a request prefix"
    );

    // A download URL does not upload, nor delete.
    let get = srv
        .store
        .download_url(&key, Duration::from_secs(60))
        .await
        .unwrap();
    let (status, _) = srv.put(get, body).await;
    assert_eq!(status, StatusCode::FORBIDDEN);
}

fn leftovers(srv: &Server, req: &RequestRef) -> Vec<String> {
    let files = srv.files();
    assert!(
        files.iter().all(|f| f.starts_with(&req.prefix())),
        "temporary files left behind: {files:?}"
    );
    files
}

#[tokio::test]
async fn oversized_uploads_get_413_and_leave_nothing() {
    let srv = Server::start(4096).await;
    let req = request("shop", "big");
    let key = req.artifact("big.pb.gz").unwrap();

    // Announced too large by Content-Length: refused before the body is read.
    let url = srv.upload_url(&key, 1024, None).await;
    let (status, text) = srv.put(url.clone(), payload(1025)).await;
    assert_eq!(status, StatusCode::PAYLOAD_TOO_LARGE, "{text}");

    // Streamed without a length: cut off while streaming.
    let chunks: Vec<Result<Vec<u8>, std::io::Error>> = (0..64).map(|_| Ok(payload(512))).collect();
    let r = srv
        .http
        .put(url.clone())
        .body(reqwest::Body::wrap_stream(futures::stream::iter(chunks)))
        .send()
        .await;
    match r {
        Ok(r) => assert_eq!(r.status(), StatusCode::PAYLOAD_TOO_LARGE),
        // The server may close the connection while the client is still sending.
        Err(e) => assert!(e.is_request() || e.is_body(), "{e}"),
    }
    assert!(leftovers(&srv, &req).is_empty());

    // The server's own cap wins over a URL that allows more.
    let generous = srv.upload_url(&key, 1 << 30, None).await;
    assert_eq!(param(&generous, "max"), "4096");
    let (status, _) = srv.put(generous.clone(), payload(4097)).await;
    assert_eq!(status, StatusCode::PAYLOAD_TOO_LARGE);
    let (status, _) = srv.put(generous, payload(4096)).await;
    assert_eq!(status, StatusCode::CREATED);

    // An artifact over the limit checked at verification time is removed.
    let err = srv.store.verify_upload(&key, 4000, None).await.unwrap_err();
    assert!(
        matches!(err, StoreError::TooLarge { found: 4096, .. }),
        "{err}"
    );
    assert!(leftovers(&srv, &req).is_empty(), "{:?}", srv.files());
    let err = srv.store.verify_upload(&key, 4096, None).await.unwrap_err();
    assert!(matches!(err, StoreError::NotFound { .. }), "{err}");
}

#[tokio::test]
async fn checksum_mismatch_gets_422_and_leaves_nothing() {
    let srv = Server::start(1 << 20).await;
    let req = request("shop", "sum");
    let key = req.artifact("heap.pb.gz").unwrap();
    let body = payload(5000);
    let wrong = Sha256Digest::of(b"something else");

    // Signed checksum.
    let url = srv.upload_url(&key, 1 << 20, Some(wrong)).await;
    let (status, text) = srv.put(url, body.clone()).await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY, "{text}");
    assert!(text.contains(&wrong.to_string()), "{text}");
    assert!(leftovers(&srv, &req).is_empty());

    // Checksum announced by the uploader in the header.
    let url = srv.upload_url(&key, 1 << 20, None).await;
    let r = srv
        .http
        .put(url.clone())
        .header(SHA256_HEADER, wrong.to_string())
        .body(body.clone())
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::UNPROCESSABLE_ENTITY);
    assert!(leftovers(&srv, &req).is_empty());
    let r = srv
        .http
        .put(url.clone())
        .header(SHA256_HEADER, "not-hex")
        .body(body.clone())
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::BAD_REQUEST);
    let r = srv
        .http
        .put(url)
        .header(SHA256_HEADER, Sha256Digest::of(&body).to_string())
        .body(body.clone())
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::CREATED);

    // Verification against another expected digest removes the artifact.
    let err = srv
        .store
        .verify_upload(&key, 1 << 20, Some(wrong))
        .await
        .unwrap_err();
    assert!(matches!(err, StoreError::ChecksumMismatch { .. }), "{err}");
    assert!(leftovers(&srv, &req).is_empty(), "{:?}", srv.files());
}

/// Sends a raw HTTP/1.1 request, so that the path reaches the server exactly as written.
async fn raw_status(base: &Url, method: &str, path: &str) -> u16 {
    let addr = format!(
        "{}:{}",
        base.host_str().unwrap(),
        base.port_or_known_default().unwrap()
    );
    let mut conn = tokio::net::TcpStream::connect(addr).await.unwrap();
    let req = format!(
        "{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nConnection: close\r\n\r\nhi"
    );
    conn.write_all(req.as_bytes()).await.unwrap();
    let mut reply = String::new();
    conn.read_to_string(&mut reply).await.unwrap();
    reply
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("no status in {reply:?}"))
}

#[tokio::test]
async fn path_traversal_and_malformed_keys_get_400() {
    let srv = Server::start(1 << 20).await;
    let req = request("shop", "trav");
    let good = srv
        .upload_url(&req.artifact("a.pb.gz").unwrap(), 1024, None)
        .await;
    let query = good.query().unwrap().to_owned();
    let dir = req.dir_name();
    for path in [
        format!("/v1/artifacts/shop/{dir}/../../../etc/passwd"),
        format!("/v1/artifacts/shop/{dir}/..%2F..%2Fetc%2Fpasswd"),
        format!("/v1/artifacts/shop/{dir}/%2e%2e"),
        format!("/v1/artifacts/shop/{dir}/.meta"),
        format!("/v1/artifacts/shop/{dir}/a%00b"),
        format!("/v1/artifacts/shop/{dir}/sub/a.pb.gz"),
        format!("/v1/artifacts/../{dir}/a.pb.gz"),
        format!("/v1/artifacts/Shop/{dir}/a.pb.gz"),
        "/v1/artifacts/shop/no-uid/a.pb.gz".to_string(),
    ] {
        for method in ["PUT", "GET"] {
            let status = raw_status(&srv.base, method, &format!("{path}?{query}")).await;
            assert_eq!(status, 400, "{method} {path}");
        }
    }
    let status = raw_status(&srv.base, "DELETE", "/v1/artifacts/shop/..?sig=00").await;
    assert_eq!(status, 400);
    assert!(srv.files().is_empty(), "{:?}", srv.files());
}

#[tokio::test]
async fn delete_by_request_removes_everything_and_is_repeatable() {
    let srv = Server::start(1 << 20).await;
    let doomed = request("shop", "doomed");
    let kept = request("shop", "kept");
    for (req, name) in [
        (&doomed, "cpu-n1.pb.gz"),
        (&doomed, "cpu-n2.pb.gz"),
        (&doomed, "runqlat.txt"),
        (&kept, "cpu-n1.pb.gz"),
    ] {
        let key = req.artifact(name).unwrap();
        let (status, _) = srv
            .put(srv.upload_url(&key, 1024, None).await, payload(10))
            .await;
        assert_eq!(status, StatusCode::CREATED);
    }
    assert_eq!(srv.store.list(&doomed).await.unwrap().len(), 3);

    // A URL signed for GET of an artifact cannot delete the request.
    let get = srv
        .store
        .download_url(
            &doomed.artifact("runqlat.txt").unwrap(),
            Duration::from_secs(60),
        )
        .await
        .unwrap();
    let mut forged = srv
        .base
        .join(&format!("v1/artifacts/{}", doomed.prefix()))
        .unwrap();
    forged.set_query(get.query());
    assert_eq!(
        srv.http.delete(forged).send().await.unwrap().status(),
        StatusCode::FORBIDDEN
    );

    let url = srv
        .store
        .delete_url(&doomed, Duration::from_secs(60))
        .unwrap();
    let r = srv.http.delete(url.clone()).send().await.unwrap();
    assert_eq!(r.status(), StatusCode::OK);
    assert_eq!(r.json::<serde_json::Value>().await.unwrap()["deleted"], 3);
    assert!(srv.store.list(&doomed).await.unwrap().is_empty());
    let names: HashSet<String> = srv.files().into_iter().collect();
    assert!(
        names.iter().all(|f| f.contains(&kept.dir_name())),
        "{names:?}"
    );
    assert_eq!(srv.store.list(&kept).await.unwrap().len(), 1);

    // A second delete succeeds, over HTTP and through the trait (the finalizer's path).
    let r = srv.http.delete(url).send().await.unwrap();
    assert_eq!(r.status(), StatusCode::OK);
    assert_eq!(srv.store.delete_request(&doomed).await.unwrap(), 0);
    assert_eq!(srv.store.delete_request(&kept).await.unwrap(), 1);
    assert_eq!(srv.store.delete_request(&kept).await.unwrap(), 0);
    assert!(srv.files().is_empty(), "{:?}", srv.files());
}

#[tokio::test]
async fn downloads_need_a_signed_url_whatever_the_headers() {
    let srv = Server::start(1 << 20).await;
    let req = request("team-a", "shared");
    let key = req.artifact("cpu.pb.gz").unwrap();
    let (status, _) = srv
        .put(srv.upload_url(&key, 1024, None).await, payload(64))
        .await;
    assert_eq!(status, StatusCode::CREATED);
    let bare = srv.base.join(&format!("v1/artifacts/{key}")).unwrap();
    // A bearer token (or anything else) is no credential here: the store never judges a
    // user; only URLs the operator signed work.
    for token in [None, Some("a-kubernetes-token")] {
        let mut r = srv.http.get(bare.clone());
        if let Some(t) = token {
            r = r.bearer_auth(t);
        }
        let r = r.send().await.unwrap();
        assert_eq!(r.status(), StatusCode::UNAUTHORIZED);
        assert!(!r.headers().contains_key("www-authenticate"));
        assert!(r.text().await.unwrap().contains("not signed"));
    }
    let signed = srv
        .store
        .download_url(&key, Duration::from_secs(60))
        .await
        .unwrap();
    let r = srv.http.get(signed).send().await.unwrap();
    assert_eq!(r.status(), StatusCode::OK);
    assert_eq!(r.bytes().await.unwrap().as_ref(), payload(64).as_slice());
}

#[tokio::test]
async fn a_remote_store_verifies_lists_and_deletes_through_signed_admin_urls() {
    let srv = Server::start(1 << 20).await;
    let remote = RemoteStore::new(RemoteConfig {
        internal_url: srv.base.clone(),
        public_url: Some("https://profiles.example.test/".parse().unwrap()),
        secret: b"0123456789abcdef0123456789abcdef".to_vec(),
        max_upload_bytes: 1 << 20,
        ca_pem: None,
    })
    .unwrap();
    let req = request("shop", "remote");
    let good = req.artifact("cpu-n1.pb.gz").unwrap();
    let bad = req.artifact("cpu-n2.pb.gz").unwrap();
    for key in [&good, &bad] {
        let target = remote
            .upload_target(
                key,
                &UploadLimits {
                    max_bytes: 4096,
                    sha256: None,
                    ttl: Duration::from_secs(60),
                },
            )
            .await
            .unwrap();
        assert_eq!(
            target.url.host_str(),
            srv.base.host_str(),
            "agents upload inside"
        );
        let (status, text) = srv.put(target.url, payload(100)).await;
        assert_eq!(status, StatusCode::CREATED, "{text}");
    }
    let digest = remote
        .verify_upload(&good, 4096, Some(Sha256Digest::of(&payload(100))))
        .await
        .unwrap();
    assert_eq!(digest.size_bytes, 100);
    // A checksum mismatch is reported and the artifact removed, as in-process.
    let err = remote
        .verify_upload(&bad, 4096, Some(Sha256Digest::of(b"other")))
        .await
        .unwrap_err();
    assert!(err.to_string().contains("expected"), "{err}");
    let missing = remote.verify_upload(&bad, 4096, None).await.unwrap_err();
    assert!(matches!(missing, StoreError::NotFound { .. }), "{missing}");
    let listed = remote.list(&req).await.unwrap();
    assert_eq!(listed.len(), 1);
    assert_eq!(listed[0].key, good);
    // Users download from the public URL.
    let url = remote
        .download_url(&good, Duration::from_secs(60))
        .await
        .unwrap();
    assert_eq!(url.host_str(), Some("profiles.example.test"));
    assert_eq!(remote.delete_request(&req).await.unwrap(), 1);
    assert!(remote.list(&req).await.unwrap().is_empty());
    // A remote store with another secret is refused by the store.
    let stranger = RemoteStore::new(RemoteConfig {
        internal_url: srv.base.clone(),
        public_url: None,
        secret: b"another-secret-another-secret-0123".to_vec(),
        max_upload_bytes: 1 << 20,
        ca_pem: None,
    })
    .unwrap();
    let err = stranger.list(&req).await.unwrap_err();
    assert!(
        matches!(err, StoreError::Remote { status: 403, .. }),
        "{err}"
    );
}

#[tokio::test]
async fn concurrent_uploads_of_one_key_keep_bytes_and_digest_together() {
    let srv = Server::start(1 << 20).await;
    let req = request("shop", "race");
    let key = req.artifact("cpu.pb.gz").unwrap();
    let url = srv.upload_url(&key, 1 << 20, None).await;
    let bodies: Vec<Vec<u8>> = (0..8u8)
        .map(|i| {
            let mut b = payload(50_000 + usize::from(i) * 1000);
            b[0] = i;
            b
        })
        .collect();
    let uploads = bodies.iter().map(|b| srv.put(url.clone(), b.clone()));
    for (status, text) in futures::future::join_all(uploads).await {
        assert_eq!(status, StatusCode::CREATED, "{text}");
    }
    let get = srv
        .store
        .download_url(&key, Duration::from_secs(60))
        .await
        .unwrap();
    let r = srv.http.get(get).send().await.unwrap();
    let announced = r.headers()[SHA256_HEADER].to_str().unwrap().to_owned();
    let got = r.bytes().await.unwrap();
    assert!(bodies.iter().any(|b| b.as_slice() == got.as_ref()));
    assert_eq!(announced, Sha256Digest::of(&got).to_string());
    let digest = srv.store.verify_upload(&key, 1 << 20, None).await.unwrap();
    assert_eq!(digest.sha256, Sha256Digest::of(&got));
    assert_eq!(leftovers(&srv, &req).len(), 2, "{:?}", srv.files());
}

fn remote_of(srv: &Server) -> RemoteStore {
    RemoteStore::new(RemoteConfig {
        internal_url: srv.base.clone(),
        public_url: None,
        secret: b"0123456789abcdef0123456789abcdef".to_vec(),
        max_upload_bytes: 1 << 20,
        ca_pem: None,
    })
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn builtin_orphans_are_swept_and_live_requests_kept() {
    let srv = Server::start(1 << 20).await;
    store_support::orphans_are_swept_and_live_requests_kept(srv.store.as_ref()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn remote_orphans_are_swept_through_signed_admin_urls() {
    let srv = Server::start(1 << 20).await;
    store_support::orphans_are_swept_and_live_requests_kept(&remote_of(&srv)).await;
    // The usage listing needs a signature like every other admin call.
    let r = srv
        .http
        .get(srv.base.join("v1/usage/").unwrap())
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::UNAUTHORIZED);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn builtin_quota_counts_what_the_store_holds() {
    let srv = Server::start(1 << 20).await;
    store_support::quota_counts_what_the_store_holds(srv.store.clone()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn remote_quota_counts_what_the_store_holds() {
    let srv = Server::start(1 << 20).await;
    store_support::quota_counts_what_the_store_holds(Arc::new(remote_of(&srv))).await;
}

/// Slowloris against the store as the operator and `flamefleet-store` serve it
/// (`server::spawn`): a client that sends half a request and then nothing loses its
/// connection at the header deadline (10 s) instead of holding it forever.
#[tokio::test]
async fn a_half_sent_request_loses_its_connection() {
    let dir = tempfile::tempdir().unwrap();
    let (_store, addr) = flamefleet_operator::store::builtin::server::spawn(
        BuiltinConfig {
            root: dir.path().join("artifacts"),
            public_url: "http://127.0.0.1:1/".parse().unwrap(),
            secret: b"0123456789abcdef0123456789abcdef".to_vec(),
            max_upload_bytes: 1 << 20,
        },
        "127.0.0.1:0".parse().unwrap(),
        None,
    )
    .await
    .unwrap();
    let mut slow = tokio::net::TcpStream::connect(addr).await.unwrap();
    slow.write_all(b"PUT /v1/artifacts/ns/a HTTP/1.1\r\nhost: store\r\n")
        .await
        .unwrap();
    let started = std::time::Instant::now();
    let mut buf = [0u8; 512];
    let closed = loop {
        match tokio::time::timeout(Duration::from_secs(20), slow.read(&mut buf)).await {
            Ok(Ok(0) | Err(_)) => break Some(started.elapsed()),
            Ok(Ok(_)) => {}
            Err(_) => break None,
        }
    };
    assert!(
        closed.is_some_and(|t| t < Duration::from_secs(15)),
        "a half-sent request held its connection to the store for {closed:?}"
    );
}

/// A store killed mid-upload leaves its temporary file behind: the next start deletes it
/// once nothing has written to it for `STALE_UPLOAD`, and keeps an upload still being
/// written (another store process on the same volume, or one that just began).
#[tokio::test]
async fn a_restarted_store_deletes_uploads_a_dead_store_left_behind() {
    use flamefleet_operator::store::builtin::STALE_UPLOAD;
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("artifacts");
    let tmp = root.join(".tmp");
    std::fs::create_dir_all(&tmp).unwrap();
    let dead = tmp.join("upload-dead");
    let live = tmp.join("upload-live");
    for path in [&dead, &live] {
        std::fs::write(path, vec![7u8; 4096]).unwrap();
    }
    std::fs::File::options()
        .write(true)
        .open(&dead)
        .unwrap()
        .set_modified(std::time::SystemTime::now() - STALE_UPLOAD - Duration::from_secs(60))
        .unwrap();
    BuiltinStore::open(BuiltinConfig {
        root: root.clone(),
        public_url: "http://127.0.0.1:1/".parse().unwrap(),
        secret: b"0123456789abcdef0123456789abcdef".to_vec(),
        max_upload_bytes: 1 << 20,
    })
    .await
    .unwrap();
    assert!(!dead.exists(), "the dead store's upload is still there");
    assert!(live.exists(), "an upload being written was deleted");
}
