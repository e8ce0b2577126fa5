//! Downloads never carry a user's credentials outside the API server, and are authorized
//! when asked for:
//! - a URL written into a ProfileRequest's status (by anyone: a compromised node, an
//!   attacker with status access) is never contacted; the CLI downloads only from URLs the
//!   operator signs in answer to a ProfileDownload;
//! - the API server refuses a ProfileDownload of a request the user may not `get`
//!   (admission policy), and revoking the user's RBAC revokes their next download.

mod support;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use flamefleet_api::{NodePhase, ProfileDownload, ProfileDownloadSpec, RequestPhase};
use flamefleet_e2e::test_namespace::download_rules;
use kube::api::{Api, DeleteParams, ObjectMeta, PostParams};
use kube::config::Kubeconfig;
use support::{Store, cli, cpu_profile, create_request, files, node, write_status};
use tokio::io::AsyncReadExt as _;

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

/// Runs the CLI until it exits with `code`, for up to 15 s: RBAC changes reach the API
/// server's authorizer through its informers, a moment after the write.
async fn cli_until(code: i32, kc: &Path, ns: &str, args: &[&str]) -> support::Run {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(15);
    loop {
        let r = cli(kc, ns, args).await;
        if r.code == code || tokio::time::Instant::now() > deadline {
            return r;
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
}

/// A listener that counts connections and keeps whatever bytes arrive.
async fn trap() -> (String, Arc<AtomicUsize>, Arc<std::sync::Mutex<Vec<u8>>>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let hits = Arc::new(AtomicUsize::new(0));
    let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
    let (h, s) = (hits.clone(), seen.clone());
    tokio::spawn(async move {
        while let Ok((mut sock, _)) = listener.accept().await {
            h.fetch_add(1, Ordering::SeqCst);
            let mut buf = vec![0u8; 8192];
            if let Ok(Ok(n)) =
                tokio::time::timeout(Duration::from_secs(2), sock.read(&mut buf)).await
            {
                s.lock().unwrap().extend_from_slice(&buf[..n]);
            }
        }
    });
    (format!("http://{addr}"), hits, seen)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn urls_in_the_status_are_never_contacted_and_tokens_stay_home() {
    let ns = support::namespace("cli-trust").await;
    let store = Store::start_for(&ns).await;
    let req = create_request(&ns, "checkout").await;
    let mut artifact = store
        .upload(&req, "cpu-node-a.pb.gz", &cpu_profile("trusted_fn"))
        .await;
    // What a compromised node (or anyone able to write the status) would plant.
    let (evil, hits, seen) = trap().await;
    artifact.url = Some(format!("{evil}/v1/artifacts/steal"));
    write_status(
        &ns,
        "checkout",
        RequestPhase::Succeeded,
        vec![node("node-a", NodePhase::Succeeded, None, vec![artifact])],
    )
    .await;
    // A user holding a bearer token: the kind of credential that could leak.
    ns.grant_get_profile_request("reader", "checkout")
        .await
        .unwrap();
    let kcdir = tempfile::tempdir().unwrap();
    let reader = token_kubeconfig(
        &support::admin_kubeconfig(&ns),
        &ns.service_account_token("reader").await.unwrap(),
        &kcdir.path().join("reader"),
    );
    let out = tempfile::tempdir().unwrap();
    let r = cli_until(
        0,
        &reader,
        ns.name(),
        &["get", "checkout", "-o", out.path().to_str().unwrap()],
    )
    .await;
    assert_eq!(r.code, 0, "{r:?}");
    assert_eq!(files(out.path()), ["checkout-node-a.pb.gz"]);
    assert_eq!(
        hits.load(Ordering::SeqCst),
        0,
        "the CLI contacted the URL from the status; it sent: {}",
        String::from_utf8_lossy(&seen.lock().unwrap())
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn downloads_are_authorized_per_request_when_asked_and_revocable() {
    let ns = support::namespace("cli-authz").await;
    let store = Store::start_for(&ns).await;
    for name in ["mine", "theirs"] {
        let req = create_request(&ns, name).await;
        let a = store
            .upload(&req, "cpu-node-a.pb.gz", &cpu_profile("authz_fn"))
            .await;
        write_status(
            &ns,
            name,
            RequestPhase::Succeeded,
            vec![node("node-a", NodePhase::Succeeded, None, vec![a])],
        )
        .await;
    }
    // A user with a client certificate (no token at all) who may get "mine" only, and
    // create ProfileDownloads.
    let user = ns.unique("alice");
    let kc = ns.control_plane().kubeconfig_for_user(&user, &[]).unwrap();
    let binding = ns
        .bind_rules("User", &user, "download-mine", download_rules("mine"))
        .await
        .unwrap();
    let out = tempfile::tempdir().unwrap();
    let dir = out.path().to_str().unwrap();
    let r = cli_until(0, &kc, ns.name(), &["get", "mine", "-o", dir]).await;
    assert_eq!(r.code, 0, "{r:?}");
    assert_eq!(files(out.path()), ["mine-node-a.pb.gz"]);

    // Asking for "theirs" directly through the API: the admission policy refuses it, even
    // though RBAC lets the user create ProfileDownloads.
    let client = kube::Client::try_from(
        kube::Config::from_custom_kubeconfig(
            Kubeconfig::read_from(&kc).unwrap(),
            &Default::default(),
        )
        .await
        .unwrap(),
    )
    .unwrap();
    let downloads: Api<ProfileDownload> = Api::namespaced(client, ns.name());
    let ask = |requests: Vec<&str>| ProfileDownload {
        metadata: ObjectMeta {
            generate_name: Some("t-".into()),
            ..Default::default()
        },
        spec: ProfileDownloadSpec {
            requests: requests.into_iter().map(String::from).collect(),
            nodes: Vec::new(),
            recipient_key: flamefleet_api::download_seal::AnswerKey::generate()
                .unwrap()
                .public_key(),
        },
        status: None,
    };
    let refused = downloads
        .create(&PostParams::default(), &ask(vec!["mine", "theirs"]))
        .await
        .expect_err("a download of a request the user may not get");
    let text = refused.to_string();
    assert!(
        text.contains("needs get on every ProfileRequest of namespace"),
        "{text}"
    );
    let refused = downloads
        .create(&PostParams::default(), &ask(vec!["theirs"]))
        .await
        .expect_err("a download of a request the user may not get");
    let text = refused.to_string();
    assert!(
        text.contains("you may not get ProfileRequest theirs"),
        "{text}"
    );
    downloads
        .create(&PostParams::default(), &ask(vec!["mine"]))
        .await
        .expect("the one request the user may get");

    // Revoking the user's RBAC revokes the next download (exit 8, nothing written).
    ns.api::<k8s_openapi::api::rbac::v1::RoleBinding>()
        .delete(&binding, &DeleteParams::default())
        .await
        .unwrap();
    let empty = tempfile::tempdir().unwrap();
    let r = cli_until(
        8,
        &kc,
        ns.name(),
        &["get", "mine", "-o", empty.path().to_str().unwrap()],
    )
    .await;
    assert_eq!(r.code, 8, "{r:?}");
    assert_eq!(files(empty.path()), Vec::<String>::new());
}

/// Two users of one namespace, each allowed to download their own request: Alice downloads
/// "mine" with the CLI while Mallory, who may list and watch ProfileDownloads (as the
/// aggregated `edit` role allows) but may not get "mine", watches every ProfileDownload of
/// the namespace. Mallory sees Alice's answer go by, but no URL in it, and so cannot fetch
/// Alice's artifact from the store.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn other_users_who_watch_downloads_never_read_their_urls() {
    let ns = support::namespace("cli-privacy").await;
    let store = Store::start_for(&ns).await;
    for name in ["mine", "theirs"] {
        let req = create_request(&ns, name).await;
        let a = store
            .upload(&req, "cpu-node-a.pb.gz", &cpu_profile("private_fn"))
            .await;
        write_status(
            &ns,
            name,
            RequestPhase::Succeeded,
            vec![node("node-a", NodePhase::Succeeded, None, vec![a])],
        )
        .await;
    }
    let alice = ns.unique("alice");
    let mallory = ns.unique("mallory");
    let alice_kc = ns.control_plane().kubeconfig_for_user(&alice, &[]).unwrap();
    let mallory_kc = ns
        .control_plane()
        .kubeconfig_for_user(&mallory, &[])
        .unwrap();
    ns.bind_rules("User", &alice, "dl-mine", download_rules("mine"))
        .await
        .unwrap();
    ns.bind_rules("User", &mallory, "dl-theirs", download_rules("theirs"))
        .await
        .unwrap();

    // Mallory watches every ProfileDownload of the namespace and keeps what it sees.
    let mallory_client = kube::Client::try_from(
        kube::Config::from_custom_kubeconfig(
            Kubeconfig::read_from(&mallory_kc).unwrap(),
            &Default::default(),
        )
        .await
        .unwrap(),
    )
    .unwrap();
    let watched: Api<ProfileDownload> = Api::namespaced(mallory_client, ns.name());
    let seen = Arc::new(std::sync::Mutex::new(Vec::<ProfileDownload>::new()));
    let (listed_tx, listed) = tokio::sync::oneshot::channel::<()>();
    {
        let seen = seen.clone();
        tokio::spawn(async move {
            use futures::StreamExt as _;
            let mut listed_tx = Some(listed_tx);
            let stream = kube::runtime::watcher(watched, Default::default());
            let mut stream = std::pin::pin!(stream);
            while let Some(event) = stream.next().await {
                match event {
                    Ok(kube::runtime::watcher::Event::InitDone) => {
                        if let Some(tx) = listed_tx.take() {
                            let _ = tx.send(());
                        }
                    }
                    Ok(
                        kube::runtime::watcher::Event::Apply(d)
                        | kube::runtime::watcher::Event::InitApply(d),
                    ) => seen.lock().unwrap().push(d),
                    _ => {}
                }
            }
        });
    }
    tokio::time::timeout(Duration::from_secs(30), listed)
        .await
        .expect("Mallory's watch lists within 30 s (RBAC lets Mallory watch downloads)")
        .unwrap();

    let out = tempfile::tempdir().unwrap();
    let r = cli_until(
        0,
        &alice_kc,
        ns.name(),
        &["get", "mine", "-o", out.path().to_str().unwrap()],
    )
    .await;
    assert_eq!(r.code, 0, "{r:?}");
    assert_eq!(files(out.path()), ["mine-node-a.pb.gz"]);

    // The watch saw Alice's answered download (the attack was made).
    let deadline = tokio::time::Instant::now() + Duration::from_secs(15);
    let answered: Vec<ProfileDownload> = loop {
        let answered: Vec<ProfileDownload> = seen
            .lock()
            .unwrap()
            .iter()
            .filter(|d| {
                d.spec.requests == ["mine"]
                    && d.status
                        .as_ref()
                        .is_some_and(|s| s.phase == Some(flamefleet_api::DownloadPhase::Ready))
            })
            .cloned()
            .collect();
        if !answered.is_empty() {
            break answered;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "Mallory's watch never saw Alice's answered download"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let http = reqwest::Client::new();
    for download in answered {
        let text = serde_json::to_string(&download).unwrap();
        assert!(
            !text.contains("sig="),
            "Mallory read a signed URL of Alice's download: {text}"
        );
        // Whatever looks like a URL in it does not fetch Alice's artifact.
        for word in text.split(['"', ' ', ',']) {
            if let Some(at) = word.find("http") {
                let url = &word[at..];
                if let Ok(response) = http.get(url).send().await {
                    assert!(
                        !response.status().is_success(),
                        "Mallory fetched {url} from Alice's download"
                    );
                }
            }
        }
    }
}
