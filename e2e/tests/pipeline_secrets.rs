//! End to end, with the real agent and operator: a signed upload URL is a credential until it
//! expires, so when an upload fails its signature (`sig=`) never reaches the agent's log,
//! the node's message in the result slice, the request's status, its Events or the
//! operator's log. Two ways a store makes an upload fail, both through a fake store that
//! every agent is sent to:
//! - it closes the connection unanswered (the HTTP client's error names the URL it was
//!   sending to);
//! - it refuses the upload with a body that echoes the whole request line, as some
//!   S3-compatible servers echo the signature they refused.

mod pipeline_support;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use flamefleet_api::{NodePhase, ProfileRequest, RequestPhase};
use flamefleet_e2e::TestNamespace;
use k8s_openapi::api::core::v1::Event;
use kube::api::{Api, ListParams};
use pipeline_support::{Pipeline, PipelineOptions, node_results, serial};
use serde_json::json;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

const TIMEOUT: Duration = Duration::from_secs(90);

/// A store that fails every upload: it closes the connection after reading the request
/// head, or (with `echo` set) reads the whole request and answers 403 with the request head
/// in its body. (Answering before the body is read would make the client's send fail with a
/// reset instead of reading the 403, depending on timing.)
async fn hostile_store(echo: Arc<AtomicBool>) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((mut sock, _)) = listener.accept().await {
            let echo = echo.clone();
            tokio::spawn(async move {
                let echoing = echo.load(Ordering::SeqCst);
                let request = read_request(&mut sock, echoing).await;
                if echoing {
                    let head = request.split("\r\n\r\n").next().unwrap_or_default();
                    let body = format!(
                        "<Error><Code>SignatureDoesNotMatch</Code><Request>{head}</Request></Error>"
                    );
                    let answer = format!(
                        "HTTP/1.1 403 Forbidden\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                        body.len()
                    );
                    let _ = sock.write_all(answer.as_bytes()).await;
                }
                // Without an answer, the client sees the connection closed mid-request.
                drop(sock);
            });
        }
    });
    format!("http://{addr}/")
}

/// Reads a request's head and, with `whole`, its body as far as its content-length says
/// (at most 4 MiB, 5 s per read); the text read so far.
async fn read_request(sock: &mut tokio::net::TcpStream, whole: bool) -> String {
    let mut data = Vec::new();
    let mut chunk = vec![0u8; 64 * 1024];
    loop {
        let n = match tokio::time::timeout(Duration::from_secs(5), sock.read(&mut chunk)).await {
            Ok(Ok(n)) if n > 0 => n,
            _ => break,
        };
        data.extend_from_slice(&chunk[..n]);
        let text = String::from_utf8_lossy(&data);
        let Some(head_end) = text.find("\r\n\r\n") else {
            if data.len() > 4 << 20 {
                break;
            }
            continue;
        };
        if !whole {
            break;
        }
        let length = text[..head_end]
            .lines()
            .find_map(|l| {
                let (k, v) = l.split_once(':')?;
                k.eq_ignore_ascii_case("content-length")
                    .then(|| v.trim().parse::<usize>().ok())
                    .flatten()
            })
            .unwrap_or(0);
        if data.len() >= head_end + 4 + length || data.len() > 4 << 20 {
            break;
        }
    }
    String::from_utf8_lossy(&data).into_owned()
}

/// Every place a user or an operator reads, with where it came from.
async fn everything_readable(
    pipeline: &Pipeline,
    ns: &TestNamespace,
    done: &ProfileRequest,
) -> Vec<(String, String)> {
    let mut places = vec![
        ("operator log".to_string(), pipeline.operator_logs()),
        (
            "agent logs".to_string(),
            pipeline
                .agents
                .iter()
                .map(|a| a.log_text())
                .collect::<Vec<_>>()
                .join("\n"),
        ),
        (
            "request status".to_string(),
            serde_json::to_string(&done.status).unwrap(),
        ),
    ];
    for (node, entry) in node_results(&pipeline.client, done).await {
        places.push((
            format!("slice entry of {node}"),
            serde_json::to_string(&entry).unwrap(),
        ));
    }
    let events: Api<Event> = ns.api();
    for event in events.list(&ListParams::default()).await.unwrap() {
        places.push((
            "event".to_string(),
            event.message.clone().unwrap_or_default(),
        ));
    }
    places
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failed_uploads_never_leak_the_signed_url() {
    let _serial = serial().await;
    let echo = Arc::new(AtomicBool::new(false));
    let store_url = hostile_store(echo.clone()).await;
    let mut pipeline = Pipeline::start(PipelineOptions {
        nodes: 1,
        store_url: Some(store_url),
        ..Default::default()
    })
    .await;
    let ns = TestNamespace::create("ff-url-leak").await.unwrap();
    pipeline
        .pod(&ns, "web-1", 0, &[("app", "web")], "spin", 1)
        .await;
    for (name, echoing, symptom) in [
        ("reset", false, "failed after"),
        ("echoed", true, "HTTP 403"),
    ] {
        echo.store(echoing, Ordering::SeqCst);
        let request = pipeline.request(
            name,
            json!({"type": "cpu", "selector": {"matchLabels": {"app": "web"}}, "duration": "1s"}),
        );
        let (done, _) = pipeline.run(&ns, &request, TIMEOUT).await;
        let status = done.status.clone().unwrap();
        assert_eq!(status.phase, Some(RequestPhase::Failed), "{status:#?}");
        let nodes = node_results(&pipeline.client, &done).await;
        let entry = &nodes[&pipeline.nodes[0]];
        assert_eq!(entry.phase, Some(NodePhase::Failed), "{entry:?}");
        let message = entry.message.clone().unwrap_or_default();
        // The failure is still explained: which artifact, and what the store did.
        assert!(message.contains("upload of cpu-"), "{message}");
        assert!(message.contains(symptom), "{message}");
        for (place, text) in everything_readable(&pipeline, &ns, &done).await {
            assert!(
                !text.contains("sig="),
                "a signed upload URL leaked into the {place} ({name}): {}",
                text.lines()
                    .filter(|l| l.contains("sig="))
                    .take(3)
                    .collect::<Vec<_>>()
                    .join("\n")
            );
        }
    }
}
