//! Without the Flamefleet CRDs every command says how to install them (exit 9). Uses a fresh
//! local control plane of its own, since the shared one has the CRDs installed.

mod support;

use flamefleet_e2e::{ControlPlane, Lifetime};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn missing_crd_is_reported_with_exit_9() {
    let state = tempfile::tempdir().unwrap();
    let dir = state.path().join("cp");
    let cp =
        tokio::task::spawn_blocking(move || ControlPlane::start(&dir, Lifetime::TiedToThisProcess))
            .await
            .unwrap()
            .unwrap_or_else(|e| panic!("this test needs its own local control plane: {e}"));
    for args in [
        &["get", "checkout-cpu"][..],
        &["list"][..],
        &["delete", "checkout-cpu"][..],
        &["cpu", "web-0", "--no-wait"][..],
    ] {
        let r = support::cli(cp.kubeconfig(), "default", args).await;
        assert_eq!(r.code, 9, "{args:?}: {r:?}");
        assert!(
            r.stderr.contains("Flamefleet is not installed")
                && r.stderr.contains("install the CRDs"),
            "{args:?}: {}",
            r.stderr
        );
    }
}
