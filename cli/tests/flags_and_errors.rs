//! Every flag of `kubectl profile cpu|heap|runqlat` is checked locally with the schema's
//! bounds (one line, exit 2, nothing created), each type's `--help` lists its own options,
//! the options reach the created request, and whatever the API server still refuses (422)
//! comes back as one line and exit 2.

mod support;

use flamefleet_api::{HeapSource, ProfileRequest, RunqlatUnit};
use kube::api::{Api, PostParams};
use support::{cli, namespace};

fn created_name(stdout: &str) -> String {
    stdout
        .lines()
        .find_map(|l| l.strip_prefix("profilerequest.flamefleet.dev/"))
        .and_then(|l| l.strip_suffix(" created"))
        .unwrap_or_else(|| panic!("no created line in {stdout:?}"))
        .to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_values_are_refused_locally_in_one_line_with_exit_2() {
    let ns = namespace("cli-flags").await;
    let kc = support::admin_kubeconfig(&ns);
    let api: Api<ProfileRequest> = ns.api();
    let cases: &[(&[&str], &str)] = &[
        (
            &["cpu", "web-0", "--frequency", "5000"],
            "5000 is not in 1..=1000",
        ),
        (
            &["cpu", "web-0", "--frequency", "0"],
            "0 is not in 1..=1000",
        ),
        (
            &["cpu", "web-0", "--duration", "20m"],
            "out of range: it must be at least 1s and at most 600s",
        ),
        (
            &["cpu", "web-0", "--duration", "5 seconds"],
            "expected a number with a unit",
        ),
        (&["cpu", "web-0", "--ttl", "10s"], "at least 60s"),
        (&["cpu", "web-0", "--timeout", "soon"], "is not a duration"),
        (
            &["cpu", "web-0", "--label", "team=not valid"],
            "is not a label value",
        ),
        (&["cpu", "Web_0"], "is not a valid name"),
        (&["runqlat", "-l", "app=-x"], "is not a label value"),
        (
            &["heap", "web-0", "--sample-bytes", "0"],
            "0 is not in 1..=1073741824",
        ),
        (
            &["heap", "web-0", "--source", "magic"],
            "invalid value 'magic'",
        ),
        (&["runqlat", "web-0", "--unit", "ns"], "invalid value 'ns'"),
        // Each type takes only its own options.
        (
            &["heap", "web-0", "--frequency", "10"],
            "unexpected argument '--frequency'",
        ),
        (
            &["cpu", "web-0", "--per-process"],
            "unexpected argument '--per-process'",
        ),
    ];
    for (args, expected) in cases {
        let mut args = args.to_vec();
        args.push("--no-wait");
        let r = cli(&kc, ns.name(), &args).await;
        assert_eq!(r.code, 2, "{args:?}: {r:?}");
        assert!(r.stderr.contains(expected), "{args:?}: {}", r.stderr);
        // One line of error (clap adds a usage line and a help hint after it).
        let first = r.stderr.lines().next().unwrap_or_default();
        assert!(first.starts_with("error: "), "{args:?}: {}", r.stderr);
        assert!(
            !r.stderr.contains("ApiError") && !r.stderr.contains("Status {"),
            "{args:?}: {}",
            r.stderr
        );
    }
    assert!(
        api.list(&Default::default())
            .await
            .unwrap()
            .items
            .is_empty(),
        "a refused command created a request"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_type_lists_its_own_options_and_they_reach_the_request() {
    let ns = namespace("cli-opts").await;
    let kc = support::admin_kubeconfig(&ns);
    let api: Api<ProfileRequest> = ns.api();

    let help = |args: &'static [&'static str]| {
        let kc = kc.clone();
        let ns = ns.name().to_owned();
        async move {
            let r = cli(&kc, &ns, args).await;
            assert_eq!(r.code, 0, "{r:?}");
            r.stdout
        }
    };
    let cpu = help(&["cpu", "--help"]).await;
    assert!(cpu.contains("--frequency <HZ>"), "{cpu}");
    assert!(
        !cpu.contains("--source") && !cpu.contains("--per-process"),
        "{cpu}"
    );
    let heap = help(&["heap", "--help"]).await;
    assert!(
        heap.contains("--source <SOURCE>") && heap.contains("--sample-bytes <BYTES>"),
        "{heap}"
    );
    assert!(
        heap.contains("goruntime") && heap.contains("ebpf"),
        "{heap}"
    );
    assert!(!heap.contains("--frequency"), "{heap}");
    let runqlat = help(&["runqlat", "--help"]).await;
    assert!(
        runqlat.contains("--per-process") && runqlat.contains("--unit <UNIT>"),
        "{runqlat}"
    );
    assert!(!runqlat.contains("--frequency"), "{runqlat}");
    for text in [&cpu, &heap, &runqlat] {
        assert!(
            text.contains("--ttl <TTL>") && text.contains("[default: 24h]"),
            "{text}"
        );
    }

    let r = cli(
        &kc,
        ns.name(),
        &[
            "heap",
            "web-0",
            "--source",
            "goruntime",
            "--sample-bytes",
            "65536",
            "--no-wait",
        ],
    )
    .await;
    assert_eq!(r.code, 0, "{r:?}");
    let name = created_name(&r.stdout);
    // The follow-up commands name the namespace, so they work when copied.
    assert!(
        r.stdout
            .contains(&format!("kubectl get preq {name} -n {} -w", ns.name())),
        "{}",
        r.stdout
    );
    let req = api.get(&name).await.unwrap();
    let heap = req.spec.heap.unwrap();
    assert_eq!(heap.source, HeapSource::Goruntime);
    assert_eq!(heap.sample_bytes, Some(65536));
    // A day by default: the CLI's requests and artifacts do not pile up.
    assert_eq!(req.spec.ttl_seconds_after_finished, Some(86_400));
    // Exported unless asked otherwise (the field stays absent).
    assert_eq!(req.spec.export, None);

    let r = cli(
        &kc,
        ns.name(),
        &[
            "runqlat",
            "web-0",
            "--per-process",
            "--unit",
            "ms",
            "--ttl",
            "never",
            "--no-export",
            "--no-wait",
        ],
    )
    .await;
    assert_eq!(r.code, 0, "{r:?}");
    let req = api.get(&created_name(&r.stdout)).await.unwrap();
    assert_eq!(req.spec.export, Some(false), "--no-export");
    let runqlat = req.spec.runqlat.unwrap();
    assert!(runqlat.per_process);
    assert_eq!(runqlat.unit, RunqlatUnit::Ms);
    assert_eq!(req.spec.ttl_seconds_after_finished, None);

    let r = cli(
        &kc,
        ns.name(),
        &[
            "cpu",
            "web-0",
            "--ttl",
            "2d",
            "--frequency",
            "1000",
            "--no-wait",
        ],
    )
    .await;
    assert_eq!(r.code, 0, "{r:?}");
    let req = api.get(&created_name(&r.stdout)).await.unwrap();
    assert_eq!(req.spec.ttl_seconds_after_finished, Some(2 * 86_400));
    assert_eq!(req.spec.frequency_hz(), 1000);
}

/// What the CLI cannot know, a cluster's own admission policy, still comes back as one line
/// and exit 2: here a policy that refuses requests kept longer than an hour.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_api_server_refusal_is_one_line_and_exit_2() {
    let ns = namespace("cli-422").await;
    let kc = support::admin_kubeconfig(&ns);
    let client = ns.client();
    let policy_name = ns.unique("ttl-limit");
    let policy: k8s_openapi::api::admissionregistration::v1::ValidatingAdmissionPolicy =
        serde_json::from_value(serde_json::json!({
            "metadata": {"name": policy_name},
            "spec": {
                "failurePolicy": "Fail",
                "matchConstraints": {"resourceRules": [{
                    "apiGroups": ["flamefleet.dev"], "apiVersions": ["*"],
                    "operations": ["CREATE"], "resources": ["profilerequests"]
                }]},
                "validations": [{
                    "expression": "has(object.spec.ttlSecondsAfterFinished) && object.spec.ttlSecondsAfterFinished <= 3600",
                    "message": "this cluster keeps profile requests at most an hour: use --ttl 1h or less",
                    "reason": "Invalid"
                }]
            }
        }))
        .unwrap();
    let binding: k8s_openapi::api::admissionregistration::v1::ValidatingAdmissionPolicyBinding =
        serde_json::from_value(serde_json::json!({
            "metadata": {"name": policy_name},
            "spec": {
                "policyName": policy_name,
                "validationActions": ["Deny"],
                "matchResources": {"namespaceSelector": {"matchLabels": {
                    "kubernetes.io/metadata.name": ns.name()
                }}}
            }
        }))
        .unwrap();
    let pp = PostParams::default();
    Api::all(client.clone()).create(&pp, &policy).await.unwrap();
    Api::all(client.clone())
        .create(&pp, &binding)
        .await
        .unwrap();
    // The policy takes effect once the API server has loaded it: a request it refuses.
    let api: Api<ProfileRequest> = ns.api();
    let probe: ProfileRequest = serde_json::from_value(serde_json::json!({
        "apiVersion": "flamefleet.dev/v1alpha1", "kind": "ProfileRequest",
        "metadata": {"generateName": "probe-"},
        "spec": {"type": "cpu", "podNames": ["web-0"], "duration": "1s"}
    }))
    .unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    loop {
        match api.create(&pp, &probe).await {
            Err(kube::Error::Api(s)) if s.code == 422 => break,
            Ok(created) => {
                let _ = api
                    .delete(&created.metadata.name.unwrap(), &Default::default())
                    .await;
            }
            Err(e) => panic!("{e}"),
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the admission policy never took effect"
        );
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    }

    let r = cli(&kc, ns.name(), &["cpu", "web-0", "--no-wait"]).await;
    assert_eq!(r.code, 2, "{r:?}");
    assert_eq!(r.stderr.lines().count(), 1, "{}", r.stderr);
    assert!(
        r.stderr
            .starts_with("error: the API server refused the profilerequest: ")
            && r.stderr
                .contains("this cluster keeps profile requests at most an hour"),
        "{}",
        r.stderr
    );
    assert!(!r.stderr.contains("ApiError"), "{}", r.stderr);
    let r = cli(
        &kc,
        ns.name(),
        &["cpu", "web-0", "--ttl", "1h", "--no-wait"],
    )
    .await;
    assert_eq!(r.code, 0, "{r:?}");
    let _ =
        Api::<k8s_openapi::api::admissionregistration::v1::ValidatingAdmissionPolicyBinding>::all(
            client.clone(),
        )
        .delete(&policy_name, &Default::default())
        .await;
    let _ =
        Api::<k8s_openapi::api::admissionregistration::v1::ValidatingAdmissionPolicy>::all(client)
            .delete(&policy_name, &Default::default())
            .await;
}
