//! Heap profiles pulled from a pod's own pprof HTTP endpoint (Go's
//! `/debug/pprof/heap`, a Rust service's jemalloc `/profile/heap`), with the
//! limits that keep a slow, huge or garbage endpoint from hurting the agent.
//!
//! Only plain HTTP/1.1 is spoken: pprof endpoints listen on the pod network
//! or on loopback inside the pod, and a tiny hyper client lets us connect from
//! inside a process's network namespace (`--pid`) and bound every step.

use std::collections::BTreeMap;
use std::fmt;
use std::net::SocketAddr;
use std::os::fd::AsFd;
use std::time::Duration;

use flamefleet_pprof::DecodeLimits;
use flamefleet_proto::pprof::Profile;
use http_body_util::BodyExt;
use hyper::body::Bytes;
use hyper_util::rt::TokioIo;

/// Pod annotation naming the port of the pod's pprof HTTP server.
pub const ANNOTATION_PORT: &str = "flamefleet.dev/pprof-port";
/// Pod annotation naming the heap profile path (and query) on that server.
pub const ANNOTATION_PATH: &str = "flamefleet.dev/heap-path";
/// Port used when the pod names a path but no port (Go's customary pprof port).
pub const DEFAULT_PORT: u16 = 6060;
/// Path used when the pod names a port but no path (Go's `net/http/pprof`).
pub const DEFAULT_PATH: &str = "/debug/pprof/heap";

/// Why fetching a heap profile from an endpoint failed.
#[derive(Debug, thiserror::Error)]
pub enum EndpointError {
    /// The endpoint URL or an annotation is malformed.
    #[error("invalid heap endpoint: {0}")]
    Invalid(String),
    /// Nothing accepted the connection in time.
    #[error("cannot connect to {endpoint}: {reason}; check that the pod serves pprof on that port")]
    Connect {
        /// The endpoint tried.
        endpoint: String,
        /// The underlying cause.
        reason: String,
    },
    /// The server did not answer with `200 OK`.
    #[error(
        "{endpoint} answered HTTP {status}, expected 200 with a pprof heap profile; check the path \
         (annotation {ANNOTATION_PATH}); body starts with: {body:?}"
    )]
    Status {
        /// The endpoint tried.
        endpoint: String,
        /// The status code received.
        status: u16,
        /// The start of the body, for the message.
        body: String,
    },
    /// The response went over the size cap.
    #[error(
        "{endpoint} sent more than {limit} bytes (the response cap); a heap profile is far \
         smaller, so this is not a pprof endpoint or it is misbehaving"
    )]
    TooLarge {
        /// The endpoint tried.
        endpoint: String,
        /// The cap in bytes.
        limit: u64,
    },
    /// The body decompressed to more than the cap (a zip bomb, or not a profile).
    #[error(
        "the profile from {endpoint} decompresses to more than {limit} bytes; refusing it as a \
         likely zip bomb"
    )]
    TooLargeDecompressed {
        /// The endpoint tried.
        endpoint: String,
        /// The cap in bytes.
        limit: u64,
    },
    /// Decoding the profile would keep more memory than the cap (a profile built to expand
    /// in memory, or one far larger than real heap profiles).
    #[error(
        "the profile from {endpoint} would keep at least {needed} bytes in memory once decoded, \
         more than the cap of {limit} bytes; refusing it before decoding it (a real heap \
         profile decodes into a few MiB)"
    )]
    TooLargeDecoded {
        /// The endpoint tried.
        endpoint: String,
        /// Bytes decoding would keep (at least).
        needed: u64,
        /// The cap in bytes.
        limit: u64,
    },
    /// A deadline passed (no byte for `idle`, or the whole exchange took too long).
    #[error("{endpoint} timed out: {what} (limit {limit:?}); the endpoint is too slow or stuck")]
    Timeout {
        /// The endpoint tried.
        endpoint: String,
        /// Which deadline passed.
        what: &'static str,
        /// The deadline.
        limit: Duration,
    },
    /// The HTTP exchange failed.
    #[error("HTTP exchange with {endpoint} failed: {reason}")]
    Http {
        /// The endpoint tried.
        endpoint: String,
        /// The underlying cause.
        reason: String,
    },
    /// The body is not a pprof profile.
    #[error(
        "{endpoint} did not return a pprof profile (expected a gzipped or plain protobuf \
         perftools.profiles.Profile): {reason}; body starts with {preview:?}"
    )]
    NotPprof {
        /// The endpoint tried.
        endpoint: String,
        /// What was wrong.
        reason: String,
        /// The first bytes of the body, for the message.
        preview: String,
    },
}

