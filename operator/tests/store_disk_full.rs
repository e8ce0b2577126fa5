//! The built-in store on a full volume: a small tmpfs the test mounts (needs root, as CI has;
//! the test fails with a clear message otherwise).

use std::{io::Write, path::PathBuf, process::Command, sync::Arc, time::Duration};

use flamefleet_operator::store::{
    ArtifactStore, RequestRef, UploadLimits,
    builtin::{BuiltinConfig, BuiltinStore, http::router},
};
use reqwest::StatusCode;

mod store_support;
use store_support::{files_under, payload, unique_uid};

/// A tmpfs mounted for the test's lifetime.
struct Tmpfs {
    path: PathBuf,
    _dir: tempfile::TempDir,
}

impl Tmpfs {
    fn mount(size: &str) -> Tmpfs {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("volume");
        std::fs::create_dir(&path).unwrap();
        let out = Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size}"), "tmpfs"])
            .arg(&path)
            .output()
            .expect("running mount(8)");
        assert!(
            out.status.success(),
            "mounting a tmpfs failed ({}): this test needs root (CAP_SYS_ADMIN), as in CI; run the suite as root",
            String::from_utf8_lossy(&out.stderr).trim()
        );
        Tmpfs { path, _dir: dir }
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(&self.path).status();
    }
}

/// Fills the volume, then frees `leave` bytes.
fn fill(volume: &std::path::Path, leave: u64) {
    let path = volume.join("filler");
    let mut f = std::fs::File::create(&path).unwrap();
    let chunk = vec![0xa5u8; 4096];
    let mut written = 0u64;
    loop {
        match f.write(&chunk) {
            Ok(n) => written += n as u64,
            Err(e) if e.kind() == std::io::ErrorKind::StorageFull => break,
            Err(e) => panic!("filling {}: {e}", path.display()),
        }
    }
    f.set_len(written.saturating_sub(leave)).unwrap();
}

#[tokio::test]
async fn full_volume_gets_507_and_leaves_nothing() {
    let volume = Tmpfs::mount("1m");
    let root = volume.path.join("artifacts");
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base: url::Url = format!("http://{}/", listener.local_addr().unwrap())
        .parse()
        .unwrap();
    let store = Arc::new(
        BuiltinStore::open(BuiltinConfig {
            root: root.clone(),
            public_url: base,
            secret: vec![9u8; 32],
            max_upload_bytes: 1 << 20,
        })
        .await
        .unwrap(),
    );
    tokio::spawn(axum::serve(listener, router(store.clone())).into_future());
    fill(&volume.path, 8192);

    let req = RequestRef::new("shop", "full", unique_uid()).unwrap();
    let key = req.artifact("cpu.pb.gz").unwrap();
    let limits = UploadLimits {
        max_bytes: 1 << 20,
        sha256: None,
        ttl: Duration::from_secs(60),
    };
    let url = store.upload_target(&key, &limits).await.unwrap().url;
    let r = reqwest::Client::new()
        .put(url.clone())
        .body(payload(64 * 1024))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::INSUFFICIENT_STORAGE);
    let text = r.text().await.unwrap();
    assert!(text.contains("no space left"), "{text}");
    assert!(files_under(&root).is_empty(), "{:?}", files_under(&root));

    // Space freed: the same URL works.
    std::fs::remove_file(volume.path.join("filler")).unwrap();
    let r = reqwest::Client::new()
        .put(url)
        .body(payload(64 * 1024))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::CREATED);
}

/// An upload small enough to go in one write, into a volume with no room left at all: the
/// write fails only when the store flushes it, and must still be refused with 507, leaving
/// neither the artifact nor a metadata file that claims it.
#[tokio::test]
async fn a_small_upload_into_a_full_volume_gets_507_too() {
    let volume = Tmpfs::mount("1m");
    let root = volume.path.join("artifacts");
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base: url::Url = format!("http://{}/", listener.local_addr().unwrap())
        .parse()
        .unwrap();
    let store = Arc::new(
        BuiltinStore::open(BuiltinConfig {
            root: root.clone(),
            public_url: base,
            secret: vec![9u8; 32],
            max_upload_bytes: 1 << 20,
        })
        .await
        .unwrap(),
    );
    tokio::spawn(axum::serve(listener, router(store.clone())).into_future());
    let req = RequestRef::new("shop", "small", unique_uid()).unwrap();
    let key = req.artifact("cpu.pb.gz").unwrap();
    let limits = UploadLimits {
        max_bytes: 1 << 20,
        sha256: None,
        ttl: Duration::from_secs(60),
    };
    let url = store.upload_target(&key, &limits).await.unwrap().url;
    // The request's directories exist (an earlier upload made them); then nothing is left.
    std::fs::create_dir_all(root.join("shop")).unwrap();
    fill(&volume.path, 0);
    let r = reqwest::Client::new()
        .put(url.clone())
        .body(payload(1200))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::INSUFFICIENT_STORAGE);
    assert!(files_under(&root).is_empty(), "{:?}", files_under(&root));
    std::fs::remove_file(volume.path.join("filler")).unwrap();
    let r = reqwest::Client::new()
        .put(url)
        .body(payload(1200))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::CREATED);
}
