//! The bounded HTTP server against clients that hold connections: one that sends half a
//! request and stops (slowloris), one that keeps an idle connection, more clients than
//! places. Real sockets on 127.0.0.1.

use std::time::{Duration, Instant};

use axum::Router;
use axum::routing::get;
use flamefleet_proto::http_serve::{ServeLimits, serve};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::TcpStream;

const LIMITS: ServeLimits = ServeLimits {
    max_connections: 2,
    header_read_timeout: Duration::from_secs(1),
    max_connection_age: Duration::from_secs(4),
};

/// Starts the server; the receiver gets one message each time a `/slow` request is being
/// served (it holds a place from then on).
async fn start() -> (
    std::net::SocketAddr,
    tokio::sync::mpsc::UnboundedReceiver<()>,
) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (entered, entries) = tokio::sync::mpsc::unbounded_channel();
    let router = Router::new().route("/ok", get(|| async { "ok" })).route(
        "/slow",
        get(move || {
            let entered = entered.clone();
            async move {
                let _ = entered.send(());
                tokio::time::sleep(Duration::from_secs(30)).await;
                "late"
            }
        }),
    );
    tokio::spawn(serve(listener, router, LIMITS));
    (addr, entries)
}

/// Reads until the server closes the connection; how long that took (None: still open
/// after `within`).
async fn closed_within(stream: &mut TcpStream, within: Duration) -> Option<Duration> {
    let started = Instant::now();
    let mut buf = [0u8; 1024];
    loop {
        match tokio::time::timeout(
            within.saturating_sub(started.elapsed()),
            stream.read(&mut buf),
        )
        .await
        {
            Ok(Ok(0) | Err(_)) => return Some(started.elapsed()),
            Ok(Ok(_)) => {}
            Err(_) => return None,
        }
    }
}

async fn get_ok(addr: std::net::SocketAddr) -> String {
    let mut s = TcpStream::connect(addr).await.unwrap();
    s.write_all(b"GET /ok HTTP/1.1\r\nhost: t\r\nconnection: close\r\n\r\n")
        .await
        .unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).await.unwrap();
    out
}

#[tokio::test]
async fn half_a_request_is_cut_off_at_the_header_deadline() {
    let (addr, _) = start().await;
    let mut slow = TcpStream::connect(addr).await.unwrap();
    slow.write_all(b"GET /ok HTTP/1.1\r\nhost: t\r\n")
        .await
        .unwrap();
    let closed = closed_within(&mut slow, Duration::from_secs(10)).await;
    assert!(
        closed.is_some_and(|t| t < Duration::from_secs(3)),
        "a half-sent request held its connection for {closed:?}"
    );
    // A kept-alive connection whose next request never comes goes the same way.
    let mut idle = TcpStream::connect(addr).await.unwrap();
    idle.write_all(b"GET /ok HTTP/1.1\r\nhost: t\r\n\r\n")
        .await
        .unwrap();
    let closed = closed_within(&mut idle, Duration::from_secs(10)).await;
    assert!(
        closed.is_some_and(|t| t < Duration::from_secs(3)),
        "an idle kept-alive connection stayed {closed:?}"
    );
}

#[tokio::test]
async fn connections_are_counted_and_aged() {
    let (addr, mut entries) = start().await;
    // Two requests that would take 30 s take both places...
    let mut held = Vec::new();
    for _ in 0..LIMITS.max_connections {
        let mut s = TcpStream::connect(addr).await.unwrap();
        s.write_all(b"GET /slow HTTP/1.1\r\nhost: t\r\n\r\n")
            .await
            .unwrap();
        held.push(s);
    }
    // Both are being served before the third client comes.
    for _ in 0..LIMITS.max_connections {
        tokio::time::timeout(Duration::from_secs(10), entries.recv())
            .await
            .expect("a held request reached its handler")
            .expect("the server is running");
    }
    // ...so a third client waits: its answer comes only once the held ones reach their
    // maximum age (4 s), not after their 30 s.
    let started = Instant::now();
    let answer = tokio::time::timeout(Duration::from_secs(15), get_ok(addr))
        .await
        .expect("the third client was served once a place freed");
    assert!(answer.contains("200 OK"), "{answer}");
    let waited = started.elapsed();
    assert!(
        waited >= Duration::from_secs(2) && waited < Duration::from_secs(12),
        "the third client waited {waited:?}"
    );
    for mut s in held {
        let closed = closed_within(&mut s, Duration::from_secs(10)).await;
        assert!(closed.is_some(), "a connection outlived its maximum age");
    }
}