/// Where a heap endpoint came from, so the result can say why it was used.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EndpointOrigin {
    /// Given explicitly (the request's `heap.endpoint`, or `--endpoint`/`--port`).
    Explicit,
    /// Declared by the pod's annotations.
    Annotations,
    /// Nothing declared: the defaults (`:6060/debug/pprof/heap`).
    Defaults,
}

impl EndpointOrigin {
    /// Whether the pod (or the user) declared the endpoint, which is what `auto` needs.
    pub fn is_declared(self) -> bool {
        !matches!(self, EndpointOrigin::Defaults)
    }
}

/// An HTTP pprof endpoint: host, port, path (with query) and, for a process
/// without a reachable address, the process whose network namespace to dial from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HeapEndpoint {
    /// Host name or IP address.
    pub host: String,
    /// TCP port.
    pub port: u16,
    /// Path and query, starting with `/`.
    pub path: String,
    /// Dial from inside this process's network namespace (`/proc/<pid>/ns/net`).
    pub netns_pid: Option<u32>,
}

impl fmt::Display for HeapEndpoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let host = if self.host.contains(':') {
            format!("[{}]", self.host)
        } else {
            self.host.clone()
        };
        write!(f, "http://{host}:{}{}", self.port, self.path)?;
        if let Some(pid) = self.netns_pid {
            write!(f, " (network namespace of pid {pid})")?;
        }
        Ok(())
    }
}

impl HeapEndpoint {
    /// Parses `http://host[:port]/path?query`; the port defaults to 80.
    pub fn parse_url(url: &str) -> Result<Self, EndpointError> {
        let uri: hyper::Uri = url.parse().map_err(|e| {
            EndpointError::Invalid(format!("expected an http:// URL, found {url:?} ({e})"))
        })?;
        match uri.scheme_str() {
            Some("http") => {}
            Some(other) => {
                return Err(EndpointError::Invalid(format!(
                    "expected an http:// URL, found scheme {other:?} in {url:?}; pprof endpoints \
                     are scraped over plain HTTP inside the pod network"
                )));
            }
            None => {
                return Err(EndpointError::Invalid(format!(
                    "expected an absolute http:// URL, found {url:?}"
                )));
            }
        }
        let host = uri
            .host()
            .filter(|h| !h.is_empty())
            .ok_or_else(|| EndpointError::Invalid(format!("no host in {url:?}")))?;
        let host = host
            .trim_start_matches('[')
            .trim_end_matches(']')
            .to_string();
        let path = uri
            .path_and_query()
            .map(|p| p.as_str().to_string())
            .filter(|p| !p.is_empty())
            .unwrap_or_else(|| "/".to_string());
        Ok(HeapEndpoint {
            host,
            port: uri.port_u16().unwrap_or(80),
            path,
            netns_pid: None,
        })
    }

    /// The same endpoint asking Go's delta form: allocations over `seconds` (`?seconds=N`).
    pub fn with_delta_seconds(mut self, seconds: u64) -> Self {
        if seconds == 0 || self.path.contains("seconds=") {
            return self;
        }
        let sep = if self.path.contains('?') { '&' } else { '?' };
        self.path = format!("{}{sep}seconds={seconds}", self.path);
        self
    }
}

/// A heap endpoint and why it was chosen.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResolvedEndpoint {
    /// The endpoint to fetch.
    pub endpoint: HeapEndpoint,
    /// Where it came from.
    pub origin: EndpointOrigin,
}

