//! Run-queue latency drawn as latency by the CLI, and the pictures read back element by
//! element: a request's histogram SVG (a bar per log2 bucket, p50/p90/p99 marked) and a
//! sampling policy's heat map over its runs (time × bucket, colour = waits).

mod support;

use std::collections::BTreeMap;

use flamefleet_api::{NodePhase, ProfileRequest, RequestPhase, SamplingPolicy};
use flamefleet_proto::agent::LatencyHistogram;
use kube::api::{Api, Patch, PatchParams, PostParams};
use support::{
    Store, cli, create_request_as, create_typed_request, files, namespace, node, runqlat_pprof,
    write_status,
};

fn svg_doc(text: &str) -> roxmltree::Document<'_> {
    roxmltree::Document::parse(text).expect("the picture is valid XML")
}

fn elements<'a>(doc: &'a roxmltree::Document<'a>, class: &str) -> Vec<roxmltree::Node<'a, 'a>> {
    doc.descendants()
        .filter(|n| n.attribute("class") == Some(class))
        .collect()
}

fn num<T: std::str::FromStr>(n: &roxmltree::Node<'_, '_>, attr: &str) -> T {
    n.attribute(attr)
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no numeric {attr} on {n:?}"))
}

fn histogram_of(buckets: &[(usize, i64)]) -> LatencyHistogram {
    let mut h = LatencyHistogram {
        unit_ns: 1000,
        buckets: vec![0; 20],
    };
    for &(i, n) in buckets {
        h.buckets[i] += n as u64;
    }
    h
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_runqlat_request_renders_as_a_histogram_with_its_percentiles() {
    let ns = namespace("cli-rqsvg").await;
    let kc = support::admin_kubeconfig(&ns);
    let store = Store::start_for(&ns).await;
    let req = create_typed_request(&ns, "rq", "runqlat", serde_json::json!({})).await;
    // The shape of the seed's sample output: most waits of a few microseconds, a tail to
    // about 2 ms.
    let buckets = [
        (0, 233),
        (1, 742),
        (2, 203),
        (3, 173),
        (4, 24),
        (6, 30),
        (7, 6),
        (8, 3),
        (9, 5),
        (10, 27),
    ];
    let a = store
        .upload(&req, "runqlat-node-a.pb.gz", &runqlat_pprof(&buckets))
        .await;
    write_status(
        &ns,
        "rq",
        RequestPhase::Succeeded,
        vec![node("node-a", NodePhase::Succeeded, None, vec![a])],
    )
    .await;
    let out = tempfile::tempdir().unwrap();
    let dir = out.path().to_str().unwrap();
    let r = cli(&kc, ns.name(), &["get", "rq", "-o", dir, "--format", "svg"]).await;
    assert_eq!(r.code, 0, "{r:?}");
    assert_eq!(files(out.path()), ["rq-node-a.pb.gz", "rq-node-a.svg"]);
    let text = std::fs::read_to_string(out.path().join("rq-node-a.svg")).unwrap();
    let doc = svg_doc(&text);
    // A bar per non-empty bucket, in latency order, with its waits.
    let bars: Vec<(u64, u64, u64, f64, f64, f64)> = elements(&doc, "bar")
        .iter()
        .map(|b| {
            (
                num(b, "data-low-ns"),
                num(b, "data-high-ns"),
                num(b, "data-count"),
                num(b, "x"),
                num(b, "height"),
                num(b, "width"),
            )
        })
        .collect();
    let expected: Vec<(u64, u64, u64)> = buckets
        .iter()
        .map(|&(i, n)| {
            let (lo, hi) = flamefleet_proto::latency::bucket_bounds(i);
            (lo * 1000, hi * 1000, n as u64)
        })
        .collect();
    assert_eq!(
        bars.iter().map(|b| (b.0, b.1, b.2)).collect::<Vec<_>>(),
        expected
    );
    assert!(
        bars.windows(2).all(|w| w[0].3 < w[1].3),
        "bars left to right"
    );
    // Heights follow the counts: the 742-wait bucket is the tallest, 3 waits the shortest.
    let tallest = bars.iter().max_by(|a, b| a.4.total_cmp(&b.4)).unwrap();
    assert_eq!(tallest.2, 742);
    let shortest = bars.iter().min_by(|a, b| a.4.total_cmp(&b.4)).unwrap();
    assert_eq!(shortest.2, 3);
    // p50, p90 and p99, where the histogram's own quantiles put them.
    let h = histogram_of(&buckets);
    let marks: Vec<(f64, f64, f64)> = elements(&doc, "percentile")
        .iter()
        .map(|m| {
            (
                num(m, "data-quantile"),
                num(m, "data-value-us"),
                num(m, "x1"),
            )
        })
        .collect();
    assert_eq!(
        marks.iter().map(|m| m.0).collect::<Vec<_>>(),
        [0.5, 0.9, 0.99]
    );
    for (q, us, x) in &marks {
        let want = h.quantile_us(*q).unwrap();
        assert!((us - want).abs() < 0.01, "p{q}: {us} against {want}");
        // The mark lies over the bar of its bucket.
        let (i, _) = (0..20)
            .map(|i| (i, flamefleet_proto::latency::bucket_bounds(i)))
            .find(|(_, (lo, hi))| (*lo as f64..*hi as f64).contains(us))
            .unwrap();
        let (lo, _) = flamefleet_proto::latency::bucket_bounds(i);
        let bar = bars.iter().find(|b| b.0 == lo * 1000).unwrap();
        // Bars fill 90% of their band, centred.
        let band = bar.5 / 0.9;
        let band_x = bar.3 - 0.05 * band;
        assert!(
            (band_x - 0.1..=band_x + band + 0.1).contains(x),
            "p{q} at x={x}, its bucket's band at {band_x}..{}",
            band_x + band
        );
    }
    let labels: Vec<&str> = elements(&doc, "percentile-label")
        .iter()
        .filter_map(|n| n.text())
        .collect();
    assert!(labels[2].starts_with("p99 "), "{labels:?}");

    // --format text: the percentiles and the histogram, in words.
    let r = cli(
        &kc,
        ns.name(),
        &["get", "rq", "-o", dir, "--format", "text"],
    )
    .await;
    assert_eq!(r.code, 0, "{r:?}");
    assert!(
        r.stdout.contains("1446 waits; p50 ") && r.stdout.contains("none longer than 2.0ms"),
        "{}",
        r.stdout
    );
}

/// Creates a runqlat request through `api` (whoever's client it is) with `metadata`, and
/// finishes it as the operator would after capturing `buckets` of waits on one node.
async fn captured(
    ns: &flamefleet_e2e::TestNamespace,
    store: &Store,
    api: &Api<ProfileRequest>,
    metadata: serde_json::Value,
    buckets: &[(usize, i64)],
) {
    let req = create_request_as(api, metadata, "runqlat").await;
    let name = req.metadata.name.clone().unwrap();
    let a = store
        .upload(&req, "runqlat-node-a.pb.gz", &runqlat_pprof(buckets))
        .await;
    write_status(
        ns,
        &name,
        RequestPhase::Succeeded,
        vec![node("node-a", NodePhase::Succeeded, None, vec![a])],
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_runqlat_policy_renders_as_a_latency_heat_map_over_its_runs() {
    let ns = namespace("cli-heat").await;
    let kc = support::admin_kubeconfig(&ns);
    let store = Store::start_for(&ns).await;
    let policies: Api<SamplingPolicy> = ns.api();
    let policy: SamplingPolicy = serde_json::from_value(serde_json::json!({
        "apiVersion": "flamefleet.dev/v1alpha1", "kind": "SamplingPolicy",
        "metadata": {"name": "rq-fleet"},
        "spec": {
            "schedule": "*/1 * * * *",
            "suspend": true,
            "startingDeadlineSeconds": 3600,
            "template": {"type": "runqlat", "selector": {"matchLabels": {"app": "web"}}, "duration": "5s"}
        }
    }))
    .unwrap();
    let policy = policies
        .create(&PostParams::default(), &policy)
        .await
        .unwrap();
    let uid = policy.metadata.uid.unwrap();
    // Three runs a minute apart whose waits get longer: the load grew.
    let now = k8s_openapi::jiff::Timestamp::now().as_second();
    let start = now - now % 60 - 600;
    let runs: [(i64, Vec<(usize, i64)>); 3] = [
        (start, vec![(1, 500), (2, 100)]),
        (start + 60, vec![(2, 300), (4, 200), (6, 20)]),
        (start + 120, vec![(5, 100), (8, 200), (11, 40)]),
    ];
    // The operator's status: the last scheduled time it handled.
    let last = k8s_openapi::jiff::Timestamp::from_second(start + 120).unwrap();
    policies
        .patch_status(
            "rq-fleet",
            &PatchParams::default(),
            &Patch::Merge(serde_json::json!({"status": {"lastScheduleTime": last.to_string()}})),
        )
        .await
        .unwrap();
    let run_metadata = |name: &str, t: i64, owned: bool| {
        let mut metadata = serde_json::json!({
            "name": name,
            "labels": {
                "flamefleet.dev/policy": "rq-fleet",
                "flamefleet.dev/policy-uid": uid,
                "flamefleet.dev/scheduled-time": t.to_string(),
            },
        });
        if owned {
            metadata["ownerReferences"] = serde_json::json!([{
                "apiVersion": "flamefleet.dev/v1alpha1", "kind": "SamplingPolicy",
                "name": "rq-fleet", "uid": uid, "controller": true,
            }]);
        }
        metadata
    };
    let mut expected = BTreeMap::new();
    for (t, buckets) in &runs {
        let name = format!("rq-fleet-{t}");
        captured(
            &ns,
            &store,
            &ns.api(),
            run_metadata(&name, *t, true),
            buckets,
        )
        .await;
        for &(i, n) in buckets {
            let lo = flamefleet_proto::latency::bucket_bounds(i).0 * 1000;
            expected.insert((*t, lo), n as u64);
        }
    }
    // A tenant with `edit` in the namespace forges runs of the policy, with waits far
    // longer than any genuine run's, and they are captured like any request of hers: one
    // carrying only the UID label, one with the policy's controller ownerReference and name
    // at a time the policy never reached, one with the ownerReference at a time it ran but
    // not under the policy's name for it.
    let mallory: Api<ProfileRequest> = Api::namespaced(
        ns.tenant_client(&ns.unique("mallory")).await.unwrap(),
        ns.name(),
    );
    let forged = [
        run_metadata("mallory-1", start + 60, false),
        run_metadata(&format!("rq-fleet-{now}"), now, true),
        run_metadata("rq-fleet-copy", start + 60, true),
    ];
    for metadata in forged {
        captured(&ns, &store, &mallory, metadata, &[(15, 9_999)]).await;
    }
    let out = tempfile::tempdir().unwrap();
    let dir = out.path().to_str().unwrap();
    let r = cli(
        &kc,
        ns.name(),
        &[
            "get",
            "sp/rq-fleet",
            "--since",
            "1d",
            "-o",
            dir,
            "--format",
            "svg",
        ],
    )
    .await;
    assert_eq!(r.code, 0, "{r:?}");
    assert!(
        r.stdout.contains("runqlat: merged 3 profiles (1460 waits)"),
        "{}",
        r.stdout
    );
    assert!(
        r.stdout.contains("ignored 3 ProfileRequests"),
        "{}",
        r.stdout
    );
    assert_eq!(
        files(out.path()),
        [
            "rq-fleet-runqlat-heatmap.svg",
            "rq-fleet-runqlat.pb.gz",
            "rq-fleet-runqlat.svg"
        ]
    );
    let text = std::fs::read_to_string(out.path().join("rq-fleet-runqlat-heatmap.svg")).unwrap();
    let doc = svg_doc(&text);
    let cells = elements(&doc, "cell");
    let found: BTreeMap<(i64, u64), u64> = cells
        .iter()
        .map(|c| {
            (
                (num(c, "data-time"), num(c, "data-low-ns")),
                num(c, "data-count"),
            )
        })
        .collect();
    assert_eq!(found, expected, "a cell per run and bucket, with its waits");
    // Time runs left to right, latency bottom to top.
    let x_of = |t: i64| {
        cells
            .iter()
            .find(|c| num::<i64>(c, "data-time") == t)
            .map(|c| num::<f64>(c, "x"))
            .unwrap()
    };
    assert!(x_of(start) < x_of(start + 60) && x_of(start + 60) < x_of(start + 120));
    let y_of = |t: i64, lo: u64| {
        cells
            .iter()
            .find(|c| num::<i64>(c, "data-time") == t && num::<u64>(c, "data-low-ns") == lo)
            .map(|c| num::<f64>(c, "y"))
            .unwrap()
    };
    assert!(y_of(start + 120, 2_048_000) < y_of(start + 120, 32_000));
    // The busiest cell is the darkest.
    let fill = |t: i64, lo: u64| {
        cells
            .iter()
            .find(|c| num::<i64>(c, "data-time") == t && num::<u64>(c, "data-low-ns") == lo)
            .and_then(|c| c.attribute("fill"))
            .unwrap()
            .to_owned()
    };
    let darkness = |hex: String| {
        let v = u32::from_str_radix(hex.trim_start_matches('#'), 16).unwrap();
        765 - ((v >> 16) + ((v >> 8) & 0xff) + (v & 0xff))
    };
    assert!(darkness(fill(start, 2_000)) > darkness(fill(start + 120, 2_048_000)));
    // Each run's p99 climbs as its waits get longer (SVG y grows downwards).
    let p99 = elements(&doc, "percentile")
        .into_iter()
        .find(|p| p.attribute("data-quantile") == Some("0.99"))
        .unwrap();
    let ys: Vec<f64> = p99
        .attribute("points")
        .unwrap()
        .split_whitespace()
        .map(|p| p.split(',').nth(1).unwrap().parse().unwrap())
        .collect();
    assert_eq!(ys.len(), 3);
    assert!(ys[0] > ys[1] && ys[1] > ys[2], "{ys:?}");
    // And the whole window as one histogram.
    let all = std::fs::read_to_string(out.path().join("rq-fleet-runqlat.svg")).unwrap();
    let doc = svg_doc(&all);
    let total: u64 = elements(&doc, "bar")
        .iter()
        .map(|b| num::<u64>(b, "data-count"))
        .sum();
    assert_eq!(total, 1460);
    // The list of runs leaves the forgeries out too.
    let r = cli(&kc, ns.name(), &["list", "sp/rq-fleet"]).await;
    assert_eq!(r.code, 0, "{r:?}");
    assert!(
        r.stdout.contains("ignored 3 ProfileRequests"),
        "{}",
        r.stdout
    );
    assert_eq!(r.stdout.matches("rq-fleet-").count(), 3, "{}", r.stdout);
    assert!(!r.stdout.contains("mallory-1"), "{}", r.stdout);
}