/// Decides where a pod's heap profile is served: the explicit URL if any, else
/// the pod's annotations ([`ANNOTATION_PORT`], [`ANNOTATION_PATH`]) on `pod_host`,
/// else the defaults on `pod_host`. Pure, so the operator can call it too.
pub fn resolve_endpoint(
    explicit: Option<&str>,
    annotations: &BTreeMap<String, String>,
    pod_host: &str,
) -> Result<ResolvedEndpoint, EndpointError> {
    if let Some(url) = explicit.map(str::trim).filter(|u| !u.is_empty()) {
        return Ok(ResolvedEndpoint {
            endpoint: HeapEndpoint::parse_url(url)?,
            origin: EndpointOrigin::Explicit,
        });
    }
    let port = annotations
        .get(ANNOTATION_PORT)
        .map(|raw| parse_port(raw.trim(), ANNOTATION_PORT))
        .transpose()?;
    let path = annotations
        .get(ANNOTATION_PATH)
        .map(|raw| parse_path(raw.trim(), ANNOTATION_PATH))
        .transpose()?;
    let origin = if port.is_some() || path.is_some() {
        EndpointOrigin::Annotations
    } else {
        EndpointOrigin::Defaults
    };
    if pod_host.is_empty() {
        return Err(EndpointError::Invalid(
            "the pod has no IP address yet; wait until it is running".into(),
        ));
    }
    Ok(ResolvedEndpoint {
        endpoint: HeapEndpoint {
            host: pod_host.to_string(),
            port: port.unwrap_or(DEFAULT_PORT),
            path: path.unwrap_or_else(|| DEFAULT_PATH.to_string()),
            netns_pid: None,
        },
        origin,
    })
}

/// Parses a TCP port (1-65535) named by `what`.
pub fn parse_port(raw: &str, what: &str) -> Result<u16, EndpointError> {
    match raw.parse::<u16>() {
        Ok(p) if p > 0 => Ok(p),
        _ => Err(EndpointError::Invalid(format!(
            "{what}: expected a TCP port 1-65535, found {raw:?}"
        ))),
    }
}

/// Checks an HTTP path (with optional query) named by `what`.
pub fn parse_path(raw: &str, what: &str) -> Result<String, EndpointError> {
    if !raw.starts_with('/') || raw.chars().any(|c| c.is_whitespace() || c.is_control()) {
        return Err(EndpointError::Invalid(format!(
            "{what}: expected an absolute HTTP path like {DEFAULT_PATH}, found {raw:?}"
        )));
    }
    Ok(raw.to_string())
}

/// Bounds on one fetch. Every remote step has a deadline, and memory is capped
/// while the body streams in, again while it decompresses, and on what decoding keeps.
#[derive(Debug, Clone)]
pub struct FetchLimits {
    /// Deadline to establish the TCP connection.
    pub connect_timeout: Duration,
    /// Longest wait for the response head or for the next body chunk.
    pub idle_timeout: Duration,
    /// Deadline for the whole exchange (add the delta seconds when using `?seconds=N`).
    pub total_timeout: Duration,
    /// Largest response body accepted, in bytes (as received, usually gzipped).
    pub max_body_bytes: u64,
    /// Largest decompressed profile accepted, in bytes.
    pub max_profile_bytes: u64,
    /// Most memory decoding one profile may keep, in bytes: the inflated protobuf plus the
    /// structures it decodes into, judged before they are allocated
    /// ([`flamefleet_pprof::DecodeLimits::max_kept_bytes`]).
    pub max_kept_bytes: u64,
}

impl Default for FetchLimits {
    /// Generous for real heap profiles (Go's are tens to hundreds of KiB
    /// gzipped), small enough that a hostile endpoint costs little.
    fn default() -> Self {
        FetchLimits {
            connect_timeout: Duration::from_secs(3),
            idle_timeout: Duration::from_secs(10),
            total_timeout: Duration::from_secs(30),
            max_body_bytes: 64 << 20,
            max_profile_bytes: 256 << 20,
            // With the body (64 MiB at most) this keeps one fetch under 192 MiB of the
            // chart's 512 MiB agent limit; real profiles decode into a few MiB.
            max_kept_bytes: 128 << 20,
        }
    }
}

/// Fetches, decompresses, decodes and validates the heap profile at `endpoint`.
pub async fn fetch_profile(
    endpoint: &HeapEndpoint,
    limits: &FetchLimits,
) -> Result<Profile, EndpointError> {
    let name = endpoint.to_string();
    let body = match tokio::time::timeout(limits.total_timeout, fetch_body(endpoint, limits)).await
    {
        Ok(r) => r?,
        Err(_) => {
            return Err(EndpointError::Timeout {
                endpoint: name,
                what: "whole request",
                limit: limits.total_timeout,
            });
        }
    };
    let decode = DecodeLimits {
        max_decompressed_bytes: limits.max_profile_bytes,
        max_kept_bytes: limits.max_kept_bytes,
    };
    // Decompressing and decoding up to hundreds of MiB is CPU work: keep it off the reactor.
    tokio::task::spawn_blocking(move || decode_profile(&body, &decode, &name))
        .await
        .map_err(|e| EndpointError::Http {
            endpoint: endpoint.to_string(),
            reason: format!("decoder task failed: {e}"),
        })?
}

/// Aborts the spawned connection driver when the fetch ends, whichever way.
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

async fn fetch_body(endpoint: &HeapEndpoint, limits: &FetchLimits) -> Result<Bytes, EndpointError> {
    let name = endpoint.to_string();
    let stream = connect(endpoint, limits.connect_timeout).await?;
    let http_err = |e: hyper::Error| EndpointError::Http {
        endpoint: name.clone(),
        reason: e.to_string(),
    };
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .map_err(http_err)?;
    let _driver = AbortOnDrop(tokio::spawn(async move {
        // Errors surface through the request future; nothing to report here.
        let _ = conn.await;
    }));
    let authority = if endpoint.host.contains(':') {
        format!("[{}]:{}", endpoint.host, endpoint.port)
    } else {
        format!("{}:{}", endpoint.host, endpoint.port)
    };
    let request = hyper::Request::get(endpoint.path.as_str())
        .header(hyper::header::HOST, authority)
        .header(hyper::header::USER_AGENT, "flamefleet-agent")
        .header(hyper::header::ACCEPT, "application/octet-stream, */*")
        .body(http_body_util::Empty::<Bytes>::new())
        .map_err(|e| EndpointError::Invalid(format!("cannot build a request for {name}: {e}")))?;
    let response =
        match tokio::time::timeout(limits.idle_timeout, sender.send_request(request)).await {
            Ok(r) => r.map_err(http_err)?,
            Err(_) => {
                return Err(EndpointError::Timeout {
                    endpoint: name,
                    what: "waiting for the response head",
                    limit: limits.idle_timeout,
                });
            }
        };
    let status = response.status();
    let too_large = || EndpointError::TooLarge {
        endpoint: name.clone(),
        limit: limits.max_body_bytes,
    };
    let declared_len = response
        .headers()
        .get(hyper::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if status.is_success() && declared_len.is_some_and(|n| n > limits.max_body_bytes) {
        return Err(too_large());
    }
    // For an error status keep only a short excerpt for the message.
    let cap = if status == hyper::StatusCode::OK {
        limits.max_body_bytes
    } else {
        512
    };
    let mut body = response.into_body();
    let mut buf: Vec<u8> = Vec::new();
    loop {
        let frame = match tokio::time::timeout(limits.idle_timeout, body.frame()).await {
            Ok(Some(f)) => f.map_err(http_err)?,
            Ok(None) => break,
            Err(_) => {
                return Err(EndpointError::Timeout {
                    endpoint: name,
                    what: "no body bytes received",
                    limit: limits.idle_timeout,
                });
            }
        };
        if let Ok(data) = frame.into_data() {
            if (buf.len() + data.len()) as u64 > cap {
                if status != hyper::StatusCode::OK {
                    let room = (cap as usize).saturating_sub(buf.len());
                    buf.extend_from_slice(&data[..room.min(data.len())]);
                    break;
                }
                return Err(too_large());
            }
            buf.extend_from_slice(&data);
        }
    }
    if status != hyper::StatusCode::OK {
        return Err(EndpointError::Status {
            endpoint: name,
            status: status.as_u16(),
            body: preview(&buf),
        });
    }
    Ok(Bytes::from(buf))
}

/// Opens the TCP connection, from the target's network namespace if asked.
async fn connect(
    endpoint: &HeapEndpoint,
    timeout: Duration,
) -> Result<tokio::net::TcpStream, EndpointError> {
    let name = endpoint.to_string();
    let connect_err = |reason: String| EndpointError::Connect {
        endpoint: name.clone(),
        reason,
    };
    let Some(pid) = endpoint.netns_pid else {
        return match tokio::time::timeout(
            timeout,
            tokio::net::TcpStream::connect((endpoint.host.as_str(), endpoint.port)),
        )
        .await
        {
            Ok(r) => r.map_err(|e| connect_err(e.to_string())),
            Err(_) => Err(EndpointError::Timeout {
                endpoint: name.clone(),
                what: "connecting",
                limit: timeout,
            }),
        };
    };
    // A socket belongs to the namespace it was created in: create it on a
    // short-lived thread that joined the target's namespace, then use it here.
    let addr: SocketAddr = format!("{}:{}", endpoint.host, endpoint.port)
        .parse()
        .or_else(|_| format!("[{}]:{}", endpoint.host, endpoint.port).parse())
        .map_err(|_| {
            EndpointError::Invalid(format!(
                "expected an IP address to dial inside the network namespace of pid {pid}, found \
                 host {:?}",
                endpoint.host
            ))
        })?;
    let std_stream = tokio::task::spawn_blocking(move || dial_in_netns(pid, addr, timeout))
        .await
        .map_err(|e| connect_err(format!("dialer thread failed: {e}")))?
        .map_err(connect_err)?;
    std_stream
        .set_nonblocking(true)
        .map_err(|e| connect_err(e.to_string()))?;
    tokio::net::TcpStream::from_std(std_stream).map_err(|e| connect_err(e.to_string()))
}

/// Connects to `addr` from inside the network namespace of `pid`. Runs on a
/// thread of its own that exits right after, so no other work sees the namespace.
fn dial_in_netns(
    pid: u32,
    addr: SocketAddr,
    timeout: Duration,
) -> Result<std::net::TcpStream, String> {
    let path = format!("/proc/{pid}/ns/net");
    let ns = std::fs::File::open(&path).map_err(|e| {
        format!("cannot open {path} ({e}); is pid {pid} alive and are we root (CAP_SYS_ADMIN)?")
    })?;
    std::thread::scope(|s| {
        s.spawn(|| {
            nix::sched::setns(ns.as_fd(), nix::sched::CloneFlags::CLONE_NEWNET).map_err(|e| {
                format!("cannot enter the network namespace of pid {pid} ({e}); run as root")
            })?;
            std::net::TcpStream::connect_timeout(&addr, timeout).map_err(|e| e.to_string())
        })
        .join()
        .map_err(|_| "dialer thread panicked".to_string())?
    })
}

/// Decompresses (if gzipped, under `limits.max_decompressed_bytes`), decodes (keeping at
/// most `limits.max_kept_bytes`) and validates a profile, with the kit's bounded decoder.
pub fn decode_profile(
    body: &[u8],
    limits: &DecodeLimits,
    endpoint: &str,
) -> Result<Profile, EndpointError> {
    flamefleet_pprof::decode_with(body, limits).map_err(|e| {
        let endpoint = endpoint.to_string();
        match e {
            flamefleet_pprof::Error::TooLargeDecompressed { limit } => {
                EndpointError::TooLargeDecompressed { endpoint, limit }
            }
            flamefleet_pprof::Error::TooLargeDecoded { needed, limit, .. } => {
                EndpointError::TooLargeDecoded {
                    endpoint,
                    needed,
                    limit,
                }
            }
            other => EndpointError::NotPprof {
                endpoint,
                reason: match other {
                    flamefleet_pprof::Error::Empty => "the body is empty".into(),
                    other => other.to_string(),
                },
                preview: preview(body),
            },
        }
    })
}

/// A printable excerpt of a body, for error messages.
fn preview(body: &[u8]) -> String {
    let head = &body[..body.len().min(64)];
    String::from_utf8_lossy(head)
        .chars()
        .map(|c| if c.is_control() { '.' } else { c })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn annotations(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn explicit_url_wins_over_annotations() {
        let a = annotations(&[(ANNOTATION_PORT, "7000")]);
        let r =
            resolve_endpoint(Some("http://10.1.2.3:7676/profile/heap"), &a, "10.0.0.9").unwrap();
        assert_eq!(r.origin, EndpointOrigin::Explicit);
        assert_eq!(r.endpoint.host, "10.1.2.3");
        assert_eq!(r.endpoint.port, 7676);
        assert_eq!(r.endpoint.path, "/profile/heap");
    }

    #[test]
    fn annotations_give_port_and_path() {
        let a = annotations(&[
            (ANNOTATION_PORT, " 7676 "),
            (ANNOTATION_PATH, "/profile/heap"),
        ]);
        let r = resolve_endpoint(None, &a, "10.0.0.9").unwrap();
        assert_eq!(r.origin, EndpointOrigin::Annotations);
        assert!(r.origin.is_declared());
        assert_eq!(r.endpoint.to_string(), "http://10.0.0.9:7676/profile/heap");
    }

    #[test]
    fn a_lone_annotation_fills_in_the_other_default() {
        let r =
            resolve_endpoint(None, &annotations(&[(ANNOTATION_PORT, "8080")]), "10.0.0.9").unwrap();
        assert_eq!(r.endpoint.path, DEFAULT_PATH);
        assert_eq!(r.origin, EndpointOrigin::Annotations);
        let r =
            resolve_endpoint(None, &annotations(&[(ANNOTATION_PATH, "/heap")]), "fd00::1").unwrap();
        assert_eq!(r.endpoint.port, DEFAULT_PORT);
        assert_eq!(r.endpoint.to_string(), "http://[fd00::1]:6060/heap");
    }

    #[test]
    fn no_declaration_gives_defaults_not_declared() {
        let r = resolve_endpoint(Some("  "), &annotations(&[("other", "x")]), "10.0.0.9").unwrap();
        assert_eq!(r.origin, EndpointOrigin::Defaults);
        assert!(!r.origin.is_declared());
        assert_eq!(
            r.endpoint.to_string(),
            "http://10.0.0.9:6060/debug/pprof/heap"
        );
    }

    #[test]
    fn bad_annotations_and_urls_are_explained() {
        for port in ["abc", "0", "70000", "-1", ""] {
            let e = resolve_endpoint(None, &annotations(&[(ANNOTATION_PORT, port)]), "10.0.0.9")
                .unwrap_err();
            assert!(e.to_string().contains(ANNOTATION_PORT), "{e}");
        }
        let e = resolve_endpoint(None, &annotations(&[(ANNOTATION_PATH, "heap")]), "10.0.0.9")
            .unwrap_err();
        assert!(e.to_string().contains("absolute HTTP path"), "{e}");
        let e = resolve_endpoint(Some("https://x:1/heap"), &BTreeMap::new(), "h").unwrap_err();
        assert!(e.to_string().contains("plain HTTP"), "{e}");
        let e = resolve_endpoint(Some("/heap"), &BTreeMap::new(), "h").unwrap_err();
        assert!(e.to_string().contains("absolute http://"), "{e}");
        let e = resolve_endpoint(None, &BTreeMap::new(), "").unwrap_err();
        assert!(e.to_string().contains("no IP address"), "{e}");
    }

    #[test]
    fn delta_form_appends_seconds_once() {
        let e = HeapEndpoint::parse_url("http://h:1/debug/pprof/heap").unwrap();
        assert_eq!(
            e.clone().with_delta_seconds(5).path,
            "/debug/pprof/heap?seconds=5"
        );
        let e = HeapEndpoint::parse_url("http://h:1/heap?gc=1").unwrap();
        assert_eq!(e.clone().with_delta_seconds(5).path, "/heap?gc=1&seconds=5");
        assert_eq!(e.clone().with_delta_seconds(0).path, "/heap?gc=1");
        let e = HeapEndpoint::parse_url("http://h:1/heap?seconds=2").unwrap();
        assert_eq!(e.with_delta_seconds(5).path, "/heap?seconds=2");
    }

    #[test]
    fn zip_bombs_are_refused_before_they_grow() {
        use std::io::Write;
        let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
        let zeros = vec![0u8; 1 << 20];
        for _ in 0..64 {
            gz.write_all(&zeros).unwrap();
        }
        let bomb = gz.finish().unwrap();
        let limits = DecodeLimits {
            max_decompressed_bytes: 8 << 20,
            ..DecodeLimits::default()
        };
        let e = decode_profile(&bomb, &limits, "test").unwrap_err();
        assert!(
            matches!(e, EndpointError::TooLargeDecompressed { .. }),
            "{e}"
        );
        let e = decode_profile(b"<html>nope</html>", &limits, "test").unwrap_err();
        assert!(e.to_string().contains("<html>nope"), "{e}");
    }
}
